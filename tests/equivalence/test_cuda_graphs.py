"""Decode steps through the padded buffers of worker/cuda_graphs.py match transformers.

On the CPU the padded step runs without capture (CONVEYOR_CUDA_GRAPHS=eager): the same
buffers, padding rows, scratch block and table widths a CUDA graph replays. With
CONVEYOR_TEST_DEVICE=cuda the same tests capture and replay real graphs."""

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

from conveyor import LLM, SamplingParams
from conveyor.worker.cuda_graphs import bucket, graph_mode, row_buckets, width_buckets

MAX_TOKENS = 12
NUM_PROMPTS = 12
# Lengths 12 down to 1: the batch shrinks step by step as requests finish.
GREEDY = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS - i, logprobs=0) for i in range(12)]


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    if DEVICE == "cpu":  # no capture on the CPU: the padded step, run as it is
        monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "eager")


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = random_prompts(NUM_PROMPTS, ref_model.config.vocab_size, seed=3)
    reference = hf_greedy(ref_model, prompts, MAX_TOKENS)
    return (
        path,
        prompts,
        [
            (t[: p.max_tokens], lp[: p.max_tokens])
            for (t, lp), p in zip(reference, GREEDY, strict=True)
        ],
    )


def test_padded_decode_steps_match_transformers(case):
    """All prompts in the first step, then decode batches of 12 down to 1 rows (padded to 16,
    8, 4, 2, 1), contexts of up to 82 tokens in blocks of 4 (tables padded to 8 and 32
    blocks)."""
    path, prompts, reference = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, max_num_seqs=12, block_size=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference)
    graphs = llm.engine.core.runner.graphs
    assert graphs is not None and graphs.replays == MAX_TOKENS - 1  # every step but the first
    assert {rows for rows, _ in graphs.entries} == {16, 8, 4, 2, 1}
    assert {width for _, width in graphs.entries} >= {8, 32}


def test_enforce_eager_runs_no_graph(case):
    path, prompts, reference = case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, enforce_eager=True)
    outputs = llm.generate(prompts[:3], GREEDY[:3], use_tqdm=False)
    assert llm.engine.core.runner.graphs is None
    assert_matches_reference(outputs, reference[:3])


def test_buckets_cover_every_batch_and_length():
    rows = row_buckets(256)
    assert rows[:4] == [1, 2, 4, 8] and rows[-1] == 256
    assert all(bucket(n, rows) >= n for n in range(1, 257))
    assert bucket(9, rows) == 16 and bucket(250, row_buckets(250)) == 256
    assert row_buckets(3) == [1, 2, 3] and row_buckets(1) == [1]
    widths = width_buckets(512)
    assert widths == [8, 16, 32, 64, 128, 256, 512]
    assert width_buckets(20) == [8, 16, 20] and width_buckets(3) == [3]
    assert all(bucket(n, widths) >= n for n in range(1, 513))


def test_graph_mode_setting(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "0")
    assert graph_mode(torch.device("cuda")) is None
    monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "eager")
    assert graph_mode(torch.device("cpu")) == "eager"
    monkeypatch.delenv("CONVEYOR_CUDA_GRAPHS")
    assert graph_mode(torch.device("cpu")) is None
    assert graph_mode(torch.device("cuda")) == "capture"
    monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="CONVEYOR_CUDA_GRAPHS"):
        graph_mode(torch.device("cuda"))


def test_padded_decode_steps_of_kv_groups_match_transformers(tiny_checkpoint):
    """A model with KV groups (model/kv_groups.py: a Gemma 3 of two-layer groups, its window
    of 5 shorter than every context): a table and slots per group in the buffers, each layer
    reading its own group's, the sliding groups' tables led by null blocks."""
    path = tiny_checkpoint("gemma3-groups")
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = random_prompts(6, ref_model.config.vocab_size, seed=4)
    reference = hf_greedy(ref_model, prompts, MAX_TOKENS)
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, max_num_seqs=6, block_size=4)
    assert len(llm.engine.core.kv_cache.windows) == 4
    outputs = llm.generate(prompts, GREEDY[0], use_tqdm=False)
    assert_matches_reference(outputs, reference)
    assert llm.engine.core.runner.graphs.replays == MAX_TOKENS - 1
