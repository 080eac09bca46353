"""Paged attention for one whole step.

Every layer first writes the step's new K/V into the cache through `slot_mapping`
(slot = block_id * block_size + offset), then attends:
  - decode rows (one query token each) as one batch: their block tables are gathered into a
    padded (B, L) view of the cache and masked past each sequence's length;
  - prompt chunks one request at a time, causally, over the cached context plus the chunk.
The cache of one layer is a tensor (2, num_blocks, block_size, num_kv_heads, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the step's flattened tokens
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # (num_blocks,) int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    decode_rows: torch.Tensor  # (B,) rows of the decode tokens
    decode_block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    decode_seq_lens: torch.Tensor  # (B,) int64, tokens to attend (cached + this one)
    prefills: list[PrefillChunk]
    block_size: int

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.numel()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode_attention(q[meta.decode_rows], kv_cache, meta)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk, meta.block_size)
    return out


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
    tables = meta.decode_block_tables  # (B, N)
    b, n = tables.shape
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keys = kv_cache[0][tables].view(b, n * meta.block_size, num_kv_heads, head_dim)
    values = kv_cache[1][tables].view(b, n * meta.block_size, num_kv_heads, head_dim)
    positions = torch.arange(n * meta.block_size, device=q.device)
    mask = (positions[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]  # (B,1,1,L)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (B, H, 1, D)
        keys.transpose(1, 2),  # (B, Hkv, L, D)
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _prefill_attention(q, k, v, kv_cache, chunk: PrefillChunk, block_size: int):
    num_q = q.shape[0]
    if chunk.context_len == 0:
        # The whole sequence is in this chunk: attend to the fresh K/V, no gather needed.
        keys, values, mask, causal = k, v, None, True
    else:
        seq_len = chunk.context_len + num_q
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        keys = kv_cache[0][chunk.block_table].view(-1, num_kv_heads, head_dim)[:seq_len]
        values = kv_cache[1][chunk.block_table].view(-1, num_kv_heads, head_dim)[:seq_len]
        rows = torch.arange(num_q, device=q.device)[:, None] + chunk.context_len
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # (Tq, L)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # (H, Tq, D)
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
