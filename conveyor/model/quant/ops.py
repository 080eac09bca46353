"""The block kernels' Python wrappers (kernels/gemm/quant_gemm.cpp, the MKL tiles, the reference)
and the int8 route through fbgemm: what `--no-batch-invariant` runs, row count by row count."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from conveyor import envs
from conveyor.model import plan as kernel_plan
from conveyor.model.quant.formats import QK, BlockWeight

logger = logging.getLogger(__name__)

# From this many tokens on, dequantize-then-MKL beats the block kernel (measured: see __init__).
DEQUANT_FROM_TOKENS = 16
# From this many tokens on, a per-channel int8 copy through fbgemm beats both. Alone (random
# activations) it wins from 8; in whole-model steps of the default model (real activations,
# two threads) the block kernel still wins below 16: at 8 tokens 52-68 ms vs 66-78 ms, at 12
# tokens of one sequence (a speculative verification) 48-51 vs 74-75; from 16 on int8 ties or
# wins (16: 92-102 vs 99-106 ms; 32: 124-163 vs 172-192).
INT8_FROM_TOKENS = 16
# Input channels above this many times a token's RMS skip the int8 route (see int8_linear).
OUTLIER_RATIO = envs.quant_outlier_ratio()
# CONVEYOR_QUANT_INT8=1 builds int8 copies at load and runs steps of 16 tokens or more
# through fbgemm (CPUs with VNNI only). Off by default: its 8-bit activations per token move
# logits more than the block kernels' 8-bit activations per block of 32 do, and which route a
# row takes depends on how many rows its step has, so a request's greedy answer depended on
# its neighbours and on prefix-cache hits. The default model asked "What is the capital of
# France?" twice (the second time with its prompt cached, so computed in 3 rows instead of 35):
# with the route, "The capital of France is Paris." then "L'Étoile, la Cité, ..." (first-token
# log-probabilities moved by 0.16; without it by 0.03-0.2: the block kernels' rounding is not
# batch-invariant either, and since 2026-12-01 14:00 it flips that 0.08-nat tie too, so the
# server test asks a question without one). What the route buys here: a 512-token prefill
# 15-30% faster; decode at 32 rows nothing.
INT8_ENV = "CONVEYOR_QUANT_INT8"


# --------------------------------------------------------------------------- the kernels


def kernel_supported() -> bool:
    """Whether this CPU runs the AVX2+FMA+F16C kernels (all x86-64 CPUs since ~2013)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def kernels_available() -> bool:
    """Whether the kernels run here: a supported CPU, and the extension builds (once)."""
    if not kernel_supported():
        return False
    try:
        kernels()
    except Exception as error:  # a missing compiler or ninja shows up as many exception types
        logger.warning("conveyor: quantized kernels unavailable: %s", str(error)[-300:])
        return False
    return True


def kernels() -> Any:
    """The compiled ops (model/kernels: gemm/quant_gemm.cpp is one of their sources), built once
    per machine. Raises when they cannot be built here."""
    from conveyor.model import kernels as compiled

    ops = compiled.load()
    if ops is None:
        raise RuntimeError("the compiled CPU kernels did not build (see the warning above)")
    return ops


def block_linear(
    x: torch.Tensor, weight: BlockWeight, dequant_from: int = DEQUANT_FROM_TOKENS
) -> torch.Tensor:
    """x (T, K) float32 @ weight.T -> (T, N) float32 through the compiled kernels: the block
    kernel (int8 activations) below `dequant_from` tokens, float tiles and MKL from there."""
    ops = kernels()
    if x.shape[0] >= dequant_from:
        if weight.format == "q4":
            return ops.q4_linear_dequant(x, weight.qs, weight.d, weight.m)
        return ops.q8_linear_dequant(x, weight.qs, weight.d)
    if weight.format == "q4":
        return ops.q4_linear(x, weight.qs, weight.d, weight.m)
    return ops.q8_linear(x, weight.qs, weight.d)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """Float32 (N, K) through the compiled kernels (the same values as BlockWeight.dequantize)."""
    if weight.format == "q4":
        return kernels().q4_dequantize(weight.qs, weight.d, weight.m)
    return kernels().q8_dequantize(weight.qs, weight.d)


def reference_linear(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """What block_linear computes, in plain PyTorch: activations rounded to int8 per block of
    32 (scale max|x| / 127), times the dequantized weight. The oracle of the kernel tests."""
    t, k = x.shape
    blocks = x.float().reshape(t, k // QK, QK)
    max_abs = blocks.abs().amax(-1, keepdim=True)
    scale = max_abs / 127
    # 127 / max, correctly rounded as the kernel computes it: 1 / (max / 127), or torch's
    # 127.0 / t (a reciprocal times 127), can differ by an ulp and flip the rounding of a value
    # that lands on .5.
    inv = torch.where(
        max_abs > 0, torch.full_like(max_abs, 127.0) / max_abs, torch.zeros_like(max_abs)
    )
    x_rounded = (torch.round(blocks * inv) * scale).reshape(t, k)
    return x_rounded.double() @ weight.dequantize().double().T


# --------------------------------------------------------------------------- int8 route


@functools.cache
def int8_gemm_available() -> bool:
    """Whether PyTorch's x86 quantized engine (fbgemm; VNNI/AMX where present) runs here."""
    engines = torch.backends.quantized.supported_engines
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        usable = [e for e in ("x86", "fbgemm") if e in engines]
        if not usable:
            logger.info("conveyor: no x86/fbgemm quantized engine; int8 GEMM route off")
            return False
        torch.backends.quantized.engine = usable[0]
    return True


@functools.cache
def has_vnni() -> bool:
    """Whether this CPU adds u8 x s8 products in int32 (AVX512-VNNI, AVX-VNNI). Without it,
    fbgemm's kernels add pairs of products in int16 (AVX2's maddubs), which saturates for 8-bit
    activations (2 x 255 x 127 > 32767): on a Zen 3 the tiny Q8_0 model's mean KL to its float
    model was 0.14, and with 7-bit activations (reduce_range) its top-1 agreement fell to 0.88.
    So the int8 route runs only with VNNI; elsewhere the float tiles do (exact activations)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni"} & set(flags))


def int8_route_enabled(cfg: kernel_plan.ModelFacts) -> bool:
    """The kernel plan's int8 route (CONVEYOR_QUANT_INT8=1 without batch invariance: the panels
    serve every row count otherwise), on a CPU with VNNI and fbgemm."""
    return kernel_plan.current(cfg).int8_route and has_vnni() and int8_gemm_available()


def pack_int8(weight: BlockWeight, tile_rows: int = 1024) -> torch.ScriptObject:
    """fbgemm's prepacked per-output-channel int8 copy of the blocks (symmetric, scale
    max|row| / 127). Rows are dequantized a tile at a time: no float copy of the whole weight."""
    num_rows, _ = weight.shape
    tiles, scales = [], []
    for start in range(0, num_rows, tile_rows):
        rows = dequantize(weight.rows(torch.arange(start, min(start + tile_rows, num_rows))))
        scale = (rows.abs().amax(1) / 127).clamp_min(1e-12)
        tiles.append(torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    scale = torch.cat(scales).double()
    q = torch._make_per_channel_quantized_tensor(
        torch.cat(tiles), scale, torch.zeros(num_rows, dtype=torch.long), 0
    )
    return torch.ops.quantized.linear_prepack(q, None)


def int8_linear(
    x: torch.Tensor, packed: torch.ScriptObject, weight: BlockWeight, outlier_ratio: float
) -> torch.Tensor:
    """x (T, K) float32 @ the packed weight.T. fbgemm rounds activations with one scale per
    tensor. Two fixes keep that close to the block kernel's per-block rounding: input channels
    where some token exceeds `outlier_ratio` x its RMS (a few fixed "massive activation"
    channels in LLMs) are multiplied in float32 with their columns read from the blocks, and
    each row is scaled to max|x| = 1 (undone on the output), so the scale is per token."""
    scaled, amax, cols, x_out = kernels().int8_prepare(x, outlier_ratio)
    out = torch.ops.quantized.linear_dynamic(scaled, packed).mul_(amax)
    return out.addmm_(x_out, weight_columns(weight, cols).T) if cols.numel() else out


def weight_columns(weight: BlockWeight, cols: torch.Tensor) -> torch.Tensor:
    """Float32 (N, len(cols)): the given input columns of the blocks, dequantized."""
    if weight.format == "q8":
        return kernels().q8_columns(weight.qs, weight.d, cols)
    return kernels().q4_columns(weight.qs, weight.d, weight.m, cols)


def reference_int8_linear(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """What int8_linear computes, in float64: per-channel int8 weights times activations that
    fbgemm rounds to uint8 (asymmetric, min/max of the tensor and 0) after the per-row scaling."""
    w = weight.dequantize().double()
    w_scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    amax = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
    xn = (x / amax).double()
    lo, hi = min(xn.min().item(), 0.0), max(xn.max().item(), 0.0)
    scale = (hi - lo) / 255
    zero = round(-lo / scale)
    x_rounded = ((torch.round(xn / scale) + zero).clamp(0, 255) - zero) * scale * amax.double()
    return x_rounded @ (torch.round(w / w_scale).clamp(-127, 127) * w_scale).T
