"""The lab's command line: `python -m benchmarks` from the repository's root lists every
command, and `conveyor bench` keeps serve and throughput only, answering each command that
moved with one line that names its new command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import COMMANDS
from conveyor.bench.cli import MOVED

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_python_m_benchmarks_lists_every_lab_command():
    result = run("-m", "benchmarks", "--help")
    assert result.returncode == 0, result.stderr
    for command, _, _ in COMMANDS:
        assert command in result.stdout
    assert set(MOVED) <= {command for command, _, _ in COMMANDS}
    step = run("-m", "benchmarks", "step", "--help")
    assert step.returncode == 0 and "--batches" in step.stdout


def test_conveyor_bench_lists_serve_and_throughput_only():
    result = run("-m", "conveyor", "bench", "--help")
    assert result.returncode == 0, result.stderr
    usage = result.stdout.splitlines()[0]
    assert "{serve,throughput}" in usage and "compare" not in usage
    assert "python -m benchmarks" in result.stdout


@pytest.mark.parametrize(
    "argv", [["compare"], ["step", "--quick"], ["quality", "some/model", "--help"]]
)
def test_a_moved_command_names_its_new_command(argv):
    result = run("-m", "conveyor", "bench", *argv)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"python -m benchmarks {argv[0]}" in line and "pip install -e '.[benchmarks]'" in line
    assert result.stdout == ""
