"""Checkpoints quantized by another tool, dequantized as they are read (model/loader.py).

fp8 (config.json's quant_method "fp8"; Qwen's and DeepSeek's -FP8 releases): a float8 e4m3
`<name>.weight` with its block scales `<name>.weight_scale_inv` (a grid of R x C blocks);
value = weight * scale in float32, as transformers dequantizes it on a CPU.

compressed-tensors (quant_method "compressed-tensors", llm-compressor's weight-only schemes
such as W4A16 and W8A16, "pack-quantized" / "int-quantized" / "naive-quantized"): integers
packed little-endian into int32 words along each row (`weight_packed`, the row length in
`weight_shape`) or stored as int8 (`weight`), a scale per group of columns or per row
(`weight_scale`), and where asymmetric a zero point per group (`weight_zero_point`, packed
along the rows as the weights are along theirs); value = (q - zero) * scale, computed exactly
(float64) and rounded once to the model's dtype: in float64, transformers' values bit for bit.

GPTQ (quant_method "gptq": AutoGPTQ's and GPTQModel's -GPTQ-Int4 / -Int8 releases) and AWQ
("awq": AutoAWQ's -AWQ releases): per `<module>`, unsigned integers packed into int32 words,
the first in the lowest bits (`qweight`), a float16 scale and an integer zero point per group
of input columns and output (`scales` (G, N), `qzeros` packed like the weights); value =
(q - zero) * scale, exact in float64 as above. GPTQ packs the input dim: qweight (K * bits /
32, N), qzeros (G, N * bits / 32), `g_idx` (K,) each input column's group (activation order
makes it a permutation of groups; without it k // group_size), zero points stored minus one
in its v1 format (checkpoint_format "gptq", each one read back + 1 as AutoGPTQ's and vLLM's
kernels read it) and as they are in "gptq_v2". AWQ packs the output dim, eight 4-bit values a
word in the order 0, 2, 4, 6, 1, 3, 5, 7: qweight (K, N / 8), qzeros (G, N / 8); without
zero points (zero_point false) every zero is 2^(bits - 1). The bits a module holds come from
its shapes (GPTQModel's per-module "dynamic" bits included).

Each dequantized weight is yielded under its module's `.weight` name; the tensors it was made
of are consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.config import quantization_config
from conveyor.model.quant.formats import QK, BlockWeight

# An fp8 checkpoint's per-tensor activation scales: its activations are computed in float.
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
_CT_PARTS = ("scale", "zero_point", "shape", "g_idx")  # of a compressed-tensors weight
_GROUPED_PARTS = ("qzeros", "scales", "g_idx")  # of a GPTQ or AWQ module's qweight
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of 8 is the word's value _AWQ_COLUMNS[c]


class Dequantizer:
    """Which stored tensors make which weight, for one checkpoint."""

    def __init__(self, folder: Path, where: dict[str, Path]) -> None:
        """where: every stored tensor's name -> its file."""
        self.where = where
        self.num_bits = _ct_num_bits(folder)
        quant = quantization_config(folder) or {}
        self.grouped = (
            quant.get("quant_method") if quant.get("quant_method") in ("gptq", "awq") else None
        )
        # GPTQ's v1 format stores each zero point minus one.
        self.zero_offset = int(
            self.grouped == "gptq"
            and quant.get("checkpoint_format", quant.get("format")) != "gptq_v2"
        )
        self.bits = quant.get("bits", quant.get("w_bit"))
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
            elif self.grouped and name.endswith(".qweight"):
                module = name.removesuffix(".qweight")
                self.makes[name] = f"{module}.weight"
                self.consumed |= {f"{module}.{part}" for part in _GROUPED_PARTS} & where.keys()

    def _grouped(self, module: str, get: Callable[[str], torch.Tensor]) -> GroupedInts:
        parts = {
            part: get(f"{module}.{part}") if f"{module}.{part}" in self.where else None
            for part in _GROUPED_PARTS
        }
        if parts["scales"] is None:
            raise ValueError(f"{module}: a qweight without its scales")
        try:
            if self.grouped == "awq":
                return read_awq(get(f"{module}.qweight"), parts["scales"], parts["qzeros"])
            return read_gptq(
                get(f"{module}.qweight"), bits=self.bits, zero_offset=self.zero_offset, **parts
            )
        except ValueError as e:
            raise ValueError(f"{module}: {e}") from None

    def _compressed(self, stored: str, weight: str) -> None:
        self.makes[stored] = weight
        self.consumed |= {f"{weight}_{part}" for part in _CT_PARTS} & self.where.keys()

    def skips(self, stored: str) -> bool:
        return stored in self.consumed or stored.endswith(_ACTIVATION_SCALES)

    def read(
        self, stored: str, get: Callable[[str], torch.Tensor], grouped: bool = False
    ) -> torch.Tensor | GroupedInts | None:
        """The weight `stored` makes, dequantized (None: it is read as it is). get: a tensor
        by name, from whichever file holds it. grouped: a GPTQ or AWQ weight as it is stored
        (GroupedInts, for a quantized module), not dequantized."""
        weight = self.makes.get(stored)
        if weight is None:
            return None
        if f"{weight}_scale_inv" in self.where:
            return dequantize_fp8(get(weight), get(f"{weight}_scale_inv"))
        if self.grouped and stored.endswith(".qweight"):
            ints = self._grouped(stored.removesuffix(".qweight"), get)
            return ints if grouped else ints.dequantize()
        if f"{weight}_g_idx" in self.where:
            raise ValueError(f"{weight}: activation order is not read")
        scale = get(f"{weight}_scale")
        if stored.endswith("_packed"):
            shape = tuple(int(n) for n in get(f"{weight}_shape"))
            values = unpack_int32(get(stored), self.num_bits, shape)
        else:
            values = get(stored).to(torch.int32)
        zero = get(f"{weight}_zero_point") if f"{weight}_zero_point" in self.where else None
        if zero is not None and stored.endswith("_packed"):  # packed along the rows
            rows, groups = values.shape[0], scale.shape[-1] if scale.dim() == 2 else 1
            zero = unpack_int32(zero.T.contiguous(), self.num_bits, (groups, rows)).T
        return dequantize_int(values, scale, zero)


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


def dequantize_int(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """(q - zero) * scale with one scale (and zero point) per group of columns (or per row),
    in float64 (exact: the caller rounds it once, to the model's dtype)."""
    rows, cols = values.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    if cols % groups:
        raise ValueError(f"a {rows} x {cols} weight cannot take {groups} scale groups a row")
    q = values.to(torch.float64).reshape(rows, groups, cols // groups)
    if zero is not None:
        if zero.numel() != rows * groups:
            raise ValueError(f"{tuple(zero.shape)} zero points for {rows} x {groups} groups")
        q = q - zero.to(torch.float64).reshape(rows, groups, 1)
    scaled = q * scale.to(torch.float64).reshape(rows, groups, 1)
    return scaled.reshape(rows, cols)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned integers packed 32 / bits to each int32 word of `words` (2-D), the first in
    the lowest bits, laid out along `dim` (0: a word holds rows, 1: columns); int64."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not pack whole into 32-bit words")
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    rows, cols = words.shape
    words = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(rows * per_word, cols)
    values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(rows, cols * per_word)


@dataclass(frozen=True)
class GroupedInts:
    """A GPTQ or AWQ module's weight as stored: value[n, k] = (q[k, n] - zeros[g, n]) *
    scales[g, n], g = group[k]."""

    q: torch.Tensor  # uint8 (K, N), unsigned
    zeros: torch.Tensor  # int64 (G, N)
    scales: torch.Tensor  # (G, N), as stored (float16 mostly)
    group: torch.Tensor  # int64 (K,)
    bits: int

    def __post_init__(self) -> None:
        num_groups = self.scales.shape[0]
        if self.zeros.shape != self.scales.shape:
            raise ValueError(
                f"zero points {tuple(self.zeros.shape)} against scales {tuple(self.scales.shape)}"
            )
        if self.group.numel() != self.q.shape[0]:
            raise ValueError(f"{self.group.numel()} group indices for {self.q.shape[0]} inputs")
        if self.group.numel() and (
            int(self.group.min()) < 0 or int(self.group.max()) >= num_groups
        ):
            raise ValueError(f"a group index outside the {num_groups} groups of its scales")

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight in float64, exact (the caller rounds it once)."""
        centred = (self.q.long() - self.zeros[self.group]).to(torch.float64)
        return (centred * self.scales.to(torch.float64)[self.group]).T.contiguous()

    def q4_blocks(self) -> BlockWeight | None:
        """The weight as q4 blocks (value = q * d + m a block of 32 inputs) where each block's
        inputs share a group (groups of whole blocks, as 128 makes them; activation order
        mostly does not) and the scales are float16 values: d = the scale bit for bit, m =
        -zero * scale rounded to float16 (within 2^-11 of it: closer to the stored values
        than int8 blocks' ~2^-8); None where they cannot hold it."""
        num_inputs, num_outputs = self.q.shape
        if self.bits != 4 or num_inputs % QK:
            return None
        block_groups = self.group.view(-1, QK)
        if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
            return None
        d = self.scales.to(torch.float16)
        m = (-self.zeros.to(torch.float64) * self.scales.to(torch.float64)).to(torch.float16)
        if not torch.equal(d.to(self.scales.dtype), self.scales) or not m.isfinite().all():
            return None
        of_block = block_groups[:, 0]
        d, m = d[of_block].T.contiguous(), m[of_block].T.contiguous()  # (N, K / 32)
        q = self.q.T.reshape(num_outputs, num_inputs // QK, QK)
        packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)  # low nibbles first
        qs = packed.reshape(num_outputs, -1)
        return BlockWeight("q4", qs, d.view(torch.int16), m.view(torch.int16))


def _groups(num_inputs: int, num_groups: int) -> torch.Tensor:
    """Each input column's group: k // group_size, the columns in num_groups equal groups."""
    if num_groups < 1 or num_inputs % num_groups:
        raise ValueError(f"{num_inputs} input columns cannot make {num_groups} equal groups")
    return torch.arange(num_inputs) // (num_inputs // num_groups)


def _bits_of(packed: int, values: int) -> int:
    """The bits per value of `values` integers packed into `packed` int32 words."""
    if values and (packed * 32) % values == 0 and (packed * 32) // values in (2, 4, 8):
        return (packed * 32) // values
    raise ValueError(f"{packed} words cannot hold {values} values of 2, 4 or 8 bits")


def read_gptq(
    qweight: torch.Tensor,
    *,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int | None,
    zero_offset: int,
) -> GroupedInts:
    """A GPTQ module's weight: qweight (K * bits / 32, N) packed along the inputs, qzeros (G,
    N * bits / 32) along the outputs (each + zero_offset), scales (G, N), g_idx (K,) the
    groups (None: K in G equal groups). The bits come from g_idx's length where it is stored
    (a per-module override), else from the config."""
    num_outputs = scales.shape[-1]
    if qweight.shape[-1] != num_outputs:
        raise ValueError(f"qweight {tuple(qweight.shape)} against scales {tuple(scales.shape)}")
    if g_idx is not None:
        bits = _bits_of(qweight.shape[0], g_idx.numel())
    if bits is None:
        raise ValueError("no bits in the quantization_config")
    q = unpack_words(qweight, bits, 0).to(torch.uint8)
    group = g_idx.long() if g_idx is not None else _groups(q.shape[0], scales.shape[0])
    if qzeros is None:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int64)
    else:
        zeros = unpack_words(qzeros, bits, 1)[:, :num_outputs] + zero_offset
    return GroupedInts(q, zeros, scales, group, bits)


def read_awq(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None
) -> GroupedInts:
    """An AWQ module's weight: qweight (K, N / 8) and qzeros (G, N / 8) packed along the
    outputs in AWQ's order, scales (G, N), K in G equal groups."""
    num_outputs = scales.shape[-1]
    if _bits_of(qweight.shape[-1], num_outputs) != 4:
        raise ValueError(f"qweight {tuple(qweight.shape)} is not 4-bit for {num_outputs} outputs")

    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = unpack_words(words, 4, 1)
        return values.reshape(values.shape[0], -1, 8)[:, :, _AWQ_COLUMNS].reshape(values.shape)

    q = unpack(qweight).to(torch.uint8)
    zeros = torch.full(scales.shape, 8, dtype=torch.int64) if qzeros is None else unpack(qzeros)
    return GroupedInts(q, zeros, scales, _groups(q.shape[0], scales.shape[0]), 4)


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
