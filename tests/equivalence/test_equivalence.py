"""Greedy outputs equal transformers' generate token for token (float64, tiny random
checkpoints of each architecture), and logprobs agree within 1e-6, however the engine batches:
(a) all in one step, (b) chunked prompts, (c) requests queueing for seats and joining
mid-flight, (d) requests added while others decode."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ARCHS,
    DEVICE,
    DEVICE_KWARGS,
    assert_matches_reference,
    hf_greedy,
    random_prompts,
)
from transformers import AutoModelForCausalLM

from conveyor import LLM, LLMEngine, SamplingParams

MAX_TOKENS = 10
NUM_PROMPTS = 16
# Different lengths, so that requests finish at different steps and seats free up mid-flight.
GREEDY = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i % 5, logprobs=0)
    for i in range(NUM_PROMPTS)
]


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = random_prompts(NUM_PROMPTS, ref_model.config.vocab_size, seed=1)
    reference = hf_greedy(ref_model, prompts, MAX_TOKENS)
    return path, prompts, _trimmed(reference)


def test_all_requests_in_one_step_match_transformers(case):
    path, prompts, reference = case
    llm = LLM(
        str(path), dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=4096, record_trace=True
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(llm.engine.trace[0].num_scheduled_tokens) == NUM_PROMPTS  # one step, all prompts
    assert_matches_reference(outputs, reference)


def test_chunked_prefill_matches_transformers(case):
    path, prompts, reference = case
    llm = LLM(
        str(path), dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=16, record_trace=True
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    longest = max(range(NUM_PROMPTS), key=lambda i: len(prompts[i]))
    chunks = [s.num_scheduled_tokens.get(f"{_ids(outputs)[longest]}", 0) for s in llm.engine.trace]
    assert sum(1 for c in chunks if c > 1) > 1, "the longest prompt was not split into chunks"
    assert_matches_reference(outputs, reference)


def test_requests_waiting_for_seats_join_mid_flight_and_match(case):
    path, prompts, reference = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, max_num_seqs=3, record_trace=True)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(len(s.num_scheduled_tokens) for s in llm.engine.trace) <= 3
    assert _joined_mid_flight(llm.engine.trace), "no request joined a batch already decoding"
    assert_matches_reference(outputs, reference)


def test_small_row_kernel_matches_transformers(case, monkeypatch):
    """Every projection through the compiled small-row kernel (kernels/gemm/small_gemm.cpp), which
    the engine otherwise uses only where it measures fastest: prompts of 1 to 3 rows per
    step's request, then decode steps of 1 to 3 rows."""
    monkeypatch.setenv("CONVEYOR_MATMUL", "kernel")
    from conveyor.model.layers import matmul_forms

    if DEVICE != "cpu" or set(matmul_forms(torch.float64).values()) != {"kernel"}:
        pytest.skip("the compiled kernels do not run here")
    path, prompts, reference = case
    llm = LLM(str(path), dtype="float64", max_num_seqs=3, max_num_batched_tokens=16)
    assert_matches_reference(llm.generate(prompts, GREEDY, use_tqdm=False), reference)


def test_requests_added_while_others_decode_match(case):
    path, prompts, reference = case
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=64, record_trace=True
    )
    pending = list(enumerate(prompts))
    done = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):  # two arrivals per step while decoding goes on
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, GREEDY[i])
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        engine.check_integrity()
    assert _joined_mid_flight(engine.trace)
    assert_matches_reference([done[i] for i in range(NUM_PROMPTS)], reference)


def _trimmed(reference):
    """A shorter max_tokens sees a prefix of the longest greedy run."""
    return [
        (t[: p.max_tokens], lp[: p.max_tokens])
        for (t, lp), p in zip(reference, GREEDY, strict=True)
    ]


def _ids(outputs) -> list[str]:
    return [o.request_id for o in outputs]


def _joined_mid_flight(trace) -> bool:
    """Some step ran a request for the first time next to a request that ran before."""
    seen: set[str] = set()
    for step in trace:
        ids = set(step.num_scheduled_tokens)
        if ids - seen and ids & seen:
            return True
        seen |= ids
    return False


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def gguf_case(request, tiny_checkpoint, tmp_path_factory):
    from gguf_util import transformers_config, write_gguf

    path = write_gguf(
        tiny_checkpoint("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf", request.param
    )
    config = transformers_config(path, tiny_checkpoint("llama"))  # its llama3 RoPE too
    ref_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float64
    )
    prompts = random_prompts(NUM_PROMPTS, ref_model.config.vocab_size, seed=2)
    reference = hf_greedy(ref_model, prompts, MAX_TOKENS)
    return path, prompts, _trimmed(reference)


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(max_num_batched_tokens=4096), dict(max_num_batched_tokens=16, max_num_seqs=3)],
    ids=["one-step", "chunked-and-queued"],
)
def test_gguf_checkpoint_matches_transformers(gguf_case, engine_kwargs):
    path, prompts, reference = gguf_case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, **engine_kwargs)
    assert_matches_reference(llm.generate(prompts, GREEDY, use_tqdm=False), reference)
