"""Writing a tiny HF checkpoint as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

Only what transformers needs to rebuild config, tokenizer and weights from the file, plus the
llama.cpp details a loader must undo (Q/K row permutation, llama3 `rope_freqs`, quantization).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

# HF model_type -> llama.cpp architecture; llama.cpp converts Mistral with its llama converter.
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
QTYPES = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def write_gguf(hf_dir: Path, out_path: Path, qtype: str = "F32") -> Path:
    """Converts the checkpoint in `hf_dir` to a GGUF at `out_path`, 2-D weights as `qtype`."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    config = AutoConfig.from_pretrained(hf_dir)
    raw_config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = GGUF_ARCHS[config.model_type]
    writer = gguf.GGUFWriter(out_path, arch)
    # Not "mistral": transformers 5.23 maps a llama file named exactly so to Mistral, then fails.
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, config, raw_config, arch)
    _add_tokenizer(writer, hf_dir, config.vocab_size)
    _add_tensors(writer, _state_dict(hf_dir, config), config, arch, QTYPES[qtype])
    _finish(writer)
    return out_path


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
    # transformers 5 keeps rope_theta and scaling together in rope_parameters.
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hparams(writer: gguf.GGUFWriter, config, raw_config: dict, arch: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if raw_config.get("head_dim") is not None:  # llama.cpp writes these when head_dim is stated
        writer.add_key_length(raw_config["head_dim"])
        writer.add_value_length(raw_config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(_head_dim(config))
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("linear", "yarn"):  # llama3 is written as the rope_freqs tensor instead
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope_type == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


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
) -> None:
    name_map = gguf.get_tensor_name_map(_model_arch(arch), config.num_hidden_layers)
    for hf_name, tensor in state.items():
        data = tensor.to(torch.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            data = permute(data, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = permute(data, config.num_attention_heads, config.num_key_value_heads)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        _add_tensor(writer, name, data.numpy(), qtype)
    if arch == "llama" and _rope(config).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))


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
