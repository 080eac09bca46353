"""`python -m benchmarks dashboard`: what watching the dashboard costs, side by side in one sitting.

Two servers of the same model, one after the other in alternating order over the rounds
(off watched watched off ...): `off` runs with --no-dashboard, `watched` with the dashboard and
`--watchers` clients reading its event stream (what an open page reads, twice a second) for the
whole run. Every run streams the same kind of random prompts at one concurrency, greedy, EOS
ignored. The report gives each one's output tok/s and the ratio watched / off, and what the
engine itself measured of the cost: the step records' share of the step time and the time a
snapshot takes the core per update.

`--screenshot PATH`: after the measured runs, one more watched run under the same load, with
the page open in headless Chromium (Playwright with Debian's chromium), saved as PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import httpx

LAYOUTS = ["off", "watched"]
CHROMIUM = "/usr/bin/chromium"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--random-input-len", type=int, default=200)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--watchers", type=int, default=1, help="event-stream readers")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads of a server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--screenshot", default=None, help="PNG of the page under load, after the runs"
    )
    add_result_args(parser)


class Watcher(threading.Thread):
    """Reads /dashboard/events as the page does, until stopped; keeps the last message."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.messages = 0
        self.last: dict | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("GET", f"{self.base_url}/dashboard/events", timeout=30) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.last = json.loads(line[6:])
                        self.messages += 1
                    if self._done.is_set():
                        return
        except Exception as error:  # noqa: BLE001 - reported with the run
            self.error = repr(error)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


def main(args: argparse.Namespace) -> int:
    from benchmarks.scaling import _stream, measure, report_header, run_order, save_report
    from benchmarks.split import Server, model_flags
    from conveyor.bench.datasets import random_requests
    from conveyor.bench.serve import load_tokenizer
    from conveyor.model.config import ModelConfig

    order = run_order(len(LAYOUTS), args.rounds)
    config = ModelConfig.from_hf(args.model)
    tokenizer = load_tokenizer(args.model)
    lengths = (args.random_input_len, args.random_output_len)
    warmup = random_requests(tokenizer, 2, args.random_input_len, 16, 0.0, args.seed + 100_000)
    report = report_header(args, config) | {
        "watchers": args.watchers,
        "order": [LAYOUTS[i] for i in order],
        "runs": [],
    }
    for step, index in enumerate(order, 1):
        layout = LAYOUTS[index]
        batch = random_requests(tokenizer, args.num_prompts, *lengths, 0.0, args.seed + step)
        flags = model_flags(args) + ([] if layout == "watched" else ["--no-dashboard"])
        with Server(flags) as server:
            asyncio.run(_stream(server.base_url, warmup, 2, tokenizer))
            watchers = []
            if layout == "watched":
                watchers = [Watcher(server.base_url) for _ in range(args.watchers)]
                for watcher in watchers:
                    watcher.start()
            start = time.monotonic()
            run = {"layout": layout} | measure(
                server.base_url, batch, args.max_concurrency, tokenizer
            )
            elapsed = time.monotonic() - start
            for watcher in watchers:
                watcher.stop()
            if watchers:
                run |= _watch_report(watchers, elapsed)
        report["runs"].append(run)
        print(f"[{step}/{len(order)}] {_progress(run)}", flush=True)
    report["summary"] = summarize(report["runs"])
    print(format_report(report))
    if args.screenshot:
        # Lengths that vary (+-90%), so that requests join and leave at every step.
        batch = random_requests(tokenizer, args.num_prompts, *lengths, 0.9, args.seed)
        with Server(model_flags(args)) as server:
            screenshot(server.base_url, batch, args.max_concurrency, tokenizer, args.screenshot)
        print(f"written: {args.screenshot}")
    save_report(report, args, "dashboard")
    return 0


def _watch_report(watchers: list[Watcher], elapsed: float) -> dict:
    last = next((w.last for w in watchers if w.last), None) or {}
    cost = last.get("cost", {})
    step_seconds = cost.get("step_seconds") or 0.0
    return {
        "updates_per_s": sum(w.messages for w in watchers) / len(watchers) / elapsed,
        "watch_errors": [w.error for w in watchers if w.error],
        "record_share": cost.get("record_seconds", 0.0) / step_seconds if step_seconds else None,
        "snapshot_ms": cost.get("snapshot_ms"),
        "engine_busy": (last.get("rates") or {}).get("busy"),
    }


def summarize(runs: list[dict]) -> list[dict]:
    from benchmarks.scaling import summarize as summarize_layouts

    rows = summarize_layouts(runs, LAYOUTS, baseline=lambda layout: LAYOUTS[0])
    watched = [r for r in runs if r["layout"] == "watched" and r.get("record_share") is not None]
    if watched:
        rows[1]["updates_per_s"] = statistics.fmean(r["updates_per_s"] for r in watched)
        rows[1]["record_share"] = statistics.fmean(r["record_share"] for r in watched)
        rows[1]["snapshot_ms"] = statistics.fmean(r["snapshot_ms"] or 0 for r in watched)
    return rows


def _progress(run: dict) -> str:
    text = (
        f"{run['layout']}: {run['output_throughput']:.1f} output tok/s, TPOT p50 "
        f"{run['median_tpot_ms'] or 0:.0f} ms, {run['completed']} done, {run['failed']} failed"
    )
    if "updates_per_s" in run:
        text += f", {run['updates_per_s']:.2f} updates/s read"
        if run["watch_errors"]:
            text += f", watcher errors: {run['watch_errors']}"
    return text


def format_report(report: dict) -> str:
    lines = [
        f"\n{report['num_prompts']} prompts of {report['input_len']} tokens -> "
        f"{report['output_len']} tokens at {report['max_concurrency']} streams; "
        f"run order {' '.join(report['order'])}; {report['watchers']} watcher(s)",
        f"{'layout':<9}{'output tok/s':>14}{'ratio':>9}{'TPOT p50':>11}{'TTFT p50':>11}"
        f"{'failed':>8}  runs",
    ]
    for row in report["summary"]:
        lines.append(
            f"{row['layout']:<9}{row['output_throughput']:>14.1f}{row['ratio']:>8.3f}x"
            f"{row['median_tpot_ms']:>9.0f}ms{row['median_ttft_ms']:>9.0f}ms{row['failed']:>8}"
            f"  {row['each']}"
        )
    watched = report["summary"][1]
    if "record_share" in watched:
        lines.append(
            f"measured by the engine: step records {100 * watched['record_share']:.3f}% of the "
            f"step time; a snapshot {watched['snapshot_ms']:.2f} ms of the core per update, "
            f"{watched['updates_per_s']:.2f} updates/s"
        )
    return "\n".join(lines)


def screenshot(base_url: str, requests, concurrency: int, tokenizer, path: str) -> None:
    """The page in headless Chromium, photographed once the batch is full."""
    from playwright.sync_api import sync_playwright

    from benchmarks.scaling import _stream

    load = threading.Thread(
        target=lambda: asyncio.run(_stream(base_url, requests, concurrency, tokenizer)),
        daemon=True,
    )
    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    args += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(f"{base_url}/dashboard")
        page.wait_for_function("window.dashboardUpdates >= 1", timeout=30_000)
        load.start()
        # Well into the load (60% done, or 45 s): the lanes show joins, leaves, a full batch.
        target, deadline = 0.6 * len(requests), time.monotonic() + 45
        while time.monotonic() < deadline and load.is_alive():
            done = page.evaluate("Number(document.getElementById('v-finished').dataset.value)")
            if done >= target:
                break
            time.sleep(0.25)
        page.screenshot(path=path, full_page=True)
        browser.close()
    load.join()
