"""The modules that replace the float projections and embeddings (same call interface as
layers.Linear / MergedLinear), holding their blocks and, once packed, their panels."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from conveyor.model.quant.formats import BlockWeight
from conveyor.model.quant.ops import (
    DEQUANT_FROM_TOKENS,
    INT8_FROM_TOKENS,
    OUTLIER_RATIO,
    block_linear,
    int8_linear,
    kernels,
    pack_int8,
)

# --------------------------------------------------------------------------- modules


def error_weights(weight: BlockWeight) -> torch.Tensor:
    """Per output row n, max over its blocks b of |d_nb| * sum_k |q_nk| + 32 |m_nb| (q4: q in
    0..15): int8 activations with a per-block scale xd_b put a value of x @ W^T off by at most
    sum_b (xd_b / 2) times this (kernels/gemm/panel_gemm.cpp: block_argmax)."""
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
        """Packs the blocks for the panel kernels (kernels/gemm/panel_gemm.cpp): from then on every
        row count runs one kernel with one reduction order per output value."""
        m = self.m if self.format == "q4" else None
        self.panels = ops.pack_blocks(self.qs, self.d, m, float_acts=self.float_acts)
        if self.float_acts and self.bias is None:  # the lm_head: greedy rows' argmax (below)
            int8_panels = ops.pack_blocks(self.qs, self.d, m, float_acts=False)
            self.argmax_panels = (int8_panels[0], error_weights(self.weight_blocks))

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(x), the first of equal maxima as torch.argmax picks,
        without computing every value in float: the int8 panels' approximate values, then the
        float kernel on the columns their error bound leaves in the running (gemm/panel_gemm.cpp:
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
