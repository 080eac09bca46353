"""Weights of a GGUF file (llama.cpp's format), under Hugging Face parameter names.

Config and tokenizer come from transformers (`AutoConfig.from_pretrained(dirname,
gguf_file=basename)`, likewise `AutoTokenizer`), or for the families transformers does not
convert (or converts only in part) from model/gguf_config.py. Each tensor is dequantized with
the `gguf` package, renamed, reshaped to its HF shape, and what llama.cpp's converter did to it
is undone: the row permutation of Q and K (its llama converter, which Granite's and SmolLM3's
extend), the 1 it adds to Gemma's norm weights, the fused tensors of Phi-3 (`attn_qkv`, and
`ffn_up` holding gate and up), which are split into the HF tensors they were made of. So every
tensor equals the one transformers loads from the same file (or from the checkpoint it was
converted from).

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every vocabulary and
merge string into numpy views (about 5 s for a 49k-token vocabulary); we skip string arrays.

File layout (little-endian; GGUF v2/v3):
    magic "GGUF" | version u32 | num_tensors u64 | num_kvs u64
    num_kvs x (key string | value_type u32 | value)
    num_tensors x (name string | n_dims u32 | dims u64 x n_dims, innermost first | type u32 |
                   offset u64 from the data section)
    padding to general.alignment (default 32) | data section
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import gguf
import numpy as np

from conveyor.model.families import projection_of
from conveyor.model.gguf_config import (
    FAMILIES,
    LLAMA3_TENSOR,
    LONGROPE_TENSORS,
    hf_config_dict,
    is_mixtral,
    nemotron_h_block_types,
    rope_parameters,
    set_llama3,
)

if TYPE_CHECKING:  # torch is imported where tensors are made: the server's front end reads
    import torch  # headers (is_quantized_gguf) without it (engine/core_proc.py)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", *FAMILIES)
# Architectures whose llama.cpp converter derives from its llama one, which permutes Q/K rows.
_PERMUTED_QK = (
    "llama",
    "arcee",
    "granite",
    "granitemoe",
    "granitehybrid",
    "nemotron_h",
    "nemotron_h_moe",
    "smollm3",
    "mistral3",
)
# Nemotron-H's files keep its blocks as llama.cpp's layers (blk.B): paired into decoder layers
# here as model/families.nemotron_h_layers pairs them (_nemotron_h_targets).
_NEMOTRON_H = ("nemotron_h", "nemotron_h_moe")
# Gemma's norms scale by 1 + w; llama.cpp stores 1 + w.
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")

# GGUF name -> HF name for tensors outside the decoder layers.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    # Present only when the output projection is not tied to the embeddings.
    "output.weight": "lm_head.weight",
}

# GGUF name inside `blk.{i}.` -> HF module inside `model.layers.{i}.`; `.weight`/`.bias` is kept.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3, OLMo 2
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # Gemma, OLMo 2: on attention's output
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixtures of experts (model/moe.py): the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_sinks": "self_attn.sinks",  # GPT-OSS: a parameter of its own (no .weight)
}
# The experts' 3-D tensors (experts, rows, columns): expert e's HF tensor is its rows.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Qwen3.5's gated delta nets (model/recurrent.py; ssm_a and ssm_dt: see _targets).
_QWEN35_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# LFM2's (and LFM2-MoE's) norms' names, and its short convolutions.
_LFM2_NAMES = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.out_proj": "conv.out_proj",
}
# Granite 4.0-H's Mamba2 layers (model/recurrent.py Mamba2Mixer; ssm_a, ssm_d and ssm_dt: see
# _targets).
_MAMBA2_NAMES = {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
# Mamba2's parameters that are no module's weight: ssm_a holds -exp(A_log) as (heads, 1), ssm_d
# the D (heads, 1), ssm_dt the dt_bias.
_MAMBA2_PARAMETERS = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_d|ssm_dt\.bias)")
_MAMBA2_PARAMETER_NAMES = {"ssm_a": "A_log", "ssm_d": "D", "ssm_dt.bias": "dt_bias"}
# Where an architecture means another module by the same GGUF name: Gemma's ffn_norm is the norm
# before the MLP (Llama's ffn_norm is the same norm, which Llama names post_attention_layernorm).
_ARCH_LAYER_NAMES = {
    "lfm2": _LFM2_NAMES,
    "lfm2moe": _LFM2_NAMES,  # and its mixtures' (the router ffn_gate_inp, exp_probs_b: _targets)
    "qwen35": _QWEN35_NAMES,
    "qwen35moe": _QWEN35_NAMES,
    "qwen3next": {**_QWEN35_NAMES, "ssm_ba": "linear_attn.in_proj_ba"},  # split by model/loader
    "granitehybrid": _MAMBA2_NAMES,
    "arcee": {"ffn_up": "mlp.gate_proj"},  # its ungated MLP's up: a one-part gate_up_proj
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    # Gemma 4 (model/gemma4.py): its router and experts beside the MLP under the layer's `moe`
    # (and _GEMMA4_PARAMETERS), its per-layer input's gate, projection and norm
    "gemma4": {
        "ffn_norm": "pre_feedforward_layernorm",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
        "ffn_gate_inp": "moe.gate",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
    },
    # Gemma 3n (model/gemma3n.py): AltUp's coefficients, router and its norm, Laurel's low-rank
    # residual, the per-layer input's gate, projection and norm (correct_output_scale:
    # _GEMMA3N_SCALE)
    "gemma3n": {
        "ffn_norm": "pre_feedforward_layernorm",
        "altup_correct_coef": "altup.correction_coefs",
        "altup_predict_coef": "altup.prediction_coefs",
        "altup_router": "altup.modality_router",
        "altup_router_norm": "altup.router_norm",
        "laurel_l": "laurel.linear_left",
        "laurel_r": "laurel.linear_right",
        "laurel_post_norm": "laurel.post_laurel_norm",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
    },
    "glm4": {
        "post_attention_norm": "post_self_attn_layernorm",
        "post_ffw_norm": "post_mlp_layernorm",
    },
    # DeepSeek-V2 / V3's latent attention (model/mla.py); attn_k_b and attn_v_b (kv_b_proj
    # split per head, k_b transposed, as llama.cpp's converter writes it since 2025) are joined
    # back by model/loader.py
    "deepseek2": {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
    },
}
_QWEN35 = ("qwen35", "qwen35moe")  # Qwen3.5 and Qwen3.5-MoE
# Gated delta nets under llama.cpp's ssm names: Qwen3.5's, and Qwen3-Next's, whose converter keeps
# transformers' grouped value heads (no tiling) and its in_proj_ba as it is (ssm_ba).
_DELTA_NETS = (*_QWEN35, "qwen3next")
# Qwen3.5's parameters that are no module's weight: ssm_a holds -exp(A_log), ssm_dt the dt_bias.
_QWEN35_PARAMETERS = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)")
# Qwen3.5's tensors whose value heads llama.cpp's converter reorders where a key head serves
# several (grouped by key head in transformers, tiled in the file), with the dim they run along
# and the size of one head there; and the query rows its attention splits into query and gate.
_QWEN35_TILED = {
    "attn_qkv": (0, "value"),  # its value rows only
    "attn_gate": (0, "value"),
    "ssm_alpha": (0, 1),
    "ssm_beta": (0, 1),
    "ssm_a": (0, 1),
    "ssm_dt": (0, 1),
    "ssm_conv1d": (0, "value"),  # its value channels only
    "ssm_out": (1, "value"),
}
# Global tensors an architecture names otherwise: LFM2's final norm is its token_embd_norm.
_LFM2_GLOBAL_NAMES = {"token_embd_norm.weight": "model.norm.weight"}
_PER_LAYER_GLOBAL_NAMES = {  # Gemma 3n's and 4's per-layer inputs' embedding, projection, norm
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_ARCH_GLOBAL_NAMES = {
    "lfm2": _LFM2_GLOBAL_NAMES,
    "lfm2moe": _LFM2_GLOBAL_NAMES,
    "gemma4": _PER_LAYER_GLOBAL_NAMES,
    "gemma3n": _PER_LAYER_GLOBAL_NAMES,
}
# Gemma 3n's AltUp projections, one per stream but the first, stacked by llama.cpp's converter
# into one 3-D tensor (streams - 1, hidden, hidden): stream i + 1's matrix is its i-th.
_GEMMA3N_STACKED = {
    "altup_proj.weight": "model.altup_projections",
    "altup_unembd_proj.weight": "model.altup_unembed_projections",
}
# Gemma 3n's correct_output_scale, a parameter no module's weight (written with `.weight`).
_GEMMA3N_SCALE = re.compile(r"blk\.(\d+)\.altup_correct_scale\.weight")
# Gemma 4's parameters that are no module's weight: the layer's output scalar, the router's
# scale of its input and each expert's scale of its output (llama.cpp's ffn_down_exps.scale).
_GEMMA4_PARAMETERS = re.compile(
    r"blk\.(\d+)\.(layer_output_scale\.weight|ffn_gate_inp\.scale|ffn_down_exps\.scale)"
)
_GEMMA4_PARAMETER_NAMES = {
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.scale": "moe.router_scale",
    "ffn_down_exps.scale": "moe.per_expert_scale",
}
# Gemma 4's keys and their norm, which the layers that read an earlier layer's cache do not
# compute (a converted checkpoint may hold them; transformers does not read them either).
_GEMMA4_KEY_VALUE = ("attn_k", "attn_v", "attn_k_norm")
_KV_SHARING = ("gemma4", "gemma3n")  # the architectures whose last layers read earlier caches
# GGUF tensors that only exist fused (Phi-3's Q, K and V); Phi-3's ffn_up is another one, gate
# and up stacked, under the name other architectures give up alone (see _fused_parts).
_FUSED = ("attn_qkv",)

# Tensors llama.cpp writes that HF models keep no parameter for. `rope_freqs` holds the llama3
# rope-scaling divisors, which the config states as llama3 parameters (gguf_config.llama3_rope),
# `rope_factors_long / _short` Phi-3's longrope factors, which its config holds (gguf_config);
# `attn_rot_embd` is the rotary inv_freq buffer that old converters stored per layer.
_SKIPPED = re.compile(
    r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?"
)

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)")

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


class _TensorInfo(NamedTuple):
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: outermost dim first
    offset: int  # from the start of the data section


class _Header(NamedTuple):
    metadata: dict[str, Any]  # string arrays (vocabulary, merges) are left out
    tensors: list[_TensorInfo]
    data_offset: int


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture`; raises ValueError if conveyor cannot run it."""
    return _architecture(_header(path), path)


class RawTensor(NamedTuple):
    """A GGUF tensor left in its stored blocks, for the quantized path (conveyor.model.quant)."""

    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # HF shape
    data: np.ndarray  # uint8 (rows, bytes per row), a view of the mapped file
    row_order: torch.Tensor | None  # rows to take (undoes llama.cpp's Q/K permutation)


class _Layout(NamedTuple):
    """What naming and undoing a tensor needs to know of the file's model."""

    architecture: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int  # the model's: blocks past it are Qwen3.5's multi-token prediction layers
    # Qwen3.5's gated delta nets: key heads, value heads, key and value head dims
    linear: tuple[int, int, int, int] | None = None
    # Nemotron-H's blocks: block -> (its decoder layer, its role there: mamba, self_attn, mlp)
    blocks: dict[int, tuple[int, str]] | None = None
    # Gemma 4: the first layer that reads an earlier layer's cache (num_layers: none does)
    first_shared: int | None = None
    # Gemma 3n: its per-layer table's rows but the converter's zero padding (_per_layer_vocab)
    per_layer_vocab: int | None = None


class _Target(NamedTuple):
    """One HF tensor made of a GGUF tensor: all of it, or (fused tensors) a range of its rows."""

    hf_name: str
    rows: slice | int | None  # an int: one row (an expert's bias), as a 1-D tensor


def iter_gguf_weights(
    path: str | Path, dtype: torch.dtype, keep_raw: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor | RawTensor]]:
    """Yields `(hf_name, tensor)` for every weight in the file, dequantized and cast to `dtype`;
    tensors whose HF name `keep_raw` accepts come as RawTensor, still in their blocks."""
    buffer = _map(path)
    header = _header(path)
    layout = _layout(header, path)
    for info in header.tensors:
        if _skipped(info, layout):
            continue
        targets = _targets(info, layout, path)
        info = _as_matrix(info)
        raw = float_weight = None
        for target in targets:
            if keep_raw is not None and keep_raw(target.hf_name) and not _changed(info, layout):
                raw = raw or _raw(buffer, header.data_offset, info, _permuted_heads(info, layout))
                yield target.hf_name, _raw_rows(raw, target.rows)
                continue
            if float_weight is None:
                float_weight = _float_weight(buffer, header.data_offset, info, layout)
            rows = float_weight if target.rows is None else float_weight[target.rows]
            yield target.hf_name, rows.to(dtype)


# Stored as floats: a GGUF of these is a float checkpoint.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def is_quantized_gguf(path: Path) -> bool:
    """Whether a .gguf file stores any projection weight in a quantized (non-float) type."""
    if path.suffix != ".gguf":
        return False
    types = gguf_tensor_types(path)
    return any(
        qtype not in GGUF_FLOAT_TYPES for name, qtype in types.items() if projection_of(name)
    )


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """HF name -> GGUF type name (e.g. "Q4_1") of every weight in the file."""
    header = _header(path)
    layout = _layout(header, path)
    return {
        target.hf_name: info.qtype.name
        for info in header.tensors
        if not _skipped(info, layout)
        for target in _targets(info, layout, path)
    }


def _skipped(info: _TensorInfo, layout: _Layout) -> bool:
    """Tensors no HF parameter holds (_SKIPPED), the blocks past the model's layers, and the
    keys of Gemma 3n's and 4's layers that read an earlier layer's cache."""
    if _SKIPPED.fullmatch(info.name):
        return True
    block = re.match(r"blk\.(\d+)\.([^.]+)", info.name)
    if block is None:
        return False
    shared = layout.architecture in _KV_SHARING and int(block[1]) >= layout.first_shared
    return int(block[1]) >= layout.num_layers or (shared and block[2] in _GEMMA4_KEY_VALUE)


def _changed(info: _TensorInfo, layout: _Layout) -> bool:
    """Whether the tensor must be read as floats to be undone (not kept in its blocks): Qwen3.5's
    value heads reordered across a row's blocks or in its rows, and its attention's query rows,
    which hold each head's gate rows too."""
    if layout.architecture not in _DELTA_NETS or not info.name.startswith("blk."):
        return False
    kind = info.name.split(".")[2]
    if layout.architecture == "qwen3next":  # its ssm_ba: each key head's b, then a rows
        return kind in ("attn_q", "ssm_ba")
    key_heads, value_heads = layout.linear[:2] if layout.linear else (1, 1)
    return kind == "attn_q" or (kind in _QWEN35_TILED and value_heads != key_heads)


def _float_weight(
    buffer: mmap.mmap, data_offset: int, info: _TensorInfo, layout: _Layout
) -> torch.Tensor:
    """The tensor in float32 with llama.cpp's changes to it undone: the Q/K permutation, and
    the 1 added to Gemma's norms, subtracted in float32, so that the model's float32 1 + w is
    the stored multiplier again (exactly, for the stored values in [0.5, 2])."""
    weight = _dequantize(buffer, data_offset, info)
    heads = _permuted_heads(info, layout)
    if heads is not None:
        weight = _unpermute_rows(weight, heads)
    if layout.architecture in _NORM_PLUS_ONE and info.name.endswith("norm.weight"):
        weight = weight - 1.0
    if layout.architecture in _DELTA_NETS:
        weight = _qwen35_float(weight, info, layout)
    if info.name.endswith(".shortconv.conv.weight"):  # (channels, kernel): nn.Conv1d's is 3-D
        weight = weight.unsqueeze(1)
    if layout.architecture in ("granitehybrid", *_NEMOTRON_H):
        weight = _mamba2_float(weight, info)
    return weight


def _mamba2_float(weight: torch.Tensor, info: _TensorInfo) -> torch.Tensor:
    """What llama.cpp's Mamba2 converter changed, undone: A_log stored as -exp(A_log), A and D
    as (heads, 1), the gated norm's weight as (groups, inner / groups), the convolution's
    weight squeezed to (channels, kernel)."""
    import torch

    kind = info.name.split(".")[2] if info.name.startswith("blk.") else ""
    if kind == "ssm_a":
        weight = torch.log(-weight)
    if kind in ("ssm_a", "ssm_d", "ssm_norm"):
        weight = weight.reshape(-1)
    if info.name.endswith(".ssm_conv1d.weight"):  # nn.Conv1d's (channels, 1, kernel)
        weight = weight.unsqueeze(1)
    return weight


def _qwen35_float(weight: torch.Tensor, info: _TensorInfo, layout: _Layout) -> torch.Tensor:
    """What llama.cpp's Qwen3.5 converter changed, undone: its (1 + w) norms (not the delta
    nets' ssm_norm) stored as 1 + w, A_log as -exp(A_log), the convolution's weight squeezed,
    and value heads tiled where a key head serves several."""
    import torch

    kind = info.name.split(".")[2] if info.name.startswith("blk.") else ""
    if info.name.endswith("norm.weight") and kind != "ssm_norm":
        weight = weight - 1.0
    if kind == "ssm_a":
        weight = torch.log(-weight)
    key_heads, value_heads, key_dim, value_dim = layout.linear
    tiled = layout.architecture in _QWEN35  # Qwen3-Next's converter keeps them grouped
    if tiled and kind in _QWEN35_TILED and value_heads != key_heads:
        dim, size = _QWEN35_TILED[kind]
        size = value_dim if size == "value" else size
        start = 2 * key_heads * key_dim if kind in ("attn_qkv", "ssm_conv1d") else 0
        part = weight.narrow(dim, start, weight.shape[dim] - start)
        grouped = _grouped_heads(part, dim, key_heads, value_heads // key_heads, size)
        weight = torch.cat([weight.narrow(dim, 0, start), grouped], dim=dim)
    if kind == "ssm_conv1d":  # (channels, kernel): nn.Conv1d's is 3-D
        weight = weight.unsqueeze(1)
    return weight


def _grouped_heads(
    weight: torch.Tensor, dim: int, key_heads: int, per_key: int, head: int
) -> torch.Tensor:
    """Value heads from llama.cpp's tiled order (each key head's first value head, then each
    one's second, ...) back to transformers' grouped order (a key head's value heads together),
    along `dim`, heads of `head` values."""
    shape = list(weight.shape)
    tiled = weight.reshape(*shape[:dim], per_key, key_heads, head, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _as_matrix(info: _TensorInfo) -> _TensorInfo:
    """An experts' 3-D tensor as the matrix of its experts' rows, one after another (each
    expert's rows are whole blocks: a view of the file, never a copy)."""
    if len(info.shape) != 3:
        return info
    experts, rows, columns = info.shape
    return info._replace(shape=(experts * rows, columns))


def _permuted_heads(info: _TensorInfo, layout: _Layout) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor; None: not permuted.

    llama.cpp permutes Q/K rows only in its llama converter and those built on it (mistral is
    stored as llama), and transformers undoes it only for files that say llama; we do the same.
    """
    if layout.architecture not in _PERMUTED_QK:
        return None
    if ".attn_q." in info.name:
        return layout.num_heads
    if ".attn_k." in info.name:
        return layout.num_kv_heads
    return None


def _raw(buffer: mmap.mmap, data_offset: int, info: _TensorInfo, heads: int | None) -> RawTensor:
    byte_shape = gguf.quants.quant_shape_to_byte_shape(info.shape, info.qtype)
    data = np.frombuffer(
        buffer, dtype=np.uint8, count=math.prod(byte_shape), offset=data_offset + info.offset
    ).reshape(-1, byte_shape[-1])
    order = None
    if heads is not None:  # whole rows move, so block-wise formats stay valid
        import torch

        order = _unpermute_rows(torch.arange(info.shape[0]), heads)
    return RawTensor(info.qtype, info.shape, data, order)


def _raw_rows(raw: RawTensor, rows: slice | None) -> RawTensor:
    """A range of a RawTensor's rows: blocks run along a row, so a row range is whole blocks."""
    if rows is None:
        return raw
    assert raw.row_order is None, "fused and expert tensors are not permuted"
    data = raw.data[rows]
    return RawTensor(raw.qtype, (data.shape[0], *raw.shape[1:]), data, None)


def _map(path: str | Path) -> mmap.mmap:
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    with open(path, "rb") as file:
        try:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise ValueError(f"{str(path)!r} is not a GGUF file: {error}") from error


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing past each."""

    def __init__(self, buffer: mmap.mmap, pos: int) -> None:
        self.buffer = buffer
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self.pos += length
        return self.buffer[self.pos - length : self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return self.string()
        if value_type == gguf.GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[gguf.GGUFValueType(value_type)])

    def array(self) -> list[Any] | None:
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type == gguf.GGUFValueType.STRING:
            for _ in range(count):  # skipped unread: vocabulary and merges are the tokenizer's
                self.pos += 8 + struct.unpack_from("<Q", self.buffer, self.pos)[0]
            return None
        if item_type == gguf.GGUFValueType.ARRAY:
            return [self.array() for _ in range(count)]
        fmt = "<" + _SCALAR_FORMATS[gguf.GGUFValueType(item_type)]
        items = np.frombuffer(self.buffer, dtype=np.dtype(fmt), count=count, offset=self.pos)
        self.pos += items.nbytes
        return items.tolist()


def _header(path: str | Path) -> _Header:
    """The file's header, read once per process while the file is unchanged: a start asks for
    it ~9 times (architecture, metadata, tensor types, weights), and each read walks the
    vocabulary's strings (~0.08 s for 49k tokens). Callers must not change it."""
    stat = Path(path).stat()
    return _cached_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int) -> _Header:
    with _map(path) as buffer:
        return _read_header(buffer, path)


def _read_header(buffer: mmap.mmap, path: str | Path) -> _Header:
    if buffer[:4] != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
    cursor = _Cursor(buffer, pos=4)
    try:
        version = cursor.scalar("I")
        if version not in (2, 3):  # v1 had 32-bit counts; a big-endian file reads as a huge number
            raise ValueError(f"GGUF version {version} of {str(path)!r} is not supported (2 or 3)")
        num_tensors, num_kvs = cursor.scalar("Q"), cursor.scalar("Q")
        metadata = {cursor.string(): cursor.value(cursor.scalar("I")) for _ in range(num_kvs)}
        tensors = [_read_tensor_info(cursor) for _ in range(num_tensors)]
    except (struct.error, KeyError) as error:  # KeyError: an unknown value type
        raise ValueError(f"GGUF header of {str(path)!r} is corrupt: {error!r}") from error
    alignment = metadata.get("general.alignment", 32)
    return _Header(metadata, tensors, data_offset=-(-cursor.pos // alignment) * alignment)


def _read_tensor_info(cursor: _Cursor) -> _TensorInfo:
    name = cursor.string()
    dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
    qtype = gguf.GGMLQuantizationType(cursor.scalar("I"))
    return _TensorInfo(name, qtype, shape=tuple(reversed(dims)), offset=cursor.scalar("Q"))


def _architecture(header: _Header, path: str | Path) -> str:
    architecture = header.metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} of {str(path)!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _layout(header: _Header, path: str | Path) -> _Layout:
    """Heads and head size; without head_count_kv there are as many KV heads as heads."""
    architecture = _architecture(header, path)
    metadata = header.metadata
    num_heads = metadata.get(f"{architecture}.attention.head_count")
    if not isinstance(num_heads, int):  # per-layer lists belong to architectures we do not run
        raise ValueError(f"GGUF {architecture}.attention.head_count is {num_heads!r}, not an int")
    num_kv_heads = metadata.get(f"{architecture}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # LFM2's, per layer (0: a short convolution)
        num_kv_heads = max(num_kv_heads)
    head_dim = metadata.get(f"{architecture}.attention.key_length") or (
        metadata[f"{architecture}.embedding_length"] // num_heads
    )
    num_layers = metadata[f"{architecture}.block_count"]
    num_layers -= metadata.get(f"{architecture}.nextn_predict_layers", 0)
    linear = None
    if architecture in _DELTA_NETS:
        value_heads = metadata[f"{architecture}.ssm.time_step_rank"]
        linear = (
            metadata[f"{architecture}.ssm.group_count"],
            value_heads,
            metadata[f"{architecture}.ssm.state_size"],
            metadata[f"{architecture}.ssm.inner_size"] // value_heads,
        )
    blocks = None
    if architecture in _NEMOTRON_H:
        blocks = _nemotron_h_blocks(metadata, architecture, num_layers)
    first_shared = num_layers - metadata.get(f"{architecture}.attention.shared_kv_layers", 0)
    per_layer_vocab = _per_layer_vocab(Path(path), header)
    return _Layout(
        architecture,
        *(num_heads, num_kv_heads, head_dim, num_layers, linear, blocks, first_shared),
        per_layer_vocab,
    )


def _nemotron_h_blocks(
    metadata: dict[str, Any], arch: str, num_blocks: int
) -> dict[int, tuple[int, str]]:
    from conveyor.model.families import nemotron_h_layers

    types = nemotron_h_block_types(metadata, arch, num_blocks)
    blocks = {}
    for layer, (mixer, mlp) in enumerate(nemotron_h_layers(types)):
        blocks[mixer] = (layer, "mamba" if types[mixer] == "linear_attention" else "self_attn")
        if mlp is not None:
            blocks[mlp] = (layer, "mlp")
    return blocks


# Nemotron-H's GGUF names in a block -> the module of its role (mamba, self_attn, mlp) there;
# its ungated MLP's up projection held as gate_proj (model/llama.py LlamaMLP).
_NEMOTRON_H_NAMES = {
    "ssm_in": "in_proj",
    "ssm_conv1d": "conv1d",
    "ssm_norm": "norm",
    "ssm_out": "out_proj",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_up": "gate_proj",
    "ffn_down": "down_proj",
    "ffn_gate_inp": "gate",
    "ffn_up_shexp": "shared_expert.gate_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
}
_NEMOTRON_H_EXPERTS = {"ffn_up_exps": "gate_proj", "ffn_down_exps": "down_proj"}


def _nemotron_h_targets(info: _TensorInfo, layout: _Layout, path: str | Path) -> list[_Target]:
    """The HF tensors of a Nemotron-H file's tensor, under the decoder layers its blocks pair
    into (its block norm the layer's input_layernorm, or post_attention_layernorm for an MLP
    block)."""
    if info.name in _GLOBAL_NAMES:
        return [_Target(_GLOBAL_NAMES[info.name], None)]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?", info.name)
    if match is None or int(match[1]) not in layout.blocks:
        raise ValueError(f"GGUF tensor {info.name!r} in {str(path)!r} has no Hugging Face name")
    layer, role = layout.blocks[int(match[1])]
    kind, param = match[2], match[3]
    prefix = f"model.layers.{layer}"
    if kind == "attn_norm":
        norm = "post_attention_layernorm" if role == "mlp" else "input_layernorm"
        return [_Target(f"{prefix}.{norm}.{param}", None)]
    if kind in _MAMBA2_PARAMETER_NAMES or f"{kind}.{param}" in _MAMBA2_PARAMETER_NAMES:
        name = _MAMBA2_PARAMETER_NAMES.get(kind) or _MAMBA2_PARAMETER_NAMES[f"{kind}.{param}"]
        return [_Target(f"{prefix}.mamba.{name}", None)]
    if kind == "exp_probs_b":  # the router's choosing bias (e_score_correction_bias)
        return [_Target(f"{prefix}.mlp.expert_bias", None)]
    if kind in _NEMOTRON_H_EXPERTS:
        experts = _expert_targets(info, str(layer), (_NEMOTRON_H_EXPERTS[kind],), param)
        return experts
    if kind not in _NEMOTRON_H_NAMES:
        raise ValueError(f"GGUF tensor {info.name!r} in {str(path)!r} has no Hugging Face name")
    return [_Target(f"{prefix}.{role}.{_NEMOTRON_H_NAMES[kind]}.{param}", None)]


def _targets(info: _TensorInfo, layout: _Layout, path: str | Path) -> list[_Target]:
    """The HF tensors a GGUF tensor holds: one, or the parts of a fused one (Phi-3's)."""
    if layout.architecture in _DELTA_NETS and (param := _QWEN35_PARAMETERS.fullmatch(info.name)):
        name = "A_log" if param[2] == "ssm_a" else "dt_bias"
        return [_Target(f"model.layers.{param[1]}.linear_attn.{name}", None)]
    if layout.architecture in _NEMOTRON_H:
        return _nemotron_h_targets(info, layout, path)
    if layout.architecture == "granitehybrid" and (
        param := _MAMBA2_PARAMETERS.fullmatch(info.name)
    ):
        name = _MAMBA2_PARAMETER_NAMES[param[2]]
        return [_Target(f"model.layers.{param[1]}.mamba.{name}", None)]
    if layout.architecture == "gemma4" and (param := _GEMMA4_PARAMETERS.fullmatch(info.name)):
        return [_Target(f"model.layers.{param[1]}.{_GEMMA4_PARAMETER_NAMES[param[2]]}", None)]
    if layout.architecture == "gemma3n" and (param := _GEMMA3N_SCALE.fullmatch(info.name)):
        return [_Target(f"model.layers.{param[1]}.altup.correct_output_scale", None)]
    if layout.per_layer_vocab is not None and info.name == "per_layer_token_embd.weight":
        return [_Target(_PER_LAYER_GLOBAL_NAMES[info.name], slice(0, layout.per_layer_vocab))]
    if layout.architecture == "gemma3n" and info.name in _GEMMA3N_STACKED:
        rows = info.shape[1]
        return [
            _Target(f"{_GEMMA3N_STACKED[info.name]}.{i}.weight", slice(i * rows, (i + 1) * rows))
            for i in range(info.shape[0])
        ]
    global_names = {**_GLOBAL_NAMES, **_ARCH_GLOBAL_NAMES.get(layout.architecture, {})}
    if info.name in global_names:
        return [_Target(global_names[info.name], None)]
    match = _LAYER_TENSOR.fullmatch(info.name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(layout.architecture, {})}
    module = "moe.experts" if layout.architecture == "gemma4" else "mlp.experts"
    if match is not None and match[2] in _EXPERT_NAMES:
        return _expert_targets(info, match[1], (_EXPERT_NAMES[match[2]],), match[3], module)
    if match is not None and match[2] == "ffn_gate_up_exps":  # each expert's gate, then up rows
        return _expert_targets(info, match[1], ("gate_proj", "up_proj"), match[3], module)
    if match is not None and match[2] == "attn_sinks":
        return [_Target(f"model.layers.{match[1]}.self_attn.sinks", None)]
    if match is not None and match[2] == "exp_probs_b":  # LFM2-MoE's choosing bias, a buffer
        return [_Target(f"model.layers.{match[1]}.mlp.expert_bias", None)]
    if match is None or (match[2] not in names and match[2] not in _FUSED):
        # Failing beats dropping a weight silently and running a model with random parameters.
        raise ValueError(f"GGUF tensor {info.name!r} in {str(path)!r} has no Hugging Face name")
    layer, kind, param = match[1], match[2], match[3]
    parts = _fused_parts(kind, info, layout)
    if parts is None:
        return [_Target(f"model.layers.{layer}.{names[kind]}.{param}", None)]
    targets, start = [], 0
    for part, num_rows in parts:
        targets.append(
            _Target(f"model.layers.{layer}.{names[part]}.{param}", slice(start, start + num_rows))
        )
        start += num_rows
    if start != info.shape[0]:
        raise ValueError(f"GGUF tensor {info.name!r} has {info.shape[0]} rows, expected {start}")
    return targets


def _expert_targets(
    info: _TensorInfo, layer: str, parts: tuple[str, ...], param: str, module: str = "mlp.experts"
) -> list:
    """Each expert's tensors of an experts' tensor: its rows of a 3-D weight (experts, rows,
    columns; read as the matrix of every expert's rows), split evenly among `parts` in order
    where it holds several (Gemma 4's ffn_gate_up_exps: gate, then up), its row of a 2-D bias
    (GPT-OSS's)."""
    experts = info.shape[0]
    if len(info.shape) != 3:
        return [_Target(f"model.layers.{layer}.{module}.{e}.{parts[0]}.{param}", e)
                for e in range(experts)]  # fmt: skip
    rows = info.shape[1] // len(parts)
    return [
        _Target(
            f"model.layers.{layer}.{module}.{e}.{part}.{param}",
            slice((e * len(parts) + k) * rows, (e * len(parts) + k + 1) * rows),
        )
        for e in range(experts)
        for k, part in enumerate(parts)
    ]


def _fused_parts(kind: str, info: _TensorInfo, layout: _Layout) -> list[tuple[str, int]] | None:
    """(GGUF name, rows) of each part of a fused tensor, in order; None: not fused. Phi-3's and
    GLM-4's ffn_up is gate and up stacked (their gate_up_proj), other architectures' is up."""
    if kind == "attn_qkv" and layout.architecture not in _DELTA_NETS:  # their delta nets' q/k/v
        kv_rows = layout.num_kv_heads * layout.head_dim
        return [
            ("attn_q", layout.num_heads * layout.head_dim),
            ("attn_k", kv_rows),
            ("attn_v", kv_rows),
        ]
    if kind == "ffn_up" and layout.architecture in ("phi3", "glm4"):
        return [("ffn_gate", info.shape[0] // 2), ("ffn_up", info.shape[0] // 2)]
    return None


def _dequantize(buffer: mmap.mmap, data_offset: int, info: _TensorInfo) -> torch.Tensor:
    """The tensor as float32 in its HF shape."""
    byte_shape = gguf.quants.quant_shape_to_byte_shape(info.shape, info.qtype)
    raw = np.frombuffer(
        buffer, dtype=np.uint8, count=math.prod(byte_shape), offset=data_offset + info.offset
    ).reshape(byte_shape)
    try:
        values = gguf.quants.dequantize(raw, info.qtype)
    except NotImplementedError as error:
        raise ValueError(
            f"GGUF tensor {info.name!r} has type {info.qtype.name}, which gguf cannot dequantize"
        ) from error
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    import torch

    return torch.from_numpy(values).reshape(info.shape)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`, which interleaves each head's two rotary halves.

    llama.cpp stores a head's rows as (head_dim / 2, 2) for its interleaved rope; HF's
    rotate_half rope wants (2, head_dim / 2). Works for weights and biases alike.
    """
    rest = weight.shape[1:]
    return weight.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(weight.shape)


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Scalar metadata of the file (string arrays such as the vocabulary left out)."""
    return _header(path).metadata


# Bumped when what a cached folder holds for the same file changes (2: llama3 rope_freqs and
# the rope.scaling keys of Llama's four read into the config).
_FOLDER_VERSION = 2


def gguf_hf_folder(path: str | Path) -> Path:
    """A Hugging Face style folder (config.json + tokenizer files) for a GGUF file.

    transformers rebuilds config and tokenizer from GGUF metadata, but slowly (tens of seconds
    for a 49k-token vocabulary), so the result is stored once per file under
    conveyor.paths.cache_dir() (default ~/.cache/conveyor) and reused while the file is unchanged.
    """
    path = Path(path).resolve()
    architecture = gguf_architecture(path)
    stat = path.stat()
    stamp = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{_FOLDER_VERSION}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    folder = _cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    print(
        f"conveyor: reading config and tokenizer of {path.name} once (can take ~30 s); "
        f"cached in {folder}",
        file=sys.stderr,
        flush=True,
    )
    config, tokenizer = _hf_config_and_tokenizer(path, architecture)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)  # atomic: a half-written folder is never seen
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return folder


def _hf_config_and_tokenizer(path: Path, architecture: str) -> tuple[Any, Any]:
    """transformers' config and tokenizer of the file; for FAMILIES the config is ours, and the
    tokenizer is built from `tokenizer.ggml.model` alone (AutoTokenizer would first convert the
    config, which transformers cannot for some of them)."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    if architecture in FAMILIES or is_mixtral(gguf_metadata(path)):
        header = _header(path)
        shapes = {t.name: t.shape for t in header.tensors}
        fields = hf_config_dict(
            header.metadata, shapes, _rope_factors(path, header), _per_layer_vocab(path, header)
        )
        config = AutoConfig.for_model(**fields)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
        return config, tokenizer
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # transformers keeps Qwen3Config's default head_dim instead of reading key_length.
    metadata = gguf_metadata(path)
    key_length = metadata.get(f"{architecture}.attention.key_length")
    if architecture == "qwen3" and key_length:
        config.head_dim = key_length
    stated = rope_parameters(metadata, architecture)  # linear / yarn, which its reader drops
    if stated["rope_type"] != "default":
        config.rope_parameters = dict(config.rope_parameters or {}) | stated
    divisors = _rope_factors(path, _header(path)).get(LLAMA3_TENSOR)
    if divisors is not None:  # llama3 scaling, which transformers' reader drops (gguf_config)
        fields = {
            "rope_parameters": {"rope_type": "default", **(config.rope_parameters or {})},
            "head_dim": getattr(config, "head_dim", None),
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
        }
        set_llama3(fields, divisors, metadata, architecture)
        config.rope_parameters = fields["rope_parameters"]
    return config, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _rope_factors(path: Path, header: _Header) -> dict[str, list[float]]:
    """The values of the file's rope factor tensors (Phi-3's longrope ones, llama3's
    rope_freqs), by name."""
    infos = [t for t in header.tensors if t.name in (*LONGROPE_TENSORS, LLAMA3_TENSOR)]
    if not infos:
        return {}
    with _map(path) as buffer:
        return {t.name: _dequantize(buffer, header.data_offset, t).tolist() for t in infos}


def _per_layer_vocab(path: Path, header: _Header) -> int | None:
    """A gemma3n file's per-layer vocabulary: per_layer_token_embd's rows but the zero rows
    llama.cpp's converter pads it with up to the vocabulary (a trained row is never all zero);
    transformers reads row 0 for the tokens past it, as the checkpoint's table has no row for
    them. None for other files."""
    info = next((t for t in header.tensors if t.name == "per_layer_token_embd.weight"), None)
    if info is None or _architecture(header, path) != "gemma3n":
        return None
    rows = info.shape[0]
    row_bytes = gguf.quants.quant_shape_to_byte_shape((1, info.shape[1]), info.qtype)[-1]
    with _map(path) as buffer:
        start = header.data_offset + info.offset
        table = np.frombuffer(buffer, dtype=np.uint8, count=rows * row_bytes, offset=start)
        table = table.reshape(rows, row_bytes)
        while rows > 1 and not table[rows - 1].any():
            rows -= 1
        del table  # (no view of the map may outlive it)
    return rows


def _cache_root() -> Path:
    from conveyor.paths import cache_dir

    return cache_dir()
