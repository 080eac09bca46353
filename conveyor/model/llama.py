"""Every supported family in one module: a layer is built from the model's layer description
(model/families.py: which norms, their kind, the activation, each layer's attention kind and
rotary table, the multipliers), both as modules and as the compiled layer of
kernels/layer/decoder_layer.cpp. Parameter names follow transformers, so checkpoints load by name;
q/k/v and gate/up are merged into one matmul each (Phi-3 stores them merged).

All non-attention work runs once over the step's flattened tokens (T, hidden); attention
reads each request's KV through its block table (see attention.py).

With tensor parallelism (a TPGroup of size N > 1) each rank builds its share of the model: its
heads, MLP columns and vocabulary rows, and adds the others' partial results through the
group's collectives (see distributed/parallel.py for the split).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from conveyor.distributed.parallel import TPGroup
from conveyor.model import gemma3n
from conveyor.model import plan as kernel_plan
from conveyor.model.attention import AttentionKind, AttentionMetadata, paged_attention
from conveyor.model.config import ModelConfig
from conveyor.model.families import PROJECTION_SHARDS, UNGATED_ACTIVATIONS, Parts
from conveyor.model.gemma4 import (
    Gemma4DecoderLayer,
    StepState,
    add_per_layer_inputs,
    per_layer_inputs,
)
from conveyor.model.layers import (
    MATMUL_BUCKETS,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    matmul_form,
)
from conveyor.model.mla import MLAAttention
from conveyor.model.moe import MoEMLP, cpu_ops, row_ops
from conveyor.model.quant import QuantLinear
from conveyor.model.recurrent import recurrent_mixer

_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensor and its index


class RopeRows(NamedTuple):
    cos: torch.Tensor  # (T, head_dim): rotary cos of each row's position
    sin: torch.Tensor


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        self.tp = tp
        self.num_heads = tp.shard.heads(cfg.num_heads)[1]
        self.num_kv_heads = tp.shard.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Qwen3.5: gate rows after q, k and v; the output is multiplied by their sigmoid
        self.gated = parts.attn_gate
        sizes = [q_size, kv_size, kv_size] + [q_size] * self.gated
        self.qkv_proj = MergedLinear(cfg.hidden_size, sizes, cfg.qkv_bias)
        self.o_proj = (
            MergedLinear(q_size, [cfg.hidden_size], bias=True)
            if parts.o_bias
            else Linear(q_size, cfg.hidden_size)
        )
        # GPT-OSS: a logit per head that joins each row's softmax (attention.py)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if parts.attn_sinks else None
        # "", "head" or "full" (the whole q and k projections)
        self.qk_norm = parts.qk_norm or ("head" if cfg.qk_norm else "")
        if self.qk_norm:
            full = self.qk_norm == "full"
            self.q_norm = _norm(parts, q_size if full else self.head_dim, cfg.rms_norm_eps)
            self.k_norm = _norm(parts, kv_size if full else self.head_dim, cfg.rms_norm_eps)
        self.kind = AttentionKind(
            parts.scale(cfg.head_dim), parts.window(index), parts.attn_softcap
        )
        self.rope = parts.rope(index)  # which of the model's rotary tables; -1: none

    def forward(self, x, ropes: list[RopeRows], rotaries: list[RotaryEmbedding], kv_cache, meta):
        num_tokens = x.shape[0]
        q, k, v, *gate = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope >= 0:
            rope = ropes[self.rope]
            q, k = rotaries[self.rope](q, k, rope.cos, rope.sin, meta.ops)
        out = paged_attention(q, k, v, kv_cache, meta, self.kind, self.sinks)  # (T, H, D)
        out = out.reshape(num_tokens, -1)
        if self.gated:  # row by row where ATen's sigmoid would not be (see moe.row_ops)
            ops = row_ops(out)
            out = ops.sigmoid_mul(out, gate[0]) if ops else out * torch.sigmoid(gate[0])
        return self.tp.all_reduce(self.o_proj(out))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, width: int = 0) -> None:
        """width: the intermediate size where it is not the model's (Gemma 4's wide layers)."""
        super().__init__()
        self.tp = tp
        size = tp.shard.part(width or cfg.intermediate_size)[1]
        self.act = cfg.parts.act
        # an ungated MLP's up projection is the activated one: a one-part gate_up_proj
        parts = [size] if self.act in UNGATED_ACTIVATIONS else [size, size]
        self.gate_up_proj = MergedLinear(cfg.hidden_size, parts, bias=False)
        self.down_proj = Linear(size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "relu2":  # Nemotron-H's: relu(x)^2 (exact per value: max, one product)
            up = self.gate_up_proj(x)
            return self.tp.all_reduce(self.down_proj(torch.relu_(up).square_()))
        gate_up = self.gate_up_proj(x)
        ops = row_ops(gate_up)
        if ops is not None and self.act == "silu":  # the compiled layers' row loop
            return self.tp.all_reduce(self.down_proj(ops.silu_and_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)  # views of a fresh tensor: in place
        if self.act == "gelu_tanh":
            gate = nn.functional.gelu(gate, approximate="tanh")
        else:
            gate = nn.functional.silu(gate, inplace=True)
        return self.tp.all_reduce(self.down_proj(gate.mul_(up)))


# The compiled layer's activations (kernels/layer/decoder_layer.cpp: Activation).
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "relu2": 2}


class LlamaDecoderLayer(nn.Module):
    """[attn_in norm] -> attention -> [attn_out norm] -> (* residual_scale) + x, then the same
    around the MLP; which norms a family has, and their checkpoint names: Parts.norms."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        self.roles: dict[str, str] = dict(parts.norms)
        if not parts.has_mlp(index):  # no MLP: no norms around one
            self.roles = {r: n for r, n in self.roles.items() if not r.startswith("mlp_")}
        for name in self.roles.values():
            self.add_module(name, _norm(parts, cfg.hidden_size, cfg.rms_norm_eps))
        # a hybrid's recurrent layer (model/recurrent.py), under its checkpoint name, or attention
        self.linear = parts.is_linear(index)
        if self.linear:
            self.mixer, mixer = recurrent_mixer(cfg, index)
            self.add_module(self.mixer, mixer)
        elif parts.mla:  # DeepSeek's multi-head latent attention (model/mla.py)
            self.self_attn = MLAAttention(cfg, tp, index)
        else:
            self.self_attn = LlamaAttention(cfg, tp, index)
        self.mlp: nn.Module | None = None  # a Nemotron-H mixer block with no MLP block after it
        if parts.has_mlp(index):
            self.mlp = MoEMLP(cfg, tp) if parts.is_moe(index) else LlamaMLP(cfg, tp)
        self.residual_scale = parts.residual_scale

    def norm(self, role: str) -> RMSNorm | None:
        name = self.roles.get(role)
        return None if name is None else getattr(self, name)

    def forward(self, x, ropes, rotaries, kv_cache, meta):
        h = self._normed("attn_in", x)
        if self.linear:  # kv_cache: this layer's RecurrentState
            h = getattr(self, self.mixer)(h, kv_cache, meta.recurrent, cpu_ops(h))
        else:
            h = self.self_attn(h, ropes, rotaries, kv_cache, meta)
        h = self._normed("attn_out", h)
        x = x + self._scaled(h)
        if self.mlp is None:
            return x
        h = self._normed("mlp_out", self.mlp(self._normed("mlp_in", x)))
        return x + self._scaled(h)

    def _normed(self, role: str, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm(role)
        return x if norm is None else norm(x)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_scale == 1.0 else h * self.residual_scale

    def compiled(self, ops: ModuleType):
        """This layer as the compiled ops' DecoderLayer (kernels/layer/decoder_layer.cpp: the same
        arithmetic in one call), or None when a projection has no compiled form there (the
        model then runs its modules). A mixture of experts runs as the compiled MoE
        (_compiled_moe); a recurrent layer, a gated or latent attention or a layer without MLP
        (Nemotron-H's) has none."""
        attn = getattr(self, "self_attn", None)
        if self.linear or self.mlp is None or not isinstance(attn, LlamaAttention) or attn.gated:
            return None
        attn, mlp = self.self_attn, self.mlp
        qkv, o = _projection(attn.qkv_proj, ops), _projection(attn.o_proj, ops)
        if isinstance(mlp, MoEMLP):
            gate_up = down = None
            moe = _compiled_moe(mlp, ops)
            if moe is None:
                return None
        else:
            gate_up, down = _projection(mlp.gate_up_proj, ops), _projection(mlp.down_proj, ops)
            moe = None
            if gate_up is None or down is None:
                return None
        if qkv is None or o is None:
            return None
        norms = {role: _kernel_weight(self.norm(role)) for role in _ROLES}
        eps = next(n.eps for n in map(self.norm, _ROLES) if n is not None)
        return ops.DecoderLayer(
            **norms,
            q_norm=_kernel_weight(attn.q_norm) if attn.qk_norm else None,
            k_norm=_kernel_weight(attn.k_norm) if attn.qk_norm else None,
            eps=eps,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.kind.scale,
            window=attn.kind.window,
            softcap=attn.kind.softcap,
            rope=attn.rope,
            activation=_ACTIVATIONS.get(getattr(mlp, "act", "silu"), 0),
            residual_scale=self.residual_scale,
            moe=moe,
            sinks=None if attn.sinks is None else attn.sinks.detach(),
        )


_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def _norm(parts: Parts, size: int, eps: float) -> RMSNorm:
    return RMSNorm(size, eps, offset=parts.norm_offset, float32_scale=parts.norm_float32_scale)


def _kernel_weight(norm: RMSNorm | None) -> torch.Tensor | None:
    """The weight the compiled rms_norm takes: the module's, or for a (1 + w) norm that sum in
    float32 (the compiled op then multiplies in float32, as transformers' Gemma norms do)."""
    if norm is None:
        return None
    return norm.scale_weight().detach()


def _projection(module: nn.Module, ops: ModuleType):
    """A compiled Projection of the module's weight: a float matrix, or GGUF-style blocks in a
    float32 model (QuantLinear: the block kernel or float tiles, as the module would run)."""
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach()
    if type(module) in (Linear, MergedLinear):
        return ops.Projection(weight=module.weight.detach(), bias=bias, panels=module.panels)
    if type(module) is QuantLinear and module.format in ("q4", "q8"):
        m = module.m if module.format == "q4" else None
        return ops.Projection(
            qs=module.qs, d=module.d, m=m, bias=bias, block_panels=module.panels,
            prompt_tiles=getattr(module, "prompt_tiles", None),
        )  # fmt: skip
    return None


# The compiled MoE's routers and expert activations (kernels/layer/decoder_layer.cpp: Router,
# ExpertActivation).
_ROUTERS = {
    "softmax_topk": 0,
    "topk_softmax": 1,
    "topk_softmax_float32": 2,
    "sigmoid_group_topk": 3,
    "softmax_bias_topk": 4,
}
_BIASED_ROUTERS = ("sigmoid_group_topk", "softmax_bias_topk")
_EXPERT_ACTIVATIONS = {"silu": 0, "swiglu_clamp": 1}


def _compiled_moe(mlp: MoEMLP, ops: ModuleType):
    """The MoE MLP as the compiled ops' MoE (the module's arithmetic: model/moe.py), or None
    when one of its projections has no compiled form or its activation no compiled loop."""
    act = mlp.experts[0].act
    if act not in _EXPERT_ACTIVATIONS or mlp.router not in _ROUTERS:
        return None
    biased = mlp.router in _BIASED_ROUTERS
    if biased and mlp.gate.weight.dtype != torch.float32:
        return None  # a float64 model's: its router's logits are float32 in the module
    router = _projection(mlp.gate, ops)
    gate_up = [_projection(e.gate_up_proj, ops) for e in mlp.experts]
    down = [_projection(e.down_proj, ops) for e in mlp.experts]
    shared = {}
    if mlp.shared_expert is not None:
        shared = {
            "shared_gate_up": _projection(mlp.shared_expert.gate_up_proj, ops),
            "shared_down": _projection(mlp.shared_expert.down_proj, ops),
        }
        if mlp.shared_expert_gate is not None:  # Qwen2-MoE's sigmoid gate; others add it ungated
            shared["shared_gate"] = _projection(mlp.shared_expert_gate, ops)
    if router is None or None in gate_up or None in down or None in shared.values():
        return None
    expert = mlp.experts[0]
    return ops.MoE(
        router=router, gate_up=gate_up, down=down, router_kind=_ROUTERS[mlp.router],
        top_k=mlp.top_k, norm_topk_prob=mlp.norm_topk_prob,
        float32_route_weights=mlp.float32_route_weights,
        activation=_EXPERT_ACTIVATIONS[act], alpha=expert.alpha or 0.0,
        limit=expert.limit or 0.0, **shared,
        router_bias=mlp.expert_bias.detach() if biased else None,
        groups=mlp.groups[0], groups_chosen=mlp.groups[1],
        routed_scaling=mlp.routed_scaling, norm_min=mlp.norm_min,
    )  # fmt: skip


def _packed(module: nn.Module) -> bool:
    """Whether the module runs the batch-invariant panel kernels (layers.pack_panels)."""
    return getattr(module, "panels", None) is not None


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        # Its weights come from the checkpoint: no random init (on the meta device the first
        # one imports torch._dynamo, ~2 s of a start).
        shape = (tp.shard.vocab(cfg.vocab_size)[2], cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(_decoder_layer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg.parts, cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.parts.per_layer_input[0]:  # Gemma 4's and 3n's
            add_per_layer_inputs(self, cfg)
        if cfg.parts.altup[0]:  # Gemma 3n's
            gemma3n.add_altup_projections(self, cfg)


def _decoder_layer(cfg: ModelConfig, tp: TPGroup, index: int) -> nn.Module:
    if cfg.parts.family == "gemma3n":
        return gemma3n.Gemma3nDecoderLayer(cfg, tp, index)
    if cfg.parts.family != "gemma4":
        return LlamaDecoderLayer(cfg, tp, index)
    width = cfg.parts.mlp_sizes[index] if cfg.parts.mlp_sizes else 0
    return Gemma4DecoderLayer(cfg, tp, index, LlamaMLP(cfg, tp, width))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPGroup()
        self.model = LlamaModel(cfg, tp)
        self.rotaries = self.rotary_tables()
        self.lm_head = Linear(cfg.hidden_size, tp.shard.vocab(cfg.vocab_size)[2])
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The checkpoint's multi-token prediction layer, a draft proposer (model/mtp.py)
        self.mtp = None
        if cfg.mtp_layers:
            from conveyor.model.mtp import MultiTokenPredictor

            self.mtp = MultiTokenPredictor(cfg, tp, LlamaDecoderLayer)
        # A *ForSequenceClassification checkpoint's head (ModelConfig.classifier), replicated
        # on every tensor-parallel rank; rank 0 applies it (classify).
        self.score = (
            Linear(cfg.hidden_size, cfg.classifier.num_labels)
            if (cfg.is_sequence_classifier)
            else None
        )
        self._compiled: list | None = None  # built at the first step that can use it
        self._invariant = False  # every projection packed for the panel kernels
        self._experts = False  # some layer's MLP is a mixture of experts
        # Block weights: (rows below which all run the block kernel, rows from which all run
        # float tiles); None for float weights.
        self._quantized_rows: tuple[int, int] | None = None
        # float64 (3,): seconds the compiled layers spent in projections, attention and the
        # rest are added here when it is set (the breakdown of `python -m benchmarks step`).
        self.compiled_seconds: torch.Tensor | None = None
        # lora/slots.py's LoRASlots when LoRA is on: it adds the adapters' deltas to the
        # projections' outputs in steps with adapter rows (hooks on the modules; the compiled
        # layers take its tensors).
        self.lora = None
        # Prompt tokens run bfloat16: the AMX tiles, or their attention alone on AVX512-BF16
        # (model/prompt_route.py; set at load).
        self.prompt_route = False

    def rotary_tables(self, device: torch.device | None = None) -> nn.ModuleList:
        """cos/sin tables by Parts.ropes' index: the global RoPE, then the local one (Gemma 3).
        Computed, not loaded: a model built on the meta device computes them again here."""
        cfg = self.config
        tables = [
            RotaryEmbedding(cfg.rope_inv_freq, cfg.rope_scaling, cfg.max_model_len, cfg.dtype)
        ]
        if cfg.parts.local_rope_inv_freq:
            local = cfg.parts.local_rope_inv_freq
            tables.append(RotaryEmbedding(local, 1.0, cfg.max_model_len, cfg.dtype))
        return nn.ModuleList(tables).to(device) if device is not None else nn.ModuleList(tables)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self._embed(input_ids)  # (T, hidden)
        if self.config.parts.family in ("gemma4", "gemma3n"):
            return self._gemma_layers(x, input_ids, positions, kv_caches, meta)
        if self.config.parts.embed_scale != 1.0:
            x = x * self.config.parts.embed_scale
        # once per step, for every layer
        ropes = [RopeRows(*rotary.rows(positions)) for rotary in self.rotaries]
        form = self._compiled_form(x, meta)
        if form is not None:  # x updated in place, layer by layer
            lora = self.lora.compiled_arguments() if self.lora and self.lora.active else {}
            groups = meta.every_group()  # KV groups: each layer's slots and tables
            meta.ops.decoder_layers(
                self._compiled, x, kv_caches, [r.cos for r in ropes], [r.sin for r in ropes],
                [g.slot_mapping for g in groups], meta.block_size, meta.query_start,
                meta.seq_lens, [g.block_tables for g in groups], self.compiled_seconds, form,
                meta.split_keys, prompt_rows=meta.prompt_rows if self.prompt_route else [],
                layer_groups=meta.layer_groups, **lora,
            )  # fmt: skip
            return self.model.norm(x)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, ropes, self.rotaries, kv_cache, meta.layer(i))
        return self.model.norm(x)

    def _gemma_layers(self, x, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Gemma 4's and 3n's layers (model/gemma4.py, model/gemma3n.py), which hand on per-layer
        inputs and keys and values: as modules, no compiled form. Gemma 3n's run on AltUp's
        streams, (S, T, hidden), spread from the embedding and merged at the end."""
        cfg = self.config
        # sqrt(hidden_size) in the model dtype, as transformers holds it (its buffer is made in
        # the dtype the model is built in)
        x = x * torch.tensor(cfg.parts.embed_scale, dtype=x.dtype)
        ropes = [RopeRows(*rotary.rows(positions)) for rotary in self.rotaries]
        altup = cfg.parts.family == "gemma3n"
        inputs = gemma3n.per_layer_inputs if altup else per_layer_inputs
        per_layer = inputs(self.model, cfg, input_ids, x) if cfg.parts.per_layer_input[0] else None
        state = StepState(per_layer, {})
        h = gemma3n.spread(self.model, x) if altup else x
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            h = layer(h, ropes, self.rotaries, kv_cache, meta.layer(i), state)
        return self.model.norm(gemma3n.merge(self.model, h) if altup else h)

    def _compiled_form(self, x: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """How the layers' projections run when the step's layers run as one compiled call
        (kernels/layer/decoder_layer.cpp: MatmulForm), for steps of up to 64 rows, or None: run the
        modules. At a few rows the Python between the matmuls costs more than the ops it runs
        (layer/decoder_layer.cpp says why); at 32 rows it was still ~10 ms of a 120 ms float32 step.
        Each projection is computed as the module would at this row count."""
        if meta.ops is None or self.tp.size > 1 or x.device.type != "cpu" or x.dim() != 2:
            return None
        if self._compiled is None:  # a plan without compiled layers: the modules always
            layers = [layer.compiled(meta.ops) for layer in self.model.layers]
            enabled = kernel_plan.current(self.config).compiled_layers
            self._compiled = layers if enabled and all(layers) else []
            self._quantized_rows = _block_kernel_rows(self.model.layers)
            projections = [m for m in self.model.layers.modules() if hasattr(m, "panels")]
            self._invariant = bool(projections) and all(map(_packed, projections))
            self._experts = any(isinstance(layer.mlp, MoEMLP) for layer in self.model.layers)
            self.prompt_route = self.prompt_route and bool(self._compiled)
        if not self._compiled:
            return None
        if self._experts and (not self._invariant or (self.lora and self.lora.active)):
            return None  # an expert's rows are not the step's: forms follow the step's rows
        if self._invariant:
            # Batch-invariant: every row count runs the same kernels in the same order, and
            # the norms, rotary and activation are the compiled ones at every row count too
            # (the modules' ATen ops reduce in other orders).
            return KERNEL
        if x.shape[0] > MATMUL_BUCKETS[-1]:  # prompt chunks: the modules' ops are multithreaded
            return None
        if self._quantized_rows:  # block weights: the block kernel below its rows, then tiles
            low, high = self._quantized_rows
            if x.dtype != torch.float32 or low <= x.shape[0] < high:
                return None  # modules that switch route at different rows (or int8 copies)
            return KERNEL if x.shape[0] < low else LINEAR
        if x.dtype not in (torch.float32, torch.float64):
            return None
        return _FORMS[matmul_form(x)]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        first, stop, _ = self.tp.shard.vocab(self.config.vocab_size)
        outside = (input_ids < first) | (input_ids >= stop)
        x = self.model.embed_tokens((input_ids - first).masked_fill_(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp.size > 1:  # every rank's vocabulary rows, the padding cut off
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        parts = self.config.parts
        if parts.logits_divisor != 1.0:
            logits = logits / parts.logits_divisor
        if parts.final_softcap:
            logits = torch.tanh(logits / parts.final_softcap) * parts.final_softcap
        return logits.contiguous()  # (N, vocab), row-major for the sampler

    def classify(self, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """(N, num_labels) label logits of final hidden states (ModelConfig.classifier): the
        score head's, or the classifier tokens' columns of those rows' `logits` (every rank
        computed them, compute_logits)."""
        classifier = self.config.classifier
        if self.score is not None:
            return self.score(hidden)
        picked = logits[:, list(classifier.token_ids)]
        return picked[:, 1:] - picked[:, :1] if classifier.difference else picked

    def mtp_hidden(self, next_ids, hidden, positions, kv_cache, meta) -> torch.Tensor:
        """The multi-token prediction layer's y (model/mtp.py) of rows at `positions` whose
        next tokens are next_ids and whose hidden states are `hidden`."""
        ropes = [RopeRows(*rotary.rows(positions)) for rotary in self.rotaries]
        embedded = self._embed(next_ids)
        if self.config.parts.embed_scale != 1.0:
            embedded = embedded * self.config.parts.embed_scale
        return self.mtp(embedded, hidden, ropes, self.rotaries, kv_cache, meta)

    def draft_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """The multi-token prediction layer's drafts of its outputs y (model/mtp.py)."""
        return self.mtp.draft_tokens(y, self.argmax_tokens)

    def argmax_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), without the logits where greedy_tokens can."""
        greedy = self.greedy_tokens(hidden)
        return self.compute_logits(hidden).argmax(-1) if greedy is None else greedy

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1), exactly, where the lm_head can find it without
        computing every logit in float (model/quant.py: QuantLinear.argmax); None: it cannot
        here, compute the logits."""
        argmax = getattr(self.lm_head, "argmax", None)
        parts = self.config.parts
        if argmax is None or self.tp.size > 1 or parts.final_softcap or parts.logits_divisor != 1:
            return None  # (monotonic, but a soft-cap can round two logits into a tie)
        return argmax(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded=()) -> None:
        """loaded: parameters already in place (a table mapped from the file: loader.py)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set(loaded)
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # derived buffers some checkpoints carry
            target, shard = _merged_target(name)
            if target in params:
                self._load_one(target, shard, name, tensor)
                loaded.add(target)
            elif (layer := _LAYER.match(name)) and int(layer[1]) >= self.config.num_layers:
                continue  # a layer past num_hidden_layers, cut short by hf_overrides
            elif not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                raise ValueError(f"checkpoint has a tensor this model does not use: {name}")
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(sorted(missing)[:5])}")

    def _load_one(self, target: str, shard, name: str, tensor: torch.Tensor) -> None:
        module_name, param_name = target.rsplit(".", 1)
        if shard is not None:
            self.get_submodule(module_name).load_shard(shard, param_name, tensor)
            return
        param = self.get_parameter(target)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)


# decoder_layers' forms (kernels/layer/decoder_layer.cpp: MatmulForm); LINEAR also means float tiles
# for block weights.
KERNEL, LINEAR, TRANSPOSED = 0, 1, 2
_FORMS = {"kernel": KERNEL, "linear": LINEAR, "transposed": TRANSPOSED}


def _block_kernel_rows(layers: nn.ModuleList) -> tuple[int, int] | None:
    """(low, high) for block-quantized layers: below `low` rows every projection runs the block
    kernel, from `high` on every one runs the float tiles (QuantLinear.dequant_from), and an
    int8 copy (from int8_from rows) pushes `high` out of reach; None for float weights."""
    modules = [m for m in layers.modules() if isinstance(m, QuantLinear)]
    if not modules:
        return None
    low = min(
        min(m.dequant_from, m.int8_from if m.int8_weight is not None else m.dequant_from)
        for m in modules
    )
    int8 = any(m.int8_weight is not None for m in modules)
    high = sys.maxsize if int8 else max(m.dequant_from for m in modules)
    return low, high


# The checkpoint's projections that load as a shard of a merged module (q/k/v, gate/up).
_MERGED = {leaf: target for leaf, target in PROJECTION_SHARDS.items() if target[0] != leaf}


def _merged_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, shard = _MERGED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None
