"""ModernBERT encoders (gte-modernbert, modernbert-embed, granite-embedding r2, the
gte-reranker-modernbert cross-encoders), as transformers' ModernBertModel and
ModernBertForSequenceClassification compute them; served as the BERT family is (model/bert.py:
each sequence whole in one step, the step's rows sharing the projections on the batch-invariant
panel kernels, attention and the activation per sequence).

Pre-norm layers (LayerNorm, no bias by default; the first layer's attention takes the embeddings
unnormed), q/k/v fused (Wqkv), RoPE on q and k (rotate-half; one base for the global layers,
another for the local ones), bidirectional attention that on the local layers sees the tokens
within `local_attention / 2` positions on either side, a gated MLP (act(input) * gate, Wi's two
halves), a final norm. The classifier pools the first token or the mean of all, then a head
(dense, activation, norm) and a linear classifier.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from conveyor.model.bert import Encoder, attend, packed_for_cpu
from conveyor.model.config import ModelConfig
from conveyor.model.layers import MergedLinear


def _norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=cfg.parts.norm_bias)


def _activation(name: str):
    approximate = "tanh" if name == "gelu_tanh" else "none"
    return lambda x: nn.functional.gelu(x, approximate=approximate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        parts, hidden = cfg.parts, cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.window = parts.window(index)  # 0: every token; else |i - j| <= window
        self.rope = parts.rope(index)
        self.attn_norm = _norm(cfg) if index > 0 else None
        self.Wqkv = MergedLinear(hidden, [hidden] * 3, bias=cfg.qkv_bias)
        self.Wo = MergedLinear(hidden, [hidden], bias=parts.o_bias)
        self.mlp_norm = _norm(cfg)
        self.Wi = MergedLinear(hidden, [cfg.intermediate_size] * 2, bias=parts.mlp_bias)
        self.mlp_Wo = MergedLinear(cfg.intermediate_size, [hidden], bias=parts.mlp_bias)
        self.act = _activation(parts.act)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]], ropes: list) -> torch.Tensor:
        normed = x if self.attn_norm is None else self.attn_norm(x)
        qkv = self.Wqkv(normed)
        context = torch.empty_like(x)
        cos, sin = ropes[self.rope]
        for a, b in bounds:
            self._attention(qkv[a:b], cos[a:b], sin[a:b], context[a:b])
        x = x + self.Wo(context)
        h = self.Wi(self.mlp_norm(x))
        size = h.shape[1] // 2
        # the activation per sequence (model/bert.py says why)
        gated = torch.cat([self.act(h[a:b, :size]) * h[a:b, size:] for a, b in bounds])
        return x + self.mlp_Wo(gated)

    def _attention(self, qkv, cos, sin, out: torch.Tensor) -> None:
        length = out.shape[0]
        mask = None
        if self.window and length > self.window + 1:  # the local layers: |i - j| <= window
            where = torch.arange(length, device=qkv.device)
            mask = (where[:, None] - where[None, :]).abs() <= self.window
        attend(qkv, out, self.num_heads, lambda t: _rotate(t, cos, sin), mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' ModernBERT turns q and k: x taken to
    float32 first (in a float64 model too), the products in the promoted dtype, the result
    back in x's."""
    wide = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-wide[..., half:], wide[..., :half]), dim=-1)
    return (wide * cos + rotated * sin).to(x.dtype)


class ModernBertEncoder(Encoder):
    """Embeddings, layers, final norm and (a classifier's) head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embeddings_norm = _norm(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)
        self.inv_freqs = [cfg.rope_inv_freq, cfg.parts.local_rope_inv_freq]
        self.head_dense = self.head_norm = self.classifier = None
        if cfg.classifier is not None:
            parts = cfg.parts
            self.head_dense = MergedLinear(cfg.hidden_size, [cfg.hidden_size], parts.head_bias)
            self.head_norm = _norm(cfg)
            self.classifier = MergedLinear(cfg.hidden_size, [cfg.classifier.num_labels], bias=True)

    def _encode(self, input_ids, positions, bounds) -> torch.Tensor:
        dtype = self.tok_embeddings.weight.dtype
        ropes = [_cos_sin(freqs, positions, dtype) for freqs in self.inv_freqs if freqs]
        x = self.embeddings_norm(self.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(x, bounds, ropes)
        return self.final_norm(x)

    def classify_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """(1, labels): a sequence's rows pooled (its first token, or the mean of all) through
        the head and the classifier."""
        if self.classifier is None:
            raise ValueError("this model has no classifier head")
        first = self.config.parts.classifier_pooling == "cls"
        pooled = hidden[:1] if first else hidden.mean(dim=0, keepdim=True)
        act = _activation(self.config.parts.classifier_act)
        return self.classifier(self.head_norm(act(self.head_dense(pooled))))

    def place(self, stored: str, tensor: torch.Tensor, params: dict) -> str | None:
        name = _name(stored, self.classifier is not None)
        return None if name is None else self.copy(params, stored, name, tensor)


def _cos_sin(inv_freq, positions: torch.Tensor, dtype: torch.dtype):
    """(L, 1, head_dim) cos and sin of each position, in float32 as transformers computes
    them, then cast to the model's dtype; broadcast over the heads of (heads, L, head_dim)."""
    freqs = positions.float()[:, None] * torch.tensor(inv_freq, dtype=torch.float32)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _name(stored: str, classifier: bool) -> str | None:
    """This module's parameter name of a stored ModernBERT tensor; None: not read."""
    name = stored.removeprefix("model.")
    if name.startswith(("head.", "classifier.")):
        if not classifier:
            return None
        return name.replace("head.dense.", "head_dense.").replace("head.norm.", "head_norm.")
    if name.startswith(("decoder.", "lm_head.")):
        return None  # a masked LM's head
    name = name.replace("embeddings.tok_embeddings.", "tok_embeddings.")
    name = name.replace("embeddings.norm.", "embeddings_norm.")
    return (
        name.replace(".mlp.Wi.", ".Wi.")
        .replace(".mlp.Wo.", ".mlp_Wo.")
        .replace(".attn.Wqkv.", ".Wqkv.")
        .replace(".attn.Wo.", ".Wo.")
    )


def load_modernbert(
    cfg: ModelConfig, device: torch.device, weights: Iterable[tuple[str, torch.Tensor]]
) -> ModernBertEncoder:
    with torch.device(device):
        model = ModernBertEncoder(cfg).to(cfg.dtype)
    model.load_weights(weights)
    return packed_for_cpu(model, cfg, device)
