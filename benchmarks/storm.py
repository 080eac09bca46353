"""`python -m benchmarks storm`: a connection storm against a running server, and /health meanwhile.

Opens --num-streams short chat streams at once (each its own connection); one in
1 / --cancel-fraction closes its connection after the first chunk, the way an impatient
client does. Meanwhile a separate process (httpx, not this client) GETs /health every
--probe-period seconds. Then it reports the streams that failed (an HTTP error, an error
event, no [DONE] on a stream that was not cut), the requests the server still counts as
running or waiting once the storm is over (/metrics), and the /health latency (p50, p99,
max): the question is whether the event loop answers a probe promptly while it serves a
thousand streams' bookkeeping.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from conveyor import envs

# Metrics that must fall back to zero once every stream ended or was cut.
LEFT_GAUGES = ("conveyor:num_requests_running", "conveyor:num_requests_waiting")
SETTLE_SECONDS = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-streams", type=int, default=1000)
    parser.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.1,
        help="share of the streams closed by the client after their first chunk",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per stream")
    parser.add_argument(
        "--probe-period", type=float, default=0.02, help="seconds between /health probes"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer key (default: $CONVEYOR_API_KEY, if set)"
    )
    parser.add_argument("--result-file", default=None, help="also write the result as JSON")


def main(args: argparse.Namespace) -> int:
    if args.num_streams < 1 or not 0 <= args.cancel_fraction <= 1 or args.probe_period <= 0:
        raise ValueError("--num-streams >= 1, --cancel-fraction in [0, 1], --probe-period > 0")
    from benchmarks.split import Probe

    key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    probe = Probe(f"{args.base_url}/health", args.probe_period)
    try:
        start = time.perf_counter()
        outcomes = asyncio.run(_storm(args, headers))
        duration = time.perf_counter() - start
    finally:
        latencies = probe.stop()
    left = _settled(args.base_url, headers)
    result = summarize(outcomes, latencies, left, duration)
    print(format_result(result, args), flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0


def summarize(outcomes: list[str], latencies: list[float], left: dict, duration: float) -> dict:
    """outcomes: "done", "cut" or an error message, one per stream; latencies in ms."""

    def percentile(q: float) -> float | None:
        return float(np.percentile(latencies, q)) if latencies else None

    errors = [o for o in outcomes if o not in ("done", "cut")]
    return {
        "num_streams": len(outcomes),
        "num_cut": outcomes.count("cut"),
        "errors": len(errors),
        "first_errors": errors[:5],
        "left_running": left,
        "duration_s": duration,
        "health_ms": {
            "p50": percentile(50),
            "p99": percentile(99),
            "max": max(latencies, default=None),
            "probes": len(latencies),
        },
    }


def format_result(result: dict, args: argparse.Namespace) -> str:
    h = result["health_ms"]
    left = ", ".join(
        f"{name.split(':')[1]} {value:g}" for name, value in result["left_running"].items()
    )
    lines = [
        f"streams: {result['num_streams']} opened at once ({result['num_cut']} cut after the "
        f"first chunk), {args.max_tokens} tokens each, {result['duration_s']:.1f} s",
        f"errors: {result['errors']}",
        f"left running: {left}",
        f"/health ({h['probes']} probes, every {args.probe_period * 1e3:g} ms): p50 "
        f"{_ms(h['p50'])} ms, p99 {_ms(h['p99'])} ms, max {_ms(h['max'])} ms",
    ]
    lines += [f"  error: {e}" for e in result["first_errors"]]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def _storm(args: argparse.Namespace, headers: dict[str, str]) -> list[str]:
    from conveyor.bench.serve import client_session, first_model

    async with client_session(None) as client:
        model = args.model or await first_model(client, args.base_url, headers)
        every = round(1 / args.cancel_fraction) if args.cancel_fraction > 0 else 0
        url = f"{args.base_url}/v1/chat/completions"

        def payload(i: int) -> dict:
            text = f"Stream {i}: name a colour and a fruit."
            return {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": args.max_tokens,
                "stream": True,
            }

        streams = (
            _one(client, url, headers, payload(i), cut=every > 0 and i % every == 0)
            for i in range(args.num_streams)
        )
        return list(await asyncio.gather(*streams))


async def _one(client, url: str, headers: dict, payload: dict, cut: bool) -> str:
    """ "done", "cut" (closed by us after the first chunk) or what went wrong."""
    import aiohttp

    try:
        async with client.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.read())[:200]!r}"
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    return "done"
                if b'"error"' in line[:16]:
                    return f"error event: {line[:200]!r}"
                if cut:
                    response.close()  # the connection, not just this response
                    return "cut"
    except (TimeoutError, aiohttp.ClientError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return "no [DONE]"


def _settled(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """The LEFT_GAUGES once they reach zero (or after SETTLE_SECONDS: what is left)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
        values = dict.fromkeys(LEFT_GAUGES, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in values:
                    values[sample.name] += sample.value
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)
