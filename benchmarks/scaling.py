"""`python -m benchmarks scaling`: the same workload against servers of several engine layouts, side
by side in one sitting: one engine against data-parallel replicas (`dpN`), one rank against
tensor-parallel ranks (`tpN`).

Each layout runs in its own `conveyor serve` child (started, warmed up, measured, stopped), in
alternating order over the rounds (A B C, then C B A, ...) so that the machine's drift cancels
out. Every run streams the same random prompts (vLLM's `random` dataset) at one concurrency,
greedy, EOS ignored. The report gives each layout's output tok/s, TPOT and TTFT, and its
ratio to the first layout of its kind (dp1 for dpN, tp1 for tpN). Tensor-parallel layouts
serve float weights (`--quantization none`), tp1 included, so that only the split differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

LAYOUT = re.compile(r"(dp|tp)([1-9][0-9]?)")
PERCENTILES = [50.0, 99.0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["dp1", "dp2"],
        help="dpN: N data-parallel replicas sharing the threads; tpN: the model split over N "
        "tensor-parallel ranks (float weights); e.g. dp1 dp2 tp1 tp2",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--random-input-len", type=int, default=200)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each layout, alternating")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads of each server, in all"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_result_args(parser)


def parse_layouts(names: list[str]) -> list[tuple[str, int]]:
    layouts = []
    for name in names:
        match = LAYOUT.fullmatch(name)
        if match is None:
            raise ValueError(f"--layouts: {name!r} is not dpN or tpN (N from 1 to 99)")
        layouts.append((match[1], int(match[2])))
    if len(set(layouts)) < len(layouts):
        raise ValueError(f"--layouts: {' '.join(names)} names a layout twice")
    return layouts


def run_order(count: int, rounds: int) -> list[int]:
    """Layout indices over the rounds, every other round reversed: 0 1 2 2 1 0 0 1 2 ..."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    order = []
    for r in range(rounds):
        indices = list(range(count))
        order += indices if r % 2 == 0 else indices[::-1]
    return order


def serve_flags(args: argparse.Namespace, kind: str, size: int) -> list[str]:
    from benchmarks.split import model_flags

    flags = model_flags(args)
    if kind == "dp":
        return flags + ["--data-parallel-size", str(size)]
    return flags + ["--tensor-parallel-size", str(size), "--quantization", "none"]


def main(args: argparse.Namespace) -> int:
    from benchmarks.split import Server
    from conveyor.bench.datasets import random_requests
    from conveyor.bench.serve import load_tokenizer
    from conveyor.distributed.parallel import check_tensor_parallel
    from conveyor.model.config import ModelConfig

    layouts = parse_layouts(args.layouts)
    order = run_order(len(layouts), args.rounds)
    config = ModelConfig.from_hf(args.model)
    for kind, size in layouts:  # refused before any server starts
        if kind == "tp":
            check_tensor_parallel(config, size)
    tokenizer = load_tokenizer(args.model)
    lengths = (args.random_input_len, args.random_output_len)
    warmup = random_requests(tokenizer, 2, args.random_input_len, 16, 0.0, args.seed + 100_000)
    report = report_header(args, config) | {
        "order": [f"{layouts[i][0]}{layouts[i][1]}" for i in order],
        "runs": [],
    }
    for step, index in enumerate(order, 1):
        kind, size = layouts[index]
        # Each run has prompts of its own (of the same lengths): no prefix-cache hits.
        batch = random_requests(tokenizer, args.num_prompts, *lengths, 0.0, args.seed + step)
        with Server(serve_flags(args, kind, size)) as server:
            asyncio.run(_stream(server.base_url, warmup, 2, tokenizer))
            run = {"layout": f"{kind}{size}"} | measure(
                server.base_url, batch, args.max_concurrency, tokenizer
            )
        report["runs"].append(run)
        print(f"[{step}/{len(order)}] {progress(run)}", flush=True)
    report["summary"] = summarize(report["runs"], [f"{k}{n}" for k, n in layouts])
    print(format_report(report))
    save_report(report, args, "scaling")
    return 0


def save_report(report: dict, args: argparse.Namespace, kind: str) -> None:
    """With --save-result: the report as JSON, named --result-filename or KIND-MODEL-DATE."""
    if not args.save_result:
        return
    name = args.result_filename or f"{kind}-{Path(report['model']).stem}-{report['date']}"
    path = Path(args.result_dir or ".") / (name if name.endswith(".json") else name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"written: {path}")


def report_header(args: argparse.Namespace, config) -> dict:
    """What a side-by-side server benchmark ran: when, which model, which workload."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model": str(config.path),
        "dtype": args.dtype,
        "device": args.device,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "input_len": args.random_input_len,
        "output_len": args.random_output_len,
    }


async def _stream(base_url: str, requests, concurrency: int, tokenizer):
    from benchmarks.structured import stream

    return await stream(base_url, "/v1/completions", requests, concurrency, tokenizer, None, True)


def measure(base_url: str, requests, concurrency: int, tokenizer) -> dict:
    """Streams the requests (greedy, EOS ignored) and returns what a side-by-side report
    shows of them (also `benchmarks peers`')."""
    from conveyor.bench.serve import compute_metrics

    results, duration = asyncio.run(_stream(base_url, requests, concurrency, tokenizer))
    m = compute_metrics(results, duration, PERCENTILES, {})
    return {
        "concurrency": concurrency,
        "completed": m.completed,
        "failed": m.failed,
        "duration": duration,
        "total_output_tokens": m.total_output,
        "output_throughput": m.output_throughput,
        "median_tpot_ms": m.summaries["tpot"].median_ms,
        "median_ttft_ms": m.summaries["ttft"].median_ms,
        "mean_ttft_ms": m.summaries["ttft"].mean_ms,
        "p99_itl_ms": dict(m.summaries["itl"].percentiles_ms).get(99.0),
        "errors": [r.error for r in results if r.error][:5],
    }


def summarize(runs: list[dict], layouts: list[str], baseline=None) -> list[dict]:
    """Per layout: the mean over its runs, and its ratio to its baseline: `baseline(layout)`,
    by default the first layout of its kind (dp1 for dpN, tp1 for tpN)."""
    rows = []
    for layout in layouts:
        mine = [r for r in runs if r["layout"] == layout]
        rows.append(
            {
                "layout": layout,
                "runs": len(mine),
                "failed": sum(r["failed"] for r in mine),
                "output_throughput": statistics.fmean(r["output_throughput"] for r in mine),
                "each": [round(r["output_throughput"], 1) for r in mine],
                "median_tpot_ms": statistics.fmean(r["median_tpot_ms"] or 0 for r in mine),
                "median_ttft_ms": statistics.fmean(r["median_ttft_ms"] or 0 for r in mine),
            }
        )
    for row in rows:
        if baseline is None:
            base = next(r for r in rows if r["layout"][:2] == row["layout"][:2])
        else:
            base = next(r for r in rows if r["layout"] == baseline(row["layout"]))
        row["baseline"] = base["layout"]
        row["ratio"] = row["output_throughput"] / base["output_throughput"]
    return rows


def progress(run: dict) -> str:
    return (
        f"{run['layout']}: {run['output_throughput']:.1f} output tok/s, TPOT p50 "
        f"{run['median_tpot_ms'] or 0:.0f} ms, {run['completed']} done, {run['failed']} failed"
    )


def format_report(report: dict) -> str:
    lines = [
        f"\n{report['num_prompts']} prompts of {report['input_len']} tokens -> "
        f"{report['output_len']} tokens at {report['max_concurrency']} streams; "
        f"run order {' '.join(report['order'])}",
        f"{'layout':<8}{'output tok/s':>14}{'ratio':>12}{'TPOT p50':>11}{'TTFT p50':>11}"
        f"{'failed':>8}  runs",
    ]
    for row in report["summary"]:
        ratio = f"{row['ratio']:.2f}x {row['baseline']}"
        lines.append(
            f"{row['layout']:<8}{row['output_throughput']:>14.1f}{ratio:>12}"
            f"{row['median_tpot_ms']:>9.0f}ms{row['median_ttft_ms']:>9.0f}ms{row['failed']:>8}"
            f"  {row['each']}"
        )
    return "\n".join(lines)
