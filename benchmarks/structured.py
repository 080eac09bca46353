"""`python -m benchmarks structured`: the json-schema workload with 0%, 50% and 100% of its requests
constrained to their schema, side by side in one run.

One `conveyor serve` child process (or the server at --base-url) serves every run: per round,
each share of constrained requests in turn, in alternating order (0, 0.5, 1, then 1, 0.5, 0),
since this machine's speed drifts 15-20% within minutes: ratios measured next to each other,
in both orders, compare fairly where runs minutes apart would not. Each run has prompts of its
own, drawn from the same tasks, so that none is in the prefix cache from an earlier run; a
warm-up first compiles every schema (a server compiles a schema once and caches it).

Per ratio: output tok/s (the mean over rounds) and its ratio to the unconstrained run's, TPOT
p50 and p99 over every round's requests, validity (constrained outputs that parse and fit
their schema; a failed or cut-short one does not) and mean output tokens. A constrained
answer ends when its JSON is complete and a free one when the model stops, so the two differ
in length: mean output tokens shows by how much. A small model left free rambles on (a ```json
fence, then more records) while a constrained one stops at its closing brace, so the 100% run
does more prefill per output token and its tok/s falls for that reason alone. Hence a control
run right after each 100% run: the same prompts unconstrained, each generating exactly as many
tokens as its constrained run did (EOS ignored; the first prompt token altered so the prefix
cache cannot serve it). 100% constrained over that control is the cost of the constraint on
equal work, and the target is judged on it.

And in process, before the server starts: what the grammar mask costs one step, for 1, 8 and
32 constrained rows mid-way through a JSON record (conveyor.structured.grammar.step_mask,
then apply_bitmask on float32 logits as wide as the model's vocabulary), the median of many
repeats. The target (the issue's): 100% constrained at >= 0.9x the unconstrained output tok/s,
every constrained output valid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from conveyor.bench.datasets import JSON_TASKS, SampleRequest, json_schema_requests

PERCENTILES = [50.0, 99.0]
TARGET_SPEED = 0.9  # 100% constrained vs unconstrained output tok/s
WARMUP_OUTPUT_LEN = 16
MATCHED = "matched"  # the structured_ratio of a control run (see the module's docstring)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args, add_structured_workload_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--base-url",
        default=None,
        help="measure the server already running here instead of starting one (MODEL, a "
        "local path, then only gives the tokenizer and the vocabulary width)",
    )
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions (templated token-id prompts) or /v1/chat/completions (text)",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="open streams")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="requests per run (default: 2 x concurrency)"
    )
    parser.add_argument(
        "--structured-ratios",
        default="0,0.5,1",
        help="comma-separated shares of constrained requests, each in [0, 1]",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of every ratio, in alternating order (0,0.5,1 then 1,0.5,0)",
    )
    add_structured_workload_args(parser)
    parser.add_argument(
        "--mask-rows",
        default="1,8,32",
        help="comma-separated constrained rows per step to time the grammar mask at",
    )
    parser.add_argument(
        "--mask-repeats", type=int, default=200, help="timed steps per row count (median)"
    )
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot",
        default=None,
        help="write a PNG (output tok/s per ratio, mask cost) here (default with "
        "--save-result: next to the JSON)",
    )
    add_result_args(parser)


def check_args(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """The ratios and mask row counts from the flags; ValueError on a bad flag."""
    try:
        ratios = [float(v) for v in args.structured_ratios.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--structured-ratios: {args.structured_ratios!r} is not a comma-separated list "
            "of numbers"
        ) from None
    if not ratios or not all(0 <= r <= 1 for r in ratios) or len(set(ratios)) < len(ratios):
        raise ValueError(
            f"--structured-ratios: give distinct values in [0, 1], got {args.structured_ratios!r}"
        )
    try:
        rows = [int(v) for v in args.mask_rows.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--mask-rows: {args.mask_rows!r} is not a list of integers") from None
    if not rows or any(n < 1 for n in rows):
        raise ValueError(f"--mask-rows: give values >= 1, got {args.mask_rows!r}")
    for name in ("concurrency", "num_prompts", "rounds", "structured_output_len", "mask_repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise ValueError(
            f"--endpoint must be /v1/completions or /v1/chat/completions, got {args.endpoint!r}"
        )
    return ratios, rows


def run_order(ratios: list[float], rounds: int) -> list[tuple[int, float]]:
    """(round, ratio) of each run: the ratios in order, then reversed, and so on, so that
    over two rounds every ratio is as often early as late while the machine drifts."""
    return [(r, ratio) for r in range(rounds) for ratio in (ratios if r % 2 == 0 else ratios[::-1])]


def main(args: argparse.Namespace) -> int:
    from conveyor.bench.serve import load_tokenizer

    ratios, mask_rows = check_args(args)
    tokenizer = load_tokenizer(args.model)
    vocab_size, eos_ids, model = _model_info(args.model)
    num = args.num_prompts or 2 * args.concurrency
    order = run_order(ratios, args.rounds)
    report = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model": model,
        "dtype": args.dtype,
        "device": args.device,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "concurrency": args.concurrency,
        "num_prompts": num,
        "rounds": args.rounds,
        "structured_ratios": ratios,
        "output_len": args.structured_output_len,
        "vocab_size": vocab_size,
        "mask_repeats": args.mask_repeats,
    }
    # Measured first, while nothing else runs on the machine.
    report["mask"] = measure_mask(
        tokenizer, vocab_size, eos_ids, mask_rows, args.mask_repeats, args.device
    )
    print(format_mask(report), flush=True)
    # Another seed, so that the warm-up leaves no measured prompt in the prefix cache; half
    # constrained, so that it compiles every schema and runs the free path too.
    warmup = json_schema_requests(
        tokenizer, 2 * len(JSON_TASKS), WARMUP_OUTPUT_LEN, 0.5, seed=args.seed + len(order)
    )
    report["runs"] = []
    total = (len(order) + args.rounds * (1 in ratios)) * num
    with _server(args) as base_url, tqdm(total=total, disable=args.disable_tqdm) as bar:
        asyncio.run(stream(base_url, args.endpoint, warmup, len(warmup), tokenizer))
        for i, (round_index, ratio) in enumerate(order):
            # Each run its own prompts: the seed differs, the mix of tasks does not.
            requests = json_schema_requests(
                tokenizer, num, args.structured_output_len, ratio, seed=args.seed + i
            )
            bar.set_description(f"{ratio:.0%} constrained, round {round_index + 1}")
            run = {"round": round_index, "structured_ratio": ratio}
            run |= measure(base_url, args, requests, tokenizer, bar)
            report["runs"].append(run)
            tqdm.write(f"[{i + 1}/{len(order)}] {_progress(run)}")
            if ratio == 1:  # its control: the same prompts and lengths, unconstrained
                bar.set_description(f"matched control, round {round_index + 1}")
                control = matched_control(requests, run["output_lens"])
                row = {"round": round_index, "structured_ratio": MATCHED}
                row |= measure(base_url, args, control, tokenizer, bar, ignore_eos=True)
                report["runs"].append(row)
                tqdm.write(f"[{i + 1}/{len(order)}] {_progress(row)}")
    report["ratios"] = summarize_ratios(report["runs"], ratios)
    report["verdict"] = verdict(report["ratios"])
    print(format_report(report))
    for path in save(report, args):
        print(f"written: {path}")
    return 0


def _model_info(model: str | None) -> tuple[int, list[int], str]:
    """(the width of the model's logits, its EOS ids, its path) from its config."""
    from conveyor.model.config import ModelConfig

    config = ModelConfig.from_hf(model)
    return config.vocab_size, sorted(config.eos_token_ids), str(config.path)


@contextlib.contextmanager
def _server(args: argparse.Namespace):
    """The base URL: --base-url's, or a `conveyor serve` child's for the model flags."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    from benchmarks.split import Server, model_flags

    with Server(model_flags(args)) as server:
        yield server.base_url


# ---- one run ------------------------------------------------------------------------------


def measure(
    base_url: str,
    args: argparse.Namespace,
    requests: list[SampleRequest],
    tokenizer,
    bar: tqdm | None = None,
    ignore_eos: bool = False,
) -> dict:
    """Streams the requests at --concurrency; the run's measurements."""
    from conveyor.bench.serve import check_outputs, compute_metrics, structured_dict

    results, duration = asyncio.run(
        stream(base_url, args.endpoint, requests, args.concurrency, tokenizer, bar, ignore_eos)
    )
    m = compute_metrics(results, duration, PERCENTILES, {})
    tpot = m.summaries["tpot"]
    row = {
        "num_prompts": len(requests),
        "completed": m.completed,
        "failed": m.failed,
        "duration": duration,
        "total_output_tokens": m.total_output,
        "output_throughput": m.output_throughput,
        "median_tpot_ms": tpot.median_ms,
        "p99_tpot_ms": tpot.percentiles_ms[1][1],
        "median_ttft_ms": m.summaries["ttft"].median_ms,
        # per request, for TPOT over all rounds (no TPOT with fewer than two tokens)
        "tpots": [r.tpot for r in results if r.success and r.output_tokens > 1],
        "output_lens": [r.output_tokens for r in results],
        "errors": [r.error for r in results if r.error][:5],
    }
    checks = check_outputs(requests, results)
    # what went wrong, for a look: the first few constrained outputs that do not fit
    row["invalid_outputs"] = [
        r.generated_text for r, ok in zip(results, checks, strict=True) if ok is False
    ][:3]
    return row | structured_dict(results, checks)


async def stream(
    base_url: str,
    endpoint: str,
    requests: list[SampleRequest],
    concurrency: int,
    tokenizer,
    bar: tqdm | None = None,
    ignore_eos: bool = False,
) -> tuple[list, float]:
    """Every request sent at once behind a limit of `concurrency` open streams, greedy, EOS
    honoured, timed per chunk by `bench serve`'s client."""
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
        chat = endpoint.endswith("chat/completions")
        target = Target(base_url + endpoint, model, chat, headers, ignore_eos, 0.0)
        payloads = [build_payload(target, r, tokenizer) for r in requests]
        return await run_requests(
            client,
            target,
            payloads,
            [r.prompt_len for r in requests],
            [0.0] * len(requests),
            concurrency,
            bar if bar is not None else tqdm(disable=True),
        )


def matched_control(requests: list[SampleRequest], output_lens: list[int]) -> list[SampleRequest]:
    """The control of a constrained run: its prompts without their schemas, each to generate
    (EOS ignored) as many tokens as it did, with its first token replaced by its second so
    that no block of it is in the prefix cache (the length, and so the work, is the same)."""
    control = []
    for request, length in zip(requests, output_lens, strict=True):
        ids = request.prompt_token_ids
        ids = ids[1:2] + ids[1:] if len(ids) > 1 else ids
        text = None if request.prompt_text is None else "." + request.prompt_text
        control.append(SampleRequest(ids, max(1, length), text, None))
    return control


# ---- the mask, in process -----------------------------------------------------------------


def midway_grammars(tokenizer, vocab_size: int, eos_ids: list[int], num_rows: int) -> list:
    """num_rows grammars part-way through a record: row k has the schema of task k (cycled)
    and has consumed the tokens of that task's example record up to 25-75% of it (spread over
    the rows; half-way for one row), so the rows' states differ as a batch's would."""
    from conveyor.structured.backend import GrammarCompiler
    from conveyor.structured.grammar import Grammar
    from conveyor.structured.params import StructuredOutputs

    compiler = GrammarCompiler(lambda: tokenizer, vocab_size, eos_ids)
    try:
        templates = [
            compiler.submit(StructuredOutputs(json=task.schema)).result() for task in JSON_TASKS
        ]
    finally:
        compiler.close()
    grammars = []
    for k in range(num_rows):
        task = k % len(JSON_TASKS)
        # json.dumps writes the separators the server's grammars allow (", " and ": ").
        text = json.dumps(JSON_TASKS[task].example)
        tokens = tokenizer(text, add_special_tokens=False).input_ids
        matcher = templates[task].deep_copy()
        upto = int(len(tokens) * (0.25 + 0.5 * (k + 0.5) / num_rows))
        if not matcher.consume_tokens(tokens[:upto]) or matcher.is_error():
            raise RuntimeError(f"the grammar refused its own example: {matcher.get_error()}")
        grammars.append(Grammar(matcher))
    return grammars


def measure_mask(
    tokenizer,
    vocab_size: int,
    eos_ids: list[int],
    rows: list[int],
    repeats: int,
    device: str = "cpu",
) -> list[dict]:
    """Per row count: the median ms of one step's mask (step_mask: filling the bitmask, in
    parallel for several rows), of applying it (apply_bitmask on float32 logits of the
    vocabulary's width) and of both. The sampler also copies the logits before masking them;
    that copy is not counted."""
    import torch

    from conveyor.structured.grammar import apply_bitmask, step_mask

    cuda = torch.device(device).type == "cuda"
    # llguidance's vocabulary, hence the bitmask's width, covers the tokenizer's tokens too
    # where it has more than the model has logits (as the engine's grammars do).
    width = max(vocab_size, len(tokenizer))
    out = []
    for num_rows in rows:
        grammars = midway_grammars(tokenizer, vocab_size, eos_ids, num_rows)
        logits = torch.randn(num_rows, vocab_size, dtype=torch.float32, device=device)
        fill, apply, total = [], [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            mask = step_mask(grammars, width)
            filled = time.perf_counter()
            apply_bitmask(logits, mask.rows, mask.bitmask)
            if cuda:
                torch.cuda.synchronize()
            end = time.perf_counter()
            fill.append((filled - start) * 1000)
            apply.append((end - filled) * 1000)
            total.append((end - start) * 1000)
        out.append(
            {
                "rows": num_rows,
                "fill_ms": statistics.median(fill[1:]),
                "apply_ms": statistics.median(apply[1:]),
                "step_ms": statistics.median(total[1:]),
            }
        )
    return out


# ---- summary and report -------------------------------------------------------------------


def summarize_ratios(runs: list[dict], ratios: list[float]) -> list[dict]:
    """Per ratio, over its rounds: mean output tok/s (and each round's) and its ratio to the
    unconstrained mean (None without a 0 ratio), TPOT p50 and p99 over every request, valid
    outputs of all constrained ones, mean output tokens."""
    from conveyor.bench.serve import summarize

    out = []
    if any(r["structured_ratio"] == MATCHED for r in runs):
        ratios = [*ratios, MATCHED]
    for ratio in ratios:
        mine = [r for r in runs if r["structured_ratio"] == ratio]
        tpot = summarize([t for r in mine for t in r["tpots"]], PERCENTILES)
        completed = sum(r["completed"] for r in mine)
        structured = [r["mean_output_tokens_structured"] for r in mine]
        num_structured = sum(r["num_structured"] for r in mine)
        num_valid = sum(r["num_valid"] for r in mine)
        out.append(
            {
                "structured_ratio": ratio,
                "output_throughput": statistics.mean(r["output_throughput"] for r in mine),
                "output_throughput_rounds": [r["output_throughput"] for r in mine],
                "median_tpot_ms": tpot.median_ms,
                "p99_tpot_ms": tpot.percentiles_ms[1][1],
                "num_structured": num_structured,
                "num_valid": num_valid,
                "validity_rate": num_valid / num_structured if num_structured else None,
                "mean_output_tokens": (
                    sum(r["total_output_tokens"] for r in mine) / completed if completed else None
                ),
                "mean_output_tokens_structured": (
                    statistics.mean(structured) if None not in structured else None
                ),
                "completed": completed,
                "failed": sum(r["failed"] for r in mine),
            }
        )
    base = next((s["output_throughput"] for s in out if s["structured_ratio"] == 0), None)
    for s in out:
        s["vs_unconstrained"] = s["output_throughput"] / base if base else None
    full = next((s for s in out if s["structured_ratio"] == 1), None)
    control = next((s for s in out if s["structured_ratio"] == MATCHED), None)
    if full is not None and control is not None:
        full["vs_matched"] = full["output_throughput"] / control["output_throughput"]
        full["tpot_vs_matched"] = full["median_tpot_ms"] / control["median_tpot_ms"]
    return out


def verdict(summary: list[dict]) -> dict:
    """The target: 100% constrained at >= 0.9x the unconstrained output tok/s, every
    constrained output valid, no request failed; met None when ratio 0 or 1 was not run."""
    by_ratio = {s["structured_ratio"]: s for s in summary}
    if 0 not in by_ratio or 1 not in by_ratio:
        return {"met": None, "speed": None, "speed_matched": None, "validity_rate": None}
    full = by_ratio[1]
    speed, valid = full["vs_unconstrained"], full["validity_rate"]
    matched = full.get("vs_matched")
    failed = by_ratio[0]["failed"] + full["failed"]
    judged = matched if matched is not None else speed
    met = judged is not None and judged >= TARGET_SPEED and valid == 1.0 and not failed
    return {"met": met, "speed": speed, "speed_matched": matched, "validity_rate": valid}


COLUMNS = (  # header, cell of a ratio's summary
    ("constrained", lambda s: _label(s["structured_ratio"])),
    ("output tok/s", lambda s: f"{s['output_throughput']:.1f}"),
    ("per round", lambda s: ", ".join(f"{t:.1f}" for t in s["output_throughput_rounds"])),
    ("vs 0%", lambda s: _number(s["vs_unconstrained"], ".2f", "x")),
    ("vs control", lambda s: _number(s.get("vs_matched"), ".2f", "x")),
    ("TPOT p50 ms", lambda s: f"{s['median_tpot_ms']:.1f}"),
    ("TPOT p99 ms", lambda s: f"{s['p99_tpot_ms']:.1f}"),
    ("valid", lambda s: _valid(s)),
    ("mean output tokens", lambda s: _number(s["mean_output_tokens"], ".1f")),
    ("constrained mean", lambda s: _number(s["mean_output_tokens_structured"], ".1f")),
)


def format_mask(report: dict) -> str:
    lines = [
        "",
        f"grammar mask per step, in process: {report['vocab_size']}-token float32 logits on "
        f"{report['device']}, rows mid-way through a JSON record, median of "
        f"{report['mask_repeats']} steps",
        "",
        "| rows | fill ms | apply ms | ms per step |",
        "|---|---|---|---|",
    ]
    for m in report["mask"]:
        lines.append(
            f"| {m['rows']} | {m['fill_ms']:.3f} | {m['apply_ms']:.3f} | {m['step_ms']:.3f} |"
        )
    return "\n".join(lines)


def format_report(report: dict) -> str:
    lines = [
        "",
        f"model {report['model']} ({report['dtype']}, {report['device']}); json-schema "
        f"workload, {report['num_prompts']} requests per run at {report['concurrency']} "
        f"streams, up to {report['output_len']} output tokens, greedy, EOS honoured; "
        f"{report['rounds']} round(s), the ratios' order alternating; vs 0%: output tok/s "
        "over the unconstrained run's",
        "",
        "| " + " | ".join(header for header, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for s in report["ratios"]:
        lines.append("| " + " | ".join(cell(s) for _, cell in COLUMNS) + " |")
    failed = sum(s["failed"] for s in report["ratios"])
    if failed:
        lines.append(f"warning: {failed} requests failed; their tokens are not counted")
    lines += [format_mask(report), "", _verdict_line(report["verdict"])]
    return "\n".join(lines)


def _verdict_line(v: dict) -> str:
    target = (
        f"target: 100% constrained >= {TARGET_SPEED}x the unconstrained output tok/s, validity 100%"
    )
    if v["met"] is None:
        return f"{target}: not measured (run the ratios 0 and 1)"
    valid = _number(v["validity_rate"], ".1%")
    word = "MET" if v["met"] else "MISSED"
    return (
        f"{target}: {word} ({_number(v.get('speed_matched'), '.2f', 'x')} of the matched "
        f"control, {_number(v['speed'], '.2f', 'x')} of the free run; validity {valid})"
    )


def _label(ratio) -> str:
    return "0%, lengths of 100% (control)" if ratio == MATCHED else f"{ratio:.0%}"


def _progress(run: dict) -> str:
    return (
        f"{_label(run['structured_ratio'])} constrained, round {run['round'] + 1}: "
        f"{run['output_throughput']:.1f} output tok/s, TPOT p50 {run['median_tpot_ms']:.1f} ms, "
        f"valid {_valid(run)}, mean output tokens {_number(run['mean_output_tokens'], '.1f')}, "
        f"{run['failed']} failed"
    )


def _valid(row: dict) -> str:
    if not row["num_structured"]:
        return "-"
    return f"{row['num_valid']}/{row['num_structured']} ({row['validity_rate']:.1%})"


def _number(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def save(report: dict, args: argparse.Namespace) -> list[Path]:
    """The JSON (with --save-result) and the plot (--plot, else next to the JSON)."""
    paths = []
    if args.save_result:
        name = args.result_filename or (
            f"structured-{Path(report['model']).stem}-{report['date']}.json"
        )
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        paths.append(path)
    plot = Path(args.plot) if args.plot else paths[0].with_suffix(".png") if paths else None
    if plot is not None:
        from benchmarks.plots import plot_structured

        paths.append(plot_structured(report, plot))
    return paths
