"""`python -m benchmarks dashboard` end to end on a tiny checkpoint: one server with --no-dashboard,
one watched through its event stream, the ratio, and the cost the engine measured itself."""

from __future__ import annotations

import json

from benchmarks.cli import main as lab_main


def test_bench_dashboard_compares_watched_with_off(tiny_checkpoint, tmp_path, capsys):
    argv = ["dashboard", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--rounds", "1", "--num-prompts", "6", "--max-concurrency", "3"]
    argv += ["--random-input-len", "24", "--random-output-len", "48", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "dash.json"]
    assert lab_main(argv) == 0
    out = capsys.readouterr().out
    assert "--no-dashboard" in out and "measured by the engine: step records" in out
    report = json.loads((tmp_path / "dash.json").read_text())
    assert report["order"] == ["off", "watched"]
    off, watched = report["runs"]
    assert off["completed"] == watched["completed"] == 6 and not off["failed"]
    assert "updates_per_s" not in off  # nobody watched the server without a dashboard
    assert watched["updates_per_s"] > 0 and not watched["watch_errors"]
    # The records are a sliver of the step time (~5% for this tiny model's ~1 ms steps on a
    # 2-core Zen 3; the benchmark reports it). The bound catches records that cost as much as
    # the step, not a machine's speed: 0.053 failed a 0.05 bound on a clean Zen 3 run.
    assert 0 < watched["record_share"] < 0.25
    assert watched["snapshot_ms"] > 0
    rows = {row["layout"]: row for row in report["summary"]}
    assert rows["off"]["ratio"] == 1.0 and rows["watched"]["baseline"] == "off"
    assert rows["watched"]["ratio"] > 0
