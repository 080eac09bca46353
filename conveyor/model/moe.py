"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, GPT-OSS), as
transformers computes it.

A router (a projection to num_experts logits) picks each token's top_k experts (Parts.router):
"softmax_topk", softmax over all experts in float32, torch.topk (ties as torch resolves them),
optionally the k weights divided by their sum (norm_topk_prob); "topk_softmax" (GPT-OSS, whose
router has a bias), torch.topk of the logits, then softmax over those k in the model dtype;
"topk_softmax_float32" (Granite's MoE) the same on the logits in float32, the weights cast back
to the model dtype.

Each expert is a gated MLP of its own, stored as the dense MLP's modules (gate_up_proj,
down_proj), so that the loader, the quantized modules (model/quant) and the batch-invariant
panel kernels (layers.pack_panels) treat an expert exactly as a dense MLP. GPT-OSS's experts
carry biases and its clamped SwiGLU; its checkpoint's 3-D, gate/up-interleaved tensors are
split per expert at load (model/loader.py).

Grouped, in one fixed order: the step's rows are grouped by expert, each active expert runs
once over all of its rows (so a step reads only its active experts' weights), and a row's
output is the sum of its experts' weighted outputs in ascending expert id, starting from zero:
the order transformers' eager experts loop adds them in, and one that depends only on the row's
own routing, never on the batch. Each expert's product runs on the projection kernels a dense
layer uses, so a row's bits are the same alone or batched.

This module is the readable reference. A batch-invariant model runs the same arithmetic as
kernels/layer/decoder_layer.cpp's MoE, inside the compiled decoder layer (one call per step, as
a dense model's: model/llama.py builds it in _compiled_moe), bit for bit equal to this module
(tests/unit/test_moe.py). The activations and the shared expert's sigmoid gate of a float32
model run the compiled row loops here too (kernels/moe/moe.h), the same in both.

With tensor parallelism each expert is split like a dense MLP (columns of gate/up, rows of
down), the router is replicated, and one all-reduce adds the ranks' partial sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from conveyor.distributed.parallel import TPGroup
from conveyor.model import kernels
from conveyor.model.layers import Linear, MergedLinear


class Expert(nn.Module):
    """act(x @ gate.T) * (x @ up.T) @ down.T (biases: GPT-OSS's), without the tensor-parallel
    reduction; act "swiglu_clamp" is GPT-OSS's (see Parts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, parts, bias: bool = False):
        super().__init__()
        # an ungated expert's up projection is the activated one: a one-part gate_up_proj
        sizes = [intermediate_size] * (1 if parts.act == "relu2" else 2)
        self.gate_up_proj = MergedLinear(hidden_size, sizes, bias=bias)
        down = MergedLinear(intermediate_size, [hidden_size], bias=True) if bias else None
        self.down_proj = down or Linear(intermediate_size, hidden_size)
        self.act = parts.act
        self.alpha, self.limit = parts.swiglu_alpha, parts.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "relu2":  # Nemotron-H's ungated experts: relu(x @ up^T)^2 @ down^T
            return self.down_proj(torch.relu_(gate_up).square_())
        ops = row_ops(gate_up)
        # The compiled layers' loops, row by row (see row_ops).
        if ops is not None and self.act == "silu":
            return self.down_proj(ops.silu_and_mul(gate_up))
        if ops is not None and self.act == "swiglu_clamp":
            return self.down_proj(ops.swiglu_clamp_and_mul(gate_up, self.alpha, self.limit))
        gate, up = gate_up.chunk(2, dim=-1)  # views of a fresh tensor: in place
        if self.act == "swiglu_clamp":  # transformers' GptOssExperts._apply_gate
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        if self.act == "gelu_tanh":
            gate = nn.functional.gelu(gate, approximate="tanh")
        else:
            gate = nn.functional.silu(gate, inplace=True)
        return self.down_proj(gate.mul_(up))


ROUTERS = (
    "softmax_topk",
    "topk_softmax",
    "topk_softmax_float32",
    "sigmoid_topk",
    "sigmoid_group_topk",
    "softmax_bias_topk",
    "softmax_group_topk",
)


# Routers whose logits are float32 whatever the model's dtype (transformers casts the rows and
# the gate's weight): Nemotron-H's, GLM-4.5's, ERNIE 4.5's, DeepSeek's.
FLOAT32_LOGITS = ("sigmoid_group_topk", "softmax_bias_topk", "softmax_group_topk")


class Routes(NamedTuple):
    weights: torch.Tensor  # (T, top_k): each row's weight of each chosen expert
    expert_ids: torch.Tensor  # (T, top_k) int64


class ExpertGroup(NamedTuple):
    expert_id: int
    rows: torch.Tensor  # (n,) ascending: the step's rows routed to the expert
    slots: torch.Tensor  # (n,): where in each row's top_k the expert is


class MoEMLP(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert, or Granite 4.0's ungated one);
    parameter names follow transformers' checkpoints (mlp.gate, mlp.experts.N.*,
    mlp.shared_expert*)."""

    def __init__(self, cfg, tp: TPGroup) -> None:
        super().__init__()
        parts = cfg.parts
        if parts.router not in ROUTERS:
            raise ValueError(f"unsupported MoE router {parts.router!r}")
        self.tp = tp
        self.router = parts.router
        self.top_k = parts.top_k
        self.norm_topk_prob = parts.norm_topk_prob
        self.float32_route_weights = parts.float32_route_weights
        self.routed_scaling = parts.routed_scaling
        self.groups = parts.router_groups  # sigmoid_group_topk's (groups, groups chosen)
        self.norm_min = parts.router_norm_min  # softmax_bias_topk's
        # LFM2-MoE: a per-expert bias added to the scores to choose (float32, as stored)
        self.expert_bias = (
            nn.Parameter(torch.zeros(parts.num_experts, dtype=torch.float32))
            if parts.router_bias
            else None
        )
        size = tp.shard.part(parts.moe_intermediate_size)[1]
        bias = parts.expert_bias
        self.gate = (
            MergedLinear(cfg.hidden_size, [parts.num_experts], bias=True)
            if bias
            else Linear(cfg.hidden_size, parts.num_experts)
        )
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, size, parts, bias) for _ in range(parts.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if parts.shared_expert_size:
            shared = tp.shard.part(parts.shared_expert_size)[1]
            self.shared_expert = Expert(cfg.hidden_size, shared, parts)
            if parts.shared_expert_gate:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def route(self, x: torch.Tensor) -> Routes:
        """Each row's top_k experts and their weights, as transformers' TopKRouter."""
        float32_logits = self.router in FLOAT32_LOGITS
        if float32_logits and x.dtype != torch.float32:
            logits = nn.functional.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)  # (T, E)
        if self.router == "softmax_bias_topk":  # ERNIE 4.5's
            probs = torch.softmax(logits.float(), dim=-1)
            expert_ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            top = torch.gather(probs, 1, expert_ids)
            top = top / _row_sums(top).clamp(min=self.norm_min)
            return Routes(top.to(x.dtype), expert_ids)
        if self.router in ("sigmoid_topk", "sigmoid_group_topk"):
            return self._sigmoid_routes(logits, x.dtype)
        if self.router == "softmax_group_topk":  # DeepSeek-V2's
            probs = torch.softmax(logits, dim=-1)
            choice = probs if self.groups[0] == 1 else self._best_groups(probs, "max", 0.0)
            top, expert_ids = torch.topk(choice, self.top_k, dim=-1)
            return Routes(top * self.routed_scaling, expert_ids)
        if self.router == "topk_softmax":
            top, expert_ids = torch.topk(logits, self.top_k, dim=-1)  # (T, k)
            return Routes(torch.softmax(top, dim=1, dtype=top.dtype), expert_ids)
        if self.router == "topk_softmax_float32":
            top, expert_ids = torch.topk(logits.float(), self.top_k, dim=-1)
            return Routes(torch.softmax(top, dim=1).to(logits.dtype), expert_ids)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            top = top / _row_sums(top)
        weights = top if self.float32_route_weights else top.to(logits.dtype)
        return Routes(weights, expert_ids)

    def _sigmoid_routes(self, logits: torch.Tensor, dtype: torch.dtype) -> Routes:
        """LFM2-MoE's: top_k of the sigmoid scores (plus expert_bias), weighed by the scores;
        Nemotron-H's (sigmoid_group_topk): the same in float32 among the topk_group groups of
        experts whose two best scores (plus bias) add up highest, renormalised (+ 1e-20), the
        weights kept float32."""
        ops = row_ops(logits)
        if ops is not None:  # row by row (see row_ops)
            scores = ops.sigmoid_mul(torch.ones_like(logits), logits)
        else:
            scores = logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        grouped = self.router == "sigmoid_group_topk"
        if grouped and self.groups[0] > 1:
            choice = self._best_groups(choice, "best_two", float("-inf"))
        expert_ids = torch.topk(choice, self.top_k, dim=-1).indices  # (T, k)
        weights = torch.gather(scores, 1, expert_ids)
        weights = weights if grouped else weights.to(dtype)
        if self.norm_topk_prob:
            weights = weights / (_row_sums(weights) + (1e-20 if grouped else 1e-6))
        return Routes(weights * self.routed_scaling, expert_ids)

    def _best_groups(self, choice: torch.Tensor, score: str, outside: float) -> torch.Tensor:
        """The choice scores with the experts outside each row's topk_group best groups at
        `outside`; a group's score: its two best experts' added ("best_two": DeepSeek-V3's,
        GLM-4.5's, Nemotron 3's) or its best one's ("max": DeepSeek-V2's)."""
        groups, chosen = self.groups
        by_group = choice.view(choice.shape[0], groups, -1)
        if score == "max":
            group_scores = by_group.max(dim=-1).values
        else:
            best_two = by_group.topk(2, dim=-1).values
            group_scores = best_two[..., 0] + best_two[..., 1]
        keep = torch.topk(group_scores, chosen, dim=-1).indices  # (T, chosen)
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return by_group.masked_fill(~mask[..., None], outside).view_as(choice)

    def forward(self, x: torch.Tensor, routes: Routes | None = None) -> torch.Tensor:
        """routes: the rows' experts where another input chose them (Gemma 4's); else x's."""
        routes = self.route(x) if routes is None else routes
        out = torch.zeros_like(x)  # (T, hidden)
        for group in expert_groups(routes.expert_ids, len(self.experts)):
            h = self.experts[group.expert_id](x[group.rows])  # (n, hidden)
            weight = routes.weights[group.rows, group.slots].unsqueeze(1)  # (n, 1)
            # each row at most once per expert: one add per row, in ascending expert id
            out.index_add_(0, group.rows, (h * weight).to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is None:
            out = out + self.shared_expert(x)  # Granite 4.0's shared_mlp, after the experts'
        elif self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate(x)  # (T, 1)
            ops = row_ops(out)
            if ops is not None:  # row by row (see Expert.forward)
                out = ops.sigmoid_gated_add(out, gate, shared)
            else:
                out = out + torch.sigmoid(gate) * shared
        return self.tp.all_reduce(out)

    # The compiled form of this module is kernels/layer/decoder_layer.cpp's MoE (built by
    # llama.py's _compiled_moe): the same arithmetic, grouped and summed in C++, bit for bit.


def row_ops(t: torch.Tensor):
    """The compiled ops where a float32 CPU tensor's activations run their row loops: ATen's
    silu and sigmoid compute a tensor's (or a thread's) last elements with their scalar exp,
    whose bits can differ from the vector one, so a row's values could depend on the rows
    computed with it."""
    if t.dtype != torch.float32:
        return None
    return cpu_ops(t)


def cpu_ops(t: torch.Tensor):
    """The compiled ops for a CPU tensor (None elsewhere, or where they do not build)."""
    return kernels.load() if t.device.type == "cpu" else None


def _row_sums(top: torch.Tensor) -> torch.Tensor:
    """(T, 1): each row's k weights added left to right (one order whatever T; a reduction
    over a short last dim may be vectorised across rows in another order)."""
    total = top[:, :1].clone()
    for j in range(1, top.shape[1]):
        total += top[:, j : j + 1]
    return total


def expert_groups(expert_ids: torch.Tensor, num_experts: int) -> list[ExpertGroup]:
    """The step's (row, slot) pairs grouped by expert, in ascending expert id; the active
    experts only."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, then by row
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for expert_id, count in enumerate(counts):
        if count:
            picked = order[start : start + count]
            groups.append(ExpertGroup(expert_id, picked // top_k, picked % top_k))
            start += count
    return groups
