"""Multi-head latent attention (DeepSeek-V2 / V3, GLM-4.7-Flash), computed on the latent: what
the cache keeps per token is one normed latent row c (kv_lora_rank) and one rope key k_pe
(qk_rope_head_dim) shared by every head, not each head's keys and values.

transformers expands the latents into each head's key [W_k c, k_pe] and value W_v c
(kv_b_proj's rows) and attends over those. The same scores and outputs, on the latent:

    q_nope . (W_k c) = (W_k^T q_nope) . c       a head's query absorbed into the latent
    sum_j p_j W_v c_j = W_v (sum_j p_j c_j)     its output expanded once, after the softmax

so each head attends with query [W_k^T q_nope, q_pe] over keys [c, k_pe] of one shared kv
head, the latent its values (padded by zeros to the key's width: the cache's tiles hold keys
and values of one width; the padded columns come out zero and are dropped), then W_v and
o_proj. That is the paged attention every other family runs (model/attention.py: its compiled
kernel, its reference twin), with num_kv_heads 1 and head_dim kv_lora_rank +
qk_rope_head_dim: a DeepSeek-V2-Lite token takes 2 x 576 values per layer where expanded heads
would take 16 x (192 + 128) (the latent is stored twice, as key and as value: vLLM's MLA
backends store it once). Mathematically transformers' result; in float64 its greedy tokens
(tests/equivalence/test_families.py).

The per-head absorptions (W_k^T, W_v: kv_b_proj's rows) run on the batch-invariant panel
kernels where the model's projections do, one head at a time, so a row's bits do not depend on
the rows beside it; elsewhere (CUDA, half dtypes) as one batched matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.distributed.parallel import TPGroup
from conveyor.model import kernels
from conveyor.model.attention import AttentionKind, paged_attention
from conveyor.model.config import ModelConfig
from conveyor.model.layers import Linear, MergedLinear, RMSNorm

# transformers builds the latent norms (q_a_layernorm, kv_a_layernorm) with its RMSNorm's
# default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentHeads(nn.Module):
    """kv_b_proj: (heads * (qk_nope + v), kv_lora_rank), each head's key rows W_k then its value
    rows W_v, as stored; used absorbed (absorb: q_nope -> W_k^T q_nope, expand: a latent output
    -> W_v of it), per head."""

    def __init__(self, heads: int, nope: int, v_dim: int, rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v_dim, self.rank = heads, nope, v_dim, rank
        self.weight = nn.Parameter(torch.empty(heads * (nope + v_dim), rank))
        # Per head, W_k^T (rank, nope) then W_v (v, rank) packed for the batch-invariant panel
        # kernels (pack_panels, at load; the memory report counts them as kernel copies).
        self.panels: list[torch.Tensor] | None = None

    def pack_panels(self, ops) -> bool:
        """Packs the heads' matrices of a float32 / float64 CPU weight (layers.pack_panels);
        whether it did."""
        weight = self._per_head()
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.float64):
            return False
        keys = weight[:, : self.nope].transpose(1, 2)  # (H, rank, nope)
        values = weight[:, self.nope :]  # (H, v, rank)
        self.panels = [ops.pack_dense(m.contiguous()) for m in (*keys, *values)]
        return True

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:  # (T, H, nope) -> (T, H, rank)
        if self._packed_for(q_nope):
            return self._panel_heads(q_nope, self.panels[: self.heads], self.rank)
        return torch.einsum("thn,hnr->thr", q_nope, self._per_head()[:, : self.nope])

    def expand(self, latent: torch.Tensor) -> torch.Tensor:  # (T, H, rank) -> (T, H, v)
        if self._packed_for(latent):
            return self._panel_heads(latent, self.panels[self.heads :], self.v_dim)
        return torch.einsum("thr,hvr->thv", latent, self._per_head()[:, self.nope :])

    def _per_head(self) -> torch.Tensor:  # (H, nope + v, rank), a view
        return self.weight.detach().view(self.heads, self.nope + self.v_dim, self.rank)

    def _packed_for(self, x: torch.Tensor) -> bool:
        return (
            self.panels is not None and x.device.type == "cpu" and x.dtype == self.panels[0].dtype
        )

    @staticmethod
    def _panel_heads(x: torch.Tensor, panels: list[torch.Tensor], out: int) -> torch.Tensor:
        """Head h's rows of x times its packed matrix, one head at a time on the panel kernels
        (every output value one chain over its inputs, whatever the row count)."""
        ops = kernels.load()
        rows = [ops.dense_linear(x[:, h].contiguous(), p, out) for h, p in enumerate(panels)]
        return torch.stack(rows, dim=1)


class MLAAttention(nn.Module):
    """Multi-head latent attention under transformers' parameter names (q_proj or q_a_proj +
    q_a_layernorm + q_b_proj, kv_a_proj_with_mqa + kv_a_layernorm, kv_b_proj, o_proj); the
    hidden rows' two projections (q_proj or q_a_proj, kv_a_proj_with_mqa) run as one matmul,
    qkv_proj."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        q_lora, rank, nope, rope, v_dim = parts.mla
        # With tensor parallelism a rank's heads (distributed/parallel.py: _latent_slice); the
        # latent and its projections are every rank's.
        self.tp = tp
        heads = tp.shard.heads(cfg.num_heads)[1]
        self.num_heads, self.q_lora, self.rank, self.nope, self.rope_dim = (
            heads, q_lora, rank, nope, rope,
        )  # fmt: skip
        self.num_kv_heads = 1  # the latent: one "KV head" that every head reads
        q_size = heads * (nope + rope)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_lora or q_size, rank + rope], bias=False)
        # its checkpoint tensors by part (for the quantized modules: quant/load_plan.py)
        self.qkv_proj.part_names = ("q_a_proj" if q_lora else "q_proj", "kv_a_proj_with_mqa")
        if q_lora:
            self.q_a_layernorm = RMSNorm(q_lora, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora, q_size)
        self.kv_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentHeads(heads, nope, v_dim, rank)
        self.o_proj = Linear(heads * v_dim, cfg.hidden_size)
        self.kind = AttentionKind(parts.scale(nope + rope))
        self.rope = parts.rope(index)

    def forward(self, x, ropes, rotaries, kv_cache, meta):
        num_tokens = x.shape[0]
        q, latent = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope_dim)
        c = self.kv_a_layernorm(latent[:, : self.rank].contiguous())  # (T, rank)
        q_pe = q[..., self.nope :].contiguous()  # (T, H, rope)
        k_pe = latent[:, self.rank :].contiguous().view(num_tokens, 1, self.rope_dim)
        if self.rope >= 0:
            rope = ropes[self.rope]
            q_pe, k_pe = rotaries[self.rope](q_pe, k_pe, rope.cos, rope.sin, meta.ops)
        query = torch.cat([self.kv_b_proj.absorb(q[..., : self.nope]), q_pe], dim=-1)
        key = torch.cat([c, k_pe.view(num_tokens, self.rope_dim)], dim=-1).unsqueeze(1)
        value = nn.functional.pad(c, (0, self.rope_dim)).unsqueeze(1)  # (T, 1, rank + rope)
        out = paged_attention(query, key, value, kv_cache, meta, self.kind)  # (T, H, rank + rope)
        out = self.kv_b_proj.expand(out[..., : self.rank])  # (T, H, v)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1)))
