"""No single request can kill, stall or corrupt the engine: atomic admission, failures of one
request kept to that request, a dead engine loop reported at once, and penalties / logit bias
that stay exact while their cost no longer grows with a request's history."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLMEngine, SamplingParams
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.streams import EngineDeadError
from conveyor.outputs import OutputKind


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture
def engine(checkpoint):
    return LLMEngine(checkpoint, dtype="float64", max_model_len=128)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(engine: LLMEngine) -> dict:
    """Steps until idle, checking block integrity after every step; finished outputs by id."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
    return finished


def generate_once(async_engine: AsyncEngine, max_tokens: int) -> list:
    """Runs one greedy request through the engine thread, then shuts it down."""

    async def generate():
        stream = await async_engine.add_request("r", [5, 6, 7], greedy(max_tokens))
        return [out async for out in stream]

    try:
        return asyncio.run(generate())
    finally:
        async_engine.shutdown()


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.scheduler.requests, "a finished request left state behind"
    assert engine.get_stats().scheduler.kv_cache_usage == 0.0


# ---- atomic admission ------------------------------------------------------------------------


def test_n2_with_the_largest_seed_runs_and_later_requests_still_step(engine):
    engine.add_request("top", [5, 6, 7], SamplingParams(n=2, seed=2**64 - 1, max_tokens=6))
    engine.add_request("after", [8, 9], greedy(4))
    finished = run(engine)
    top = finished["top"].outputs
    assert [len(c.token_ids) for c in top] <= [6, 6] and len(top) == 2
    assert len(finished["after"].outputs[0].token_ids) == 4
    assert_idle(engine)


def test_child_seeds_wrap_and_are_reproducible(engine):
    params = SamplingParams(n=3, seed=2**64 - 2, max_tokens=8, temperature=1.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    first = [c.token_ids for c in run(engine)["a"].outputs]
    engine.add_request("a", [5, 6, 7], params)
    again = [c.token_ids for c in run(engine)["a"].outputs]
    assert first == again
    # child 2's seed wrapped to 0: it samples exactly like a request seeded 0
    engine.add_request("zero", [5, 6, 7], params.clone(n=1, seed=0))
    assert run(engine)["zero"].outputs[0].token_ids == first[2]


def test_a_request_refused_halfway_through_its_children_leaves_no_trace(engine, monkeypatch):
    make_request = engine.core._make_request
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("refused while building the third child")
        return make_request(*args)

    monkeypatch.setattr(engine.core, "_make_request", failing)
    with pytest.raises(ValueError, match="third child"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(n=4, max_tokens=4))
    monkeypatch.undo()
    assert_idle(engine)
    assert not engine.outputs.has_unfinished() and not engine.outputs._sequences
    engine.add_request("bad", [5, 6, 7], greedy(3))  # the id is free again
    assert len(run(engine)["bad"].outputs[0].token_ids) == 3


def test_min_tokens_beyond_what_the_context_leaves_is_refused(engine):
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("m", [5, 6, 7], SamplingParams(max_tokens=None, min_tokens=10**6))
    assert_idle(engine)


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: {vocab} is not in \[0, {vocab}\)"):
        engine.add_request("b", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    assert_idle(engine)


# ---- one request's failure stays with that request ----------------------------------------


def test_a_request_whose_detokenizer_raises_fails_alone(engine):
    for request_id in ("ok-1", "broken", "ok-2"):
        engine.add_request(request_id, [5, 6, 7, 8], greedy(6), output_kind=OutputKind.DELTA)
    engine.step()
    detokenizer = engine.outputs._sequences["broken"].detokenizer

    def explode(token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    detokenizer.update = explode
    finished = run(engine)
    broken = finished["broken"]
    assert broken.error is not None and "UnicodeDecodeError" in broken.error
    assert broken.outputs[0].finish_reason == "error"
    for request_id in ("ok-1", "ok-2"):
        assert finished[request_id].error is None
        assert finished[request_id].outputs[0].finish_reason == "length"
    assert_idle(engine)


def test_a_failing_metrics_callback_does_not_stop_the_engine(checkpoint):
    calls = []

    def on_step(engine, outputs):
        calls.append(len(outputs))
        raise RuntimeError("metrics exporter broke")

    async_engine = AsyncEngine(LLMEngine(checkpoint, dtype="float32"), on_step=on_step)
    outputs = generate_once(async_engine, 5)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 5
    assert len(calls) >= 5 and async_engine.error is None


def test_a_dead_engine_loop_fails_open_and_new_requests_at_once(checkpoint):
    engine = LLMEngine(checkpoint, dtype="float32")
    async_engine = AsyncEngine(engine)

    async def scenario():
        stream = await async_engine.add_request("r", [5, 6, 7], greedy(500))
        outputs = []
        with pytest.raises(EngineDeadError, match="injected fault"):
            async for out in stream:
                outputs.append(out)
                if len(outputs) == 3:
                    engine.runner.execute = _raise_injected
        assert not async_engine.is_alive
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("late", [5, 6], greedy(2))
        return outputs

    outputs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert len(outputs) >= 3 and not outputs[-1].finished


def _raise_injected(*args, **kwargs):
    raise RuntimeError("injected fault in the model step")


# ---- penalties and logit bias -----------------------------------------------------------------


def test_repetition_penalty_matches_transformers_greedy(checkpoint):
    prompts = random_prompts(4, 384, seed=3, max_len=20)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    reference = []
    for prompt in prompts:
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.7,
            pad_token_id=0,
            eos_token_id=None,
        )
        reference.append(out[0, len(prompt) :].tolist())
    engine = LLMEngine(checkpoint, dtype="float64")
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(24, repetition_penalty=1.7))
    finished = run(engine)
    assert [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))] == reference
    plain = [tokens for tokens, _ in hf_greedy(hf, prompts, 24)]
    assert plain != reference, "the penalty should change some greedy continuation"


def test_penalty_counts_follow_preemption_and_stay_exact(checkpoint):
    """A penalized request gives the same tokens alone and squeezed by preemptions."""
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
    )
    alone = LLMEngine(checkpoint, dtype="float64")
    alone.add_request("p", [5, 6, 7], params)
    expected = run(alone)["p"].outputs[0].token_ids
    tight = LLMEngine(checkpoint, dtype="float64", num_blocks=12, block_size=4)
    tight.add_request("p", [5, 6, 7], params)
    for i, prompt in enumerate(random_prompts(4, 384, seed=5, max_len=6)):
        tight.add_request(f"o{i}", prompt, greedy(16))
    finished = run(tight)
    assert tight.get_stats().scheduler.num_preemptions_total > 0
    assert finished["p"].outputs[0].token_ids == expected


def test_logit_bias_forces_and_forbids_tokens(engine):
    engine.add_request("free", [5, 6, 7], greedy(6))
    free = run(engine)["free"].outputs[0].token_ids
    engine.add_request("forced", [5, 6, 7], greedy(6, logit_bias={"42": 100.0}))
    assert run(engine)["forced"].outputs[0].token_ids == [42] * 6
    banned = {str(t): -100.0 for t in set(free)}
    engine.add_request("banned", [5, 6, 7], greedy(6, logit_bias=banned))
    assert not set(run(engine)["banned"].outputs[0].token_ids) & set(free)


def test_the_engine_is_built_and_stepped_on_the_engine_thread(checkpoint):
    """One thread does all torch work (see AsyncEngine): the factory runs on it."""
    built_on = []

    def factory():
        built_on.append(threading.current_thread().name)
        return LLMEngine(checkpoint, dtype="float32")

    async_engine = AsyncEngine(factory)
    outputs = generate_once(async_engine, 3)
    assert built_on == ["conveyor-engine"]
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 3


def test_a_factory_that_raises_raises_in_the_caller():
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(factory)
