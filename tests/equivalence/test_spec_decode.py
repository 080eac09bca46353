"""Speculative decoding (issue #10): n-gram prompt lookup and a draft model, verified exactly.

Greedy outputs with speculation equal those without it and transformers' generate (float64,
tiny random checkpoints) across batching, a budget that cuts drafts, block edges, prefix-cache
hits, preemption, stop strings and max_tokens inside an accepted run; block accounting holds
after every step. The verifier is tested on crafted logits, and its sampled tokens against the
target distribution (chi-square).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from conftest import DEVICE_FLAGS, DEVICE_KWARGS, hf_greedy, random_prompts
from scipy import stats as scipy_stats
from tiny import build_tokenizer, tiny_config
from transformers import AutoModelForCausalLM

from conveyor import LLM, LLMEngine, SamplingParams
from conveyor.config import SpeculativeConfig
from conveyor.outputs import PenaltyCounts, SamplingRow
from conveyor.sample.sampler import Sampler, sampling_probs
from conveyor.sample.verifier import rejection_sample, verify
from conveyor.speculative.ngram import NgramProposer
from conveyor.speculative.policy import DraftPolicy

MAX_TOKENS = 24
MAX_STEPS = 2000
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 models are bound by per-op overhead: one thread (see test_scheduling)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def other_draft(model_path, tmp_path_factory) -> str:
    """A draft with the target's vocabulary and its last layer dropped (self-speculation by
    layer skipping): right only part of the time."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so n-gram lookup finds drafts) and plain ones."""
    plain = random_prompts(10, 384, seed=3, max_len=40)
    return [p + p[: len(p) // 2] + p for p in plain[:6]] + plain[6:]


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    return [tokens for tokens, _ in hf_greedy(model, prompts, MAX_TOKENS)]


def spec_configs(model_path: str, other_draft: str) -> dict[str, dict]:
    """Drafts verified every step ("adaptive": false), to exercise verification everywhere;
    and the default adaptive policy, which verifies fewer."""
    return {
        "ngram": NGRAM | {"adaptive": False},
        "ngram-adaptive": NGRAM,
        "draft-self": {
            "method": "draft_model",
            "model": model_path,
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
        "draft-other": {"model": other_draft, "num_speculative_tokens": 5, "adaptive": False},
    }


def run(engine: LLMEngine, requests: dict, on_step=None) -> dict:
    """Adds the requests, steps until idle checking block accounting after every step."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
        if on_step is not None:
            on_step(engine)
    raise AssertionError("requests unfinished")


def greedy_requests(prompts, lengths=None) -> dict:
    lengths = lengths or [MAX_TOKENS - i % 7 for i in range(len(prompts))]
    return {
        str(i): (p, SamplingParams(temperature=0, max_tokens=n, logprobs=0))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    }


# ---- configuration --------------------------------------------------------------------------


def test_config_defaults_follow_vllm():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2})
    assert config.method == "draft_model"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
        ("{not json", "not valid JSON"),
    ],
)
def test_config_refusals(value, message):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(value)
    assert message in str(info.value)


def test_draft_with_another_vocabulary_is_refused(model_path, tmp_path):
    draft = tmp_path / "draft"
    AutoModelForCausalLM.from_config(tiny_config("llama", 512)).save_pretrained(draft)
    build_tokenizer().save_pretrained(draft)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            model_path,
            dtype="float64",
            **DEVICE_KWARGS,
            speculative_config={"model": str(draft), "num_speculative_tokens": 2},
        )


def test_cli_refuses_a_bad_config_before_loading_a_model():
    bad = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 3,
            "prompt_lookup_max": 1,
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "serve", "--speculative-config", bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "prompt_lookup_min (3) must be <= prompt_lookup_max (1)" in result.stderr


# ---- the n-gram proposer --------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(4, 2, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6, 1]
    # "2 3" occurs twice before; "1 2 3" (longer) only at the start.
    assert proposer.propose([1, 2, 3, 7, 2, 3, 8, 1, 2, 3]) == [7, 2, 3, 8]
    # Two matches of max length: the one whose earlier context agrees wins.
    assert proposer.propose([9, 7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 9, 7, 1, 2, 3]) == [4, 8, 1, 2]
    # Equal context: the latest.
    assert proposer.propose([1, 2, 5, 1, 2, 6, 1, 2]) == [6, 1, 2]
    assert proposer.propose([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert proposer.propose([4, 1, 2, 4]) == []  # a match shorter than min
    assert NgramProposer(2, 1, 3).propose([1, 2, 3, 4, 5, 6, 1]) == [2, 3]  # k caps


@pytest.mark.serial
def test_ngram_costs_well_under_a_millisecond():
    import time

    rng = np.random.default_rng(0)
    proposer = NgramProposer(8, 2, 5)
    for tokens in (rng.integers(0, 50_000, 4096).tolist(), rng.integers(0, 4, 4096).tolist()):
        start = time.perf_counter()
        for _ in range(50):
            proposer.propose(tokens)
        assert (time.perf_counter() - start) / 50 < 1e-3


# ---- the verifier ---------------------------------------------------------------------------


def one_hot_logits(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab, dtype=torch.float64)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def row(params: SamplingParams, generator=None, output=()) -> SamplingRow:
    return SamplingRow(params, generator, list(output))


GREEDY = SamplingParams(temperature=0)


def test_verifier_greedy_cases():
    sampler = Sampler([0])
    # all accepted plus the bonus token
    tokens, _, _ = verify(sampler, one_hot_logits([3, 4, 5, 6]), [row(GREEDY)], [[3, 4, 5]])
    assert tokens == [[3, 4, 5, 6]]
    # first mismatch: the target's token replaces it and the rest is dropped
    tokens, _, _ = verify(sampler, one_hot_logits([3, 7, 5, 6]), [row(GREEDY)], [[3, 4, 5]])
    assert tokens == [[3, 7]]
    tokens, _, _ = verify(sampler, one_hot_logits([2, 4, 5, 6]), [row(GREEDY)], [[3, 4, 5]])
    assert tokens == [[2]]
    # a batch mixing 0, 1 and k drafts
    logits = one_hot_logits([1] + [2, 3] + [4, 5, 6, 7])
    tokens, logprobs, _ = verify(
        sampler,
        logits,
        [row(GREEDY), row(SamplingParams(temperature=0, logprobs=1)), row(GREEDY)],
        [[], [2], [4, 5, 0]],
    )
    assert tokens == [[1], [2, 3], [4, 5, 6]]
    assert logprobs[0] is None and logprobs[2] is None
    assert [max(p, key=lambda t: p[t].logprob) for p in logprobs[1]] == [2, 3]


def test_verifier_applies_penalties_and_min_tokens_as_of_each_position():
    sampler = Sampler([0])
    # min_tokens=2: EOS (0) may not end the request at position 0 or 1, but may at 2.
    params = SamplingParams(temperature=0, min_tokens=2)
    logits = one_hot_logits([0, 0, 0])
    logits[:, 5] = 4.0  # the runner-up
    tokens, _, _ = verify(sampler, logits, [row(params)], [[5, 5]])
    assert tokens == [[5, 5, 0]]
    # A repetition penalty counts the accepted drafts before a position as generated.
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    logits = torch.zeros(2, 8, dtype=torch.float64)
    logits[:, 3], logits[:, 4] = 5.0, 3.0
    counts = PenaltyCounts([1], 8)
    tokens, _, _ = verify(sampler, logits, [SamplingRow(params, None, [], counts)], [[3]])
    assert tokens == [[3, 4]]  # position 1 sees 3 as generated: 5 / 2 < 3


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    probs = sampling_probs(logits.unsqueeze(0), [params])[0]
    return (probs / probs.sum()).numpy()


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    expected = expected_probs[keep] * counts.sum()
    return scipy_stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.parametrize("drafts", ["fixed", "random", "draft-probs"])
def test_rejection_sampling_follows_the_target_distribution(drafts):
    """The first token's distribution is the target's whatever the draft (chi-square); so is
    the second's, given the first draft was accepted."""
    vocab, draws = 6, 12_000
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor(
        [[1.0, 0.5, 2.0, -1.0, 0.0, 1.5], [0.2, 2.0, 0.1, 1.0, -0.5, 0.3]], dtype=torch.float64
    )
    params = SamplingParams(temperature=0.8, top_k=5)
    target = [target_distribution(logits[j], params) for j in range(2)]
    probs = torch.stack([torch.from_numpy(t) for t in target] + [torch.from_numpy(target[1])])
    q = torch.softmax(torch.randn(2, vocab, generator=gen, dtype=torch.float64), -1)
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    for _ in range(draws):
        if drafts == "fixed":
            draft = [2, 1]
        else:
            draft = torch.randint(0, vocab, (2,), generator=gen).tolist()
        if drafts == "draft-probs":
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        out = rejection_sample(probs, draft, gen, q if drafts == "draft-probs" else None)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == draft[0]:
            second[out[1]] += 1
    assert chi_square_p(first, target[0]) > 1e-3
    assert second.sum() > 1000
    assert chi_square_p(second, target[1]) > 1e-3


def test_sampled_verification_through_the_sampler_pipeline():
    """verify() on a sampled row: the first token follows temperature + top-p + min-p."""
    sampler = Sampler([0], seed=1)
    params = SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.8, 0.3, 0.9]] * 3, dtype=torch.float64)
    counts = np.zeros(8)
    for _ in range(6000):
        tokens, _, _ = verify(sampler, logits, [row(params)], [[5, 1]])
        counts[tokens[0][0]] += 1
    assert chi_square_p(counts, target_distribution(logits[0], params)) > 1e-3


# ---- the draft policy ------------------------------------------------------------------------


def policy_with_costs(costs: dict[int, float]) -> DraftPolicy:
    policy = DraftPolicy()
    for _ in range(3):  # a width counts from its third step
        for num_tokens, seconds in costs.items():
            policy.observe_step(num_tokens, seconds)
    return policy


def test_policy_takes_likely_drafts_while_the_step_is_bound_by_reading_weights():
    # 25 ms for one token, +2.5 ms per token: the first drafts nearly free.
    policy = policy_with_costs({1: 0.025, 8: 0.0425, 32: 0.1025})
    likely, unlikely = [8.0, 10.0], [0.0, 10.0]  # accepted / tried so far
    chosen = policy.choose([("a", likely, 4), ("b", unlikely, 4)], 2, 2, 100)
    assert chosen.get("a") == 4  # 0.8 ** 4 = 0.41 still pays
    assert "b" not in chosen
    # Without a cost model yet, every draft is taken (that is how wider steps get seen).
    assert DraftPolicy().choose([("a", likely, 4), ("b", unlikely, 4)], 2, 2, 100) == {
        "a": 4,
        "b": 4,
    }
    # The budget caps them.
    assert sum(policy.choose([("a", likely, 4)], 1, 1, 3).values()) == 3


def test_policy_drops_drafts_once_the_step_is_bound_by_arithmetic():
    # 32 decoding requests; each token of width costs nearly as much as a token of output
    # (20 ms + 4.4 ms per token).
    policy = policy_with_costs({32: 0.1608, 64: 0.3016, 128: 0.5832})
    candidates = [(str(i), [6.0, 10.0], 4) for i in range(32)]  # 60% acceptance
    assert policy.choose(candidates, 32, 32, 2048) == {}
    # Accepted nearly always: worth it even there.
    sure = [(str(i), [50.0, 50.5], 4) for i in range(32)]
    assert len(policy.choose(sure, 32, 32, 2048)) >= 16
    assert DraftPolicy(adaptive=False).choose(candidates, 32, 32, 2048) == {
        str(i): 4 for i in range(32)
    }


def test_policy_measures_again_a_width_it_stopped_taking():
    """A width that looked too costly (noise) is forgotten after 100 steps without it, so
    drafts are taken again and the width is measured anew."""
    policy = policy_with_costs({1: 0.025, 2: 0.030, 5: 0.500})  # 5 wide: a noisy 500 ms
    likely = [8.0, 10.0]
    assert policy.choose([("a", likely, 4)], 1, 1, 100) == {"a": 1}
    for _ in range(101):
        policy.observe_step(1, 0.025)
    assert policy.choose([("a", likely, 4)], 1, 1, 100) == {"a": 4}


def test_policy_tries_a_written_off_request_again_after_a_while():
    policy = policy_with_costs({1: 0.025, 8: 0.0425})
    counts = [0.0, 0.0]
    for _ in range(5):  # five verifications, nothing accepted
        policy.observe_verification(counts, 4, 0)
    assert policy.choose([("a", counts, 4)], 1, 1, 100) == {}
    retried = None
    for step in range(60):
        if policy.choose([("a", counts, 4)], 1, 1, 100):
            retried = step
            break
    assert retried is not None and retried > 3


# ---- exact greedy output in the engine -------------------------------------------------------


@pytest.mark.parametrize("name", ["ngram", "ngram-adaptive", "draft-self", "draft-other"])
def test_greedy_with_speculation_equals_transformers(
    name, model_path, other_draft, prompts, reference
):
    config = spec_configs(model_path, other_draft)[name]
    engine = LLMEngine(
        model_path, dtype="float64", **DEVICE_KWARGS, block_size=4, speculative_config=config
    )
    free = engine.kv_cache.pool.num_free_blocks
    done = run(engine, greedy_requests(prompts, [MAX_TOKENS] * len(prompts)))
    for i, expected in enumerate(reference):
        assert done[str(i)].token_ids == expected, f"prompt {i}"
    spec = engine.get_stats().spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    if name == "draft-self":
        assert spec.acceptance_rate == 1.0  # the target drafting for itself is always right
        assert spec.accepted_per_position[0] == spec.num_drafts
        # 1 + 3 per verification, less where max_tokens cut the last drafts
        assert 3.5 < spec.mean_accepted_length <= 4.0
    else:
        assert spec.acceptance_rate < 1.0
    assert engine.kv_cache.pool.num_free_blocks == free
    assert engine.kv_cache.req_to_blocks == {}


@pytest.mark.parametrize("name", ["ngram", "draft-other"])
def test_budget_cuts_prefix_cache_and_preemption_keep_outputs_exact(
    name, model_path, other_draft, prompts, reference
):
    """A budget of 6 tokens cuts drafts (and chunks prompts); shared prefixes hit the cache;
    a cache of 32 blocks of 4 tokens preempts; logprobs agree with speculation off."""
    config = spec_configs(model_path, other_draft)[name]
    shared = max(prompts, key=len)[:12]
    extra = [shared + p[:9] for p in prompts[6:]]
    all_prompts = prompts + extra
    requests = greedy_requests(all_prompts)
    kwargs = dict(
        dtype="float64", **DEVICE_KWARGS, block_size=4, num_blocks=32, max_num_batched_tokens=6
    )
    spec_engine = LLMEngine(model_path, speculative_config=config, record_trace=True, **kwargs)
    plain_engine = LLMEngine(model_path, **kwargs)
    budget_cut = []

    def watch(engine):
        step = engine.trace[-1]
        budget_cut.append(sum(step.num_scheduled_tokens.values()))

    done = run(spec_engine, requests, watch)
    plain = run(plain_engine, requests)
    stats = spec_engine.get_stats()
    assert stats.scheduler.num_preemptions_total > 0
    assert stats.scheduler.prefix_cache_hits > 0
    assert max(budget_cut) == 6
    for i in range(len(prompts)):
        assert done[str(i)].token_ids == reference[i][: len(done[str(i)].token_ids)]
    for request_id, out in plain.items():
        assert done[request_id].token_ids == out.token_ids
        got = [p[t].logprob for p, t in zip(done[request_id].logprobs, out.token_ids, strict=True)]
        want = [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert np.allclose(got, want, atol=1e-9)
    assert spec_engine.kv_cache.pool.num_free_blocks == spec_engine.num_blocks


def test_stop_tokens_strings_and_max_tokens_inside_an_accepted_run(model_path, prompts, reference):
    """The target drafting for itself accepts every draft, so each stop lands inside a run of
    accepted tokens; what follows the stop is dropped exactly as without speculation."""
    config = {
        "method": "draft_model",
        "model": model_path,
        "num_speculative_tokens": 5,
        "adaptive": False,
    }
    spec = LLM(model_path, dtype="float64", **DEVICE_KWARGS, speculative_config=config)
    plain = LLM(model_path, dtype="float64", **DEVICE_KWARGS)
    tokenizer = plain.get_tokenizer()
    params = []
    for i, expected in enumerate(reference[:6]):
        if i % 3 == 0:  # a stop token at the 7th position
            params.append(
                SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[expected[6]])
            )
        elif i % 3 == 1:  # a stop string made of the text of tokens 5-6
            text = tokenizer.decode(expected[4:6])
            params.append(
                SamplingParams(temperature=0, max_tokens=20, stop=[text] if text.strip() else None)
            )
        else:  # max_tokens in the middle of a run of 5 drafts
            params.append(SamplingParams(temperature=0, max_tokens=8))
    prompt_list = prompts[:6]
    got = spec.generate(prompt_list, params, use_tqdm=False)
    want = plain.generate(prompt_list, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].stop_reason == b.outputs[0].stop_reason
    assert sum(len(o.outputs[0].token_ids) for o in got) < sum(20 for _ in got)
    assert spec.engine.kv_cache.pool.num_free_blocks == spec.engine.num_blocks


def test_abort_while_verifying_drafts_frees_everything(model_path, prompts):
    config = {"model": model_path, "num_speculative_tokens": 4, "adaptive": False}
    engine = LLMEngine(
        model_path, dtype="float64", **DEVICE_KWARGS, block_size=4, speculative_config=config
    )
    requests = greedy_requests(prompts[:4], [MAX_TOKENS] * 4)
    aborted = []

    def abort_midway(engine):
        request = engine.scheduler.requests.get("1")
        if not aborted and request is not None and request.num_output_tokens >= 5:
            engine.abort_request("1")
            aborted.append(request.num_output_tokens)

    done = run(engine, requests, abort_midway)
    assert aborted and aborted[0] < MAX_TOKENS
    assert "1" not in done  # an aborted request gets no finished output from step()
    assert all(done[str(i)].finish_reason == "length" for i in (0, 2, 3))
    assert engine.kv_cache.req_to_blocks == {}
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks


def test_seeded_sampling_with_speculation_is_reproducible_whatever_the_batch(model_path, prompts):
    config = {"model": model_path, "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=16)
    other = SamplingParams(temperature=1.0, max_tokens=16)
    llm = LLM(model_path, dtype="float64", **DEVICE_KWARGS, speculative_config=config)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts[:4], [params, other, other, other], use_tqdm=False)
    assert alone == again == batch[0].outputs[0].token_ids
    assert llm.engine.get_stats().spec.num_draft_tokens > 0


# ---- the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_server(model_path, tmp_path_factory):
    """The tiny model drafting for itself: every draft is accepted, so each decode step
    streams 1 + 3 tokens at once."""
    from server_util import ServerProcess

    config = {"model": model_path, "num_speculative_tokens": 3, "adaptive": False}
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    proc = ServerProcess(
        [
            model_path,
            "--dtype",
            "float64",
            *DEVICE_FLAGS,
            "--speculative-config",
            json.dumps(config),
        ],
        log,
    )
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def test_server_streams_each_steps_accepted_tokens_as_one_delta(spec_server, model_path, prompts):
    import openai

    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="x", max_retries=0)
    before = spec_server.metrics()
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompts[2],
        max_tokens=14,
        temperature=0,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    tokens_per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert max(tokens_per_chunk) == 4  # the step's own token and its 3 accepted drafts
    assert sum(tokens_per_chunk) == chunks[-1].usage.completion_tokens == 14
    plain = LLM(model_path, dtype="float64", **DEVICE_KWARGS).generate(
        [prompts[2]], SamplingParams(temperature=0, max_tokens=14), use_tqdm=False
    )
    assert text == plain[0].outputs[0].text
    after = spec_server.metrics()

    def grew(name: str) -> float:
        return after[f"conveyor:{name}"] - before.get(f"conveyor:{name}", 0.0)

    drafts = grew("spec_decode_num_drafts_total")
    assert drafts > 0
    assert grew("spec_decode_num_draft_tokens_total") == grew(
        "spec_decode_num_accepted_tokens_total"
    )
    per_pos = "conveyor:spec_decode_num_accepted_tokens_per_pos_total"
    first = next(k for k in after if k.startswith(per_pos + "{") and "position=0" in k)
    assert after[first] - before.get(first, 0.0) == drafts
    # The dashboard's acceptance is the same count.
    totals = httpx.get(f"{spec_server.base_url}/dashboard/state", timeout=10).json()["totals"]
    assert totals["spec_draft_tokens"] == after["conveyor:spec_decode_num_draft_tokens_total"]
    assert totals["spec_accepted"] == after["conveyor:spec_decode_num_accepted_tokens_total"]
