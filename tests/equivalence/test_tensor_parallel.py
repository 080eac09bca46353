"""Tensor parallelism on CPU: two ranks over gloo, each holding half of the heads, the MLP and
the vocabulary, give transformers' greedy tokens (float64) on tiny random checkpoints: GQA;
MQA (its one KV head replicated) with biases and tied embeddings over a vocabulary that does
not split evenly. A model that does not divide is refused; a rank that dies stops the engine with an
error naming it, never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import LOGPROB_TOL, assert_matches_reference, hf_greedy, random_prompts
from tiny import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams
from conveyor.distributed.parallel import TPShard, check_tensor_parallel

MAX_TOKENS = 8
GREEDY = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i % 3, logprobs=0) for i in range(8)
]

CASES = {
    # llama: GQA (4 query heads over 2 KV heads), head_dim 32 != hidden / heads, llama3 rope.
    "gqa": ("llama", {}),
    # qwen2 with MQA (one KV head, replicated on both ranks), q/k/v biases, tied embeddings
    # and 387 tokens: the vocabulary splits 194 + 193.
    "mqa-tied-odd-vocab": ("qwen2", {"num_key_value_heads": 1, "vocab_size": 387}),
    # Gemma 3: sliding-window and global layers with their own rotary bases, (1 + w) per-head
    # q/k norms, the embedding scale (tests/tiny.py FAMILIES).
    "gemma3-window": ("gemma3", {}),
    # Phi-3: q/k/v and gate/up fused in the checkpoint (each rank cuts its share of each part),
    # a sliding window on every layer (blocks freed as they leave it).
    "phi3-fused": ("phi3", {}),
    # Granite 4.0 (attention-only GraniteMoeHybrid): its shared_mlp's input_linear is gate and
    # up fused, cut per part as Phi-3's; Granite's multipliers.
    "granite4-fused": ("granitemoehybrid", {}),
    # Qwen2-MoE: each of 6 experts and the shared expert split like a dense MLP (columns of
    # gate/up, rows of down), the router and the shared expert's gate replicated, one dense
    # layer next to the mixture.
    "qwen2-moe": ("qwen2_moe", {}),
    # Arcee: an ungated relu(x)^2 MLP (its up projection cut by columns as a gate), yarn RoPE.
    "arcee-ungated": ("arcee", {}),
    # GLM-4.5: q/k/v biases, partial rotary beside q/k norms, a dense layer then a mixture
    # routed by groups, its ungated shared expert split like a dense MLP.
    "glm4-moe": ("glm4_moe", {}),
    # DeepSeek-V2 / V3's latent attention: each rank its heads' rows of q_proj (V2) or q_b_proj
    # (V3) and kv_b_proj, their columns of o_proj; the latent projections and the latent cache
    # every rank's; RoPE on adjacent pairs; the mixtures split like GLM-4.5's.
    "deepseek-v2-latent": ("deepseek_v2", {}),
    "deepseek-v3-latent": ("deepseek_v3", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    prompts = random_prompts(len(GREEDY), ref.config.vocab_size, seed=3)
    reference = [
        (tokens[: p.max_tokens], logprobs[: p.max_tokens])
        for (tokens, logprobs), p in zip(hf_greedy(ref, prompts, MAX_TOKENS), GREEDY, strict=True)
    ]
    return request.param, path, prompts, reference


def test_two_ranks_match_transformers(case, monkeypatch):
    name, path, prompts, reference = case
    # GQA adds its partial sums through shared memory (the CPU default), the other case
    # through gloo alone.
    shm = name == "gqa"
    if not shm:
        monkeypatch.setenv("CONVEYOR_TP_SHM", "0")
    # A small token budget: prompts arrive in chunks, mixed with decoding rows.
    llm = LLM(str(path), dtype="float64", tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        workers = llm.engine.core.tp_workers
        assert workers.size == 2 and len(workers.procs) == 1 and workers.group.pg is not None
        assert (workers.group.shm is not None) == shm
        attn = llm.engine.core.runner.model.model.layers[0].self_attn
        assert attn.num_heads == 2  # half of the 4 query heads on this rank
        assert attn.num_kv_heads == 1  # half of GQA's 2; MQA's one, replicated
        if name == "mqa-tied-odd-vocab":
            assert (
                attn.qkv_proj.bias is not None and llm.engine.core.model_config.tie_word_embeddings
            )
        if name == "qwen2-moe":
            mlp = llm.engine.core.runner.model.model.layers[0].mlp
            assert [e.down_proj.weight.shape[1] for e in mlp.experts] == [16] * 6  # 32 / 2
            assert mlp.shared_expert.down_proj.weight.shape[1] == 24  # 48 / 2
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        # GLM-4.5's and DeepSeek's float32 router logits (and V2's float32 RoPE): see
        # tests/equivalence/test_families.py TOLERANCE
        float32 = name == "glm4-moe" or name.startswith("deepseek")
        assert_matches_reference(outputs, reference, 2e-5 if float32 else LOGPROB_TOL)
        if name == "gqa":  # the last use of this engine: a rank dies mid-collective wait
            _kill_rank_and_expect_an_error(llm)
    finally:
        llm.engine.shutdown()
    assert all(p.poll() is not None for p in workers.procs), "a worker outlived its engine"


def _kill_rank_and_expect_an_error(llm) -> None:
    worker = llm.engine.core.tp_workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 was killed by SIGKILL"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 30  # an error, not a wait for the collective timeout


def test_a_model_that_does_not_divide_is_refused(tmp_path):
    path = make_tiny_checkpoint(
        tmp_path, "llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16
    )
    with pytest.raises(ValueError, match="does not divide its 3 attention heads"):
        LLM(str(path), dtype="float64", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(str(path), dtype="float64", tensor_parallel_size=0)


def test_shards_cover_every_head_and_vocabulary_row():
    class Cfg:
        num_heads, num_kv_heads, intermediate_size, head_dim, vocab_size = 8, 2, 96, 4, 50

    for size in (2, 4, 8):
        check_tensor_parallel(Cfg, size)
        shards = [TPShard(r, size) for r in range(size)]
        q = [s.slice_of("model.layers.0.self_attn.q_proj.weight", Cfg) for s in shards]
        assert [c[1:3] for c in q] == [(r * 32 // size, (r + 1) * 32 // size) for r in range(size)]
        kv = [s.kv_heads(2) for s in shards]
        for r, (first, count) in enumerate(kv):  # the KV head this rank's queries read
            heads_first, heads = shards[r].heads(8)
            assert count == max(1, 2 // size)
            assert first == heads_first // 4 if size > 2 else first == r
        rows = [s.vocab(50) for s in shards]
        assert rows[0][0] == 0 and rows[-1][1] == 50
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
        assert len({r[2] for r in rows}) == 1  # the same padded row count on every rank
    with pytest.raises(ValueError, match="key/value heads"):
        check_tensor_parallel(type("C", (), dict(vars(Cfg), num_kv_heads=3)), 2)
    with pytest.raises(ValueError, match="intermediate size"):
        check_tensor_parallel(type("C", (), dict(vars(Cfg), intermediate_size=97)), 2)


def test_a_shared_memory_wait_ends_when_a_peer_is_gone_or_late():
    import subprocess

    from conveyor.distributed import shm

    if not shm.available():
        pytest.skip("the shared-memory collectives run on x86-64 Linux only")
    path = shm.create(2)
    try:
        group = shm.ShmCollectives(path, 0, 2, timeout=0.3)
        gone = subprocess.Popen(["true"])
        gone.wait()
        group._pids[1] = gone.pid  # a peer that exited
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            group.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 0.2
        group._pids[1] = os.getpid()  # alive, but it never arrives
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach a collective in 0.3 s"):
            group.all_reduce(torch.ones(4))
        group.close()
    finally:
        shm.remove(path)


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("olmo2", "q/k norms over all heads"),
        ("gpt_oss", "biased row-parallel projections"),
        ("gemma4", "Gemma 4's per-layer heads"),
        ("gemma3n", "Gemma 3n's AltUp streams"),
    ],
)
def test_a_family_that_does_not_split_yet_is_refused_with_the_reason(tmp_path, family, reason):
    path = make_tiny_checkpoint(tmp_path, family)
    with pytest.raises(ValueError, match=reason):
        LLM(str(path), dtype="float64", tensor_parallel_size=2)
