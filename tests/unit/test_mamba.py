"""The compiled Mamba2 scan (kernels/layer/mamba.cpp mamba2_mix) against its PyTorch twin
(model/recurrent.py mamba2_reference): the same outputs and states within rounding, in float64
and float32, for state sizes on the vector path (16, 128) and off it (6), one group and several,
a clamped time step; and its batch invariance: a sequence's outputs and state are the same bits
run alone or beside others, in one call of its rows or one call per row."""

from __future__ import annotations

import pytest
import torch

from conveyor.model import kernels
from conveyor.model.recurrent import mamba2_reference

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the compiled CPU kernels are unavailable")


def inputs(rows, num_slots, heads, head_dim, groups, size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    inner = heads * head_dim
    conv = rand(rows, inner + 2 * groups * size)
    dt, z = rand(rows, heads, scale=2.0), rand(rows, inner)
    fixed = (rand(heads, scale=0.5), rand(heads), 1.0 + rand(heads, scale=0.2))
    weights = (1.0 + rand(inner, scale=0.2), 1e-6, groups)
    state = rand(num_slots, heads, head_dim, size, scale=0.3)
    return state, conv, rand(conv.shape[1], scale=0.3), dt, z, fixed, weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "heads,head_dim,groups,size,limit",
    [(4, 16, 1, 128, (0.0, float("inf"))), (8, 8, 2, 16, (0.01, 0.5)), (6, 4, 3, 6, (0.0, 2.0))],
)
def test_compiled_scan_equals_its_reference(dtype, heads, head_dim, groups, size, limit):
    """Three sequences of 5, 1 and 3 rows in slots 4, 0 and 2 of 5."""
    state, conv, bias, dt, z, fixed, weights = inputs(9, 5, heads, head_dim, groups, size, dtype)
    slots, starts = torch.tensor([4, 0, 2]), [0, 5, 6, 9]
    ref_state, got_state = state.clone(), state.clone()
    args = (conv, bias, dt, z, *fixed, *weights, *limit)
    expected = mamba2_reference(ref_state, slots, starts, *args)
    got = ops.mamba2_mix(got_state, slots, starts, *args)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(got_state, ref_state, **tol)
    assert torch.equal(got_state[[1, 3]], state[[1, 3]])  # other slots untouched


@pytest.mark.parametrize("size", [16, 6])
def test_a_sequence_is_the_same_bits_alone_batched_and_row_by_row(size):
    state, conv, bias, dt, z, fixed, weights = inputs(12, 4, 4, 8, 2, size, torch.float32, 1)
    slots, starts = torch.tensor([1, 3, 0, 2]), [0, 6, 7, 10, 12]
    together = state.clone()
    out = ops.mamba2_mix(together, slots, starts, conv, bias, dt, z, *fixed, *weights, 0.0, 9.0)
    for s in range(4):
        alone, stepwise = state.clone(), state.clone()
        rows = slice(starts[s], starts[s + 1])
        one = ops.mamba2_mix(
            alone, slots[s : s + 1], [0, rows.stop - rows.start], conv[rows], bias, dt[rows],
            z[rows], *fixed, *weights, 0.0, 9.0,
        )  # fmt: skip
        assert torch.equal(one, out[rows])
        for r in range(rows.start, rows.stop):
            got = ops.mamba2_mix(
                stepwise, slots[s : s + 1], [0, 1], conv[r : r + 1], bias, dt[r : r + 1],
                z[r : r + 1], *fixed, *weights, 0.0, 9.0,
            )  # fmt: skip
            assert torch.equal(got[0], out[r])
        assert torch.equal(alone[slots[s]], together[slots[s]])
        assert torch.equal(stepwise[slots[s]], together[slots[s]])


def test_bad_shapes_are_a_clear_error():
    state, conv, bias, dt, z, fixed, weights = inputs(3, 2, 4, 8, 2, 16, torch.float32)
    limit = (0.0, float("inf"))
    with pytest.raises(RuntimeError, match="slots"):
        ops.mamba2_mix(state, torch.tensor([0, 1]), [0, 3], conv, bias, dt, z, *fixed, *weights,
                       *limit)  # fmt: skip
    with pytest.raises(RuntimeError, match="every tensor of the state's dtype"):
        ops.mamba2_mix(state, torch.tensor([0]), [0, 3], conv.double(), bias, dt, z, *fixed,
                       *weights, *limit)  # fmt: skip
    with pytest.raises(RuntimeError, match="groups divide the heads"):
        ops.mamba2_mix(state, torch.tensor([0]), [0, 3], conv, bias, dt, z, *fixed, weights[0],
                       1e-6, 3, *limit)  # fmt: skip
