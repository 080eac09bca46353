"""A step-time target (max_step_ms) changes only where prompts are cut, never a request's
tokens: greedy outputs equal transformers' generate (float64 tiny llama), with the cost model
at fixed coefficients (so the chunks are known) and learning from the steps' own timing."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_KWARGS, assert_matches_reference, hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLMEngine, SamplingParams
from conveyor.core.step_budget import NUM_WARMUP_STEPS, StepBudget, StepTimeModel

MAX_TOKENS = 8
NUM_PROMPTS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = random_prompts(NUM_PROMPTS, model.config.vocab_size, seed=3)
    return path, prompts, hf_greedy(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("costs", ["fixed", "learnt"])
def test_prompts_cut_by_a_step_time_target_match_transformers(case, costs):
    path, prompts, reference = case
    # fixed: the prior's costs (next to a few decodes, ~40 prompt tokens fit in 30 ms);
    # learnt: this machine's steps, against a target below any of them.
    target = 30.0 if costs == "fixed" else 0.01
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, max_step_ms=target, record_trace=True
    )
    if costs == "fixed":
        engine.scheduler.step_budget = StepBudget(target, StepTimeModel(window=0))
    pending, done = list(enumerate(prompts)), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(3):  # arrivals while others decode
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    # Every step but the first two (warm-up), under the windows' lengths.
    num_observed = 0 if costs == "fixed" else len(engine.trace) - NUM_WARMUP_STEPS
    assert engine.scheduler.step_budget.model.num_observed == num_observed
    chunks = {str(i): 0 for i in range(NUM_PROMPTS)}
    for record in engine.trace:
        for request_id, num_tokens in record.num_scheduled_tokens.items():
            chunks[request_id] += num_tokens > 1 and record.decode_tokens > 0
    assert max(chunks.values()) > 1, "no prompt was cut next to decodes"
    assert_matches_reference([done[i] for i in range(NUM_PROMPTS)], reference)
