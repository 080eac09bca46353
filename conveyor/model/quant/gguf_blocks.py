"""GGUF's quantized tensors as conveyor's blocks: Q8_0, Q4_0, Q4_1, Q4_K and MXFP4 as they are,
any other type requantized (the package docstring says how each maps)."""

from __future__ import annotations

import numpy as np
import torch

from conveyor.model.quant.formats import QK, BlockWeight, _half_bits, quantize_q8

# --------------------------------------------------------------------------- GGUF blocks

# GGUF types whose blocks map onto ours without loss (Q4_K: up to fp16 rounding of d * sc;
# MXFP4: where its scales are float16 values, which trained weights' are).
_GGUF_DIRECT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "MXFP4")


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
    if qtype_name == "MXFP4" and (exact := _from_mxfp4(data, num_rows, k)) is not None:
        return exact
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    try:
        values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError as error:
        raise ValueError(f"GGUF type {qtype_name} cannot be dequantized by gguf") from error
    return quantize_q8(torch.from_numpy(np.ascontiguousarray(values)).reshape(num_rows, k))


# MXFP4's e2m1 values doubled, by code (gguf.quants.MXFP4.kvalues, llama.cpp's kvalues_mxfp4).
_MXFP4_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8
)


def _from_mxfp4(data: np.ndarray, num_rows: int, k: int) -> BlockWeight | None:
    """MXFP4 blocks (GPT-OSS's experts in llama.cpp's files: a power-of-two scale byte, then 32
    e2m1 codes, element i in byte i's low nibble and element 16 + i in its high one) as q8
    blocks with the same values: q = the doubled e2m1 value (an integer up to 12), d = the
    halved scale, exact whenever that power of two is a float16 (2^-24 .. 2^15). None when a
    block's is not (the caller then requantizes)."""
    import gguf

    blocks = data.reshape(num_rows, k // QK, 17)
    scale = torch.from_numpy(gguf.quants.MXFP4.e8m0_to_fp32_half(blocks[..., :1].copy())[..., 0])
    packed = torch.from_numpy(blocks[..., 1:].copy())
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).long()  # (N, nb, 32)
    q = _MXFP4_VALUES[codes]
    d = scale.to(torch.float16)
    used = (q != 0).any(-1)  # an all-zero block's scale is never read
    if not torch.equal(d[used].float(), scale[used]):
        return None
    d = torch.where(used, d, torch.zeros((), dtype=torch.float16))
    return BlockWeight("q8", q.reshape(num_rows, k), d.view(torch.int16), None)


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
