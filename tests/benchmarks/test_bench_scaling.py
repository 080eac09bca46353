"""`python -m benchmarks scaling`: layouts parse or are refused before any server starts, runs
alternate, ratios are taken against the first layout of each kind, and the command runs end
to end against real servers (one engine, and `conveyor serve --tensor-parallel-size 2`, whose
second rank must not outlive it) on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from benchmarks import scaling
from benchmarks.cli import main as lab_main


def test_layouts_parse_and_bad_ones_are_refused():
    assert scaling.parse_layouts(["dp1", "dp2", "tp2"]) == [("dp", 1), ("dp", 2), ("tp", 2)]
    for bad in (["pp2"], ["dp0"], ["tp"], ["dp1", "dp1"]):
        with pytest.raises(ValueError, match="--layouts"):
            scaling.parse_layouts(bad)


def test_runs_alternate_over_the_rounds():
    assert scaling.run_order(3, 2) == [0, 1, 2, 2, 1, 0]
    assert scaling.run_order(2, 3) == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="--rounds"):
        scaling.run_order(2, 0)


def test_ratios_are_taken_against_the_first_layout_of_each_kind():
    def run(layout, tps):
        return {
            "layout": layout,
            "failed": 0,
            "output_throughput": tps,
            "median_tpot_ms": 10.0,
            "median_ttft_ms": 50.0,
        }

    runs = [run("dp1", 100), run("dp2", 130), run("tp1", 80), run("dp2", 110), run("dp1", 90)]
    runs.append(run("tp2", 60))
    rows = {r["layout"]: r for r in scaling.summarize(runs, ["dp1", "dp2", "tp1", "tp2"])}
    assert rows["dp1"]["output_throughput"] == 95 and rows["dp1"]["ratio"] == 1.0
    assert rows["dp2"]["ratio"] == pytest.approx(120 / 95) and rows["dp2"]["baseline"] == "dp1"
    assert rows["tp2"]["ratio"] == pytest.approx(0.75) and rows["tp2"]["baseline"] == "tp1"
    assert rows["dp2"]["each"] == [130.0, 110.0]


def test_a_model_that_does_not_split_is_refused_before_any_server(tmp_path, capsys):
    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path, "llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16
    )
    assert lab_main(["scaling", str(path), "--layouts", "dp1", "tp2"]) == 2
    captured = capsys.readouterr()
    assert "does not divide its 3 attention heads" in captured.err
    assert "starting" not in captured.out


def test_bench_scaling_runs_each_layout(tiny_checkpoint, tmp_path, capsys):
    argv = [
        "scaling",
        str(tiny_checkpoint("llama")),
        "--dtype",
        "float32",
        "--layouts",
        "dp1",
        "tp2",
        "--rounds",
        "1",
        "--num-prompts",
        "4",
        "--max-concurrency",
        "2",
        "--random-input-len",
        "24",
        "--random-output-len",
        "6",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "scaling.json",
    ]
    assert lab_main(argv) == 0
    report = json.loads((tmp_path / "scaling.json").read_text())
    assert report["order"] == ["dp1", "tp2"]
    for run in report["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0, run
        assert run["total_output_tokens"] == 4 * 6  # EOS ignored: exact lengths
    rows = {r["layout"]: r for r in report["summary"]}
    assert rows["tp2"]["baseline"] == "tp2" and rows["tp2"]["ratio"] == 1.0  # no tp1 ran
    assert "tp2" in capsys.readouterr().out
    deadline = time.monotonic() + 10
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers(), "a tensor-parallel worker outlived its server"


def _workers() -> list[str]:
    command = ["pgrep", "-f", "conveyor.worker.tp_worker"]
    return subprocess.run(command, capture_output=True, text=True).stdout.split()
