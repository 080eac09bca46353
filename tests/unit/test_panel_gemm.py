"""The batch-invariant panel kernels (kernels/gemm/panel_gemm.cpp) and paged attention without key
splits: close to a float64 reference, and bitwise the same for a row whatever else shares its
call (alone, in any slice, in another order), on every instruction set this CPU runs and on
one or two threads. Bad input raises instead of crashing."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import torch_threads

from conveyor.model import quant
from conveyor.model.quant import BlockWeight

# N: never a multiple of 16 (or 8), so every call has a padded panel; K: one block up to the
# default model's hidden size; T: one row, tails of every token tile, several tiles.
SHAPES = [(13, 32), (37, 64), (100, 96), (201, 576)]
TOKENS = (1, 2, 5, 17, 70, 130)
ISAS = ("avx512", "avx2", "scalar")
QUANTIZERS = {"q4": quant.quantize_q4, "q8": quant.quantize_q8}
# Worst |error| / max |reference| measured over random shapes: float32 1.1e-6, float64 1e-15,
# blocks 3e-7 (int8 activations) and 9.5e-7 (float activations).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-13, "blocks": 1e-5}


@pytest.fixture(autouse=True)
def auto_isa(ops):
    """Every test starts and ends on the best instruction set, whatever it switched to."""
    ops.set_isa("auto")
    yield
    ops.set_isa("auto")


@pytest.fixture(scope="module")
def isas(ops):
    """The instruction sets this CPU and build run (set_isa refuses the others)."""
    found = []
    try:
        for name in ISAS:
            try:
                found.append(ops.set_isa(name))
            except RuntimeError:
                continue
    finally:
        ops.set_isa("auto")
    assert "scalar" in found and ops.isa() == found[0]
    return found


# ---- helpers -------------------------------------------------------------------------------


class Dense:
    def __init__(self, ops, weight: torch.Tensor) -> None:
        self.ops, self.weight = ops, weight
        self.panels = ops.pack_dense(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.dense_linear(x, self.panels, self.weight.shape[0])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() @ self.weight.double().T


class Blocks:
    def __init__(self, ops, weight: BlockWeight, float_acts: bool) -> None:
        self.ops, self.weight, self.float_acts = ops, weight, float_acts
        self.wq, self.dw, self.mw = ops.pack_blocks(weight.qs, weight.d, weight.m, float_acts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n_out = self.weight.shape[0]
        return self.ops.block_linear(x, self.wq, self.dw, self.mw, n_out, self.float_acts)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_acts:
            return x.double() @ self.weight.dequantize().double().T
        return int8_reference(x, self.weight)


def int8_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """The int8-activation reference (quant.reference_linear: round(x * (127 / max|x|)) per
    block of 32, times the dequantized weight, in float64)."""
    return quant.reference_linear(x, weight)


def make_op(ops, kind: str, n: int, k: int, seed: int = 0):
    """kind: float32 | float64 | q4 | q8 | q4-float | q8-float -> (op, activation dtype)."""
    gen = torch.Generator().manual_seed(seed * 1009 + n * 31 + k)
    if kind in ("float32", "float64"):
        dtype = getattr(torch, kind)
        return Dense(ops, torch.randn(n, k, generator=gen, dtype=dtype)), dtype
    fmt, _, acts = kind.partition("-")
    weight = QUANTIZERS[fmt](torch.randn(n, k, generator=gen) * 0.05)
    return Blocks(ops, weight, acts == "float"), torch.float32


def random_x(t: int, k: int, dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + t * 131 + k)
    x = torch.randn(t, k, generator=gen, dtype=dtype) * 3
    if t > 3:
        x[3, : min(k, 40)] = 0.0  # a zero block (scale 0) and a row that is partly zero
    return x


KINDS = ["float32", "float64", "q4", "q8", "q4-float", "q8-float"]


def assert_rows_invariant(op, x: torch.Tensor, full: torch.Tensor, seed: int = 0) -> None:
    """Every row alone, arbitrary slices, and the rows in another order give the same bits."""
    t = x.shape[0]
    for i in range(t):
        assert torch.equal(op(x[i : i + 1]), full[i : i + 1]), f"row {i} alone differs"
    rng = random.Random(seed)
    for _ in range(12):
        a = rng.randrange(0, t)
        b = rng.randrange(a + 1, t + 1)
        assert torch.equal(op(x[a:b]), full[a:b]), f"rows [{a}:{b}) differ"
    order = torch.randperm(t, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(op(x[order]), full[order]), "rows in another order differ"
    if t > 1:  # a strided (non-contiguous) view of every other row
        assert torch.equal(op(x[::2]), full[::2])


# ---- (a) close to the float64 reference ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_panel_linear_is_close_to_the_float64_reference(ops, kind, shape):
    n, k = shape
    op, dtype = make_op(ops, kind, n, k)
    tolerance = TOLERANCE.get(dtype if kind.startswith("float") else "blocks")
    for t in TOKENS:
        x = random_x(t, k, dtype)
        out = op(x)
        assert out.shape == (t, n) and out.dtype == dtype
        ref = op.reference(x)
        worst = (out.double() - ref).abs().max().item()
        assert worst <= tolerance * ref.abs().max().item(), f"T={t}: max abs error {worst}"


def test_dense_float64_panels_hold_eight_columns(ops):
    """64-byte panels: 16 float32 or 8 float64 columns, zero-padded beyond N."""
    for dtype, lanes in ((torch.float32, 16), (torch.float64, 8)):
        weight = torch.randn(19, 40, dtype=dtype)
        panels = ops.pack_dense(weight)
        assert panels.shape == (-(-19 // lanes), 40, lanes)
        assert torch.equal(panels.transpose(1, 2).reshape(-1, 40)[:19], weight)
        assert panels.transpose(1, 2).reshape(-1, 40)[19:].count_nonzero() == 0


def test_zero_rows_and_zero_outputs(ops):
    op, _ = make_op(ops, "q4", 37, 64)
    assert op(torch.empty(0, 64)).shape == (0, 37)
    dense, _ = make_op(ops, "float32", 37, 64)
    assert dense(torch.empty(0, 64)).shape == (0, 37)
    assert ops.dense_linear(torch.randn(3, 64), dense.panels, 0).shape == (3, 0)
    # A row of zeros: every block's activation scale is 0, so a q8 output is exactly 0.
    q8, _ = make_op(ops, "q8", 37, 64)
    assert q8(torch.zeros(2, 64)).count_nonzero() == 0


# ---- (b) a row's result does not depend on the other rows ----------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_each_row_is_the_same_alone_in_any_slice_and_any_order(ops, kind, shape):
    n, k = shape
    op, dtype = make_op(ops, kind, n, k, seed=1)
    x = random_x(130, k, dtype, seed=1)
    full = op(x)
    assert_rows_invariant(op, x, full, seed=n)
    # The same rows inside a larger batch of other rows, at another offset.
    others = random_x(70, k, dtype, seed=2)
    mixed = op(torch.cat((others[:33], x, others[33:])))
    assert torch.equal(mixed[33 : 33 + 130], full)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_do_not_depend_on_the_thread_count(ops, kind):
    op, dtype = make_op(ops, kind, 201, 576, seed=3)
    x = random_x(70, 576, dtype, seed=3)
    with torch_threads(2):
        two = op(x)
    for threads in (1, 3):
        with torch_threads(threads):
            assert torch.equal(op(x), two), f"{threads} threads"
            assert torch.equal(op(x[5:6]), two[5:6])


# ---- (c) every instruction set gives the same bits -----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_gives_the_same_bits(ops, isas, kind):
    if len(isas) == 1:
        pytest.skip("this CPU runs the scalar path only")
    cases = []
    for n, k in SHAPES:
        op, dtype = make_op(ops, kind, n, k, seed=4)
        for t in TOKENS:
            cases.append((op, random_x(t, k, dtype, seed=4)))
    results = {}
    try:
        for isa in isas:
            assert ops.set_isa(isa) == isa and ops.isa() == isa
            results[isa] = [op(x) for op, x in cases]
            # And, on this ISA too, a row alone equals the row in the batch.
            op, x = cases[-1]
            full = results[isa][-1]
            for i in (0, 1, 17, 69, 129):
                assert torch.equal(op(x[i : i + 1]), full[i : i + 1]), f"{isa}: row {i}"
    finally:
        ops.set_isa("auto")
    best = results[isas[0]]
    for isa in isas[1:]:
        for index, (a, b) in enumerate(zip(best, results[isa], strict=True)):
            op, x = cases[index]
            assert torch.equal(a, b), f"{isa} differs from {isas[0]}: T={x.shape[0]}"


def test_set_isa_refuses_unknown_names_and_auto_is_the_best(ops, isas):
    with pytest.raises(RuntimeError, match="set_isa"):
        ops.set_isa("sse2")
    assert ops.set_isa("auto") == isas[0] == ops.isa()


def test_peak_rates_run_on_each_instruction_set(ops, isas):
    """kernels.peak_rate (bench step's compute roofs) runs every kind on every instruction set
    (rates, not timings, are asserted: > 0), bf16 dot products only on AVX-512 builds whose
    CPU has them (0 elsewhere), and refuses unknown kinds."""
    kinds = ("f32_fma", "f64_fma", "int8_dot", "bf16_dot")
    try:
        for isa in isas:
            ops.set_isa(isa)
            rate = {kind: ops.peak_rate(kind, 100_000) for kind in kinds}
            assert rate["f32_fma"] > 0 and rate["f64_fma"] > 0 and rate["int8_dot"] > 0, isa
            if isa != "avx512":
                assert rate["bf16_dot"] == 0, isa
    finally:
        ops.set_isa("auto")
    with pytest.raises(RuntimeError, match="peak_rate"):
        ops.peak_rate("fp4_dot", 1000)
    with pytest.raises(RuntimeError, match="peak_rate"):
        ops.peak_rate("f32_fma", 0)


# ---- (d) bad input raises ------------------------------------------------------------------


def test_dense_bad_input_raises(ops):
    weight = torch.randn(37, 64)
    panels = ops.pack_dense(weight)
    bad_calls = {
        "K mismatch": lambda: ops.dense_linear(torch.randn(3, 65), panels, 37),
        "x float64, panels float32": lambda: ops.dense_linear(
            torch.randn(3, 64, dtype=torch.float64), panels, 37
        ),
        "x int32": lambda: ops.dense_linear(torch.ones(3, 64, dtype=torch.int32), panels, 37),
        "x 1-D": lambda: ops.dense_linear(torch.randn(64), panels, 37),
        "n_out beyond the panels": lambda: ops.dense_linear(torch.randn(3, 64), panels, 49),
        "panels not from pack_dense": lambda: ops.dense_linear(torch.randn(3, 64), weight, 37),
        "pack int32": lambda: ops.pack_dense(torch.ones(4, 4, dtype=torch.int32)),
        "pack float16": lambda: ops.pack_dense(torch.ones(4, 4, dtype=torch.float16)),
        "pack 1-D": lambda: ops.pack_dense(torch.ones(4)),
    }
    for what, call in bad_calls.items():
        with pytest.raises((RuntimeError, ValueError)):
            call()
            pytest.fail(f"{what}: no error")
    # Still working afterwards.
    out = ops.dense_linear(torch.ones(1, 64), panels, 37)[0]
    assert (out - weight.sum(1)).abs().max() < 1e-4


def test_block_bad_input_raises(ops):
    q4 = quant.quantize_q4(torch.randn(37, 96))
    q8 = quant.quantize_q8(torch.randn(37, 96))
    wq, dw, mw = ops.pack_blocks(q4.qs, q4.d, q4.m)
    wq8, dw8, mw8 = ops.pack_blocks(q8.qs, q8.d)
    assert mw8.numel() == 0
    x = torch.randn(3, 96)
    bad_calls = {
        "K mismatch": lambda: ops.block_linear(torch.randn(3, 64), wq, dw, mw, 37),
        "K not a multiple of 32": lambda: ops.block_linear(torch.randn(3, 100), wq, dw, mw, 37),
        "x float64": lambda: ops.block_linear(x.double(), wq, dw, mw, 37),
        "x int8": lambda: ops.block_linear(x.to(torch.int8), wq, dw, mw, 37),
        "x 1-D": lambda: ops.block_linear(x[0], wq, dw, mw, 37),
        "n_out beyond the panels": lambda: ops.block_linear(x, wq, dw, mw, 49),
        "q8 panels with a q4 m": lambda: ops.block_linear(x, wq8, dw8, mw, 37),
        "q4 panels without m": lambda: ops.block_linear(x, wq, dw, mw8, 37),
        "scales as float32": lambda: ops.block_linear(x, wq, dw.float(), mw.float(), 37),
        "pack: qs does not fit d": lambda: ops.pack_blocks(q4.qs[:, :16], q4.d, q4.m),
        "pack: q8 qs of a q4 weight": lambda: ops.pack_blocks(q4.qs, q4.d),
        "pack: scales as float32": lambda: ops.pack_blocks(q4.qs, q4.d.float(), q4.m.float()),
        "int8-activation panels read as float-activation ones": lambda: ops.block_linear(
            x, wq, dw, mw, 37, True
        ),
        "float-activation panels read as int8-activation ones": lambda: ops.block_linear(
            x, *ops.pack_blocks(q4.qs, q4.d, q4.m, True), 37, False
        ),
    }
    for what, call in bad_calls.items():
        with pytest.raises((RuntimeError, ValueError)):
            call()
            pytest.fail(f"{what}: no error")
    ref = int8_reference(x, q4)
    assert (ops.block_linear(x, wq, dw, mw, 37).double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("case", ["dw-more-blocks", "m-more-blocks", "qs-float"])
def test_block_shapes_and_dtypes_that_do_not_fit_are_refused(ops, case):
    # Only inputs larger than expected: no out-of-bounds read when the check is missing.
    q4 = quant.quantize_q4(torch.randn(37, 96))
    wide = quant.quantize_q4(torch.randn(37, 192))
    with pytest.raises((RuntimeError, ValueError)):
        if case == "dw-more-blocks":
            wq, _, _ = ops.pack_blocks(q4.qs, q4.d, q4.m)
            _, dw, mw = ops.pack_blocks(wide.qs, wide.d, wide.m)
            ops.block_linear(torch.randn(2, 96), wq, dw, mw, 37)
        elif case == "m-more-blocks":
            ops.pack_blocks(q4.qs, q4.d, wide.m)
        else:
            q8 = quant.quantize_q8(torch.randn(37, 96))
            ops.pack_blocks(q8.qs.float(), q8.d)


def test_reference_linear_rounds_activations_as_the_kernel(ops):
    gen = torch.Generator().manual_seed(8)
    weight = quant.quantize_q8(torch.randn(100, 64, generator=gen) * 0.05)
    x = torch.randn(2000, 64, generator=gen) * 3
    op = Blocks(ops, weight, float_acts=False)
    ref = quant.reference_linear(x, weight)
    worst = (op(x).double() - ref).abs().max().item()
    assert worst <= TOLERANCE["blocks"] * ref.abs().max().item()


# ---- (e) the lm_head's greedy argmax --------------------------------------------------------


class Argmax:
    """block_argmax over one weight: the float-activation panels, the int8 ones and the
    weight's error bounds (quant.error_weights), as QuantLinear.argmax calls it."""

    def __init__(self, ops, weight: BlockWeight) -> None:
        self.ops, self.n = ops, weight.shape[0]
        self.floats = Blocks(ops, weight, float_acts=True)
        self.ints = Blocks(ops, weight, float_acts=False)
        self.wmax = quant.error_weights(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        f = self.floats
        return self.ops.block_argmax(x, f.wq, self.ints.wq, f.dw, f.mw, self.wmax, self.n)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_block_argmax_is_the_float_kernels_argmax(ops, isas, fmt):
    """Each row's argmax equals torch.argmax of block_linear(float_acts=True), on every
    instruction set: over 3,001 columns (a padded panel) and 400 rows the int8 values rank the
    top of some rows differently (asserted, so the candidates the bound keeps are exercised);
    a column duplicated from an earlier one ties with it exactly where a row points at it (the
    first wins, as torch.argmax); a zero row makes every value 0 (column 0)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 3001, 576
    dense = torch.randn(n, k, generator=gen) * 0.05
    dense[2000] = dense[5]
    weight = QUANTIZERS[fmt](dense)
    argmax = Argmax(ops, weight)
    x = torch.randn(400, k, generator=gen) * 3
    x[0] = 0.0
    x[1] = weight.dequantize()[5] * 40  # its maximum: columns 5 and 2000, equal
    expected = argmax.floats(x).argmax(-1)
    assert expected[0] == 0 and expected[1] == 5
    flipped = argmax.ints(x).argmax(-1) != expected
    assert flipped.any(), "no row where int8 values rank the top differently: make ties nearer"
    try:
        for isa in isas:
            ops.set_isa(isa)
            assert torch.equal(argmax(x), expected), f"{isa}: rows {flipped.nonzero().tolist()}"
            assert torch.equal(argmax(x[1:2]), expected[1:2])
    finally:
        ops.set_isa("auto")


def test_block_argmax_marks_rows_that_are_not_finite(ops):
    weight = quant.quantize_q8(torch.randn(37, 64))
    argmax = Argmax(ops, weight)
    x = torch.randn(4, 64)
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    out = argmax(x)
    assert out.tolist()[1:3] == [-1, -1]
    assert out[0] == argmax.floats(x[:1]).argmax(-1)[0] and out[3] >= 0
    with pytest.raises(RuntimeError, match="wmax"):
        argmax.ops.block_argmax(
            x,
            argmax.floats.wq,
            argmax.ints.wq,
            argmax.floats.dw,
            argmax.floats.mw,
            argmax.wmax[:-1],
            37,
        )
    with pytest.raises(RuntimeError, match="float-activation panels"):
        f = argmax.floats
        argmax.ops.block_argmax(x, argmax.ints.wq, argmax.ints.wq, f.dw, f.mw, argmax.wmax, 37)


# ---- paged attention without key splits ----------------------------------------------------


def _attention(ops, q, cache, block_size, steps_of_rows, tables):
    """One paged_attention call over `steps_of_rows`: (context_len, query_rows tensor,
    table index) per sequence; returns the output rows of each sequence."""
    query_lens = [rows.shape[0] for _, rows, _ in steps_of_rows]
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    seq_lens = torch.tensor([c + n for (c, _, _), n in zip(steps_of_rows, query_lens, strict=True)])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    block_tables = padded[[i for _, _, i in steps_of_rows]].contiguous()
    q_all = torch.cat([rows for _, rows, _ in steps_of_rows])
    out = ops.paged_attention(
        q_all, cache, block_size, query_start, seq_lens, block_tables, q.shape[-1] ** -0.5, False
    )
    return list(out.split(query_lens))


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        # A narrow cache: prompt tiles widen it into float32 scratch once, decode rows read it
        # in place; on a Zen 3 the two differed in the last bits until their multiply-adds had
        # one fixed form (isa/vec.h: madd).
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_rows_are_the_same_in_a_prefill_chunks_and_decode_rows(
    ops, dtype, cache_dtype, block_size, head_dim
):
    """A 150-token sequence (GQA 9/3 heads): one prefill, chunks of 37 (one call each, and all
    in one call as separate items), each row as a decode row alone, and all 150 decode rows in
    one call next to another sequence: split_keys=False gives the same bits for every row, with
    a cache of the model's dtype or a narrower one."""
    length, num_heads, num_kv_heads = 150, 9, 3
    gen = torch.Generator().manual_seed(block_size + head_dim)
    needed = -(-length // block_size)
    num_blocks = 2 * needed + 4
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[:needed], ids[needed : 2 * needed]]  # ours, and a neighbour's
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size * head_dim, generator=gen)
    cache = cache.to(cache_dtype)
    q = torch.randn(length, num_heads, head_dim, generator=gen, dtype=dtype)
    other_q = torch.randn(40, num_heads, head_dim, generator=gen, dtype=dtype)
    attend = lambda steps: _attention(ops, q, cache, block_size, steps, tables)  # noqa: E731

    (prefill,) = attend([(0, q, 0)])
    assert prefill.shape == q.shape and torch.isfinite(prefill).all()
    starts = range(0, length, 37)
    chunks = torch.cat([attend([(s, q[s : s + 37], 0)])[0] for s in starts])
    assert torch.equal(chunks, prefill), "chunks of 37 differ from the prefill"
    # All chunks in one call (as a step would hold several requests' chunks), plus a
    # neighbour's prompt chunk and decode row.
    together = attend(
        [(100, other_q[:30], 1), *[(s, q[s : s + 37], 0) for s in starts], (120, other_q[30:31], 1)]
    )
    assert torch.equal(torch.cat(together[1:-1]), prefill), "chunks in one call differ"
    rows = torch.cat([attend([(i, q[i : i + 1], 0)])[0] for i in range(length)])
    assert torch.equal(rows, prefill), "decode rows alone differ from the prefill"
    batched = attend([(i, q[i : i + 1], 0) for i in range(length)] + [(7, other_q[:9], 1)])
    assert torch.equal(torch.cat(batched[:-1]), prefill), "batched decode rows differ"
    # A speculative-style short chunk in the middle.
    (short,) = attend([(77, q[77:81], 0)])
    assert torch.equal(short, prefill[77:81])


def test_attention_decode_rows_on_one_and_two_threads(ops):
    """A long decode row alone (the case split_keys=True would split) on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(5)
    block_size, head_dim, length = 16, 64, 700
    needed = -(-length // block_size)
    tables = [torch.randperm(needed, generator=gen).tolist()]
    cache = torch.randn(2, needed, 3, block_size * head_dim, generator=gen)
    q = torch.randn(length, 9, head_dim, generator=gen)
    (prefill,) = _attention(ops, q, cache, block_size, [(0, q, 0)], tables)
    for threads in (1, 2):
        with torch_threads(threads):
            (row,) = _attention(ops, q, cache, block_size, [(length - 1, q[-1:], 0)], tables)
        assert torch.equal(row, prefill[-1:]), f"{threads} threads"


@pytest.mark.parametrize("kind", ["q4", "q8", "float32"])
def test_a_group_of_calls_gives_each_calls_bits(ops, isas, kind):
    """block_linear_group and dense_linear_group (a mixture of experts' projections in one
    parallel region) equal block_linear / dense_linear call by call, on every instruction set
    and on one and two threads: calls of 0-40 rows (past the AMX tiles' switch point, which a
    block call takes alone), widths off a panel's 16, and a call of the same weights twice."""
    shapes = [(37, 64), (48, 96), (16, 32), (100, 64), (37, 64)]
    calls = [make_op(ops, kind, n, k, seed=s)[0] for s, (n, k) in enumerate(shapes)]
    calls[-1] = calls[0]
    rows = [1, 0, 7, 40, 16]
    xs = [
        random_x(t, op.weight.shape[1], torch.float32, seed=t)
        for t, op in zip(rows, calls, strict=True)
    ]
    if kind == "float32":
        group, panels = ops.dense_linear_group, [op.panels for op in calls]
    else:
        group, panels = ops.block_linear_group, [[op.wq, op.dw, op.mw] for op in calls]
    n_outs = [op.weight.shape[0] for op in calls]
    try:
        for isa in isas:
            ops.set_isa(isa)
            alone = [op(x) for op, x in zip(calls, xs, strict=True)]
            for threads in (1, 2):
                with torch_threads(threads):
                    together = group(xs, panels, n_outs)
                for i, (a, b) in enumerate(zip(alone, together, strict=True)):
                    assert a.shape == b.shape and torch.equal(a, b), f"{isa}, {threads}: call {i}"
    finally:
        ops.set_isa("auto")
    with pytest.raises(RuntimeError, match="as many panels"):
        group(xs, panels[:-1], n_outs)
