"""`python -m benchmarks moe` on a tiny MoE / dense pair: a real run over the real engines, the
experts each step ran counted by the compiled MoE layers, and the floors those counts give."""

from __future__ import annotations

import json

import pytest
from conftest import run_lab

LAYERS, EXPERTS, TOP_K, WIDTH, HIDDEN = 2, 8, 2, 32, 64


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    argv = ["moe", "--hidden", str(HIDDEN), "--layers", str(LAYERS), "--heads", "4"]
    argv += ["--kv-heads", "2", "--experts", str(EXPERTS), "--top-k", str(TOP_K)]
    argv += ["--expert-width", str(WIDTH), "--vocab", "512", "--rows", "1", "16"]
    argv += ["--context", "8", "--rounds", "1", "--save-result", "--result-dir", str(out)]
    table = run_lab(argv)
    (saved,) = out.glob("moe-*.json")
    return table, json.loads(saved.read_text())


def test_a_one_row_step_runs_its_top_k_experts_and_reads_what_the_dense_step_reads(report):
    _, saved = report
    one = saved["steps"]["1"]
    assert one["experts_run"] == TOP_K * LAYERS
    assert one["moe_bytes"] == pytest.approx(one["dense_bytes"], rel=0.02)
    assert one["floor_ratio"] == pytest.approx(1.0, rel=0.02)
    b = saved["bytes"]
    assert b["expert_bytes_run"] == b["active_expert_bytes"]
    assert b["active_expert_bytes"] == b["all_expert_bytes"] * TOP_K // EXPERTS


def test_many_rows_run_more_experts_and_the_floor_counts_their_bytes(report):
    table, saved = report
    one, many = saved["steps"]["1"], saved["steps"]["16"]
    assert TOP_K * LAYERS < many["experts_run"] <= EXPERTS * LAYERS
    expert = (many["moe_bytes"] - one["moe_bytes"]) / (many["experts_run"] - one["experts_run"])
    assert expert == pytest.approx(3 * HIDDEN * WIDTH * 4)  # float32 gate, up and down
    assert many["floor_ratio"] >= 1.0
    for row in saved["steps"].values():
        assert row["moe_ms"] > 0 and row["dense_ms"] > 0
        assert row["ratio"] == pytest.approx(row["moe_ms"] / row["dense_ms"])
    assert "floor ratio" in table and f"{many['floor_ratio']:.2f}x" in table
