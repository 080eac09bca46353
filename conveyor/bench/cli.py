"""`conveyor bench serve | throughput | compare | step | quality | split | spec | structured |
scaling | dashboard | storm`: the commands.

Flag names follow `vllm bench serve` / `vllm bench throughput`, so a command line written for
one runs against the other (the shared flags are in bench/args.py). Each command's module is
imported only when its command runs or its parser is built.
"""

from __future__ import annotations

import argparse

from conveyor.bench.args import add_serve_args, add_throughput_args


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine (throughput)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server, seen by a client"
    )
    add_serve_args(serve)
    serve.set_defaults(func=_run_serve)
    throughput = bench_sub.add_parser("throughput", help="offline throughput of LLM.generate")
    add_throughput_args(throughput)
    throughput.set_defaults(func=_run_throughput)
    from conveyor.bench import (
        compare,
        dashboard,
        quality,
        scaling,
        spec,
        split,
        step,
        storm,
        structured,
    )

    commands = [
        (compare, "continuous vs static batching vs transformers generate, swept over request "
         "rates"),
        (step, "one model step (decode batches, prefill chunks) against its measured floor"),
        (quality, "KL divergence, top-1 agreement and perplexity of quantized vs float32"),
        (split, "the engine-core process vs the engine on a thread vs offline: throughput, "
         "/health latency, engine time per step"),
        (spec, "n-gram speculative decoding vs none on code editing and a control: acceptance, "
         "throughput, TPOT and ITL over a grid of k and concurrency"),
        (structured, "the json-schema workload with 0%%, 50%% and 100%% of requests "
         "constrained, side by side: output tok/s, TPOT, validity, and the grammar mask's cost "
         "per step"),
        (scaling, "one engine vs data-parallel replicas vs tensor-parallel ranks, side by side"),
        (dashboard, "what watching /dashboard costs: served with it watched vs --no-dashboard, "
         "side by side"),
        (storm, "many short streams opened at once against a running server, some cut after "
         "the first chunk: errors, requests left running, /health latency meanwhile"),
    ]  # fmt: skip
    for module, text in commands:
        parser = bench_sub.add_parser(module.__name__.rsplit(".", 1)[-1], help=text)
        module.add_arguments(parser)
        parser.set_defaults(func=module.main)


def _run_serve(args: argparse.Namespace) -> int:
    from conveyor.bench.serve import main

    return main(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from conveyor.bench.throughput import main

    return main(args)
