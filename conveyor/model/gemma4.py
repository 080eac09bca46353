"""Gemma 4's layer (Gemma4ForCausalLM; the language model of Gemma4ForConditionalGeneration),
as transformers 5 computes it, from the parts model/llama.py's layers are made of.

What it adds to Gemma 3's layer (Parts: layer_heads, kv_sources, value_is_key, v_norm,
per_layer_input, mlp_sizes, moe_beside_mlp, layer_scalar):

- Attention with per-head q, k and weightless v norms and unscaled scores; the full-attention
  layers have their own head_dim and KV heads (each layer's cache has its own shape:
  worker/model_runner.py), turn a quarter of each head by their own RoPE ("proportional": the
  other frequencies are 0) and, with attention_k_eq_v, take the key projection's output as
  the value (normed without weight, not turned).
- The last num_kv_shared_layers compute no keys or values: each attends over the cache of the
  last earlier layer of its kind (sliding or full), whose keys and values of this step it is
  handed (StepState.kv), written again to the same slots (the same values) by the attention.
- Per-layer inputs (PLE): at the embedding, each token's row of a second embedding
  (num_layers x hidden_size_per_layer_input wide) plus a projection of its embedding, normed,
  gives each layer a small input; after its MLP the layer adds
  norm(per_layer_projection(act(per_layer_input_gate(x)) * input)) to the residual.
- A mixture of experts beside the MLP (the 26B-A4B): routed from the layer's residual input
  (RMS-normalised, times a stored scale and hidden_size ** -0.5; softmax of float32 logits,
  top-k renormalised, each weight times its expert's stored scale), its experts fed the
  residual through their own norm; each output through its own norm, then added.
- Each layer's output multiplied by a stored scalar.

The layers run as modules (no compiled layer): their projections still take the panel
kernels, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
import torch
from torch import nn

from conveyor.distributed.parallel import TPGroup
from conveyor.model.attention import AttentionKind, paged_attention
from conveyor.model.config import ModelConfig
from conveyor.model.families import SANDWICH_NORMS
from conveyor.model.layers import Linear, MergedLinear, RMSNorm
from conveyor.model.moe import MoEMLP, Routes, cpu_ops


class StepState(NamedTuple):
    """What a step's layers hand on: each layer's per-layer input (T, num_layers, width), or
    None; the keys and values each cache-owning layer wrote, by layer index."""

    per_layer: torch.Tensor | None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]


def _norm(size: int, eps: float) -> RMSNorm:
    """Gemma 4's RMSNorm: normalised in float32, times w in float32, then the cast."""
    return RMSNorm(size, eps, float32_scale=True)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalised over the last dim in float32, without a weight (Gemma 4's v_norm and
    router norm): the compiled row loop for float32 (times ones: the same bits)."""
    if x.dtype == torch.float32:
        ops = cpu_ops(x)
        if ops is not None:
            ones = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
            return ops.rms_norm(x.contiguous(), ones, eps)
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        self.index = index
        self.head_dim, self.num_kv_heads = parts.heads(index, (cfg.head_dim, cfg.num_kv_heads))
        self.num_heads = cfg.num_heads
        self.source = parts.kv_source(index)  # the layer whose cache it reads
        self.shared = self.source != index
        self.value_is_key = bool(parts.value_is_key) and parts.value_is_key[index]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        sizes = [q_size]
        if not self.shared:
            sizes += [kv_size] if self.value_is_key else [kv_size, kv_size]
            self.k_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_proj = MergedLinear(cfg.hidden_size, sizes, bias=False)
        self.o_proj = Linear(q_size, cfg.hidden_size)
        self.q_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.kind = AttentionKind(
            parts.scale(self.head_dim), parts.window(index), parts.attn_softcap
        )
        self.rope = parts.rope(index)

    def forward(self, x, ropes, rotaries, kv_cache, meta, state: StepState) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, *kv = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        rope, rotary = ropes[self.rope], rotaries[self.rope]
        if self.shared:
            k, v = state.kv[self.source]
            q, _ = rotary(
                q, q.new_empty(num_tokens, 0, self.head_dim), rope.cos, rope.sin, meta.ops
            )
        else:
            shape = (num_tokens, self.num_kv_heads, self.head_dim)
            k = kv[0].reshape(shape)
            v = unit_rms(k if self.value_is_key else kv[1].reshape(shape), self.eps)
            q, k = rotary(q, self.k_norm(k), rope.cos, rope.sin, meta.ops)
            state.kv[self.index] = k, v
        out = paged_attention(q, k, v, kv_cache, meta, self.kind)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, -1))


class Gemma4MoE(MoEMLP):
    """The mixture beside the MLP: MoEMLP's experts and top-k softmax router ("gate": the
    checkpoint's router.proj), routed from the residual input rather than the experts' own."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__(cfg, tp)
        self.router_scale = nn.Parameter(torch.empty(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(cfg.parts.num_experts))
        self.eps = cfg.rms_norm_eps
        self.root = cfg.hidden_size**-0.5

    def route_residual(self, residual: torch.Tensor) -> Routes:
        h = unit_rms(residual, self.eps) * self.router_scale * self.root
        routes = self.route(h)  # float32 weights, renormalised
        scale = self.per_expert_scale[routes.expert_ids]
        return Routes(routes.weights * scale, routes.expert_ids)


class Gemma4DecoderLayer(nn.Module):
    """input_layernorm -> attention -> post_attention_layernorm -> + x; pre_feedforward_layernorm
    -> MLP [-> post_feedforward_layernorm_1, + the experts' post_feedforward_layernorm_2] ->
    post_feedforward_layernorm -> + x; [+ the per-layer input's term]; times layer_scalar."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int, mlp: nn.Module) -> None:
        """mlp: the dense MLP (model/llama.py's, of this layer's width: Parts.mlp_sizes)."""
        super().__init__()
        parts, hidden, eps = cfg.parts, cfg.hidden_size, cfg.rms_norm_eps
        self.index = index
        for _, name in SANDWICH_NORMS:
            self.add_module(name, _norm(hidden, eps))
        self.self_attn = Gemma4Attention(cfg, tp, index)
        self.mlp = mlp
        self.act = parts.act
        self.moe: Gemma4MoE | None = None
        if parts.moe_beside_mlp:
            self.moe = Gemma4MoE(cfg, tp)
            for name in (
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ):
                self.add_module(name, _norm(hidden, eps))
        self.per_layer = parts.per_layer_input[0]
        if self.per_layer:
            self.per_layer_input_gate = Linear(hidden, self.per_layer)
            self.per_layer_projection = Linear(self.per_layer, hidden)
            self.post_per_layer_input_norm = _norm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1))

    def compiled(self, ops):
        return None  # no compiled form: the model runs its modules

    def forward(self, x, ropes, rotaries, kv_cache, meta, state: StepState) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), ropes, rotaries, kv_cache, meta, state)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            routes = self.moe.route_residual(x)
            experts = self.moe(self.pre_feedforward_layernorm_2(x), routes)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(experts)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            gate = activation(self.act, self.per_layer_input_gate(x))
            h = self.per_layer_projection(gate * state.per_layer[:, self.index])
            x = x + self.post_per_layer_input_norm(h)
        return x * self.layer_scalar


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """act(x) of a (T, W) matrix (gelu_tanh or silu), each row's values the same bits whatever
    T (whole_vectors)."""
    if name == "gelu_tanh":
        return whole_vectors(lambda h: nn.functional.gelu(h, approximate="tanh"), x)
    return whole_vectors(nn.functional.silu, x)


def whole_vectors(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), an elementwise function of a (T, W) matrix, each row's values the same bits
    whatever T: ATen computes a contiguous tensor's last elements (past its last whole pair of
    vectors) with the scalar function, whose bits may differ from the vector one's, so rows
    are padded to a multiple of 64 values (every row whole vectors) where W is not."""
    width = x.shape[-1]
    pad = -width % 64
    if pad:
        x = nn.functional.pad(x, (0, pad))
    out = fn(x)
    return out[:, :width] if pad else out


class BlockRows(nn.Module):
    """A GGUF's per-layer embedding kept in its blocks (a memory map of the file: Q6_K, 1.9 GB
    for gemma-4-E2B, against 9.4 GB as float32): the rows a step reads dequantized then, the
    values of the tensor dequantized whole (blocks run along a row)."""

    def __init__(self, qtype, data) -> None:
        """qtype: its gguf.GGMLQuantizationType; data: (rows, bytes a row) uint8."""
        super().__init__()
        self.qtype, self.data = qtype, data

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.data[input_ids.cpu().numpy()]
        values = gguf.quants.dequantize(rows, self.qtype).reshape(len(rows), -1)
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(input_ids.device)


def add_per_layer_inputs(model: nn.Module, cfg: ModelConfig) -> None:
    """Gemma 4's per-layer input modules on the text model, under its names."""
    width, vocab = cfg.parts.per_layer_input
    total = cfg.num_layers * width
    model.embed_tokens_per_layer = nn.Embedding(vocab, total, _weight=torch.empty(vocab, total))
    model.per_layer_model_projection = Linear(cfg.hidden_size, total)
    model.per_layer_projection_norm = _norm(width, cfg.rms_norm_eps)


def per_layer_inputs(
    model: nn.Module, cfg: ModelConfig, input_ids, embeds, rounded_scales: bool = False
) -> torch.Tensor:
    """(T, num_layers, width): transformers' get_per_layer_inputs and project_per_layer_inputs
    of the step's tokens and their (scaled) embeddings. rounded_scales: the projection's and
    the sum's scales rounded to the model dtype first (Gemma 3n keeps them as tensors; Gemma
    4 as Python floats, which a 16-bit product takes unrounded)."""
    width = cfg.parts.per_layer_input[0]
    shape = (input_ids.shape[0], cfg.num_layers, width)
    # The rows in the table's dtype (mapped from the checkpoint's file as stored: loader.py),
    # then the model's: the values of a table converted whole.
    tokens = model.embed_tokens_per_layer(input_ids).to(embeds.dtype)
    scale = torch.tensor(width**0.5, dtype=tokens.dtype)  # in the model dtype, as the embedding's
    tokens = (tokens * scale).reshape(shape)
    first, second = cfg.hidden_size**-0.5, 2.0**-0.5
    if rounded_scales:
        first, second = (torch.tensor(s, dtype=embeds.dtype) for s in (first, second))
    projected = model.per_layer_model_projection(embeds) * first
    projected = model.per_layer_projection_norm(projected.reshape(shape))
    return (projected + tokens) * second
