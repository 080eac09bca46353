"""Generated rows on AMX-INT8 tiles (kernels/gemm/amx_gemm.cpp: int8_block_linear, the route
block_linear takes from the kernel plan's row count on): the same bits as the panel kernel's
VNNI int8 route on random shapes, at block and tile edges (K of 1, 2, 3, 5 blocks, not a
multiple of the tiles' four-block groups; N not a multiple of 16), at every row count from 1 to
130, on one and two threads, with extreme weights and activations. The route runs where the CPU
has AMX-INT8 (`lscpu`: amx_int8), so these tests skip elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import torch_threads

from conveyor.model import quant
from conveyor.model.quant import BlockWeight

# (N, K): one panel, a padded panel, K of 1, 2, 3, 5 and 18 blocks, the default model's shapes.
SHAPES = [(16, 32), (13, 64), (37, 96), (100, 160), (201, 576), (576, 1536)]
QUANTIZERS = {"q4": quant.quantize_q4, "q8": quant.quantize_q8}


@pytest.fixture
def amx8(ops):
    if not ops.cpu_features()["amx_int8"]:
        pytest.skip("no AMX-INT8 here (`lscpu`: amx_int8), or the OS refuses the tile state")
    if not ops.amx_available():
        pytest.skip("the kernel plan in force keeps the AMX tiles off")
    before = ops.amx_int8_from()
    ops.set_isa("auto")
    yield ops
    ops.set_amx_int8_from(before)


class Routes:
    """One weight packed for the panels, run through either route of block_linear."""

    def __init__(self, ops, weight: BlockWeight) -> None:
        self.ops, self.n = ops, weight.shape[0]
        self.panels = ops.pack_blocks(weight.qs, weight.d, weight.m, False)

    def run(self, x: torch.Tensor, tiles: bool) -> torch.Tensor:
        self.ops.set_amx_int8_from(1 if tiles else 0)
        runs = self.ops.kernel_runs()["amx/int8_blocks"]
        y = self.ops.block_linear(x, *self.panels, self.n, False)
        assert self.ops.kernel_runs()["amx/int8_blocks"] == runs + int(tiles), "route not taken"
        return y


def random_x(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + t * 131 + k)
    x = torch.randn(t, k, generator=gen) * 3
    if t > 3:
        x[3, : min(k, 40)] = 0.0  # a zero block (scale 0) and a block that is partly zero
    return x


def assert_same_bits(routes: Routes, x: torch.Tensor, what: str) -> None:
    tiles, panels = routes.run(x, True), routes.run(x, False)
    assert tiles.shape == panels.shape
    bad = (tiles.view(torch.int32) != panels.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"{what}: {len(bad)} values differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_tiles_give_the_panel_kernels_bits(amx8, fmt, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 31 + k)
    routes = Routes(amx8, QUANTIZERS[fmt](torch.randn(n, k, generator=gen) * 0.05))
    counts = range(1, 131) if n * k <= 100 * 160 else (1, 2, 15, 16, 17, 33, 64, 70, 130)
    for t in counts:
        assert_same_bits(routes, random_x(t, k, seed=t), f"{fmt} {shape} T={t}")


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_extreme_weights_and_activations_give_the_same_bits(amx8, fmt):
    """q8 weights at -128 and 127, q4 at 0 and 15 (the unsigned operand's ends), activations
    that round to -127 and 127 everywhere: the integer sums' largest magnitudes."""
    n, k = 40, 160
    gen = torch.Generator().manual_seed(5)
    weight = QUANTIZERS[fmt](torch.randn(n, k, generator=gen))
    if fmt == "q8":
        ends = torch.tensor([-128, 127], dtype=torch.int8)
        qs = ends[torch.randint(0, 2, weight.qs.shape, generator=gen)]
    else:
        qs = torch.full_like(weight.qs, 0xF0)
        qs[::2] = 0x0F
        qs[1::3] = 0xFF
    routes = Routes(amx8, BlockWeight(fmt, qs, weight.d, weight.m))
    x = torch.randn(35, k, generator=gen).sign() * 2.5
    x[7] = -x[7].abs()
    assert_same_bits(routes, x, f"{fmt} extremes")


def test_tiles_give_the_same_bits_on_one_and_two_threads(amx8):
    gen = torch.Generator().manual_seed(9)
    routes = Routes(amx8, quant.quantize_q4(torch.randn(576, 576, generator=gen) * 0.05))
    x = random_x(64, 576, seed=9)
    with torch_threads(2):
        two = routes.run(x, True)
    with torch_threads(1):
        assert torch.equal(routes.run(x, True), two)
    assert torch.equal(routes.run(x[10:11], True), two[10:11])


def test_the_switch_point_and_the_isa_choose_the_route(amx8):
    """From set_amx_int8_from rows on, on the avx512 rung; 0 never; a narrower set_isa never."""
    gen = torch.Generator().manual_seed(2)
    weight = quant.quantize_q8(torch.randn(32, 64, generator=gen))
    panels = amx8.pack_blocks(weight.qs, weight.d, weight.m, False)

    def tiles_ran(rows: int) -> bool:
        before = amx8.kernel_runs()["amx/int8_blocks"]
        amx8.block_linear(torch.randn(rows, 64, generator=gen), *panels, 32, False)
        return amx8.kernel_runs()["amx/int8_blocks"] > before

    amx8.set_amx_int8_from(16)
    assert not tiles_ran(15) and tiles_ran(16) and tiles_ran(64)
    amx8.set_amx_int8_from(0)
    assert not tiles_ran(64)
    amx8.set_amx_int8_from(1)
    try:
        amx8.set_isa("avx2")
        assert not tiles_ran(64)
    finally:
        amx8.set_isa("auto")
    assert tiles_ran(1)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_the_lm_head_s_argmax_on_the_tiles_equals_the_panels(amx8, fmt):
    """block_argmax's approximate pass (each row's bounds over each panel) on the tiles: the
    same argmax as on the VNNI panels, over a padded panel (1,001 columns), rows that tie and
    rows that are not finite, at row counts below, at and past a tile's 16."""
    gen = torch.Generator().manual_seed(17)
    n, k = 1001, 576
    dense = torch.randn(n, k, generator=gen) * 0.05
    dense[900] = dense[7]
    weight = QUANTIZERS[fmt](dense)
    floats = amx8.pack_blocks(weight.qs, weight.d, weight.m, True)
    ints = amx8.pack_blocks(weight.qs, weight.d, weight.m, False)
    wmax = quant.error_weights(weight)

    def argmax(x: torch.Tensor, tiles: bool) -> torch.Tensor:
        amx8.set_amx_int8_from(1 if tiles else 0)
        runs = amx8.kernel_runs()["amx/int8_blocks"]
        out = amx8.block_argmax(x, floats[0], ints[0], floats[1], floats[2], wmax, n)
        assert amx8.kernel_runs()["amx/int8_blocks"] == runs + int(tiles), "route not taken"
        return out

    for t in (1, 15, 16, 17, 64, 130):
        x = random_x(t, k, seed=t) * 2
        if t > 2:
            x[1] = weight.dequantize()[7] * 40  # columns 7 and 900 tie at its maximum
        if t > 5:
            x[4, 9] = float("nan")
        tiles, panels = argmax(x, True), argmax(x, False)
        assert torch.equal(tiles, panels), f"{fmt} T={t}: rows {(tiles != panels).nonzero()}"
        if t > 2:
            assert tiles[1] == 7
        if t > 5:
            assert tiles[4] == -1
