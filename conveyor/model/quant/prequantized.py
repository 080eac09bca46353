"""Checkpoints quantized by another tool, dequantized as they are read (model/loader.py).

fp8 (config.json's quant_method "fp8"; Qwen's and DeepSeek's -FP8 releases): a float8 e4m3
`<name>.weight` with its block scales `<name>.weight_scale_inv` (a grid of R x C blocks);
value = weight * scale in float32, as transformers dequantizes it on a CPU.

compressed-tensors (quant_method "compressed-tensors", llm-compressor's weight-only schemes
such as W4A16 and W8A16, "pack-quantized" / "int-quantized" / "naive-quantized"): integers
packed little-endian into int32 words along each row (`weight_packed`, the row length in
`weight_shape`) or stored as int8 (`weight`), a scale per group of columns or per row
(`weight_scale`), symmetric (no zero points); value = q * scale, computed exactly (float64)
and rounded once to the model's dtype: in float64, transformers' values bit for bit.

Each dequantized weight is yielded under its module's `.weight` name; the tensors it was made
of are consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from conveyor.config import quantization_config

# An fp8 checkpoint's per-tensor activation scales: its activations are computed in float.
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
_CT_PARTS = ("scale", "zero_point", "shape", "g_idx")  # of a compressed-tensors weight


class Dequantizer:
    """Which stored tensors make which weight, for one checkpoint."""

    def __init__(self, folder: Path, where: dict[str, Path]) -> None:
        """where: every stored tensor's name -> its file."""
        self.where = where
        self.num_bits = _ct_num_bits(folder)
        self.makes: dict[str, str] = {}  # stored name -> the weight name it is read as
        self.consumed: set[str] = set()  # read as parts of another tensor's weight
        for name in where:
            if name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") in where:
                self.makes[name.removesuffix("_scale_inv")] = name.removesuffix("_scale_inv")
                self.consumed.add(name)
            elif self.num_bits and name.endswith(".weight_packed"):
                self._compressed(name, name.removesuffix("_packed"))
            elif self.num_bits and name.endswith(".weight") and f"{name}_scale" in where:
                self._compressed(name, name)  # int8 weights beside their scales

    def _compressed(self, stored: str, weight: str) -> None:
        self.makes[stored] = weight
        self.consumed |= {f"{weight}_{part}" for part in _CT_PARTS} & self.where.keys()

    def skips(self, stored: str) -> bool:
        return stored in self.consumed or stored.endswith(_ACTIVATION_SCALES)

    def read(self, stored: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """The weight `stored` makes, dequantized (None: it is read as it is). get: a tensor
        by name, from whichever file holds it."""
        weight = self.makes.get(stored)
        if weight is None:
            return None
        if f"{weight}_scale_inv" in self.where:
            return dequantize_fp8(get(weight), get(f"{weight}_scale_inv"))
        if f"{weight}_g_idx" in self.where or f"{weight}_zero_point" in self.where:
            raise ValueError(f"{weight}: zero points and activation order are not read")
        if stored.endswith("_packed"):
            shape = tuple(int(n) for n in get(f"{weight}_shape"))
            values = unpack_int32(get(stored), self.num_bits, shape)
        else:
            values = get(stored).to(torch.int32)
        return dequantize_int(values, get(f"{weight}_scale"))


def _ct_num_bits(folder: Path) -> int | None:
    """A weight-only compressed-tensors checkpoint's bits per weight (None: not one)."""
    quant = quantization_config(folder)
    if quant is None or quant.get("quant_method") != "compressed-tensors":
        return None
    bits = {group["weights"]["num_bits"] for group in quant["config_groups"].values()}
    return bits.pop() if len(bits) == 1 else None


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """Signed integers of `shape` from int32 words holding 32 / num_bits each, little-endian
    along each row, stored offset by 2^(num_bits - 1)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    values = (words[..., None] >> shifts) & ((1 << num_bits) - 1)  # (rows, words, per_word)
    values = values.reshape(words.shape[0], -1)[:, : shape[1]]
    return (values - (1 << (num_bits - 1))).to(torch.int32).reshape(shape)


def dequantize_int(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale with one scale per group of columns (or per row), in float64 (exact: the
    caller rounds it once, to the model's dtype)."""
    rows, cols = values.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    if cols % groups:
        raise ValueError(f"a {rows} x {cols} weight cannot take {groups} scale groups a row")
    q = values.to(torch.float64).reshape(rows, groups, cols // groups)
    scaled = q * scale.to(torch.float64).reshape(rows, groups, 1)
    return scaled.reshape(rows, cols)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """A block-scaled float8 weight in float32: each (rows / R, cols / C) block of it times
    its scale, R x C the scales' grid; as transformers dequantizes it (float32 products), so
    that the bits are the same."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"fp8 weight {tuple(weight.shape)} needs a 2-D scale grid")
    rows, cols = weight.shape
    grid_rows, grid_cols = scale_inv.shape
    if rows % grid_rows or cols % grid_cols:
        raise ValueError(
            f"fp8 weight shape ({rows}, {cols}) is not divisible by its scale grid "
            f"({grid_rows}, {grid_cols})"
        )
    blocks = weight.to(torch.float32).reshape(grid_rows, rows // grid_rows, grid_cols, -1)
    scaled = blocks * scale_inv.to(torch.float32)[:, None, :, None]
    return scaled.reshape(rows, cols)
