"""Prompt logprobs and embeddings equal transformers' (float64, tiny random llama), whatever
the chunking, next to generating requests, and with the prefix cache on (a cached prompt is
recomputed, never skipped); allowed_token_ids and bad_words constrain what is sampled."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_KWARGS, LOGPROB_TOL, hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams

NUM_TOP = 3


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = random_prompts(6, model.config.vocab_size, seed=7, max_len=60)
    return path, model, [p for p in prompts if len(p) > 1]


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab): the log-distribution of each prompt token after the first."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def hf_embedding(model, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def check_prompt_logprobs(output, reference: torch.Tensor) -> None:
    positions = output.prompt_logprobs
    prompt = output.prompt_token_ids
    assert positions is not None and len(positions) == len(prompt)
    assert positions[0] is None
    for j, position in enumerate(positions[1:]):
        expected = reference[j]
        token = prompt[j + 1]
        assert abs(position[token].logprob - expected[token].item()) < LOGPROB_TOL
        assert position[token].rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(NUM_TOP).indices.tolist()
        assert set(top) <= set(position), f"position {j + 1}: top-{NUM_TOP} missing"
        for rank, t in enumerate(top, start=1):
            assert position[t].rank == rank or t == token


@pytest.mark.parametrize("budget", [4096, 16])
def test_prompt_logprobs_match_transformers_beside_generating_requests(case, budget):
    path, model, prompts = case
    llm = LLM(
        str(path),
        dtype="float64",
        **DEVICE_KWARGS,
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
    )
    asking = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=NUM_TOP, logprobs=0)
    plain = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    # Each prompt twice (the second could be a prefix-cache hit) and once without asking.
    batch = prompts + prompts + prompts
    params = [asking] * (2 * len(prompts)) + [plain] * len(prompts)
    outputs = llm.generate(batch, params, use_tqdm=False)
    generated = hf_greedy(model, prompts, 4)
    for i, out in enumerate(outputs):
        prompt_index = i % len(prompts)
        assert out.outputs[0].token_ids == generated[prompt_index][0]
        if params[i] is asking:
            check_prompt_logprobs(out, hf_prompt_logprobs(model, prompts[prompt_index]))
        else:
            assert out.prompt_logprobs is None
    # A prompt seen before, asked again once its blocks are cached: still computed in full.
    again = llm.generate([prompts[0]], asking, use_tqdm=False)[0]
    check_prompt_logprobs(again, hf_prompt_logprobs(model, prompts[0]))


def test_prompt_logprobs_with_max_tokens_zero_generate_nothing(case):
    path, model, prompts = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outputs = llm.generate(prompts[:3], params, use_tqdm=False)
    for out, prompt in zip(outputs, prompts[:3], strict=True):
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        reference = hf_prompt_logprobs(model, prompt)
        got = [p[t].logprob for p, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        want = [reference[j, t].item() for j, t in enumerate(prompt[1:])]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < LOGPROB_TOL


def test_max_tokens_zero_needs_something_to_compute():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=3, pooling="mean")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_in_any_chunking(case, pooling):
    path, model, prompts = case
    by_budget = {}
    for budget in (4096, 16):
        llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=budget)
        params = SamplingParams(max_tokens=0, pooling=pooling)
        generating = SamplingParams(temperature=0, max_tokens=5)
        outputs = llm.generate(prompts + prompts[:2], [params] * len(prompts) + [generating] * 2)
        by_budget[budget] = [out.embedding for out in outputs[: len(prompts)]]
        assert all(out.embedding is None for out in outputs[len(prompts) :])
        embedded = llm.embed(prompts[:2], pooling=pooling, use_tqdm=False)
        assert [out.outputs.embedding for out in embedded] == by_budget[budget][:2]
    for prompt, got in zip(prompts, by_budget[16], strict=True):
        want = hf_embedding(model, prompt, pooling)
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=1e-9)
    assert by_budget[16] == by_budget[4096]  # bitwise: one reduction, whatever the chunks


def test_allowed_token_ids_restrict_sampling_to_them(case):
    path, model, prompts = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    allowed = [5, 17, 42, 99]
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed)
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    assert out.token_ids[0] == allowed[int(logits[allowed].argmax())]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=allowed)
    out = llm.generate([prompts[1]], sampled, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_bad_words_ban_their_last_token_after_the_rest(case):
    path, model, prompts = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    free = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6))[0]
    tokens = free.outputs[0].token_ids
    # Ban the pair the free run produced at positions 1-2: its second token may still come,
    # but never right after the first.
    pair = tokens[1:3]
    params = SamplingParams(temperature=0, max_tokens=6, bad_words_token_ids=[pair])
    banned = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert banned[:2] == tokens[:2] and banned[2] != tokens[2]
    pairs = list(zip(banned, banned[1:], strict=False))
    assert tuple(pair) not in pairs
    single = SamplingParams(temperature=0, max_tokens=6, bad_words_token_ids=[[tokens[0]]])
    out = llm.generate([prompts[0]], single, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[0] not in out


def test_prompt_rows_survive_preemption(case):
    path, model, prompts = case
    # 6 blocks of 16 hold two of these requests at most: the others are preempted and redone.
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, num_blocks=6, max_num_batched_tokens=32)
    asking = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=NUM_TOP)
    embedding = SamplingParams(max_tokens=0, pooling="mean")
    batch = prompts + prompts
    params = [asking] * len(prompts) + [embedding] * len(prompts)
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert llm.engine.get_stats().scheduler.num_preemptions_total > 0, "nothing preempted"
    for out, prompt in zip(outputs[: len(prompts)], prompts, strict=True):
        check_prompt_logprobs(out, hf_prompt_logprobs(model, prompt))
    for out, prompt in zip(outputs[len(prompts) :], prompts, strict=True):
        want = hf_embedding(model, prompt, "mean")
        assert torch.allclose(torch.tensor(out.embedding, dtype=torch.float64), want, atol=1e-9)
