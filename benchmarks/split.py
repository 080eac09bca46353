"""`python -m benchmarks split`: the engine-core process measured against its alternatives, in one
run.

Systems, on the same requests (random token prompts, exact output lengths, greedy):
  offline        LLM.generate in this process: no HTTP, no second process (the ceiling);
  http-process   `conveyor serve` (the engine core in its own process), streamed over HTTP;
  http-thread    `conveyor serve --no-engine-process` (the engine on a thread of the server).

For each concurrency: output tokens/s of each system and its ratio to offline (the mean of an
offline run before and one after the servers; each server starts once), and /health
latency seen by a separate prober process while the streams run (p50 / p99). Then /health
under many short streams (the front end's worst case). Finally the engine's own time per step
at a batch of decoding requests: scheduling, input preparation, sampling and output handling
(including encoding the step message for the front end) against the model forward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import pickle
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

SYSTEMS = ("offline", "http-process", "http-thread")
SERVER_FLAGS = {"http-process": [], "http-thread": ["--no-engine-process"]}
# /health is probed every 50 ms under the many-stream test, and only every 250 ms while
# throughput is measured: the prober's own requests take CPU from the server under test.
PROBE_PERIOD = 0.05
THROUGHPUT_PROBE_PERIOD = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--waves",
        type=int,
        default=3,
        help="requests per concurrency = concurrency x waves (the batch refills as they finish)",
    )
    parser.add_argument(
        "--health-streams",
        type=int,
        default=1000,
        help="concurrent short streams for the /health test (0 skips it)",
    )
    parser.add_argument("--health-output-len", type=int, default=8)
    parser.add_argument(
        "--overhead-batch", type=int, default=64, help="decoding requests for the overhead part"
    )
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    from conveyor import LLM, SamplingParams
    from conveyor.bench.datasets import random_requests

    engine = {"dtype": args.dtype, "device": args.device, "num_threads": args.num_threads}
    llm = LLM(args.model, record_trace=True, **engine)
    tokenizer = llm.get_tokenizer()
    report: dict = {"model": str(llm.engine.model_config.path), "throughput": [], "health": {}}
    workloads = {
        c: random_requests(
            tokenizer, c * args.waves, args.input_len, args.output_len, seed=args.seed + c
        )
        for c in args.concurrency
    }
    overhead = _overhead(llm, args, SamplingParams)
    del llm
    serve_args = _serve_args(args)
    print(f"{args.input_len}-token prompts, {args.output_len} output tokens, greedy")
    # Offline: at most c requests in the batch, the next joining as one finishes (what a client
    # holding c streams open gives a server), measured before and after the servers so that a
    # drift of the machine's speed during the run cancels out. Each server starts once and
    # serves every concurrency, then the many-stream /health test.
    before = {c: _offline_at(args, engine, c, requests) for c, requests in workloads.items()}
    rows = {c: {"concurrency": c} for c in workloads}
    for system, flags in SERVER_FLAGS.items():
        with Server(serve_args + flags) as server:
            for c, requests in workloads.items():
                tok_s, health, errors = server.measure(requests, c, THROUGHPUT_PROBE_PERIOD)
                rows[c][system] = tok_s
                rows[c][f"{system}_health_ms"] = health
                rows[c][f"{system}_errors"] = errors
            if args.health_streams > 0:
                print(f"  /health under {args.health_streams} short streams:", flush=True)
                requests = random_requests(
                    tokenizer, args.health_streams, 16, args.health_output_len, seed=args.seed
                )
                tok_s, health, errors = server.measure(requests, args.health_streams)
                report["health"][system] = {"health_ms": health, "errors": errors, "tok_s": tok_s}
    for c, requests in workloads.items():
        after = _offline_at(args, engine, c, requests, again=True)
        row = rows[c]
        row["offline"], row["offline_runs"] = (before[c] + after) / 2, [before[c], after]
        report["throughput"].append(row)
    report["overhead"] = overhead
    print(format_report(report, args))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2))
        print(f"results written to {args.result_file}")
    return 0


def _offline_at(args, engine: dict, c: int, requests, again: bool = False) -> float:
    from conveyor import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=c, **engine)
    tok_s = _offline(llm, requests, SamplingParams)
    print(f"  offline, {c} in the batch{', again' if again else ''}: {tok_s:.1f} output tok/s")
    return tok_s


def _serve_args(args: argparse.Namespace) -> list[str]:
    return model_flags(args) + ["--max-num-seqs", "1024"]


def model_flags(args: argparse.Namespace) -> list[str]:
    """`conveyor serve` flags for a benchmark's model flags (model, dtype, device, threads):
    what every command that starts its own servers passes on."""
    flags = ["--dtype", args.dtype, "--device", args.device]
    if args.model:
        flags.insert(0, args.model)
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    return flags


# ---- offline ------------------------------------------------------------------------------


def _offline(llm, requests, sampling_params) -> float:
    llm.generate([[5, 6, 7]], sampling_params(max_tokens=4), use_tqdm=False)  # warm-up
    params = [
        sampling_params(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def _overhead(llm, args: argparse.Namespace, sampling_params) -> dict:
    """Median parts of the steps in which `overhead_batch` requests decode together, and the
    cost of encoding such a step's message for the front end."""
    from conveyor.engine.core_proc import encode
    from conveyor.messages import StepOutput

    batch = args.overhead_batch
    rng = np.random.default_rng(args.seed)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.get_tokenizer()))
    prompts = [rng.integers(0, vocab, size=16).tolist() for _ in range(batch)]
    params = sampling_params(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    core = llm.engine.core
    core.observer.trace.clear()
    outputs = []
    original_step = core.step

    def step():  # keep the last full-batch step's outputs, to time their encoding
        out = original_step()
        if len(out) == batch:
            outputs[:] = out
        return out

    core.step = step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del core.step
    steps = [t.timing for t in core.observer.trace if len(t.num_scheduled_tokens) == batch]
    steps = [t for t in steps if t.sample > 0]  # decode steps: every request samples
    stats = core.get_stats()
    message = StepOutput(outputs, stats)
    encode_s = statistics.median(_timed(lambda: encode(message)) for _ in range(50))
    parts = {
        name: statistics.median(getattr(t, name) for t in steps) * 1e3
        for name in ("schedule", "prepare", "forward", "sample", "update")
    }
    parts["encode"] = encode_s * 1e3
    total = sum(parts.values())
    return {
        "batch": batch,
        "num_steps": len(steps),
        "parts_ms": parts,
        "step_ms": total,
        "engine_share": (total - parts["forward"]) / total,
        "message_bytes": len(pickle.dumps(message, protocol=5)),
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- servers ------------------------------------------------------------------------------


class Server:
    """A `conveyor serve` child process on a free local port, stopped with SIGTERM."""

    def __init__(self, flags: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.flags = flags

    def __enter__(self) -> Server:
        cmd = [sys.executable, "-m", "conveyor.cli", "serve", *self.flags]
        cmd += ["--port", str(self.port), "--log-level", "warning"]
        print(f"starting: conveyor serve {' '.join(self.flags)}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("the server did not become ready in 600 s")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def measure(
        self, requests, concurrency: int, probe_period: float = PROBE_PERIOD
    ) -> tuple[float, dict, int]:
        """Output tok/s of the requests at this concurrency, /health latency percentiles (ms)
        seen by a prober process meanwhile, and the number of failed requests."""
        asyncio.run(self._run(requests[:2], 2))  # warm-up
        probe = Probe(f"{self.base_url}/health", probe_period)
        try:
            results, duration = asyncio.run(self._run(requests, concurrency))
        finally:
            latencies = probe.stop()
        tokens = sum(count for count in results if count is not None)
        errors = sum(1 for count in results if count is None)
        health = {
            "p50": float(np.percentile(latencies, 50)) if latencies else None,
            "p99": float(np.percentile(latencies, 99)) if latencies else None,
            "max": max(latencies, default=None),
            "probes": len(latencies),
        }
        print(
            f"  {concurrency} streams: {tokens / duration:.1f} output tok/s, /health p99 "
            f"{_ms(health['p99'])} ms, {errors} failed",
            flush=True,
        )
        return tokens / duration, health, errors

    async def _run(self, requests, concurrency: int) -> tuple[list[int | None], float]:
        """Streams every request at this concurrency; the output tokens of each (None: it
        failed) and the wall time. Only the last chunk (usage) is parsed: this throughput
        figure needs no per-token timing, and parsing every chunk takes CPU from the server
        under test on a machine that runs both."""
        from conveyor.bench.serve import client_session, first_model

        limit = asyncio.Semaphore(concurrency)
        async with client_session(concurrency) as client:
            model = await first_model(client, self.base_url, {})
            url = f"{self.base_url}/v1/completions"

            async def one(request) -> int | None:
                payload = {
                    "model": model,
                    "prompt": request.prompt_token_ids,
                    "max_tokens": request.output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with limit:
                    return await _stream_tokens(client, url, payload)

            start = time.perf_counter()
            counts = await asyncio.gather(*(one(r) for r in requests))
            return list(counts), time.perf_counter() - start


async def _stream_tokens(client, url: str, payload: dict) -> int | None:
    """Completion tokens of one streamed request from its usage chunk; None on any failure
    (an HTTP error, an error event, no usage, no [DONE])."""
    import aiohttp

    last = None
    try:
        async with client.post(url, json=payload) as response:
            if response.status != 200:
                return None
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    usage = json.loads(last[6:]).get("usage") if last else None
                    return usage["completion_tokens"] if usage else None
                if line.startswith(b"data: "):
                    last = line
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    return None


class Probe:
    """GET /health every `period` s from a process of its own (so the client's own load
    does not count), until stop(); the latencies in ms."""

    def __init__(self, url: str, period: float) -> None:
        spawn = multiprocessing.get_context("spawn")
        self._stop, ready = spawn.Event(), spawn.Event()
        self._receive, send = spawn.Pipe(duplex=False)
        args = (url, period, self._stop, ready, send)
        self._proc = spawn.Process(target=_probe, args=args, daemon=True)
        self._proc.start()
        if not ready.wait(60):  # the first probe has answered: the run may start
            raise RuntimeError("the /health prober did not start")

    def stop(self) -> list[float]:
        self._stop.set()
        latencies = self._receive.recv() if self._receive.poll(30) else []
        self._proc.join(10)
        return latencies


def _probe(url: str, period: float, stop, ready, send) -> None:
    latencies = []
    with httpx.Client(timeout=30) as client:
        client.get(url)
        ready.set()
        while not stop.is_set():
            start = time.perf_counter()
            try:
                client.get(url)
                latencies.append((time.perf_counter() - start) * 1e3)
            except httpx.HTTPError:
                pass
            time.sleep(period)
    send.send(latencies)


# ---- report -------------------------------------------------------------------------------


def format_report(report: dict, args: argparse.Namespace) -> str:
    lines = [
        "",
        f"model {report['model']}; {args.input_len}-token prompts, {args.output_len} output "
        "tokens, greedy, EOS ignored",
        "",
        "| concurrency | offline tok/s (before / after) | http-process tok/s (x offline) | "
        "http-thread tok/s (x offline) | /health p99 ms: process / thread |",
        "|---|---|---|---|---|",
    ]
    for row in report["throughput"]:
        off, (before, after) = row["offline"], row["offline_runs"]
        lines.append(
            f"| {row['concurrency']} | {off:.1f} ({before:.1f} / {after:.1f}) | "
            f"{row['http-process']:.1f} "
            f"({row['http-process'] / off:.2f}x) | {row['http-thread']:.1f} "
            f"({row['http-thread'] / off:.2f}x) | {_ms(row['http-process_health_ms']['p99'])} / "
            f"{_ms(row['http-thread_health_ms']['p99'])} |"
        )
    if report["health"]:
        lines += ["", f"/health under {args.health_streams} concurrent short streams:", ""]
        lines += ["| system | p50 ms | p99 ms | max ms | failed streams |", "|---|---|---|---|---|"]
        for system, result in report["health"].items():
            h = result["health_ms"]
            lines.append(
                f"| {system} | {_ms(h['p50'])} | {_ms(h['p99'])} | {_ms(h['max'])} | "
                f"{result['errors']} |"
            )
    o = report["overhead"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in o["parts_ms"].items())
    lines += [
        "",
        f"engine time per step at {o['batch']} decoding requests (median of {o['num_steps']} "
        f"steps, ms): {parts}",
        f"engine share outside the forward: {o['engine_share']:.1%} of a {o['step_ms']:.1f} ms "
        f"step; the step message is {o['message_bytes']} bytes",
    ]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
