"""`conveyor bench compare` on a tiny checkpoint: conveyor-fcfs, conveyor-static and
transformers' generate loop serve the same requests at two rates, in real time."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import pytest

from conveyor.bench import compare

NUM_PROMPTS = 8
RATES = ["40", "inf"]  # inf: all at once, so requests queue behind a full batch
MAX_NUM_SEQS = 3


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """One compare run: (printed text, saved JSON, output folder)."""
    out_dir = tmp_path_factory.mktemp("compare")
    args = parse(
        [
            str(tiny_checkpoint("llama")),
            "--dtype",
            "float32",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--request-rates",
            *RATES,
            "--prompt-range",
            "4",
            "40",
            "--output-range",
            "2",
            "16",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--timeline-rate",
            "inf",
            "--output-dir",
            str(out_dir),
            "--disable-tqdm",
        ]
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert compare.main(args) == 0
    return stdout.getvalue(), json.loads((out_dir / "compare.json").read_text()), out_dir


def runs_of(data: dict, system: str) -> list[dict]:
    return [r for r in data["runs"] if r["system"] == system]


def test_every_system_completes_every_request_with_its_exact_output_length(run):
    _, data, _ = run
    assert sorted((r["system"], str(r["request_rate"])) for r in data["runs"]) == sorted(
        (s, rate) for s in compare.SYSTEMS for rate in ("40.0", "inf")
    )
    for result in data["runs"]:
        requests = result["requests"]
        assert sorted(int(r["request_id"]) for r in requests) == list(range(NUM_PROMPTS))
        assert result["summary"]["num_completed"] == NUM_PROMPTS
        for r in requests:
            assert r["num_output_tokens"] == r["output_len"], (result["system"], r)
            assert 2 <= r["output_len"] <= 16 and 4 <= r["prompt_len"] <= 40


def test_latencies_are_ordered_and_positive(run):
    _, data, _ = run
    for result in data["runs"]:
        for r in result["requests"]:
            ttft, e2e = r["first_token"] - r["arrival"], r["finish"] - r["arrival"]
            assert 0 < ttft <= e2e, (result["system"], r)
            assert e2e / r["num_output_tokens"] > 0
        summary = result["summary"]
        assert summary["normalized_latency_median"] > 0
        assert summary["normalized_latency_p99"] >= summary["normalized_latency_median"]


def test_same_workload_for_every_system(run):
    _, data, _ = run
    for rate in {str(r["request_rate"]) for r in data["runs"]}:
        shapes = {
            tuple((q["prompt_len"], q["output_len"], round(q["arrival"], 6)) for q in r["requests"])
            for r in data["runs"]
            if str(r["request_rate"]) == rate
        }
        assert len(shapes) == 1


def table_rows(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(system, rate) -> (req/s, norm med) as printed."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] in compare.SYSTEMS and len(cells) == len(compare.TABLE_COLUMNS):
            rows[(cells[0], cells[1])] = (float(cells[3]), float(cells[5]))
    return rows


def test_ratio_lines_agree_with_the_table(run):
    text, data, _ = run
    rows = table_rows(text)
    assert len(rows) == len(compare.SYSTEMS) * len(RATES)
    pattern = re.compile(
        r"rate\s+(\S+) req/s\s+vs (\S+)\s+throughput ([\d.]+)x"
        r"\s+median normalized latency ([\d.]+)x"
    )
    lines = pattern.findall(text)
    assert len(lines) == (len(compare.SYSTEMS) - 1) * len(RATES)
    for rate, baseline, throughput, latency in lines:
        ours, theirs = rows[("conveyor-fcfs", rate)], rows[(baseline, rate)]
        assert float(throughput) == pytest.approx(ours[0] / theirs[0], rel=0.01, abs=0.006)
        assert float(latency) == pytest.approx(ours[1] / theirs[1], rel=0.01, abs=0.006)
    summary = {(s["system"], str(s["request_rate"])): s for s in data["summary"]}
    for r in data["ratios"]:
        ours = summary[("conveyor-fcfs", str(r["request_rate"]))]
        theirs = summary[(r["baseline"], str(r["request_rate"]))]
        assert r["throughput_ratio"] == pytest.approx(
            ours["request_throughput"] / theirs["request_throughput"]
        )
        assert r["normalized_latency_ratio"] == pytest.approx(
            ours["normalized_latency_median"] / theirs["normalized_latency_median"]
        )


def test_plots_are_written(run):
    _, _, out_dir = run
    for name in ("throughput.png", "latency.png", "timeline.png"):
        path = out_dir / name
        assert path.exists() and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def joins_into_running_batch(steps: list[dict]) -> int:
    """Steps at which a request starts while a request started at an earlier step is still
    unfinished. With prompts far below the token budget every member of a static batch
    starts in the batch's first step, so static has none."""
    started: set[str] = set()
    running: set[str] = set()
    count = 0
    for step in steps:
        ids = set(step["num_scheduled_tokens"])
        new = ids - started
        count += bool(new and running)
        started |= new
        running = (running | new) - set(step["finished_request_ids"])
    return count


def test_static_batches_admit_nobody_in_progress_while_fcfs_does(run):
    _, data, _ = run
    for system in ("conveyor-static", "hf-generate"):
        for result in runs_of(data, system):
            assert result["steps"], system
            assert joins_into_running_batch(result["steps"]) == 0, system
            assert result["summary"]["num_joins_in_progress"] == 0, system
            sizes = [len(s["num_scheduled_tokens"]) for s in result["steps"]]
            assert max(sizes) <= MAX_NUM_SEQS
    fcfs_inf = [r for r in runs_of(data, "conveyor-fcfs") if r["request_rate"] == "inf"][0]
    assert joins_into_running_batch(fcfs_inf["steps"]) > 0
    assert fcfs_inf["summary"]["num_joins_in_progress"] > 0


def test_bad_ranges_are_refused_with_the_flag_named():
    args = parse(["--prompt-range", "64", "32"])
    with pytest.raises(ValueError, match="--prompt-range"):
        compare.check_args(args)
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            parse(["--request-rates", "0"])
