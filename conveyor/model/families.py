"""Each supported family as a description of its layers: what it adds to Llama's.

A decoder layer here is always: [norm] -> attention -> [norm] -> residual add, then
[norm] -> MLP -> [norm] -> residual add. A family says which of the four norms it has and
what their checkpoint names are, how a norm scales (w, or Gemma's 1 + w), the MLP's activation,
and per layer the attention's kind (full or a sliding window, soft-capped scores, its scale)
and rotary table (the global one, Gemma 3's local one, or none: SmolLM3's NoPE layers), and
per layer the MLP's kind: dense, or a mixture of experts (a router that picks top_k of
num_experts per token, how it weighs them, a shared expert behind a sigmoid gate); a hybrid's
layers that are gated delta nets instead of attention (model/recurrent.py); around the
layers, the embedding, residual and logit multipliers. `Parts` holds that, resolved once
from the checkpoint's config (as transformers reads it); model/llama.py builds both the modules
and the compiled layers (kernels/layer/decoder_layer.cpp) from it, so a family is written once.

A setting a family does not support (a rope variant, a norm kind) is refused at load with the
field's name: never loaded and computed wrong. Partial rotary dims and GLM's interleaved pairs
are the default RoPE on q and k rows put in another order at load (model/config.py
rotary_rows).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields

from conveyor.config import SUPPORTED_ARCHITECTURES as ARCHITECTURES

# The four norms by role: attn_in (before attention), attn_out (on its output, before the
# residual add), mlp_in and mlp_out likewise; the value is the checkpoint's module name.
LLAMA_NORMS = (("attn_in", "input_layernorm"), ("mlp_in", "post_attention_layernorm"))
SANDWICH_NORMS = (  # Gemma 2 and 3: all four
    ("attn_in", "input_layernorm"),
    ("attn_out", "post_attention_layernorm"),
    ("mlp_in", "pre_feedforward_layernorm"),
    ("mlp_out", "post_feedforward_layernorm"),
)
GLM4_NORMS = (  # GLM-4: all four, under its names
    ("attn_in", "input_layernorm"),
    ("attn_out", "post_self_attn_layernorm"),
    ("mlp_in", "post_attention_layernorm"),
    ("mlp_out", "post_mlp_layernorm"),
)
OUTPUT_NORMS = (  # OLMo 2: on the sublayers' outputs only
    ("attn_out", "post_attention_layernorm"),
    ("mlp_out", "post_feedforward_layernorm"),
)

# A checkpoint's projection -> (the merged module of model/llama.py it loads into, its shard
# index there).
PROJECTION_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    # Qwen3.5's attention: the gate rows of its q_proj (loader: _gated_queries splits them off)
    "q_gate_proj": ("qkv_proj", 3),
    # multi-head latent attention's two projections of the hidden rows (q_proj's place, or
    # q_a_proj's before its norm and q_b_proj; and the latent kv with the shared rope key)
    "q_a_proj": ("qkv_proj", 0),
    "kv_a_proj_with_mqa": ("qkv_proj", 1),
    "q_b_proj": ("q_b_proj", 0),
    # a gated delta net's projections (model/recurrent.py): q/k/v, z, b and a in one matmul
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
    "out_proj": ("out_proj", 0),
}


def projection_of(hf_name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> ('model.layers.3.self_attn.qkv_proj', 1,
    'weight'); None for tensors that are not decoder projections."""
    module, _, param = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf not in PROJECTION_SHARDS:
        return None
    merged, shard = PROJECTION_SHARDS[leaf]
    return f"{parent}.{merged}", shard, param


# The families whose attention is multi-head latent attention (model/mla.py).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# An MLP without gate: up, then relu(x)^2, then down (Nemotron-H's). Its up projection is the
# activated one, held where a gated MLP holds its gate: a one-part gate_up_proj.
UNGATED_ACTIVATIONS = ("relu2",)


@dataclass(frozen=True)
class Parts:
    """One model's layer description (see the module docstring); the defaults are Llama's."""

    family: str = "llama"
    norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
    norm_offset: bool = False  # Gemma: the norm scales by 1 + w, multiplied in float32
    norm_float32_scale: bool = False  # Nemotron-H: w multiplied in float32, then the cast
    qk_norm: str = ""  # "" none, "head" per head (Qwen3, Gemma 3), "full" all heads (OLMo 2)
    act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 full attention
    ropes: tuple[int, ...] = ()  # per layer: 0 the global RoPE, 1 the local one, -1 none
    local_rope_inv_freq: tuple[float, ...] = ()  # the local layers' (Gemma 3)
    attn_scale: float = 0.0  # the scores' scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embed_scale: float = 1.0  # the embedding rows' multiplier
    residual_scale: float = 1.0  # each sublayer's output is multiplied by it before the add
    logits_divisor: float = 1.0  # logits are divided by it (Granite's logits_scaling)
    # Mixture of experts (model/moe.py); moe_layers empty: every layer's MLP is dense.
    moe_layers: tuple[bool, ...] = ()  # per layer: True a mixture of experts
    # "softmax_topk": softmax over all experts in float32, then top_k; "topk_softmax"
    # (GPT-OSS): top_k of the logits, then softmax over those k; "sigmoid_topk" (LFM2-MoE):
    # top_k of the sigmoid scores (plus a learned per-expert bias, router_bias, that only
    # chooses), weighed by their scores, renormalised (+ 1e-6) with norm_topk_prob, times
    # routed_scaling
    router: str = ""
    router_bias: bool = False
    router_groups: tuple[int, int] = (1, 1)  # sigmoid_group_topk's (n_group, topk_group)
    # "softmax_bias_topk" (ERNIE 4.5): softmax of float32 logits, top_k of it plus router_bias,
    # the k weights divided by their sum, at least router_norm_min, in the model dtype
    router_norm_min: float = 0.0
    routed_scaling: float = 1.0
    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False  # the top_k weights divided by their sum
    # Mixtral keeps the weights float32 (each expert's output is multiplied in the promoted
    # dtype); the Qwen MoEs cast them to the model dtype first.
    float32_route_weights: bool = False
    moe_intermediate_size: int = 0  # each expert's
    shared_expert_size: int = 0  # Qwen2-MoE's always-on expert, behind a sigmoid gate; 0 none
    shared_expert_gate: bool = True  # False: added ungated (Granite 4.0's shared_mlp)
    # GPT-OSS: experts (and router) with biases, the clamped SwiGLU (act "swiglu_clamp":
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)),
    # attention sinks (a learned per-head logit in every softmax), a biased o_proj.
    expert_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attn_sinks: bool = False
    o_bias: bool = False
    # BERT / RoBERTa encoders (model/bert.py): their first position's row (RoBERTa:
    # padding_idx + 1), token types (a pair's second text: 1 after the first sep_token_id).
    position_offset: int = 0
    type_vocab_size: int = 0
    sep_token_id: int = -1
    # ModernBERT (model/modernbert.py): biased norms / MLP / head, the classifier's pooling
    # (cls | mean) and its head's activation
    norm_bias: bool = True
    mlp_bias: bool = False
    head_bias: bool = False
    classifier_pooling: str = "cls"
    classifier_act: str = "gelu"
    # Hybrids: per layer, True where a recurrent mixer (model/recurrent.py: a state per
    # sequence instead of KV blocks) replaces attention: "gated_delta" (Qwen3.5's gated delta
    # net, its (key, value) heads and head dims) or "short_conv" (LFM2's gated convolution);
    # the causal convolution's kernel size.
    linear_kind: str = ""
    linear_layers: tuple[bool, ...] = ()
    linear_heads: tuple[int, int] = (0, 0)
    linear_dims: tuple[int, int] = (0, 0)
    linear_conv: int = 0
    # "mamba2" (Granite 4.0-H's Mamba2 layers): (heads, head_dim, groups, state size), the
    # convolution's bias, dt's clamp (transformers' time_step_limit)
    mamba_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    mamba_conv_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    attn_gate: bool = False  # attention's output times sigmoid(gate rows of q_proj's)
    # per layer: False where the layer has no MLP (Nemotron-H's blocks: nemotron_h_layers)
    mlp_layers: tuple[bool, ...] = ()
    # Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash: model/mla.py):
    # (q_lora_rank, 0 for a plain q_proj; kv_lora_rank; qk_nope_head_dim; qk_rope_head_dim;
    # v_head_dim); empty: none. mla_rope_interleaved: RoPE turns adjacent pairs (2i, 2i + 1)
    # of the rope dims (the q and k rows are reordered at load: model/loader.py).
    mla: tuple[int, ...] = ()
    mla_rope_interleaved: bool = False
    # Gemma 4 (model/gemma4.py). Per layer (head_dim, num_kv_heads) where some layer's differ
    # from the model's (its full-attention layers' wider heads); empty: every layer's are.
    layer_heads: tuple[tuple[int, int], ...] = ()
    # per layer: the layer whose keys and values it attends, its own index or, for a layer
    # that shares an earlier one's cache (num_kv_shared_layers), that layer's; empty: its own
    kv_sources: tuple[int, ...] = ()
    value_is_key: tuple[bool, ...] = ()  # per layer: the value is the key projection's output
    v_norm: bool = False  # the values RMS-normalised per head, without a weight
    # Per-layer inputs: (each layer's width, the vocabulary of their embedding); (0, 0): none
    per_layer_input: tuple[int, int] = (0, 0)
    mlp_sizes: tuple[int, ...] = ()  # per layer: the MLP's width where it varies (double-wide)
    moe_beside_mlp: bool = False  # a mixture of experts whose output is added to the MLP's
    layer_scalar: bool = False  # a stored scalar multiplies each layer's output
    # Gemma 3n (model/gemma3n.py): AltUp's (parallel streams, the one the layer computes on);
    # its correct_output_scale applied to that stream; Laurel's rank; per layer the gate's
    # gaussian top-k sparsity, 0 none (empty: none on any layer)
    altup: tuple[int, int] = (0, 0)
    altup_correct_scale: bool = False
    laurel_rank: int = 0
    activation_sparsity: tuple[float, ...] = ()

    def one_layer(self, layer: int) -> Parts:
        """These parts with layer `layer`'s per-layer description as the only layer's (index
        0): a layer built apart from the model's (a multi-token prediction layer, model/mtp.py,
        described as the model's layer of its kind)."""
        per_layer = (
            "windows", "ropes", "moe_layers", "linear_layers", "mlp_layers", "layer_heads",
            "value_is_key", "mlp_sizes", "activation_sparsity",
        )  # fmt: skip
        picked = {
            name: getattr(self, name)[layer : layer + 1]
            for name in per_layer
            if getattr(self, name)
        }
        return dataclasses.replace(self, **picked, kv_sources=(0,) if self.kv_sources else ())

    def heads(self, layer: int, default: tuple[int, int]) -> tuple[int, int]:
        """(head_dim, num_kv_heads) of a layer's attention; `default`: the model's."""
        return self.layer_heads[layer] if self.layer_heads else default

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache this layer's attention reads (and writes, if its own)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def rope(self, layer: int) -> int:
        return self.ropes[layer] if self.ropes else 0

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def has_mlp(self, layer: int) -> bool:
        return not self.mlp_layers or self.mlp_layers[layer]

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state per sequence (model/recurrent.py)."""
        return any(self.linear_layers)

    def scale(self, head_dim: int) -> float:
        return self.attn_scale or head_dim**-0.5

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Parts:
        """From to_dict's output after a JSON round trip (lists back to tuples)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: _tuples(v) for k, v in data.items() if k in known})


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def architecture(hf) -> str:
    """The family of a transformers config, or a ValueError that lists the supported ones."""
    names = list(getattr(hf, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = getattr(hf, "model_type", "")
    if not names and model_type in ARCHITECTURES.values():
        return model_type  # configs written from GGUF metadata carry model_type only
    raise ValueError(
        f"unsupported architecture {names or model_type!r}; supported: "
        f"{', '.join(ARCHITECTURES)} (README: supported families)"
    )


def parts_of(hf, family: str, num_layers: int, head_dim: int, local_rope: Callable) -> Parts:
    """The layer description of a transformers config of `family`; local_rope(hf, head_dim):
    the inverse frequencies of the sliding layers' RoPE (model/config.py's)."""
    _refuse_unsupported(hf, family)
    builder = _BUILDERS.get(family)
    extra = builder(hf, head_dim, local_rope) if builder else {}
    if family in _MOE:
        extra.update(_MOE[family](hf, num_layers))
    return Parts(family=family, windows=_windows(hf, family, num_layers), **extra)


def _windows(hf, family: str, num_layers: int) -> tuple[int, ...]:
    """Per layer the sliding window transformers applies (its sliding_window_overlay), 0: full.
    Families with `layer_types` slide on the layers it names; the others on every layer."""
    window = getattr(hf, "sliding_window", None)
    if not window or getattr(hf, "use_sliding_window", True) is False:
        return ()
    types = getattr(hf, "layer_types", None)
    if family in ("mistral", "ministral3", "phi3", "mixtral") or types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _gemma1(hf, head_dim: int, local_rope: Callable) -> dict:
    """Gemma: Llama's two norms scaling by 1 + w, GeGLU, the embedding scaled by sqrt(hidden)."""
    return dict(
        norm_offset=True,
        act=_activation(getattr(hf, "hidden_activation", None) or hf.hidden_act),
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the model dtype.
        embed_scale=struct.unpack("f", struct.pack("f", hf.hidden_size**0.5))[0],
    )


def _gemma(hf, head_dim: int, local_rope: Callable) -> dict:
    return dict(
        _gemma1(hf, head_dim, local_rope),
        norms=SANDWICH_NORMS,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
    )


def _gemma3(hf, head_dim: int, local_rope: Callable) -> dict:
    types = list(hf.layer_types)
    return dict(
        _gemma(hf, head_dim, local_rope),
        qk_norm="head",
        ropes=tuple(1 if t == "sliding_attention" else 0 for t in types),
        local_rope_inv_freq=local_rope(hf, head_dim),
    )


def _gemma_sandwich(hf, head_dim: int, local_rope: Callable) -> dict:
    """Gemma 3n's and 4's layer: Gemma 3's sandwich of norms (w, not 1 + w, multiplied in
    float32) around attention with q, k and weightless v norms and unscaled scores, the sliding
    layers turned by their own RoPE, soft-capped logits, the embedding scaled by sqrt(hidden)
    rounded to the model dtype (model/llama.py)."""
    return dict(
        _gemma1(hf, head_dim, local_rope),
        embed_scale=hf.hidden_size**0.5,
        norm_offset=False,
        norm_float32_scale=True,
        norms=SANDWICH_NORMS,
        attn_scale=1.0,
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        qk_norm="head",
        v_norm=True,
        ropes=tuple(1 if t == "sliding_attention" else 0 for t in hf.layer_types),
        local_rope_inv_freq=local_rope(hf, head_dim),
    )


def _gemma4(hf, head_dim: int, local_rope: Callable) -> dict:
    """Gemma 4: Gemma 3's sandwich of norms (w, not 1 + w, multiplied in float32) around
    attention with q, k and weightless v norms and unscaled scores (the norms keep them
    bounded); its full layers' own head_dim, KV heads, RoPE ("proportional": a quarter of each
    head turned) and, with attention_k_eq_v, values that are the keys' projection; the last
    num_kv_shared_layers reading the cache of the last earlier layer of their kind; per-layer
    inputs (PLE) added after the MLP; a mixture of experts beside the MLP; a scalar per layer."""
    types = list(hf.layer_types)
    count = len(types)
    modes = hf.kv_sharing_modes
    sources = _kv_sources(hf)
    layer = [hf.per_layer_config[i] for i in range(count)]
    heads = tuple((int(c.head_dim), int(c.num_key_value_heads)) for c in layer)
    full = [t == "full_attention" for t in types]
    wide = bool(getattr(hf, "use_double_wide_mlp", False))
    inner = int(hf.intermediate_size)
    per_layer = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        raise ValueError("unsupported use_bidirectional_attention 'all' for gemma4 (causal only)")
    if getattr(hf, "attention_bias", False):
        raise ValueError("unsupported attention_bias for gemma4")
    return dict(
        _gemma_sandwich(hf, head_dim, local_rope),
        layer_heads=heads if len(set(heads)) > 1 else (),
        kv_sources=sources,
        value_is_key=tuple(f and bool(hf.attention_k_eq_v) for f in full),
        per_layer_input=(per_layer, int(hf.vocab_size_per_layer_input)) if per_layer else (0, 0),
        mlp_sizes=tuple(inner * (2 if wide and m == "reuse" else 1) for m in modes),
        layer_scalar=True,
    )


def _kv_sources(hf) -> tuple[int, ...]:
    """Per layer the layer whose cache it reads (Gemma 3n's and 4's kv_sharing_modes): the
    last num_kv_shared_layers read the last earlier layer of their kind; empty: none does."""
    types = list(hf.layer_types)
    count, modes = len(types), hf.kv_sharing_modes
    first_shared = count - int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    producer = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types)}
    sources = tuple(i if modes[i] != "reuse" else producer[types[i]] for i in range(count))
    return sources if sources != tuple(range(count)) else ()


def _gemma3n(hf, head_dim: int, local_rope: Callable) -> dict:
    """Gemma 3n: Gemma 4's attention (q, k and weightless v norms, unscaled scores, the last
    num_kv_shared_layers reading earlier caches) with one head size, Gemma 3's RoPE per kind of
    layer; AltUp's parallel streams around each layer, Laurel's low-rank residual beside
    attention, a gaussian top-k on the first layers' MLP gates, per-layer inputs (always);
    soft-capped logits."""
    widths = [int(w) for w in hf.intermediate_size]
    sparsity = tuple(float(s) for s in hf.activation_sparsity_pattern)
    per_layer = int(hf.hidden_size_per_layer_input or 0)
    for name, bad in (
        ("attention_bias", bool(getattr(hf, "attention_bias", False))),
        ("use_bidirectional_attention", bool(getattr(hf, "use_bidirectional_attention", 0))),
        ("hidden_size_per_layer_input 0", per_layer <= 0),
        ("altup_active_idx", not 0 <= int(hf.altup_active_idx) < int(hf.altup_num_inputs)),
    ):
        if bad:
            raise ValueError(f"unsupported {name} for gemma3n")
    if any(not 0 <= s < 1 for s in sparsity):
        raise ValueError(f"unsupported activation_sparsity_pattern {list(sparsity)} for gemma3n")
    return dict(
        _gemma_sandwich(hf, head_dim, local_rope),
        kv_sources=_kv_sources(hf),
        per_layer_input=(per_layer, int(hf.vocab_size_per_layer_input)),
        mlp_sizes=tuple(widths) if len(set(widths)) > 1 else (),
        altup=(int(hf.altup_num_inputs), int(hf.altup_active_idx)),
        altup_correct_scale=bool(hf.altup_correct_scale),
        laurel_rank=int(hf.laurel_rank),
        activation_sparsity=sparsity if any(sparsity) else (),
    )


def _gemma4_moe(hf, num_layers: int) -> dict:
    """Gemma 4's mixture, beside every layer's MLP: a softmax of float32 logits (of the
    layer's input RMS-normalised, times a stored scale and hidden_size ** -0.5), top-k
    renormalised, each weight times its expert's stored scale."""
    if not getattr(hf, "enable_moe_block", False):
        return {}
    return dict(
        moe_beside_mlp=True,
        router="softmax_topk",
        norm_topk_prob=True,
        float32_route_weights=True,
        num_experts=int(hf.num_experts),
        top_k=int(hf.top_k_experts),
        moe_intermediate_size=int(hf.moe_intermediate_size),
    )


def _olmo3(hf, head_dim: int, local_rope: Callable) -> dict:
    """OLMo 3: OLMo 2's layer, sliding layers (layer_types) turning by their own RoPE table,
    the full ones by the global (possibly scaled) one."""
    return dict(
        norms=OUTPUT_NORMS,
        qk_norm="full",
        ropes=tuple(1 if t == "sliding_attention" else 0 for t in hf.layer_types),
        local_rope_inv_freq=local_rope(hf, head_dim),
    )


def _exaone4(hf, head_dim: int, local_rope: Callable) -> dict:
    """EXAONE 4: norms on the sublayers' outputs, per-head q/k norms; with a sliding window
    only the sliding layers turn by RoPE (the global ones take none), else every layer."""
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    sliding = getattr(hf, "sliding_window", None)
    ropes = tuple(0 if not sliding or t == "sliding_attention" else -1 for t in types)
    return dict(norms=OUTPUT_NORMS, qk_norm="head", ropes=ropes)


def _granite(hf, head_dim: int, local_rope: Callable) -> dict:
    return dict(
        attn_scale=float(hf.attention_multiplier),
        embed_scale=float(hf.embedding_multiplier),
        residual_scale=float(hf.residual_multiplier),
        logits_divisor=float(hf.logits_scaling),
    )


# Granite 4.0's Mamba2 layers (transformers' name, and the released configs')
_MAMBA_LAYERS = ("linear_attention", "mamba")
_ATTENTION_LAYERS = ("full_attention", "attention")


def _granite_hybrid(hf, head_dim: int, local_rope: Callable) -> dict:
    """Granite 4.0 (GraniteMoeHybrid): Granite's layer, its MLP the shared_mlp
    (shared_intermediate_size; beside a mixture of experts, _granite_hybrid_moe, added ungated),
    RoPE where position_embedding_type is "rope", none otherwise; the -H models' Mamba2 layers
    (layer_types) in place of attention (model/recurrent.py)."""
    types = list(getattr(hf, "layer_types", None) or ())
    if set(types) - set(_MAMBA_LAYERS) - set(_ATTENTION_LAYERS):
        raise ValueError(f"unsupported layer_types {sorted(set(types))} for GraniteMoeHybrid")
    rope = getattr(hf, "position_embedding_type", None) == "rope"
    extra = dict(_granite(hf, head_dim, local_rope), ropes=() if rope else (-1,) * len(types))
    if any(t in _MAMBA_LAYERS for t in types):
        extra.update(_mamba2(hf, [t in _MAMBA_LAYERS for t in types]))
    return extra


BAMBA_NORMS = (("attn_in", "input_layernorm"), ("mlp_in", "pre_ff_layernorm"))


def _bamba(hf, head_dim: int, local_rope: Callable) -> dict:
    """Bamba (Bamba-9B): Granite 4.0-H's Mamba2 layers beside attention on attn_layer_indices,
    which turns half of each head by RoPE; Llama's MLP (feed_forward), its norm before it
    pre_ff_layernorm."""
    types = list(hf.layers_block_type)
    return dict(norms=BAMBA_NORMS, **_mamba2(hf, [t == "linear_attention" for t in types]))


def _mamba2(hf, layers: list[bool]) -> dict:
    """The Mamba2 layers of a hybrid (transformers' mamba_* settings)."""
    if getattr(hf, "mamba_proj_bias", False):
        raise ValueError("unsupported mamba_proj_bias (biased Mamba2 projections)")
    heads, head_dim = int(hf.mamba_n_heads), int(hf.mamba_d_head)
    groups, size = int(hf.mamba_n_groups), int(hf.mamba_d_state)
    if heads % groups or heads * head_dim != int(hf.mamba_expand * hf.hidden_size):
        raise ValueError(
            f"Mamba2 sizes: {heads} heads of {head_dim} in {groups} groups do not make "
            f"mamba_expand * hidden_size"
        )
    kernel = int(hf.mamba_d_conv)
    if not 2 <= kernel <= 8:
        raise ValueError(f"unsupported mamba_d_conv {kernel} (2 to 8)")
    limit = tuple(getattr(hf, "time_step_limit", None) or (0.0, float("inf")))
    return dict(
        linear_kind="mamba2",
        linear_layers=tuple(layers),
        linear_conv=kernel,
        mamba_shape=(heads, head_dim, groups, size),
        mamba_conv_bias=bool(getattr(hf, "mamba_conv_bias", True)),
        mamba_dt_limit=(float(limit[0]), float(limit[1])),
    )


_NEMOTRON_MIXERS = ("linear_attention", "full_attention")
_NEMOTRON_MLPS = ("mlp", "moe")


def nemotron_h_layers(types: list[str]) -> list[tuple[int, int | None]]:
    """Nemotron-H's blocks (each a norm and one mixer: Mamba2, attention, or an MLP) as decoder
    layers: (a Mamba2 or attention block, the MLP block right after it or None), by block
    index. Every released pattern puts a mixer before each MLP block."""
    layers: list[tuple[int, int | None]] = []
    for i, kind in enumerate(types):
        if kind in _NEMOTRON_MIXERS:
            layers.append((i, None))
        elif kind in _NEMOTRON_MLPS and layers and layers[-1][1] is None:
            layers[-1] = (layers[-1][0], i)
        else:
            raise ValueError(
                f"unsupported layer_types for nemotron_h: block {i} ({kind!r}) is not a Mamba2 "
                f"or attention block, nor an MLP right after one"
            )
    return layers


def num_decoder_layers(hf, family: str) -> int:
    """The model's decoder layers: num_hidden_layers, or Nemotron-H's blocks paired up."""
    if family == "nemotron_h":
        return len(nemotron_h_layers(list(hf.layer_types)))
    return int(hf.num_hidden_layers)


def _nemotron_h(hf, head_dim: int, local_rope: Callable) -> dict:
    """Nemotron-H (Nemotron-H-4B/8B/47B, NVIDIA Nemotron Nano 2, Nemotron 3 Nano): its blocks
    paired into layers (nemotron_h_layers), Mamba2 layers beside attention without RoPE,
    ungated relu(x)^2 MLPs (or mixtures of them: _nemotron_h_moe), norms that multiply by w in
    float32; the Mamba2 time step clamped below at time_step_min (transformers'
    time_step_limit for it)."""
    types = list(hf.layer_types)
    for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf, name, want) != want:
            raise ValueError(f"unsupported {name} {getattr(hf, name)!r} for nemotron_h")
    if getattr(hf, "use_bias", False) or getattr(hf, "mamba_proj_bias", False):
        raise ValueError("unsupported use_bias for nemotron_h (biased Mamba2 projections)")
    layers = nemotron_h_layers(types)
    heads, head_dim_m = int(hf.mamba_num_heads), int(hf.mamba_head_dim)
    groups, size = int(hf.n_groups), int(hf.ssm_state_size)
    if heads % groups:
        raise ValueError(f"Mamba2 sizes: {heads} heads in {groups} groups")
    kernel = int(hf.conv_kernel)
    if not 2 <= kernel <= 8:
        raise ValueError(f"unsupported conv_kernel {kernel} (2 to 8)")
    return dict(
        act="relu2",
        norm_float32_scale=True,
        ropes=(-1,) * len(layers),
        mlp_layers=tuple(mlp is not None for _, mlp in layers),
        linear_kind="mamba2",
        linear_layers=tuple(types[mixer] == "linear_attention" for mixer, _ in layers),
        linear_conv=kernel,
        mamba_shape=(heads, head_dim_m, groups, size),
        mamba_conv_bias=bool(hf.use_conv_bias),
        mamba_dt_limit=(float(hf.time_step_min), float("inf")),
    )


def _nemotron_h_moe(hf, num_layers: int) -> dict:
    """Nemotron 3's mixture blocks (layer_types "moe"): sigmoid scores of float32 logits, the
    top-k among the topk_group best of n_group groups chosen with e_score_correction_bias,
    weighed by the scores (float32), renormalised, times routed_scaling_factor; ungated
    relu(x)^2 experts and one ungated shared expert."""
    types = list(hf.layer_types)
    if "moe" not in types:
        return {}
    if getattr(hf, "moe_latent_size", None) is not None:
        raise ValueError("unsupported moe_latent_size for nemotron_h (latent expert projections)")
    if int(getattr(hf, "n_shared_experts", 1)) != 1:
        raise ValueError(f"unsupported n_shared_experts {hf.n_shared_experts} for nemotron_h")
    layers = nemotron_h_layers(types)
    return _grouped_sigmoid_mixture(
        hf,
        tuple(mlp is not None and types[mlp] == "moe" for _, mlp in layers),
        int(hf.moe_shared_expert_intermediate_size),
    )


def _grouped_sigmoid_mixture(hf, layers: tuple[bool, ...], shared_size: int) -> dict:
    """The mixtures Nemotron 3 and GLM-4.5 share (their transformers TopkRouter): sigmoid scores
    of float32 logits, the top-k among the topk_group best of n_group groups chosen with
    e_score_correction_bias, weighed by the scores (float32), renormalised where
    norm_topk_prob, times routed_scaling_factor; an ungated shared expert of shared_size."""
    experts, groups = int(hf.n_routed_experts), int(hf.n_group)
    if experts % groups or not 1 <= int(hf.topk_group) <= groups:
        raise ValueError(f"MoE router: {experts} experts in {groups} groups, topk_group")
    return dict(
        moe_layers=layers,
        router="sigmoid_group_topk",
        router_bias=True,
        router_groups=(groups, int(hf.topk_group)),
        routed_scaling=float(hf.routed_scaling_factor),
        num_experts=experts,
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(hf.norm_topk_prob),
        float32_route_weights=True,
        moe_intermediate_size=int(hf.moe_intermediate_size),
        shared_expert_size=shared_size,
        shared_expert_gate=False,
    )


def _qwen3_5(hf, head_dim: int, local_rope: Callable) -> dict:
    """Qwen3.5: three gated delta nets to one attention layer (layer_types), norms scaling by
    1 + w, per-head q/k norms, attention gated by its q_proj's second half per head."""
    types = list(hf.layer_types)
    if set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(set(types))} for Qwen3.5")
    return dict(
        norm_offset=True,
        qk_norm="head",
        attn_gate=True,
        linear_kind="gated_delta",
        linear_layers=tuple(t == "linear_attention" for t in types),
        linear_heads=(int(hf.linear_num_key_heads), int(hf.linear_num_value_heads)),
        linear_dims=(int(hf.linear_key_head_dim), int(hf.linear_value_head_dim)),
        linear_conv=int(hf.linear_conv_kernel_dim),
    )


LFM2_NORMS = (("attn_in", "operator_norm"), ("mlp_in", "ffn_norm"))


def _lfm2(hf, head_dim: int, local_rope: Callable) -> dict:
    """LFM2: gated short convolutions (layer_types "conv") beside attention layers with
    per-head q/k norms; its norms under their own names."""
    if getattr(hf, "conv_bias", False):
        raise ValueError("unsupported conv_bias for lfm2 (biased convolution projections)")
    return dict(
        norms=LFM2_NORMS,
        qk_norm="head",
        linear_kind="short_conv",
        linear_layers=tuple(t == "conv" for t in hf.layer_types),
        linear_conv=int(hf.conv_L_cache),
    )


def _smollm3(hf, head_dim: int, local_rope: Callable) -> dict:
    return dict(ropes=tuple(0 if use else -1 for use in hf.no_rope_layers))


def _mixtral_moe(hf, num_layers: int) -> dict:
    """Every layer a mixture: softmax, top-k, renormalised, weights kept float32."""
    return dict(
        moe_layers=(True,) * num_layers,
        router="softmax_topk",
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=True,
        float32_route_weights=True,
        moe_intermediate_size=int(hf.intermediate_size),
    )


def _qwen_moe(hf, num_layers: int) -> dict:
    """Qwen2/3-MoE: a mixture on the layers transformers makes one (not in mlp_only_layers,
    every decoder_sparse_step-th), dense (intermediate_size) elsewhere; renormalised only with
    norm_topk_prob; Qwen2-MoE adds a shared expert behind a sigmoid gate."""
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    num_experts = int(hf.num_experts)
    layers = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    return dict(
        moe_layers=layers if any(layers) else (),
        router="softmax_topk",
        num_experts=num_experts,
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_intermediate_size=int(hf.moe_intermediate_size),
        shared_expert_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
    )


def _gpt_oss_moe(hf, num_layers: int) -> dict:
    """Every layer a mixture: top-k of the router's (biased) logits, then softmax over those
    k in the model dtype; biased experts with the clamped SwiGLU."""
    return dict(
        moe_layers=(True,) * num_layers,
        router="topk_softmax",
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.intermediate_size),
        expert_bias=True,
        act="swiglu_clamp",
        swiglu_alpha=float(hf.swiglu_alpha),
        swiglu_limit=float(hf.swiglu_limit),
        attn_sinks=True,
        o_bias=bool(getattr(hf, "attention_bias", False)),
    )


def _olmoe_moe(hf, num_layers: int) -> dict:
    """OLMoE: every layer a mixture of experts of intermediate_size; softmax in float32, top-k,
    renormalised only with norm_topk_prob, the weights cast to the model dtype."""
    return dict(
        moe_layers=(True,) * num_layers,
        router="softmax_topk",
        num_experts=int(hf.num_experts),
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        moe_intermediate_size=int(hf.intermediate_size),
    )


def _granitemoe_moe(hf, num_layers: int) -> dict:
    """Granite's MoE: every layer a mixture; top-k of the router's logits in float32, softmax
    over those k, the weights in the model dtype; experts of intermediate_size."""
    return dict(
        moe_layers=(True,) * num_layers,
        router="topk_softmax_float32",
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.intermediate_size),
    )


def _granite_hybrid_moe(hf, num_layers: int) -> dict:
    """Granite 4.0's experts (num_local_experts, 0: none): Granite MoE's mixture on every layer,
    its shared_mlp added ungated."""
    if not int(getattr(hf, "num_local_experts", 0) or 0):
        return {}
    return dict(
        _granitemoe_moe(hf, num_layers),
        shared_expert_size=int(hf.shared_intermediate_size),
        shared_expert_gate=False,
    )


def _glm4_moe(hf, num_layers: int) -> dict:
    """GLM-4.5 / 4.6 / 4.7: dense MLPs on the first first_k_dense_replace layers, then
    mixtures routed as Nemotron 3's (sigmoid scores of float32 logits, the top-k among the
    topk_group best of n_group groups chosen with e_score_correction_bias, renormalised, times
    routed_scaling_factor) with an ungated shared expert of n_shared_experts experts' width."""
    dense = int(hf.first_k_dense_replace)
    shared = int(hf.moe_intermediate_size) * int(hf.n_shared_experts)
    return _grouped_sigmoid_mixture(hf, tuple(i >= dense for i in range(num_layers)), shared)


def _deepseek_v2_moe(hf, num_layers: int) -> dict:
    """DeepSeek-V2 (-Lite, -Chat): dense MLPs on the first first_k_dense_replace layers, then
    mixtures routed by the softmax of float32 logits, the top-k ("greedy"), or the top-k
    among the topk_group groups whose best expert scores highest ("group_limited_greedy"),
    times routed_scaling_factor, not renormalised; an ungated shared expert of n_shared_experts
    experts' width."""
    method = getattr(hf, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} for deepseek_v2")
    experts = int(hf.n_routed_experts)
    groups = (int(hf.n_group), int(hf.topk_group)) if method != "greedy" else (1, 1)
    if experts % groups[0] or not 1 <= groups[1] <= groups[0]:
        raise ValueError(f"MoE router: {experts} experts in {groups[0]} groups, topk_group")
    dense = int(hf.first_k_dense_replace)
    return dict(
        moe_layers=tuple(i >= dense for i in range(num_layers)),
        router="softmax_group_topk",
        router_groups=groups,
        routed_scaling=float(hf.routed_scaling_factor),
        num_experts=experts,
        top_k=int(hf.num_experts_per_tok),
        float32_route_weights=True,
        moe_intermediate_size=int(hf.moe_intermediate_size),
        shared_expert_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0),
        shared_expert_gate=False,
    )


def _glm4_moe_lite_moe(hf, num_layers: int) -> dict:
    """GLM-4.7-Flash: GLM-4.5's mixtures on the layers mlp_layer_types calls sparse."""
    types = list(hf.mlp_layer_types)
    if set(types) - {"dense", "sparse"} or len(types) != num_layers:
        raise ValueError(f"unsupported mlp_layer_types {types} for glm4_moe_lite")
    shared = int(hf.moe_intermediate_size) * int(hf.n_shared_experts)
    return _grouped_sigmoid_mixture(hf, tuple(t == "sparse" for t in types), shared)


def _mla(hf, head_dim: int, local_rope: Callable) -> dict:
    """Multi-head latent attention's shapes (model/mla.py). DeepSeek-V2 turns adjacent pairs
    of the rope dims (as complex numbers); V3 and GLM-4.7-Flash where rope_interleave."""
    q_lora = int(getattr(hf, "q_lora_rank", None) or 0)
    shape = (q_lora, int(hf.kv_lora_rank), int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim))
    if shape[3] % 2 or min(shape[1:]) <= 0 or int(hf.v_head_dim) <= 0:
        raise ValueError(f"unsupported multi-head latent attention shape {shape}")
    interleaved = hf.model_type == "deepseek_v2" or bool(getattr(hf, "rope_interleave", True))
    return dict(
        mla=(*shape, int(hf.v_head_dim)),
        mla_rope_interleaved=interleaved,
        attn_scale=_mla_scale(hf),
    )


def _mla_scale(hf) -> float:
    """Multi-head latent attention's scale of the scores, as transformers' yarn_apply_mscale:
    (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times yarn's mscale(factor,
    mscale_all_dim) squared under a scaled RoPE that names mscale_all_dim."""
    scale = (int(hf.qk_nope_head_dim) + int(hf.qk_rope_head_dim)) ** (-0.5)
    params = getattr(hf, "rope_parameters", None) or {}
    all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def _ernie4_5_moe(hf, num_layers: int) -> dict:
    """ERNIE 4.5's mixtures (ERNIE-4.5-21B-A3B, -300B-A47B): on every moe_layer_interval-th layer
    from moe_layer_start_index to moe_layer_end_index, dense MLPs elsewhere; softmax of float32
    logits, the top-k chosen with the e_score_correction_bias added, weighed by the softmax,
    divided by their sum (at least moe_norm_min); an ungated shared expert of
    moe_num_shared_experts experts' width."""
    start, end = int(hf.moe_layer_start_index), int(hf.moe_layer_end_index)
    interval = int(hf.moe_layer_interval)
    layers = tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers))
    shared = int(getattr(hf, "moe_num_shared_experts", 0) or 0)
    return dict(
        moe_layers=layers if any(layers) else (),
        router="softmax_bias_topk",
        router_bias=True,
        router_norm_min=float(hf.moe_norm_min),
        num_experts=int(hf.moe_num_experts),
        top_k=int(hf.moe_k),
        norm_topk_prob=True,
        moe_intermediate_size=int(hf.moe_intermediate_size),
        shared_expert_size=int(hf.moe_intermediate_size) * shared,
        shared_expert_gate=False,
    )


def _lfm2_moe(hf, num_layers: int) -> dict:
    """LFM2-MoE: dense MLPs on its first num_dense_layers, a mixture on the others."""
    dense = int(hf.num_dense_layers)
    return dict(
        moe_layers=tuple(i >= dense for i in range(num_layers)),
        router="sigmoid_topk",
        router_bias=bool(hf.use_expert_bias),
        routed_scaling=float(hf.routed_scaling_factor),
        num_experts=int(hf.num_experts),
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_intermediate_size=int(hf.moe_intermediate_size),
    )


_MOE = {
    "qwen3_next": _qwen_moe,
    "mixtral": _mixtral_moe,
    "lfm2_moe": _lfm2_moe,
    # Qwen3.5-MoE: a mixture with a shared expert on every layer, its top-k always renormalised
    "qwen3_5_moe": lambda hf, num_layers: dict(_qwen_moe(hf, num_layers), norm_topk_prob=True),
    "granitemoe": _granitemoe_moe,
    "granitemoehybrid": _granite_hybrid_moe,
    "nemotron_h": _nemotron_h_moe,
    "glm4_moe": _glm4_moe,
    "gemma4": _gemma4_moe,
    "deepseek_v3": _glm4_moe,  # the same mixtures
    "glm4_moe_lite": _glm4_moe_lite_moe,
    "deepseek_v2": _deepseek_v2_moe,
    "ernie4_5_moe": _ernie4_5_moe,
    "olmoe": _olmoe_moe,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "gpt_oss": _gpt_oss_moe,
}

_BUILDERS = {
    "qwen3": lambda hf, head_dim, local_rope: dict(qk_norm="head"),
    "qwen3_moe": lambda hf, head_dim, local_rope: dict(qk_norm="head"),
    "gemma": _gemma1,
    "gemma2": _gemma,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "gemma3n": _gemma3n,
    "olmo2": lambda hf, head_dim, local_rope: dict(norms=OUTPUT_NORMS, qk_norm="full"),
    "glm4": lambda hf, head_dim, local_rope: dict(norms=GLM4_NORMS),
    # GLM-4.5's attention: partial rotary (rotate-half on its first dims), q/k/v biases, per-head
    # q/k norms where use_qk_norm
    "glm4_moe": lambda hf, head_dim, local_rope: dict(
        qk_norm="head" if getattr(hf, "use_qk_norm", False) else ""
    ),
    "exaone4": _exaone4,
    "olmoe": lambda hf, head_dim, local_rope: dict(qk_norm="full"),
    "olmo3": _olmo3,
    # Seed-OSS: q/k/v biases (attention_bias) and the o_proj's own (attention_out_bias)
    "seed_oss": lambda hf, head_dim, local_rope: dict(
        o_bias=bool(getattr(hf, "attention_out_bias", False))
    ),
    "granite": _granite,
    "granitemoe": _granite,
    "granitemoehybrid": _granite_hybrid,
    "smollm3": _smollm3,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5,
    "qwen3_next": _qwen3_5,  # Qwen3.5's layers (its delta nets' projections stored interleaved)
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2,
    "nemotron_h": _nemotron_h,
    "bamba": _bamba,
    "deepseek_v2": _mla,
    "deepseek_v3": _mla,
    "glm4_moe_lite": _mla,
    # Arcee (AFM-4.5B): Llama's layer with an ungated relu(x)^2 MLP
    "arcee": lambda hf, head_dim, local_rope: dict(act="relu2"),
}


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {name!r}; supported: {list(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _refuse_unsupported(hf, family: str) -> None:
    """Settings inside a supported family that conveyor does not compute: refused by name."""
    act = getattr(hf, "hidden_act", None) or "silu"
    supported = "relu2" if family == "arcee" else "silu"
    if family not in ("gemma", "gemma2", "gemma3", "gemma4", "gemma3n"):
        if act != supported:
            raise ValueError(
                f"unsupported hidden_act {act!r} for {family}; supported: {supported!r}"
            )
    if family == "nemotron_h" and getattr(hf, "sliding_window", None):
        raise ValueError("unsupported sliding_window for nemotron_h")
    if family == "gemma3" and getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("unsupported use_bidirectional_attention for gemma3 (causal only)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"unsupported mlp_bias for {family}")
    if getattr(hf, "clip_qkv", None) is not None:
        raise ValueError(f"unsupported clip_qkv for {family} (q, k and v clamped)")
    if family in MLA_FAMILIES and getattr(hf, "attention_bias", False):
        raise ValueError(f"unsupported attention_bias for {family} (biased latent projections)")
    if family in ("ernie4_5", "ernie4_5_moe") and getattr(hf, "use_bias", False):
        raise ValueError(f"unsupported use_bias for {family} (biased projections and MLP)")
