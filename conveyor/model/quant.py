"""Quantized weights served quantized: block formats, their CPU kernels and the modules that
replace the float projections (same call interface as layers.Linear / MergedLinear).

Formats (a weight (N, K) in blocks of 32 input elements, one fp16 scale per block):
    q4  4-bit unsigned q, value = q * d + m           (GGUF Q4_1 as is; Q4_0 with m = -8 d;
                                                      Q4_K with d = d_K * sc, m = -dmin_K * mn)
    q8  int8 q,          value = q * d                 (GGUF Q8_0 as is; any other GGUF type
                                                      and `--quantization int8` requantize to it)
Activations are quantized per token and block to int8 inside the kernel (as llama.cpp's
Q8_0/Q8_1 dot products do), so a block's dot product is an integer dot product.

By default (batch-invariant, CPU) every row count runs one kernel instead of the routes below:
kernels/panel_gemm.cpp, int8 activations per block of 32 as here (VNNI on AVX-512, maddubs on
AVX2), float activations for the lm_head, each output value one chain in a fixed order; the
blocks are packed into column panels at load (QuantLinear.pack_panels). On a CPU with
AMX-BF16 the prompt tokens take bfloat16 tiles of the same weights instead (model/prompt_route.py),
generated tokens these blocks. What follows is what `--no-batch-invariant` runs.

Kernel choice. `python -m benchmarks quant-kernels` prints ms per call of each candidate for
SmolLM2-135M's shapes, one thread, cycling through 30 weights so that they stream from memory
as in a real step. On this project's shared 2-core Xeon (AVX-512 VNNI/AMX capable; the
kernels here use AVX2+FMA+F16C only, for Zen 3 and older CPUs):

    shape (N x K)     T    f32   fbgemm_i8  i8pack_mm  i4pack_mm  q4_block  q8_block  q4_tiles
    qkv 960x576       1   0.128    0.038      0.380      0.839     0.026     0.042     0.108
                      8   0.336    0.073      2.398      6.515     0.165     0.139     0.148
                     32   0.379    0.106        -          -       0.615     0.565     0.341
                    512   3.076    1.168        -          -       9.588     7.948     3.485
    gate_up 3072x576  1   0.515    0.130      1.205      2.717     0.133     0.213     0.403
                      8   1.023    0.229      7.617     20.734     0.656     0.496     0.507
                     32   1.300    0.383        -          -       1.936     1.568     1.031
                    512   9.033    3.434        -          -      30.335    25.101    10.324
    down 576x1536     1   0.216    0.057      0.599      1.342     0.047     0.081     0.241
                      8   0.392    0.111      3.726     10.393     0.239     0.352     0.328
                     32   0.460    0.159        -          -       0.800     0.781     0.682
    o 576x576         1   0.059    0.026      0.200      0.505     0.016     0.022     0.079
                     32   0.176    0.069        -          -       0.366     0.354     0.207
    logits 49152x576  1   8.099    1.675     19.255     43.344     2.031     3.272     6.287
                      8  15.974    3.623    128.077    339.553    10.797     7.989     8.296
                     32  21.239    6.923        -          -      33.568    27.032    18.558
    (T = 64 in the printout: the same ordering as T = 32.)

`torch._weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are far slower than float32 at
every T on this CPU. fbgemm's dynamic int8 linear (`quantized.linear_dynamic`) is the fastest
from 8 tokens up here (VNNI), but it rounds activations per tensor and would need its own
per-channel int8 copy of every weight; it is not used (yet). So: a small AVX2 extension
(kernels/quant_gemm.cpp) reads the GGUF-style blocks directly, with activations rounded to int8
per block of 32 (q4_block/q8_block: at T = 1 it streams weights at memory speed, 0.63 bytes
per parameter for q4 instead of 4); from DEQUANT_FROM_TOKENS tokens on, the step is
compute-bound and MKL wins: rows are dequantized in L2-sized tiles and multiplied there
(q4_tiles; no float copy of the whole weight is kept). The lm_head always takes float
activations: its logits pick the sampled token, and int8 activations flipped a 0.08-nat near
tie in the default model's greedy answer to "What is the capital of France?". Up to 16 rows it
runs a block kernel with float activations (each block widened once, then multiplied with every
row: 1.5 ms for the tied Q8_0 head at one row on Zen 3, against ~9 ms through float tiles),
and the tiles from there.

Whole model, one thread, ModelRunner decode steps (ctx 256), float32 vs the Q4_1 file served
quantized, side by side: batch 1: 48.3 -> 23.2 ms, batch 8: 113.5 -> 68.5 ms, batch 32:
175.5 -> 159.8 ms; a 512-token prefill 861 -> 934 ms. Weights 513 -> 92 MiB.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from conveyor import envs

logger = logging.getLogger(__name__)

QK = 32  # elements per block
FORMATS = ("q4", "q8")
# From this many tokens on, dequantize-then-MKL beats the block kernel (measured, see above).
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


# --------------------------------------------------------------------------- block weights


@dataclass(frozen=True)
class BlockWeight:
    """A (N, K) matrix in 32-element blocks. d and m hold float16 bit patterns as int16."""

    format: str  # "q4" | "q8"
    qs: torch.Tensor  # q4: uint8 (N, K/2), two values per byte; q8: int8 (N, K)
    d: torch.Tensor  # int16 (N, K/32)
    m: torch.Tensor | None  # int16 (N, K/32), q4 only

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """Float32 (N, K): the readable reference of what the kernels compute with."""
        num_rows, num_blocks = self.d.shape
        d = self.d.view(torch.float16).float().unsqueeze(-1)  # (N, nb, 1)
        if self.format == "q8":
            q = self.qs.view(num_rows, num_blocks, QK).float()
            return (q * d).reshape(num_rows, -1)
        packed = self.qs.view(num_rows, num_blocks, QK // 2)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # low nibbles come first
        m = self.m.view(torch.float16).float().unsqueeze(-1)
        return (q * d + m).reshape(num_rows, -1)

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """Whole rows moved or gathered: blocks never straddle rows, so they stay valid."""
        m = None if self.m is None else self.m[index]
        return BlockWeight(self.format, self.qs[index], self.d[index], m)

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        if len(weights) == 1:  # no copy: a tied lm_head shares the embedding's blocks
            return weights[0]
        fmt = weights[0].format
        assert all(w.format == fmt for w in weights), "only one format per matrix"
        m = None if fmt == "q8" else torch.cat([w.m for w in weights])
        return BlockWeight(
            fmt, torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]), m
        )


def _half_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.int16)


def quantize_q8(weight: torch.Tensor) -> BlockWeight:
    """Float (N, K) -> q8 blocks, scale max|w| / 127 per block (llama.cpp's Q8_0 rule)."""
    num_rows, k = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(num_rows, k // QK, QK)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return BlockWeight("q8", q.reshape(num_rows, k), d.view(torch.int16), None)


def quantize_q4(weight: torch.Tensor) -> BlockWeight:
    """Float (N, K) -> q4 blocks with min and scale per block (llama.cpp's Q4_1 rule)."""
    num_rows, k = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(num_rows, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round((blocks - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return BlockWeight(
        "q4", packed.reshape(num_rows, k // 2), d.view(torch.int16), m.view(torch.int16)
    )


# --------------------------------------------------------------------------- GGUF blocks

# GGUF types whose blocks map onto ours without loss (Q4_K: up to fp16 rounding of d * sc).
_GGUF_DIRECT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# Stored as floats: a GGUF of these is a float checkpoint.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def is_quantized_gguf(path: Path) -> bool:
    """Whether a .gguf file stores any projection weight in a quantized (non-float) type."""
    if path.suffix != ".gguf":
        return False
    from conveyor.model.gguf_loader import gguf_tensor_types

    types = gguf_tensor_types(path)
    return any(
        qtype not in GGUF_FLOAT_TYPES for name, qtype in types.items() if projection_of(name)
    )


def from_gguf_blocks(qtype_name: str, data: np.ndarray, shape: tuple[int, int]) -> BlockWeight:
    """GGUF tensor bytes (rows, bytes per row) -> BlockWeight. Types without a direct mapping
    are dequantized by the gguf package and requantized to q8 (8 bits >= their 2-6 bits)."""
    num_rows, k = shape
    if k % QK:
        raise ValueError(f"rows of {k} elements do not split into blocks of {QK}")
    if qtype_name == "Q8_0":
        blocks = data.reshape(num_rows, k // QK, 34)
        d = _np_half(blocks[..., :2])
        qs = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(num_rows, k))
        return BlockWeight("q8", qs, d, None)
    if qtype_name in ("Q4_0", "Q4_1"):
        size = 18 if qtype_name == "Q4_0" else 20
        blocks = data.reshape(num_rows, k // QK, size)
        d = _np_half(blocks[..., :2])
        m = _np_half(blocks[..., 2:4]) if qtype_name == "Q4_1" else _half_bits(-8 * _f16(d))
        qs = torch.from_numpy(blocks[..., size - 16 :].copy().reshape(num_rows, k // 2))
        return BlockWeight("q4", qs, d, m)
    if qtype_name == "Q4_K":
        return _from_q4_k(data, num_rows, k)
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    try:
        values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError as error:
        raise ValueError(f"GGUF type {qtype_name} cannot be dequantized by gguf") from error
    return quantize_q8(torch.from_numpy(np.ascontiguousarray(values)).reshape(num_rows, k))


def _np_half(raw: np.ndarray) -> torch.Tensor:
    """Two little-endian bytes per value -> int16 tensor of the fp16 bit patterns."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.int16)[..., 0].copy())


def _f16(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float16).float()


def _from_q4_k(data: np.ndarray, num_rows: int, k: int) -> BlockWeight:
    """Q4_K super-blocks of 256 (d, dmin, 8 six-bit scales and mins, 4-bit q) -> q4 blocks.

    Each 32-element sub-block becomes one q4 block: d = d_K * sc, m = -dmin_K * mn. Q4_K puts
    sub-blocks 2j and 2j+1 in the low and high nibbles of the same 32 bytes; ours keeps the
    first 16 elements of a block in the low nibbles, so the nibbles are re-paired."""
    import gguf

    blocks = data.reshape(-1, 144)  # (num super-blocks, bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (S, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # (S, 8) each
    scale = torch.from_numpy(d * sc.astype(np.float32)).reshape(num_rows, k // QK)
    minimum = torch.from_numpy(-dmin * mn.astype(np.float32)).reshape(num_rows, k // QK)
    raw = torch.from_numpy(blocks[:, 16:].copy()).reshape(-1, 4, 32)  # 4 x (64 elements)
    q = torch.stack((raw & 0x0F, raw >> 4), dim=2).reshape(num_rows, k // QK, QK)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return BlockWeight(
        "q4", packed.reshape(num_rows, k // 2), _half_bits(scale), _half_bits(minimum)
    )


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
    """The compiled ops (model/kernels: quant_gemm.cpp is one of their sources), built once
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


def int8_route_enabled() -> bool:
    return envs.quant_int8() and has_vnni() and int8_gemm_available()


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


# --------------------------------------------------------------------------- modules


def error_weights(weight: BlockWeight) -> torch.Tensor:
    """Per output row n, max over its blocks b of |d_nb| * sum_k |q_nk| + 32 |m_nb| (q4: q in
    0..15): int8 activations with a per-block scale xd_b put a value of x @ W^T off by at most
    sum_b (xd_b / 2) times this (kernels/panel_gemm.cpp: block_argmax)."""
    num_rows, num_blocks = weight.d.shape
    if weight.format == "q4":
        qs = weight.qs.reshape(num_rows, num_blocks, 16).to(torch.int32)
        size = ((qs & 0x0F) + (qs >> 4)).sum(-1)
    else:
        size = weight.qs.reshape(num_rows, num_blocks, 32).to(torch.int32).abs().sum(-1)
    scale = weight.d.view(torch.float16).to(torch.float32).abs()
    bound = scale * size.to(torch.float32)
    if weight.format == "q4":
        bound += 32 * weight.m.view(torch.float16).to(torch.float32).abs()
    return bound.amax(dim=1).contiguous()


class QuantLinear(nn.Module):
    """A projection over block-quantized rows; merged projections (q/k/v, gate/up) keep
    `out_sizes` for the model's split. The bias (if any) stays float."""

    def __init__(
        self, weight: BlockWeight, out_sizes: list[int], bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        assert sum(out_sizes) == weight.shape[0]
        self.format = weight.format
        self.out_sizes = out_sizes
        self.in_features = weight.shape[1]
        # Token count from which the float-tile path runs (--no-batch-invariant); 1 makes
        # every row count take float activations (the lm_head: see float_acts).
        self.dequant_from = DEQUANT_FROM_TOKENS
        # Token count from which the int8 copy runs (once pack_int8 has made one).
        self.int8_from = INT8_FROM_TOKENS
        self.int8_weight: torch.ScriptObject | None = None
        self.outlier_ratio = OUTLIER_RATIO
        # (wq, dw, mw): the blocks packed for the batch-invariant panel kernels (pack_panels).
        self.panels: list[torch.Tensor] | None = None
        # (int8 panels, error weights): the lm_head's exact argmax from int8 values (argmax).
        self.argmax_panels: tuple[torch.Tensor, torch.Tensor] | None = None
        # int16 / uint8 / int8 buffers: Module.to(dtype) casts floats only, so they survive it.
        _register_blocks(self, weight)
        self.register_buffer("bias", bias)

    def pack_int8(self) -> None:
        """Adds fbgemm's int8 copy (about 1 byte per parameter) for T >= int8_from."""
        with warnings.catch_warnings():  # quantized tensor creation is deprecated, not gone
            warnings.simplefilter("ignore", UserWarning)
            self.int8_weight = pack_int8(self.weight_blocks)

    @property
    def weight_blocks(self) -> BlockWeight:
        return BlockWeight(self.format, self.qs, self.d, self.m)

    @property
    def float_acts(self) -> bool:
        """Whether every row count takes float activations (the lm_head: QuantPlan.install
        sets dequant_from to 1), not int8 ones."""
        return self.dequant_from <= 1

    def pack_panels(self, ops) -> None:
        """Packs the blocks for the panel kernels (kernels/panel_gemm.cpp): from then on every
        row count runs one kernel with one reduction order per output value."""
        m = self.m if self.format == "q4" else None
        self.panels = ops.pack_blocks(self.qs, self.d, m, float_acts=self.float_acts)
        if self.float_acts and self.bias is None:  # the lm_head: greedy rows' argmax (below)
            int8_panels = ops.pack_blocks(self.qs, self.d, m, float_acts=False)
            self.argmax_panels = (int8_panels[0], error_weights(self.weight_blocks))

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(x), the first of equal maxima as torch.argmax picks,
        without computing every value in float: the int8 panels' approximate values, then the
        float kernel on the columns their error bound leaves in the running (panel_gemm.cpp:
        block_argmax). None where it does not apply (call forward): no packed panels, not a
        CPU float32 matrix, or a row with values that are not finite."""
        on_cpu = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
        if self.argmax_panels is None or not on_cpu:
            return None
        wq, wmax = self.argmax_panels
        wk, dw, mw = self.panels
        out = kernels().block_argmax(x, wk, wq, dw, mw, wmax, self.d.shape[0])
        return None if bool((out < 0).any()) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.device.type == "cpu" and x.dim() == 2:
            x32 = x.to(torch.float32)
            n_out = self.d.shape[0]
            out = kernels().block_linear(x32, *self.panels, n_out, self.float_acts).to(x.dtype)
        elif x.device.type == "cpu" and x.dim() == 2:
            x32 = x.to(torch.float32)
            if self.int8_weight is not None and x.shape[0] >= self.int8_from:
                out = int8_linear(x32, self.int8_weight, self.weight_blocks, self.outlier_ratio)
                out = out.to(x.dtype)
            else:
                out = block_linear(x32, self.weight_blocks, self.dequant_from).to(x.dtype)
        else:  # other devices and shapes: the readable (slow) path
            out = x @ self.weight_blocks.dequantize().to(x.device, x.dtype).T
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.format}, in={self.in_features}, out={self.out_sizes}"


class QuantConcatLinear(nn.Module):
    """Merged projection whose parts came in different formats (e.g. a GGUF with q/k in Q4_K
    and v in Q6_K): one matmul per part, outputs concatenated."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_sizes = [size for part in parts for size in part.out_sizes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """Token embeddings from block rows: only the looked-up rows are dequantized."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.format = weight.format
        _register_blocks(self, weight)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = BlockWeight(self.format, self.qs, self.d, self.m).rows(flat)
        return rows.dequantize().to(self.dtype).reshape(*input_ids.shape, -1)


def pack_int8_modules(model: nn.Module) -> int:
    """Gives every QuantLinear but the lm_head its int8 copy where the route is on; returns
    how many got one."""
    if not int8_route_enabled():
        return 0
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name != _LM_HEAD:
            module.pack_int8()
            count += 1
    return count


def _register_blocks(module: nn.Module, weight: BlockWeight) -> None:
    for name in ("qs", "d", "m"):
        module.register_buffer(name, getattr(weight, name))


def merged_linear(
    shards: list[BlockWeight], biases: list[torch.Tensor] | None
) -> QuantLinear | QuantConcatLinear:
    """One module for the shards of a merged projection, in checkpoint order."""
    sizes = [w.shape[0] for w in shards]
    if len({w.format for w in shards}) == 1:
        bias = torch.cat(biases) if biases else None
        return QuantLinear(BlockWeight.cat(shards), sizes, bias)
    parts = [
        QuantLinear(w, [w.shape[0]], biases[i] if biases else None) for i, w in enumerate(shards)
    ]
    return QuantConcatLinear(parts)


# --------------------------------------------------------------------------- loading

# HF projection -> (module of the merged model, shard index in it); see llama.py.
_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_EMBED, _LM_HEAD = "model.embed_tokens", "lm_head"


def projection_of(hf_name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> ('model.layers.3.self_attn.qkv_proj', 1,
    'weight'); None for tensors that are not decoder projections."""
    module, _, param = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf not in _SHARDS:
        return None
    merged, shard = _SHARDS[leaf]
    return f"{parent}.{merged}", shard, param


class _Pending(nn.Module):
    """Stands in for a module to be quantized while the float model gets its storage."""


@dataclass
class _Spec:
    checkpoint_names: list[str]  # weight tensors feeding the shards, in shard order
    has_bias: bool
    embedding: bool = False
    shards: dict[int, BlockWeight] | None = None
    biases: dict[int, torch.Tensor] | None = None


class QuantPlan:
    """Which modules of a model are served quantized, and their weights as they stream in.

    Use: `strip(model)` on the meta-device model (the float storage is then never allocated
    for them), `take(weights)` around the checkpoint iterator (quantized tensors are kept here,
    the rest passes to model.load_weights), then `install(model)`."""

    def __init__(self, mode: str, dtype: torch.dtype, specs: dict[str, _Spec]) -> None:
        self.mode = mode  # "gguf" | "int8"
        self.dtype = dtype
        self.specs = specs
        self._routes: dict[str, list[tuple[str, int]]] = {}
        for module, spec in specs.items():
            for shard, name in enumerate(spec.checkpoint_names):
                self._routes.setdefault(name, []).append((module, shard))

    def keep_raw(self, hf_name: str) -> bool:
        """For the GGUF reader: leave this tensor in its blocks."""
        return self.mode == "gguf" and hf_name in self._routes

    def strip(self, model: nn.Module) -> None:
        for name in self.specs:
            model.set_submodule(name, _Pending())

    def take(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name in self._routes:
                weight = self._to_blocks(tensor)
                for module, shard in self._routes[name]:
                    self.specs[module].shards[shard] = weight
            elif name.endswith(".bias") and self._bias_route(name) is not None:
                module, shard = self._bias_route(name)
                self.specs[module].biases[shard] = tensor.to(self.dtype)
            else:
                yield name, tensor

    def install(self, model: nn.Module) -> None:
        for name, spec in self.specs.items():
            missing = [n for i, n in enumerate(spec.checkpoint_names) if i not in spec.shards]
            if missing:
                raise ValueError(f"checkpoint lacks tensors: {', '.join(missing[:5])}")
            shards = [spec.shards[i] for i in range(len(spec.checkpoint_names))]
            if spec.embedding:
                model.set_submodule(name, QuantEmbedding(shards[0], self.dtype))
                continue
            biases = None
            if spec.has_bias:
                biases = [spec.biases[i] for i in range(len(shards))]
            module = merged_linear(shards, biases)
            if name == _LM_HEAD:
                # Logits decide the sampled token: near ties (0.1 nat apart happen in greedy
                # chat answers) must not flip on the activations' int8 rounding, so the head
                # always takes the float-tile path (float32 arithmetic on the stored blocks).
                module.dequant_from = 1  # and so float_acts
            model.set_submodule(name, module)
        pack_int8_modules(model)

    def _to_blocks(self, tensor) -> BlockWeight:
        if isinstance(tensor, torch.Tensor):  # a float checkpoint (or a dequantized GGUF)
            return quantize_q8(tensor)
        weight = from_gguf_blocks(tensor.qtype.name, tensor.data, tuple(tensor.shape))
        return weight if tensor.row_order is None else weight.rows(tensor.row_order)

    def _bias_route(self, name: str) -> tuple[str, int] | None:
        route = self._routes.get(name.removesuffix(".bias") + ".weight")
        return route[0] if route else None


def plan_quantization(cfg, model: nn.Module) -> QuantPlan | None:
    """The QuantPlan for `cfg.quantization` on the (meta-device) float model; None for 'none'."""
    if cfg.quantization == "none":
        return None
    types = None
    if cfg.quantization == "gguf":
        from conveyor.model.gguf_loader import gguf_tensor_types

        types = gguf_tensor_types(cfg.path)

    def quantized(names: list[str]) -> bool:  # a GGUF keeps float weights float
        return types is None or all(types.get(n, "F32") not in GGUF_FLOAT_TYPES for n in names)

    specs: dict[str, _Spec] = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in {merged for merged, _ in _SHARDS.values()} or module.weight.shape[1] % QK:
            continue
        parent = name.rpartition(".")[0]
        names = [f"{parent}.{p}.weight" for p, (m, _) in _SHARDS.items() if m == leaf]
        if quantized(names):
            specs[name] = _Spec(names, getattr(module, "bias", None) is not None)
    _plan_embeddings(cfg, model, specs, quantized)
    for spec in specs.values():
        spec.shards, spec.biases = {}, {}
    return QuantPlan(cfg.quantization, cfg.dtype, specs)


def _plan_embeddings(cfg, model: nn.Module, specs: dict[str, _Spec], quantized) -> None:
    """lm_head is a projection like the others. A tied one shares its blocks with the token
    embeddings; an untied GGUF embedding that is stored quantized stays so (rows are
    dequantized per lookup)."""
    hidden = model.get_submodule(_EMBED).weight.shape[1]
    if hidden % QK:
        return
    embed_name = f"{_EMBED}.weight"
    head_source = embed_name if cfg.tie_word_embeddings else "lm_head.weight"
    if quantized([head_source]):
        specs[_LM_HEAD] = _Spec([head_source], has_bias=False)
    if (cfg.tie_word_embeddings and _LM_HEAD in specs) or (
        cfg.quantization == "gguf" and quantized([embed_name])
    ):
        specs[_EMBED] = _Spec([embed_name], has_bias=False, embedding=True)
