"""`python -m benchmarks start`: a `conveyor serve` start, this tree against another revision.

Each start runs `python -m conveyor.cli serve MODEL` from a tree (its own code on PYTHONPATH, the
engine core started from the same tree), and measures the seconds until /health answers 200 and
the CPU seconds of the server's processes (front end and engine core) from start to a SIGINT
stop, read from getrusage(RUSAGE_CHILDREN). With --against REV the revision is checked out in a
temporary git worktree and the two trees start in turn, --rounds times each (this tree first),
so that the machine's drift falls on both; the medians and their ratios are printed. Both trees
run with this venv: a revision whose dependencies differ is measured with today's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the default model")
    parser.add_argument("--against", default=None, metavar="REV", help="a git revision")
    parser.add_argument("--rounds", type=int, default=3, help="starts of each tree")
    parser.add_argument(
        "--serve-args", default="", help="more `conveyor serve` flags, e.g. '--dtype float32'"
    )
    parser.add_argument("--save-result", default=None, metavar="FILE", help="JSON of the runs")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_once(tree: Path, argv: list[str]) -> dict[str, float]:
    """One start of `conveyor serve ARGV` from `tree`: seconds to /health, CPU seconds."""
    port = _free_port()
    command = [sys.executable, "-m", "conveyor.cli", "serve", *argv, "--port", str(port)]
    command += ["--log-level", "warning"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    env = os.environ | {"PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"the server from {tree} exited:\n{tail}")
                if time.perf_counter() - began > READY_TIMEOUT:
                    raise RuntimeError(f"the server from {tree} was not ready in time")
                try:
                    url = f"http://127.0.0.1:{port}/health"
                    if httpx.get(url, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            ready = time.perf_counter() - began
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"ready_s": ready, "cpu_s": cpu}


def _worktree(revision: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="conveyor-start-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(folder), revision],
        check=True,
    )
    return folder


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    argv = ([args.model] if args.model else []) + args.serve_args.split()
    trees = {"this tree": ROOT}
    other = None
    if args.against:
        other = _worktree(args.against)
        trees[args.against] = other
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                run = start_once(tree, argv)
                runs[name].append(run)
                print(
                    f"round {round_ + 1}, {name}: ready {run['ready_s']:.2f} s, "
                    f"CPU {run['cpu_s']:.1f} s",
                    flush=True,
                )
    finally:
        if other is not None:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                check=False,
            )
    print(f"\n{'tree':<16} {'ready (s), median':>18} {'CPU (s), median':>16}")
    medians = {}
    for name, done in runs.items():
        ready = statistics.median(r["ready_s"] for r in done)
        cpu = statistics.median(r["cpu_s"] for r in done)
        medians[name] = (ready, cpu)
        print(f"{name:<16} {ready:>18.2f} {cpu:>16.1f}")
    if args.against:
        (ready, cpu), (ready_b, cpu_b) = medians["this tree"], medians[args.against]
        print(f"this tree / {args.against}: ready {ready / ready_b:.2f}x, CPU {cpu / cpu_b:.2f}x")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"argv": argv, "runs": runs}, indent=1))
    return 0
