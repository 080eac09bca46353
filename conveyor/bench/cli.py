"""`conveyor bench serve | throughput | compare | step`: argument parsing, shared workload flags.

Flag names follow `vllm bench serve` / `vllm bench throughput`, so a command line written for
one runs against the other. serve and throughput are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import math

from conveyor.entrypoints.args import add_engine_args

DATASETS = ("random", "prefix-repetition", "sharegpt")


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
    from conveyor.bench import compare, quality, split, step

    parser = bench_sub.add_parser(
        "compare",
        help="continuous vs static batching vs transformers generate, swept over request rates",
    )
    compare.add_arguments(parser)
    parser.set_defaults(func=compare.main)
    parser = bench_sub.add_parser(
        "step", help="one model step (decode batches, prefill chunks) against its measured floor"
    )
    step.add_arguments(parser)
    parser.set_defaults(func=step.main)
    parser = bench_sub.add_parser(
        "quality", help="KL divergence, top-1 agreement and perplexity of quantized vs float32"
    )
    quality.add_arguments(parser)
    parser.set_defaults(func=quality.main)
    parser = bench_sub.add_parser(
        "split",
        help="the engine-core process vs the engine on a thread vs offline: throughput, "
        "/health latency, engine time per step",
    )
    split.add_arguments(parser)
    parser.set_defaults(func=split.main)


def _run_serve(args: argparse.Namespace) -> int:
    from conveyor.bench.serve import main

    return main(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from conveyor.bench.throughput import main

    return main(args)


def add_dataset_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    parser.add_argument("--dataset-name", default="random", choices=DATASETS)
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length for every sharegpt request (default: the reply's)",
    )
    if with_seed:
        parser.add_argument("--seed", type=int, default=0)


def add_result_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-dir", default=None, help="folder of the JSON file (default: .)")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    parser.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    parser.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions (token-id prompts) or /v1/chat/completions (text)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model name sent to the server (default: the first of /v1/models)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf file (default: --model if it is a local path, "
        "else conveyor's default model)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (default inf: all sent at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival times; 1 is a Poisson process",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:3000",
    )
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated, from ttft,tpot,itl,e2el",
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99"
    )
    add_result_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # it brings --seed, which the workload uses too
    add_dataset_args(parser, with_seed=False)
    add_result_args(parser)
