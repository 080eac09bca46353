"""Scheduling under pressure (issue #3): preemption by recompute, automatic prefix caching,
the fcfs / priority / static policies, aborts in every state, stats and the block pool.

Greedy outputs are compared with transformers' generate on a tiny float64 checkpoint; block
accounting is checked with check_integrity() after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLMEngine, SamplingParams
from conveyor.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.request import ROOT_DIGEST, BlockHash, Request, RequestStatus

VOCAB = 384
REF_TOKENS = 16  # the reference is computed once per prompt for this many tokens, then cut
MAX_STEPS = 3000  # a livelocked scheduler fails a test instead of hanging it


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(model_path):
    """prompt, max_tokens -> transformers' greedy tokens (memoized per prompt)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy_tokens(prompt: list[int], max_tokens: int) -> list[int]:
        assert max_tokens <= REF_TOKENS
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_greedy(model, [list(prompt)], REF_TOKENS)[0][0]
        return memo[key][:max_tokens]

    return greedy_tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 models are bound by per-op overhead; on a shared 2-core machine a second
    OpenMP thread mostly spins (measured 8x slower), so this file runs on one."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def make_engine(model_path: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("record_trace", True)
    return LLMEngine(model_path, dtype="float64", **kwargs)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def run_to_completion(engine: LLMEngine, on_step=None) -> dict:
    """Steps until idle, checking block accounting after every step; finished outputs by id."""
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            assert out.request_id not in done, "output after the request finished"
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        if on_step is not None:
            on_step(engine)
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def tokens(done: dict, request_id: str) -> list[int]:
    return done[request_id].outputs[0].token_ids


def first_steps(trace) -> dict[str, int]:
    first: dict[str, int] = {}
    for s in trace:
        for request_id in s.num_scheduled_tokens:
            first.setdefault(request_id, s.step)
    return first


def finish_steps(trace) -> dict[str, int]:
    return {rid: s.step for s in trace for rid in s.finished_request_ids}


def num_computed_tokens(trace) -> int:
    return sum(sum(s.num_scheduled_tokens.values()) for s in trace)


def assert_idle(engine: LLMEngine) -> None:
    """No request holds a block: every block is free or cached, kv usage is 0."""
    assert engine.kv_cache.req_to_blocks == {}
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
    assert engine.get_stats().scheduler.kv_cache_usage == 0.0
    engine.check_integrity()


# ---- 0. the default token budget ----------------------------------------------------------


def test_the_default_budget_lets_the_first_of_many_prompts_decode_while_the_rest_prefill(
    model_path, reference
):
    """On CPU a step without decodes hands out 512 tokens by default, and 12 more for each
    request decoding in it, at most 2048: of 40 120-token prompts that arrive together, the
    first four are prefilled (and sample their first token) in the first step, and each later
    step, while prompts wait, takes exactly that budget. Every output equals transformers'."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(40)]
    engine = make_engine(model_path)
    cpu = engine.device.type == "cpu"
    assert engine.scheduler_config.max_num_batched_tokens == 2048
    assert engine.scheduler_config.base_batched_tokens == (512 if cpu else None)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(8))
    done = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens(done, str(i)) == reference(prompt, 8)
    if cpu:
        first = engine.trace[0].num_scheduled_tokens
        assert first == {"0": 120, "1": 120, "2": 120, "3": 120, "4": 32}
        computed = dict.fromkeys(map(str, range(len(prompts))), 0)
        grown = 0
        for step in engine.trace:
            decoding = sum(1 for rid in step.num_scheduled_tokens if computed[rid] >= 120)
            waiting = any(n < 120 for n in computed.values())
            total = sum(step.num_scheduled_tokens.values())
            budget = min(2048, 512 + 12 * decoding)
            assert total <= budget
            if waiting and total < budget:  # only the last prompts' ends leave some unused
                assert all(computed[r] + n >= 120 for r, n in step.num_scheduled_tokens.items())
            grown += waiting and total > 512
            for rid, n in step.num_scheduled_tokens.items():
                computed[rid] += n
        assert grown >= 3
    # Without chunked prefill a whole prompt must fit one step: a flat 2048.
    whole = make_engine(model_path, enable_chunked_prefill=False)
    assert whole.scheduler_config.max_num_batched_tokens == 2048
    assert whole.scheduler_config.base_batched_tokens is None
    # A budget given is flat, as vLLM's.
    given = make_engine(model_path, max_num_batched_tokens=96).scheduler_config
    assert (given.max_num_batched_tokens, given.base_batched_tokens) == (96, None)


def test_a_long_prefill_threshold_lets_several_prompts_share_each_step(model_path, reference):
    """long_prefill_token_threshold 48 (vLLM's): no request adds more than 48 tokens to a
    step, so three 120-token prompts arriving together each prefill 48 + 48 + 24 in the
    first three steps side by side (without it the first takes the whole budget's share);
    the outputs stay transformers'."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(3)]
    engine = make_engine(model_path, max_num_batched_tokens=160, long_prefill_token_threshold=48)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(6))
    done = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens(done, str(i)) == reference(prompt, 6)
    steps = [s.num_scheduled_tokens for s in engine.trace]
    assert steps[:3] == [{"0": 48, "1": 48, "2": 48}] * 2 + [{"0": 24, "1": 24, "2": 24}]
    assert all(n <= 48 for step in steps for n in step.values())
    plain = make_engine(model_path, max_num_batched_tokens=160)
    for i, prompt in enumerate(prompts):
        plain.add_request(str(i), prompt, greedy(6))
    run_to_completion(plain)
    assert plain.trace[0].num_scheduled_tokens == {"0": 120, "1": 40}


# ---- 1. preemption by recompute ------------------------------------------------------------


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_requests_resume_with_tokens_identical_to_transformers(
    model_path, reference, policy, caching
):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 29))] for _ in range(8)]
    # A request is admitted with 4-7 blocks of 4 and grows by 3 more while it decodes: two
    # admitted side by side outgrow the 14 blocks, so one of them must be preempted.
    engine = make_engine(
        model_path,
        block_size=4,
        num_blocks=14,
        scheduling_policy=policy,
        enable_prefix_caching=caching,
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(12), priority=i % 3)
    done = run_to_completion(engine)
    assert engine.get_stats().scheduler.num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        assert tokens(done, str(i)) == reference(prompt, 12), f"request {i} differs"
    assert_idle(engine)


@pytest.mark.parametrize(
    "policy, priorities, victim",
    [
        ("fcfs", (0, 0), "b"),
        ("fcfs", (1, 0), "b"),
        ("priority", (0, 0), "b"),
        ("priority", (1, 0), "a"),
    ],
)
def test_preemption_victim_is_latest_admitted_under_fcfs_and_lowest_priority_under_priority(
    model_path, reference, policy, priorities, victim
):
    prompts = {"a": list(range(10, 22)), "b": list(range(30, 50))}
    # Both start at step 1 (3 + 5 of the 10 blocks); decoding, they outgrow the cache.
    engine = make_engine(
        model_path,
        block_size=4,
        num_blocks=10,
        scheduling_policy=policy,
        enable_prefix_caching=False,
    )
    for (request_id, prompt), priority in zip(prompts.items(), priorities, strict=True):
        engine.add_request(request_id, prompt, greedy(16), priority=priority)
    done = run_to_completion(engine)
    assert set(engine.trace[0].num_scheduled_tokens) == {"a", "b"}
    survivor = "a" if victim == "b" else "b"
    finish = finish_steps(engine.trace)
    gap = next(s for s in engine.trace if victim not in s.num_scheduled_tokens)
    assert gap.step < finish[victim] and survivor in gap.num_scheduled_tokens
    # The survivor ran every step until it finished: it was never the one preempted.
    assert all(
        survivor in s.num_scheduled_tokens for s in engine.trace if s.step <= finish[survivor]
    )
    assert finish[survivor] < finish[victim]
    assert engine.get_stats().scheduler.num_preemptions_total >= 1
    for request_id, prompt in prompts.items():
        assert tokens(done, request_id) == reference(prompt, 16)


# ---- 2. automatic prefix caching ------------------------------------------------------------


def test_shared_prefix_hits_the_cache_computes_fewer_tokens_and_changes_no_output(
    model_path, reference
):
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(64)]
    prompts = [
        prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(6)
    ]

    def run(caching: bool):
        engine = make_engine(model_path, block_size=16, enable_prefix_caching=caching)
        engine.add_request("0", prompts[0], greedy(8))
        engine.step()  # the first request computes the shared prefix; the others arrive after
        for i in range(1, len(prompts)):
            engine.add_request(str(i), prompts[i], greedy(8))
        done = run_to_completion(engine)
        return engine, done

    cached_engine, cached = run(True)
    plain_engine, plain = run(False)
    stats = cached_engine.get_stats().scheduler
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 5 * 64
    assert [cached[str(i)].num_cached_tokens for i in range(6)] == [0] + [64] * 5
    assert plain_engine.get_stats().scheduler.prefix_cache_hits == 0
    assert all(plain[str(i)].num_cached_tokens == 0 for i in range(6))
    assert num_computed_tokens(cached_engine.trace) == (
        num_computed_tokens(plain_engine.trace) - 5 * 64
    )
    for i, prompt in enumerate(prompts):
        assert tokens(cached, str(i)) == tokens(plain, str(i)) == reference(prompt, 8)
    assert_idle(cached_engine)


def test_a_cache_salt_shares_blocks_only_between_requests_that_give_it(model_path, reference):
    """vLLM's cache_salt: the same prompt hits the cache only under the same salt (an unsalted
    request, or another salt, computes it again); the tokens are transformers' either way."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, VOCAB) for _ in range(70)]
    engine = make_engine(model_path, block_size=16)

    def cached(request_id: str, salt: str | None) -> int:
        params = SamplingParams(temperature=0, max_tokens=4, cache_salt=salt)
        engine.add_request(request_id, prompt, params)
        out = run_to_completion(engine)[request_id]
        assert out.outputs[0].token_ids == reference(prompt, 4)
        return out.num_cached_tokens

    assert cached("a", "tenant-a") == 0
    assert cached("b", None) == 0
    assert cached("c", "tenant-b") == 0
    assert cached("a2", "tenant-a") == cached("b2", None) == cached("c2", "tenant-b") == 64
    for bad in ("", 7, "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            SamplingParams(cache_salt=bad)
    assert_idle(engine)


def test_repeated_prompt_reuses_finished_requests_blocks_but_computes_at_least_one_token(
    model_path, reference
):
    rng = random.Random(4)
    prompt = [rng.randrange(3, VOCAB) for _ in range(64)]  # exactly 4 full blocks
    engine = make_engine(model_path, block_size=16)
    engine.add_request("first", prompt, greedy(16))
    first = run_to_completion(engine)["first"]
    assert first.num_cached_tokens == 0
    assert_idle(engine)  # the blocks are freed but stay cached

    # The whole prompt is cached, but the last block is recomputed to get logits to sample.
    engine.add_request("again", prompt, greedy(16))
    step = len(engine.trace)
    again = run_to_completion(engine)["again"]
    assert again.num_cached_tokens == 48
    assert engine.trace[step].num_scheduled_tokens == {"again": 16}
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference(prompt, 16)
    assert_idle(engine)


def test_blocks_holding_generated_tokens_are_cached_for_a_follow_up(model_path, reference):
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(20)]
    engine = make_engine(model_path, block_size=8)
    engine.add_request("turn1", prompt, greedy(16))  # computes 20 + 15 = 35 tokens: 4 full blocks
    first = run_to_completion(engine)["turn1"].outputs[0].token_ids
    follow = prompt + first[:15] + [11, 12, 13, 14, 15]
    engine.add_request("turn2", follow, greedy(8))
    out = run_to_completion(engine)["turn2"]
    assert out.num_cached_tokens == 32  # blocks 0-3, the last two made of generated tokens
    assert out.outputs[0].token_ids == reference(follow, 8)


# ---- 3. randomized stress ------------------------------------------------------------------

STATES = ("waiting", "prefill", "decode", "preempted")


def state_of(request: Request) -> str:
    if request.status == RequestStatus.WAITING:
        return "waiting"
    if request.status == RequestStatus.PREEMPTED:
        return "preempted"
    assert request.status == RequestStatus.RUNNING
    return "prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decode"


def random_workload(rng: random.Random, num_requests: int, policy: str) -> list[tuple]:
    """(arrival step, id, prompt, params, priority); prompts share a few prefixes."""
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (0, 17, 30)]
    workload, step = [], 0
    for i in range(num_requests):
        step += rng.choice([0, 0, 1, 2])
        prefix = rng.choice(prefixes)
        prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))]
        max_tokens = rng.randrange(1, 11)
        if rng.random() < 0.75:
            params = greedy(max_tokens)
        else:
            params = SamplingParams(
                temperature=1.0, seed=rng.randrange(1000), max_tokens=max_tokens
            )
        priority = rng.randrange(4) if policy == "priority" else 0
        workload.append((step, f"r{i}", prompt, params, priority))
    return workload


# seed, policy, chunked prefill. The seed draws block size (1-8), cache size (the largest
# request's blocks + 0-2), token budget, seats and prefix caching (even seeds).
STRESS_CASES = [
    (2, "fcfs", True),
    (5, "fcfs", True),
    (3, "priority", True),
    (8, "priority", True),
    (9, "priority", True),
    (6, "static", True),
    (9, "static", True),
    (13, "fcfs", False),
    (10, "priority", False),
    (12, "priority", False),
]


@pytest.mark.parametrize("seed, policy, chunked", STRESS_CASES)
def test_random_arrivals_aborts_and_tiny_cache_keep_integrity_and_greedy_outputs(
    model_path, reference, seed, policy, chunked
):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    blocks_for_largest = -(-(30 + 11 + 10) // block_size)
    engine = make_engine(
        model_path,
        block_size=block_size,
        num_blocks=blocks_for_largest + rng.randrange(3),
        max_num_batched_tokens=rng.choice([3, 8, 16, 24] if chunked else [41, 48, 64]),
        max_num_seqs=rng.choice([3, 5, 8]),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=seed % 2 == 0,
        scheduling_policy=policy,
    )
    workload = random_workload(rng, 24, policy)
    done, aborted, aborted_in = _run_with_random_aborts(engine, rng, workload)

    assert engine.get_stats().scheduler.num_preemptions_total > 0, "the cache never ran out"
    # Without chunked prefill a prompt is computed in one step: never seen mid-prefill.
    states = set(STATES) if chunked else set(STATES) - {"prefill"}
    assert aborted_in >= states, f"no abort while {states - aborted_in}"
    assert_idle(engine)
    assert set(done) == {w[1] for w in workload} - set(aborted)
    for request_id, step in aborted.items():
        assert all(request_id not in s.num_scheduled_tokens for s in engine.trace[step:])
    compared = 0
    for _, request_id, prompt, params, _ in workload:
        if request_id in done:
            assert done[request_id].outputs[0].finish_reason in ("stop", "length")
            if params.temperature == 0:
                assert tokens(done, request_id) == reference(prompt, params.max_tokens), request_id
                compared += 1
    assert compared >= 6


def _run_with_random_aborts(engine: LLMEngine, rng: random.Random, workload: list[tuple]):
    """Adds requests at their arrival steps and aborts some before each step; checks the
    block accounting after every step. Returns (finished outputs by id, aborted id -> number
    of traced steps before its abort, the states that aborts hit)."""
    pending, step = list(workload), 0
    done: dict = {}
    aborted: dict[str, int] = {}
    aborted_in: set[str] = set()
    while pending or engine.has_unfinished_requests():
        assert step < MAX_STEPS, f"requests still unfinished after {MAX_STEPS} steps"
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params, priority = pending.pop(0)
            engine.add_request(request_id, prompt, params, priority=priority)
        for request_id in _pick_aborts(engine, rng, aborted_in):
            engine.abort_request(request_id)
            aborted[request_id] = len(engine.trace)
            assert request_id not in engine.kv_cache.req_to_blocks
            engine.check_integrity()
        for out in engine.step():
            assert out.request_id not in aborted, "output for an aborted request"
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        _assert_blocks_match_computed_tokens(engine)
        if engine.trace:
            last = engine.trace[-1]
            assert not set(last.preempted_request_ids) & set(last.num_scheduled_tokens), (
                "a request was preempted and resumed in the same step"
            )
        step += 1
    return done, aborted, aborted_in


def _assert_blocks_match_computed_tokens(engine: LLMEngine) -> None:
    """Between steps a running request holds exactly the blocks of its computed tokens (the
    scheduler allocates only what a step needs); a waiting one holds none."""
    block_size = engine.kv_cache.block_size
    for request in engine.scheduler.requests.values():
        held = len(engine.kv_cache.req_to_blocks.get(request.request_id, [[]])[0])
        if request.status == RequestStatus.RUNNING:
            assert held == -(-request.num_computed_tokens // block_size), request.request_id
        else:
            assert held == 0, f"{request.request_id} ({request.status.name}) holds {held} blocks"


def _pick_aborts(engine: LLMEngine, rng: random.Random, aborted_in: set[str]) -> list[str]:
    """Often one abort in each state not yet covered, plus rare ones in any state."""
    live = [r for r in engine.scheduler.requests.values() if not r.is_finished]
    picks = []
    for state in STATES:
        in_state = [r for r in live if state_of(r) == state]
        if in_state and (state not in aborted_in and rng.random() < 0.7 or rng.random() < 0.03):
            request = rng.choice(in_state)
            picks.append(request.request_id)
            aborted_in.add(state)
    return picks


# ---- 4. priority ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_arrival_at_full_batch_is_served_before_earlier_low_priority(
    model_path, reference, policy
):
    prompts = random_prompts(3, VOCAB, seed=21, max_len=12)
    engine = make_engine(model_path, max_num_seqs=2, scheduling_policy=policy)
    engine.add_request("low0", prompts[0], greedy(16), priority=1)
    engine.add_request("low1", prompts[1], greedy(16), priority=1)
    engine.step()
    engine.step()  # both low ones decode; every seat is taken
    engine.add_request("high", prompts[2], greedy(4), priority=0)
    done = run_to_completion(engine)
    next_step = engine.trace[2].num_scheduled_tokens
    finish = finish_steps(engine.trace)
    if policy == "priority":
        # It runs at once, in the seat of the latest low-priority request, and finishes first.
        assert set(next_step) == {"low0", "high"}
        assert finish["high"] < finish["low0"] and finish["high"] < finish["low1"]
        assert engine.get_stats().scheduler.num_preemptions_total == 1
    else:
        assert set(next_step) == {"low0", "low1"}
        assert first_steps(engine.trace)["high"] > min(finish["low0"], finish["low1"])
        assert engine.get_stats().scheduler.num_preemptions_total == 0
    for request_id, prompt, n in zip(("low0", "low1", "high"), prompts, (16, 16, 4), strict=True):
        assert tokens(done, request_id) == reference(prompt, n)


def test_waiting_requests_are_admitted_by_priority_then_arrival(model_path):
    engine = make_engine(model_path, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("running", [5, 6, 7], greedy(3), priority=9)
    engine.step()
    for request_id, priority in (("p2-a", 2), ("p0", 0), ("p2-b", 2), ("p1", 1)):
        engine.add_request(request_id, [8, 9, 10], greedy(2), priority=priority)
    run_to_completion(engine)
    first = first_steps(engine.trace)
    # "p0" took the seat of the low-priority "running" request at once (preempting it).
    order = sorted(first, key=lambda r: (first[r], r))
    assert order == ["running", "p0", "p1", "p2-a", "p2-b"]
    finish = finish_steps(engine.trace)
    assert finish["running"] == max(finish.values())  # resumed last, after its preemption


# ---- 5. static batching ------------------------------------------------------------------


def joined_a_batch_in_progress(trace) -> bool:
    """Some request started while a request that started earlier had not finished."""
    first, finish = first_steps(trace), finish_steps(trace)
    return any(first[q] < first[r] <= finish[q] for r in first for q in first)


def test_static_policy_admits_no_one_until_the_whole_batch_finished(model_path):
    prompts = random_prompts(9, VOCAB, seed=6, max_len=30)
    params = [greedy(2 + i % 5) for i in range(9)]

    def run(policy: str):
        engine = make_engine(model_path, max_num_seqs=3, scheduling_policy=policy)
        for i in range(6):
            engine.add_request(str(i), prompts[i], params[i])
        early = {out.request_id: out for _ in range(2) for out in engine.step() if out.finished}
        for i in range(6, 9):  # late arrivals
            engine.add_request(str(i), prompts[i], params[i])
        return engine.trace, early | run_to_completion(engine)

    static_trace, static = run("static")
    fcfs_trace, fcfs = run("fcfs")
    assert joined_a_batch_in_progress(fcfs_trace)  # the check below can fail
    assert not joined_a_batch_in_progress(static_trace)
    assert max(len(s.num_scheduled_tokens) for s in static_trace) == 3
    assert len(set(first_steps(static_trace).values())) == 3  # three batches of three
    assert len(static_trace) > len(fcfs_trace)
    for i in range(9):
        assert tokens(static, str(i)) == tokens(fcfs, str(i))


# ---- 6. requests too large for the cache -------------------------------------------------


def test_request_larger_than_the_cache_is_refused_and_the_engine_keeps_serving(
    model_path, reference
):
    engine = make_engine(model_path, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=r"needs 10 KV blocks; the whole cache has 8"):
        engine.add_request("big", list(range(3, 33)), greedy(10))  # 30 + 10 tokens
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    fits = list(range(40, 62))  # 22 + 10 tokens: exactly the 8 blocks of the cache
    small = [70, 71, 72, 73, 74]
    engine.add_request("fits", fits, greedy(10))
    engine.add_request("small", small, greedy(10))
    engine.add_request("big", list(range(3, 23)), greedy(10))  # the id is free to reuse
    done = run_to_completion(engine)
    assert tokens(done, "fits") == reference(fits, 10)
    assert tokens(done, "small") == reference(small, 10)
    assert tokens(done, "big") == reference(list(range(3, 23)), 10)
    assert engine.get_stats().scheduler.num_preemptions_total > 0
    assert_idle(engine)


# ---- 7. stats ------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_stats_count_running_waiting_preempted_and_kv_usage(model_path, caching):
    num_blocks, max_num_seqs = 14, 4
    engine = make_engine(
        model_path,
        block_size=4,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
    )
    prompts = random_prompts(8, VOCAB, seed=8, max_len=30)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(10))
    stats = engine.get_stats().scheduler
    assert (stats.num_running, stats.num_waiting, stats.num_preempted) == (0, 8, 0)
    assert stats.kv_cache_usage == 0.0
    seen = {"preempted": False, "total": 0}

    def check(engine: LLMEngine) -> None:
        stats = engine.get_stats().scheduler
        live = [r for r in engine.scheduler.requests.values() if not r.is_finished]
        statuses = [r.status for r in live]
        assert stats.num_running == statuses.count(RequestStatus.RUNNING) <= max_num_seqs
        assert stats.num_preempted == statuses.count(RequestStatus.PREEMPTED)
        assert stats.num_waiting == stats.num_preempted + statuses.count(RequestStatus.WAITING)
        assert stats.num_running + stats.num_waiting == engine.get_num_unfinished_requests()
        used = {b for tables in engine.kv_cache.req_to_blocks.values() for b in tables[0]}
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        assert stats.kv_cache_usage == pytest.approx(len(used) / num_blocks)
        # A preempted request waits at least until the next step.
        assert stats.num_preemptions_total >= seen["total"]
        if stats.num_preemptions_total > seen["total"]:
            assert stats.num_preempted > 0
        seen["total"] = stats.num_preemptions_total
        seen["preempted"] |= stats.num_preempted > 0

    run_to_completion(engine, on_step=check)
    assert seen["preempted"], "no step saw a preempted request waiting"
    stats = engine.get_stats().scheduler
    assert (stats.num_running, stats.num_waiting, stats.num_preempted) == (0, 0, 0)
    assert stats.kv_cache_usage == 0.0
    assert_idle(engine)


# ---- 8. abort ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("state", STATES)
def test_abort_frees_blocks_at_once_and_yields_no_output(model_path, reference, state, policy):
    # Budget 8: "victim" waits behind "a" at first, then prefills in chunks, then decodes,
    # until the 10-block cache runs out and it is preempted (it arrived last).
    engine = make_engine(
        model_path,
        block_size=4,
        num_blocks=10,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        scheduling_policy=policy,
        enable_prefix_caching=False,
    )
    prompts = {"a": list(range(10, 22)), "victim": list(range(30, 50)), "c": [60, 61, 62]}
    max_tokens = {"a": 16, "victim": 16, "c": 4}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens[request_id]))
    victim = engine.scheduler.requests["victim"]
    for _ in range(40):
        engine.step()
        engine.check_integrity()
        if state_of(victim) == state:
            break
    assert state_of(victim) == state, f"victim never reached {state}"
    held = len(engine.kv_cache.req_to_blocks.get("victim", [[]])[0])
    assert (held > 0) == (state in ("prefill", "decode"))
    num_free = engine.kv_cache.pool.num_free_blocks
    num_unfinished = engine.get_num_unfinished_requests()
    engine.abort_request("victim")
    assert "victim" not in engine.kv_cache.req_to_blocks
    assert engine.kv_cache.pool.num_free_blocks == num_free + held
    assert engine.get_num_unfinished_requests() == num_unfinished - 1
    assert "victim" not in engine.scheduler.requests
    engine.check_integrity()
    step = len(engine.trace)
    done = run_to_completion(engine)
    assert "victim" not in done
    assert all("victim" not in s.num_scheduled_tokens for s in engine.trace[step:])
    assert all("victim" not in s.finished_request_ids for s in engine.trace[step:])
    for request_id in ("a", "c"):
        expected = reference(prompts[request_id], max_tokens[request_id])
        assert tokens(done, request_id) == expected
    assert_idle(engine)


# ---- 9. block pool -------------------------------------------------------------------------


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_removes_from_the_middle_in_constant_time_and_keeps_order():
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert _ids(queue) == [0, 1, 3, 5] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.remove(blocks[5])  # the tail's neighbour links are kept right
    queue.append(blocks[4])
    assert _ids(queue) == [1, 3, 2, 4] and len(queue) == 4
    for _ in range(4):
        queue.popleft()
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(ValueError):
        queue.popleft()


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, greedy(1), max_tokens=1, eos_token_ids=frozenset())


def _prefill(manager: KVCacheManager, request: Request) -> None:
    """Allocates and 'computes' the whole prompt, caching its full blocks."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)


def test_eviction_is_lru_with_a_freed_requests_tail_block_first():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5, 6])  # 3 full blocks
    b = _request("b", [7, 8, 9, 10, 11, 12])
    _prefill(manager, a)
    _prefill(manager, b)
    [a_blocks], [b_blocks] = manager.req_to_blocks["a"], manager.req_to_blocks["b"]
    manager.free(a)
    manager.free(b)
    manager.check_integrity()
    # Never-used blocks first, then a's blocks tail first, then b's.
    expected = [6, 7] + _ids(a_blocks[::-1]) + _ids(b_blocks[::-1])
    assert _ids(manager.pool.free_queue) == expected
    assert len(manager.pool.cached) == 6
    taken = manager.pool.get_new_blocks(3)  # two never-used blocks, then a's tail block
    assert _ids(taken) == expected[:3]
    assert taken[2].block_hash is None and len(manager.pool.cached) == 5
    # a's prefix survives its tail: a re-run of a hits its first two blocks, b hits all three.
    a_hits, _ = manager.get_computed_blocks(_request("a2", [1, 2, 3, 4, 5, 6, 0]))
    b_hits, _ = manager.get_computed_blocks(_request("b2", [7, 8, 9, 10, 11, 12, 0]))
    assert a_hits == [a_blocks[:2]] and b_hits == [b_blocks]


def test_cached_block_hit_is_pulled_off_the_free_queue_and_shared():
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    first = _request("first", [1, 2, 3, 4, 5])
    _prefill(manager, first)
    prefix = manager.req_to_blocks["first"][0][:2]
    manager.free(first)
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in prefix)
    num_free = manager.pool.num_free_blocks
    second = _request("second", [1, 2, 3, 4, 9])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert hits == [prefix] and num_hit_tokens == 4
    manager.allocate_slots(second, 1, hits)
    assert all(b.ref_cnt == 1 for b in prefix)
    assert not set(_ids(prefix)) & set(_ids(manager.pool.free_queue))
    assert manager.pool.num_free_blocks == num_free - 3  # two hits and one new block
    second.num_computed_tokens = 4
    # A concurrent third request shares the same blocks: ref counts go to 2.
    third = _request("third", [1, 2, 3, 4, 7])
    hits, _ = manager.get_computed_blocks(third)
    manager.allocate_slots(third, 1, hits)
    assert all(b.ref_cnt == 2 for b in prefix)
    manager.check_integrity()
    manager.free(second)
    manager.free(third)
    assert all(b.ref_cnt == 0 for b in prefix)
    manager.check_integrity()


def test_block_hash_keys_on_the_tokens_so_a_digest_collision_serves_no_wrong_kv(monkeypatch):
    h1 = BlockHash(ROOT_DIGEST, (1, 2))
    h2 = BlockHash(ROOT_DIGEST, (1, 3))
    assert h1.parent_digest == h2.parent_digest and h1 != h2
    assert BlockHash(h1.digest, (5, 6)) != BlockHash(h2.digest, (5, 6))  # same tokens, other prefix
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h1)
    assert pool.get_cached_block(h1) is block
    assert pool.get_cached_block(h2) is None
    # Even if sha256 collided everywhere (every digest equal), the lookup compares tokens and
    # stops at the first block that differs, so no later block is served from another prefix.
    monkeypatch.setattr(BlockHash, "digest", property(lambda self: b"same"))
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    _prefill(manager, _request("x", [1, 2, 5, 6, 0]))
    assert manager.get_computed_blocks(_request("y", [3, 4, 5, 6, 0])) == ([[]], 0)
    hits, num = manager.get_computed_blocks(_request("z", [1, 2, 5, 6, 0]))
    assert num == 4 and _ids(hits[0]) == manager.block_ids("x")[0][:2]


def test_request_preempted_for_a_higher_priority_one_is_not_resumed_in_the_same_step(
    tiny_checkpoint,
):
    engine = LLMEngine(
        str(tiny_checkpoint("llama")),
        dtype="float64",
        scheduling_policy="priority",
        block_size=4,
        num_blocks=10,
        max_num_batched_tokens=16,
        record_trace=True,
        enable_prefix_caching=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("low", list(range(10, 40)), greedy, priority=5)
    for _ in range(3):  # two prefill chunks (16 + 14 tokens), then a decode: 8 blocks held
        engine.step()
    engine.add_request("high", list(range(50, 60)), greedy.clone(max_tokens=2), priority=-1)
    engine.step()
    step = engine.trace[-1]
    assert step.preempted_request_ids == ["low"]
    assert "high" in step.num_scheduled_tokens
    # 6 tokens of budget and 7 free blocks were left, but "low" was just evicted: it waits.
    assert "low" not in step.num_scheduled_tokens
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def test_blocks_without_a_hash_are_taken_again_before_never_used_ones():
    """Prefix caching off: a freed request's blocks are the next ones taken, so a server keeps
    writing the pages it has already written (on the CPU the first write of a page faults it in,
    block_pool's docstring); never-used blocks come only after them."""
    manager = KVCacheManager(num_blocks=10, block_size=2, enable_caching=False)
    a = _request("a", [1, 2, 3, 4, 5])  # 3 blocks
    _prefill(manager, a)
    a_blocks = set(_ids(manager.req_to_blocks["a"][0]))
    manager.free(a)
    manager.check_integrity()
    b = _request("b", [6, 7, 8, 9, 10, 11, 12, 13])  # 4 blocks: a's 3, then a never-used one
    _prefill(manager, b)
    taken = _ids(manager.req_to_blocks["b"][0])
    assert set(taken[:3]) == a_blocks and taken[3] not in a_blocks
    manager.check_integrity()


def test_a_freed_partial_block_is_taken_before_never_used_and_cached_ones():
    """Prefix caching on: a request's full blocks are cached and evicted least recently freed
    first, after every never-used block; its partial last block holds nothing to hit and is
    taken first."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5])  # 2 full blocks and a partial one
    _prefill(manager, a)
    [table] = manager.req_to_blocks["a"]
    full, partial = table[:2], table[2]
    manager.free(a)
    manager.check_integrity()
    order = _ids(manager.pool.free_queue)
    assert order[0] == partial.block_id and order[-2:] == _ids(full[::-1])
    assert manager.pool.get_new_blocks(1) == [partial]
    hits, _ = manager.get_computed_blocks(_request("a2", [1, 2, 3, 4, 9]))
    assert hits == [full]
