"""`python -m benchmarks compare`: one workload, one model, several serving systems, as in the Orca
paper's evaluation.

Systems:
  conveyor-fcfs    conveyor with continuous batching (iteration-level scheduling);
  conveyor-static  conveyor with request-level batching: a batch forms from the waiting
                   requests and nobody joins it until all its members have finished (Orca's
                   baseline);
  hf-generate      the naive serving loop: transformers' `model.generate` on static batches
                   of up to max_num_seqs arrived requests, left padded, in arrival order;
and one derived from conveyor-static's runs, not run on its own:
  static-batch-end conveyor-static with each result returned when its batch's last member
                   finishes, as a request-level server returns them (Orca's baseline, and
                   hf-generate here). conveyor-static hands each one over at its own end,
                   which such a server cannot: its finished rows still leave the later steps
                   (FasterTransformer, Orca's baseline, kept computing them), so this is
                   still kinder than Orca's baseline.

Each request is sent at its (Poisson) arrival time in wall-clock time and generates exactly
its output length (EOS ignored, greedy; by default heavy-tailed, a capped lognormal). Per
request we record arrival, first token and finish; the headline latency is the normalized
latency of the Orca / vLLM papers, end-to-end latency divided by the number of output tokens
(s/token).

Headline numbers, over the sweep of rates:
  capacity  Orca's measure: the request rate a system sustains while its median normalized
            latency stays under one threshold for all systems (--capacity-factor times the
            lowest median at the lowest rate), linearly interpolated between the two rates
            around the first crossing;
  goodput   requests/s that meet a time-between-tokens SLO (the 99th percentile of the
            request's gaps between consecutive tokens <= --tbt-slo), the best over the sweep.

In an hf-generate batch every member generates up to the batch's longest output and its result
is returned when `generate` returns: that is its finish time. Its first token time, and the
times of its later tokens, are when the batch computed them (what a streaming loop could
deliver), the same definition as for conveyor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.records import RequestRecord, RunResult, StepSpan
from conveyor.bench.datasets import (
    OUTPUT_DISTS,
    SampleRequest,
    arrival_times,
    synthetic_requests,
)

SYSTEMS = ("conveyor-fcfs", "conveyor-static", "hf-generate")
CONTINUOUS = "conveyor-fcfs"  # the system every ratio is taken of
POLICIES = {"conveyor-fcfs": "fcfs", "conveyor-static": "static"}
HELD = "static-batch-end"  # derived from each conveyor-static run (held_to_batch_end)
WARMUP_PROMPT_LEN = 16
FULL_NUM_PROMPTS = 200
# fcfs kept up with 8 req/s on an idle 2-core Zen 5; saturation lies past 11
FULL_RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# transformers' loop is ~10x slower per request at 64 rows: fewer requests, lower rates
FULL_HF_NUM_PROMPTS = 32
FULL_HF_RATES = (0.25, 0.5, 1.0)
DEFAULT_CAPACITY_FACTOR = 5.0
DEFAULT_TBT_SLO = 0.5  # s


class Scale(NamedTuple):
    num_prompts: int
    request_rates: tuple[float, ...]
    hf_num_prompts: int
    hf_request_rates: tuple[float, ...]


# Sized for ~40 min on a 2-core CPU with the default model; --quick for a look in minutes.
FULL = Scale(FULL_NUM_PROMPTS, FULL_RATES, FULL_HF_NUM_PROMPTS, FULL_HF_RATES)
QUICK = Scale(24, (0.5, 2.0, math.inf), 24, (0.5, math.inf))


class Workload(NamedTuple):
    requests: list[SampleRequest]
    arrivals: list[float]  # seconds from the start of the run


# ---- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.entrypoints.args import add_model_arg

    add_model_arg(parser)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a small sweep ({QUICK.num_prompts} requests at {_rates_text(QUICK.request_rates)}"
        " req/s) instead of the full one; explicit flags still win",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests per rate (default {FULL.num_prompts})",
    )
    parser.add_argument(
        "--request-rates",
        nargs="+",
        type=_rate,
        default=None,
        help="Poisson arrival rates in requests/s, 'inf': all at once "
        f"(default {_rates_text(FULL.request_rates)})",
    )
    parser.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="hf-generate serves the first N of the same requests, it is far slower "
        f"(default {FULL.hf_num_prompts})",
    )
    parser.add_argument(
        "--hf-request-rates",
        nargs="+",
        type=_rate,
        default=None,
        help=f"hf-generate's rates (default {_rates_text(FULL.hf_request_rates)})",
    )
    parser.add_argument(
        "--prompt-range", nargs=2, type=int, default=[32, 256], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-dist",
        default="lognormal",
        choices=OUTPUT_DISTS,
        help="output lengths: lognormal (sigma 1, ShareGPT-like heavy tail; default), "
        "exponential, or uniform over --output-range (Orca's trace); capped to the range",
    )
    parser.add_argument(
        "--output-range", nargs=2, type=int, default=[1, 512], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-mean",
        type=float,
        default=48.0,
        help="mean output length of lognormal/exponential before capping (default 48)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="batch size of every system")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of a step for both conveyor systems (default: the engine's, as "
        "conveyor serve runs: 512 on CPU, 2048 on CUDA)",
    )
    parser.add_argument(
        "--max-step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="target step time of both conveyor systems (conveyor serve --max-step-ms: decodes "
        "first, prompt chunks cut to fit; default off, as conveyor serve runs)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto|float32|bfloat16|float16|float64 (auto: conveyor's default; hf-generate "
        "loads a GGUF dequantized to float32)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8"],
        help="the conveyor systems' (auto: a quantized GGUF runs quantized, conveyor's default)",
    )
    parser.add_argument("--device", default="cpu", help="cpu|cuda")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch CPU threads for every system (default 0: torch's default, every core)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=DEFAULT_CAPACITY_FACTOR,
        help="capacity threshold = this times the lowest median normalized latency at the "
        f"lowest rate (default {DEFAULT_CAPACITY_FACTOR:g})",
    )
    parser.add_argument(
        "--tbt-slo",
        type=float,
        default=DEFAULT_TBT_SLO,
        help="goodput's SLO: a request's p99 time between tokens in seconds "
        f"(default {DEFAULT_TBT_SLO:g})",
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


def _rates_text(rates) -> str:
    return " ".join(_rate_label(r) for r in rates)


def resolve_scale(args: argparse.Namespace) -> None:
    """Fills the sweep flags left unset from --quick's scale or the full one."""
    scale = QUICK if args.quick else FULL
    for name in Scale._fields:
        value = getattr(scale, name)
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, tuple) else value)


def check_args(args: argparse.Namespace) -> None:
    resolve_scale(args)
    for name in ("prompt_range", "output_range"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
    for name in ("num_prompts", "hf_num_prompts", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.num_threads < 0:
        raise ValueError(f"--num-threads must be >= 0, got {args.num_threads}")
    if args.max_step_ms is not None and not (0 < args.max_step_ms < math.inf):
        raise ValueError(f"--max-step-ms must be a finite number > 0, got {args.max_step_ms}")
    for name in ("output_mean", "tbt_slo"):
        if not (0 < getattr(args, name) < math.inf):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a finite number > 0, got {getattr(args, name)}")
    if not (1 < args.capacity_factor < math.inf):
        raise ValueError(f"--capacity-factor must be > 1, got {args.capacity_factor}")
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
    print(format_headline(report))
    paths = save(report, results, args)
    print(f"\nwall time {report['wall_time_s']:.0f} s; wrote " + ", ".join(map(str, paths)))
    return 0


# ---- orchestration ------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> list[RunResult]:
    from conveyor.model.config import ModelConfig, load_tokenizer

    # hf-generate's dtype: a GGUF's "auto" resolves to float32, what transformers dequantizes to
    model_config = ModelConfig.from_hf(args.model, args.dtype, args.device)
    tokenizer = load_tokenizer(model_config)
    requests = synthetic_requests(
        tokenizer,
        args.num_prompts,
        tuple(args.prompt_range),
        tuple(args.output_range),
        args.output_dist,
        args.output_mean,
        args.seed,
    )
    results = []
    for system in args.systems:
        runner = _make_runner(system, args, model_config)
        hf = system == "hf-generate"
        ours = requests[: args.hf_num_prompts] if hf else requests
        runs = []
        for rate in args.hf_request_rates if hf else args.request_rates:
            workload = Workload(ours, arrival_times(len(ours), rate, 1.0, args.seed))
            label = f"{system} @ {_rate_label(rate)} req/s"
            with tqdm(total=len(ours), desc=label, disable=args.disable_tqdm) as bar:
                records, steps = runner(workload, bar)
            set_tbt_p99(records, steps)
            summary = summarize(records, steps, args.max_num_seqs, args.tbt_slo)
            summary["load_average_1m"] = os.getloadavg()[0]  # other jobs on the machine
            runs.append(RunResult(system, rate, records, steps, summary))
        results += runs
        if system == "conveyor-static":
            results += [held_to_batch_end(r, args.max_num_seqs, args.tbt_slo) for r in runs]
        del runner  # one model in memory at a time
    return results


def held_to_batch_end(result: RunResult, max_num_seqs: int, tbt_slo: float) -> RunResult:
    """A request-level batching run as a request-level server delivers it: every result when
    the last member of its batch finishes (static-batch-end). The tokens were computed at the
    same times, so the first token, the times between tokens and goodput stay the run's;
    end-to-end and normalized latency are what change. A request in no batch keeps its own
    finish."""
    ends: dict[int, float] = {}
    for r in result.requests:
        if r.batch >= 0:
            ends[r.batch] = max(ends.get(r.batch, r.finish), r.finish)
    requests = [replace(r, finish=ends.get(r.batch, r.finish)) for r in result.requests]
    summary = summarize(requests, result.steps, max_num_seqs, tbt_slo)
    summary["load_average_1m"] = result.summary["load_average_1m"]
    return RunResult(HELD, result.request_rate, requests, result.steps, summary)


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
        quantization=args.quantization,
        num_threads=args.num_threads or None,
        # Just what the workload needs, so the KV cache stays small.
        max_model_len=args.prompt_range[1] + args.output_range[1],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_ms=args.max_step_ms,
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


def drive_engine(engine, workload: Workload, bar) -> tuple[list[RequestRecord], list[StepSpan]]:
    """Adds each request once its arrival time has passed; steps while there is work, sleeps
    until the next arrival when idle. The engine is idle again when this returns."""
    engine.trace.clear()
    start = time.monotonic()
    records: list[RequestRecord] = []
    spans: list[tuple[float, float]] = []  # (begin, end) of each step that ran
    static = engine.scheduler.policy == "static"
    batches = _StaticBatches()
    num_sent = 0
    while len(records) < len(workload.requests):
        num_sent = _send_arrived(engine, workload, start, num_sent)
        if not engine.has_unfinished_requests():
            _sleep_until(start + workload.arrivals[num_sent])
            continue
        step_start = time.monotonic() - start
        outputs = engine.step()
        if len(engine.trace) > len(spans):
            spans.append((step_start, time.monotonic() - start))
            if static:
                batches.step(engine.trace[-1], engine.scheduler.static_batch)
        for out in outputs:
            if out.finished:
                records.append(_engine_record(out, workload, start, batches.of))
                bar.update()
    steps = [
        StepSpan(begin, end, dict(t.num_scheduled_tokens), list(t.finished_request_ids))
        for (begin, end), t in zip(spans, engine.trace, strict=True)
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


class _StaticBatches:
    """Which request-level batch each request of conveyor-static ran in, as its scheduler
    forms them: a batch is formed once every member of the one before has finished, and all
    its members are chosen then (the scheduler's static_batch holds those not finished yet).
    So after each step, the requests seen for the first time (in the step, or waiting in
    static_batch) open a new batch if none of the current one was left unfinished before it."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # request id -> batch number
        self._number = -1  # the current batch's
        self._unfinished: set[str] = set()  # of the current batch, before the next step

    def step(self, record, static_batch: set[str]) -> None:
        new = [i for i in (*record.num_scheduled_tokens, *static_batch) if i not in self.of]
        if new:
            if not self._unfinished:
                self._number += 1
            for request_id in new:
                self.of[request_id] = self._number
            self._unfinished.update(new)
        self._unfinished.difference_update(record.finished_request_ids)


def _engine_record(
    out, workload: Workload, start: float, batch_of: dict[str, int]
) -> RequestRecord:
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
        batch=batch_of.get(out.request_id, -1),
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
) -> tuple[list[RequestRecord], list[StepSpan]]:
    """The naive loop: take up to max_num_seqs arrived requests, generate, return, repeat."""
    start = time.monotonic()
    records: list[RequestRecord] = []
    steps: list[StepSpan] = []
    num_taken = num_batches = 0
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
        records += _generate_batch(model, workload, batch, num_batches, pad_id, start, steps)
        num_batches += 1
        bar.update(len(batch))
    return records, steps


def _generate_batch(
    model,
    workload: Workload,
    batch: list[int],
    number: int,
    pad_id: int,
    start: float,
    steps: list[StepSpan],
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
            batch=number,
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


def _hf_steps(ids: list[str], width: int, times: list[float], start: float) -> list[StepSpan]:
    """Every member occupies the batch for every step; the first step computes the padded
    prompt, later steps one token each; all leave after the last step."""
    steps = []
    for k in range(1, len(times)):
        num_tokens = width if k == 1 else 1
        last = k == len(times) - 1
        steps.append(
            StepSpan(
                times[k - 1] - start,
                times[k] - start,
                dict.fromkeys(ids, num_tokens),
                list(ids) if last else [],
            )
        )
    return steps


# ---- metrics --------------------------------------------------------------------------------


def token_times(record: RequestRecord, steps: list[StepSpan]) -> list[float]:
    """When each of a request's output tokens was computed: the end of the step that
    completed its prompt, then of every later step it ran in (one token per step, as neither
    system speculates), up to its number of output tokens."""
    times = []
    num_computed = 0
    for step in steps:
        num_computed += step.num_scheduled_tokens.get(record.request_id, 0)
        if record.request_id in step.num_scheduled_tokens and num_computed >= record.prompt_len:
            times.append(step.end)
            if len(times) == record.num_output_tokens:
                break
    return times


def tbt_p99(times: list[float]) -> float:
    """99th percentile of the gaps between consecutive tokens; 0 for fewer than two."""
    return float(np.percentile(np.diff(times), 99)) if len(times) > 1 else 0.0


def set_tbt_p99(records: list[RequestRecord], steps: list[StepSpan]) -> None:
    by_request: dict[str, list[StepSpan]] = {}
    for step in steps:
        for request_id in step.num_scheduled_tokens:
            by_request.setdefault(request_id, []).append(step)
    for record in records:
        record.tbt_p99 = tbt_p99(token_times(record, by_request.get(record.request_id, [])))


def goodput(records: list[RequestRecord], duration: float, tbt_slo: float) -> float:
    """Requests per second whose p99 time between tokens meets the SLO."""
    return sum(r.tbt_p99 <= tbt_slo for r in records) / duration


def summarize(
    records: list[RequestRecord], steps: list[StepSpan], max_num_seqs: int, tbt_slo: float
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
        "tbt_p99_median": float(np.median([r.tbt_p99 for r in records])),
        "slo_attainment": sum(r.tbt_p99 <= tbt_slo for r in records) / len(records),
        "goodput": goodput(records, duration, tbt_slo),
        "mean_batch_size": _mean_batch_size(steps),
        "num_joins_in_progress": count_joins_in_progress(steps, records, max_num_seqs),
    }


def _mean_batch_size(steps: list[StepSpan]) -> float:
    """Time-weighted number of requests in a step while the model was running."""
    busy = sum(s.end - s.start for s in steps)
    weighted = sum((s.end - s.start) * len(s.num_scheduled_tokens) for s in steps)
    return weighted / busy if busy > 0 else 0.0


def count_joins_in_progress(
    steps: list[StepSpan], records: list[RequestRecord], max_num_seqs: int
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


# ---- capacity and goodput over the sweep ----------------------------------------------------


class Capacity(NamedTuple):
    rate: float  # requests/s
    # "=": interpolated; ">=": under the threshold at every rate of the sweep (a lower bound);
    # "<=": over it already at the lowest rate (an upper bound)
    bound: str


def capacity(points: list[tuple[float, float]], threshold: float) -> Capacity:
    """Orca's capacity: the rate at which the median normalized latency first rises above the
    threshold, linearly interpolated between the two sweep rates around the crossing.
    points: (request rate, median normalized latency); 'inf' rates are left out."""
    points = sorted((rate, median) for rate, median in points if not math.isinf(rate))
    if not points:
        raise ValueError("capacity needs at least one finite request rate")
    for k, (rate, median) in enumerate(points):
        if median <= threshold:
            continue
        if k == 0:
            return Capacity(rate, "<=")
        low_rate, low_median = points[k - 1]
        share = (threshold - low_median) / (median - low_median)
        return Capacity(low_rate + share * (rate - low_rate), "=")
    return Capacity(points[-1][0], ">=")


def capacity_ratio(ours: Capacity, theirs: Capacity) -> tuple[float, str]:
    """ours / theirs and what kind of bound it is ("?": the bounds point both ways)."""
    lower = ours.bound == ">=" or theirs.bound == "<="
    upper = ours.bound == "<=" or theirs.bound == ">="
    bound = "?" if lower and upper else ">=" if lower else "<=" if upper else "="
    return ours.rate / theirs.rate, bound


def capacity_threshold(results: list[RunResult], factor: float) -> tuple[float, float]:
    """(threshold, reference): reference is the lowest median normalized latency any system
    shows at its lowest finite rate, the latency of a nearly idle server."""
    lowest: dict[str, RunResult] = {}
    for r in results:
        if not math.isinf(r.request_rate) and (
            r.system not in lowest or r.request_rate < lowest[r.system].request_rate
        ):
            lowest[r.system] = r
    if not lowest:
        raise ValueError("capacity needs at least one finite request rate")
    reference = min(r.summary["normalized_latency_median"] for r in lowest.values())
    return factor * reference, reference


def capacity_report(results: list[RunResult], factor: float) -> dict:
    """Empty systems and ratios when the sweep has no finite rate (only 'inf')."""
    if all(math.isinf(r.request_rate) for r in results):
        return {"factor": factor, "systems": {}, "ratios": {}}
    threshold, reference = capacity_threshold(results, factor)
    systems = {}
    for system in dict.fromkeys(r.system for r in results):
        points = [
            (r.request_rate, r.summary["normalized_latency_median"])
            for r in results
            if r.system == system
        ]
        if any(not math.isinf(rate) for rate, _ in points):
            systems[system] = capacity(points, threshold)._asdict()
    return {
        "factor": factor,
        "reference_s_per_token": reference,
        "threshold_s_per_token": threshold,
        "systems": systems,
        "ratios": _ratios_of(systems, _capacity_ratio_of),
    }


def _capacity_ratio_of(ours: dict, theirs: dict) -> dict:
    ratio, bound = capacity_ratio(Capacity(**ours), Capacity(**theirs))
    return {"ratio": ratio, "bound": bound}


def goodput_report(results: list[RunResult], tbt_slo: float) -> dict:
    """Each system's best goodput over the sweep, and the rate it was reached at."""
    systems = {}
    for r in results:
        best = systems.get(r.system)
        if best is None or r.summary["goodput"] > best["goodput"]:
            systems[r.system] = {
                "goodput": r.summary["goodput"],
                "request_rate": _json_rate(r.request_rate),
            }
    return {
        "tbt_slo_s": tbt_slo,
        "systems": systems,
        "ratios": _ratios_of(systems, _goodput_ratio_of),
    }


def _goodput_ratio_of(ours: dict, theirs: dict) -> dict:
    ratio = ours["goodput"] / theirs["goodput"] if theirs["goodput"] > 0 else math.inf
    return {"ratio": _json_rate(ratio)}


def _ratios_of(systems: dict, ratio_of) -> dict:
    ours = systems.get(CONTINUOUS)
    if ours is None:
        return {}
    return {s: ratio_of(ours, theirs) for s, theirs in systems.items() if s != CONTINUOUS}


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
        "capacity": capacity_report(results, args.capacity_factor),
        "goodput": goodput_report(results, args.tbt_slo),
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
    ("TBT p99", "tbt_p99_median", ">8", ".3f"),
    ("goodput", "goodput", ">8", ".3f"),
)


def format_table(report: dict) -> str:
    header = "  ".join(f"{title:{align}}" for title, _, align, _ in TABLE_COLUMNS)
    lines = [
        "",
        "norm = end-to-end latency / output tokens (s/token); TTFT in s; batch = mean requests "
        "per step; joins = requests that joined a batch in progress;\nTBT p99 = median over "
        "requests of their p99 time between tokens (s); goodput = requests/s meeting the "
        "TBT SLO",
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


def format_headline(report: dict) -> str:
    cap, good = report["capacity"], report["goodput"]
    lines = [""]
    if cap["systems"]:
        lines.append(
            f"capacity: request rate at median normalized latency <= "
            f"{cap['threshold_s_per_token']:.4g} s/token ({cap['factor']:g}x the lowest-load "
            f"{cap['reference_s_per_token']:.4g}), interpolated over the sweep"
        )
    for system, c in cap["systems"].items():
        lines.append(f"  {system:<16} {_bound_text(c['bound'])}{c['rate']:.3g} req/s")
    for system, r in cap["ratios"].items():
        lines.append(
            f"  {CONTINUOUS} / {system:<16} capacity {_bound_text(r['bound'])}{r['ratio']:.2f}x"
        )
    lines.append(
        f"goodput: requests/s with p99 time between tokens <= {good['tbt_slo_s']:g} s, "
        "best over the sweep"
    )
    for system, g in good["systems"].items():
        lines.append(
            f"  {system:<16} {g['goodput']:.3f} req/s (at {_rate_label(g['request_rate'])} req/s)"
        )
    for system, r in good["ratios"].items():
        lines.append(f"  {CONTINUOUS} / {system:<16} goodput {float(r['ratio']):.2f}x")
    return "\n".join(lines)


def _bound_text(bound: str) -> str:
    return {"=": "", ">=": ">= ", "<=": "<= ", "?": "~ "}[bound]


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
    from benchmarks import plots

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report | {"runs": [_run_dict(r) for r in results]}
    json_path = out_dir / "compare.json"
    json_path.write_text(json.dumps(data, indent=1))
    timeline_rate = args.timeline_rate
    if timeline_rate is None:
        timeline_rate = args.request_rates[len(args.request_rates) // 2]
    return [json_path, *plots.plot_all(results, out_dir, timeline_rate, report)]


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
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
