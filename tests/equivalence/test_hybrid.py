"""Hybrid models (recurrent layers beside attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2,
LFM2-MoE, Granite 4.0-H's Mamba2 layers with experts, Nemotron-H's blocks, dense and with
experts, Bamba; model/recurrent.py) against transformers in float64 on tiny random checkpoints
(their recurrences in float64: transformers runs its delta rule and Mamba2 scans in float32):
greedy tokens equal its generate, logprobs agree, all prompts in one step, chunked at an odd
budget with arrivals while others decode, and preempted in a small cache (a recompute starts its
state from zeros); each sequence holds one state slot while it runs. Tokens and logprobs are the
same bits alone or batched, whatever the chunking (float32). Drafts (n-gram, a draft model) are
verified, the rejected ones taken back out of the state. A prefix
hit continues from a snapshot of the recurrent state at its end (core/state_snapshots.py): a
repeated prompt, and a prompt extended by its own answer (a chat's next turn), get transformers'
tokens, and the same bits as computing the prefix."""

from __future__ import annotations

import contextlib
import importlib
import shutil
from unittest import mock

import pytest
import torch
from conftest import DEVICE_KWARGS, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file
from test_families import assert_reference as family_reference
from test_families import requests, run
from tiny import auto_class, make_tiny_checkpoint
from transformers import AutoConfig

from conveyor import LLMEngine, SamplingParams
from conveyor.speculative.ngram import NgramProposer

MAX_TOKENS = 8
# transformers' gated delta rule runs float32 even for a float64 model (so its own answers are
# 1e-4 off in logprob on these models); the reference's is replaced by the same rule in float64
# (float64_delta_rule), and what is left is its float32 RMSNorms of each head's output, which
# conveyor's float64 rule computes in float64.
TOLERANCE = 2e-5
_CASES: dict = {}
_DELTA_NET_MODULES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def float64_delta_rule(
    query, key, value, g, beta, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs,
):  # fmt: skip
    """transformers' torch_recurrent_gated_delta_rule in the inputs' dtype (float64 here)."""
    heads, key_heads, key_dim = value.shape[-2], key.shape[-2], key.shape[-1]
    if key_heads != heads:
        query = query.repeat_interleave(heads // key_heads, dim=2)
        key = key.repeat_interleave(heads // key_heads, dim=2)
    q, k, v, b, decay = (x.transpose(1, 2) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * key_dim**-0.5
    state = initial_state
    if state is None:
        state = torch.zeros(*v.shape[:2], key_dim, v.shape[-1], dtype=v.dtype)
    out = torch.zeros_like(v)
    for t in range(v.shape[2]):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).contiguous(), state if output_final_state else None


def float64_mamba2_scan(
    hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs,
):  # fmt: skip
    """transformers' mamba2_chunk_scan token by token in the inputs' dtype (float64 here; its
    own runs float32): (batch, length, heads, head_dim) outputs, the final state."""
    batch, length, heads, head_dim = hidden_states.shape
    per_group = heads // B.shape[2]
    B, C = B.repeat_interleave(per_group, dim=2), C.repeat_interleave(per_group, dim=2)
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(dt_limit[0], dt_limit[1])  # (batch, length, heads)
    state = initial_states
    if state is None:
        state = torch.zeros(batch, heads, head_dim, B.shape[-1], dtype=hidden_states.dtype)
    state = state.to(hidden_states.dtype)
    out = torch.empty_like(hidden_states)
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # (batch, heads, 1, 1)
        x = hidden_states[:, t] * dt[:, t, :, None]
        state = state * decay + x[..., None] * B[:, t, :, None, :]
        out[:, t] = (state * C[:, t, :, None, :]).sum(-1) + D[:, None] * hidden_states[:, t]
    return (out, state) if return_final_states else out


def float64_mamba2_step(
    state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
):
    """transformers' mamba2_selective_state_update in float64, its time step clamped as its
    chunk scan clamps it (the layer's time_step_limit)."""
    limit = kwargs.get("dt_limit") or _MAMBA_DT_LIMIT.get("value", (0.0, float("inf")))
    heads = hidden_states.shape[1]
    out, final = float64_mamba2_scan(
        hidden_states[:, None], dt[:, None, :, 0], A[:, 0, 0], B[:, None], C[:, None], 1,
        D=D[:, 0], dt_bias=dt_bias[:, 0], initial_states=state, dt_softplus=dt_softplus,
        dt_limit=limit, return_final_states=True,
    )  # fmt: skip
    state.copy_(final.to(state.dtype))
    assert out.shape[2] == heads
    return out[:, 0]


_MAMBA_DT_LIMIT: dict = {}
_MAMBA2_MODULES = ("granitemoehybrid", "nemotron_h", "bamba")


@contextlib.contextmanager
def exact_delta_rule():
    """transformers' delta-net and Mamba2 models computing their recurrences in float64
    (float64_delta_rule, float64_mamba2_scan / _step)."""
    with contextlib.ExitStack() as stack:
        for name in _DELTA_NET_MODULES:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            for rule in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
                stack.enter_context(mock.patch.object(module, rule, float64_delta_rule))
        for name in _MAMBA2_MODULES:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            stack.enter_context(mock.patch.object(module, "mamba2_chunk_scan", float64_mamba2_scan))
            step = float64_mamba2_step
            stack.enter_context(mock.patch.object(module, "mamba2_selective_state_update", step))
        yield


def _case(name: str, tmp_path_factory):
    if name not in _CASES:
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
        config = AutoConfig.from_pretrained(path)
        reference_model = auto_class(config).from_pretrained(
            path, dtype=torch.float64, experts_implementation="eager"
        )
        prompts = random_prompts(8, config.get_text_config().vocab_size, seed=3, max_len=40)
        _MAMBA_DT_LIMIT["value"] = (  # Nemotron-H's layers clamp dt from time_step_min
            (config.time_step_min, float("inf"))
            if config.model_type == "nemotron_h"
            else tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        )
        with exact_delta_rule():
            reference = hf_greedy(reference_model, prompts, MAX_TOKENS)
        _CASES[name] = str(path), prompts, reference
    return _CASES[name]


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5-vlm",
        "qwen3_next",
        "lfm2",
        "lfm2_moe",
        "granite4-h",
        "nemotron_h",
        "nemotron_h-moe",
        "bamba",
    ],
)
def hybrid(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return _case("qwen3_5", tmp_path_factory)


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "lfm2",
        "lfm2_moe",
        "granite4-h",
        "nemotron_h-moe",
    ],
)
def layers(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def assert_reference(done: dict, reference) -> None:
    family_reference("hybrid", done, reference, TOLERANCE)


def test_all_prompts_in_one_step_match_transformers(hybrid):
    path, prompts, reference = hybrid
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=4096)
    assert engine.model_config.parts.recurrent
    assert engine.kv_cache.snapshots is not None  # prefix caching on, with state snapshots
    assert_reference(run(engine, requests(prompts)), reference)


def _again(prompts, reference) -> tuple[list, dict]:
    """Each prompt repeated, extended by the first 3 tokens of its greedy answer, and by the
    first 7 (all it computed: a chat's next turn repeats the answer): requests, and each one's
    expected tokens and logprobs (greedy: an extension's are the answer's after it)."""
    todo, expected = [], {}
    for i, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, reference, strict=True)):
        turns = ((f"rep{i}", [], 0), (f"ext{i}", tokens[:3], 3), (f"turn{i}", tokens[:7], 7))
        for name, extra, skip in turns:
            if len(tokens) <= skip:  # the answer ended (EOS) within what the turn repeats
                continue
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS - skip, logprobs=0)
            todo.append((name, prompt + extra, params))
            expected[name] = tokens[skip:], logprobs[skip:]
    return todo, expected


def test_prefix_hits_continue_from_state_snapshots_with_transformers_tokens(hybrid):
    """Blocks of 4: each prompt's state is saved at its last block boundary (its chunk ends
    there) and at its answer's (the last boundary its output passed); a repeated prompt and
    ones extended by its answer hit those prefixes, restore the state and compute the rest:
    transformers' tokens and logprobs. An extension by the whole answer hits past the
    prompt."""
    path, prompts, reference = hybrid
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, block_size=4)
    assert_reference(run(engine, requests(prompts)), reference)
    snapshots = engine.kv_cache.snapshots
    long_enough = sum(len(p) > 4 for p in prompts)  # a block boundary before the last token
    # and one for the last boundary each answer passed (the 7 tokens of one of 8 pass one)
    full_answers = sum(len(tokens) == MAX_TOKENS for tokens, _ in reference)
    assert long_enough + full_answers <= len(snapshots.ready) <= long_enough + len(prompts)
    todo, expected = _again(prompts, reference)
    before = engine.get_stats().scheduler.prefix_cache_hits
    done = run(engine, [t for t in todo if t[0].startswith("turn")])
    past_prompt = engine.get_stats().scheduler.prefix_cache_hits - before
    assert past_prompt > sum((len(p) - 1) // 4 * 4 for p in prompts)
    done |= run(engine, [t for t in todo if not t[0].startswith("turn")])
    for name, (tokens, logprobs) in expected.items():
        got = done[name]
        assert got.token_ids == tokens, f"{name}: tokens differ from transformers"
        mine = [pos[t].logprob for pos, t in zip(got.logprobs, tokens, strict=True)]
        worst = max(abs(a - b) for a, b in zip(mine, logprobs, strict=True))
        assert worst < TOLERANCE, f"{name}: logprob differs by {worst}"
    assert snapshots.hits >= 2 * long_enough  # every repeat and extension of such a prompt
    assert engine.get_stats().scheduler.prefix_cache_hits > 0
    engine.check_integrity()


def test_a_prefix_hit_gives_the_same_bits_as_computing_it(layers):
    """float32: the repeats and extensions after the prompts ran (hits, restored states)
    against the same requests on an engine without prefix caching: every token and top-5
    logprob the same bits."""
    path, prompts, reference = layers

    def logprobs(out):
        return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    todo, _ = _again(prompts, reference)
    todo = [(n, p, params.clone(logprobs=5)) for n, p, params in todo]
    cached = LLMEngine(path, dtype="float32", **DEVICE_KWARGS, block_size=4)
    run(cached, requests(prompts))
    hot = run(cached, todo)
    assert cached.kv_cache.snapshots.hits > 0
    cold_engine = LLMEngine(
        path, dtype="float32", **DEVICE_KWARGS, block_size=4, enable_prefix_caching=False
    )
    cold = run(cold_engine, todo)
    for name, out in cold.items():
        assert hot[name].token_ids == out.token_ids, f"{name}: tokens differ after a hit"
        assert logprobs(hot[name]) == logprobs(out), f"{name}: logprobs differ after a hit"


def test_odd_chunks_arrivals_and_preemption_match_transformers(qwen3_5):
    """A state continues across a prompt's chunks of 7 tokens, and a preempted request starts
    its recompute from zeros in a slot it takes anew (check_integrity: exactly the running
    requests hold a slot after every step)."""
    path, prompts, reference = qwen3_5
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=7, record_trace=True
    )
    assert_reference(run(engine, requests(prompts), arrive_every=3), reference)
    assert max(sum(s.num_scheduled_tokens.values()) for s in engine.trace) == 7
    small = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, block_size=4, num_blocks=16,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    assert_reference(run(small, requests(prompts)), reference)
    assert small.get_stats().scheduler.num_preemptions_total > 0
    assert small.scheduler.state_slots == {}
    assert sorted(small.scheduler._free_slots) == [0, 1, 2, 3]


def test_tokens_and_logprobs_are_the_same_bits_alone_and_batched(layers):
    """float32: each prompt alone in steps of 4096 tokens, then all of them at once in odd
    chunks of 5 mixed with decode rows: every token and top-5 logprob the same bits (a
    mixture of experts' too)."""
    path, prompts, _ = layers
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)

    def logprobs(out):
        return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    alone = {}
    engine = LLMEngine(path, dtype="float32", **DEVICE_KWARGS, max_num_batched_tokens=4096)
    for i, prompt in enumerate(prompts):
        out = run(engine, [(str(i), prompt, params)])[str(i)]
        alone[str(i)] = out.token_ids, logprobs(out)
    batched = LLMEngine(path, dtype="float32", **DEVICE_KWARGS, max_num_batched_tokens=5)
    done = run(batched, [(str(i), p, params) for i, p in enumerate(prompts)])
    for key, (tokens, top) in alone.items():
        assert done[key].token_ids == tokens, f"prompt {key}: tokens differ batched"
        assert logprobs(done[key]) == top, f"prompt {key}: logprobs differ batched"


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


def knowing_drafts(monkeypatch, answers: dict[tuple, list[int]], vocab_size: int) -> None:
    """A random model's greedy answers repeat too little for n-gram lookup to draft what it
    accepts: the proposer is replaced by one that knows each prompt's greedy answer and drafts
    its next 3 tokens, every draft right after 0 mod 3 tokens of answer, the second wrong
    after 1 (one accepted), the first wrong after 2 (none accepted)."""

    def propose(self, token_ids):
        for prompt, answer in answers.items():
            if tuple(token_ids[: len(prompt)]) != prompt:
                continue
            done = token_ids[len(prompt) :]
            if answer[: len(done)] != done:
                return []
            drafts = list(answer[len(done) : len(done) + 3])
            wrong = {1: 1, 2: 0}.get(len(done) % 3)
            if wrong is not None and wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % vocab_size
            return drafts
        return []

    monkeypatch.setattr(NgramProposer, "propose", propose)


def test_speculation_takes_rejected_drafts_back_out_of_the_state(hybrid, monkeypatch):
    """Drafts verified every step (all, one or none of three accepted: knowing_drafts), blocks
    of 4, chunks of 16: a verification keeps the state after the request's own token and after
    each draft but the last, and a step after rejected drafts continues from the one at the
    accepted drafts' end: transformers' tokens and logprobs."""
    path, prompts, reference = hybrid
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, block_size=4, max_num_batched_tokens=16,
        speculative_config=NGRAM,
    )  # fmt: skip
    core = engine.core  # each running slot and 3 states after drafts
    assert core.memory["recurrent_states"] == core.runner.state_bytes_per_slot() * (
        4 * core.num_state_slots + core.num_snapshots
    )
    answers = {tuple(p): tokens for p, (tokens, _) in zip(prompts, reference, strict=True)}
    knowing_drafts(monkeypatch, answers, engine.model_config.vocab_size)
    assert_reference(run(engine, requests(prompts)), reference)
    spec = engine.get_stats().spec
    assert spec.accepted_per_position[0] > spec.accepted_per_position[1] > 0
    assert spec.accepted_per_position[2] > 0
    assert engine.scheduler._restores == {}
    engine.check_integrity()


def test_speculation_gives_the_same_bits_and_snapshots_as_without(layers, monkeypatch):
    """float32: with drafts every step (knowing_drafts), each prompt's tokens and top-5
    logprobs are the bits of an engine without speculation; the output snapshots taken in
    verifications (the state after the request's own token, kept aside) give prefix hits of
    a chat's next turn the same bits too."""
    path, prompts, reference = layers

    def logprobs(out):
        return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    todo = [(str(i), p, params) for i, p in enumerate(prompts)]
    again, _ = _again(prompts, reference)
    again = [(n, p, params.clone(logprobs=5)) for n, p, params in again]
    kwargs = dict(dtype="float32", **DEVICE_KWARGS, block_size=4, max_num_batched_tokens=16)
    plain = LLMEngine(path, **kwargs, enable_prefix_caching=False)
    cold = run(plain, todo) | run(plain, again)
    spec = LLMEngine(path, **kwargs, speculative_config=NGRAM)
    answers = {tuple(p): cold[str(i)].token_ids for i, p in enumerate(prompts)}
    knowing_drafts(monkeypatch, answers, spec.model_config.vocab_size)
    hot = run(spec, todo)
    hits = spec.kv_cache.snapshots.hits
    hot |= run(spec, again)
    assert spec.get_stats().spec.num_accepted_tokens > 0
    assert spec.kv_cache.snapshots.hits > hits
    for name, out in cold.items():
        assert hot[name].token_ids == out.token_ids, f"{name}: tokens differ with speculation"
        assert logprobs(hot[name]) == logprobs(out), f"{name}: logprobs differ with speculation"


def test_a_draft_model_for_a_hybrid_preempted_in_a_small_cache(qwen3_5, tmp_path):
    """A plain draft model (a tiny Llama of the same vocabulary) proposing for Qwen3.5, in a
    cache small enough to preempt: transformers' tokens; a hybrid draft model is refused by
    name; a checkpoint's multi-token prediction layer (mtp.*, as Qwen3.5's releases carry) is
    not read."""
    path, prompts, reference = qwen3_5
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=5)
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, block_size=4, num_blocks=24,
        max_num_batched_tokens=16, max_num_seqs=4,
        speculative_config={"model": str(draft), "num_speculative_tokens": 2, "adaptive": False},
    )  # fmt: skip
    assert_reference(run(engine, requests(prompts)), reference)
    stats = engine.get_stats()
    assert stats.scheduler.num_preemptions_total > 0 and stats.spec.num_draft_tokens > 0
    assert engine.scheduler.state_slots == {}
    with pytest.raises(ValueError, match="a draft model with recurrent layers"):
        LLMEngine(
            path, dtype="float64", **DEVICE_KWARGS,
            speculative_config={"model": path, "num_speculative_tokens": 2},
        )  # fmt: skip
    copy = shutil.copytree(path, tmp_path / "with-mtp")
    weights = load_file(copy / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(64, 128, dtype=torch.float64)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    engine = LLMEngine(str(copy), dtype="float64", **DEVICE_KWARGS)
    assert_reference(run(engine, requests(prompts[:2])), reference[:2])


def test_state_slots_share_the_cache_memory_and_bound_the_running_requests(qwen3_5):
    """--kv-cache-memory holds the states and the KV blocks: with room for two states (of
    10.5 KiB, float64) in half of it, two requests run at once and the rest wait; every one
    finishes with transformers' tokens."""
    path, prompts, reference = qwen3_5
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, kv_cache_memory="60KiB", block_size=16
    )
    core = engine.core
    per_slot = core.runner.state_bytes_per_slot()
    assert per_slot == 3 * (64 * 3 + 4 * 8 * 8) * 8  # three delta nets: conv inputs, matrices
    assert core.num_state_slots == 2 and core.memory["recurrent_states"] == 2 * per_slot
    running = []
    pending, done = list(requests(prompts)), {}
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
        running.append(len(engine.scheduler.running))
    assert max(running) == 2
    assert_reference(done, reference)


@pytest.mark.parametrize("case", ["qwen3_5", "lfm2", "granite4-h"])
def test_the_pytorch_twins_give_transformers_tokens(case, tmp_path_factory, monkeypatch):
    """The recurrent layers' PyTorch twins (the path off the CPU, CUDA's: delta_rule_reference,
    causal_conv_reference), run here in place of the compiled ops, chunked at an odd budget,
    and verifying drafts."""
    import conveyor.model.llama as llama
    import conveyor.model.recurrent as recurrent

    path, prompts, reference = _case(case, tmp_path_factory)
    calls = []
    twin = recurrent.causal_conv_reference
    monkeypatch.setattr(llama, "cpu_ops", lambda tensor: None)
    monkeypatch.setattr(
        recurrent, "causal_conv_reference", lambda *args: calls.append(1) or twin(*args)
    )
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=7)
    assert_reference(run(engine, requests(prompts), arrive_every=2), reference)
    assert calls  # the twins ran
    spec = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, speculative_config=NGRAM)
    answers = {tuple(p): tokens for p, (tokens, _) in zip(prompts, reference, strict=True)}
    knowing_drafts(monkeypatch, answers, spec.model_config.vocab_size)
    assert_reference(run(spec, requests(prompts)), reference)  # drafts taken back too
    assert 0 < spec.get_stats().spec.acceptance_rate < 1


@pytest.mark.parametrize("case", ["qwen3_5", "lfm2", "granite4-h"])
def test_column_major_projection_outputs_feed_the_recurrent_layers(
    case, tmp_path_factory, monkeypatch
):
    """Off the panels (batch_invariant off, or a bfloat16 model) a projection may run as (W @
    x^T)^T, its rows column-major, where this machine measured that form fastest: the
    recurrent layers' ops read unit-stride rows, so they take a contiguous copy (a bfloat16
    Qwen3.5 stopped its engine with 'rows of unit stride' on such a machine)."""
    import conveyor.model.layers as layers

    path, prompts, reference = _case(case, tmp_path_factory)
    monkeypatch.setattr(layers, "matmul_form", lambda x: "transposed")
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, batch_invariant=False)
    assert_reference(run(engine, requests(prompts), arrive_every=2), reference)


def test_aborted_requests_give_their_slots_back(qwen3_5):
    """Requests aborted while prefilling and while decoding free their state slots at once; the
    others finish with transformers' tokens, and an idle engine holds no slot."""
    path, prompts, reference = qwen3_5
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=16, max_num_seqs=3
    )
    todo = requests(prompts)
    engine.add_request("gone-early", prompts[2], todo[0][2])  # 40 tokens: chunks of 16
    engine.add_request("gone-late", prompts[0], todo[0][2])
    for request in todo:
        engine.add_request(*request)
    done: dict = {}
    for step in range(2000):
        if step == 1:
            assert engine.scheduler.requests["gone-early"].num_computed_tokens < 40
            engine.abort_request("gone-early")
        if step == 4:
            assert engine.scheduler.requests["gone-late"].num_output_tokens > 0
            engine.abort_request("gone-late")
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
    assert engine.scheduler.state_slots == {}
    assert sorted(engine.scheduler._free_slots) == [0, 1, 2]
    assert_reference({k: v for k, v in done.items() if not k.startswith("gone")}, reference)


def test_a_nemotron_h_config_as_released_reads_as_the_same_model(tmp_path):
    """The released configs state the blocks as hybrid_override_pattern ("M" Mamba2, "*"
    attention, "-" MLP, "E" mixture) and name them num_hidden_layers long: the same layers."""
    import json

    from tiny import make_tiny_checkpoint

    from conveyor.model.config import ModelConfig

    path = make_tiny_checkpoint(tmp_path / "nemotron", "nemotron_h-moe")
    saved = ModelConfig.from_hf(str(path), dtype="float64")
    config = json.loads((path / "config.json").read_text())
    symbols = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    pattern = "".join(symbols[t] for t in config.pop("layers_block_type"))
    config.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    (path / "config.json").write_text(json.dumps(config))
    released = ModelConfig.from_hf(str(path), dtype="float64")
    assert pattern == "M*EMEM" and released.num_layers == saved.num_layers == 4
    assert released.parts == saved.parts


def test_mamba_cache_mode_none_keeps_no_snapshots(qwen3_5):
    """vLLM's --mamba-cache-mode: none keeps no state snapshots (prefix caching off for the
    hybrid, transformers' tokens still); align, the default, keeps them; another is refused."""
    path, prompts, reference = qwen3_5
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, mamba_cache_mode="none")
    assert engine.kv_cache.snapshots is None and not engine.kv_cache.enable_caching
    assert_reference(run(engine, requests(prompts[:2])), reference[:2])
    assert LLMEngine(path, dtype="float64", mamba_cache_mode="all").kv_cache.snapshots is not None
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of"):
        LLMEngine(path, dtype="float64", mamba_cache_mode="sometimes")
