"""`python -m benchmarks peers`: conveyor against the servers its users compare it with (vLLM's
CPU backend, llama.cpp's llama-server), one at a time in one sitting, with the same client and
the same prompts for each.

Each system is a server command. It is started alone on a free port (in its own process group,
so that its children go with it), waited for (`/health` and `/v1/models` answer 200), warmed
up with prompts of its own (16 at 8 streams, 32 tokens each, not counted), then measured at each
concurrency C with 2C prompts (at least 4), streamed to `/v1/completions` as token ids, greedy,
EOS ignored (vLLM's `random` dataset: `--input-len` and `--output-len` tokens, both varied by
`--range-ratio`), and stopped. Each concurrency has prompts of its own (the seed plus the
concurrency's index: the same prompts for every system), and the warm-up yet others, so that no
server's prompt cache can hold a measured prompt: llama-server keeps each slot's last prompt
whatever the flags, and in a hand-run sitting of 2026-12-04 (a Zen 4) its 8-stream run, whose
prompts repeated the warm-up's, showed a mean TTFT of 87 ms against 2.9 s with fresh ones.
conveyor and vLLM run with prefix caching off.

Built-in systems (`--systems` names; a name may come twice, e.g. conveyor first and last, so
that the machine's drift over the sitting shows):
  conveyor   conveyor serve [MODEL] --no-enable-prefix-caching [--conveyor-args ...]
  vllm       vLLM's CPU backend as `--vllm-dir` holds it (venv/ and the default model's weights
             in bfloat16 in smollm2-bf16/; docs/benchmarks.md, "The peers", says how to install
             it), its OpenMP threads on every core of --num-threads, tcmalloc and Intel's OpenMP
             preloaded where found, as vLLM's CPU guide asks (without them it made 0.89-0.93x
             the tokens here, and 1.5x the TTFT at 64 streams)
  llama      llama-server (`--llama-server`) on the GGUF file (`--llama-model`, default the
             default model's), -t/-tb threads, one slot per stream of the largest concurrency
Any other: `--system NAME='COMMAND'`, `{port}` and `{threads}` filled in (e.g. llama-server on
another file, or conveyor with other flags).

The report: per system and concurrency output tok/s, mean TTFT, p99 inter-token latency and
failed requests; then the first system's ratios to each other one (each system's mean over its
runs): output tok/s (> 1: the first is faster), mean TTFT and p99 ITL (< 1: the first is lower).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ANCHORS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "conveyor-anchor"
BUILT_IN = ("conveyor", "vllm", "llama")
WARMUP = (16, 8, 32)  # prompts, streams, output tokens
CELL = 31  # characters of a column of the report
READY_TIMEOUT = 900.0  # vLLM compiles its model at every start (1-2 min on 2 cores)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.bench.args import add_result_args
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["conveyor", "vllm", "llama", "conveyor"],
        help=f"in the order they run: {', '.join(BUILT_IN)} or a --system name; the first is "
        "the one the ratios are of",
    )
    parser.add_argument(
        "--system",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="another server: a command line with {port} (and {threads}) in it",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--input-len", type=int, default=209)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.47)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-threads", type=int, default=None, help="threads of every server (default: all cores)"
    )
    parser.add_argument(
        "--conveyor-args", default="", help="more `conveyor serve` flags, as one string"
    )
    parser.add_argument("--vllm-dir", type=Path, default=ANCHORS / "vllm")
    parser.add_argument("--vllm-dtype", choices=("bf16", "f32"), default="bf16")
    parser.add_argument(
        "--llama-server", type=Path, default=ANCHORS / "llama-build" / "bin" / "llama-server"
    )
    parser.add_argument("--llama-model", type=Path, default=None)
    add_result_args(parser)


@dataclass
class System:
    """A server to start: its argv (with {port} and {threads} still to fill in) and env."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def custom_systems(specs: list[str]) -> dict[str, System]:
    systems = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        name = name.strip()
        if not sep or not name or not command.strip():
            raise ValueError(f"--system: {spec!r} is not NAME=COMMAND")
        if name in BUILT_IN or name in systems:
            raise ValueError(f"--system: {name!r} is already a system")
        if "{port}" not in command:
            raise ValueError(f"--system {name}: the command has no {{port}} to listen on")
        systems[name] = System(name, shlex.split(command))
    return systems


def build_system(name: str, args: argparse.Namespace, custom: dict[str, System]) -> System:
    """The server command of a --systems name; a missing peer is a ValueError that says what
    to install."""
    if name in custom:
        return custom[name]
    if name == "conveyor":
        argv = [sys.executable, "-m", "conveyor", "serve"]
        argv += [args.model] if args.model else []
        argv += ["--dtype", args.dtype, "--device", args.device, "--no-enable-prefix-caching"]
        argv += ["--port", "{port}", "--num-threads", "{threads}"]
        return System(name, argv + shlex.split(args.conveyor_args))
    if name == "vllm":
        vllm = args.vllm_dir / "venv" / "bin" / "vllm"
        weights = args.vllm_dir / f"smollm2-{args.vllm_dtype}"
        if not vllm.exists() or not weights.is_dir():
            raise ValueError(
                f"vllm: no vLLM CPU install at {args.vllm_dir} ({vllm} and {weights}/): "
                'docs/benchmarks.md, "The peers", says how to install it, or pass --vllm-dir'
            )
        dtype = {"bf16": "bfloat16", "f32": "float32"}[args.vllm_dtype]
        argv = [str(vllm), "serve", str(weights), "--host", "127.0.0.1", "--port", "{port}"]
        argv += ["--dtype", dtype, "--max-model-len", "2048", "--no-enable-prefix-caching"]
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": "0-{last_core}",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        preload = vllm_preloads(args.vllm_dir)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return System(name, argv, env)
    if name == "llama":
        if not args.llama_server.exists():
            raise ValueError(
                f'llama: no llama-server at {args.llama_server}: docs/benchmarks.md, "The '
                'peers", says how to build it, or pass --llama-server'
            )
        model = args.llama_model or default_gguf(args.model)
        slots = max(args.concurrency)
        argv = [str(args.llama_server), "-m", str(model), "--host", "127.0.0.1"]
        argv += ["--port", "{port}", "-t", "{threads}", "-tb", "{threads}", "-np", str(slots)]
        argv += ["-c", str(slots * 512), "-cb", "--no-webui"]
        return System(name, argv)
    raise ValueError(
        f"--systems: {name!r} is none of {', '.join(BUILT_IN)} and no --system gives it"
    )


def vllm_preloads(vllm_dir: Path) -> list[str]:
    """tcmalloc and Intel's OpenMP (from vLLM's venv), each where it is found."""
    found = [p for p in TCMALLOC if Path(p).exists()][:1]
    iomp = vllm_dir / "venv" / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.exists() else [])


def default_gguf(model: str | None) -> Path:
    from conveyor.config import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        raise ValueError(f"llama: {path} is not a GGUF file: pass --llama-model")
    return path


def fill(system: System, port: int, threads: int) -> tuple[list[str], dict[str, str]]:
    """The argv and env with {port}, {threads} and {last_core} filled in; other braces (a JSON
    flag value) are left as they are."""
    values = {"port": port, "threads": threads, "last_core": threads - 1}

    def filled(text: str) -> str:
        for key, value in values.items():
            text = text.replace(f"{{{key}}}", str(value))
        return text

    return [filled(part) for part in system.argv], {k: filled(v) for k, v in system.env.items()}


class Server:
    """One system's server on a free local port, in its own process group, its output in a
    log file: start() waits until it answers, stop() ends the whole group."""

    def __init__(self, system: System, threads: int, log_dir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv, env = fill(system, self.port, threads)
        self.env = os.environ | env
        self.log = log_dir / f"{system.name}-{self.port}.log"

    def start(self) -> None:
        """Starts the server and waits until it answers; RuntimeError if it exits first or
        is not ready in READY_TIMEOUT (then it is stopped)."""
        import httpx

        print(f"starting: {shlex.join(self.argv)}", flush=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        start = time.monotonic()
        while time.monotonic() - start < READY_TIMEOUT:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.stop()  # whatever of its group outlived it
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {tail}")
            try:
                if all(
                    httpx.get(self.base_url + path, timeout=2).status_code == 200
                    for path in ("/health", "/v1/models")
                ):
                    self.ready_s = time.monotonic() - start
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not ready in {READY_TIMEOUT:.0f} s; log: {self.log}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left of it after a grace time."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15  # its children (vLLM's engine core) follow it
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def workloads(args: argparse.Namespace, tokenizer) -> tuple[list, list[list]]:
    """The warm-up's prompts and each concurrency's: every set drawn with its own seed."""
    from conveyor.bench.datasets import random_requests

    shape = (args.input_len, args.output_len, args.range_ratio)
    count, _, out = WARMUP
    warmup = random_requests(tokenizer, count, args.input_len, out, 0.0, args.seed + 100_000)
    runs = [
        random_requests(tokenizer, prompts_for(c), *shape, args.seed + i)
        for i, c in enumerate(args.concurrency)
    ]
    return warmup, runs


def prompts_for(concurrency: int) -> int:
    return max(4, 2 * concurrency)


def summarize(runs: list[dict], systems: list[str]) -> dict:
    """Per distinct system and concurrency: the mean over its runs; and the first system's
    ratios to each other one."""
    names = list(dict.fromkeys(systems))
    table: dict[str, dict[int, dict]] = {}
    for name in names:
        table[name] = {}
        for c in sorted({r["concurrency"] for r in runs}):
            mine = [r for r in runs if r["system"] == name and r["concurrency"] == c]
            if not mine:
                continue
            table[name][c] = {
                key: _mean(r[key] for r in mine)
                for key in ("output_throughput", "mean_ttft_ms", "p99_itl_ms")
            } | {"failed": sum(r["failed"] for r in mine), "runs": len(mine)}
    first = names[0]
    ratios = {}
    for name in names[1:]:
        ratios[name] = {}
        for c, mine in table[first].items():
            other = table[name].get(c)
            if other is None:
                continue
            ratios[name][c] = {
                key: _ratio(mine[key], other[key])
                for key in ("output_throughput", "mean_ttft_ms", "p99_itl_ms")
            }
    return {"first": first, "table": table, "ratios": ratios}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_summary(summary: dict, concurrencies: list[int]) -> str:
    cs = sorted(set(concurrencies))
    head = "".join(f" {f'{c} stream' + ('s' if c > 1 else ''):>{CELL}}" for c in cs)
    lines = [
        "output tok/s (mean TTFT ms; p99 ITL ms), the mean over a system's runs",
        f"{'system':<20}{head}",
    ]
    for name, row in summary["table"].items():
        cells = []
        for c in cs:
            cell = row.get(c)
            if cell is None:
                cells.append(f" {'-':>{CELL}}")
                continue
            ttft, itl = _num(cell["mean_ttft_ms"]), _num(cell["p99_itl_ms"])
            text = f"{cell['output_throughput']:.1f} ({ttft}; {itl})"
            text += f" {cell['failed']} failed" if cell["failed"] else ""
            cells.append(f" {text:>{CELL}}")
        lines.append(f"{name:<20}" + "".join(cells))
    first = summary["first"]
    for name, row in summary["ratios"].items():
        lines.append(f"{first} against {name}:")
        for key, label in (
            ("output_throughput", "output tok/s"),
            ("mean_ttft_ms", "mean TTFT"),
            ("p99_itl_ms", "p99 ITL"),
        ):
            cells = [f" {_x(row.get(c, {}).get(key)):>{CELL}}" for c in cs]
            lines.append(f"  {label:<18}" + "".join(cells))
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(args: argparse.Namespace) -> int:
    from benchmarks.scaling import measure
    from conveyor.bench.serve import load_tokenizer
    from conveyor.config import resolve_model_path

    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError("--concurrency: every value must be >= 1")
    custom = custom_systems(args.system)
    systems = {name: build_system(name, args, custom) for name in dict.fromkeys(args.systems)}
    threads = args.num_threads or len(os.sched_getaffinity(0))
    tokenizer = load_tokenizer(str(resolve_model_path(args.model)))
    warmup, run_requests = workloads(args, tokenizer)
    report = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "systems": args.systems,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "threads": threads,
        "runs": [],
    }
    log_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report["not_started"] = {}
    for name in args.systems:
        server = Server(systems[name], threads, log_dir)
        try:
            server.start()
        except RuntimeError as error:  # the sitting goes on without it, and says so
            print(f"{name}: did not start: {error}", flush=True)
            report["not_started"][name] = str(error)
            continue
        try:
            print(f"{name}: ready in {server.ready_s:.0f} s", flush=True)
            measure(server.base_url, warmup, WARMUP[1], tokenizer)
            for c, requests in zip(args.concurrency, run_requests, strict=True):
                run = {"system": name} | measure(server.base_url, requests, c, tokenizer)
                report["runs"].append(run)
                print(
                    f"  {c} streams: {run['output_throughput']:.1f} output tok/s, mean TTFT "
                    f"{_num(run['mean_ttft_ms'])} ms, p99 ITL {_num(run['p99_itl_ms'])} ms, "
                    f"{run['failed']} failed",
                    flush=True,
                )
        finally:
            server.stop()
    report["summary"] = summarize(report["runs"], args.systems)
    print(format_summary(report["summary"], args.concurrency))
    print(f"server logs: {log_dir}")
    if args.save_result:
        path = log_dir / (args.result_filename or f"peers-{report['date']}.json")
        path.write_text(json.dumps(report, indent=2))
        print(f"written: {path}")
    if report["not_started"]:
        print(f"did not start: {', '.join(report['not_started'])}", file=sys.stderr)
        return 1
    return 0
