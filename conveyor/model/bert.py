"""The BERT family of encoders (BERT, RoBERTa, XLM-RoBERTa): sentence embedders and
cross-encoder rerankers (all-MiniLM, bge, e5, bge-m3, ms-marco-MiniLM, bge-reranker), as
transformers' BertModel / XLMRobertaModel and their *ForSequenceClassification compute them.

An encoder's attention is bidirectional: every token sees its whole sequence, so a sequence
runs whole in one step (the scheduler never chunks it, engine/config.py), and nothing is
cached between steps: the KV cache the engine holds goes unread. The step's rows share the
projections, on the batch-invariant panel kernels on the CPU (every output value one chain of
FMAs, whatever the row count: layers.pack_panels); attention and the GELU run per sequence, and
the norms per row, so a sequence's embedding and scores are the same bits alone or batched.

Embeddings (post-norm layers): word + position + token type rows, LayerNorm. RoBERTa numbers
positions from padding_idx + 1. The token type of a pair's second text (BERT's cross-encoders)
is 1 from the token after the first [SEP] on, as BERT's tokenizer marks a pair; a single text
is all type 0. A layer: self-attention (biased q, k, v, o), then LayerNorm(x + attention);
the MLP (GELU), then LayerNorm(x + MLP).

The classifier head reads the first token ([CLS] / <s>): BERT's pooler (dense, tanh) then its
classifier; RoBERTa's classifier.dense, tanh, classifier.out_proj: the same arithmetic, loaded
under one pair of names here (head_dense, head_out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from conveyor.model.attention import AttentionMetadata
from conveyor.model.config import ModelConfig
from conveyor.model.layers import MergedLinear, pack_panels

ENCODER_FAMILIES = ("bert", "roberta")
# Stored name prefixes of the encoder proper (a *ForSequenceClassification or *ForMaskedLM
# checkpoint's); a BertModel saved alone (sentence-transformers) has none.
_PREFIXES = ("bert.", "roberta.", "model.")
# Stored tensors that are not the encoder's: a masked LM's head, position ids buffers.
_UNUSED = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
# Longer sequences attend through torch's fused attention (flash: O(L) memory; bge-m3 takes
# 8192 tokens, whose (heads, L, L) scores would be 4 GiB); shorter ones through batched
# matmuls, faster at a few hundred tokens. Chosen by the sequence's own length: batch-invariant.
MATMUL_ATTENTION_TOKENS = 1024
_HEAD_NAMES = {
    "pooler.dense.weight": "head_dense.weight",
    "pooler.dense.bias": "head_dense.bias",
    "classifier.dense.weight": "head_dense.weight",
    "classifier.dense.bias": "head_dense.bias",
    "classifier.out_proj.weight": "head_out.weight",
    "classifier.out_proj.bias": "head_out.bias",
    "classifier.weight": "head_out.weight",
    "classifier.bias": "head_out.bias",
}


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = MergedLinear(hidden, [hidden] * 3, bias=True)
        self.attention_out = MergedLinear(hidden, [hidden], bias=True)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = MergedLinear(hidden, [cfg.intermediate_size], bias=True)
        self.output = MergedLinear(cfg.intermediate_size, [hidden], bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)
        self.approximate = "tanh" if cfg.parts.act == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """x: (T, hidden), the step's sequences one after another, [a, b) each."""
        qkv = self.qkv(x)
        context = torch.empty_like(x)
        for a, b in bounds:
            self._attention(qkv[a:b], context[a:b])
        x = self.attention_norm(self.attention_out(context) + x)
        h = self.intermediate(x)
        # GELU per sequence, in place: an elementwise op's vector loop leaves a tail to its
        # scalar form where its range ends, which would fall elsewhere in a larger tensor
        for a, b in bounds:
            torch.ops.aten.gelu_(h[a:b], approximate=self.approximate)
        return self.output_norm(self.output(h) + x)

    def _attention(self, qkv: torch.Tensor, out: torch.Tensor) -> None:
        attend(qkv, out, self.num_heads)


def attend(
    qkv: torch.Tensor,
    out: torch.Tensor,
    num_heads: int,
    rotate: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mask: torch.Tensor | None = None,
) -> None:
    """One sequence's bidirectional attention into `out` (L, hidden) from its fused q, k, v
    rows (L, 3 hidden): softmax(q k^T / sqrt(head_dim)) v per head, q and k turned by `rotate`
    first, keys outside `mask` (L, L; True: seen) hidden. As batched matmuls up to
    MATMUL_ATTENTION_TOKENS (at a few hundred tokens faster here than the fused kernel, which
    pays for tiling a short sequence), through the fused kernel past it or with a mask."""
    length, hidden = out.shape
    head_dim = hidden // num_heads
    q, k, v = (
        qkv[:, i * hidden : (i + 1) * hidden].reshape(length, num_heads, head_dim).transpose(0, 1)
        for i in range(3)
    )  # (heads, L, head_dim)
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    if length > MATMUL_ATTENTION_TOKENS or mask is not None:  # no (L, L) scores kept
        context = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(head_dim**-0.5)
        context = torch.bmm(torch.softmax(scores, dim=-1), v)
    out.view(length, num_heads, head_dim).copy_(context.transpose(0, 1))


class Encoder(nn.Module):
    """What every encoder (this module's, model/modernbert.py's) shows the runner: forward
    returns every token's final hidden state, a step's sequences one after another, as a
    decoder's forward does; classify_sequence(rows) pools a sequence's rows through the
    head; no logits. A subclass defines _encode and place (a stored tensor into its
    parameters)."""

    prompt_route = False
    lora = None
    per_sequence = False  # each sequence's rows through the projections alone (packed_for_cpu)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,): 0 .. L - 1 within each sequence, which runs whole
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        del kv_caches  # nothing is cached: a sequence runs whole, in one step
        return encode_step(self, input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder generates no tokens")

    def greedy_tokens(self, hidden: torch.Tensor) -> None:
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = {self.place(stored, tensor, params) for stored, tensor in weights}
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {type(self).__name__} weights: {missing[:5]}")

    def place(self, stored: str, tensor: torch.Tensor, params: dict) -> str | None:
        """Copies a stored tensor into its parameter; returns the parameter's name once it is
        whole (None: not read, or a part of it)."""
        raise NotImplementedError

    @staticmethod
    def copy(params: dict, stored: str, target: str, tensor: torch.Tensor) -> str:
        if target not in params:
            raise ValueError(f"unexpected encoder weight {stored!r} ({target})")
        if params[target].shape != tensor.shape:
            raise ValueError(f"{stored}: shape {tuple(tensor.shape)}, not {params[target].shape}")
        params[target].data.copy_(tensor)
        return target


class EncoderModel(Encoder):
    """BERT / RoBERTa: the encoder and (a classifier's) head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        parts = cfg.parts
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        positions = cfg.max_model_len + parts.position_offset
        self.position_embeddings = nn.Embedding(positions, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(parts.type_vocab_size, 1), cfg.hidden_size)
        self.embeddings_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self._shards: set[tuple[str, int]] = set()  # the q / k / v rows placed (place)
        self.head_dense = self.head_out = None
        if cfg.classifier is not None:
            self.head_dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.head_out = nn.Linear(cfg.hidden_size, cfg.classifier.num_labels)

    def _encode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        types = torch.cat([self._token_types(input_ids[a:b]) for a, b in bounds])
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(types)
            + self.position_embeddings(positions + self.config.parts.position_offset)
        )
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x, bounds)
        return x

    def _token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """A sequence's token types: a pair's second text is type 1 from the token after the
        first separator on (as BERT's tokenizer marks a pair); 0 everywhere otherwise."""
        parts = self.config.parts
        if parts.type_vocab_size < 2 or parts.sep_token_id < 0:
            return torch.zeros_like(ids)
        seps = (ids == parts.sep_token_id).to(torch.int64)
        return (torch.cumsum(seps, 0) - seps).clamp_(max=1)

    def classify_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """(1, labels): the head on a sequence's first token's final hidden state (its rows
        given whole, as the runner gives an encoder's)."""
        if self.head_dense is None:
            raise ValueError("this model has no classifier head")
        return self.head_out(torch.tanh(self.head_dense(hidden[:1])))

    def place(self, stored: str, tensor: torch.Tensor, params: dict) -> str | None:
        target = encoder_name(stored, self.head_dense is not None)
        if target is None:
            return None
        if ".qkv." not in target:
            return self.copy(params, stored, target, tensor)
        # query, key, value: the rows of one fused projection, whole once all three came
        module, _, kind = target.rpartition(".")
        index = ("query", "key", "value").index(stored.split(".")[-2])
        self.get_submodule(module).load_shard(index, kind, tensor)
        self._shards.add((target, index))
        return target if all((target, i) in self._shards for i in range(3)) else None


def encode_step(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """An encoder's step: its sequences' rows [a, b), each whole from position 0, through
    model._encode(ids, positions, bounds): all rows at once, or each sequence alone where the
    model's projections would reduce a row by the row count (per_sequence)."""
    starts = meta.query_start.tolist()
    bounds = list(zip(starts[:-1], starts[1:], strict=True))
    if any(int(positions[a]) != 0 for a, _ in bounds):
        raise ValueError("an encoder's sequence runs whole, from its first token")
    if model.per_sequence and len(bounds) > 1:
        return torch.cat(
            [model._encode(input_ids[a:b], positions[a:b], [(0, b - a)]) for a, b in bounds]
        )
    return model._encode(input_ids, positions, bounds)


def packed_for_cpu(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """The loaded encoder with its projections packed for the batch-invariant panel kernels
    on the CPU; weights those do not take (bfloat16, float16) make it run each sequence's
    projections alone (torch's matmul for a given row count reduces in its own order)."""
    if cfg.batch_invariant and device.type == "cpu":
        pack_panels(model)  # every row's projections one chain of FMAs, whatever the batch
        projections = [m for m in model.modules() if isinstance(m, MergedLinear)]
        model.per_sequence = any(m.panels is None for m in projections)
    return model.eval()


def encoder_name(stored: str, classifier: bool) -> str | None:
    """This module's parameter name of a stored BERT / RoBERTa tensor; None: not read."""
    name = stored
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    if name in _HEAD_NAMES:
        return _HEAD_NAMES[name] if classifier else None
    if name.startswith(_UNUSED) or name.startswith("pooler."):
        return None  # a BertModel's pooler serves no embedding
    name = name.replace("embeddings.LayerNorm.", "embeddings_norm.").removeprefix("embeddings.")
    if name.startswith("encoder.layer."):
        index, _, rest = name.removeprefix("encoder.layer.").partition(".")
        for old, new in _LAYER_NAMES:
            if rest.startswith(old):
                return f"layers.{index}.{new}{rest.removeprefix(old)}"
    return name


_LAYER_NAMES = (
    ("attention.self.query.", "qkv."),
    ("attention.self.key.", "qkv."),
    ("attention.self.value.", "qkv."),
    ("attention.output.dense.", "attention_out."),
    ("attention.output.LayerNorm.", "attention_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
    ("output.LayerNorm.", "output_norm."),
)


def load_encoder(
    cfg: ModelConfig, device: torch.device, weights: Iterable[tuple[str, torch.Tensor]]
) -> EncoderModel:
    """The encoder on `device`, in cfg.dtype, its weights read from `weights` (the
    checkpoint's, model/loader.py)."""
    with torch.device(device):
        model = EncoderModel(cfg).to(cfg.dtype)
    model.load_weights(_weights(weights))
    return packed_for_cpu(model, cfg, device)


def _weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # Old BERT checkpoints name LayerNorm's weight and bias gamma and beta.
    for name, tensor in weights:
        yield (
            name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            ),
            tensor,
        )
