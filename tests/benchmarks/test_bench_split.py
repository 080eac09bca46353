"""`python -m benchmarks split` on the tiny model: the engine-core process against the engine
on a thread and offline, and the engine's share of a step."""

from __future__ import annotations

import json

import pytest


def test_bench_split_measures_every_system_and_the_engine_share(tiny_checkpoint, tmp_path):
    from benchmarks.cli import build_parser
    from benchmarks.split import main

    result = tmp_path / "split.json"
    argv = ["split", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--concurrency", "4", "--input-len", "8", "--output-len", "16", "--waves", "2"]
    argv += ["--health-streams", "32", "--overhead-batch", "4", "--result-file", str(result)]
    assert main(build_parser().parse_args(argv)) == 0
    report = json.loads(result.read_text())
    (row,) = report["throughput"]
    for system in ("offline", "http-process", "http-thread"):
        assert row[system] > 0
    assert row["http-process_errors"] == 0 and row["http-thread_errors"] == 0
    assert row["http-process_health_ms"]["probes"] > 0
    for system in ("http-process", "http-thread"):
        assert report["health"][system]["errors"] == 0
    overhead = report["overhead"]
    assert overhead["num_steps"] >= 10  # steps in which all 4 requests decoded together
    parts = overhead["parts_ms"]
    assert set(parts) == {"schedule", "prepare", "forward", "sample", "update", "encode"}
    assert 0 < overhead["engine_share"] < 1
    assert overhead["step_ms"] == pytest.approx(sum(parts.values()))
