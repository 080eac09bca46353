"""Paged attention for one whole step.

Every layer first writes the step's new K/V into the cache through `slot_mapping`
(slot = block_id * block_size + offset), then attends, all rows of the step in one call.

The cache of one layer is a tensor (2, num_blocks, num_kv_heads, block_size * head_dim): one
(block, kv head) tile is contiguous; keys are stored transposed in it, (head_dim, block_size),
values as (block_size, head_dim). That is the layout the compiled CPU kernel reads in place
(see kernels/attention/paged_attention.cpp); `key_blocks` / `value_blocks` give its shaped views.

Two implementations of the same op:
  - the compiled kernel (CPU, float32/float64; a float16/bfloat16/fp8 cache for float32 models):
    varlen over all rows, no copies of the cache;
  - the reference in PyTorch, the readable oracle and the path for CUDA, other dtypes or when
    no compiler is present: decode rows as one batch over a padded gather of their blocks,
    masked past each sequence's length; prompt chunks one at a time, causally, over the cached
    context plus the chunk.
Everything that is the same for all layers is in AttentionMetadata, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from conveyor.model.recurrent import RecurrentRows


class AttentionKind(NamedTuple):
    """What a layer's attention computes besides softmax(q k^T scale) v over earlier keys."""

    scale: float  # head_dim ** -0.5, or the family's (query_pre_attn_scalar, a multiplier)
    window: int = 0  # sliding window: a row at position p sees keys (p - window, p]; 0: all
    softcap: float = 0.0  # scores -> tanh(s / softcap) * softcap before the softmax; 0: none


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the step's flattened tokens
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # (num_blocks,) int64


@dataclass(slots=True)
class ReferencePlan:
    """The step split the way the reference ops run it."""

    decode_rows: torch.Tensor  # (B,) rows of the decode tokens
    decode_block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    decode_seq_lens: torch.Tensor  # (B,) int64, tokens to attend (cached + this one)
    prefills: list[PrefillChunk]

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.numel()


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    query_start: torch.Tensor  # (S + 1,) int64: rows of sequence s are [qs[s], qs[s + 1])
    seq_lens: torch.Tensor  # (S,) int64: cached + new tokens of each sequence
    block_tables: torch.Tensor  # (S, max_blocks) int64, padded with 0
    block_size: int
    ops: ModuleType | None  # the compiled kernels; None -> the reference ops
    reference: ReferencePlan | None  # set when ops is None
    # The kernel may split a step's few decode rows by key blocks (flash-decoding); a
    # batch-invariant model does not let it, so a row's keys add up in one order.
    split_keys: bool = True
    # [begin, end) pairs, flat: the rows that are prompt tokens, for a model whose prompt
    # tokens take a route of their own (model/prompt_route.py).
    prompt_rows: list[int] = field(default_factory=list)
    # A hybrid's recurrent layers: each sequence's state slot and rows (model/recurrent.py).
    recurrent: RecurrentRows | None = None
    # KV groups (model/kv_groups.py), where the layers read more than one group's tables: each
    # group's metadata (its slots and block tables; this one the first) and each layer's group.
    # Empty: every layer reads this one.
    groups: list[AttentionMetadata] = field(default_factory=list)
    layer_groups: list[int] = field(default_factory=list)

    def layer(self, index: int) -> AttentionMetadata:
        """The metadata layer `index` attends with."""
        return self.groups[self.layer_groups[index]] if self.groups else self

    def every_group(self) -> list[AttentionMetadata]:
        return self.groups or [self]


def build_metadata(
    query_lens: np.ndarray,  # (S,) int64 new tokens per sequence, rows in this order
    context_lens: np.ndarray,  # (S,) int64 tokens already cached
    block_tables: np.ndarray,  # (S, W) int64
    slot_mapping: np.ndarray,  # (T,) int64
    block_size: int,
    device: torch.device,
    ops: ModuleType | None,
    split_keys: bool = True,
) -> AttentionMetadata:
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    seq_lens = context_lens + query_lens
    meta = AttentionMetadata(
        slot_mapping=_tensor(slot_mapping, device),
        query_start=_tensor(query_start, device),
        seq_lens=_tensor(seq_lens, device),
        block_tables=_tensor(block_tables, device),
        block_size=block_size,
        ops=ops,
        reference=None,
        split_keys=split_keys,
    )
    if ops is None:
        meta.reference = _reference_plan(
            query_start, seq_lens, block_tables, meta.block_tables, block_size
        )
    return meta


def group_metadata(
    meta: AttentionMetadata,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
) -> AttentionMetadata:
    """Another KV group's metadata for the step of `meta` (built by build_metadata from the
    same query_lens and context_lens; model/kv_groups.py): its own block tables (S, W) and
    slots, the rest shared."""
    tables = _tensor(block_tables, meta.block_tables.device)
    reference = None
    if meta.ops is None:  # the plan from the host's arrays: no copy back from the device
        query_start = np.concatenate([[0], np.cumsum(query_lens)])
        seq_lens = context_lens + query_lens
        reference = _reference_plan(query_start, seq_lens, block_tables, tables, meta.block_size)
    return replace(
        meta, slot_mapping=_tensor(slot_mapping, tables.device), block_tables=tables,
        reference=reference, groups=[], layer_groups=[],
    )  # fmt: skip


def _reference_plan(query_start, seq_lens, block_tables, tables, block_size) -> ReferencePlan:
    device = tables.device
    query_lens = np.diff(query_start)
    decode = query_lens == 1
    width = -(-int(seq_lens[decode].max(initial=0)) // block_size)
    prefills = [
        PrefillChunk(
            int(query_start[i]),
            int(query_start[i + 1]),
            int(seq_lens[i] - query_lens[i]),
            tables[i, : -(-int(seq_lens[i]) // block_size)],
        )
        for i in np.flatnonzero(~decode)
    ]
    return ReferencePlan(
        decode_rows=_tensor(query_start[:-1][decode], device),
        decode_block_tables=_tensor(block_tables[decode, :width], device),
        decode_seq_lens=_tensor(seq_lens[decode], device),
        prefills=prefills,
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def key_blocks(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    num_blocks, num_kv_heads, tile = kv_cache.shape[1:]
    return kv_cache[0].view(num_blocks, num_kv_heads, head_dim, tile // head_dim)


def value_blocks(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    num_blocks, num_kv_heads, tile = kv_cache.shape[1:]
    return kv_cache[1].view(num_blocks, num_kv_heads, tile // head_dim, head_dim)


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kind: AttentionKind,
    sinks: torch.Tensor | None = None,  # (H,): GPT-OSS's per-head logits that join the softmax
) -> torch.Tensor:  # (T, H, D)
    if meta.ops is None:
        return reference_paged_attention(q, k, v, kv_cache, meta, kind, sinks)
    meta.ops.write_kv(k, v, kv_cache, meta.slot_mapping, meta.block_size)
    return meta.ops.paged_attention(
        q,
        kv_cache,
        meta.block_size,
        meta.query_start,
        meta.seq_lens,
        meta.block_tables,
        kind.scale,
        meta.split_keys,
        window=kind.window,
        softcap=kind.softcap,
        sinks=None if sinks is None else sinks.detach(),
    )


def reference_paged_attention(
    q, k, v, kv_cache, meta: AttentionMetadata, kind: AttentionKind, sinks=None
) -> torch.Tensor:
    plan = meta.reference
    write_kv(kv_cache, k, v, meta.slot_mapping, meta.block_size)
    out = torch.empty_like(q)
    if plan.num_decodes:
        out[plan.decode_rows] = _decode_attention(q[plan.decode_rows], kv_cache, plan, kind, sinks)
    for chunk in plan.prefills:
        rows = slice(chunk.start, chunk.end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk, kind, sinks)
    return out


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # its largest finite value; torch's conversion turns anything beyond into NaN


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, block_size: int
) -> None:
    head_dim = k.shape[-1]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
    if kv_cache.dtype == FP8:  # indexed writes of fp8 go through its bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    key_blocks(kv_cache, head_dim)[blocks, :, :, offsets] = k  # indexed view: (T, Hkv, D)
    value_blocks(kv_cache, head_dim)[blocks, :, offsets, :] = v


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: rounded to nearest even; for fp8 e4m3, clamped to
    its range first (the compiled write does the same)."""
    if dtype == FP8:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def _gather(kv_cache: torch.Tensor, tables: torch.Tensor, head_dim: int, dtype: torch.dtype):
    """Keys and values of the blocks in `tables` (..., N) as (..., Hkv, N * block_size, D),
    converted to `dtype` (the query's: a half cache is computed with in the model dtype)."""
    keys = key_blocks(kv_cache, head_dim)[tables]  # (..., N, Hkv, D, bs)
    values = value_blocks(kv_cache, head_dim)[tables]  # (..., N, Hkv, bs, D)
    keys = keys.transpose(-1, -2).transpose(-3, -4)  # (..., Hkv, N, bs, D)
    values = values.transpose(-3, -4)
    return keys.flatten(-3, -2).to(dtype), values.flatten(-3, -2).to(dtype)


def _decode_attention(q, kv_cache, plan: ReferencePlan, kind: AttentionKind, sinks=None):
    tables = plan.decode_block_tables  # (B, N)
    keys, values = _gather(kv_cache, tables, q.shape[-1], q.dtype)  # (B, Hkv, L, D)
    positions = torch.arange(keys.shape[2], device=q.device)[None, :]
    seq_lens = plan.decode_seq_lens[:, None]
    mask = positions < seq_lens  # (B, L)
    if kind.window:
        mask &= positions >= seq_lens - kind.window
    out = _attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], False, kind, sinks)
    return out.squeeze(2)  # (B, H, D)


def _attend(q, keys, values, mask, causal: bool, kind: AttentionKind, sinks=None) -> torch.Tensor:
    """softmax(q k^T scale [soft-capped]) v over (..., H, Tq, D) queries and (..., Hkv, L, D)
    keys; mask: True where a key is seen (broadcast), or causal; sinks (H,): a logit per head
    that joins the softmax without a value."""
    if not kind.softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=kind.scale, enable_gqa=True
        )
    group = q.shape[-3] // keys.shape[-3]
    keys, values = (x.repeat_interleave(group, dim=-3) for x in (keys, values))
    scores = torch.matmul(q, keys.transpose(-1, -2)) * kind.scale
    if kind.softcap:
        scores = torch.tanh(scores / kind.softcap) * kind.softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights, values)


def _prefill_attention(q, k, v, kv_cache, chunk: PrefillChunk, kind: AttentionKind, sinks=None):
    num_q = q.shape[0]
    if chunk.context_len == 0 and not kind.window:
        # The whole sequence is in this chunk: attend to the fresh K/V, no gather needed.
        # Rounded as the cache holds them, so the chunk sees the same keys as later steps.
        k, v = (to_cache_dtype(x, kv_cache.dtype).to(q.dtype) for x in (k, v))
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, Tq, D)
        mask, causal = None, True
    else:
        seq_len = chunk.context_len + num_q
        keys, values = _gather(kv_cache, chunk.block_table, q.shape[-1], q.dtype)  # (Hkv, L, D)
        keys, values = keys[:, :seq_len], values[:, :seq_len]
        rows = torch.arange(num_q, device=q.device)[:, None] + chunk.context_len
        positions = torch.arange(seq_len, device=q.device)[None, :]
        mask = positions <= rows  # (Tq, L)
        if kind.window:
            mask &= positions > rows - kind.window
        causal = False
    out = _attend(q.transpose(0, 1), keys, values, mask, causal, kind, sinks)  # (H, Tq, D)
    return out.transpose(0, 1)
