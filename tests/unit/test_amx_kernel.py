"""The prompt route's AMX bfloat16 kernel (kernels/gemm/amx_gemm.cpp: pack_bf16, bf16_linear) and
its row ranges (model/prompt_route.py): close to its twin, a float64 product of the same
bfloat16-rounded operands, on shapes at tile edges and odd K; a row's output bitwise the same
whatever its row count, its place in a tile and the thread count; bad input raises. The kernel
runs where the CPU has AMX-BF16 (`lscpu`: amx_bf16), so its tests skip elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import torch_threads

from conveyor.model import prompt_route

# (N, K): one tile, a row past it, odd sizes, the default model's projections.
SHAPES = [(16, 32), (17, 33), (50, 70), (3, 1), (960, 576), (576, 1536)]
ROWS = [1, 15, 16, 17, 31, 32, 33, 70]


@pytest.fixture
def amx(ops):
    if not ops.amx_available():
        pytest.skip("no AMX-BF16 here (or the kernel plan narrows it)")
    return ops


def twin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T in float64 of the operands as the kernel rounds them (bfloat16, nearest even)."""
    return x.bfloat16().double() @ w.bfloat16().double().T


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_its_twin(amx, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    packed = amx.pack_bf16(w)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        y = amx.bf16_linear(x, packed, n)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        want = twin(x, w)
        # float32 sums of exact bfloat16 products: a few float32 roundings of the total
        error = (y.double() - want).abs().max().item()
        assert error <= 1e-5 * max(1.0, want.abs().max().item()), (shape, rows, error)


@pytest.mark.parametrize("shape", [(50, 70), (960, 576)])
def test_a_row_is_the_same_bits_alone_in_any_batch_and_thread_count(amx, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(n, k, generator=gen), torch.randn(70, k, generator=gen)
    packed = amx.pack_bf16(w)
    with torch_threads(2):
        full = amx.bf16_linear(x, packed, n)
    for threads in (1, 2):
        with torch_threads(threads):
            for start, rows in [(0, 1), (5, 1), (3, 17), (16, 33), (37, 33), (0, 70)]:
                part = amx.bf16_linear(x[start : start + rows].contiguous(), packed, n)
                assert torch.equal(part, full[start : start + rows]), (threads, start, rows)


@pytest.mark.parametrize("inner, k", [(16, 32), (48, 70), (256, 576), (1536, 576)])
def test_silu_fused_on_the_tiles_is_the_bits_of_the_product_then_silu(amx, inner, k):
    """bf16_silu_mul (the prompt rows' MLP activation straight from the gate/up tiles' sums)
    gives silu_and_mul(bf16_linear(...)) bit for bit, at any row count and thread count: a step
    with a LoRA adapter in it runs the unfused pair for every row, so a prompt row's bits must
    not depend on which one ran."""
    gen = torch.Generator().manual_seed(inner + k)
    w = torch.randn(2 * inner, k, generator=gen) * 0.2
    packed = amx.pack_bf16(w)
    for threads in (1, 2):
        with torch_threads(threads):
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                want = amx.silu_and_mul(amx.bf16_linear(x, packed, 2 * inner))
                got = amx.bf16_silu_mul(x, packed, inner)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, threads)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        amx.bf16_silu_mul(torch.randn(2, k), amx.pack_bf16(torch.randn(40, k)), 20)


def test_no_rows_and_bad_input(amx):
    w = torch.randn(20, 40)
    packed = amx.pack_bf16(w)
    assert amx.bf16_linear(torch.empty(0, 40), packed, 20).shape == (0, 20)
    with pytest.raises(RuntimeError, match="columns"):
        amx.bf16_linear(torch.randn(3, 72), packed, 20)
    with pytest.raises(RuntimeError, match="n_out"):
        amx.bf16_linear(torch.randn(3, 40), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        amx.bf16_linear(torch.randn(3, 40, dtype=torch.float64), packed, 20)
    with pytest.raises(RuntimeError, match="packed"):
        amx.bf16_linear(torch.randn(3, 40), w, 20)
    with pytest.raises(RuntimeError, match="float32 weight"):
        amx.pack_bf16(w.double())


def test_prompt_rows_of_a_step():
    """Each request's leading rows below its prompt length, joined where adjacent."""
    query_lens = np.array([1, 5, 4, 1, 3])
    context_lens = np.array([20, 0, 8, 3, 10])
    num_prompt = np.array([10, 5, 10, 4, -1])  # -1: none (a request without a prompt length)
    counts = prompt_route.prompt_tokens(query_lens, context_lens, num_prompt)
    assert counts.tolist() == [0, 5, 2, 1, 0]
    # rows: r0 | r1..r5 prompt | r6, r7 prompt, r8, r9 | r10 prompt | r11..r13
    assert prompt_route.row_ranges(query_lens, counts) == [1, 8, 10, 11]
    assert prompt_route.row_ranges(np.array([4]), np.array([0])) == []
    assert prompt_route.row_ranges(np.array([3, 2]), np.array([3, 2])) == [0, 5]
