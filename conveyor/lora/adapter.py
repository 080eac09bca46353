"""A PEFT LoRA folder, read and checked against the base model's shapes.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight`, A of shape
(r, in_features) and B of shape (out_features, r); PEFT computes
`base(x) + lora_B(lora_A(x)) * scaling`, scaling = alpha / r (alpha / sqrt(r) with rsLoRA),
r and alpha per module from `rank_pattern` / `alpha_pattern` when they match it.

conveyor merges q/k/v and gate/up into one projection each (model/llama.py): an adapter's
q_proj is slice 0 of `self_attn.qkv_proj`, and so on (SLICES). Anything this cannot compute
exactly (DoRA, LoRA biases, modules saved whole, embeddings or lm_head targeted, ...) is refused
with a ValueError that names it; so are folders that do not fit the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection -> (conveyor's projection in the layer, slice of its output columns).
SLICES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_PARENTS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<leaf>\w+)$")
# Config entries that change what the adapter computes beyond x @ A^T @ B^T * scaling.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out",
    "modules_to_save": "modules saved whole (modules_to_save)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
    "arrow_config": "Arrow routing (arrow_config)",
}


class ProjectionShape(NamedTuple):
    in_features: int
    out_sizes: tuple[int, ...]  # one per slice (q, k, v; gate, up; or the whole output)


@dataclass(frozen=True)
class LoRAShapes:
    """The base model's projection shapes an adapter must fit, and the adapters' dtype."""

    num_layers: int
    projections: dict[str, ProjectionShape]  # PROJECTIONS -> shape
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg) -> LoRAShapes:
        """From a model/config.py ModelConfig (the whole model: LoRA refuses tensor parallel)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        projections = {
            "self_attn.qkv_proj": ProjectionShape(hidden, (q, kv, kv)),
            "self_attn.o_proj": ProjectionShape(q, (hidden,)),
            "mlp.gate_up_proj": ProjectionShape(hidden, (inter, inter)),
            "mlp.down_proj": ProjectionShape(inter, (hidden,)),
        }
        return cls(cfg.num_layers, projections, cfg.dtype)


class SliceLoRA(NamedTuple):
    a: torch.Tensor  # (r, in_features)
    b: torch.Tensor  # (out_size, r)
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter in host memory: per (layer, projection), one SliceLoRA or None per slice."""

    lora_int_id: int
    lora_name: str
    lora_path: str
    rank: int  # the largest of its modules' ranks
    modules: dict[tuple[int, str], list[SliceLoRA | None]]
    digest: bytes  # of its id and files: what the prefix cache and the slots key it by


def load_adapter(request, shapes: LoRAShapes, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks a LoRARequest's folder; ValueError naming what is wrong."""
    folder = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} ({str(folder)!r})"
    config_bytes, weights_bytes = _read_files(folder, where)
    config = _parse_config(config_bytes, where)
    tensors = _read_tensors(weights_bytes, where)
    modules, rank = _build_modules(tensors, config, shapes, max_lora_rank, where)
    digest = hashlib.sha256(
        b"conveyor-lora\0%d\0" % request.lora_int_id
        + hashlib.sha256(config_bytes).digest()
        + hashlib.sha256(weights_bytes).digest()
    ).digest()
    return LoRAAdapter(
        request.lora_int_id, request.lora_name, request.lora_path, rank, modules, digest
    )


def _read_files(folder: Path, where: str) -> tuple[bytes, bytes]:
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"{where}: {CONFIG_FILE} is missing")
    if not weights_file.is_file():
        other = (
            " (only safetensors is read, not adapter_model.bin)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"{where}: {WEIGHTS_FILE} is missing{other}")
    try:
        return config_file.read_bytes(), weights_file.read_bytes()
    except OSError as error:
        raise ValueError(f"{where}: cannot read its files: {error}") from None


def _parse_config(raw: bytes, where: str) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config.get('bias')!r} is not supported (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
    if not _is_real(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(_is_real(v) for v in pattern.values()):
            raise ValueError(f"{where}: {key} must map module patterns to numbers")
        config[key] = pattern
    targets = config.get("target_modules")
    if isinstance(targets, list):
        leaves = {str(t).rpartition(".")[2] for t in targets}
        unsupported = sorted(leaves - SLICES.keys())
        if unsupported:
            raise ValueError(
                f"{where}: target modules {unsupported} are not supported (only "
                f"{', '.join(SLICES)})"
            )
    return config


def _read_tensors(raw: bytes, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except (SafetensorError, ValueError, RuntimeError, OSError) as error:
        raise ValueError(
            f"{where}: {WEIGHTS_FILE} is not a readable safetensors file: {error}"
        ) from None
    if not tensors:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no tensors")
    return tensors


def _build_modules(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    shapes: LoRAShapes,
    max_lora_rank: int,
    where: str,
) -> tuple[dict[tuple[int, str], list[SliceLoRA | None]], int]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A/B weight this can apply")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    modules: dict[tuple[int, str], list[SliceLoRA | None]] = {}
    top_rank = 0
    for module_name, pair in sorted(pairs.items()):
        layer, projection, index = _locate(module_name, shapes, where)
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module_name} has lora_{''.join(pair)} without its pair")
        shape = shapes.projections[projection]
        one = _slice(pair["A"], pair["B"], shape.in_features, shape.out_sizes[index],
                     module_name, config, shapes.dtype, max_lora_rank, where)  # fmt: skip
        slices = modules.setdefault((layer, projection), [None] * len(shape.out_sizes))
        slices[index] = one
        top_rank = max(top_rank, one.a.shape[0])
    return modules, top_rank


def _locate(module_name: str, shapes: LoRAShapes, where: str) -> tuple[int, str, int]:
    """'model.layers.3.self_attn.k_proj' -> (3, 'self_attn.qkv_proj', 1)."""
    match = _MODULE.match(module_name)
    if match is None or match["leaf"] not in _PARENTS[match["parent"]]:
        leaf = module_name.rpartition(".")[2]
        raise ValueError(
            f"{where}: target module {leaf!r} ({module_name}) is not supported (only "
            f"{', '.join(SLICES)} of the decoder layers)"
        )
    layer = int(match["layer"])
    if layer >= shapes.num_layers:
        raise ValueError(
            f"{where}: {module_name} is beyond this model's {shapes.num_layers} layers: the "
            "adapter was made for another base model"
        )
    projection, index = SLICES[match["leaf"]]
    return layer, projection, index


def _slice(a, b, in_features, out_size, module_name, config, dtype, max_lora_rank, where):
    """One module's checked A and B in the model's dtype, with PEFT's scaling."""
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise ValueError(f"{where}: {module_name}: A and B must be 2-D float matrices")
    rank = a.shape[0]
    if a.shape[1] != in_features or b.shape != (out_size, rank):
        raise ValueError(
            f"{where}: {module_name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit this "
            f"model (expected ({rank}, {in_features}) and ({out_size}, {rank})): the adapter "
            "was made for another base model"
        )
    expected = _pattern_value(config["rank_pattern"], module_name, config["r"])
    if rank != expected:
        raise ValueError(f"{where}: {module_name} has rank {rank}, its config says {expected}")
    if rank > max_lora_rank:
        raise ValueError(
            f"{where}: rank {rank} ({module_name}) is over max_lora_rank={max_lora_rank}"
        )
    a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError(f"{where}: {module_name} has NaN or infinite weights (in {dtype})")
    alpha = _pattern_value(config["alpha_pattern"], module_name, config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return SliceLoRA(a, b, scaling)


def _pattern_value(pattern: dict[str, Any], module_name: str, default):
    """PEFT's get_pattern_key: the first key that matches the end of the module's name."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module_name):
                return value
        except re.error:
            continue
    return default


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
