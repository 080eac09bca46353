"""Every family beyond Llama's four (model/families.py) against transformers in float64, on
tiny random checkpoints whose windows are shorter than the prompts: greedy tokens equal
transformers' generate, and logprobs agree, however the engine runs them. All prompts in one
step; chunked at an odd budget with requests arriving while others decode; with a small cache
that preempts, shared prefixes that hit the prefix cache, and n-gram speculation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import DEVICE_KWARGS, hf_greedy, random_prompts
from tiny import FAMILIES, auto_class, make_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from conveyor import LLMEngine, SamplingParams

MAX_TOKENS = 8
NUM_PROMPTS = 8
MAX_STEPS = 2000
# transformers runs Gemma 2 on its eager attention, whose softmax is float32 even for a float64
# model, and turns ERNIE 4.5's q and k by RoPE in float32 (q.float(), float32 cos and sin) even
# for a float64 model; GLM-4.5's router computes its logits in float32 (a float32 matmul, whose
# sums transformers and conveyor order by their own row counts: ~1e-6 in logprob); the others'
# references are float64 throughout (sdpa).
TOLERANCE = {"gemma2": 2e-5, "ernie4_5": 2e-5, "ernie4_5_moe": 2e-5, "glm4_moe": 5e-6}
# DeepSeek-V2 turns q and k by RoPE in float32 (complex float32 numbers) and its routers, like
# GLM-4.5's, take float32 logits.
MLA = ("deepseek_v2", "deepseek_v2-groups", "deepseek_v3", "glm4_moe_lite")
TOLERANCE.update(dict.fromkeys(MLA, 2e-5))


# Multimodal checkpoints whose language model is a family the battery runs whole: its layers
# are that family's, only their reading differs, so one step against transformers suffices.
READ_ONLY_VARIANTS = (
    "gemma3-vlm", "gemma4-vlm", "gemma3n-vlm", "mistral3-vlm", "llava", "qwen2-vl",
    "qwen2_5-vl", "qwen3-vl", "qwen3-vl-moe",
)  # fmt: skip
_CASES: dict = {}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f not in READ_ONLY_VARIANTS])
def layer_family(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def _case(name: str, tmp_path_factory):
    """The family's tiny checkpoint, prompts and transformers' greedy tokens, built once."""
    if name in _CASES:
        return _CASES[name]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
    # transformers' eager experts loop is the reference for the mixtures of experts (its
    # default, grouped_mm, takes no float64)
    reference_model = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    vocab_size = reference_model.config.get_text_config().vocab_size
    prompts = random_prompts(NUM_PROMPTS, vocab_size, seed=3, max_len=40)
    shared = max(prompts, key=len)[:13]  # prompts that share a prefix: prefix-cache hits
    prompts += [shared + p[:5] for p in prompts[:4]]
    reference = hf_greedy(reference_model, prompts, MAX_TOKENS)
    _CASES[name] = name, str(path), prompts, reference
    return _CASES[name]


def requests(prompts) -> list[tuple[str, list[int], SamplingParams]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    return [(str(i), p, params) for i, p in enumerate(prompts)]


def run(engine: LLMEngine, todo: list, arrive_every: int = 0) -> dict:
    """Steps until idle, checking block accounting after every step; with arrive_every > 0,
    one request is added every that many steps (the rest at once otherwise)."""
    pending = list(todo)
    done = {}
    for step in range(MAX_STEPS):
        while pending and (not arrive_every or step % arrive_every == 0):
            engine.add_request(*pending.pop(0))
            if arrive_every:
                break
        if not pending and not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        engine.check_integrity()
    raise AssertionError("requests unfinished")


def assert_reference(name: str, done: dict, reference, tolerance: float | None = None) -> None:
    tolerance = tolerance or TOLERANCE.get(name, 1e-6)
    for i, (tokens, logprobs) in enumerate(reference):
        out = done[str(i)]
        assert out.token_ids == tokens, f"{name} prompt {i}: tokens differ from transformers"
        got = [pos[t].logprob for pos, t in zip(out.logprobs, tokens, strict=True)]
        worst = max(abs(a - b) for a, b in zip(got, logprobs, strict=True))
        assert worst < tolerance, f"{name} prompt {i}: logprob differs by {worst}"


def test_all_prompts_in_one_step_match_transformers(family):
    name, path, prompts, reference = family
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=4096)
    assert_reference(name, run(engine, requests(prompts)), reference)


def test_odd_chunks_and_staggered_arrivals_match_transformers(layer_family):
    name, path, prompts, reference = layer_family
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, max_num_batched_tokens=7, record_trace=True
    )
    done = run(engine, requests(prompts), arrive_every=3)
    assert max(sum(s.num_scheduled_tokens.values()) for s in engine.trace) == 7
    assert_reference(name, done, reference)


def test_preemption_prefix_hits_and_speculation_match_transformers(layer_family):
    name, path, prompts, reference = layer_family
    # Where every layer slides, a request holds only its window's blocks: a smaller cache; and
    # where a random model's greedy outputs repeat no n-gram at 24 blocks, fewer blocks (more
    # preemption, more of its outputs recomputed) give n-gram speculation its drafts.
    blocks = {"mistral-window": 10, "phi3": 10, "seed_oss": 16, "llama-bias": 16}
    blocks["gemma3-groups"] = 32  # four tables per request (model/kv_groups.py)
    num_blocks = blocks.get(name, 24)
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, block_size=4, num_blocks=num_blocks,
        max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "adaptive": False},
    )  # fmt: skip
    done = run(engine, requests(prompts))
    stats = engine.get_stats()
    assert stats.scheduler.num_preemptions_total > 0
    assert stats.scheduler.prefix_cache_hits > 0
    assert stats.spec.num_draft_tokens > 0
    assert_reference(name, done, reference)
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks


def test_without_its_sliding_window_a_model_serves_up_to_its_window_with_its_tokens(tmp_path):
    """disable_sliding_window (vLLM's): full attention, the context capped at the smallest
    window, inside which a window hides nothing: transformers' tokens (it slides), a request
    that would pass the window refused, a longer max_model_len a ValueError naming the
    window; a model with global layers (Gemma 2) capped at its local layers' window."""
    path = make_tiny_checkpoint(tmp_path / "mistral", "mistral-window")
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompt = [5, 17, 42, 9]  # and 3 tokens: the window, all of it
    [(tokens, _)] = hf_greedy(reference_model, [prompt], 3)
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, block_size=4, disable_sliding_window=True
    )
    assert engine.kv_cache.windows == (0,) and engine.max_model_len == 7
    assert not any(engine.model_config.parts.windows)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    done = run(engine, [("short", prompt, params)])
    assert done["short"].token_ids == tokens
    with pytest.raises(ValueError, match="context length 7"):  # past the window
        engine.add_request("long", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"\[1, 7\] \(the sliding window"):
        LLMEngine(str(path), dtype="float64", max_model_len=8, disable_sliding_window=True)
    gemma = make_tiny_checkpoint(tmp_path / "gemma2", "gemma2")
    window = AutoConfig.from_pretrained(gemma).sliding_window
    capped = LLMEngine(str(gemma), dtype="float64", num_blocks=64, disable_sliding_window=True)
    assert capped.max_model_len == window and capped.kv_cache.windows == (0,)


def test_a_windowed_request_holds_only_its_window_of_blocks(tmp_path):
    """Every layer slides (Mistral's window of 7): blocks that left the window go back to the
    pool while the request runs, so a 90-token request runs in a cache of 8 blocks of 4 tokens
    (32 tokens), with transformers' tokens; a model with a full-attention layer keeps them."""
    path = make_tiny_checkpoint(tmp_path / "mistral", "mistral-window")
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompt = random_prompts(3, reference_model.config.vocab_size, seed=5, max_len=70)[2]
    [(tokens, _)] = hf_greedy(reference_model, [prompt], 20)
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, block_size=4, num_blocks=8,
        max_num_batched_tokens=8,
    )  # fmt: skip
    assert engine.kv_cache.windows == (7,)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("long", prompt, params)
    held, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0]
        engine.check_integrity()
        [table] = engine.kv_cache.req_to_blocks.get("long", [[]])
        held.append(sum(b is not engine.kv_cache.null_block for b in table))
    assert done["long"].token_ids == tokens
    assert max(held) <= -(-(7 + 8) // 4) + 1  # the window and one step's tokens
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks


def test_a_hybrid_holds_its_global_layers_context_and_its_local_layers_window(tmp_path):
    """Gemma 2's sliding and global layers in KV groups of their own (model/kv_groups.py): a
    block id is one layer's page, not both layers', and the local layer's blocks that left its
    window go back to the pool while the request runs. So a cache of 20 blocks' bytes of the
    one-table layout (both layers' pages: too small for a 90-token request and its 20 tokens)
    serves it with transformers' tokens, and a second request on the same prompt hits its
    prefix in both groups, the local one from the blocks inside the window."""
    path = make_tiny_checkpoint(tmp_path / "gemma2", "gemma2")
    config = AutoConfig.from_pretrained(path)
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompt = random_prompts(3, config.vocab_size, seed=5, max_len=90)[2]
    assert len(prompt) > 80
    again = prompt + [7, 8, 9]
    expected = [tokens for tokens, _ in hf_greedy(reference_model, [prompt, again], 20)]
    page = 2 * config.num_key_value_heads * config.head_dim * 4 * 8  # a layer's block, float64
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, block_size=4, max_num_batched_tokens=8,
        kv_cache_memory=20 * 2 * page,
    )  # fmt: skip
    window = config.sliding_window
    assert engine.kv_cache.windows == (0, window) and engine.num_blocks == 40
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    done = {}
    for request_id, tokens in (("first", prompt), ("again", again)):
        engine.add_request(request_id, tokens, params)
        held = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0]
            engine.check_integrity()
            tables = engine.kv_cache.req_to_blocks.get(request_id)
            if tables is not None:
                held.append([sum(b is not engine.kv_cache.null_block for b in t) for t in tables])
        assert max(full for full, _ in held) == -(-(len(tokens) + 18) // 4)  # every token
        assert max(local for _, local in held) <= -(-(window + 8) // 4) + 1
    assert done["first"].token_ids == expected[0]
    assert done["again"].token_ids == expected[1]
    assert engine.get_stats().scheduler.prefix_cache_hits == len(prompt) // 4 * 4
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
    one_table = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, block_size=4, max_num_batched_tokens=8,
        kv_cache_memory=20 * 2 * page, disable_hybrid_kv_cache_manager=True,
    )  # fmt: skip
    assert one_table.kv_cache.windows == (0,) and one_table.num_blocks == 20
    with pytest.raises(ValueError, match="needs 28 KV blocks; the whole cache has 20"):
        one_table.add_request("first", prompt, params)


def test_past_longrope_original_length_the_long_factors_turn_every_position(tmp_path):
    """Phi-3.5 / Phi-4-mini with a max_model_len past original_max_position_embeddings (128
    here): longrope's long factors turn every position, as vLLM and llama.cpp choose by the
    context. Prompts past 128 tokens, chunked, get transformers' tokens (it turns a sequence
    longer than 128 by the long factors); a short prompt gets the tokens of transformers with
    the short factors set to the long ones (it would turn that one by the short factors)."""
    path = make_tiny_checkpoint(tmp_path, "phi4-mini")
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    vocab_size = reference_model.config.vocab_size
    rng = random.Random(11)
    long_prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (129, 140, 163)]
    reference = hf_greedy(reference_model, long_prompts, MAX_TOKENS)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters["short_factor"] = list(config.rope_parameters["long_factor"])
    long_only = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float64)
    short_prompts = random_prompts(3, vocab_size, seed=12, max_len=60)
    reference += hf_greedy(long_only, short_prompts, MAX_TOKENS)
    engine = LLMEngine(
        str(path), dtype="float64", **DEVICE_KWARGS, max_model_len=512,
        max_num_batched_tokens=48,
    )  # fmt: skip
    assert engine.max_model_len == 512
    done = run(engine, requests(long_prompts + short_prompts), arrive_every=2)
    assert_reference("phi4-mini", done, reference)
    short = hf_greedy(reference_model, short_prompts, MAX_TOKENS)  # the factors count
    assert [tokens for tokens, _ in short] != [tokens for tokens, _ in reference[3:]]


def test_ernie4_5_moe_multi_token_prediction_tensors_are_not_read(tmp_path_factory, tmp_path):
    """ERNIE 4.5's releases carry its multi-token prediction block beside the model's
    (model.mtp_block.*, mtp_emb_norm, ...): never read, the model the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    name, original, prompts, reference = _case("ernie4_5_moe", tmp_path_factory)
    path = str(shutil.copytree(original, tmp_path / "with-mtp"))
    shard = Path(path) / "model.safetensors"
    weights = load_file(shard)
    weights["model.mtp_block.0.mlp.gate_proj.weight"] = torch.zeros(32, 64, dtype=torch.float64)
    weights["model.mtp_emb_norm.0.weight"] = torch.ones(64, dtype=torch.float64)
    save_file(weights, shard, metadata={"format": "pt"})
    engine = LLMEngine(path, dtype="float64", **DEVICE_KWARGS)
    assert_reference(name, run(engine, requests(prompts[:3])), reference[:3])
