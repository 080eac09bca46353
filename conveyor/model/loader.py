"""Builds the model and tokenizer from a local checkpoint: a Hugging Face folder (one or
several safetensors files) or a single GGUF file (dequantized with the gguf package, or with
`cfg.quantization` != "none" its projections kept in quantized blocks, see model/quant.py)."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from conveyor.distributed.parallel import TPGroup, TPShard
from conveyor.model.config import ModelConfig
from conveyor.model.families import MLA_FAMILIES
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.quant import QuantPlan, plan_quantization
from conveyor.model.quant.prequantized import Dequantizer, GroupedInts


def load_model(
    cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None
) -> LlamaForCausalLM:
    """The model on `device`; with a TPGroup of size > 1, this rank's share of it, read from
    the checkpoint as slices (see distributed/parallel.py)."""
    shard = TPShard() if tp is None else tp.shard
    if cfg.is_encoder:  # the BERT family: a model of its own (model/bert.py)
        if shard.size > 1:
            raise ValueError("an encoder (BERT family) does not split over tensor-parallel ranks")
        weights = iter_safetensors(cfg.path, cfg.dtype)
        if cfg.parts.family == "modernbert":
            from conveyor.model.modernbert import load_modernbert

            return load_modernbert(cfg, device, weights)
        from conveyor.model.bert import load_encoder

        return load_encoder(cfg, device, weights)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    plan = plan_quantization(cfg, model)
    if plan is not None and shard.size > 1:
        raise ValueError("quantized weights do not split over tensor-parallel ranks")
    # Gemma 4's per-layer embedding read from its file's pages as tokens use them (CPU): a
    # safetensors tensor mapped in its dtype, a GGUF's blocks dequantized row by row
    table = _per_layer_table(cfg) if device.type == "cpu" else None
    rows = device.type == "cpu" and cfg.is_gguf and bool(cfg.parts.per_layer_input[0])
    mapped = (f"{PER_LAYER_MODULE}.weight",) if table is not None or rows else ()
    if device.type == "cpu":  # before any storage: a model too large for memory says so
        _check_fits(cfg, model, plan, mapped=(PER_LAYER_MODULE,) if mapped else ())
    if plan is not None:  # quantized modules never get float storage
        plan.strip(model)
    # Real storage on the target device, in the model's dtype; weights are then copied in by
    # name. As to_empty() then .to(dtype), but torch.empty: to_empty's empty_like on meta
    # tensors imports sympy (~1 s of every start) for their strides.
    model._apply(lambda t: torch.empty(t.shape, dtype=_dtype(t, cfg.dtype), device=device))
    # Buffers computed at construction were lost on the meta device: compute them again.
    model.rotaries = model.rotary_tables(device)
    if cfg.tie_word_embeddings and (plan is None or "lm_head" not in plan.specs):
        model.lm_head.weight = model.model.embed_tokens.weight  # _apply() made two tensors
    weights = tqdm(
        iter_weights(cfg, plan, shard, mapped),
        desc=f"Loading {cfg.path.name}",
        unit=" tensors",
        leave=False,
        disable=None,
    )
    if table is not None:
        model.get_submodule(PER_LAYER_MODULE).weight = nn.Parameter(table, requires_grad=False)
    if rows:
        weights = _gguf_rows(model, weights)
    model.load_weights(weights if plan is None else plan.take(weights), loaded=mapped)
    if plan is not None:
        plan.install(model)
    if cfg.batch_invariant and device.type == "cpu":
        from conveyor.model.layers import pack_panels

        pack_panels(model)
        from conveyor.model import kernels, prompt_route

        ops = kernels.load()
        if cfg.dtype == torch.float32:
            prompt_route.choose(model, ops)
    return model.eval()


# Gemma 4's per-layer input embedding: num_layers x 256 values for each of 262,144 tokens (2.3 G
# parameters in gemma-4-E2B, more than the rest of the model), of which a step reads its
# tokens' rows.
PER_LAYER_MODULE = "model.embed_tokens_per_layer"


def _gguf_rows(model: LlamaForCausalLM, weights) -> Iterator[tuple[str, Any]]:
    """The weights but a GGUF's per-layer embedding, which comes in its blocks (iter_weights:
    `mapped`) and becomes a table whose rows are dequantized as a step reads them."""
    from conveyor.model.gemma4 import BlockRows

    name = f"{PER_LAYER_MODULE}.weight"
    for weight_name, tensor in weights:
        if weight_name == name:
            model.model.embed_tokens_per_layer = BlockRows(tensor.qtype, tensor.data)
            continue
        yield weight_name, tensor


def _per_layer_table(cfg: ModelConfig) -> torch.Tensor | None:
    """Gemma 4's per-layer embedding mapped from the checkpoint's file in its stored dtype
    (model/gemma4.py converts the rows a step reads: the values of a converted table's): its
    pages are read as tokens first use them, and shared with the page cache. None where it is
    not a plain safetensors tensor of its shape (a GGUF, a quantized checkpoint): then it is
    loaded as the others are."""
    width, vocab = cfg.parts.per_layer_input
    if not width or cfg.is_gguf:
        return None
    table = map_safetensor(cfg.path, _stored_name(cfg, f"{PER_LAYER_MODULE}.weight"))
    if table is None or tuple(table.shape) != (vocab, cfg.num_layers * width):
        return None
    return table


def _stored_name(cfg: ModelConfig, name: str) -> str:
    """A text model's weight name as its checkpoint stores it (a multimodal one's under its
    language model)."""
    return name.replace("model.", "model.language_model.", 1) if cfg.text_of else name


def map_safetensor(folder: Path, name: str) -> torch.Tensor | None:
    """The stored tensor `name` of a safetensors checkpoint as a read-only memory map of its
    bytes (no copy: pages are read as they are touched); None where it is not stored."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        file = json.loads(index.read_text())["weight_map"].get(name)
        files = [folder / file] if file else []
    else:
        files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        entry = header.get(name)
        if entry is None:
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            return None
        start, stop = entry["data_offsets"]
        offset = 8 + length + start
        raw = np.memmap(file, dtype=np.uint8, mode="r", offset=offset, shape=(stop - start,))
        with warnings.catch_warnings():  # read-only: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw)
        return flat.view(dtype).view(entry["shape"])
    return None


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def _check_fits(
    cfg: ModelConfig, model: LlamaForCausalLM, plan: QuantPlan | None, mapped=()
) -> None:
    """mapped: modules whose weights are mapped from the checkpoint's file (page cache)."""
    from conveyor.model import memory
    from conveyor.model.prompt_route import available_memory

    quantized = () if plan is None else plan.specs
    need = memory.estimate(
        model, quantized, cfg.quantization, cfg.dtype, cfg.batch_invariant, mapped=mapped
    )
    memory.check_fits(need, available_memory(), cfg.path.name)


def iter_weights(
    cfg: ModelConfig, plan: QuantPlan | None = None, shard: TPShard | None = None, mapped=()
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every checkpoint weight; with a shard of size > 1, only this rank's
    slice of each split tensor. safetensors files are read slice by slice; a GGUF tensor is
    dequantized whole from its memory map, then cut. `mapped`: weights read from the file's
    map as a step needs them (Gemma 4's per-layer embedding: load_model), not read here; a
    GGUF's come in their blocks (RawTensor)."""
    shard = shard or TPShard()
    if cfg.is_gguf:
        from conveyor.model.gguf_loader import iter_gguf_weights

        keep_raw = None if plan is None else plan.keep_raw
        if mapped:
            planned = keep_raw
            keep_raw = lambda name: name in mapped or bool(planned and planned(name))  # noqa: E731
        weights = iter_gguf_weights(cfg.path, cfg.dtype, keep_raw)
        if cfg.parts.attn_gate:  # Qwen3.5's query and gate rows (read as floats)
            weights = _gated_queries(weights, cfg)
        if cfg.parts.family == "qwen3_next":  # its ssm_ba's b and a rows (read as floats)
            weights = _grouped_projections(weights, cfg)
        if cfg.rotary_rows is not None:  # before the cut: a fused qkv_proj is whole
            weights = _rotary_rows(weights, cfg)
        if cfg.parts.family == "ernie4_5_moe":
            weights = _flat_expert_bias(weights)
        if cfg.parts.mla:
            weights = _latent_heads(weights, cfg)
        if cfg.parts.mla_rope_interleaved:
            weights = _mla_rope_rows(weights, cfg)
        for name, tensor in weights:
            cut = shard.slice_of(name, cfg)
            yield name, tensor if cut is None else _cut(tensor, cut).clone()
    else:
        cut_of = lambda name: shard.slice_of(name, cfg)  # noqa: E731
        family = cfg.parts.family
        if family == "gpt_oss":  # its experts' 3-D tensors are split first, then cut
            weights = _gpt_oss_experts(iter_safetensors(cfg.path, cfg.dtype), cut_of)
        else:
            rename = {
                "mixtral": _MIXTRAL_NAMES, "granitemoe": _GRANITE_MOE_NAMES, "lfm2": _LFM2_NAMES,
                "arcee": _UNGATED_MLP_NAMES,
                "bamba": _BAMBA_NAMES,
                "glm4_moe": _GLM4_MOE_NAMES,
                # DeepSeek's and GLM-4.7-Flash's shared experts and router bias: GLM-4.5's names
                **dict.fromkeys(MLA_FAMILIES, _GLM4_MOE_NAMES),
                "ernie4_5_moe": _ERNIE_MOE_NAMES,
                "granitemoehybrid": (
                    _GRANITE_HYBRID_MOE_NAMES if any(cfg.parts.moe_layers)
                    else _GRANITE_HYBRID_NAMES
                ),
                "lfm2_moe": (*_LFM2_NAMES, *_LFM2_EXPERT_NAMES),
                "gemma4": _GEMMA4_MOE_NAMES,
            }.get(family)  # fmt: skip
            skip = _NOT_READ.get(family)
            if cfg.mtp_layers:  # the multi-token prediction layer is read (model/mtp.py)
                skip = tuple(p for p in skip or () if p != "mtp.") or None
            if cfg.text_of is not None:  # a multimodal checkpoint's language model alone
                rename = _LANGUAGE_MODEL_NAMES + (rename or ())
                skip = _NOT_LANGUAGE_MODEL + (skip or ())
            if mapped:  # by their stored names (a multimodal checkpoint's language model's)
                skip = (skip or ()) + tuple(_stored_name(cfg, name) for name in mapped)
            grouped = None if plan is None or shard.size > 1 else plan.keep_grouped
            stacked = family in _STACKED_FAMILIES or (
                family == "granitemoehybrid" and any(cfg.parts.moe_layers)
            )
            if cfg.text_of in _STACKED_EXPERTS or stacked:  # split, then cut
                weights = iter_safetensors(cfg.path, cfg.dtype, None, rename, grouped, skip)
                weights = _stacked_experts(_mtp_layer(weights, cfg), cfg, cut_of)
            else:
                weights = iter_safetensors(cfg.path, cfg.dtype, cut_of, rename, grouped, skip)
                weights = _mtp_layer(weights, cfg)
        # Fused q/k/v or gate/up tensors, split where a rank cuts them or quantized modules
        # take them by their parts (QuantPlan: each part's blocks).
        fused = family in ("phi3", "granitemoehybrid", "glm", "glm4")
        if fused and (shard.size > 1 or plan is not None):
            weights = _unfused(weights, cfg, cut_of)
        if family == "nemotron_h":
            weights = _nemotron_h_blocks(weights, cfg)
        if family == "ernie4_5_moe":
            weights = _flat_expert_bias(weights)
        if cfg.parts.attn_gate:  # before the rows turn: q_proj's gate rows are no query's
            weights = _gated_queries(weights, cfg)
        if family == "qwen3_next":
            weights = _grouped_projections(weights, cfg)
        if cfg.rotary_rows is not None:
            weights = _rotary_rows(weights, cfg)
        if cfg.parts.mla_rope_interleaved:
            weights = _mla_rope_rows(weights, cfg)
        if cfg.parts.kv_sources:
            weights = _unshared(weights, cfg)
        yield from weights


# A multi-token prediction layer stored after the model's (GLM-4.5, DeepSeek-V3): its own
# tensors' names -> model/mtp.py's; the embedding and head it may store again are the model's.
_MTP_LAYER_NAMES = {
    "enorm.": "mtp.pre_fc_norm_embedding.",
    "hnorm.": "mtp.pre_fc_norm_hidden.",
    "eh_proj.": "mtp.fc.",
    "shared_head.norm.": "mtp.norm.",
    "shared_head.head.": None,
    "embed_tokens.": None,
}


def _mtp_layer(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """With the multi-token prediction layer read (ModelConfig.mtp_layers) of a family that
    stores it as model.layers.{num_hidden_layers} (model/mtp.py LAYER_MTP_FAMILIES), its
    tensors under model/mtp.py's names (its decoder layer's as mtp.layers.0.*); the layers
    after it are not read. Other weights pass as they are."""
    from conveyor.model.mtp import LAYER_MTP_FAMILIES

    if not cfg.mtp_layers or cfg.parts.family not in LAYER_MTP_FAMILIES:
        yield from weights
        return
    first = f"model.layers.{cfg.num_layers}."
    for name, tensor in weights:
        if not name.startswith(first):
            yield name, tensor
            continue
        rest = name.removeprefix(first)
        own = next((k for k in _MTP_LAYER_NAMES if rest.startswith(k)), None)
        if own is None:
            yield f"mtp.layers.0.{rest}", tensor
        elif _MTP_LAYER_NAMES[own] is not None:
            yield _MTP_LAYER_NAMES[own] + rest.removeprefix(own), tensor


def _unshared(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Without the key and value tensors some checkpoints keep for a layer that reads another
    layer's cache (Gemma 4's num_kv_shared_layers: transformers does not read them either)."""
    for name, tensor in weights:
        layer = _LAYER.match(name)
        shared = layer is not None and cfg.parts.kv_source(int(layer[1])) != int(layer[1])
        if shared and name.rpartition(".self_attn.")[2].split(".")[0] in _KEY_VALUE_MODULES:
            continue
        yield name, tensor


_KEY_VALUE_MODULES = ("k_proj", "v_proj", "k_norm", "v_norm")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _mla_rope_rows(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Multi-head latent attention's rope rows (each head's last qk_rope_head_dim rows of q_proj
    or q_b_proj, the rope key's of kv_a_proj_with_mqa) with the even dims first, then the odd
    ones: RoPE on adjacent pairs (2i, 2i + 1) becomes the default one on pairs (i, i + d / 2),
    and q_pe . k_pe adds the same products in another order (model/config.py rotary_rows)."""
    _, rank, nope, rope, _ = cfg.parts.mla
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    for name, tensor in weights:
        module = name.rpartition(".")[0].rpartition(".")[2]
        if module in ("q_proj", "q_b_proj"):
            heads = tensor.shape[0] // (nope + rope)
            rows = torch.arange(tensor.shape[0]).view(heads, nope + rope)
            rows[:, nope:] = rows[:, nope:][:, order]
            tensor = _taken_rows(tensor, rows.flatten(), cfg)
        elif module == "kv_a_proj_with_mqa":
            rows = torch.arange(tensor.shape[0])
            rows[rank:] = rows[rank:][order]
            tensor = _taken_rows(tensor, rows, cfg)
        yield name, tensor


def _taken_rows(tensor, rows: torch.Tensor, cfg: ModelConfig):
    """The tensor's rows in `rows`' order: a GGUF tensor kept in its blocks takes them as it
    loads (RawTensor.row_order), any other one at once."""
    from conveyor.model.gguf_loader import RawTensor

    if isinstance(tensor, RawTensor):
        taken = rows if tensor.row_order is None else tensor.row_order[rows]
        return tensor._replace(row_order=taken)
    return _float_rows(tensor, cfg)[rows]


def _latent_heads(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """A GGUF file's k_b_proj (heads, kv_lora_rank, qk_nope: each head's key rows, transposed)
    and v_b_proj (heads, v, kv_lora_rank), as llama.cpp's converter splits kv_b_proj, joined
    back into kv_b_proj (each head's key rows, then its value rows)."""
    _, rank, nope, _, v_dim = cfg.parts.mla
    heads = cfg.num_heads
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        if leaf not in ("k_b_proj", "v_b_proj"):
            yield name, tensor
            continue
        parts = halves.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == 2:
            keys = parts["k_b_proj"].reshape(heads, rank, nope).transpose(1, 2)
            values = parts["v_b_proj"].reshape(heads, v_dim, rank)
            joined = torch.cat([keys, values], dim=1).reshape(heads * (nope + v_dim), rank)
            yield f"{prefix}.kv_b_proj.{param}", joined.contiguous()
            del halves[prefix]
    if halves:
        raise ValueError(f"a latent attention's k_b_proj or v_b_proj alone in {sorted(halves)}")


def _flat_expert_bias(weights) -> Iterator[tuple[str, Any]]:
    """ERNIE 4.5's choosing bias, stored (1, experts), as the router's (experts,)."""
    for name, tensor in weights:
        yield name, tensor.reshape(-1) if name.endswith(".mlp.expert_bias") else tensor


# Stored tensors a family's model does not read: Qwen3.5's multi-token prediction layer, but
# where speculative decoding runs it (ModelConfig.mtp_layers, model/mtp.py).
_NOT_READ = {"qwen3_5": ("mtp.",), "qwen3_5_moe": ("mtp.",), "qwen3_next": ("mtp.",)}
_NOT_READ["ernie4_5_moe"] = ("model.mtp_",)  # ERNIE 4.5's mtp_block, mtp_emb_norm, ...


def _gated_queries(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Qwen3.5's q_proj holds each head's query rows, then that head's gate rows: split into
    q_proj and q_gate_proj (the qkv_proj's fourth part, model/llama.py)."""
    head_dim = cfg.head_dim
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        if not module.endswith("self_attn.q_proj"):
            yield name, tensor
            continue
        tensor = _float_rows(tensor, cfg)
        if not isinstance(tensor, torch.Tensor) or tensor.shape[0] % (2 * head_dim):
            raise ValueError(f"{name}: not whole heads of query and gate rows")
        rows = tensor.reshape(-1, 2, head_dim, *tensor.shape[1:])
        yield name, rows[:, 0].flatten(0, 1).contiguous()
        yield f"{module.removesuffix('q_proj')}q_gate_proj.{param}", rows[:, 1].flatten(0, 1)


def _float_rows(tensor, cfg: ModelConfig):
    """A GPTQ or AWQ weight (GroupedInts) as the float rows it holds, to be reordered or split
    by rows; any other tensor as it is."""
    if isinstance(tensor, GroupedInts):
        return tensor.dequantize().to(cfg.dtype)
    return tensor


def _grouped_projections(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Qwen3-Next's delta nets store their input projections per key head: in_proj_qkvz as
    each key head's q, k, then its value heads' v and z rows, in_proj_ba as its value heads' b
    and a rows; split into Qwen3.5's in_proj_qkv (every q, every k, every v), in_proj_z,
    in_proj_b and in_proj_a."""
    (key_heads, value_heads), (key_dim, value_dim) = cfg.parts.linear_heads, cfg.parts.linear_dims
    per_key = value_heads // key_heads
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf not in ("in_proj_qkvz", "in_proj_ba"):
            yield name, tensor
            continue
        tensor = _float_rows(tensor, cfg)
        prefix = module.removesuffix(leaf)
        if leaf == "in_proj_qkvz":
            sizes = [key_dim, key_dim, per_key * value_dim, per_key * value_dim]
            q, k, v, z = tensor.reshape(key_heads, sum(sizes), -1).split(sizes, dim=1)
            qkv = torch.cat([part.reshape(-1, tensor.shape[1]) for part in (q, k, v)])
            yield f"{prefix}in_proj_qkv.{param}", qkv
            yield f"{prefix}in_proj_z.{param}", z.reshape(-1, tensor.shape[1])
        else:
            b, a = tensor.reshape(key_heads, 2 * per_key, -1).split(per_key, dim=1)
            yield f"{prefix}in_proj_b.{param}", b.reshape(-1, tensor.shape[1])
            yield f"{prefix}in_proj_a.{param}", a.reshape(-1, tensor.shape[1])


def _rotary_rows(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Each q and k head's rows (weights and biases, of q_proj / k_proj or the q and k rows of
    a fused qkv_proj, and the weights of q and k norms) in cfg.rotary_rows' order: the
    checkpoint's RoPE as the default one (model/config.py rotary_rows)."""
    from conveyor.model.gguf_loader import RawTensor

    order = torch.tensor(cfg.rotary_rows)
    head_dim = len(order)

    def heads(count: int, first: int = 0) -> torch.Tensor:
        return (first + torch.arange(count)[:, None] * head_dim + order).flatten()

    for name, tensor in weights:
        module = name.rpartition(".")[0].rpartition(".")[2]
        if module not in ("q_proj", "k_proj", "qkv_proj", "q_norm", "k_norm"):
            yield name, tensor
            continue
        tensor = _float_rows(tensor, cfg)
        if module == "qkv_proj":
            q_rows = cfg.num_heads * head_dim
            if tensor.shape[0] != q_rows + 2 * cfg.num_kv_heads * head_dim:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, not the whole q, k and v")
            qk = torch.cat([heads(cfg.num_heads), heads(cfg.num_kv_heads, q_rows)])
            rows = torch.cat(
                [qk, torch.arange(q_rows + cfg.num_kv_heads * head_dim, tensor.shape[0])]
            )
        else:
            rows = heads(tensor.shape[0] // head_dim)
        if isinstance(tensor, RawTensor):  # a GGUF tensor's blocks: rows taken as they load
            taken = rows if tensor.row_order is None else tensor.row_order[rows]
            tensor = tensor._replace(row_order=taken)
        else:
            tensor = tensor[rows]
        yield name, tensor


# LFM2's names -> the model's: its MLP's w1 / w3 / w2, attention's out_proj and q/k norms, and
# its final norm (embedding_norm, applied after the last layer).
_LFM2_NAMES = (
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    ("model.embedding_norm.", "model.norm."),
)
# LFM2-MoE's mixtures: its router, expert bias and experts (stored one module each, w1 / w3 /
# w2, or stacked) under the MoE MLP's names.
_LFM2_EXPERT_NAMES = (
    (".feed_forward.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
# Granite MoE's names of its MoE modules -> the names the model uses (its experts stacked).
_GRANITE_MOE_NAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
)
# Granite 4.0's (attention-only GraniteMoeHybrid) MLP: input_linear is gate then up.
_GRANITE_HYBRID_NAMES = (
    (".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.down_proj."),
)
# GLM-4.5's shared expert and its router's choosing bias under the MoE MLP's names.
_GLM4_MOE_NAMES = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.expert_bias"),
)
# ERNIE 4.5's shared expert and its router's choosing bias (moe_statics, (1, experts) as
# released; under the gate as transformers names it in memory).
_ERNIE_MOE_NAMES = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.expert_bias"),
    (".mlp.moe_statics.e_score_correction_bias", ".mlp.expert_bias"),
)
# Bamba's MLP and final norm under Llama's names.
_BAMBA_NAMES = ((".feed_forward.", ".mlp."), ("model.final_layernorm.", "model.norm."))
# An ungated MLP's up projection (Arcee's), held as gate_proj: a one-part gate_up_proj.
_UNGATED_MLP_NAMES = ((".mlp.up_proj.", ".mlp.gate_proj."),)
# Granite 4.0 with experts (-H-Tiny, -H-Small): Granite MoE's, its shared_mlp the shared expert.
_GRANITE_HYBRID_MOE_NAMES = (
    (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
    *_GRANITE_MOE_NAMES,
)
# Gemma 4's mixture beside the MLP (model/gemma4.py: the layer's `moe`, a MoEMLP): its
# router's projection, scales and stacked experts.
_GEMMA4_MOE_NAMES = (
    (".router.proj.", ".moe.gate."),
    (".router.scale", ".moe.router_scale"),
    (".router.per_expert_scale", ".moe.per_expert_scale"),
    (".experts.", ".moe.experts."),
)
# Checkpoints that keep each layer's experts as two 3-D tensors (experts.gate_up_proj, gate
# rows then up rows, and experts.down_proj), in x @ W form (as released) or nn.Linear's.
_STACKED_EXPERTS = ("Qwen3VLMoeForConditionalGeneration",)
# Families whose experts transformers 5 saves stacked (a checkpoint of one expert per module
# reads as it is too).
_STACKED_FAMILIES = (
    "granitemoe", "qwen3_5_moe", "lfm2_moe", "glm4_moe", "ernie4_5_moe", "gemma4",
    *MLA_FAMILIES,
)  # fmt: skip


def _stacked_experts(weights, cfg: ModelConfig, cut_of) -> Iterator[tuple[str, Any]]:
    """Each expert of a stacked `mlp.experts.gate_up_proj` / `down_proj` pair under a dense
    MLP's names (gate_proj, up_proj, down_proj of `mlp.experts.E`), in nn.Linear's (out, in)
    form whichever form is stored (a square one, hidden = 2 x inner, is taken as nn.Linear's:
    Granite's form, and no released Qwen3-VL-MoE's shape); every tensor then cut for this
    rank."""
    hidden, inner = cfg.hidden_size, cfg.parts.moe_intermediate_size
    forms = {  # leaf -> (shape as nn.Linear's (out, in), the parts' names and row ranges)
        "gate_up_proj": (
            (2 * inner, hidden),
            (("gate_proj", 0, inner), ("up_proj", inner, 2 * inner)),
        ),
        "down_proj": ((hidden, inner), (("down_proj", 0, hidden),)),
    }
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith((".mlp.experts", ".moe.experts")) or leaf not in forms:
            cut = cut_of(name)
            yield name, tensor if cut is None else _cut(tensor, cut).clone()
            continue
        shape, parts = forms[leaf]
        if tuple(tensor.shape[1:]) == shape:
            linear = tensor
        elif tuple(tensor.shape[1:]) == shape[::-1]:
            linear = tensor.transpose(1, 2)
        else:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}, expected (E, {shape}) or its x @ W form"
            )
        for expert, matrix in enumerate(linear):
            for part, start, stop in parts:
                part_name = f"{prefix}.{expert}.{part}.weight"
                piece, cut = matrix[start:stop].contiguous(), cut_of(part_name)
                yield part_name, piece if cut is None else _cut(piece, cut).clone()


def _gpt_oss_experts(weights, cut_of) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-OSS's checkpoint keeps each layer's experts in 3-D tensors, x @ W form, gate and up
    interleaved by column (gate_up_proj (E, hidden, 2I), down_proj (E, I, hidden), biases
    (E, ...)): each expert's tensors under the names of a dense MLP's (its gate rows, then up
    rows), and the router under the MoE's name (mlp.gate)."""
    parts = {
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
        "down_proj": (("down_proj", None),),
    }
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        base, param = leaf.removesuffix("_bias"), "bias" if leaf.endswith("_bias") else "weight"
        for expert, matrix in enumerate(tensor):
            for part, offset in parts[base]:
                piece = matrix if offset is None else matrix[..., offset::2]
                piece = piece.T if param == "weight" else piece
                part_name = f"{prefix}.{expert}.{part}.{param}"
                cut = cut_of(part_name)
                yield part_name, piece.contiguous() if cut is None else _cut(piece, cut).clone()


_NEMOTRON_H_BLOCK = re.compile(r"(?:backbone|model)\.layers\.(\d+)\.(norm|mixer)\.(.+)")
_NEMOTRON_H_GLOBAL = {
    "embeddings.weight": "model.embed_tokens.weight",
    "norm_f.weight": "model.norm.weight",
}
# An MLP block's names -> the layer's MLP's: ungated, its up_proj held as gate_proj (a one-part
# gate_up_proj); Nemotron 3's shared expert and its router's choosing bias.
_NEMOTRON_H_MLP_NAMES = (
    ("up_proj.", "gate_proj."),
    ("shared_experts.", "shared_expert."),
    ("gate.e_score_correction_bias", "expert_bias"),
)


def _nemotron_h_blocks(weights, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Nemotron-H's blocks (`backbone.layers.B.norm` and `.mixer`, as released, or `model.` as
    transformers names them) under the decoder layers they pair into (families.
    nemotron_h_layers): a Mamba2 or attention block's norm is its layer's input_layernorm and
    its mixer the layer's `mamba` or `self_attn`; the MLP block after it gives the layer's
    post_attention_layernorm and `mlp`, its up_proj the one-part gate_up_proj's (held as
    gate_proj). The embeddings and final norm under Llama's names."""
    parts = cfg.parts
    blocks: dict[int, tuple[int, str]] = {}  # block -> (layer, its role there)
    block = 0
    for layer in range(cfg.num_layers):
        blocks[block] = (layer, "mamba" if parts.is_linear(layer) else "self_attn")
        block += 1
        if parts.has_mlp(layer):
            blocks[block] = (layer, "mlp")
            block += 1
    for name, tensor in weights:
        prefix, _, rest = name.partition(".")
        if prefix in ("backbone", "model") and rest in _NEMOTRON_H_GLOBAL:
            yield _NEMOTRON_H_GLOBAL[rest], tensor
            continue
        match = _NEMOTRON_H_BLOCK.fullmatch(name)
        if match is None or int(match[1]) not in blocks:
            yield name, tensor  # lm_head, or a tensor the model then names as unused
            continue
        layer, role = blocks[int(match[1])]
        if match[2] == "norm":
            norm = "post_attention_layernorm" if role == "mlp" else "input_layernorm"
            yield f"model.layers.{layer}.{norm}.{match[3]}", tensor
            continue
        leaf = match[3]
        if role == "mlp":
            for old, new in _NEMOTRON_H_MLP_NAMES:
                leaf = leaf.replace(old, new)
        yield f"model.layers.{layer}.{role}.{leaf}", tensor


# Phi-3's checkpoint tensors that hold several projections, and the names of their parts.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _unfused(weights, cfg: ModelConfig, cut_of) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3 stores q/k/v and gate/up as one tensor each (read whole: no name of theirs is
    cut): under their parts' names, each cut to this rank's share as a Llama's would be."""
    q, kv, inner = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [inner, inner]}
    shared = cfg.parts.shared_expert_size
    for name, tensor in weights:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module not in _FUSED or ".mlp.experts." in name:
            yield name, tensor
            continue
        split = [shared, shared] if ".shared_expert." in name else sizes[module]
        for part, piece in zip(_FUSED[module], tensor.split(split), strict=True):
            part_name = name.replace(f".{module}.", f".{part}.")
            cut = cut_of(part_name)
            yield part_name, piece.contiguous() if cut is None else _cut(piece, cut).clone()


# Mixtral's checkpoint names of its MoE modules -> the Qwen-MoE names the model uses.
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


# A multimodal checkpoint's language model: its tensors (transformers' saved layouts and its
# in-memory one) under the text model's names; its vision tower and projector are not read.
_NOT_LANGUAGE_MODEL = (
    "vision_tower.",
    "multi_modal_projector.",
    "visual.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.visual.",
    "model.audio_tower.",  # Gemma 4's audio encoder and the two towers' embedders
    "model.embed_vision.",
    "model.embed_audio.",
)
_LANGUAGE_MODEL_NAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def iter_safetensors(
    folder: Path, dtype: torch.dtype, slice_of=None, rename=None, grouped=None, skip=None
) -> Iterator[tuple[str, Any]]:
    """skip: prefixes of stored names that are not read.
    rename: (old, new) substrings replaced in each name, in order, before it is cut. The
    weights of a checkpoint quantized by another tool (fp8, compressed-tensors, GPTQ, AWQ) are
    dequantized whole, then cut (model/quant/prequantized.py); grouped(name): a GPTQ or AWQ
    weight of that name comes as it is stored (GroupedInts, uncut: for the QuantPlan)."""
    files = _safetensors_files(folder)
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    dequantizer = Dequantizer(folder, where)

    def get(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as f:
            return f.get_tensor(name)

    for file in files:
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():
                if dequantizer.skips(stored) or (skip and stored.startswith(skip)):
                    continue  # a part of another tensor's weight; no activation scales
                name = dequantizer.makes.get(stored, stored)
                for old, new in rename or ():
                    name = name.replace(old, new)
                keep = grouped is not None and grouped(name)
                weight = dequantizer.read(stored, get, grouped=keep)
                if isinstance(weight, GroupedInts):
                    yield name, weight
                    continue
                cut = None if slice_of is None else slice_of(name)
                if weight is not None:
                    yield name, (weight if cut is None else _cut(weight, cut)).to(dtype)
                elif cut is None:
                    yield name, f.get_tensor(stored).to(dtype)
                else:
                    yield name, _cut(f.get_slice(stored), cut).to(dtype)


def _cut(tensor, cut: tuple[int, int, int, int]) -> torch.Tensor:
    """tensor[start:stop] along dim (a tensor, or a safetensors slice that reads only those
    bytes), zero-padded to `length` along dim."""
    dim, start, stop, length = cut
    part = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
    if stop - start == length:
        return part
    padding = [0, 0] * (part.dim() - 1 - dim) + [0, length - (stop - start)]
    return torch.nn.functional.pad(part, padding)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {str(folder)!r}")
    for file in files:
        if not file.exists():
            raise ValueError(f"checkpoint shard {str(file)!r} listed in the index is missing")
    return files


def _dtype(tensor: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if tensor.is_floating_point() else tensor.dtype
