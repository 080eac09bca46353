"""`python -m benchmarks spec`: n-gram speculative decoding against none, side by side, in one run.

One `conveyor serve` child process per configuration: no speculation, then n-gram
speculation (prompt lookup) with each k in --num-speculative-tokens. On each server, in the
same order, every workload (spec-edit: answers that copy the prompt's code; spec-control:
answers with nothing to copy) at every concurrency: greedy, EOS ignored, exact output
lengths, token-id prompts to /v1/completions. Per run: output tok/s and its ratio to no
speculation at the same workload and concurrency, TPOT and ITL timed per streamed chunk as
`bench serve` does (a chunk may carry several accepted tokens, so ITL spreads while TPOT
falls), and the acceptance the server counted in /metrics over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

from conveyor.bench.datasets import SPEC_WORKLOADS, SampleRequest

GENERATED = "conveyor:generation_tokens_total"
SPEC_COUNTERS = {  # row key -> counter, summed over its labels (one model is served)
    "num_drafts": "conveyor:spec_decode_num_drafts_total",
    "num_draft_tokens": "conveyor:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "conveyor:spec_decode_num_accepted_tokens_total",
}
PERCENTILES = [50.0, 99.0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args, add_spec_workload_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--num-speculative-tokens",
        default="2,4,8",
        help="comma-separated k, tokens proposed per step; '' runs no speculation only",
    )
    parser.add_argument(
        "--fixed",
        action="store_true",
        help='also run each k with every draft verified every step ("adaptive": false, as '
        "vLLM does), next to the default adaptive policy",
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated, e.g. 1,8,32")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per run (default: max(12, 2 x concurrency); at one stream 4 requests of "
        "~0.6 s each gave one build 1.5-2.4x within a sitting on a noisy VM)",
    )
    add_spec_workload_args(parser)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot",
        default=None,
        help="write a PNG (speed-up vs concurrency) here (default with --save-result: "
        "next to the JSON)",
    )
    add_result_args(parser)


def check_args(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The grid (k values, concurrencies) from the flags; ValueError on a bad one."""
    ks = _int_list(args.num_speculative_tokens, "--num-speculative-tokens")
    concurrencies = _int_list(args.concurrency, "--concurrency")
    if any(k < 1 for k in ks):
        raise ValueError(f"--num-speculative-tokens: every k must be >= 1, got {ks}")
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise ValueError(f"--concurrency: give values >= 1, got {args.concurrency!r}")
    if args.prompt_lookup_min < 1:
        raise ValueError(f"--prompt-lookup-min must be >= 1, got {args.prompt_lookup_min}")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        raise ValueError(
            f"--prompt-lookup-min ({args.prompt_lookup_min}) must be <= --prompt-lookup-max "
            f"({args.prompt_lookup_max})"
        )
    for name in ("num_prompts", "spec_input_len", "spec_output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return ks, concurrencies


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


def main(args: argparse.Namespace) -> int:
    from benchmarks.split import Server, model_flags
    from conveyor.bench.serve import load_tokenizer
    from conveyor.config import resolve_model_path

    ks, concurrencies = check_args(args)
    model = str(resolve_model_path(args.model))
    tokenizer = load_tokenizer(args.model)
    num_prompts = [args.num_prompts or max(12, 2 * c) for c in concurrencies]
    lengths = (args.spec_input_len, args.spec_output_len)
    # Every server gets the same requests. Each run has prompts of its own, so that none is
    # in the prefix cache from an earlier run on the same server.
    workloads = {}
    for name, build in SPEC_WORKLOADS.items():
        requests = iter(build(tokenizer, sum(num_prompts), *lengths, seed=args.seed))
        workloads[name] = [list(itertools.islice(requests, n)) for n in num_prompts]
    # Another seed, so that the warm-up leaves no measured prompt in the prefix cache.
    warmup = SPEC_WORKLOADS["spec-edit"](tokenizer, 2, *lengths, seed=args.seed + 1)
    report = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model": model,
        "dtype": args.dtype,
        "device": args.device,
        "input_len": args.spec_input_len,
        "output_len": args.spec_output_len,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "num_speculative_tokens": ks,
        "concurrency": concurrencies,
        "rows": [],
    }
    configs = [(None, None)] + [(k, "adaptive") for k in ks]
    if args.fixed:
        configs += [(k, "fixed") for k in ks]
    report["policies"] = sorted({policy for _, policy in configs if policy})
    total = len(configs) * len(workloads) * len(concurrencies)
    for k, policy in configs:
        with Server(model_flags(args) + _spec_flags(args, k, policy)) as server:
            asyncio.run(_stream(server.base_url, warmup, 2, disable_tqdm=True))
            for workload, runs in workloads.items():
                for c, requests in zip(concurrencies, runs, strict=True):
                    row = {"workload": workload, "k": k, "policy": policy, "concurrency": c}
                    row |= _measure(server.base_url, requests, c, args)
                    report["rows"].append(row)
                    print(f"[{len(report['rows'])}/{total}] {_progress(row)}", flush=True)
    _add_speedups(report["rows"])
    print(format_report(report))
    for path in save(report, args):
        print(f"written: {path}")
    return 0


def _spec_flags(args: argparse.Namespace, k: int | None, policy: str | None) -> list[str]:
    if k is None:
        return []
    config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "adaptive": policy == "adaptive",
    }
    return ["--speculative-config", json.dumps(config)]


# ---- one run ------------------------------------------------------------------------------


def _measure(
    base_url: str, requests: list[SampleRequest], concurrency: int, args: argparse.Namespace
) -> dict:
    """Streams the requests at this concurrency; the row's measurements."""
    from conveyor.bench.serve import compute_metrics

    before = read_counters(base_url)
    results, duration = asyncio.run(_stream(base_url, requests, concurrency, args.disable_tqdm))
    m = compute_metrics(results, duration, PERCENTILES, {})
    after = _settled_counters(base_url, before, m.total_output)
    tpot, itl = m.summaries["tpot"], m.summaries["itl"]
    row = {
        "num_prompts": len(requests),
        "completed": m.completed,
        "failed": m.failed,
        "duration": duration,
        "total_output_tokens": m.total_output,
        "output_throughput": m.output_throughput,
        "median_tpot_ms": tpot.median_ms,
        "p99_tpot_ms": tpot.percentiles_ms[1][1],
        "median_itl_ms": itl.median_ms,
        "p99_itl_ms": itl.percentiles_ms[1][1],
        "median_ttft_ms": m.summaries["ttft"].median_ms,
    }
    for key, name in SPEC_COUNTERS.items():  # None: the server does not count it
        row[key] = int(after[name] - before[name]) if name in after and name in before else None
    return row | acceptance(row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"])


def acceptance(drafts: float | None, draft_tokens: float | None, accepted: float | None) -> dict:
    """Acceptance rate (accepted / proposed tokens) and mean accepted length (tokens per
    verification step: the accepted drafts plus the token the step samples itself); None
    where nothing was proposed (no speculation, or no n-gram matched)."""
    rate = accepted / draft_tokens if draft_tokens and accepted is not None else None
    length = 1 + accepted / drafts if drafts and accepted is not None else None
    return {"acceptance_rate": rate, "mean_accepted_length": length}


async def _stream(
    base_url: str, requests: list[SampleRequest], concurrency: int, disable_tqdm: bool
) -> tuple[list, float]:
    """Every request streamed at once behind a limit of `concurrency` open streams, timed per
    chunk by `bench serve`'s client."""
    from conveyor.bench.serve import (
        Target,
        _headers,
        build_payload,
        client_session,
        first_model,
        run_requests,
    )

    headers = _headers()
    async with client_session(concurrency) as client:
        model = await first_model(client, base_url, headers)
        target = Target(f"{base_url}/v1/completions", model, False, headers, True, 0.0)
        payloads = [build_payload(target, r, None) for r in requests]
        with tqdm(total=len(requests), disable=disable_tqdm, leave=False) as bar:
            return await run_requests(
                client,
                target,
                payloads,
                [r.prompt_len for r in requests],
                [0.0] * len(requests),
                concurrency,
                bar,
            )


def read_counters(base_url: str) -> dict[str, float]:
    """Every sample of the server's /metrics, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from conveyor.bench.serve import _headers

    response = httpx.get(f"{base_url}/metrics", headers=_headers(), timeout=30)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _settled_counters(
    base_url: str, before: dict[str, float], generated: int, timeout: float = 5.0
) -> dict[str, float]:
    """/metrics once it counts the run's generated tokens: the server updates its counters
    just after a step's outputs go to the streams, so the last step's may trail the last
    chunk the client read."""
    deadline = time.monotonic() + timeout
    while True:
        after = read_counters(base_url)
        grown = after.get(GENERATED, 0.0) - before.get(GENERATED, 0.0)
        if grown >= generated or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def _add_speedups(rows: list[dict]) -> None:
    """Each row's output tok/s over that of no speculation at its workload and concurrency."""
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["k"] is None}
    for row in rows:
        reference = base[row["workload"], row["concurrency"]]["output_throughput"]
        row["speedup"] = row["output_throughput"] / reference if reference else None


# ---- report -------------------------------------------------------------------------------

COLUMNS = (  # header, cell of a row
    ("workload", lambda r: r["workload"]),
    ("k", lambda r: _k(r)),
    ("concurrency", lambda r: str(r["concurrency"])),
    ("acceptance", lambda r: _number(r["acceptance_rate"], ".2f")),
    ("mean accepted len", lambda r: _number(r["mean_accepted_length"], ".2f")),
    ("output tok/s", lambda r: f"{r['output_throughput']:.1f}"),
    ("speed-up", lambda r: _number(r["speedup"], ".2f", "x")),
    # The prompt's prefill, which speculation cannot shorten: at one stream it bounds the
    # speed-up however cheap the drafts are (docs/benchmarks.md).
    ("TTFT p50 ms", lambda r: f"{r['median_ttft_ms']:.0f}"),
    ("TPOT p50 ms", lambda r: f"{r['median_tpot_ms']:.1f}"),
    ("ITL p50 ms", lambda r: f"{r['median_itl_ms']:.1f}"),
    ("ITL p99 ms", lambda r: f"{r['p99_itl_ms']:.1f}"),
)


def format_report(report: dict) -> str:
    lines = [
        "",
        f"model {report['model']} ({report['dtype']}, {report['device']}); about "
        f"{report['input_len']}-token prompts, {report['output_len']} output tokens, greedy, "
        f"EOS ignored; n-gram lookup {report['prompt_lookup_min']}-"
        f"{report['prompt_lookup_max']} tokens; speed-up: output tok/s over k=off's at the "
        "same workload and concurrency",
        "",
        "| " + " | ".join(header for header, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    rows = sorted(
        report["rows"],
        key=lambda r: (r["workload"], r["concurrency"], r["k"] or 0, r["policy"] or ""),
    )
    for row in rows:
        lines.append("| " + " | ".join(cell(row) for _, cell in COLUMNS) + " |")
    failed = sum(r["failed"] for r in rows)
    if failed:
        lines.append(f"warning: {failed} requests failed; their tokens are not counted")
    return "\n".join(lines)


def _progress(row: dict) -> str:
    k = "no speculation" if row["k"] is None else f"ngram k={_k(row)}"
    return (
        f"{k}, {row['workload']}, concurrency {row['concurrency']}: "
        f"{row['output_throughput']:.1f} output tok/s, TPOT p50 {row['median_tpot_ms']:.1f} ms, "
        f"acceptance {_number(row['acceptance_rate'], '.2f')}, mean accepted length "
        f"{_number(row['mean_accepted_length'], '.2f')}, {row['failed']} failed"
    )


def _k(row: dict) -> str:
    """off, k (the adaptive policy) or "k fixed" (every draft verified)."""
    if row["k"] is None:
        return "off"
    return f"{row['k']} fixed" if row["policy"] == "fixed" else str(row["k"])


def _number(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def save(report: dict, args: argparse.Namespace) -> list[Path]:
    """The JSON (with --save-result) and the plot (--plot, else next to the JSON)."""
    paths = []
    if args.save_result:
        name = args.result_filename or f"spec-{Path(report['model']).stem}-{report['date']}.json"
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        paths.append(path)
    plot = Path(args.plot) if args.plot else paths[0].with_suffix(".png") if paths else None
    if plot is not None:
        from benchmarks.plots import plot_spec

        paths.append(plot_spec(report, plot))
    return paths
