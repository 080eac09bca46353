"""The compiled gated delta rule (kernels/layer/deltanet.cpp) against its PyTorch twin
(model/recurrent.py delta_rule_reference): the same outputs and states within rounding, in
float64 and float32, for value dims on the register blocks' path (64, 128) and off it (8, 16),
one key head serving several value heads; and its batch invariance: a sequence's outputs and
state are the same bits run alone or beside others, and in one call of L steps or L calls of
one."""

from __future__ import annotations

import pytest
import torch

from conveyor.model import kernels
from conveyor.model.recurrent import causal_conv_reference, delta_rule_reference

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the compiled CPU kernels are unavailable")


def inputs(steps, n, key_heads, heads, dk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    mixed = rand(steps, n, 2 * key_heads * dk + heads * dv)
    a, b = rand(steps, n, heads, scale=3.0), rand(steps, n, heads, scale=3.0)
    z = rand(steps, n, heads, dv)
    fixed = (rand(heads, scale=0.5), rand(heads), 1.0 + rand(dv, scale=0.2), 1e-6, key_heads)
    state = rand(n + 2, heads, dk, dv, scale=0.3)
    return state, (mixed, a, b, z), fixed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dk,dv", [(16, 64), (8, 128), (32, 16), (8, 8)])
def test_compiled_rule_equals_its_reference(dtype, dk, dv):
    state, args, fixed = inputs(5, 3, 2, 4, dk, dv, dtype)
    slots = torch.tensor([4, 0, 2])
    ref_state, out_state = state.clone(), state.clone()
    expected = delta_rule_reference(ref_state, slots, *args, *fixed)
    got = ops.gated_delta_rule(out_state, slots, *args, *fixed)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(out_state, ref_state, **tol)
    assert torch.equal(out_state[[1, 3]], state[[1, 3]])  # other slots untouched


@pytest.mark.parametrize("dk,dv", [(16, 64), (8, 8)])
def test_a_sequence_is_the_same_bits_alone_batched_and_step_by_step(dk, dv):
    state, (mixed, a, b, z), fixed = inputs(6, 4, 1, 2, dk, dv, torch.float32, seed=1)
    slots = torch.tensor([1, 3, 0, 2])
    together = state.clone()
    out = ops.gated_delta_rule(together, slots, mixed, a, b, z, *fixed)
    for s in range(4):  # alone, one step per call
        alone = state.clone()
        for t in range(6):
            step = [x[t : t + 1, s : s + 1] for x in (mixed, a, b, z)]
            got = ops.gated_delta_rule(alone, slots[s : s + 1], *step, *fixed)
            assert torch.equal(got[0, 0], out[t, s])
        assert torch.equal(alone[slots[s]], together[slots[s]])


def test_bad_shapes_are_a_clear_error():
    state, (mixed, a, b, z), fixed = inputs(2, 1, 1, 2, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="slots"):
        ops.gated_delta_rule(state, torch.tensor([0, 1]), mixed, a, b, z, *fixed)
    with pytest.raises(RuntimeError, match="every tensor of the state's dtype"):
        ops.gated_delta_rule(state, torch.tensor([0]), mixed.double(), a, b, z, *fixed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_compiled_convolution_equals_its_reference_and_is_chunking_invariant(dtype):
    """Three sequences of 5, 1 and 7 rows in one call: the reference's outputs and kept
    inputs; each sequence's rows one call at a time: the same bits."""
    g = torch.Generator().manual_seed(2)
    channels, kernel, starts = 80, 4, [0, 5, 6, 13]
    x = torch.randn(13, channels, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(channels, kernel, generator=g, dtype=torch.float64).to(dtype)
    state = torch.randn(5, channels, kernel - 1, generator=g, dtype=torch.float64).to(dtype)
    slots = torch.tensor([3, 0, 1])
    ref_state, got_state = state.clone(), state.clone()
    expected = causal_conv_reference(ref_state, slots, starts, x, weight)
    got = ops.causal_conv(got_state, slots, starts, x, weight)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got_state, ref_state)  # the kept inputs are copies
    stepwise = state.clone()
    for s in range(3):
        for row in range(starts[s], starts[s + 1]):
            one = ops.causal_conv(stepwise, slots[s : s + 1], [0, 1], x[row : row + 1], weight)
            assert torch.equal(one[0], got[row])
    assert torch.equal(stepwise, got_state)
