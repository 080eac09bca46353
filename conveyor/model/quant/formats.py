"""The block formats: a weight (N, K) in blocks of 32 input elements, one fp16 scale per
block (the package docstring, conveyor/model/quant/__init__.py, describes q4 and q8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # elements per block
FORMATS = ("q4", "q8")

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
