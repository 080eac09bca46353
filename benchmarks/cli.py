"""`python -m benchmarks compare | step | quality | split | spec | mtp | structured | scaling |
peers | dashboard | storm | contention | fuzz |
families | moe | kernels | attention | quant-kernels | start`: the lab's commands.

The flags they share with `conveyor bench serve | throughput` and `conveyor serve` come from
conveyor.bench.args and conveyor.entrypoints.args. Each command's module is imported when the
parser is built (its add_arguments) and runs its main(args).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module in benchmarks/, help)
COMMANDS = [
    ("compare", "compare", "continuous vs static batching vs transformers generate, swept over "
     "request rates"),
    ("step", "step", "one model step (decode batches, prefill chunks) against its measured "
     "floor"),
    ("quality", "quality", "KL divergence, top-1 agreement and perplexity of quantized vs "
     "float32"),
    ("split", "split", "the engine-core process vs the engine on a thread vs offline: "
     "throughput, /health latency, engine time per step"),
    ("spec", "spec", "n-gram speculative decoding vs none on code editing and a control: "
     "acceptance, throughput, TPOT and ITL over a grid of k and concurrency"),
    ("mtp", "mtp", "a Qwen3.5 model's multi-token prediction layer proposing drafts vs none: "
     "a layer whose drafts are all right and a random one bound what it buys and costs"),
    ("structured", "structured", "the json-schema workload with 0%%, 50%% and 100%% of "
     "requests constrained, side by side: output tok/s, TPOT, validity, and the grammar "
     "mask's cost per step"),
    ("scaling", "scaling", "one engine vs data-parallel replicas vs tensor-parallel ranks, "
     "side by side"),
    ("peers", "peers", "conveyor against vLLM's CPU backend and llama-server, one server at "
     "a time in one sitting, the same prompts: tok/s, TTFT, p99 ITL and ratios"),
    ("dashboard", "dashboard", "what watching /dashboard costs: served with it watched vs "
     "--no-dashboard, side by side"),
    ("storm", "storm", "many short streams opened at once against a running server, some cut "
     "after the first chunk: errors, requests left running, /health latency meanwhile"),
    ("contention", "contention", "the server next to other busy processes: output tok/s and "
     "TTFT quiet and busy, all threads kept vs the adaptive thread count"),
    ("fuzz", "fuzz", "random hostile requests against every route of a running server: 5xx, "
     "dropped connections, unterminated streams, engine deaths"),
    ("families", "families", "each family's step time against Llama of the same shape, per "
     "parameter, and a sliding window's peak KV blocks against full attention"),
    ("moe", "moe", "a mixture-of-experts decode step against a dense model of the same active "
     "parameters at 1, 8 and 64 rows, and the expert bytes a one-row step reads"),
    ("kernels", "kernels", "ModelRunner.execute per attention path (PyTorch reference vs "
     "compiled kernels) on synthetic decode and prefill steps"),
    ("attention", "attention", "the decode attention op alone: us per layer by rows, context "
     "and KV dtype, against another build of the kernels, alternated, bits compared"),
    ("quant-kernels", "quant_kernels", "ms per call of each quantized-matmul candidate for "
     "SmolLM2-135M's shapes"),
    ("start", "start", "a conveyor serve start, this tree against another git revision, "
     "alternated: seconds to /health and CPU seconds of its processes"),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The experiment lab, run from a clone of the repository (pip install -e "
        "'.[benchmarks]'). The server's own benchmarks are `conveyor bench serve | throughput`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, module_name, text in COMMANDS:
        module = importlib.import_module(f"benchmarks.{module_name}")
        command_parser = sub.add_parser(command, help=text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"python -m benchmarks: error: {error}", file=sys.stderr)
        return 2
