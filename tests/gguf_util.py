"""Writing a tiny HF checkpoint as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

Only what a loader needs to rebuild config, tokenizer and weights from the file, plus the
llama.cpp details a loader must undo (Q/K row permutation, llama3 `rope_freqs`, quantization,
Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv and gate+up ffn_up and its longrope
factors as tensors, Gemma 4's proportional RoPE as rope_freqs, its scales and fused experts,
Gemma 3n's AltUp projections stacked and its sparsity as normal quantiles), under llama.cpp's
architecture names, metadata keys and tensor names (gguf.get_tensor_name_map).

What llama.cpp does not store but fixes in its code (Gemma's sliding layers and query scale,
Gemma 3's local RoPE base, SmolLM3's RoPE-less layers; see conveyor/model/gguf_config.py) a
checkpoint must match: write_gguf refuses one that does not, rather than write a file that
llama.cpp would run as another model. One deviation: every vocabulary is written as the byte
level BPE ("gpt2") it is in the tests, where llama.cpp writes Gemma 2's and Phi-3's from their
sentencepiece tokenizer.model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

# HF model_type -> llama.cpp architecture; llama.cpp converts Mistral with its llama converter.
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gemma3n_text": "gemma3n",
    "phi3": "phi3",
    "glm4": "glm4",
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # llama.cpp's Olmo2Model converts OLMo 3, with its window
    "granite": "granite",
    "arcee": "arcee",
    "granitemoe": "granitemoe",
    "ministral3": "mistral3",
    # llama.cpp's GraniteHybridModel writes Granite 4.0 without Mamba2 layers nor experts as
    # granite: its shared_mlp as the MLP; with Mamba2 layers as granitehybrid (gguf_arch)
    "granitemoehybrid": "granite",
    "smollm3": "smollm3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp's llama converter, with experts
    "gpt_oss": "gpt-oss",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2moe",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5-moe",
    "glm4_moe": "glm4moe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "exaone4": "exaone4",
    "seed_oss": "seed_oss",
    "olmoe": "olmoe",
    "nemotron_h": "nemotron_h",  # nemotron_h_moe with mixture blocks (gguf_arch)
}
# The experts' tensors one per expert in a checkpoint, and their 3-D stack in a GGUF file
# (llama.cpp's converters merge them); the routers llama.cpp keeps in F32.
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
# llama.cpp's LlamaModel and the converters built on it permute Q/K rows.
PERMUTED_QK = ("llama", "granite", "granitemoe", "granitehybrid", "smollm3", "mistral3")
PERMUTED_QK += ("nemotron_h", "nemotron_h_moe")  # GraniteHybridModel's, without RoPE too
PERMUTED_QK += ("arcee",)
NEMOTRON_H = ("nemotron_h", "nemotron_h_moe")
QWEN35 = ("qwen35", "qwen35moe")  # Qwen3.5 and Qwen3.5-MoE
DELTA_NETS = (*QWEN35, "qwen3next")  # and Qwen3-Next: gated delta nets under the ssm keys
LFM2 = ("lfm2", "lfm2moe")  # LFM2 and LFM2-MoE
LFM2_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # LFM2-MoE's expert leaves
NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")  # Gemma's converters store a norm weight w as 1 + w
QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def write_gguf(
    hf_dir: Path,
    out_path: Path,
    qtype: str = "F32",
    experts: str | None = None,
    arch: str | None = None,
    mtp_layers: int = 0,
    legacy_mla: bool = False,
) -> Path:
    """Converts the checkpoint in `hf_dir` to a GGUF at `out_path`, 2-D weights as `qtype`;
    the experts' 3-D weights as `experts` when given (llama.cpp's GPT-OSS files: "MXFP4");
    under `arch` when given (llama.cpp's qwen2vl: a Qwen2.5-VL's language model, Qwen2's
    tensors under another architecture name), else the model type's. mtp_layers: Qwen3.5's
    multi-token prediction layers after the model's, as llama.cpp's converter appends them
    (block_count counts them, nextn_predict_layers says how many; here copies of the last
    layer and its nextn tensors). legacy_mla: a deepseek2 file as llama.cpp wrote them before
    its absorbed MLA (2025-04): the heads' key and value lengths, attn_kv_b whole."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    config = AutoConfig.from_pretrained(hf_dir)
    config.gguf_legacy_mla = legacy_mla  # read by the deepseek2 writers below
    raw_config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = arch or gguf_arch(config)
    writer = gguf.GGUFWriter(out_path, arch)
    # Not "mistral": transformers 5.23 maps a llama file named exactly so to Mistral, then fails.
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config.num_hidden_layers + mtp_layers)  # MTP layers after the model's
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    _add_hparams(writer, config, raw_config, arch)
    _add_tokenizer(writer, hf_dir, config.vocab_size)
    expert_qtype = QTYPES[qtype] if experts is None else gguf.GGMLQuantizationType[experts]
    state = _state_dict(hf_dir, config)
    _add_tensors(writer, state, config, arch, QTYPES[qtype], expert_qtype)
    if mtp_layers:
        _add_mtp_layers(writer, state, config, arch, QTYPES[qtype], mtp_layers)
    _finish(writer)
    return out_path


def gguf_arch(config) -> str:
    """llama.cpp's architecture for a checkpoint's config: its model type's, but Granite 4.0
    with Mamba2 layers, which is granitehybrid."""
    if config.model_type == "granitemoehybrid" and _mamba_layers(config):
        return "granitehybrid"
    if config.model_type == "nemotron_h" and "moe" in config.layer_types:
        return "nemotron_h_moe"
    return GGUF_ARCHS[config.model_type]


def _mamba_layers(config) -> list[int]:
    return [i for i, t in enumerate(config.layer_types) if t in ("mamba", "linear_attention")]


def _add_mtp_layers(writer, state, config, arch: str, qtype, count: int) -> None:
    """Qwen3.5's MTP blocks after the model's own: the last layer's tensors again, and the
    nextn tensors (eh_proj, enorm, hnorm, shared_head_norm) of each."""
    layers = config.num_hidden_layers
    last = f"model.layers.{layers - 1}."
    for i in range(layers, layers + count):
        copies = {
            k.replace(last, f"model.layers.{i}.", 1): v
            for k, v in state.items()
            if k.startswith(last)
        }
        _add_tensors(writer, copies, config, arch, qtype, qtype, num_layers=layers + count)
        hidden = config.hidden_size
        nextn = {"eh_proj": np.ones((hidden, 2 * hidden), np.float32)}
        nextn |= {n: np.ones(hidden, np.float32) for n in ("enorm", "hnorm", "shared_head_norm")}
        for name, data in nextn.items():
            _add_tensor(writer, f"blk.{i}.nextn.{name}.weight", data, qtype)


def transformers_config(path: Path, checkpoint: Path):
    """transformers' config of a GGUF file written here from `checkpoint`, with the RoPE
    scaling its GGUF reader drops (llama.cpp's rope_freqs and rope.scaling keys, which conveyor
    reads) restated from the checkpoint: the reference a test compares a GGUF file's run with."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.rope_parameters = AutoConfig.from_pretrained(checkpoint).rope_parameters
    return config


def snap_to_float_gguf(hf_dir: Path) -> Path:
    """Rewrites the checkpoint's weights as the values its F32 and F16 GGUF files load back:
    matrices in float16's values, norms and biases in float32's (llama.cpp keeps 1-D tensors in
    F32), Gemma's norms such that float32 (1 + w) - 1 is w again; so that the GGUF files and
    the checkpoint hold the same model, bit for bit."""
    arch = gguf_arch(AutoConfig.from_pretrained(hf_dir))
    for shard in sorted(Path(hf_dir).glob("*.safetensors")):
        state = load_file(shard)
        for name, tensor in state.items():
            plus_one = _plus_one(arch, name)
            if tensor.dim() >= 2:
                tensor = tensor.to(torch.float16).to(tensor.dtype)
            state[name] = _f32_round_trip(tensor, plus_one)
        save_file(state, shard, metadata={"format": "pt"})
    return hf_dir


def _plus_one(arch: str, name: str) -> bool:
    """Whether llama.cpp's converter stores this norm's weight w as 1 + w: Gemma's, and
    Qwen3.5's but its delta nets' (linear_attn.norm, a plain w)."""
    if arch in DELTA_NETS:
        return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
    return arch in NORM_PLUS_ONE and name.endswith("norm.weight")


def _f32_round_trip(tensor: torch.Tensor, plus_one: bool) -> torch.Tensor:
    if not plus_one:
        return tensor.to(torch.float32).to(tensor.dtype)
    for _ in range(4):  # the writer adds 1 in the checkpoint's dtype, the loader subtracts in f32
        snapped = ((tensor + 1).to(torch.float32) - 1.0).to(tensor.dtype)
        if torch.equal(snapped, tensor):
            return tensor
        tensor = snapped
    raise AssertionError("a norm weight does not settle under the 1 + w round trip")


def write_bare_gguf(out_path: Path, arch: str) -> Path:
    """A minimal GGUF with `general.architecture = arch` and one tensor."""
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(writer)
    return out_path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rope(config) -> dict:
    # transformers 5 keeps rope_theta and scaling together in rope_parameters; Gemma 3 one set
    # per layer type, of which the file states the global layers'.
    params = dict(getattr(config, "rope_parameters", None) or {})
    params = dict(params.get("full_attention", params))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hparams(writer: gguf.GGUFWriter, config, raw_config: dict, arch: str) -> None:
    check_expressible(config, arch)
    # llama.cpp's GraniteHybridModel: an "arbitrary" context where no RoPE turns
    hybrid = arch in ("granitehybrid", *NEMOTRON_H)
    writer.add_context_length(2**20 if hybrid else config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if arch in NEMOTRON_H:  # per block: its MLP's width (an expert's), 0 elsewhere
        width = (
            config.moe_intermediate_size if arch == "nemotron_h_moe" else config.intermediate_size
        )
        mlp = ("mlp", "moe")
        writer.add_feed_forward_length([width if t in mlp else 0 for t in config.layer_types])
    elif arch != "gemma4":  # its widths per layer (_gemma4_hparams)
        writer.add_feed_forward_length(_mlp_width(config, arch))
    writer.add_head_count(config.num_attention_heads)
    if arch in LFM2:  # llama.cpp's LFM2: KV heads per layer, none on a short convolution
        kv = [0 if t == "conv" else config.num_key_value_heads for t in config.layer_types]
        writer.add_head_count_kv(kv)
        writer.add_shortconv_l_cache(config.conv_L_cache)
    elif arch in NEMOTRON_H:  # Nemotron-H's: on its attention blocks only
        kv = config.num_key_value_heads
        writer.add_head_count_kv([kv if t == "full_attention" else 0 for t in config.layer_types])
    elif hybrid:  # and Granite 4.0-H's, none on a Mamba2 layer
        mamba = _mamba_layers(config)
        layers = range(config.num_hidden_layers)
        writer.add_head_count_kv([0 if i in mamba else config.num_key_value_heads for i in layers])
    elif arch == "deepseek2":  # latent attention as llama.cpp's MQA: one KV head (before its
        # absorbed MLA: every head's own)
        writer.add_head_count_kv(config.num_attention_heads if config.gguf_legacy_mla else 1)
    elif arch != "gemma4":  # its KV heads per layer (_gemma4_hparams)
        writer.add_head_count_kv(config.num_key_value_heads)
    rope = _rope(config)
    if arch not in ("gemma", "gemma2"):  # GemmaModel and Gemma2Model write no base: 10000
        writer.add_rope_freq_base(rope["rope_theta"])
    eps = config.layer_norm_epsilon if arch in NEMOTRON_H else None
    writer.add_layer_norm_rms_eps(eps or (config.norm_eps if arch in LFM2 else config.rms_norm_eps))
    stated = raw_config.get("head_dim") is not None or arch in NORM_PLUS_ONE
    if arch not in ("deepseek2", "gemma4") and stated:
        writer.add_key_length(_head_dim(config))  # llama.cpp writes these when head_dim is stated
        writer.add_value_length(_head_dim(config))
    if arch in PERMUTED_QK:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(_head_dim(config))
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("linear", "yarn"):  # llama3 is written as the rope_freqs tensor instead
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope_type == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _FAMILY_HPARAMS.get(arch, lambda writer, config: None)(writer, config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    # (a dense Nemotron-H's config has expert defaults; Gemma 4 states its own)
    if experts and arch not in ("nemotron_h", "gemma4"):
        _expert_hparams(writer, config)


def _mlp_width(config, arch: str) -> int:
    """feed_forward_length: LFM2's converter writes its MLP's width as transformers adjusts it."""
    if arch != "lfm2" or not config.block_auto_adjust_ff_dim:
        return config.intermediate_size
    width = int(2 * config.intermediate_size / 3)
    if config.block_ffn_dim_multiplier is not None:
        width = int(config.block_ffn_dim_multiplier * width)
        multiple = config.block_multiple_of
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _expert_hparams(writer: gguf.GGUFWriter, config) -> None:
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "gpt_oss":  # its experts' width, and its windows
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "moe_intermediate_size", None):  # Qwen's; Mixtral's is ffn length
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _lfm2moe_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's LFM2-MoE: its dense layers' count, and sigmoid scores choosing the experts."""
    writer.add_leading_dense_block_count(config.num_dense_layers)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _mistral3_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Ministral3Model: yarn's mscale_all_dim as its log multiplier, the query
    scale's beta as the attention temperature scale."""
    rope = _rope(config)
    writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def _olmo3_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's OLMo 3 (as olmo2): the window, which layers slide, the sliding layers' base
    where it is not the global one (llama.cpp reads freq_base_swa)."""
    if config.model_type != "olmo3":
        return
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    local = config.rope_parameters["sliding_attention"]
    if local["rope_theta"] != _rope(config)["rope_theta"]:
        writer.add_rope_freq_base_swa(local["rope_theta"])


def _exaone4_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's EXAONE 4 converter: the window, and which layers slide, when it has one."""
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])


def _qwen35_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Qwen3.5: its gated delta nets' sizes under the ssm keys, the attention
    interval, the rotary dims, the (text-irrelevant) multimodal RoPE sections."""
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    partial = _rope(config).get("partial_rotary_factor", 0.25)
    writer.add_rope_dimension_count(int(_head_dim(config) * partial))
    if config.model_type != "qwen3_next":  # Qwen3.5's multimodal RoPE
        writer.add_rope_dimension_sections([11, 11, 10, 0])


def _qwen3next_tensors(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """What llama.cpp's Qwen3-Next converter does to a delta net's tensors: in_proj_qkvz (each
    key head's q, k, v and z rows) split into attn_qkv (every q, every k, every v) and attn_gate
    (the z rows), A_log as -exp(A_log), dt_bias as dt_proj.bias, the conv weight squeezed; the
    value heads stay in transformers' order, in_proj_ba (ssm_ba) as it is."""
    key_heads, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_key = config.linear_num_value_heads // key_heads * config.linear_value_head_dim
    out: dict[str, torch.Tensor] = {}
    for name, data in state.items():
        if name.endswith(".in_proj_qkvz.weight"):
            sizes = [dk, dk, per_key, per_key]
            q, k, v, z = data.reshape(key_heads, sum(sizes), -1).split(sizes, dim=1)
            prefix = name.removesuffix("in_proj_qkvz.weight")
            out[f"{prefix}in_proj_qkv.weight"] = torch.cat([t.flatten(0, 1) for t in (q, k, v)])
            out[f"{prefix}in_proj_z.weight"] = z.flatten(0, 1)
        elif name.endswith(".A_log"):
            out[name] = -torch.exp(data)
        elif name.endswith(".dt_bias"):
            out[name.removesuffix("dt_bias") + "dt_proj.bias"] = data
        elif ".linear_attn.conv1d." in name:
            out[name] = data.squeeze(1)
        else:
            out[name] = data
    return out


def _qwen35_tensor(hf_name: str, data: torch.Tensor, config) -> tuple[str, torch.Tensor]:
    """What llama.cpp's Qwen3.5 converter does to a delta net's tensor: value heads from
    transformers' grouped order (each key head's together) to a tiled one where a key head
    serves several, A_log as -exp(A_log), dt_bias as dt_proj.bias, the conv weight squeezed."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    dv, per_key = config.linear_value_head_dim, value_heads // key_heads
    keys = 2 * key_heads * config.linear_key_head_dim

    def tiled(t: torch.Tensor, dim: int, head: int, start: int = 0) -> torch.Tensor:
        if per_key == 1:
            return t
        part = t.narrow(dim, start, t.shape[dim] - start)
        shape = list(part.shape)
        grouped = part.reshape(*shape[:dim], key_heads, per_key, head, *shape[dim + 1 :])
        part = grouped.transpose(dim, dim + 1).reshape(shape)
        return torch.cat([t.narrow(dim, 0, start), part], dim=dim)

    if ".linear_attn." not in hf_name:
        return hf_name, data
    if ".in_proj_qkv." in hf_name:
        data = tiled(data, 0, dv, keys)
    elif ".in_proj_z." in hf_name:
        data = tiled(data, 0, dv)
    elif ".in_proj_a." in hf_name or ".in_proj_b." in hf_name:
        data = tiled(data, 0, 1)
    elif ".conv1d." in hf_name:
        data = tiled(data.squeeze(1), 0, dv, keys)
    elif ".out_proj." in hf_name:
        data = tiled(data, 1, dv)
    elif hf_name.endswith(".A_log"):
        data = -torch.exp(tiled(data, 0, 1))
    elif hf_name.endswith(".dt_bias"):
        hf_name, data = hf_name.removesuffix("dt_bias") + "dt_proj.bias", tiled(data, 0, 1)
    return hf_name, data


def _gemma2_hparams(writer: gguf.GGUFWriter, config) -> None:
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _gemma3_hparams(writer: gguf.GGUFWriter, config) -> None:
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _gemma4_heads(config) -> list[tuple[int, int]]:
    """Each layer's (head_dim, num_key_value_heads)."""
    layers = config.per_layer_config
    return [(layers[i].head_dim, layers[i].num_key_value_heads) for i in range(len(layers))]


def _gemma4_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Gemma4Model: each kind's head size (key_length: the full layers',
    key_length_swa: the sliding ones'), KV heads per layer where the kinds' differ, the MLP's
    width per layer with use_double_wide_mlp, the shared layers, the per-layer inputs' width,
    which layers slide, the soft-cap, the sliding layers' RoPE base, each kind's rotary dims
    (the full layers' whole heads: rope_freqs says which pairs turn), the experts'."""
    types, heads = config.layer_types, _gemma4_heads(config)
    full, local = heads[types.index("full_attention")], heads[types.index("sliding_attention")]
    writer.add_key_length(full[0])
    writer.add_value_length(full[0])
    writer.add_key_length_swa(local[0])
    writer.add_value_length_swa(local[0])
    kv = [n for _, n in heads]
    writer.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    own = config.num_hidden_layers - config.num_kv_shared_layers
    width = config.intermediate_size
    if config.use_double_wide_mlp:
        writer.add_feed_forward_length([width * (1 + (i >= own)) for i in range(len(types))])
    else:
        writer.add_feed_forward_length(width)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full[0])
    writer.add_rope_dimension_count_swa(local[0])
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def gemma4_rope_freqs(config) -> np.ndarray:
    """llama.cpp's Gemma4Model.generate_extra_tensors: the full layers' proportional RoPE as
    divisors of whole-head frequencies, 1 on the turned pairs, 1e30 on the others."""
    full = config.rope_parameters["full_attention"]
    head_dim = _gemma4_heads(config)[config.layer_types.index("full_attention")][0]
    turned = int(head_dim * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (head_dim // 2 - turned), dtype=np.float32)


# Gemma 4's checkpoint names llama.cpp's Gemma4Model writes under its own names (experts'
# 3-D tensors as they are, the scales as tensors of the router and the experts).
_GEMMA4_STATED = {
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
}


def _gemma4_tensors(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The tensors of _GEMMA4_STATED by GGUF name, apart from the others."""
    rest, stated = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.([\w.]+)", name)
        if match is None or match[2] not in _GEMMA4_STATED:
            rest[name] = tensor
        else:
            stated[f"blk.{match[1]}.{_GEMMA4_STATED[match[2]]}"] = tensor
    return rest, stated


def _check_gemma4(config) -> None:
    """What llama.cpp's gemma4 fixes or its converter writes one way: one head shape per kind
    of layer, proportional RoPE on the full layers and plain RoPE on whole sliding heads, a
    final soft-cap (30 where a file states none), the shared layers reading the last two
    layers that compute keys (n - 2 the sliding ones, n - 1 the full ones)."""
    types, heads = config.layer_types, _gemma4_heads(config)
    for kind in set(types):
        if len({h for h, t in zip(heads, types, strict=True) if t == kind}) > 1:
            raise ValueError(f"llama.cpp's gemma4 GGUF has one head shape for its {kind} layers")
    rope = config.rope_parameters
    if rope["full_attention"]["rope_type"] != "proportional":
        raise ValueError("llama.cpp's Gemma4Model converts proportional full-layer RoPE only")
    if rope["sliding_attention"].get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("conveyor reads a gemma4 GGUF's sliding layers turning whole heads")
    if not config.final_logit_softcapping:
        raise ValueError("llama.cpp's gemma4 GGUF cannot state final_logit_softcapping=None")
    own = config.num_hidden_layers - config.num_kv_shared_layers
    modes = config.kv_sharing_modes
    for i in range(own, config.num_hidden_layers):
        theirs = own - (2 if types[i] == "sliding_attention" else 1)
        if modes[i] == "reuse" and (types[theirs] != types[i] or modes[theirs] != "store"):
            raise ValueError(f"llama.cpp's gemma4 reads another cache for layer {i}")


def _gemma3n_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Gemma3NModel: Gemma 3's keys, then AltUp's streams, the per-layer inputs'
    width, the shared layers, each layer's sparsity as the normal quantile (float32 icdf) its
    gate's cut-off multiplies, and which layers slide."""
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_altup_active_idx(config.altup_active_idx)
    writer.add_altup_num_inputs(config.altup_num_inputs)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    normal = torch.distributions.normal.Normal(0, 1)
    writer.add_activation_sparsity_scale(
        [normal.icdf(torch.tensor(s, dtype=torch.float32)).item()
         for s in config.activation_sparsity_pattern]
    )  # fmt: skip
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])


def _gemma3n_tensors(state: dict[str, torch.Tensor], config) -> tuple[dict, dict]:
    """Gemma3NModel's own: the AltUp projections stacked (altup_proj, altup_unembd_proj), the
    embeddings padded with zero rows to vocab_size, correct_output_scale as `.weight`."""
    rest, stated = {}, {}
    for kind, name in (("altup_projections", "altup_proj"),
                       ("altup_unembed_projections", "altup_unembd_proj")):  # fmt: skip
        count = config.altup_num_inputs - 1
        parts = [state.pop(f"model.{kind}.{i}.weight") for i in range(count)]
        stated[f"{name}.weight"] = torch.stack(parts)
    for name, tensor in state.items():
        if name.endswith("embed_tokens_per_layer.weight") or name.endswith("embed_tokens.weight"):
            padding = config.vocab_size - tensor.shape[0]
            tensor = torch.cat([tensor, tensor.new_zeros(padding, tensor.shape[1])])
        layer = re.fullmatch(r"model\.layers\.(\d+)\.altup\.correct_output_scale", name)
        if layer:
            stated[f"blk.{layer[1]}.altup_correct_scale.weight"] = tensor
        else:
            rest[name] = tensor
    return rest, stated


def _phi3_hparams(writer: gguf.GGUFWriter, config) -> None:
    original = config.original_max_position_embeddings
    writer.add_rope_scaling_orig_ctx_len(original)
    if _rope(config).get("rope_type") == "longrope":  # llama.cpp's attention factor
        scale = config.max_position_embeddings / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(factor)
    partial = _rope(config).get("partial_rotary_factor", 1.0)  # llama.cpp's n_rot
    writer.add_rope_dimension_count(int(_head_dim(config) * partial))
    writer.add_sliding_window(config.sliding_window or 0)


def _granite_hparams(writer: gguf.GGUFWriter, config) -> None:
    # llama.cpp's names for Granite's multipliers
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)


def _granitehybrid_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's GraniteHybridModel: Granite's multipliers, the Mamba2 sizes under the ssm
    keys (time_step_rank: the heads), no RoPE (rope.scaling.finetuned: Bamba's alone), the
    shared MLP's width."""
    _granite_hparams(writer, config)
    heads, head_dim = config.mamba_n_heads, config.mamba_expand * config.hidden_size
    head_dim //= heads
    sizes = (config.mamba_d_conv, config.mamba_d_state, config.mamba_n_groups, heads, head_dim)
    _mamba2_hparams(writer, *sizes)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)


def _mamba2_hparams(writer, kernel: int, state: int, groups: int, heads: int, head_dim: int):
    """A Mamba2 model's sizes under llama.cpp's ssm keys (time_step_rank: the heads), no RoPE."""
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(heads * head_dim)
    writer.add_ssm_time_step_rank(heads)
    writer.add_rope_scaling_finetuned(False)


def _glm4moe_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Glm4MoeModel: the rotary part of each head, the experts' keys (sigmoid
    gating, scale, renormalisation, leading dense layers, shared experts by count)."""
    partial = _rope(config).get("partial_rotary_factor", 0.5)
    writer.add_rope_dimension_count(int(_head_dim(config) * partial))
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)


def _deepseek2_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's DeepseekV2Model: latent attention's sizes (the cache's key and value lengths,
    the heads' as key_length_mla / value_length_mla), the rope dims, yarn's mscale_all_dim as
    0.1 times it, the experts' keys; sigmoid gating and its groups for V3 (a V2 file states no
    gating: llama.cpp's softmax)."""
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_kv_lora_rank(rank)
    if config.gguf_legacy_mla:  # the heads' own lengths, no _mla keys
        writer.add_key_length(config.qk_nope_head_dim + rope)
        writer.add_value_length(config.v_head_dim)
    else:
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + rope)
        writer.add_value_length_mla(config.v_head_dim)
    writer.add_rope_dimension_count(rope)
    if (mscale_all_dim := _rope(config).get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if config.model_type == "deepseek_v3":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)


def _ernie4_5_moe_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's Ernie4_5MoeModel: where the mixtures start and their step, the shared
    experts' count, and a shared width it derives as intermediate_size / KV heads."""
    writer.add_interleave_moe_layer_step(config.moe_layer_interval)
    writer.add_leading_dense_block_count(config.moe_layer_start_index)
    writer.add_expert_shared_count(config.moe_num_shared_experts)
    width = config.intermediate_size // config.num_key_value_heads
    writer.add_expert_shared_feed_forward_length(width)


def _nemotron_h_hparams(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's NemotronHModel: the Mamba2 sizes (inner_size heads x head_dim), no RoPE;
    Nemotron 3's router (its groups; the groups chosen are not stated)."""
    sizes = (config.conv_kernel, config.ssm_state_size, config.n_groups)
    _mamba2_hparams(writer, *sizes, config.mamba_num_heads, config.mamba_head_dim)
    if "moe" in config.layer_types:
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_group_count(config.n_group)


def _nemotron_h_tensors(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """llama.cpp's NemotronHModel: Mamba2's tensors changed as Granite 4.0-H's are, the experts
    under the names it stacks."""
    out = {}
    for name, tensor in state.items():
        if match := re.fullmatch(r"backbone\.layers\.(\d+)\.mixer\.(experts\..*)", name):
            name = f"model.layers.{match[1]}.mlp.{match[2]}"
        else:
            name, tensor = _mamba2_tensor(name, tensor, ".mixer.", config.n_groups)
        out[name] = tensor
    return out


def _mamba2_tensor(name: str, tensor: torch.Tensor, module: str, groups: int):
    """A Mamba2 layer's tensor (under `module`) as llama.cpp's Mamba2 converter writes it:
    A_log as -exp(A_log), A and D as (heads, 1), the gated norm's weight as (groups, inner /
    groups), the convolution's weight squeezed, dt_bias named dt_proj.bias; others as they
    are."""
    if name.endswith(f"{module}A_log"):
        return name, (-torch.exp(tensor)).reshape(-1, 1)
    if name.endswith(f"{module}D"):
        return name, tensor.reshape(-1, 1)
    if name.endswith(f"{module}norm.weight"):
        return name, tensor.reshape(groups, -1)
    if name.endswith(f"{module}conv1d.weight"):
        return name, tensor.squeeze(1)
    if name.endswith(f"{module}dt_bias"):
        return name.replace(f"{module}dt_bias", f"{module}dt_proj.bias"), tensor
    return name, tensor


def _granitehybrid_tensors(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """What llama.cpp's Mamba2 converter changes: A_log to -exp(A_log), A and D to (heads, 1),
    the gated norm's weight to (groups, inner / groups), the convolution's weight squeezed,
    dt_bias named as dt_proj.bias; with experts, the shared_mlp as the shared expert's gate,
    up (its input_linear split) and down."""
    experts = bool(getattr(config, "num_local_experts", 0))
    out = {}
    for name, tensor in state.items():
        name, tensor = _mamba2_tensor(name, tensor, ".mamba.", config.mamba_n_groups)
        if experts and name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = tensor.chunk(2, dim=0)
            prefix = name.removesuffix("shared_mlp.input_linear.weight")
            out[f"{prefix}mlp.shared_expert.gate_proj.weight"] = gate
            name, tensor = f"{prefix}mlp.shared_expert.up_proj.weight", up
        elif experts and name.endswith(".shared_mlp.output_linear.weight"):
            name = name.replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj.")
        out[name] = tensor
    return out


def _glm4_hparams(writer: gguf.GGUFWriter, config) -> None:
    partial = _rope(config).get("partial_rotary_factor", 0.5)  # llama.cpp's n_rot
    writer.add_rope_dimension_count(int(_head_dim(config) * partial))


_FAMILY_HPARAMS = {
    "qwen35": _qwen35_hparams,
    "qwen35moe": _qwen35_hparams,
    "qwen3next": _qwen35_hparams,
    "lfm2moe": _lfm2moe_hparams,
    "exaone4": _exaone4_hparams,
    "olmo2": _olmo3_hparams,
    "mistral3": _mistral3_hparams,
    "glm4": _glm4_hparams,
    "gemma2": _gemma2_hparams,
    "gemma3": _gemma3_hparams,
    "gemma4": _gemma4_hparams,
    "gemma3n": _gemma3n_hparams,
    "phi3": _phi3_hparams,
    "granite": _granite_hparams,
    "granitemoe": _granite_hparams,
    "granitehybrid": _granitehybrid_hparams,
    "ernie4_5-moe": _ernie4_5_moe_hparams,
    "glm4moe": _glm4moe_hparams,
    "deepseek2": _deepseek2_hparams,
    "nemotron_h": _nemotron_h_hparams,
    "nemotron_h_moe": _nemotron_h_hparams,
}


def check_expressible(config, arch: str) -> None:
    """Refuses a checkpoint whose settings llama.cpp fixes in code to other values (see the
    module docstring): its GGUF would be another model."""
    layers = range(config.num_hidden_layers)
    expected: dict[str, object] = {}
    if arch == "gemma":  # GemmaModel drops lm_head.weight and writes no RoPE base
        expected["tie_word_embeddings"] = True
        expected["rope_theta"] = 10000.0
    elif arch in NORM_PLUS_ONE:
        big = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
        scalar = config.hidden_size // config.num_attention_heads if big else _head_dim(config)
        expected["query_pre_attn_scalar"] = scalar
    if arch == "gemma2":
        expected["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in layers
        ]
        expected["rope_theta"] = 10000.0
        expected["tie_word_embeddings"] = True  # Gemma2Model drops lm_head.weight
    if arch == "gemma3":
        expected["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in layers
        ]
        expected["local rope_theta"] = 10000.0
    if arch == "gemma4":
        _check_gemma4(config)
    if arch == "gemma3n":  # Gemma3NModel asserts four streams; llama.cpp fixes these
        expected["altup_num_inputs"] = 4
        expected["local rope_theta"] = 10000.0
        expected["altup_correct_scale"] = True
    if arch == "smollm3":
        expected["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in layers]
    if arch == "phi3" and _rope(config).get("rope_type") != "longrope":
        expected["rope_scaling"] = None  # llama.cpp's phi3 writes longrope or no scaling
    if arch == "gpt-oss":  # llama.cpp fixes these
        expected["swiglu_limit"] = 7.0
        expected["swiglu_alpha"] = 1.702
        expected["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in layers
        ]
    if arch in DELTA_NETS:  # llama.cpp's: attention every fourth layer
        expected["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in layers
        ]
    if arch == "granitehybrid":  # no RoPE (llama.cpp's use_rope), dt unclamped, bare projections
        expected["position_embedding_type"] = "nope"
        expected["time_step_limit"] = (0.0, float("inf"))
        expected["mamba_proj_bias"] = False
    if arch == "glm4moe":  # llama.cpp's files state no groups: one, all chosen
        expected["n_group"] = 1
        expected["topk_group"] = 1
    if arch == "deepseek2":  # adjacent rope pairs; V2's softmax router has no groups there
        expected["rope_interleave"] = True
        if "mscale_all_dim" in _rope(config):  # one yarn log multiplier for both mscales
            expected["mscale"] = _rope(config)["mscale_all_dim"]
        if config.model_type == "deepseek_v2":
            expected["topk_method"] = "greedy"
    if arch == "ernie4_5-moe":  # mixtures up to the last layer; llama.cpp clamps the weights'
        expected["moe_layer_end_index"] = config.num_hidden_layers - 1  # sum at 6.1e-5, not 1e-12
    if arch in NEMOTRON_H:  # llama.cpp clamps no time step; it states no groups chosen
        expected["time_step_min"] = 0.001  # (transformers' default, which conveyor then takes)
        if arch == "nemotron_h_moe":
            expected["topk_group"] = config.n_group
    if arch == "mistral3":  # one yarn log multiplier for both of transformers' mscales
        expected["mscale"] = _rope(config)["mscale_all_dim"]
    if arch == "olmoe":  # llama.cpp's OlmoeModel writes 1e-5, its olmoe never renormalises
        expected["rms_norm_eps"] = 1e-5
        expected["norm_topk_prob"] = False
        expected["tie_word_embeddings"] = False  # its olmoe needs an output tensor
    if arch == "lfm2moe":  # llama.cpp renormalises the chosen weights and scales them by 1
        expected["tie_word_embeddings"] = True  # its lfm2moe has no output tensor
        expected["norm_topk_prob"] = True
        expected["routed_scaling_factor"] = 1.0
    if arch in ("qwen2moe", "qwen3moe", "qwen3next"):  # every layer a mixture; qwen2moe alone
        expected["mlp_only_layers"] = []  # does not renormalise
        expected["decoder_sparse_step"] = 1
        expected["norm_topk_prob"] = arch != "qwen2moe"
    for name, value in expected.items():
        if _setting(config, name) != value:
            raise ValueError(
                f"llama.cpp's {arch} GGUF cannot state {name}={_setting(config, name)}"
            )


def _setting(config, name: str):
    params = getattr(config, "rope_parameters", None) or {}
    if name == "rope_theta":
        return _rope(config)["rope_theta"]
    if name == "mscale":
        return _rope(config).get("mscale")
    if name == "rope_interleave" and config.model_type == "deepseek_v2":
        return True  # V2 always turns adjacent pairs
    if name == "local rope_theta":
        return params["sliding_attention"]["rope_theta"]
    if name == "rope_scaling":
        return None if _rope(config).get("rope_type", "default") == "default" else params
    return getattr(config, name)


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id >= len(tokenizer):  # llama.cpp pads the vocabulary up to the embedding rows
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(tokenizer.convert_ids_to_tokens(token_id))
        if token_id in added:
            special = added[token_id].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex, which ByteLevel uses by default
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if (token_id := getattr(tokenizer, f"{name}_token_id")) is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _state_dict(hf_dir: Path, config) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(shard))
    if config.tie_word_embeddings:  # llama.cpp writes output.weight only for untied heads
        state.pop("lm_head.weight", None)
    return state


def _add_tensors(
    writer: gguf.GGUFWriter,
    state: dict[str, torch.Tensor],
    config,
    arch: str,
    qtype: gguf.GGMLQuantizationType,
    expert_qtype: gguf.GGMLQuantizationType,
    num_layers: int | None = None,
) -> None:
    name_map = gguf.get_tensor_name_map(_model_arch(arch), num_layers or config.num_hidden_layers)
    if arch == "gpt-oss":
        state, stated = _gpt_oss_experts(state)
        for name, tensor in stated.items():
            kind = expert_qtype if name.endswith("_exps.weight") else qtype
            _add_tensor(writer, name, tensor.to(torch.float32).numpy(), kind)
    if arch == "qwen3next":
        state = _qwen3next_tensors(state, config)
    if arch == "granitehybrid":
        state = _granitehybrid_tensors(state, config)
    if arch in NEMOTRON_H:
        state = _nemotron_h_tensors(state, config)
    if arch == "deepseek2" and not config.gguf_legacy_mla:
        state = _deepseek2_tensors(state, config)
    if arch == "gemma4":
        state, stated = _gemma4_tensors(state)
        for name, tensor in stated.items():
            kind = expert_qtype if tensor.dim() == 3 else qtype
            _add_tensor(writer, name, tensor.to(torch.float32).numpy(), kind)
        writer.add_tensor("rope_freqs.weight", gemma4_rope_freqs(config))
    if arch == "gemma3n":
        state, stated = _gemma3n_tensors(state, config)
        for name, tensor in stated.items():
            _add_tensor(writer, name, tensor.to(torch.float32).numpy(), qtype)
    for hf_name, tensor in _merged_experts(state).items():
        data = tensor
        if _plus_one(arch, hf_name):
            data = data + 1  # in the checkpoint's dtype, then cast, as llama.cpp does
        if arch in QWEN35:
            hf_name, data = _qwen35_tensor(hf_name, data, config)
        # a router's choosing bias: exp_probs_b.bias (llama.cpp's converters name it so)
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        data = data.to(torch.float32)
        if arch in PERMUTED_QK and ".q_proj." in hf_name:
            data = permute(data, config.num_attention_heads, config.num_attention_heads)
        elif arch in PERMUTED_QK and ".k_proj." in hf_name:
            data = permute(data, config.num_attention_heads, config.num_key_value_heads)
        if arch == "lfm2moe":  # its experts' w1 / w3 / w2, merged as llama.cpp's converter does
            for leaf, proj in LFM2_EXPERTS.items():
                hf_name = hf_name.replace(f".experts.{leaf}.", f".experts.{proj}.")
        if arch in LFM2 and hf_name.endswith(".conv.conv.weight"):
            data = data.squeeze(1)  # llama.cpp's shortconv.conv: (channels, kernel)
        # Phi-3's qkv_proj and gate_up_proj map as they are: attn_qkv, and ffn_up
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if hf_name.endswith(".sinks"):  # llama.cpp's GPT-OSS converter names them so
            name = f"{name}.weight"
        if hf_name.endswith(".expert_bias"):  # LFM2-MoE's converter: exp_probs_b.bias
            name = f"{name}.bias"
        if name is None:
            raise ValueError(f"llama.cpp has no {arch} tensor name for {hf_name}")
        kind = expert_qtype if data.dim() == 3 else qtype
        _add_tensor(writer, name, data.numpy(), F32 if _kept_f32(name) else kind)
    if _rope(config).get("rope_type") == "llama3":  # llama.cpp's LlamaModel, Exaone4Model, ...
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    if arch == "phi3" and _rope(config).get("rope_type") == "longrope":  # Phi-3.5's factors
        for which in ("long", "short"):
            factors = np.array(_rope(config)[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)


F32 = gguf.GGMLQuantizationType.F32


def _kept_f32(name: str) -> bool:
    """llama.cpp's converters keep the routers, the SSM convolutions, norms and every tensor
    not named `.weight` (Mamba2's A and D, 2-D there) in F32, whatever the file type."""
    return (
        name.endswith(F32_TENSORS)
        or name.endswith(("_norm.weight", ".ssm_conv1d.weight"))
        or not name.endswith((".weight", ".bias"))
    )


def _deepseek2_tensors(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """llama.cpp's DeepseekV2Model: each kv_b_proj split per head into k_b_proj (its key rows,
    transposed: (heads, kv_lora_rank, qk_nope)) and v_b_proj ((heads, v, kv_lora_rank))."""
    heads, nope = config.num_attention_heads, config.qk_nope_head_dim
    out = {}
    for name, tensor in state.items():
        if not name.endswith(".kv_b_proj.weight"):
            out[name] = tensor
            continue
        per_head = tensor.view(heads, nope + config.v_head_dim, tensor.shape[-1])
        keys, values = per_head.split([nope, config.v_head_dim], dim=1)
        out[name.replace("kv_b_proj", "k_b_proj")] = keys.transpose(1, 2).contiguous()
        out[name.replace("kv_b_proj", "v_b_proj")] = values.contiguous()
    return out


def _gpt_oss_experts(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """GPT-OSS's 3-D experts (x @ W form, gate and up interleaved by column) as llama.cpp's
    converter writes them: ffn_{gate,up,down}_exps (experts, rows, columns) and their biases;
    returns the other tensors and these by GGUF name."""
    rest, stated = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)", name)
        if match is None:
            rest[name] = tensor
            continue
        blk, leaf = f"blk.{match[1]}", match[2]
        if leaf == "gate_up_proj":
            stated[f"{blk}.ffn_gate_exps.weight"] = tensor[..., ::2].transpose(1, 2).contiguous()
            stated[f"{blk}.ffn_up_exps.weight"] = tensor[..., 1::2].transpose(1, 2).contiguous()
        elif leaf == "gate_up_proj_bias":
            stated[f"{blk}.ffn_gate_exps.bias"] = tensor[:, ::2].contiguous()
            stated[f"{blk}.ffn_up_exps.bias"] = tensor[:, 1::2].contiguous()
        elif leaf == "down_proj":
            stated[f"{blk}.ffn_down_exps.weight"] = tensor.transpose(1, 2).contiguous()
        else:
            stated[f"{blk}.ffn_down_exps.bias"] = tensor
    return rest, stated


def _merged_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors stacked into one (experts, rows, columns) tensor per
    layer and projection, named without the expert's index, as llama.cpp's converters do; a
    stacked gate_up_proj (transformers 5's, nn.Linear's form) split into gate and up."""
    merged: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".feed_forward.experts.gate_up_proj")):
            gate, up = tensor.chunk(2, dim=1)
            merged[f"{name.removesuffix('gate_up_proj')}gate_proj.weight"] = gate
            merged[f"{name.removesuffix('gate_up_proj')}up_proj.weight"] = up
            continue
        if name.endswith(".shared_mlp.input_linear.weight"):  # Granite 4.0's MLP: gate, then up
            gate, up = tensor.chunk(2, dim=0)
            prefix = name.removesuffix("shared_mlp.input_linear.weight")
            merged[f"{prefix}mlp.gate_proj.weight"] = gate
            merged[f"{prefix}mlp.up_proj.weight"] = up
            continue
        if name.endswith(".shared_mlp.output_linear.weight"):
            merged[name.replace(".shared_mlp.output_linear.", ".mlp.down_proj.")] = tensor
            continue
        if name.endswith(".block_sparse_moe.input_linear.weight"):  # Granite MoE's gate and up
            gate, up = tensor.chunk(2, dim=1)
            prefix = name.removesuffix("block_sparse_moe.input_linear.weight")
            merged[f"{prefix}mlp.experts.gate_proj.weight"] = gate
            merged[f"{prefix}mlp.experts.up_proj.weight"] = up
            continue
        if name.endswith((".mlp.experts.down_proj", ".feed_forward.experts.down_proj")):
            merged[f"{name}.weight"] = tensor
            continue
        match = EXPERT.fullmatch(name)
        if match is None:
            merged[name] = tensor
        else:
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
    for name, by_index in experts.items():
        merged[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return merged


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    # llama.cpp keeps 1-D tensors (norms, biases) in F32, and rows that do not fill whole blocks.
    if data.ndim < 2 or data.shape[-1] % block_size != 0:
        qtype = gguf.GGMLQuantizationType.F32
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves become interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: per-frequency llama3 rope divisors."""
    rope = _rope(config)
    dim = _head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
