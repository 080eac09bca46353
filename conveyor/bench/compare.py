"""`conveyor bench compare`: one workload, one model, several serving systems, as in the Orca
paper's evaluation.

Systems:
  conveyor-fcfs    conveyor with continuous batching (iteration-level scheduling);
  conveyor-static  conveyor with request-level batching: a batch forms from the waiting
                   requests and nobody joins it until all its members have finished (Orca's
                   baseline);
  hf-generate      the naive serving loop: transformers' `model.generate` on static batches
                   of up to max_num_seqs arrived requests, left padded, in arrival order.

Each request is sent at its (Poisson) arrival time in wall-clock time and generates exactly
its output length (EOS ignored, greedy). Per request we record arrival, first token and
finish; the headline latency is the normalized latency of the Orca / vLLM papers, end-to-end
latency divided by the number of output tokens (s/token). In an hf-generate batch every member
generates up to the batch's longest output and its result is returned when `generate`
returns: that is its finish time. Its first token time is when the batch's first token was
computed (what a streaming loop could deliver), the same definition as for conveyor.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from conveyor.bench.datasets import SampleRequest, arrival_times, uniform_requests
from conveyor.bench.records import RequestRecord, RunResult, StepRecord

SYSTEMS = ("conveyor-fcfs", "conveyor-static", "hf-generate")
CONTINUOUS = "conveyor-fcfs"  # the system every ratio is taken of
POLICIES = {"conveyor-fcfs": "fcfs", "conveyor-static": "static"}
DEFAULT_RATES = (0.1, 0.2, 0.4)
WARMUP_PROMPT_LEN = 16


class Workload(NamedTuple):
    requests: list[SampleRequest]
    arrivals: list[float]  # seconds from the start of the run


# ---- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.entrypoints.args import add_model_arg

    add_model_arg(parser)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=9,
        help="requests per rate (default 9: the default sweep takes ~12 min on 2 CPU cores)",
    )
    parser.add_argument(
        "--request-rates",
        nargs="+",
        type=_rate,
        default=list(DEFAULT_RATES),
        help="Poisson arrival rates in requests/s ('inf': all at once)",
    )
    parser.add_argument(
        "--prompt-range", nargs=2, type=int, default=[32, 512], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-range", nargs=2, type=int, default=[1, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-num-seqs", type=int, default=8, help="batch size of every system")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", help="auto|float32|bfloat16|float16|float64")
    parser.add_argument("--device", default="cpu", help="cpu|cuda")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads for every system (default 1: on a small shared CPU a second "
        "OpenMP thread mostly spins); 0 keeps torch's default",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeline-rate",
        type=_rate,
        default=None,
        help="rate of the batch-occupancy plot (default: the middle of --request-rates)",
    )
    parser.add_argument("--output-dir", default="results/compare")
    parser.add_argument("--disable-tqdm", action="store_true")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'inf'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0, got {text!r}")
    return value


def check_args(args: argparse.Namespace) -> None:
    for name in ("prompt_range", "output_range"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
    for name in ("num_prompts", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.num_threads < 0:
        raise ValueError(f"--num-threads must be >= 0, got {args.num_threads}")
    if args.timeline_rate is not None and args.timeline_rate not in args.request_rates:
        raise ValueError(f"--timeline-rate {args.timeline_rate} is not one of --request-rates")


def main(args: argparse.Namespace) -> int:
    check_args(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    started = time.monotonic()
    results = run_all(args)
    report = build_report(args, results, time.monotonic() - started)
    print(format_table(report))
    print(format_ratios(report))
    paths = save(report, results, args)
    print(f"\nwall time {report['wall_time_s']:.0f} s; wrote " + ", ".join(map(str, paths)))
    return 0


# ---- orchestration ------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> list[RunResult]:
    from conveyor.config import ModelConfig
    from conveyor.model.loader import load_tokenizer

    model_config = ModelConfig.from_hf(args.model, args.dtype, args.device)
    tokenizer = load_tokenizer(model_config)
    requests = uniform_requests(
        tokenizer, args.num_prompts, tuple(args.prompt_range), tuple(args.output_range), args.seed
    )
    results = []
    for system in args.systems:
        runner = _make_runner(system, args, model_config)
        for rate in args.request_rates:
            workload = Workload(requests, arrival_times(len(requests), rate, 1.0, args.seed))
            label = f"{system} @ {_rate_label(rate)} req/s"
            with tqdm(total=len(requests), desc=label, disable=args.disable_tqdm) as bar:
                records, steps = runner(workload, bar)
            summary = summarize(records, steps, args.max_num_seqs)
            results.append(RunResult(system, rate, records, steps, summary))
        del runner  # one model in memory at a time
    return results


def _make_runner(system: str, args: argparse.Namespace, model_config):
    """Loads the system once; returns run(workload, bar) -> (records, steps), reused per rate."""
    if system in POLICIES:
        engine = _load_engine(args, POLICIES[system])
        _warm_up_engine(engine)
        return lambda workload, bar: drive_engine(engine, workload, bar)
    model, pad_id = _load_hf(model_config, args.device)
    _warm_up_hf(model, pad_id)
    return lambda workload, bar: drive_hf(model, workload, args.max_num_seqs, pad_id, bar)


def _load_engine(args: argparse.Namespace, policy: str):
    from conveyor.engine.llm_engine import LLMEngine

    return LLMEngine(
        args.model,
        dtype=args.dtype,
        device=args.device,
        # Just what the workload needs, so the KV cache stays small.
        max_model_len=args.prompt_range[1] + args.output_range[1],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # Every rate replays the same prompts, and transformers has no prefix cache.
        enable_prefix_caching=False,
        scheduling_policy=policy,
        seed=args.seed,
        record_trace=True,
    )


def _load_hf(model_config, device: str):
    from transformers import AutoModelForCausalLM

    path = model_config.path
    if model_config.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=model_config.dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=model_config.dtype)
    model = model.to(device).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = min(model_config.eos_token_ids) if model_config.eos_token_ids else 0
    return model, int(pad_id if isinstance(pad_id, int) else pad_id[0])


def _warm_up_engine(engine) -> None:
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("warm-up", [1] * WARMUP_PROMPT_LEN, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.trace.clear()


def _warm_up_hf(model, pad_id: int) -> None:
    prompt = torch.ones((1, WARMUP_PROMPT_LEN), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=pad_id)


# ---- driving conveyor in real time ---------------------------------------------------------


def drive_engine(engine, workload: Workload, bar) -> tuple[list[RequestRecord], list[StepRecord]]:
    """Adds each request once its arrival time has passed; steps while there is work, sleeps
    until the next arrival when idle. The engine is idle again when this returns."""
    engine.trace.clear()
    start = time.monotonic()
    records: list[RequestRecord] = []
    step_starts: list[float] = []
    num_sent = 0
    while len(records) < len(workload.requests):
        num_sent = _send_arrived(engine, workload, start, num_sent)
        if not engine.has_unfinished_requests():
            _sleep_until(start + workload.arrivals[num_sent])
            continue
        step_start = time.monotonic()
        outputs = engine.step()
        if len(engine.trace) > len(step_starts):
            step_starts.append(step_start - start)
        for out in outputs:
            if out.finished:
                records.append(_engine_record(out, workload, start))
                bar.update()
    steps = [
        StepRecord(
            begin, t.time - start, dict(t.num_scheduled_tokens), list(t.finished_request_ids)
        )
        for begin, t in zip(step_starts, engine.trace, strict=True)
    ]
    engine.trace.clear()
    return sorted(records, key=lambda r: int(r.request_id)), steps


def _send_arrived(engine, workload: Workload, start: float, num_sent: int) -> int:
    from conveyor.outputs import OutputKind
    from conveyor.sampling_params import SamplingParams

    now = time.monotonic() - start
    while num_sent < len(workload.requests) and workload.arrivals[num_sent] <= now:
        request = workload.requests[num_sent]
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        engine.add_request(
            str(num_sent),
            request.prompt_token_ids,
            params,
            arrival_time=start + workload.arrivals[num_sent],
            output_kind=OutputKind.FINAL_ONLY,  # no per-step copies of the output so far
        )
        num_sent += 1
    return num_sent


def _engine_record(out, workload: Workload, start: float) -> RequestRecord:
    request = workload.requests[int(out.request_id)]
    metrics = out.metrics
    return RequestRecord(
        request_id=out.request_id,
        prompt_len=request.prompt_len,
        output_len=request.output_len,
        num_output_tokens=len(out.outputs[0].token_ids),
        arrival=metrics.arrival_time - start,
        first_token=metrics.first_token_time - start,
        finish=metrics.finished_time - start,
    )


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


# ---- driving transformers' generate in real time --------------------------------------------


class _StepClock:
    """A stopping criterion that never stops: transformers calls it once per generated token,
    which gives the end time of every step of the batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.monotonic())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def drive_hf(
    model, workload: Workload, max_num_seqs: int, pad_id: int, bar
) -> tuple[list[RequestRecord], list[StepRecord]]:
    """The naive loop: take up to max_num_seqs arrived requests, generate, return, repeat."""
    start = time.monotonic()
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    num_taken = 0
    while num_taken < len(workload.requests):
        _sleep_until(start + workload.arrivals[num_taken])
        now = time.monotonic() - start
        batch = []
        while (
            num_taken < len(workload.requests)
            and len(batch) < max_num_seqs
            and workload.arrivals[num_taken] <= now
        ):
            batch.append(num_taken)
            num_taken += 1
        records += _generate_batch(model, workload, batch, pad_id, start, steps)
        bar.update(len(batch))
    return records, steps


def _generate_batch(
    model, workload: Workload, batch: list[int], pad_id: int, start: float, steps: list[StepRecord]
) -> list[RequestRecord]:
    from transformers import StoppingCriteriaList

    requests = [workload.requests[i] for i in batch]
    input_ids, attention_mask = _left_pad([r.prompt_token_ids for r in requests], pad_id)
    max_new = max(r.output_len for r in requests)
    clock = _StepClock()
    begin = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # EOS ignored: every member runs to the batch's longest
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    done = time.monotonic()
    num_generated = out.shape[1] - input_ids.shape[1]
    ids = [str(i) for i in batch]
    steps += _hf_steps(ids, input_ids.shape[1], [begin, *clock.times], start)
    return [
        RequestRecord(
            request_id=ids[k],
            prompt_len=r.prompt_len,
            output_len=r.output_len,
            num_output_tokens=min(r.output_len, num_generated),
            arrival=workload.arrivals[i],
            first_token=clock.times[0] - start,
            finish=done - start,  # results come back when generate returns
        )
        for k, (i, r) in enumerate(zip(batch, requests, strict=True))
    ]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def _hf_steps(ids: list[str], width: int, times: list[float], start: float) -> list[StepRecord]:
    """Every member occupies the batch for every step; the first step computes the padded
    prompt, later steps one token each; all leave after the last step."""
    steps = []
    for k in range(1, len(times)):
        num_tokens = width if k == 1 else 1
        last = k == len(times) - 1
        steps.append(
            StepRecord(
                times[k - 1] - start,
                times[k] - start,
                dict.fromkeys(ids, num_tokens),
                list(ids) if last else [],
            )
        )
    return steps


# ---- metrics --------------------------------------------------------------------------------


def summarize(
    records: list[RequestRecord], steps: list[StepRecord], max_num_seqs: int
) -> dict[str, float]:
    duration = max(r.finish for r in records) - min(r.arrival for r in records)
    normalized = [r.normalized_latency for r in records]
    ttft = [r.ttft for r in records]
    e2e = [r.e2e for r in records]
    return {
        "num_completed": len(records),
        "duration_s": duration,
        "request_throughput": len(records) / duration,
        "output_throughput": sum(r.num_output_tokens for r in records) / duration,
        "normalized_latency_median": float(np.median(normalized)),
        "normalized_latency_p99": float(np.percentile(normalized, 99)),
        "normalized_latency_mean": float(np.mean(normalized)),
        "ttft_mean": float(np.mean(ttft)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "e2e_median": float(np.median(e2e)),
        "e2e_p99": float(np.percentile(e2e, 99)),
        "mean_batch_size": _mean_batch_size(steps),
        "num_joins_in_progress": count_joins_in_progress(steps, records, max_num_seqs),
    }


def _mean_batch_size(steps: list[StepRecord]) -> float:
    """Time-weighted number of requests in a step while the model was running."""
    busy = sum(s.end - s.start for s in steps)
    weighted = sum((s.end - s.start) * len(s.num_scheduled_tokens) for s in steps)
    return weighted / busy if busy > 0 else 0.0


def count_joins_in_progress(
    steps: list[StepRecord], records: list[RequestRecord], max_num_seqs: int
) -> int:
    """Requests that joined a batch in progress: they started while the batch still held
    (a) a request that had already run before they arrived, or (b) since it was last empty,
    more than max_num_seqs requests had started (so they took a seat someone left).
    Request-level batching does neither: whoever arrives after a batch formed waits for it to
    drain, and one batch holds at most max_num_seqs requests, even when the token budget
    spreads its members' first steps over several steps."""
    arrival = {r.request_id: r.arrival for r in records}
    first_end: dict[str, float] = {}
    running: set[str] = set()
    num_started = 0  # since the batch was last empty
    count = 0
    for step in steps:
        if not running:
            num_started = 0
        for request_id in step.num_scheduled_tokens:
            if request_id in first_end:
                continue
            num_started += 1
            late = any(first_end[c] < arrival[request_id] for c in running)
            count += late or num_started > max_num_seqs
            first_end[request_id] = step.end
            running.add(request_id)
        running -= set(step.finished_request_ids)
    return count


# ---- report -------------------------------------------------------------------------------


def build_report(args: argparse.Namespace, results: list[RunResult], wall_time: float) -> dict:
    config = {k: v for k, v in vars(args).items() if k != "func"}
    return {
        "config": _json_safe(config),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": _cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "wall_time_s": wall_time,
        "summary": [
            {"system": r.system, "request_rate": _json_rate(r.request_rate), **r.summary}
            for r in results
        ],
        "ratios": ratios(results),
    }


def ratios(results: list[RunResult]) -> list[dict]:
    """conveyor-fcfs / each baseline at each rate: throughput (> 1: fcfs serves more) and
    median normalized latency (< 1: fcfs is faster per token)."""
    by_key = {(r.system, r.request_rate): r.summary for r in results}
    out = []
    for (system, rate), base in by_key.items():
        ours = by_key.get((CONTINUOUS, rate))
        if system == CONTINUOUS or ours is None:
            continue
        out.append(
            {
                "request_rate": _json_rate(rate),
                "baseline": system,
                "throughput_ratio": ours["request_throughput"] / base["request_throughput"],
                "normalized_latency_ratio": (
                    ours["normalized_latency_median"] / base["normalized_latency_median"]
                ),
            }
        )
    return out


TABLE_COLUMNS = (
    ("system", "system", "<16", "s"),
    ("rate", "request_rate", ">5", "s"),
    ("done", "num_completed", ">5", "d"),
    ("req/s", "request_throughput", ">7", ".3f"),
    ("tok/s", "output_throughput", ">7", ".1f"),
    ("norm med", "normalized_latency_median", ">9", ".4g"),
    ("norm p99", "normalized_latency_p99", ">9", ".4g"),
    ("TTFT mean", "ttft_mean", ">10", ".3f"),
    ("TTFT p99", "ttft_p99", ">9", ".3f"),
    ("batch", "mean_batch_size", ">6", ".2f"),
    ("joins", "num_joins_in_progress", ">6", "d"),
)


def format_table(report: dict) -> str:
    header = "  ".join(f"{title:{align}}" for title, _, align, _ in TABLE_COLUMNS)
    lines = [
        "",
        "norm = end-to-end latency / output tokens (s/token); TTFT in s; batch = mean requests "
        "per step; joins = requests that joined a batch in progress",
        header,
        "-" * len(header),
    ]
    for row in report["summary"]:
        cells = []
        for _, key, align, fmt in TABLE_COLUMNS:
            value = _rate_label(row[key]) if key == "request_rate" else row[key]
            cells.append(f"{value:{align}{fmt}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_ratios(report: dict) -> str:
    lines = ["", f"{CONTINUOUS} / baseline (throughput: > 1 is better; normalized latency: < 1)"]
    for r in report["ratios"]:
        lines.append(
            f"rate {_rate_label(r['request_rate']):>5} req/s  vs {r['baseline']:<16} "
            f"throughput {r['throughput_ratio']:.2f}x  "
            f"median normalized latency {r['normalized_latency_ratio']:.2f}x"
        )
    return "\n".join(lines)


def save(report: dict, results: list[RunResult], args: argparse.Namespace) -> list[Path]:
    from conveyor.bench import plots

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report | {"runs": [_run_dict(r) for r in results]}
    json_path = out_dir / "compare.json"
    json_path.write_text(json.dumps(data, indent=1))
    timeline_rate = args.timeline_rate
    if timeline_rate is None:
        timeline_rate = args.request_rates[len(args.request_rates) // 2]
    return [json_path, *plots.plot_all(results, out_dir, timeline_rate)]


def _run_dict(result: RunResult) -> dict:
    return {
        "system": result.system,
        "request_rate": _json_rate(result.request_rate),
        "summary": result.summary,
        "requests": [asdict(r) for r in result.requests],
        "steps": [asdict(s) for s in result.steps],
    }


def _rate_label(rate: float | str) -> str:
    rate = float(rate)
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _json_safe(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
