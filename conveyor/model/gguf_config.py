"""A Hugging Face config for GGUF files of the families beyond Llama's four, from llama.cpp's
metadata keys.

transformers converts no GGUF config of OLMo 2, Granite or SmolLM3, and for Gemma 2 / 3 and
Phi-3 it drops what these families compute with (soft-caps, sliding layers, the local RoPE
base, the query scale), so the config of each is written here, one table for the keys they
share and one function per family for what llama.cpp does not store but fixes in its code
(llama-model.cpp): which layers slide (Gemma 2 every other one from layer 0, Gemma 3 all but
every sixth), the local RoPE base of Gemma 3 (10000), the query scale of Gemma (head_dim, or
hidden / heads for the 27B models: 46 or 62 layers), SmolLM3's RoPE-less layers (every
fourth). A file that states one of these (`attention.sliding_window_pattern`,
`rope.freq_base_swa`) is taken at its word.

The mixtures of experts: `qwen2moe`, `qwen3moe`, `olmoe`, `granitemoe` (Granite's multipliers,
its Q/K rows permuted as Granite's), and `llama` with `expert_count` (Mixtral).

Nemotron-H (`nemotron_h`, and Nemotron 3 as `nemotron_h_moe`) keeps its blocks as llama.cpp's
layers: a per-block head_count_kv marks attention, a per-block feed_forward_length an MLP (a
mixture), the others are Mamba2 (gguf_loader pairs them into decoder layers as model/families
does).

Granite 4.0-H (`granitehybrid`) states its Mamba2 layers as a per-layer head_count_kv of 0 and
their sizes by the ssm keys; its experts (-H-Tiny, -H-Small) as Granite MoE's, beside the shared
MLP (expert_shared_feed_forward_length), added ungated.
llama.cpp makes every layer a mixture in these, renormalises the top-k weights of `qwen3moe`
and of Mixtral but not of `qwen2moe` (its build_moe_ffn's norm_w), and gates `qwen2moe`'s
shared expert by a sigmoid; the configs say the same to transformers.

Qwen3.5 (`qwen35`, and `qwen35moe` with its experts) states its gated delta nets by llama.cpp's
ssm keys (conv_kernel, state_size: the key head dim, group_count: the key heads,
time_step_rank: the value heads, inner_size), its attention layers by full_attention_interval,
and counts its multi-token prediction layers in block_count (nextn_predict_layers of them,
after the model's own). Qwen3-Next (`qwen3next`) states them so too; its converter splits
in_proj_qkvz into attn_qkv and attn_gate, keeps in_proj_ba as ssm_ba, and keeps the value heads
in transformers' order; every layer a mixture with a shared expert.

OLMo 3 is converted as `olmo2` with a sliding window: sliding layers by plain RoPE, the full
ones by the (yarn-scaled) global RoPE, as llama.cpp's olmo2 graph runs them.

DeepSeek-V2 / V3 (and GLM-4.7-Flash) are `deepseek2`: latent attention's
sizes under its attention keys, kv_b_proj split into attn_k_b / attn_v_b (_deepseek2).

Ministral 3 is `mistral3`: its yarn with one yarn_log_multiplier for transformers' mscale
and mscale_all_dim, and its query scale (llama_4_scaling_beta) as attention.temperature_scale.

ERNIE 4.5 (`ernie4_5`) is stored as transformers holds it (its interleaved rotary pairs
unpermuted). EXAONE 4 (`exaone4`) states its window and which layers slide
(sliding_window_pattern); llama.cpp gives a 64-layer file that states none a 4096 window with
every fourth layer global, and so does this.

LFM2 states its attention layers by a per-layer head_count_kv (0 on its short convolutions) and
the MLP's width already adjusted (transformers' GGUF reader takes them so too). LFM2-MoE
(`lfm2moe`) has LFM2's layers, dense MLPs on the first leading_dense_block_count and mixtures
after them, chosen by sigmoid scores (expert_gating_func 2; another is refused) plus the
exp_probs_b bias where the file has it; llama.cpp's build_moe_ffn renormalises the chosen
weights and scales them by nothing, so norm_topk_prob and a routed_scaling_factor of 1.

Gemma 4 (`gemma4`) states its layers by keys and tensors alike (_gemma4): which layers slide
(one flag each), each kind's head size (key_length / key_length_swa), the shared caches
(shared_kv_layers), the values its keys where a full layer has no attn_v, its full layers'
proportional RoPE as a rope_freqs tensor (1 on the turned pairs, 1e30 on the others: not
llama3's divisors), its experts beside every MLP; its norms are stored as w (no 1 added).

Gemma 3n (`gemma3n`, _gemma3n): AltUp's streams (altup.num_inputs, altup.active_idx), Laurel's
rank by its tensors, the per-layer inputs (their vocabulary: per_layer_token_embd's rows but
the zero rows its converter pads the table with up to the vocabulary), each layer's gate
sparsity as the normal quantile its converter stores (activation_sparsity_scale, turned back
into the sparsity whose float32 quantile it is), the sliding layers' RoPE base 10000
(llama.cpp's, unwritten); its norms are stored as w.

Phi-3's longrope (Phi-3.5, Phi-4-mini) is stored as two tensors, rope_factors_long / _short,
which become the config's long_factor / short_factor. llama3 scaling (Llama 3.1-3.3, EXAONE 4)
is stored as one tensor too, rope_freqs: a divisor per frequency, which llama3_rope turns back
into the llama3 parameters that give those divisors (for every family, Llama's four included).
A setting the file states and conveyor does not compute (rope_freqs that no llama3 parameters
give, a rope scaling type) is refused by name, never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# HF model_type and class of each llama.cpp architecture handled here.
FAMILIES = {
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    # Gemma 3n's language model (AltUp, Laurel, per-layer inputs: _gemma3n)
    "gemma3n": ("gemma3n_text", "Gemma3nForCausalLM"),
    # Gemma 4's language model (and its experts): its layers stated by its tensors too (_gemma4)
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    # A Qwen2-VL / Qwen2.5-VL's language model, as llama.cpp converts it: Qwen2's tensors (its
    # multimodal RoPE sections are one position on text)
    "qwen2vl": ("qwen2", "Qwen2ForCausalLM"),
    # A Qwen3-VL's (and Qwen3-VL-MoE's) language model: Qwen3's (Qwen3-MoE's) tensors; its
    # interleaved multimodal RoPE is one position on text, its deepstack layers take images only
    "qwen3vl": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3vlmoe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "arcee": ("arcee", "ArceeForCausalLM"),  # Llama's layer, an ungated relu(x)^2 MLP
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
    "lfm2moe": ("lfm2_moe", "Lfm2MoeForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "ernie4_5": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "ernie4_5-moe": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),  # GLM-4.5 / 4.6 / 4.7
    # DeepSeek-V3 (and GLM-4.7-Flash) by sigmoid gating, else DeepSeek-V2
    # (_deepseek2)
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "exaone4": ("exaone4", "Exaone4ForCausalLM"),
    "seed_oss": ("seed_oss", "SeedOssForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM"),
    # Granite 4.0-H (and its experts): Mamba2 layers beside attention (_granitehybrid)
    "granitehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    # Nemotron-H, and Nemotron 3 with its mixtures: blocks as llama.cpp's layers (_nemotron_h)
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "nemotron_h_moe": ("nemotron_h", "NemotronHForCausalLM"),
    # Ministral 3 (its yarn and query scale), else a Mistral (_mistral3)
    "mistral3": ("ministral3", "Ministral3ForCausalLM"),
}
# A `llama` file with experts is Mixtral's (llama.cpp converts Mixtral with its llama converter).
MIXTRAL = ("mixtral", "MixtralForCausalLM")

# `{arch}.` + key -> HF config field, for the keys llama.cpp writes in the same sense for all.
_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    # Granite's multipliers, which llama.cpp names scales
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
    # mixtures of experts
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
_ROPE_SCALINGS = ("none", "linear", "yarn")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B of each


def hf_config_dict(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_factors: dict[str, list[float]] | None = None,
    per_layer_vocab: int | None = None,
) -> dict[str, Any]:
    """The config.json fields of a GGUF file of one of FAMILIES, from its key-values and the
    (torch order) shapes of its tensors by GGUF name; rope_factors: the values of the file's
    rope factor tensors by name (a Phi-3 file's rope_factors_long / _short, llama3's
    rope_freqs), where it has them; per_layer_vocab: a gemma3n file's per-layer vocabulary,
    its per_layer_token_embd's rows but the converter's zero padding (default: all of them)."""
    arch = metadata["general.architecture"]
    if arch not in FAMILIES and not is_mixtral(metadata):
        raise ValueError(f"GGUF architecture {arch!r} has no config mapping here")
    _refuse_extra_tensors(arch, set(tensor_shapes))
    model_type, class_name = MIXTRAL if is_mixtral(metadata) else FAMILIES[arch]
    config = {"model_type": model_type, "architectures": [class_name]}
    prefix = f"{arch}."
    for key, field in _KEYS.items():
        if (value := metadata.get(prefix + key)) is not None:
            config[field] = value
    # Most converters write no vocab_size: llama.cpp counts the embedding rows.
    config.setdefault("vocab_size", tensor_shapes["token_embd.weight"][0])
    config["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    for field, name in _TOKEN_IDS.items():
        config[field] = metadata.get(f"tokenizer.ggml.{name}_token_id")
    config["rope_parameters"] = rope_parameters(metadata, arch)
    if arch == "gemma4":  # its rope_freqs are its full layers' unturned dims, not llama3's
        _gemma4(metadata, config, tensor_shapes, (rope_factors or {}).get(LLAMA3_TENSOR))
        return config
    if arch == "gemma3n":  # Laurel's rank and the per-layer vocabulary by their tensors
        _gemma3n(metadata, config, tensor_shapes, per_layer_vocab)
        return config
    _FAMILY_FIELDS["mixtral" if is_mixtral(metadata) else arch](metadata, config)
    if LONGROPE_TENSORS[0] in tensor_shapes:
        _longrope(metadata, config, rope_factors)
    if LLAMA3_TENSOR in tensor_shapes:
        if rope_factors is None or LLAMA3_TENSOR not in rope_factors:
            raise ValueError(f"a GGUF {arch} file's {LLAMA3_TENSOR} was not read")
        set_llama3(config, rope_factors[LLAMA3_TENSOR], metadata, arch)
    if arch == "glm4":  # q/k/v biases, stated by their tensors
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch in ("ernie4_5", "ernie4_5-moe"):  # biased projections (refused), by their tensors
        config["use_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "glm4moe":  # q/k/v biases and q/k norms, by their tensors
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_shapes
    if arch == "granitehybrid":  # the Mamba2 convolution's bias, stated by its tensors
        config["mamba_conv_bias"] = any(n.endswith(".ssm_conv1d.bias") for n in tensor_shapes)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        config["use_conv_bias"] = any(n.endswith(".ssm_conv1d.bias") for n in tensor_shapes)
    if arch == "seed_oss":  # q/k/v biases and o_proj's, by their tensors
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        config["attention_out_bias"] = "blk.0.attn_output.bias" in tensor_shapes
    if config.get("num_experts"):
        _experts(arch, config, tensor_shapes)
    return config


def is_mixtral(metadata: dict[str, Any]) -> bool:
    """A `llama` file with experts: Mixtral."""
    return metadata.get("general.architecture") == "llama" and bool(
        metadata.get("llama.expert_count")
    )


def _experts(arch: str, config: dict[str, Any], tensor_shapes: dict) -> None:
    """The MoE fields llama.cpp fixes in code: every layer a mixture, top-k weights
    renormalised except qwen2moe's; a qwen2moe file states its q/k/v biases by their tensors."""
    if config["model_type"] == "mixtral":
        config["num_local_experts"] = config.pop("num_experts")
        config.pop("moe_intermediate_size", None)
        config["sliding_window"] = None
        return
    if config["model_type"] in ("granitemoe", "granitemoehybrid"):  # of feed_forward_length
        config["num_local_experts"] = config.pop("num_experts")
        config.pop("moe_intermediate_size", None)
        return
    if config["model_type"] == "olmoe":  # experts of feed_forward_length, not renormalised
        config.pop("moe_intermediate_size", None)  # (llama.cpp's olmoe: build_moe_ffn, no norm_w)
        config["norm_topk_prob"] = False
        return
    if config["model_type"] == "lfm2_moe":  # its choosing bias, stated by its tensors
        config["use_expert_bias"] = any(n.endswith(".exp_probs_b.bias") for n in tensor_shapes)
        return
    if config["model_type"] == "gpt_oss":  # its experts' width is intermediate_size
        config["num_local_experts"] = config.pop("num_experts")
        config["intermediate_size"] = config.pop("moe_intermediate_size")
        return
    config.update(mlp_only_layers=[], decoder_sparse_step=1, use_sliding_window=False)
    config["norm_topk_prob"] = arch != "qwen2moe"
    config.setdefault("intermediate_size", config["moe_intermediate_size"])
    if arch == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    else:
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])


# Phi-3's longrope factors, as llama.cpp's converter stores them (float32, one per pair of dims)
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama3 scaling's divisors, one per pair of dims (float32)
LLAMA3_TENSOR = "rope_freqs.weight"
# Meta's llama3 band edges and original context (Llama 3.1-3.3; EXAONE 4 took them too)
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL = 8192


def llama3_rope(
    divisors: list[float], theta: float, rotary_dim: int, original: int | None = None
) -> dict[str, Any]:
    """transformers' llama3 rope_parameters whose per-frequency divisors are a file's rope_freqs
    (llama.cpp's converter computes them from the same parameters, in float32). The divisors
    fix the scaling factor (the low band's), the band edges' wavelengths and the line between
    them, not the original context by itself: any original length with matching low and high
    factors gives the same frequencies. Tried: Meta's band factors with the file's original
    context (else 8192), then the line through the middle band's divisors; ValueError if
    neither gives every divisor within float32 rounding."""
    import numpy as np

    got = np.asarray(divisors, dtype=np.float64)
    if got.shape != (rotary_dim // 2,) or not np.all(np.isfinite(got)) or got.min() < 1.0:
        raise ValueError(
            f"rope_freqs holds {got.size} divisors, expected {rotary_dim // 2} finite ones >= 1"
        )
    factor = float(got.max())
    original = int(original or _LLAMA3_ORIGINAL)
    candidates = [(original, _LLAMA3_DEFAULTS)]
    wavelen = 2 * math.pi / _float32_freqs(theta, rotary_dim)
    middle = (got > 1.0) & (got < factor)
    if factor > 1.0 and middle.sum() >= 2:  # smooth = a / wavelen - b on the middle band
        smooth = (1 / got[middle] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(1 / wavelen[middle], smooth, 1)
        # the original length that makes the low factor 1 (Meta's), where one does
        fitted = round(a / -minus_b) if minus_b < 0 and a > 0 else original
        for length in {fitted, original}:
            if a > 0:
                low = float(-minus_b * length / a)
                bands = {"low_freq_factor": low, "high_freq_factor": low + float(length / a)}
                candidates.append((length, bands))
    for length, bands in candidates:
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **bands}
        params["original_max_position_embeddings"] = length
        if np.allclose(_llama3_divisors(params, rotary_dim), got, rtol=2e-6, atol=0):
            return params
    raise ValueError(
        "a GGUF file's rope_freqs are no llama3 scaling conveyor can state (per-frequency "
        "divisors other than llama3's); refused rather than served with another RoPE"
    )


def _float32_freqs(theta: float, head_dim: int):
    """The base frequencies as llama.cpp's converter computes them: in float32."""
    import numpy as np

    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponents).astype(np.float32)).astype(np.float64)


def _llama3_divisors(params: dict[str, Any], head_dim: int):
    """llama3's divisor of each frequency (transformers' and llama.cpp's formula)."""
    import numpy as np

    factor, original = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / _float32_freqs(params["rope_theta"], head_dim)
    smooth = (original / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle)
    )


def set_llama3(
    config: dict[str, Any], divisors: list[float], metadata: dict[str, Any], arch: str
) -> None:
    """The config's rope_parameters (the global ones, where a family has two) as the file's
    rope_freqs say: `config` holds rope_parameters, hidden_size, num_attention_heads and
    head_dim where it has one."""
    params = config["rope_parameters"]
    params = params.get("full_attention", params)
    if params["rope_type"] != "default":
        raise ValueError(f"a GGUF {arch} file states rope_freqs and {params['rope_type']} scaling")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    params.update(llama3_rope(divisors, params["rope_theta"], rotary, original))


def _refuse_extra_tensors(arch: str, tensor_names: set[str]) -> None:
    """Tensors that carry RoPE settings a config cannot say here; see the module docstring."""
    refused = []
    if arch != "phi3":
        refused.append((LONGROPE_TENSORS[0], "longrope scaling (rope_factors_long / _short)"))
    for name, what in refused:
        if name in tensor_names:
            raise ValueError(f"unsupported {what} in a GGUF {arch} file")
    if (LONGROPE_TENSORS[0] in tensor_names) != (LONGROPE_TENSORS[1] in tensor_names):
        raise ValueError(f"a GGUF {arch} file with one of {LONGROPE_TENSORS} needs both")


def _longrope(
    metadata: dict[str, Any], config: dict[str, Any], factors: dict[str, list[float]] | None
) -> None:
    """Phi-3.5 / Phi-4-mini's longrope, as transformers' config states it: llama.cpp keeps its
    factors as tensors, its original length and attention factor as keys. The attention
    factor is left to transformers where it is the one it derives (sqrt(1 + ln(s) / ln(n)) for
    s = context / original length n), which the file holds rounded to float32."""
    if factors is None or not all(name in factors for name in LONGROPE_TENSORS):
        raise ValueError("a GGUF phi3 file's longrope factors were not read")
    params = config["rope_parameters"]
    if params["rope_type"] != "default":
        raise ValueError(f"a GGUF phi3 file states longrope and {params['rope_type']} scaling")
    original = config["original_max_position_embeddings"]
    params.update(
        rope_type="longrope",
        long_factor=[float(f) for f in factors[LONGROPE_TENSORS[0]]],
        short_factor=[float(f) for f in factors[LONGROPE_TENSORS[1]]],
        original_max_position_embeddings=original,
    )
    stated = metadata.get("phi3.rope.scaling.attn_factor")
    scale = config["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    if stated is not None and not math.isclose(stated, derived, rel_tol=1e-6):
        params["attention_factor"] = float(stated)


def rope_parameters(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """rope_parameters of the (global) layers: base, and llama.cpp's linear or yarn scaling
    (Llama's four architectures, whose config transformers reads without the scaling keys,
    take them from here too)."""
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in _ROPE_SCALINGS:
        raise ValueError(
            f"unsupported {arch}.rope.scaling.type {scaling!r}; supported: {_ROPE_SCALINGS}"
        )
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling != "none" and factor not in (None, 1.0):
        params.update(rope_type=scaling, factor=factor)
        if scaling == "yarn":
            key = f"{arch}.rope.scaling.original_context_length"
            params["original_max_position_embeddings"] = metadata.get(key)
            if (attn := metadata.get(f"{arch}.rope.scaling.attn_factor")) is not None:
                params["attention_factor"] = attn
    return params


def _rotary_fraction(metadata: dict[str, Any], arch: str, config: dict[str, Any]) -> None:
    """rope.dimension_count below head_dim means partial rotary (refused by model/families)."""
    dims = metadata.get(f"{arch}.rope.dimension_count")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if dims is not None and dims != head_dim:
        config["rope_parameters"]["partial_rotary_factor"] = dims / head_dim


def _layer_types(metadata: dict[str, Any], arch: str, is_sliding: Callable[[int], bool]) -> list:
    """Per layer "sliding_attention" or "full_attention": the file's pattern, else llama.cpp's."""
    num_layers = metadata[f"{arch}.block_count"]
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) or (isinstance(pattern, int) and pattern > 0):
        flags = _sliding_flags(pattern, num_layers)
    else:
        flags = [is_sliding(i) for i in range(num_layers)]
    if not metadata.get(f"{arch}.attention.sliding_window"):
        flags = [False] * num_layers  # no window: every layer attends to the whole context
    return ["sliding_attention" if flag else "full_attention" for flag in flags]


def _gemma_scalar(arch: str, config: dict[str, Any]) -> None:
    """llama.cpp scales Gemma's queries by head_dim ** -0.5, by (hidden / heads) ** -0.5 on the
    27B models; query_pre_attn_scalar says the same to transformers."""
    heads = config["num_attention_heads"]
    if config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads
    else:
        config["query_pre_attn_scalar"] = config.get("head_dim", 256)
    config["hidden_activation"] = "gelu_pytorch_tanh"


def _gemma2(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    _gemma_scalar("gemma2", config)
    # llama.cpp's defaults where the keys are absent (llama_hparams)
    config.setdefault("attn_logit_softcapping", 50.0)
    config.setdefault("final_logit_softcapping", 30.0)
    config["layer_types"] = _layer_types(metadata, "gemma2", lambda i: i % 2 == 0)
    config["sliding_window"] = metadata.get("gemma2.attention.sliding_window") or None


def _gemma3(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    _gemma_scalar("gemma3", config)
    config["attn_logit_softcapping"] = None
    config.setdefault("final_logit_softcapping", None)
    config["layer_types"] = _layer_types(metadata, "gemma3", lambda i: (i + 1) % 6 != 0)
    config["sliding_window"] = metadata.get("gemma3.attention.sliding_window") or None
    local = {"rope_type": "default", "rope_theta": metadata.get("gemma3.rope.freq_base_swa", 1e4)}
    config["rope_parameters"] = {
        "full_attention": config["rope_parameters"],
        "sliding_attention": local,
    }


# llama.cpp's final soft-cap where a gemma4 file states none (llama_hparams' default), and the
# divisor its converter stores in rope_freqs for a full layer's dim that does not turn.
_GEMMA4_FINAL_SOFTCAP = 30.0
_UNTURNED_DIVISOR = 1e30


def _gemma4(
    metadata: dict[str, Any],
    config: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: list[float] | None,
) -> None:
    """Gemma 4 as llama.cpp's gemma4 runs it: which layers slide (sliding_window_pattern, one
    flag per layer), each kind's head size (key_length: the full layers', key_length_swa: the
    sliding ones') and a per-layer head_count_kv, the keys as values where a full layer has no
    attn_v (attention_k_eq_v), the last shared_kv_layers reading earlier caches, the MLP's width
    per layer (double-wide on the shared layers), per-layer inputs, experts beside every MLP,
    the full layers' "proportional" RoPE (rope_freqs: 1 on the turned pairs, 1e30 on the
    others) and the sliding ones' (freq_base_swa). What transformers' Gemma 4 cannot state the
    same way is refused by name (see the helpers)."""
    arch, num_layers = "gemma4", config["num_hidden_layers"]
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(
            f"a GGUF gemma4 file's {arch}.attention.sliding_window_pattern is {pattern!r}: "
            f"llama.cpp's gemma4 needs one flag per layer ({num_layers})"
        )
    sliding = [bool(flag) for flag in pattern]
    if sliding[-1]:  # transformers' Gemma 4 makes its last layer a full one
        raise ValueError("a GGUF gemma4 file whose last layer slides is not Gemma 4's")
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    config["sliding_window"] = metadata[f"{arch}.attention.sliding_window"]
    shared = metadata.get(f"{arch}.attention.shared_kv_layers", 0)
    _gemma4_kv_sources(sliding, shared)
    config["num_kv_shared_layers"] = shared
    own = num_layers - shared  # the layers that compute keys and values
    _gemma4_heads(metadata, config, sliding)
    config["attention_k_eq_v"] = _gemma4_values_are_keys(tensor_shapes, sliding, own)
    _gemma4_mlp(config, own)
    width = metadata.get(f"{arch}.embedding_length_per_layer_input", 0)
    config["hidden_size_per_layer_input"] = width
    if width:
        config["vocab_size_per_layer_input"] = tensor_shapes["per_layer_token_embd.weight"][0]
    _gemma4_experts(config, tensor_shapes)
    config["rope_parameters"] = _gemma4_rope(metadata, config, rope_freqs)
    config.setdefault("final_logit_softcapping", _GEMMA4_FINAL_SOFTCAP)
    config.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False)


def _gemma4_kv_sources(sliding: list[bool], shared: int) -> None:
    """llama.cpp's shared layers read layer n - 2 (sliding) or n - 1 (full) of the n that
    compute keys and values; transformers' read the last of those of their kind. Refused where
    the two differ."""
    own = len(sliding) - shared
    if shared and own < 1:
        raise ValueError(f"a GGUF gemma4 file shares the caches of all {len(sliding)} layers")
    for layer in range(own, len(sliding)):
        theirs = own - (2 if sliding[layer] else 1)
        kind = [i for i in range(own) if sliding[i] == sliding[layer]]
        if not kind or kind[-1] != theirs:
            raise ValueError(
                f"a GGUF gemma4 file's layer {layer} reads layer {theirs}'s cache in llama.cpp, "
                "not the last earlier layer of its kind's (as transformers' Gemma 4 does)"
            )


def _gemma4_heads(metadata: dict[str, Any], config: dict[str, Any], sliding: list[bool]) -> None:
    """The sliding layers' head size and KV heads as the config's own, each other layer's in
    per_layer_config."""
    arch = "gemma4"
    full, local = (metadata[f"{arch}.attention.key_length{k}"] for k in ("", "_swa"))
    for key, size in (("value_length", full), ("value_length_swa", local)):
        if metadata.get(f"{arch}.attention.{key}", size) != size:
            raise ValueError(f"a GGUF gemma4 file's {arch}.attention.{key} is not its key length")
    kv = config["num_key_value_heads"]
    kv = list(kv) if isinstance(kv, list) else [kv] * len(sliding)
    heads = [(local if s else full, n) for s, n in zip(sliding, kv, strict=True)]
    base = heads[sliding.index(True)] if any(sliding) else heads[0]
    config["head_dim"], config["num_key_value_heads"] = base
    config["per_layer_config"] = {
        i: {"head_dim": dim, "num_key_value_heads": n}
        for i, (dim, n) in enumerate(heads)
        if (dim, n) != base
    }


def _gemma4_values_are_keys(tensor_shapes: dict, sliding: list[bool], own: int) -> bool:
    """attention_k_eq_v: llama.cpp takes the keys as values on a layer without attn_v;
    transformers on every full layer with attention_k_eq_v, on no sliding one."""
    without = [i for i in range(own) if f"blk.{i}.attn_v.weight" not in tensor_shapes]
    full = [i for i in range(own) if not sliding[i]]
    if without and without != full:
        raise ValueError(
            f"a GGUF gemma4 file without attn_v on layers {without}: Gemma 4 takes its keys as "
            f"values on every full-attention layer (attention_k_eq_v: {full}) or on none"
        )
    return bool(without)


def _gemma4_mlp(config: dict[str, Any], own: int) -> None:
    """feed_forward_length per layer: one width, twice it on the shared layers
    (use_double_wide_mlp)."""
    widths = config["intermediate_size"]
    widths = list(widths) if isinstance(widths, list) else [widths] * config["num_hidden_layers"]
    base, rest = widths[0], set(widths[own:])
    if set(widths[:own]) != {base} or len(rest) > 1 or rest - {base, 2 * base}:
        raise ValueError(
            f"a GGUF gemma4 file's feed_forward_length {widths}: Gemma 4's MLPs have one width, "
            "twice it on the shared layers (use_double_wide_mlp)"
        )
    config["intermediate_size"] = base
    config["use_double_wide_mlp"] = rest == {2 * base}


def _gemma4_experts(config: dict[str, Any], tensor_shapes: dict) -> None:
    """Experts beside every layer's MLP (enable_moe_block), routed by softmax and renormalised
    top-k weights as llama.cpp's gemma4 graph routes them (it reads no gating key)."""
    experts = config.pop("num_experts", None)
    top_k = config.pop("num_experts_per_tok", None)
    if not experts:
        config.pop("moe_intermediate_size", None)
        config["enable_moe_block"] = False
        return
    layers = config["num_hidden_layers"]
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    if len(routed) != layers:
        raise ValueError(
            f"a GGUF gemma4 file with experts on layers {routed} of {layers}: Gemma 4 has "
            "them beside every layer's MLP"
        )
    config.update(enable_moe_block=True, num_experts=experts, top_k_experts=top_k)


def _gemma4_rope(
    metadata: dict[str, Any], config: dict[str, Any], rope_freqs: list[float] | None
) -> dict[str, Any]:
    """The sliding layers turn every dim by freq_base_swa (llama.cpp's default 10000); the full
    ones the pairs whose rope_freqs divisor is 1, as transformers' "proportional" RoPE with
    partial_rotary_factor = 2 x those pairs / head size (the others' 1e30 turns them by ~0)."""
    arch = "gemma4"
    if metadata.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError(f"unsupported {arch}.rope.scaling.type for Gemma 4's proportional RoPE")
    full = (config.get("per_layer_config") or {}).get(config["layer_types"].index("full_attention"))
    full_dim, local_dim = (full or {}).get("head_dim", config["head_dim"]), config["head_dim"]
    for key, dim in (("dimension_count", full_dim), ("dimension_count_swa", local_dim)):
        if metadata.get(f"{arch}.rope.{key}", dim) != dim:
            raise ValueError(
                f"a GGUF gemma4 file's {arch}.rope.{key} is not its head size ({dim}): "
                "conveyor runs Gemma 4's RoPE over whole heads (the full layers' pairs by "
                "rope_freqs)"
            )
    turned = full_dim // 2
    if rope_freqs is not None:
        turned = sum(1 for f in rope_freqs if f == 1.0)
        stated = [1.0] * turned + [_UNTURNED_DIVISOR] * (full_dim // 2 - turned)
        if len(rope_freqs) != full_dim // 2 or any(
            f != want and not (want > 1.0 and f >= want)
            for f, want in zip(rope_freqs, stated, strict=True)
        ):
            raise ValueError(
                "a GGUF gemma4 file's rope_freqs are not Gemma 4's proportional RoPE (divisors "
                f"1, then >= {_UNTURNED_DIVISOR:g}, {full_dim // 2} of them); refused rather "
                "than served with another RoPE"
            )
    proportional = {
        "rope_type": "proportional",
        "partial_rotary_factor": 2 * turned / full_dim,
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
    }
    local = {"rope_type": "default", "rope_theta": metadata.get(f"{arch}.rope.freq_base_swa", 1e4)}
    return {"full_attention": proportional, "sliding_attention": local}


def _gemma3n(
    metadata: dict[str, Any],
    config: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    per_layer_vocab: int | None,
) -> None:
    """Gemma 3n as llama.cpp's Gemma3NModel writes it (see the module docstring); its final
    soft-cap 30 where the file states none (llama.cpp's default, and transformers')."""
    arch, num_layers = "gemma3n", config["num_hidden_layers"]
    widths = config["intermediate_size"]
    config["intermediate_size"] = widths if isinstance(widths, list) else [widths] * num_layers
    config["layer_types"] = _layer_types(metadata, arch, lambda i: (i + 1) % 5 != 0)
    config["sliding_window"] = metadata[f"{arch}.attention.sliding_window"]
    local = {"rope_type": "default", "rope_theta": 10000.0}  # llama.cpp's, whatever the file
    full = config["rope_parameters"]
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    config["num_kv_shared_layers"] = metadata.get(f"{arch}.attention.shared_kv_layers", 0)
    config["altup_num_inputs"] = metadata[f"{arch}.altup.num_inputs"]
    config["altup_active_idx"] = metadata[f"{arch}.altup.active_idx"]
    config["altup_correct_scale"] = True  # llama.cpp's gemma3n always scales the active stream
    config["hidden_size_per_layer_input"] = metadata[f"{arch}.embedding_length_per_layer_input"]
    rows = tensor_shapes["per_layer_token_embd.weight"][0]
    config["vocab_size_per_layer_input"] = per_layer_vocab or rows
    config["laurel_rank"] = tensor_shapes["blk.0.laurel_l.weight"][0]
    scales = metadata.get(f"{arch}.activation_sparsity_scale", [])
    if len(scales) != num_layers:
        raise ValueError(
            f"a GGUF gemma3n file's {arch}.activation_sparsity_scale has {len(scales)} values: "
            f"Gemma 3n needs one per layer ({num_layers})"
        )
    config["activation_sparsity_pattern"] = [_sparsity_of(float(q)) for q in scales]
    config.setdefault("final_logit_softcapping", 30.0)
    config.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False)


def _sparsity_of(quantile: float) -> float:
    """The sparsity whose float32 normal quantile (icdf, as transformers and llama.cpp's
    converter compute it) is `quantile` (-inf: 0, no sparsity); refused where none is."""
    if quantile == -math.inf:
        return 0.0
    import torch  # (the config mapping needs it for this family alone)

    normal = torch.distributions.normal.Normal(0, 1)
    target = torch.tensor(quantile, dtype=torch.float32)

    def gives(p: float) -> bool:
        return 0 <= p < 1 and bool(normal.icdf(torch.tensor(p, dtype=torch.float32)) == target)

    guess = normal.cdf(target)
    for toward in (1.0, 0.0):  # the cdf's value, then its float32 neighbours either side
        candidate = guess
        for _ in range(8):
            if gives(float(candidate)):  # the shortest decimal that gives it (a config's 0.95)
                return next(p for d in range(1, 18) if gives(p := round(float(candidate), d)))
            candidate = torch.nextafter(candidate, torch.tensor(toward))
    raise ValueError(
        f"a GGUF gemma3n file's activation_sparsity_scale {quantile!r} is no float32 normal "
        "quantile of a sparsity in [0, 1)"
    )


def _phi3(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    _rotary_fraction(metadata, "phi3", config)
    config["sliding_window"] = metadata.get("phi3.attention.sliding_window") or None
    original = metadata.get("phi3.rope.scaling.original_context_length")
    config["original_max_position_embeddings"] = original or config["max_position_embeddings"]


def _gpt_oss(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """llama.cpp's gpt-oss: sliding and full layers alternate from a sliding one (its swa
    pattern 2), q/k/v/o biases, the SwiGLU clamp at 7 with alpha 1.702, YaRN untruncated."""
    config["layer_types"] = _layer_types(metadata, "gpt-oss", lambda i: i % 2 == 0)
    config["sliding_window"] = metadata.get("gpt-oss.attention.sliding_window") or None
    config["attention_bias"] = True
    config.update(swiglu_alpha=1.702, swiglu_limit=7.0)
    if config["rope_parameters"]["rope_type"] == "yarn":
        config["rope_parameters"].update(truncate=False, beta_fast=32.0, beta_slow=1.0)


def _sliding_flags(pattern: Any, num_layers: int, period: int = 4) -> list[bool]:
    """Which layers slide, from a file's sliding_window_pattern: a flag per layer, or a period
    (llama.cpp's set_swa_pattern(n): every n-th layer full), `period` where it states none."""
    if isinstance(pattern, list):
        return [bool(p) for p in pattern]
    n = pattern if isinstance(pattern, int) and pattern > 0 else period
    return [(i + 1) % n != 0 for i in range(num_layers)]


_EXAONE4_32B_LAYERS = 64  # llama.cpp's EXAONE 4.0 32B: a 4096 window, every fourth layer global


def _exaone4(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """EXAONE 4: sliding layers where the file states a window (the converter writes its
    pattern with it), llama.cpp's 32B defaults where a 64-layer file states none; else every
    layer global (and every one turns by RoPE, as transformers' EXAONE 4 without a window)."""
    num_layers = config["num_hidden_layers"]
    big = num_layers == _EXAONE4_32B_LAYERS
    window = metadata.get("exaone4.attention.sliding_window") or (4096 if big else None)
    pattern = metadata.get("exaone4.attention.sliding_window_pattern")
    sliding = _sliding_flags(pattern, num_layers) if window else [False] * num_layers
    config["sliding_window"] = window
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]


def _mistral3(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """Ministral 3, which llama.cpp converts as mistral3 (from Ministral3's llama converter: Q/K
    permuted): its yarn, whose mscale and mscale_all_dim llama.cpp keeps as one
    yarn_log_multiplier, the yarn betas where stated, and llama_4_scaling_beta as the attention's
    temperature_scale. Without yarn, a Mistral."""
    params = config["rope_parameters"]
    if params["rope_type"] != "yarn":
        config.update(model_type="mistral", architectures=["MistralForCausalLM"])
        config["sliding_window"] = None
        return
    log_mul = metadata.get("mistral3.rope.scaling.yarn_log_multiplier", 1.0)
    params.update(mscale=log_mul, mscale_all_dim=log_mul)
    for beta in ("beta_fast", "beta_slow"):
        if (value := metadata.get(f"mistral3.rope.scaling.yarn_{beta}")) is not None:
            params[beta] = value
    if (scale := metadata.get("mistral3.attention.temperature_scale")) is not None:
        params["llama_4_scaling_beta"] = scale


def _olmo2(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """OLMo 2, or OLMo 3 where the file states a window (llama.cpp converts OLMo 3 as olmo2):
    its sliding layers as the stated pattern (a list, or a period: every period-th layer full,
    4 if none is stated), turning by plain RoPE of freq_base_swa (else the global base), the
    full ones by the global RoPE with its (yarn) scaling, as llama.cpp's olmo2 graph does."""
    _rotary_fraction(metadata, "olmo2", config)
    window = metadata.get("olmo2.attention.sliding_window")
    if not window:
        return
    config.update(model_type="olmo3", architectures=["Olmo3ForCausalLM"], sliding_window=window)
    pattern = metadata.get("olmo2.attention.sliding_window_pattern")
    sliding = _sliding_flags(pattern, config["num_hidden_layers"])
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = config["rope_parameters"]
    base = metadata.get("olmo2.rope.freq_base_swa", full["rope_theta"])
    local = {"rope_type": "default", "rope_theta": base}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


def _llama_like(arch: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    return lambda metadata, config: _rotary_fraction(metadata, arch, config)


def _smollm3(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    _rotary_fraction(metadata, "smollm3", config)
    config["use_sliding_window"] = False
    # llama.cpp: every fourth layer without RoPE (n_no_rope_layer_step), no key for it
    config["no_rope_layer_interval"] = 4
    layers = range(config["num_hidden_layers"])
    config["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in layers]


def _lfm2_layers(arch: str, metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """LFM2's layers: one with KV heads attends, one without is a short convolution
    (shortconv.l_cache its kernel)."""
    kv = config["num_key_value_heads"]
    kv = list(kv) if isinstance(kv, list) else [kv] * config["num_hidden_layers"]
    config["num_key_value_heads"] = max(kv)
    config["layer_types"] = ["full_attention" if n else "conv" for n in kv]
    config["conv_L_cache"] = metadata[f"{arch}.shortconv.l_cache"]
    config["norm_eps"] = config.pop("rms_norm_eps")


def _lfm2(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """LFM2: its layers; feed_forward_length is the MLP's width as it runs."""
    _lfm2_layers("lfm2", metadata, config)
    config["block_auto_adjust_ff_dim"] = False


_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_SOFTMAX_GATING = 1  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _deepseek2(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """DeepSeek-V2 / V3 as llama.cpp's deepseek2: latent attention's sizes (kv_lora_rank, the
    per-head key_length_mla and value_length_mla; files older than those keys state the heads'
    key_length and value_length instead), RoPE on adjacent pairs of rope.dimension_count dims
    (llama.cpp's converter keeps transformers' interleaved rows), yarn's mscale_all_dim as ten
    times yarn_log_multiplier (one value for transformers' mscale and mscale_all_dim), dense
    layers before leading_dense_block_count, then mixtures: by sigmoid scores (V3; its groups
    where expert_group_count states them) or by softmax (V2's greedy, and what llama.cpp takes
    for a file that states no gating); the MTP layers left out."""
    arch = "deepseek2"
    gating = metadata.get(f"{arch}.expert_gating_func", _SOFTMAX_GATING)
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ValueError(
            f"a GGUF deepseek2 file's deepseek2.expert_gating_func is {gating!r}: DeepSeek routes "
            f"by softmax ({_SOFTMAX_GATING}) or sigmoid ({_SIGMOID_GATING}) scores"
        )
    if gating == _SOFTMAX_GATING:
        config.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
        config["topk_method"] = "greedy"
    config["num_hidden_layers"] -= metadata.get(f"{arch}.nextn_predict_layers", 0)
    rope = metadata[f"{arch}.rope.dimension_count"]
    key = metadata.get(f"{arch}.attention.key_length_mla")
    value = metadata.get(f"{arch}.attention.value_length_mla")
    if key is None:  # a file from before llama.cpp's absorbed MLA: the heads' own lengths
        key, value = config["head_dim"], metadata[f"{arch}.attention.value_length"]
    config.pop("head_dim", None)
    config.update(
        q_lora_rank=metadata.get(f"{arch}.attention.q_lora_rank") or None,
        kv_lora_rank=metadata[f"{arch}.attention.kv_lora_rank"],
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key - rope,
        v_head_dim=value,
        num_key_value_heads=config["num_attention_heads"],
        rope_interleave=True,
        attention_bias=False,
        **_grouped_mixture(metadata, arch, config, shared=0),
    )
    params = config["rope_parameters"]
    if params["rope_type"] == "yarn":
        # llama.cpp's converter writes 0.1 * mscale_all_dim (its TAG_DEEPSEEK2_YARN_LOG_MUL_FIX)
        log_mul = metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1)
        params.update(mscale=log_mul * 10, mscale_all_dim=log_mul * 10)
        for beta in ("beta_fast", "beta_slow"):
            if (stated := metadata.get(f"{arch}.rope.scaling.yarn_{beta}")) is not None:
                params[beta] = stated
    config.pop("shared_expert_intermediate_size", None)


def _lfm2moe(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """LFM2-MoE: LFM2's layers, the first leading_dense_block_count with dense MLPs of
    feed_forward_length, then mixtures as llama.cpp computes them (see the module docstring)."""
    _lfm2_layers("lfm2moe", metadata, config)
    gating = metadata.get("lfm2moe.expert_gating_func")
    if gating != _SIGMOID_GATING:
        raise ValueError(
            f"a GGUF lfm2moe file's lfm2moe.expert_gating_func is {gating!r}: conveyor runs "
            f"LFM2-MoE's sigmoid scores ({_SIGMOID_GATING}) only"
        )
    config["num_dense_layers"] = metadata["lfm2moe.leading_dense_block_count"]
    config.update(norm_topk_prob=True, routed_scaling_factor=1.0)


# llama.cpp's GraniteHybridModel writes this context length where the model turns no RoPE
# ("arbitrary"); a config says the released models' 128K instead.
_UNBOUNDED_CONTEXT, _GRANITE_4_CONTEXT = 2**20, 131072


def _granitehybrid(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """Granite 4.0-H: a layer with KV heads (a per-layer head_count_kv) attends, one without is
    a Mamba2 layer, its sizes the ssm keys (time_step_rank: the heads, inner_size: heads x
    head_dim, group_count, state_size, conv_kernel); no RoPE (llama.cpp's Bamba files, which
    state rope.scaling.finetuned, are refused); the shared MLP's width the
    expert_shared_feed_forward_length, or the feed_forward_length without experts."""
    arch = "granitehybrid"
    kv = config["num_key_value_heads"]
    kv = list(kv) if isinstance(kv, list) else [kv] * config["num_hidden_layers"]
    config["num_key_value_heads"] = max(kv)
    config["layer_types"] = ["attention" if n else "mamba" for n in kv]
    heads, inner = metadata[f"{arch}.ssm.time_step_rank"], metadata[f"{arch}.ssm.inner_size"]
    config.update(
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=metadata[f"{arch}.ssm.group_count"],
        mamba_d_state=metadata[f"{arch}.ssm.state_size"],
        mamba_d_conv=metadata[f"{arch}.ssm.conv_kernel"],
        mamba_expand=inner // config["hidden_size"],
        mamba_proj_bias=False,
    )
    if metadata.get(f"{arch}.rope.scaling.finetuned", False):  # llama.cpp's Bamba files
        raise ValueError(
            "a GGUF granitehybrid file with RoPE (rope.scaling.finetuned: Bamba) is not "
            "supported; its checkpoint (BambaForCausalLM) is"
        )
    config["position_embedding_type"] = "nope"
    if config.get("max_position_embeddings") == _UNBOUNDED_CONTEXT:
        config["max_position_embeddings"] = _GRANITE_4_CONTEXT
    shared = config.pop("shared_expert_intermediate_size", None)
    config["shared_intermediate_size"] = shared or config["intermediate_size"]
    config.setdefault("num_local_experts", 0)


def nemotron_h_block_types(metadata: dict[str, Any], arch: str, num_blocks: int) -> list[str]:
    """Each block's transformers layer type, from llama.cpp's per-block arrays: KV heads make
    it attention, a feed_forward_length an MLP (a mixture in nemotron_h_moe), else Mamba2."""

    def per_block(key: str) -> list[int]:
        value = metadata.get(f"{arch}.{key}", 0)
        return list(value) if isinstance(value, list) else [value] * num_blocks

    kv, ff = per_block("attention.head_count_kv"), per_block("feed_forward_length")
    mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
    return [
        "full_attention" if kv[i] else mlp if ff[i] else "linear_attention"
        for i in range(num_blocks)
    ]


def _nemotron_h(arch: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Nemotron-H's fields: its blocks' types from the per-block head_count_kv and
    feed_forward_length (nemotron_h_block_types), its Mamba2 sizes from the ssm
    keys, no RoPE; Nemotron 3's mixtures (nemotron_h_moe) from the expert keys, its groups
    all chosen where the file states no expert_group_used_count (llama.cpp then limits none);
    the MTP blocks left out."""

    def fields(metadata: dict[str, Any], config: dict[str, Any]) -> None:
        blocks = config.pop("num_hidden_layers") - metadata.get(f"{arch}.nextn_predict_layers", 0)
        types = nemotron_h_block_types(metadata, arch, blocks)
        kv = config["num_key_value_heads"]
        config["num_key_value_heads"] = max(kv) if isinstance(kv, list) else kv
        ff = config.pop("intermediate_size", 0)
        heads, inner = metadata[f"{arch}.ssm.time_step_rank"], metadata[f"{arch}.ssm.inner_size"]
        config.update(
            layers_block_type=types,
            intermediate_size=max(ff) if isinstance(ff, list) else ff,
            mamba_num_heads=heads,
            mamba_head_dim=inner // heads,
            n_groups=metadata[f"{arch}.ssm.group_count"],
            ssm_state_size=metadata[f"{arch}.ssm.state_size"],
            conv_kernel=metadata[f"{arch}.ssm.conv_kernel"],
            layer_norm_epsilon=config.pop("rms_norm_eps"),
            mlp_hidden_act="relu2",
        )
        if config.get("max_position_embeddings") == _UNBOUNDED_CONTEXT:
            config["max_position_embeddings"] = _GRANITE_4_CONTEXT
        if arch == "nemotron_h_moe":
            groups = metadata.get(f"{arch}.expert_group_count") or 1
            config.update(
                n_routed_experts=config.pop("num_experts"),
                moe_shared_expert_intermediate_size=config.pop("shared_expert_intermediate_size"),
                n_shared_experts=metadata.get(f"{arch}.expert_shared_count", 1),
                norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", False)),
                routed_scaling_factor=metadata.get(f"{arch}.expert_weights_scale", 1.0),
                n_group=groups,
                topk_group=metadata.get(f"{arch}.expert_group_used_count") or groups,
            )
        else:
            config.pop("num_experts", None)

    return fields


def _glm4moe(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """GLM-4.5: its rotary part of each head (rope.dimension_count), dense layers before
    leading_dense_block_count, mixtures after with sigmoid gating (another is refused), their
    groups from expert_group_count (llama.cpp's files state none: one), all chosen where the
    file states no expert_group_used_count; the MTP layers left out."""
    arch = "glm4moe"
    gating = metadata.get(f"{arch}.expert_gating_func", _SIGMOID_GATING)
    if gating != _SIGMOID_GATING:
        raise ValueError(
            f"a GGUF glm4moe file's glm4moe.expert_gating_func is {gating!r}: GLM-4.5 routes by "
            f"sigmoid scores ({_SIGMOID_GATING})"
        )
    config["num_hidden_layers"] -= metadata.get(f"{arch}.nextn_predict_layers", 0)
    _rotary_fraction(metadata, arch, config)
    config.update(_grouped_mixture(metadata, arch, config, shared=1))
    config.pop("shared_expert_intermediate_size", None)


def _grouped_mixture(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], shared: int
) -> dict[str, Any]:
    """GLM-4.5's and DeepSeek's mixture fields: the experts, `shared` shared ones where the file
    states no count, the leading dense layers, the weights' scale and renormalisation, the
    groups (expert_group_count; all chosen where expert_group_used_count is not stated)."""
    groups = metadata.get(f"{arch}.expert_group_count") or 1
    return dict(
        n_routed_experts=config.pop("num_experts"),
        n_shared_experts=metadata.get(f"{arch}.expert_shared_count", shared),
        first_k_dense_replace=metadata.get(f"{arch}.leading_dense_block_count", 0),
        routed_scaling_factor=metadata.get(f"{arch}.expert_weights_scale", 1.0),
        norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", False)),
        n_group=groups,
        topk_group=metadata.get(f"{arch}.expert_group_used_count") or groups,
        num_nextn_predict_layers=0,
    )


def _ernie4_5_moe(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """ERNIE 4.5 MoE: its mixtures from leading_dense_block_count on, every
    interleave_moe_layer_step-th layer, to the last; expert_shared_count shared experts of
    expert_feed_forward_length each (llama.cpp's shared width key is derived, not read)."""
    arch = "ernie4_5-moe"
    config.update(
        moe_num_experts=config.pop("num_experts"),
        moe_k=config.pop("num_experts_per_tok"),
        moe_num_shared_experts=metadata.get(f"{arch}.expert_shared_count", 0),
        moe_layer_start_index=metadata.get(f"{arch}.leading_dense_block_count", 1),
        moe_layer_interval=metadata.get(f"{arch}.interleave_moe_layer_step", 1),
        moe_layer_end_index=-1,
    )
    config.pop("shared_expert_intermediate_size", None)


def _qwen35(arch: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Qwen3.5's fields: its gated delta nets' sizes from the ssm keys, every interval-th layer
    attention, partial rotary (rope.dimension_count of key_length), the MTP layers left out."""

    def fields(metadata: dict[str, Any], config: dict[str, Any]) -> None:
        config["num_hidden_layers"] -= metadata.get(f"{arch}.nextn_predict_layers", 0)
        value_heads = metadata[f"{arch}.ssm.time_step_rank"]
        config.update(
            linear_conv_kernel_dim=metadata[f"{arch}.ssm.conv_kernel"],
            linear_key_head_dim=metadata[f"{arch}.ssm.state_size"],
            linear_num_key_heads=metadata[f"{arch}.ssm.group_count"],
            linear_num_value_heads=value_heads,
            linear_value_head_dim=metadata[f"{arch}.ssm.inner_size"] // value_heads,
        )
        interval = metadata.get(f"{arch}.full_attention_interval", 4)
        config["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config["num_hidden_layers"])
        ]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        dims = metadata.get(f"{arch}.rope.dimension_count", head_dim // 4)
        config["rope_parameters"]["partial_rotary_factor"] = dims / head_dim

    return fields


_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "gemma": lambda metadata, config: config.update(hidden_act="gelu_pytorch_tanh"),
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen2vl": lambda metadata, config: config.update(use_sliding_window=False),
    "qwen3vl": _llama_like("qwen3vl"),
    "qwen3vlmoe": _llama_like("qwen3vlmoe"),
    "glm4": _llama_like("glm4"),  # its rotary half of each head: rope.dimension_count
    "olmo2": _olmo2,
    "granite": _llama_like("granite"),
    "arcee": _llama_like("arcee"),
    "smollm3": _smollm3,
    "qwen2moe": _llama_like("qwen2moe"),
    "qwen3moe": _llama_like("qwen3moe"),
    "mixtral": _llama_like("llama"),
    "gpt-oss": _gpt_oss,
    "lfm2": _lfm2,
    "lfm2moe": _lfm2moe,
    "qwen35": _qwen35("qwen35"),
    "qwen35moe": _qwen35("qwen35moe"),
    "qwen3next": _qwen35("qwen3next"),
    "ernie4_5": _llama_like("ernie4_5"),
    "ernie4_5-moe": _ernie4_5_moe,
    "glm4moe": _glm4moe,
    "deepseek2": _deepseek2,
    "exaone4": _exaone4,
    "seed_oss": _llama_like("seed_oss"),
    "olmoe": _llama_like("olmoe"),
    "granitemoe": _llama_like("granitemoe"),
    "granitehybrid": _granitehybrid,
    "nemotron_h": _nemotron_h("nemotron_h"),
    "nemotron_h_moe": _nemotron_h("nemotron_h_moe"),
    "mistral3": _mistral3,
}
