"""The step-time target (max_step_ms, core/step_budget.py): its cost model fits step times, and
the scheduler gives every decoding request its token, then cuts prompts to what fits, never
below a minimum chunk. Without the setting the schedule is exactly what it was.

No test here times anything: the scheduler runs without a model (a scripted runner output),
and its cost model is given fixed coefficients (window=0: it never learns)."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest

from conveyor.config import SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.step_budget import (
    DECODE_OVERRUN_SHARE,
    MIN_PREFILL_CHUNK,
    PRIOR,
    StepBudget,
    StepShape,
    StepTimeModel,
    step_shape,
)
from conveyor.engine_args import EngineArgs
from conveyor.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams

# Seconds per unit of each feature of a made-up machine: const, decode token, prefill token,
# decode kilo-pair, prefill kilo-pair.
TRUE = (4e-3, 0.7e-3, 0.3e-3, 1.5e-3, 0.2e-3)


def synthetic_steps(rng: random.Random, num: int) -> list[StepShape]:
    """Steps as serving makes them: decodes at growing contexts, some with a prompt chunk."""
    shapes = []
    for _ in range(num):
        shape = StepShape()
        for _ in range(rng.randrange(0, 40)):
            shape = shape.plus(rng.randrange(20, 1500), 1, decode=True)
        if rng.random() < 0.5 or shape.decode_tokens == 0:
            shape = shape.plus(rng.randrange(0, 600), rng.randrange(8, 513), decode=False)
        shapes.append(shape)
    return shapes


def true_seconds(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUE, shape.features, strict=True))


# ---- the cost model -----------------------------------------------------------------------


def test_cost_model_fits_known_step_times_despite_noise_and_outliers():
    rng = random.Random(0)
    model = StepTimeModel()
    for i, shape in enumerate(synthetic_steps(rng, 128)):
        seconds = true_seconds(shape) * rng.uniform(0.98, 1.02)
        if i % 10 == 3:  # a neighbour took the CPU for this step
            seconds *= 3
        model.observe(shape, seconds)
    for shape in synthetic_steps(rng, 50):
        assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.05)
    assert model.coefficients == pytest.approx(TRUE, rel=0.2)


def test_cost_model_starts_from_its_prior_and_never_predicts_less_for_more_work():
    model = StepTimeModel()
    shape = StepShape().plus(100, 1, decode=True).plus(0, 64, decode=False)
    assert model.predict(shape) == pytest.approx(
        sum(c * x for c, x in zip(PRIOR, shape.features, strict=True))
    )
    # Times that fall as prompts grow (noise, or a device that idles otherwise) would fit a
    # negative cost per prompt token; it is pinned at zero instead.
    for n in range(1, 60):
        model.observe(StepShape().plus(0, 8 * n, decode=False), 0.05 - n * 5e-4)
    assert min(model.coefficients) >= 0 and model.coefficients[2] == 0
    small, large = (StepShape().plus(0, n, decode=False) for n in (16, 512))
    assert model.predict(large) >= model.predict(small)


def test_cost_model_keeps_prompt_costs_through_a_long_stretch_of_decodes():
    rng = random.Random(1)
    model = StepTimeModel(window=16)
    for shape in synthetic_steps(rng, 64):
        model.observe(shape, true_seconds(shape))
    chunk = StepShape().plus(0, 256, decode=False)
    before = model.predict(chunk)
    for _ in range(500):  # decodes only: they fill their own window, not the prompts'
        shape = StepShape().plus(300, 1, decode=True).plus(400, 1, decode=True)
        model.observe(shape, true_seconds(shape))
    assert model.predict(chunk) == pytest.approx(before, rel=0.02)


def test_largest_chunk_that_fits_is_found_and_respects_its_bounds():
    model = StepTimeModel(TRUE, window=0)
    decodes = StepShape().plus(200, 1, decode=True).plus(300, 1, decode=True)
    limit = 0.05
    n = model.max_chunk(decodes, 100, limit, 1000)
    assert model.predict(decodes.plus(100, n, decode=False)) <= limit
    assert model.predict(decodes.plus(100, n + 1, decode=False)) > limit
    assert model.max_chunk(decodes, 100, limit, 7) == 7
    assert model.max_chunk(decodes, 100, 1e-6, 1000) == 0


def test_step_shape_counts_a_drafted_decode_row_as_decode_and_a_chunk_as_prefill():
    from conveyor.outputs import ScheduledRequest

    rows = [
        ScheduledRequest("a", [5], 40, [[]], None, num_drafts=3),
        ScheduledRequest("b", list(range(10)), 6, [[]], None),
    ]
    shape = step_shape(SchedulerOutput(rows, 14))
    assert shape == StepShape(4, 10, 4 * 40 + 10, 10 * 6 + 55)


# ---- the scheduler with a target ----------------------------------------------------------


def make_request(
    request_id: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: float = 0.0
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, prompt, params, max_tokens, frozenset(), priority, arrival)


def runner_output(sched: SchedulerOutput) -> ModelRunnerOutput:
    """A made-up token for every row that samples (no model: only the schedule matters)."""
    rows = [r for r in sched.scheduled if r.sampling is not None]
    tokens = [[3 + (len(r.token_ids) * 7 + r.num_computed_tokens) % 50] for r in rows]
    return ModelRunnerOutput([r.request_id for r in rows], tokens, [None] * len(rows))


def make_scheduler(max_step_ms: float | None, coefficients=TRUE, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 512)
    scheduler = Scheduler(
        SchedulerConfig(max_step_ms=max_step_ms, **config),
        KVCacheManager(num_blocks=400, block_size=16, enable_caching=True),
    )
    if max_step_ms is not None:  # fixed costs: the schedule does not depend on timing
        scheduler.step_budget = StepBudget(max_step_ms, StepTimeModel(coefficients, window=0))
    return scheduler


def step(scheduler: Scheduler) -> SchedulerOutput:
    sched = scheduler.schedule()
    scheduler.update_from_output(sched, runner_output(sched))
    return sched


def decoding(scheduler: Scheduler, num: int) -> list[str]:
    """`num` requests past their prompts (8 tokens each), decoding for a long while."""
    ids = [f"d{i}" for i in range(num)]
    for request_id in ids:
        scheduler.add_request(make_request(request_id, [7] * 8, 200))
    while any(scheduler.requests[i].num_output_tokens == 0 for i in ids):
        step(scheduler)
    return ids


def test_target_cuts_a_long_prompt_into_fitting_chunks_while_every_decode_runs_each_step():
    scheduler = make_scheduler(60.0)
    decoders = decoding(scheduler, 12)
    scheduler.add_request(make_request("long", list(range(3, 1203)), 4))
    chunks = []
    model = scheduler.step_budget.model
    while not chunks or sum(chunks) < 1200:
        sched = step(scheduler)
        rows = sched.num_scheduled_tokens
        assert all(rows[d] == 1 for d in decoders)  # every decode, every step
        chunks.append(rows["long"])
        assert model.predict(step_shape(sched)) <= 0.060
    assert len(chunks) > 3 and max(chunks) < 512  # cut finer than the token budget alone
    # The chunks shrink as the prompt's context grows (each reads all before it).
    assert chunks[0] > chunks[-2]
    without = make_scheduler(None)
    decoding(without, 12)
    without.add_request(make_request("long", list(range(3, 1203)), 4))
    assert step(without).num_scheduled_tokens["long"] == 512 - 12


def test_decodes_admitted_after_a_prompt_still_count_against_its_next_chunk():
    """One-token prompts join behind a long prompt's first chunk and decode from the next
    step on, while the long prompt is still prefilling ahead of them in admission order:
    they are scheduled first, so the prompt's chunk is cut to the time they leave."""
    scheduler = make_scheduler(40.0)
    decoders = decoding(scheduler, 4)
    scheduler.add_request(make_request("long", list(range(3, 1003)), 4))
    short = [f"s{i}" for i in range(16)]
    for request_id in short:
        scheduler.add_request(make_request(request_id, [9], 50))
    assert set(step(scheduler).num_scheduled_tokens) == {*decoders, "long", *short}
    sched = step(scheduler)
    rows = sched.num_scheduled_tokens
    assert all(rows[s] == 1 for s in decoders + short) and rows["long"] > 1
    assert scheduler.step_budget.model.predict(step_shape(sched)) <= 0.040


def test_a_step_without_decodes_keeps_the_whole_token_budget():
    """Nobody waits on a step of prompts only: the target does not cut them."""
    scheduler = make_scheduler(1.0)
    for request_id in ("p", "q"):
        scheduler.add_request(make_request(request_id, list(range(3, 303)), 4))
    assert step(scheduler).num_scheduled_tokens == {"p": 300, "q": 212}


@pytest.mark.parametrize("num_decoding", [4, 40])
def test_a_prompt_moves_on_every_step_when_the_decodes_alone_exceed_the_target(num_decoding):
    """The first prompt in line gets the larger of the minimum chunk and what fits in the
    decodes' overrun share; the second waits for a step of its own."""
    scheduler = make_scheduler(1.0, max_num_seqs=64)  # far below what the decodes take
    decoders = decoding(scheduler, num_decoding)
    for request_id in ("p", "q"):
        scheduler.add_request(make_request(request_id, list(range(3, 403)), 4))
    model = scheduler.step_budget.model
    decodes = StepShape(num_decoding, 0, num_decoding * 9, 0)
    limit = (1 + DECODE_OVERRUN_SHARE) * model.predict(decodes)
    fits = model.max_chunk(decodes, 0, limit, 400)
    rows = step(scheduler).num_scheduled_tokens
    assert all(rows[d] == 1 for d in decoders)
    assert rows["p"] == max(MIN_PREFILL_CHUNK, fits) and "q" not in rows
    assert (fits > MIN_PREFILL_CHUNK) == (num_decoding == 40)
    num_steps = 1
    while scheduler.requests["p"].num_output_tokens == 0:
        remaining = 400 - scheduler.requests["p"].num_computed_tokens
        rows = step(scheduler).num_scheduled_tokens
        assert rows["p"] >= min(MIN_PREFILL_CHUNK, remaining)
        num_steps += 1
    assert num_steps <= -(-400 // MIN_PREFILL_CHUNK)  # never starved


def test_a_whole_prompt_without_chunked_prefill_runs_alone_when_it_exceeds_the_target():
    scheduler = make_scheduler(20.0, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    decoders = decoding(scheduler, 2)
    scheduler.add_request(make_request("a", list(range(3, 303)), 2))
    scheduler.add_request(make_request("b", list(range(303, 3, -1))[:300], 2))
    rows = step(scheduler).num_scheduled_tokens
    assert rows == {**dict.fromkeys(decoders, 1), "a": 300}  # over the target: never starved
    rows = step(scheduler).num_scheduled_tokens
    assert rows == {**dict.fromkeys(decoders, 1), "a": 1, "b": 300}


def test_max_step_ms_is_a_checked_setting_with_its_flag():
    for bad in (0, -5, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="max_step_ms must be"):
            EngineArgs(max_step_ms=bad)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--max-step-ms", "90"]))
    assert args.scheduler_config().max_step_ms == 90.0
    assert EngineArgs().scheduler_config().max_step_ms is None


# ---- without the setting: unchanged ------------------------------------------------------


def describe(sched: SchedulerOutput) -> str:
    rows = " ".join(
        f"{r.request_id}@{r.num_computed_tokens}+{len(r.token_ids)}{'*' if r.sampling else ''}"
        for r in sched.scheduled
    )
    for label, ids in (
        ("pre", sched.preempted_request_ids),
        ("fin", sched.finished_request_ids),
        ("join", sched.joined_request_ids),
    ):
        if ids:
            rows += f" {label}:" + ",".join(ids)
    return rows


def scripted_run(policy: str, max_step_ms: float | None = None) -> list[str]:
    """Arrivals, a shared prefix, a pool small enough to preempt, and an abort."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 90) for _ in range(16)]
    arrivals = {
        0: [
            ("a", shared + [rng.randrange(3, 90) for _ in range(14)], 6, 1),
            ("b", [rng.randrange(3, 90) for _ in range(10)], 8, 0),
        ],
        2: [("c", shared + [rng.randrange(3, 90) for _ in range(5)], 5, 2)],
        3: [("d", [rng.randrange(3, 90) for _ in range(40)], 3, 0)],
        5: [("e", [rng.randrange(3, 90) for _ in range(7)], 9, 1)],
    }
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=3, max_num_batched_tokens=24, policy=policy, max_step_ms=max_step_ms
        ),
        KVCacheManager(num_blocks=14, block_size=4, enable_caching=True),
    )
    steps = []
    for i in range(60):
        for request_id, prompt, max_tokens, priority in arrivals.get(i, []):
            request = make_request(request_id, prompt, max_tokens, priority, float(i))
            scheduler.add_request(request)
        if i == 9:
            scheduler.finish_requests(["e"], RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_unfinished_requests():
            break
        steps.append(describe(step(scheduler)))
    return steps


# Recorded with the scheduler before the step-time target existed.
UNCHANGED = {
    "fcfs": [
        "a@0+24 join:a", "a@24+6* b@0+10* join:b", "a@30+1* b@10+1* c@16+5* join:c",
        "a@31+1* b@11+1* c@21+1*", "a@32+1* b@12+1* pre:c", "a@33+1* b@13+1*",
        "a@34+1* b@14+1*", "b@15+1* c@20+3* fin:a join:c", "b@16+1* c@23+1*",
        "c@24+1* d@0+23 fin:b,e join:d", "d@23+17* fin:c", "d@40+1*", "d@41+1*",
    ],
    "priority": [
        "b@0+10* a@0+14 join:b,a", "b@10+1* a@14+16*", "b@11+1* a@30+1* c@16+5* join:c",
        "b@12+1* d@0+23 pre:c,a join:d", "b@13+1* d@23+17*", "b@14+1* pre:d", "b@15+1*",
        "b@16+1*", "d@36+5* fin:b join:d", "d@41+1* fin:e", "a@0+24 fin:d join:a",
        "a@24+8* c@16+6* join:c", "a@32+1* c@22+1*", "a@33+1* c@23+1*", "a@34+1* c@24+1*",
    ],
    "static": [
        "a@0+24 join:a", "a@24+6* b@0+10* join:b", "a@30+1* b@10+1*", "a@31+1* b@11+1*",
        "a@32+1* b@12+1*", "a@33+1* b@13+1*", "a@34+1* b@14+1*", "b@15+1* fin:a",
        "b@16+1*", "c@16+5* d@0+19 fin:b,e join:c,d", "c@21+1* pre:d", "c@22+1*",
        "c@23+1*", "c@24+1*", "d@16+24* fin:c join:d", "d@40+1*", "d@41+1*",
    ],
}  # fmt: skip


@pytest.mark.parametrize("policy", sorted(UNCHANGED))
def test_without_a_target_the_schedule_is_what_it_was(policy):
    assert scripted_run(policy) == UNCHANGED[policy]


@pytest.mark.parametrize("policy", sorted(UNCHANGED))
def test_with_a_target_the_same_script_decodes_every_step_and_finishes_everyone(policy):
    """Preemption, prefix hits and aborts under a target far below any step: every request
    still ends, and a request that decoded in one step decodes in the next unless it finished
    or was preempted."""
    steps = [parse(line) for line in scripted_run(policy, max_step_ms=1e-3)]
    for (rows, _), (next_rows, labels) in itertools.pairwise(steps):
        decoders = {request_id for request_id, tokens in rows.items() if tokens == "1*"}
        gone = set(labels.get("fin", [])) | set(labels.get("pre", []))
        assert decoders - gone <= set(next_rows)
    finished = {request_id for _, labels in steps for request_id in labels.get("fin", [])}
    assert finished | set(steps[-1][0]) == set("abcde")


def parse(line: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """describe()'s line back into {request id: tokens} and {label: request ids}."""
    rows, labels = {}, {}
    for part in line.split(" "):
        if "@" in part:
            request_id, _, rest = part.partition("@")
            rows[request_id] = rest.partition("+")[2]
        else:
            label, _, ids = part.partition(":")
            labels[label] = ids.split(",")
    return rows, labels
