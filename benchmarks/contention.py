"""`python -m benchmarks contention`: the server next to another busy program, side by side.

One sitting: for each thread policy (`fixed`: --no-adaptive-threads, the engine keeps all its
threads; `adaptive`: the default, engine/threads.py) and each neighbour (`quiet`, or `busy`:
--busy-threads processes that spin at the same priority for the whole run, a fair share then
leaving the server about half of a 2-core machine), a server of the model streams the same
random prompts at each --concurrency, greedy, EOS ignored. Policies alternate over the rounds
(fixed adaptive adaptive fixed ...). The report gives each one's output tok/s and mean TTFT,
and each busy figure as a share of the same policy's quiet one and of fixed-quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

POLICIES = ["fixed", "adaptive"]
NEIGHBOURS = ["quiet", "busy"]
SPIN = "while True: pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16, help="per concurrency")
    parser.add_argument("--random-input-len", type=int, default=200)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--busy-threads", type=int, default=2, help="spinning processes")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each policy, alternating")
    parser.add_argument("--num-threads", type=int, default=None, help="the server's full count")
    parser.add_argument("--seed", type=int, default=0)
    add_result_args(parser)


class Neighbours:
    """`count` processes that spin at the same priority until stopped."""

    def __init__(self, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main(args: argparse.Namespace) -> int:
    from benchmarks.scaling import _stream, measure, report_header, run_order, save_report
    from benchmarks.split import Server, model_flags
    from conveyor.bench.datasets import random_requests
    from conveyor.bench.serve import load_tokenizer
    from conveyor.model.config import ModelConfig

    config = ModelConfig.from_hf(args.model)
    tokenizer = load_tokenizer(args.model)
    lengths = (args.random_input_len, args.random_output_len)
    warmup = random_requests(tokenizer, 2, args.random_input_len, 16, 0.0, args.seed + 100_000)
    args.max_concurrency = max(args.concurrency)  # for report_header
    report = report_header(args, config) | {"busy_threads": args.busy_threads, "runs": []}
    order = [POLICIES[i] for i in run_order(len(POLICIES), args.rounds)]
    for step, policy in enumerate(order, 1):
        flags = model_flags(args) + ([] if policy == "adaptive" else ["--no-adaptive-threads"])
        with Server(flags) as server:
            asyncio.run(_stream(server.base_url, warmup, 2, tokenizer))
            for neighbour in NEIGHBOURS:
                for concurrency in args.concurrency:
                    # Prompts of their own per run: a busy run must not hit the quiet one's
                    # prefix cache.
                    seed = args.seed + concurrency + (1000 if neighbour == "busy" else 0)
                    batch = random_requests(tokenizer, args.num_prompts, *lengths, 0.0, seed)
                    busy = Neighbours(args.busy_threads if neighbour == "busy" else 0)
                    try:
                        run = measure(server.base_url, batch, concurrency, tokenizer)
                    finally:
                        busy.stop()
                    run |= {"policy": policy, "neighbour": neighbour}
                    report["runs"].append(run)
                    print(f"[{step}/{len(order)}] {_line(run)}", flush=True)
    report["summary"] = summarize(report["runs"], args.concurrency)
    print(format_report(report))
    save_report(report, args, "contention")
    return 0


def _line(run: dict) -> str:
    return (
        f"{run['policy']:8} {run['neighbour']:5} x{run['concurrency']}: "
        f"{run['output_throughput']:.1f} tok/s, mean TTFT {run['mean_ttft_ms'] / 1e3:.2f} s"
        + (f", {run['failed']} failed" if run["failed"] else "")
    )


def summarize(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Per policy, neighbour and concurrency: the best round's tok/s and its mean TTFT; busy
    rows also as a share of their own policy's quiet tok/s and of fixed-quiet's."""
    best: dict[tuple, dict] = {}
    for run in runs:
        key = (run["policy"], run["neighbour"], run["concurrency"])
        if key not in best or run["output_throughput"] > best[key]["output_throughput"]:
            best[key] = run
    rows = []
    for policy in POLICIES:
        for neighbour in NEIGHBOURS:
            for concurrency in concurrencies:
                run = best.get((policy, neighbour, concurrency))
                if run is None:
                    continue
                quiet = best.get((policy, "quiet", concurrency), run)["output_throughput"]
                base = best.get(("fixed", "quiet", concurrency), run)["output_throughput"]
                tok = run["output_throughput"]
                rows.append(
                    {
                        "policy": policy,
                        "neighbour": neighbour,
                        "concurrency": concurrency,
                        "output_throughput": tok,
                        "mean_ttft_s": run["mean_ttft_ms"] / 1e3,
                        "of_own_quiet": tok / quiet if quiet else None,
                        "of_fixed_quiet": tok / base if base else None,
                    }
                )
    return rows


def format_report(report: dict) -> str:
    lines = [
        f"model {Path(report['model']).name}, {report['busy_threads']} busy neighbour "
        "processes when busy; best of the rounds",
        "policy   neighbour  streams  output tok/s  mean TTFT s  x own quiet  x fixed quiet",
    ]
    for row in report["summary"]:
        lines.append(
            f"{row['policy']:8} {row['neighbour']:9} {row['concurrency']:7d}  "
            f"{row['output_throughput']:12.1f}  {row['mean_ttft_s']:11.2f}  "
            f"{row['of_own_quiet']:11.2f}  {row['of_fixed_quiet']:13.2f}"
        )
    return "\n".join(lines)
