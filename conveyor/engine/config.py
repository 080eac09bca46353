"""EngineArgs resolved against the checkpoint and the device: the frozen sub-configs the engine
core hands out, each component taking only its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from conveyor.engine_args import EngineArgs
from conveyor.model.config import ModelConfig, check_tokenizer

if TYPE_CHECKING:  # imported where an engine is built: resolve_model_config runs without it in
    import torch  # the server's front end (engine/core_proc.py)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None
    device: torch.device
    tensor_parallel_size: int
    num_threads: int | None  # this rank's CPU threads; None: torch's default
    seed: int
    grammar_compile_timeout: float
    skip_tokenizer_init: bool
    record_trace: bool
    lora_config: LoRAConfig | None = None  # LoRA on (enable_lora)
    enforce_eager: bool = False  # no CUDA graphs (worker/cuda_graphs.py)
    adaptive_threads: bool = True  # engine/threads.py
    kernel_isa: str | None = None  # the plan's ISA cap (model/plan.py); None: $CONVEYOR_ISA
    download_dir: str | None = None  # where Hub ids are read from: the draft model's too

    @classmethod
    def resolve(cls, args: EngineArgs, model_config: ModelConfig | None = None) -> EngineConfig:
        """Reads the checkpoint's config; raises ValueError for a model, device or split that
        cannot serve. With tensor parallelism, the ranks share num_threads (default: the
        physical cores) evenly. model_config: resolve_model_config(args), when the caller
        has it already (an engine-core process gets it from its front end)."""
        import torch

        from conveyor.distributed.parallel import check_tensor_parallel

        device = resolve_device(args.device)
        tp_size = args.tensor_parallel_size
        num_threads = args.num_threads
        if tp_size > 1 and device.type == "cpu":
            num_threads = max(1, (num_threads or torch.get_num_threads()) // tp_size)
        if model_config is None:
            model_config = resolve_model_config(args)
        model_config = model_config.with_kernels_checked()
        if not args.skip_tokenizer_init:
            check_tokenizer(model_config)
        check_tensor_parallel(model_config, tp_size)
        lora_config = args.lora_config()
        refused = _lora_refusal(model_config.parts)
        if lora_config is not None and refused:
            raise ValueError(f"enable_lora: LoRA adapters on {refused}")
        scheduler_config, enforce_eager = args.scheduler_config(), args.enforce_eager
        cache_config = args.cache_config()
        if model_config.is_encoder:
            scheduler_config = _encoder_scheduling(args, model_config, scheduler_config)
            enforce_eager = True  # no decode steps to replay
        if model_config.parts.recurrent:
            cache_config = _hybrid_cache(args, cache_config)
            enforce_eager = True  # the recurrent layers' per-sequence loops: no graphs to replay
        spec = args.speculative_config
        if spec is not None and spec.method == "mtp":
            from conveyor.model.mtp import with_mtp

            model_config = with_mtp(model_config, spec.model)
            enforce_eager = True  # it reads every step's hidden states: no graphs to replay
            if tp_size > 1:
                raise ValueError("speculative_config: method 'mtp' with tensor parallelism")
        return cls(
            model_config,
            cache_config,
            scheduler_config,
            args.speculative_config,
            device,
            tp_size,
            num_threads,
            args.seed,
            args.grammar_compile_timeout,
            args.skip_tokenizer_init,
            args.record_trace,
            lora_config,
            enforce_eager,
            args.adaptive_threads,
            args.kernel_isa,
            args.download_dir,
        )


def _lora_refusal(parts) -> str | None:
    """What a model's layers are that LoRA adapters cannot go on, and why; None: they can."""
    if parts.mla:
        return (
            "multi-head latent attention (DeepSeek's) are not supported (its latent "
            "projections have no adapter slots)"
        )
    if parts.family == "gemma4":
        return (
            "Gemma 4 are not supported (its layers' heads differ in size and its shared-cache "
            "layers have no key or value projection)"
        )
    if parts.family == "gemma3n":
        return (
            "Gemma 3n are not supported (its layers run on AltUp's streams and its shared-cache "
            "layers have no key or value projection)"
        )
    if any(parts.moe_layers):
        return (
            "a mixture-of-experts model are not supported (its experts' projections have no "
            "adapter slots)"
        )
    if parts.act == "relu2":
        return (
            "an ungated MLP (Arcee's relu^2) are not supported (the adapter slots hold a gate "
            "and an up projection)"
        )
    return None


def _hybrid_cache(args: EngineArgs, cache: CacheConfig) -> CacheConfig:
    """A hybrid model's (recurrent layers, model/recurrent.py) cache: a prefix-cache hit
    continues from a snapshot of the recurrent state at its end (core/state_snapshots.py);
    rejected drafts are taken back by the state kept after the accepted ones
    (ScheduledRequest.draft_state_slots). --mamba-cache-mode none: no snapshots, prefix caching
    off. Adapters and tensor parallelism are refused."""
    if args.mamba_cache_mode == "none":
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if args.enable_lora:
        raise ValueError("enable_lora: a hybrid model's recurrent layers have no adapter slots")
    if args.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 is not supported for a hybrid model")
    return cache


def _encoder_scheduling(
    args: EngineArgs, model: ModelConfig, config: SchedulerConfig
) -> SchedulerConfig:
    """An encoder's sequences run whole (bidirectional attention; model/bert.py): no chunked
    prefill, and a step budget that takes the longest one; no drafts, no adapters."""
    if args.speculative_config is not None:
        raise ValueError("an encoder (BERT family) generates no tokens: no speculative decoding")
    if args.enable_lora:
        raise ValueError("enable_lora: an encoder (BERT family) has no adapter slots")
    budget = config.max_num_batched_tokens
    if args.max_num_batched_tokens is not None and budget < model.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens {budget} < max_model_len {model.max_model_len}: an "
            "encoder's sequence runs whole in one step"
        )
    return dataclasses.replace(
        config,
        max_num_batched_tokens=max(budget, model.max_model_len),
        enable_chunked_prefill=False,
        base_batched_tokens=None,
        long_prefill_token_threshold=0,
        max_step_ms=None,
    )


def resolve_model_config(args: EngineArgs) -> ModelConfig:
    """The checkpoint's ModelConfig for these settings. With tensor parallelism, quantization
    "auto" dequantizes (blocks do not split)."""
    tp_size = args.tensor_parallel_size
    quantization = "none" if tp_size > 1 and args.quantization == "auto" else args.quantization
    return ModelConfig.from_hf(
        args.model,
        args.dtype,
        str(args.device).partition(":")[0],  # EngineArgs checked it: cpu or cuda
        args.max_model_len,
        quantization,
        args.tokenizer,
        args.batch_invariant,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        download_dir=args.download_dir,
        load_format=args.load_format,
        hf_overrides=args.hf_overrides,
        disable_sliding_window=args.disable_sliding_window,
    )


def resolve_device(device: str | torch.device) -> torch.device:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return dev
