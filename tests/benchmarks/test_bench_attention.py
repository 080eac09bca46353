"""`python -m benchmarks attention` on tiny shapes (decode rows and a prompt): it times the op
and, against a baseline build (here the same .so, in a process of its own), reports the outputs
bit for bit; a second build is never loaded into a process beside the first (Python would hand
back the first)."""

from __future__ import annotations

import shutil

import pytest
from conftest import run_lab

from benchmarks.attention import load_build
from conveyor.model import kernels


def test_attention_lab_times_each_case_and_compares_the_builds_bits():
    ops = kernels.load()
    if ops is None:
        pytest.skip("compiled kernels unavailable")
    argv = ["attention", "--rows", "1,3", "--contexts", "40", "--kv-dtypes", "float32,bfloat16"]
    argv += ["--prompts", "40"]
    argv += ["--repeats", "1", "--cache-mib", "1", "--num-threads", "1"]
    argv += ["--baseline", ops.__file__]
    rows = [line.split() for line in run_lab(argv).splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "40", "float32"), ("3", "40", "float32"), ("p", "40", "float32"),
        ("1", "40", "bfloat16"), ("3", "40", "bfloat16"), ("p", "40", "bfloat16"),
    ]  # fmt: skip
    assert all(r[-1] == "same" for r in rows)


def test_a_second_build_is_never_loaded_beside_the_first(tmp_path):
    ops = kernels.load()
    if ops is None:
        pytest.skip("compiled kernels unavailable")
    copy = tmp_path / "conveyor_kernels.so"
    shutil.copy(ops.__file__, copy)
    with pytest.raises(RuntimeError, match="is loaded from .* already"):
        load_build(str(copy))
