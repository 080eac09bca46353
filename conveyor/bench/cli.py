"""`conveyor bench serve | throughput`: the commands.

Flag names follow `vllm bench serve` / `vllm bench throughput`, so a command line written for
one runs against the other (the shared flags are in bench/args.py). Each command's module is
imported only when its command runs.

The experiment lab (compare, step, quality, split, spec, structured, scaling, dashboard, storm)
is not part of the package: it lives in benchmarks/ at the root of the repository and runs as
`python -m benchmarks <command>` from a clone. `conveyor bench <lab command>` says so.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.bench.args import add_serve_args, add_throughput_args

# The lab's commands, which `conveyor bench` had until they moved to benchmarks/.
MOVED = (
    "compare",
    "step",
    "quality",
    "split",
    "spec",
    "structured",
    "scaling",
    "dashboard",
    "storm",
)
LAB = "python -m benchmarks"
LAB_INSTALL = "pip install -e '.[benchmarks]'"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark a server (serve) or the engine (throughput)",
        epilog=f"The experiment lab ({', '.join(MOVED)}) runs as `{LAB} <command>` from a "
        f"clone of the repository, after `{LAB_INSTALL}`.",
    )
    # metavar: the moved commands' stand-ins below are left out of the usage line.
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{serve,throughput}"
    )
    serve = bench_sub.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server, seen by a client"
    )
    add_serve_args(serve)
    serve.set_defaults(func=_run_serve)
    throughput = bench_sub.add_parser("throughput", help="offline throughput of LLM.generate")
    add_throughput_args(throughput)
    throughput.set_defaults(func=_run_throughput)
    for name in MOVED:
        # No help (not listed) and no option prefix ("\0" never starts a word): every word after
        # the command, its old flags and -h included, lands in `argv` instead of an argparse
        # error, and the command answers with where it went.
        moved = bench_sub.add_parser(name, add_help=False, prefix_chars="\0")
        moved.add_argument("argv", nargs="*")
        moved.set_defaults(func=_run_moved)


def moved_message(command: str) -> str:
    return (
        f"conveyor bench {command}: moved out of the package to the repository's benchmarks/: "
        f"run `{LAB} {command}` from a clone (after `{LAB_INSTALL}`)"
    )


def _run_moved(args: argparse.Namespace) -> int:
    print(moved_message(args.bench_command), file=sys.stderr)
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    from conveyor.bench.serve import main

    return main(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from conveyor.bench.throughput import main

    return main(args)
