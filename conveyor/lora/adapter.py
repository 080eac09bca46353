"""A PEFT LoRA folder, read and checked against the base model's shapes.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight`, A of shape
(r, in_features) and B of shape (out_features, r); PEFT computes
`base(x) + lora_B(lora_A(x)) * scaling`, scaling = alpha / r (alpha / sqrt(r) with rsLoRA),
r and alpha per module from `rank_pattern` / `alpha_pattern` when they match it.

The folder is untrusted input (a client names it over HTTP): the config is read bounded (size,
nesting) and every field it uses is checked for its type, pattern keys are matched without
regular expressions (PatternKeys), and the scaling is folded into B at load and checked against
the model's dtype (_fold).

conveyor merges q/k/v and gate/up into one projection each (model/llama.py): an adapter's
q_proj is slice 0 of `self_attn.qkv_proj`, and so on (SLICES). Anything this cannot compute
exactly (DoRA, LoRA biases, modules saved whole, embeddings or lm_head targeted, ...) is refused
with a ValueError that names it; so are folders that do not fit the model.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from conveyor import nesting
from conveyor.lora.request import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from conveyor.model.families import PROJECTION_SHARDS

MAX_CONFIG_DEPTH = 32  # PEFT's own configs nest 3 levels
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha when a config leaves it out

_PARENTS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
# HF projection -> (conveyor's projection in the layer, slice of its output columns).
SLICES = {
    leaf: (f"{parent}.{PROJECTION_SHARDS[leaf][0]}", PROJECTION_SHARDS[leaf][1])
    for parent, leaves in _PARENTS.items()
    for leaf in leaves
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
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
    b: torch.Tensor  # (out_size, r); load_adapter folds PEFT's scaling into it
    scaling: float = 1.0  # a further factor, applied when the slice is copied into a slot


class PatternKeys:
    """rank_pattern / alpha_pattern as PEFT matches them (peft's get_pattern_key): the first key,
    in the file's order, that is the module's name or a dotted suffix of it. PEFT runs each key
    as the regex `(.*\\.)?(key)$`; keys here must be module names (dotted words), for which
    that is what the regex finds (but for its `.` matching any character: `q.proj` would match
    q_proj there), so a match is a few dictionary look-ups and no key can backtrack (as a
    regex, `(.|.)*Z` took seconds to minutes per module, holding the GIL)."""

    def __init__(self, pattern: dict[str, Any]) -> None:
        self._first = {key: (i, value) for i, (key, value) in enumerate(pattern.items())}

    def get(self, module_name: str) -> Any | None:
        """The value of the first key that matches module_name, None if none does."""
        parts = module_name.split(".")
        suffixes = (".".join(parts[i:]) for i in range(len(parts)))
        found = [self._first[s] for s in suffixes if s in self._first]
        return min(found)[1] if found else None


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that decide what the adapter computes, checked."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: PatternKeys
    alpha_pattern: PatternKeys

    def rank(self, module_name: str) -> int:
        rank = self.rank_pattern.get(module_name)
        return self.r if rank is None else rank

    def alpha(self, module_name: str) -> tuple[str, float]:
        """The module's alpha and the field it comes from (alpha_pattern or lora_alpha)."""
        alpha = self.alpha_pattern.get(module_name)
        return ("lora_alpha", self.lora_alpha) if alpha is None else ("alpha_pattern", alpha)


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
        with config_file.open("rb") as file:
            config = file.read(MAX_CONFIG_BYTES + 1)
        weights = weights_file.read_bytes()
    except OSError as error:
        raise ValueError(f"{where}: cannot read its files ({error.strerror})") from None
    if len(config) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {CONFIG_FILE} has more than {MAX_CONFIG_BYTES} bytes")
    return config, weights


def _parse_config(raw: bytes, where: str) -> AdapterConfig:
    config = _read_json(raw, where)
    _check_supported(config, where)
    r = config.get("r")
    if r is None:
        raise ValueError(f"{where}: r is missing (the adapter's rank, an integer >= 1)")
    if not _is_rank(r):
        raise ValueError(f"{where}: r must be an integer >= 1, got {_shown(r)}")
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not _is_real(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {_shown(alpha)}")
    rslora = config.get("use_rslora") or False
    if not isinstance(rslora, bool):
        raise ValueError(f"{where}: use_rslora must be true or false, got {_shown(rslora)}")
    _check_targets(config.get("target_modules"), where)
    rank_pattern = _pattern(config, "rank_pattern", _is_rank, "integers >= 1", where)
    alpha_pattern = _pattern(config, "alpha_pattern", _is_real, "finite numbers", where)
    return AdapterConfig(r, alpha, rslora, rank_pattern, alpha_pattern)


def _read_json(raw: bytes, where: str) -> dict[str, Any]:
    try:
        config = nesting.loads(raw.decode("utf-8"), MAX_CONFIG_DEPTH)
    except nesting.TooDeep:
        raise ValueError(
            f"{where}: {CONFIG_FILE} nests deeper than {MAX_CONFIG_DEPTH} levels"
        ) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_supported(config: dict[str, Any], where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {_shown(config.get('peft_type'))} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{where}: bias={_shown(config.get('bias'))} is not supported (only 'none')"
        )


def _check_targets(targets: Any, where: str) -> None:
    """target_modules: a name, a list of names or null. Only the leaves of a list are checked:
    the weights say which modules the adapter has, and each of those is checked (_locate)."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"{where}: target_modules must be a module name or a list of them, got "
            f"{_shown(targets)}"
        )
    unsupported = sorted({t.rpartition(".")[2] for t in targets} - SLICES.keys())
    if unsupported:
        shown = ", ".join(repr(t[:64]) for t in unsupported[:8])
        raise ValueError(
            f"{where}: target modules [{shown}] are not supported (only {', '.join(SLICES)})"
        )


def _pattern(config: dict[str, Any], key: str, valid, what: str, where: str) -> PatternKeys:
    """rank_pattern or alpha_pattern: module names (see PatternKeys) mapped to values."""
    pattern = config.get(key) or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{where}: {key} must map module names to {what}, got {_shown(pattern)}")
    for name, value in pattern.items():
        if not _is_module_name(name):
            raise ValueError(
                f"{where}: {key} key {name[:64]!r} is not a module name (dotted words such as "
                "'q_proj' or 'layers.0.self_attn.q_proj'; keys are not read as regexes)"
            )
        if not valid(value):
            raise ValueError(f"{where}: {key}[{name[:64]!r}] must be one of {what}, got "
                             f"{_shown(value)}")  # fmt: skip
    return PatternKeys(pattern)


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
    config: AdapterConfig,
    shapes: LoRAShapes,
    max_lora_rank: int,
    where: str,
) -> tuple[dict[tuple[int, str], list[SliceLoRA | None]], int]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(
                f"{where}: tensor {name[:200]!r} is not a LoRA A/B weight this can apply"
            )
        pair = pairs.setdefault(match["module"], {})
        if match["ab"] in pair:
            raise ValueError(f"{where}: {match['module']} has two lora_{match['ab']} tensors")
        pair[match["ab"]] = tensor
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


def _slice(a, b, in_features, out_size, module_name, config: AdapterConfig, dtype,
           max_lora_rank, where) -> SliceLoRA:  # fmt: skip
    """One module's checked A and B in the model's dtype, PEFT's scaling folded into B."""
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise ValueError(f"{where}: {module_name}: A and B must be 2-D float matrices")
    rank = a.shape[0]
    if a.shape[1] != in_features or b.shape != (out_size, rank):
        raise ValueError(
            f"{where}: {module_name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit this "
            f"model (expected ({rank}, {in_features}) and ({out_size}, {rank})): the adapter "
            "was made for another base model"
        )
    expected = config.rank(module_name)
    if rank != expected:
        raise ValueError(f"{where}: {module_name} has rank {rank}, its config says {expected}")
    if rank > max_lora_rank:
        raise ValueError(
            f"{where}: rank {rank} ({module_name}) is over max_lora_rank={max_lora_rank}"
        )
    a = a.to(dtype).contiguous()
    if not (torch.isfinite(a).all() and torch.isfinite(b.to(dtype)).all()):
        raise ValueError(f"{where}: {module_name} has NaN or infinite weights (in {dtype})")
    field, alpha = config.alpha(module_name)
    scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    return SliceLoRA(a, _fold(a, b, scaling, field, module_name, dtype, where))


def _fold(a, b, scaling: float, field: str, module_name: str, dtype, where: str) -> torch.Tensor:
    """B times the scaling, rounded once into the model's dtype; a ValueError naming `field`
    (lora_alpha or alpha_pattern) when that is not finite there, or when the update
    (x A^T) (s B)^T can multiply an input of size 1 past what the model's arithmetic after it
    survives (_max_gain): lora_alpha 1e30 in float32 folds to finite weights whose outputs
    made every token NaN."""
    scaled = (b.to(torch.float64) * scaling).to(dtype).contiguous()
    name = str(dtype).removeprefix("torch.")
    if not torch.isfinite(scaled).all():
        raise ValueError(
            f"{where}: {module_name}: lora_B times {field} / r ({scaling:.3g}) is not finite "
            f"in {name}"
        )
    # The largest |output| for inputs of size 1: ||s B||_inf * ||A||_inf (max row sums).
    gain = float(scaled.double().abs().sum(1).max() * a.double().abs().sum(1).max())
    limit = _max_gain(dtype, scaled.shape[0])
    if gain > limit:
        raise ValueError(
            f"{where}: {module_name}: its update lora_B @ lora_A * {field} / r ({scaling:.3g}) "
            f"multiplies an input of size 1 by up to {gain:.3g}, more than {name} activations "
            f"survive ({limit:.3g})"
        )
    return scaled


def _max_gain(dtype: torch.dtype, width: int) -> float:
    """The largest factor an update may scale an input of size 1 by: its output must be finite
    in dtype, and the squares that the norm and the attention after it sum over a row of
    `width` (in float32 or wider) must be finite too."""
    top = torch.finfo(dtype).max
    squares = max(top, torch.finfo(torch.float32).max)
    return min(top, math.sqrt(squares / width))


def _is_module_name(key: Any) -> bool:
    """Dotted words of ASCII letters, digits and underscores ('layers.0.mlp.down_proj')."""
    return isinstance(key, str) and all(
        part.isascii() and part.replace("_", "a").isalnum() for part in key.split(".")
    )


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def _shown(value: Any) -> str:
    """A config value for a message: a number or a short string as itself, else its JSON type."""
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.6g}" if isinstance(value, float) else str(value)[:40]
    if isinstance(value, str) and len(value) <= 64:
        return repr(value)
    return _JSON_TYPES.get(type(value), type(value).__name__)
