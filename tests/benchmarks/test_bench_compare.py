"""`python -m benchmarks compare` on a tiny checkpoint: conveyor-fcfs, conveyor-static and
transformers' generate loop serve the same requests at two rates, in real time; and the sweep's
pieces (heavy-tailed lengths, capacity, goodput) on synthetic data."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import compare
from benchmarks.records import RequestRecord, RunResult, StepSpan
from conveyor.bench.datasets import output_lengths

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
            "--hf-request-rates",
            *RATES,
            "--hf-num-prompts",
            str(NUM_PROMPTS),
            "--prompt-range",
            "4",
            "40",
            "--output-dist",
            "lognormal",
            "--output-mean",
            "6",
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


REPORTED = (*compare.SYSTEMS, compare.HELD)  # the systems run, and the one derived


def test_every_system_completes_every_request_with_its_exact_output_length(run):
    _, data, _ = run
    assert sorted((r["system"], str(r["request_rate"])) for r in data["runs"]) == sorted(
        (s, rate) for s in REPORTED for rate in ("40.0", "inf")
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
        if cells and cells[0] in REPORTED and len(cells) == len(compare.TABLE_COLUMNS):
            rows[(cells[0], cells[1])] = (float(cells[3]), float(cells[5]))
    return rows


def test_ratio_lines_agree_with_the_table(run):
    text, data, _ = run
    rows = table_rows(text)
    assert len(rows) == len(REPORTED) * len(RATES)
    pattern = re.compile(
        r"rate\s+(\S+) req/s\s+vs (\S+)\s+throughput ([\d.]+)x"
        r"\s+median normalized latency ([\d.]+)x"
    )
    lines = pattern.findall(text)
    assert len(lines) == (len(REPORTED) - 1) * len(RATES)
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
    for name in ("throughput.png", "latency.png", "goodput.png", "timeline.png"):
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


def test_static_batches_are_numbered_as_the_scheduler_formed_them(run):
    """Each conveyor-static request carries its batch: at most max_num_seqs members, and every
    member of a batch starts only after every member of the one before has finished (nobody
    joins a batch in progress); hf-generate's are numbered too, fcfs has none."""
    _, data, _ = run
    for result in runs_of(data, "conveyor-static") + runs_of(data, "hf-generate"):
        batches: dict[int, list[dict]] = {}
        for r in result["requests"]:
            batches.setdefault(r["batch"], []).append(r)
        assert sorted(batches) == list(range(len(batches))), result["system"]
        previous_end = -math.inf
        for number in sorted(batches):
            members = batches[number]
            assert len(members) <= MAX_NUM_SEQS
            assert min(m["first_token"] for m in members) > previous_end, (result["system"], number)
            previous_end = max(m["finish"] for m in members)
    assert len({r["batch"] for r in runs_of(data, "conveyor-static")[1]["requests"]}) > 1
    for result in runs_of(data, "conveyor-fcfs"):
        assert {r["batch"] for r in result["requests"]} == {-1}


def test_static_batch_end_holds_every_result_until_its_batch_finishes(run):
    """static-batch-end is conveyor-static's run with each result handed over when its
    batch's last member finishes: the same first tokens, a later or equal finish, and a
    higher median normalized latency where a batch mixes output lengths."""
    _, data, _ = run
    static_runs, held_runs = runs_of(data, "conveyor-static"), runs_of(data, compare.HELD)
    for static, held in zip(static_runs, held_runs, strict=True):
        assert static["request_rate"] == held["request_rate"]
        assert held["steps"] == static["steps"]
        ends: dict[int, float] = {}
        for r in static["requests"]:
            ends[r["batch"]] = max(ends.get(r["batch"], 0.0), r["finish"])
        for before, after in zip(static["requests"], held["requests"], strict=True):
            assert after["request_id"] == before["request_id"]
            assert after["first_token"] == before["first_token"]
            assert after["finish"] == ends[before["batch"]] >= before["finish"]
        assert held["summary"]["goodput"] == static["summary"]["goodput"]
    inf = [runs_of(data, s)[1]["summary"] for s in ("conveyor-static", compare.HELD)]
    assert inf[1]["normalized_latency_median"] > inf[0]["normalized_latency_median"]


def step(scheduled: list[str], finished: list[str]):
    return SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(scheduled, 1), finished_request_ids=finished
    )


def test_a_batch_member_admitted_after_another_finished_stays_in_its_batch():
    """The token budget can leave a member waiting (in static_batch) past the step in which
    another member of its batch finished: it is still that batch's, and the next batch
    starts only once all of them have finished."""
    batches = compare._StaticBatches()
    batches.step(step(["a"], ["a"]), {"b"})  # a: one output token, finished at once; b waits
    batches.step(step(["b"], []), {"b"})
    batches.step(step(["b"], ["b"]), set())
    batches.step(step(["c", "d"], []), {"c", "d"})
    batches.step(step(["c", "d"], ["c", "d"]), set())
    assert batches.of == {"a": 0, "b": 0, "c": 1, "d": 1}


def test_bad_ranges_are_refused_with_the_flag_named():
    args = parse(["--prompt-range", "64", "32"])
    with pytest.raises(ValueError, match="--prompt-range"):
        compare.check_args(args)
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            parse(["--request-rates", "0"])


def test_capacity_and_goodput_are_printed_and_saved_for_both_baselines(run):
    text, data, _ = run
    capacity, goodput = data["capacity"], data["goodput"]
    assert set(capacity["ratios"]) == set(goodput["ratios"]) == set(REPORTED[1:])
    ours = capacity["systems"]["conveyor-fcfs"]
    for baseline, ratio in capacity["ratios"].items():
        assert ratio["ratio"] == pytest.approx(ours["rate"] / capacity["systems"][baseline]["rate"])
        printed = re.search(rf"conveyor-fcfs / {baseline}\s+capacity [<>=~ ]*([\d.]+)x", text)
        assert float(printed.group(1)) == pytest.approx(ratio["ratio"], abs=0.006)
    for result in data["runs"]:
        summary = result["summary"]
        assert 0 <= summary["goodput"] <= summary["request_throughput"] + 1e-9
        for r in result["requests"]:
            assert (r["tbt_p99"] > 0) == (r["num_output_tokens"] > 1), (result["system"], r)


# ---- the sweep's pieces, on synthetic data ---------------------------------------------------


@pytest.mark.parametrize("dist", ["lognormal", "exponential", "uniform"])
def test_output_lengths_are_deterministic_by_seed_and_within_the_caps(dist):
    def draw(seed):
        return output_lengths(np.random.default_rng(seed), 2000, dist, (4, 300), 48.0)

    first = draw(1)
    assert np.array_equal(first, draw(1))
    assert not np.array_equal(first, draw(2))
    assert first.min() >= 4 and first.max() <= 300
    assert first.dtype.kind == "i"


@pytest.mark.parametrize("dist", ["lognormal", "exponential"])
def test_heavy_tailed_output_lengths_have_a_long_tail_near_the_mean_asked(dist):
    lengths = output_lengths(np.random.default_rng(0), 20000, dist, (1, 4096), 48.0)
    assert np.mean(lengths) == pytest.approx(48.0, rel=0.05)
    assert np.median(lengths) < 0.75 * np.mean(lengths)  # mass on the short side
    assert np.percentile(lengths, 99) > 4 * np.median(lengths)  # and a long tail


def test_output_lengths_refuse_bad_input():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="output distribution"):
        output_lengths(rng, 4, "pareto-ish", (1, 8), 4.0)
    with pytest.raises(ValueError, match="output range"):
        output_lengths(rng, 4, "lognormal", (8, 1), 4.0)
    with pytest.raises(ValueError, match="output mean"):
        output_lengths(rng, 4, "lognormal", (1, 8), 0.0)


def test_capacity_interpolates_the_first_crossing_of_the_threshold():
    sweep = [(4.0, 1.0), (1.0, 0.1), (2.0, 0.2), (8.0, 0.15), (math.inf, 9.0)]
    # crosses 0.6 between 2 (0.2) and 4 (1.0): 2 + 2 * 0.4 / 0.8; the dip at 8 is past it
    assert compare.capacity(sweep, 0.6) == compare.Capacity(3.0, "=")
    assert compare.capacity(sweep, 5.0) == compare.Capacity(8.0, ">=")
    assert compare.capacity(sweep, 0.05) == compare.Capacity(1.0, "<=")
    with pytest.raises(ValueError, match="finite"):
        compare.capacity([(math.inf, 1.0)], 0.5)


def test_capacity_ratio_says_which_way_a_bound_points():
    exact, floor, ceiling = (
        compare.Capacity(r, b) for r, b in ((2.0, "="), (6.0, ">="), (1.0, "<="))
    )
    assert compare.capacity_ratio(floor, exact) == (3.0, ">=")
    assert compare.capacity_ratio(exact, ceiling) == (2.0, ">=")
    assert compare.capacity_ratio(ceiling, exact) == (0.5, "<=")
    assert compare.capacity_ratio(exact, exact) == (1.0, "=")
    assert compare.capacity_ratio(floor, floor) == (1.0, "?")


def result(system, rate, median, goodput=0.0):
    summary = {"normalized_latency_median": median, "goodput": goodput}
    return RunResult(system, rate, [], [], summary)


def test_capacity_report_uses_one_threshold_from_the_lowest_load():
    sweep = [
        result("conveyor-fcfs", 1.0, 0.10),
        result("conveyor-fcfs", 4.0, 0.30),
        result("conveyor-fcfs", 8.0, 0.90),
        result("conveyor-static", 1.0, 0.12),
        result("conveyor-static", 4.0, 1.20),
        result("conveyor-static", math.inf, 5.0),
        result("hf-generate", 0.5, 0.20),
        result("hf-generate", 1.0, 2.00),
    ]
    report = compare.capacity_report(sweep, factor=5.0)
    assert report["reference_s_per_token"] == pytest.approx(0.10)
    assert report["threshold_s_per_token"] == pytest.approx(0.5)
    systems = report["systems"]
    assert systems["conveyor-fcfs"] == {"rate": pytest.approx(4 + 4 * 0.2 / 0.6), "bound": "="}
    assert systems["conveyor-static"] == {"rate": pytest.approx(1 + 3 * 0.38 / 1.08), "bound": "="}
    assert systems["hf-generate"]["rate"] == pytest.approx(0.5 + 0.5 * 0.3 / 1.8)
    assert report["ratios"]["conveyor-static"]["ratio"] == pytest.approx(
        systems["conveyor-fcfs"]["rate"] / systems["conveyor-static"]["rate"]
    )


def test_token_times_and_tbt_p99_from_the_steps():
    record = RequestRecord(
        "7",
        prompt_len=10,
        output_len=4,
        num_output_tokens=4,
        arrival=0.0,
        first_token=0.0,
        finish=0.0,
    )
    steps = [
        StepSpan(0.0, 1.0, {"7": 6}, []),  # first prompt chunk: no token yet
        StepSpan(1.0, 2.0, {"7": 4, "8": 1}, []),  # the rest of it: token 1
        StepSpan(2.0, 2.5, {"8": 1}, []),  # without 7
        StepSpan(2.5, 3.0, {"7": 1}, []),
        StepSpan(3.0, 6.0, {"7": 1}, []),
        StepSpan(6.0, 6.5, {"7": 1}, ["7"]),
        StepSpan(6.5, 7.0, {"7": 1}, []),  # past its output length (a static batch's seat)
    ]
    assert compare.token_times(record, steps) == [2.0, 3.0, 6.0, 6.5]
    assert compare.tbt_p99([2.0, 3.0, 6.0, 6.5]) == pytest.approx(np.percentile([1, 3, 0.5], 99))
    assert compare.tbt_p99([2.0]) == 0.0
    compare.set_tbt_p99([record], steps)
    assert record.tbt_p99 == pytest.approx(np.percentile([1, 3, 0.5], 99))


def test_goodput_counts_the_requests_that_meet_the_slo_per_second():
    records = [
        RequestRecord(str(i), 1, 1, 1, 0.0, 0.0, 0.0, tbt_p99=tbt)
        for i, tbt in enumerate([0.1, 0.2, 0.5, 0.51, 2.0])
    ]
    assert compare.goodput(records, duration=2.0, tbt_slo=0.5) == pytest.approx(1.5)
    assert compare.goodput(records, duration=2.0, tbt_slo=0.05) == 0.0
    best = compare.goodput_report(
        [
            result("conveyor-fcfs", 1.0, 0, 0.9),
            result("conveyor-fcfs", 2.0, 0, 1.8),
            result("conveyor-static", 1.0, 0, 0.6),
            result("conveyor-static", 2.0, 0, 0.5),
        ],
        tbt_slo=0.5,
    )
    assert best["systems"]["conveyor-fcfs"] == {"goodput": 1.8, "request_rate": 2.0}
    assert best["ratios"]["conveyor-static"]["ratio"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--output-range", "0", "8"], "--output-range"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--hf-num-prompts", "0"], "--hf-num-prompts"),
        (["--output-mean", "0"], "--output-mean"),
        (["--output-mean", "inf"], "--output-mean"),
        (["--tbt-slo", "-1"], "--tbt-slo"),
        (["--capacity-factor", "1"], "--capacity-factor"),
        (["--max-step-ms", "0"], "--max-step-ms"),
        (["--max-step-ms", "nan"], "--max-step-ms"),
        (["--request-rates", "1", "2", "--timeline-rate", "3"], "--timeline-rate"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        compare.check_args(parse(argv))


def test_quick_shrinks_the_sweep_and_explicit_flags_win():
    full, quick = parse([]), parse(["--quick", "--num-prompts", "5"])
    compare.check_args(full)
    compare.check_args(quick)
    assert (full.num_prompts, full.request_rates) == (
        compare.FULL.num_prompts,
        list(compare.FULL.request_rates),
    )
    assert quick.num_prompts == 5
    assert quick.request_rates == list(compare.QUICK.request_rates)
    assert quick.hf_request_rates == list(compare.QUICK.hf_request_rates)
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            parse(["--output-dist", "zipf"])


def test_the_step_time_target_reaches_both_conveyor_systems(tiny_checkpoint):
    argv = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--max-step-ms", "40"]
    args = parse([*argv, "--prompt-range", "4", "40", "--output-range", "2", "16"])
    compare.check_args(args)
    for policy in ("fcfs", "static"):
        engine = compare._load_engine(args, policy)
        try:
            config = engine.scheduler_config
            assert (config.max_step_ms, config.policy) == (40.0, policy)
        finally:
            engine.shutdown()
