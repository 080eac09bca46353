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

from conveyor.model.attention import AttentionMetadata
from conveyor.model.bert import MATMUL_ATTENTION_TOKENS
from conveyor.model.config import ModelConfig
from conveyor.model.layers import MergedLinear, pack_panels


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
        length, hidden = out.shape
        q, k, v = (
            qkv[:, i * hidden : (i + 1) * hidden]
            .reshape(length, self.num_heads, self.head_dim)
            .transpose(0, 1)
            for i in range(3)
        )  # (heads, L, head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        mask = None
        if self.window and length > self.window + 1:
            where = torch.arange(length, device=qkv.device)
            mask = (where[:, None] - where[None, :]).abs() <= self.window
        if length > MATMUL_ATTENTION_TOKENS or mask is not None:
            context = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(self.head_dim**-0.5)
            context = torch.bmm(torch.softmax(scores, dim=-1), v)
        out.view(length, self.num_heads, self.head_dim).copy_(context.transpose(0, 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as transformers' ModernBERT turns q and k: x taken to
    float32 first (in a float64 model too), the products in the promoted dtype, the result
    back in x's."""
    wide = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-wide[..., half:], wide[..., :half]), dim=-1)
    return (wide * cos + rotated * sin).to(x.dtype)


class ModernBertEncoder(nn.Module):
    """Embeddings, layers, final norm and (a classifier's) head; forward returns every
    token's final hidden state, the step's sequences one after another."""

    prompt_route = False
    lora = None
    per_sequence = False

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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        del kv_caches  # nothing is cached: a sequence runs whole, in one step
        starts = meta.query_start.tolist()
        bounds = list(zip(starts[:-1], starts[1:], strict=True))
        if any(int(positions[a]) != 0 for a, _ in bounds):
            raise ValueError("an encoder's sequence runs whole, from its first token")
        if self.per_sequence and len(bounds) > 1:
            return torch.cat(
                [self._encode(input_ids[a:b], positions[a:b], [(0, b - a)]) for a, b in bounds]
            )
        return self._encode(input_ids, positions, bounds)

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
        pooled = hidden[:1] if self.config.parts.classifier_pooling == "cls" else None
        if pooled is None:
            pooled = hidden.mean(dim=0, keepdim=True)
        act = _activation(self.config.parts.classifier_act)
        return self.classifier(self.head_norm(act(self.head_dense(pooled))))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder generates no tokens")

    def greedy_tokens(self, hidden: torch.Tensor) -> None:
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for stored, tensor in weights:
            name = _name(stored, self.classifier is not None)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"unexpected ModernBERT weight {stored!r} ({name})")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{stored}: shape {tuple(tensor.shape)}, not {params[name].shape}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks ModernBERT weights: {missing[:5]}")


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
    if cfg.batch_invariant and device.type == "cpu":
        pack_panels(model)
        projections = [m for m in model.modules() if isinstance(m, MergedLinear)]
        model.per_sequence = any(m.panels is None for m in projections)
    return model.eval()
