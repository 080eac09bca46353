"""`python -m conveyor` is the `conveyor` command: same help, same usage errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_python_m_conveyor_is_the_conveyor_command():
    module = run(sys.executable, "-m", "conveyor", "--help")
    assert module.returncode == 0, module.stderr
    for command in ("serve", "generate", "bench"):
        assert command in module.stdout
    script = Path(sys.executable).with_name("conveyor")
    if script.exists():  # installed as a console script next to this interpreter
        assert run(str(script), "--help").stdout == module.stdout


def test_python_m_conveyor_reports_usage_errors_like_the_command():
    result = run(sys.executable, "-m", "conveyor", "serve", "--max-num-seqs", "many")
    assert result.returncode == 2
    assert "conveyor serve: error: argument --max-num-seqs" in result.stderr
