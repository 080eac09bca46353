"""Classification and scoring (vLLM's pooling runner: LLM.classify, LLM.score; the routes are
tests/server/test_scoring_server.py): a *ForSequenceClassification checkpoint's score head and
a causal LM's `classifier_from_token` labels (Qwen3-Reranker's overrides) against transformers
in float64, the same bits alone or batched and whatever the chunking, and what is refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE_KWARGS
from tiny import build_tokenizer, make_tiny_checkpoint, tiny_config
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from conveyor import LLM, PoolingParams, SamplingParams

PROMPTS = [
    "the quick brown fox",
    "a rose by any other name would smell as sweet, and a long prompt runs in chunks",
    "hello",
]
QUERY = "which fox is quick?"
DOCUMENTS = ["the quick brown fox", "a slow green turtle", "fox"]


def _sequence_classifier(path, arch: str, num_labels: int, **overrides):
    """A float64 random *ForSequenceClassification checkpoint with the tiny tokenizer."""
    tokenizer = build_tokenizer()
    config = tiny_config(arch, len(tokenizer), num_labels=num_labels, **overrides)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float64)
    with torch.no_grad():  # a head that separates the labels (initializer_range 0.2 is small)
        model.score.weight.normal_(0, 1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module", params=[("qwen3", 1), ("llama", 3)], ids=["qwen3-1", "llama-3"])
def classifier(request, tmp_path_factory):
    arch, num_labels = request.param
    path, reference = _sequence_classifier(tmp_path_factory.mktemp(arch), arch, num_labels)
    # chunks of 8 tokens: the longer prompts' last rows come in a later step than their first
    llm = LLM(str(path), dtype="float64", max_num_batched_tokens=8, **DEVICE_KWARGS)
    yield llm, reference, num_labels
    llm.shutdown()


def test_the_score_head_equals_transformers_and_is_the_same_bits_batched(classifier):
    llm, reference, num_labels = classifier
    tokenizer = llm.get_tokenizer()
    together = llm.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, together, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].tolist()
        assert out.prompt_token_ids == ids
        assert len(out.outputs.logits) == num_labels == out.outputs.num_classes
        assert out.outputs.logits == pytest.approx(expected, rel=1e-12, abs=1e-12)
        if num_labels == 1:
            assert out.outputs.probs == [pytest.approx(1 / (1 + math.exp(-expected[0])))]
        else:
            assert sum(out.outputs.probs) == pytest.approx(1.0)
            top = max(range(num_labels), key=expected.__getitem__)
            assert max(range(num_labels), key=out.outputs.probs.__getitem__) == top
        alone = llm.classify(prompt, use_tqdm=False)[0]
        assert alone.outputs.logits == out.outputs.logits  # bit for bit
    # vLLM's use_activation=False: the raw logits (a reward model's score) in probs
    raw = llm.classify(PROMPTS, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert [r.outputs.probs for r in raw] == [out.outputs.logits for out in together]


def test_a_sequence_classifier_generates_nothing_and_embeds(classifier):
    llm = classifier[0]
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    vector = llm.embed("hello", use_tqdm=False)[0].outputs.embedding
    assert len(vector) == 64 and sum(v * v for v in vector) == pytest.approx(1.0)


def test_scoring_with_several_labels_is_refused(classifier):
    llm, _, num_labels = classifier
    if num_labels == 1:
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        assert len(scores) == 3 and all(0 < s.outputs.score < 1 for s in scores)
    else:
        with pytest.raises(ValueError, match="3 labels: scoring takes one"):
            llm.score(QUERY, DOCUMENTS, use_tqdm=False)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A causal Qwen3 served as Qwen3-Reranker is in vLLM: the logits of two tokens."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("reranker"), "qwen3")
    tokenizer = build_tokenizer()
    no, yes = "Ġthe", "Ġcapital"  # two tokens of the tiny vocabulary
    assert None not in tokenizer.convert_tokens_to_ids([no, yes])
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(str(path), dtype="float64", hf_overrides=overrides, **DEVICE_KWARGS)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    yield llm, reference, tokenizer.convert_tokens_to_ids([no, yes])
    llm.shutdown()


def test_classifier_from_token_scores_pairs_as_transformers_logits_say(reranker):
    llm, reference, (no, yes) = reranker
    tokenizer = llm.get_tokenizer()
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    for document, out in zip(DOCUMENTS, scores, strict=True):
        ids = tokenizer(QUERY, text_pair=document)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            last = reference(torch.tensor([ids])).logits[0, -1]
        p_yes = torch.softmax(last[[no, yes]], dim=0)[1].item()  # P(yes) among the two
        assert out.outputs.score == pytest.approx(p_yes, rel=1e-12)
    pairwise = llm.score([QUERY] * 3, DOCUMENTS, use_tqdm=False)  # N:N, the same pairs
    assert [s.outputs.score for s in pairwise] == [s.outputs.score for s in scores]
    # The model still generates: its lm_head is untouched.
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_without_a_classifier_scores_are_the_embeddings_cosine(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)
    try:
        with pytest.raises(ValueError, match="has no classifier"):
            llm.classify("hello", use_tqdm=False)
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        vectors = [o.outputs.embedding for o in llm.embed([QUERY, *DOCUMENTS], use_tqdm=False)]
        for out, document in zip(scores, vectors[1:], strict=True):
            expected = sum(a * b for a, b in zip(vectors[0], document, strict=True))
            assert out.outputs.score == pytest.approx(expected, rel=1e-12)
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score([QUERY, QUERY], DOCUMENTS, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_bad_classifier_override_is_refused_by_name(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    bad = {"classifier_from_token": ["no-such-token-here"]}
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        LLM(path, dtype="float64", hf_overrides=bad, **DEVICE_KWARGS)
    three = {"classifier_from_token": ["a", "b", "c"], "is_original_qwen3_reranker": True}
    with pytest.raises(ValueError, match="takes two classifier_from_token tokens"):
        LLM(path, dtype="float64", hf_overrides=three, **DEVICE_KWARGS)


def test_two_tensor_parallel_ranks_give_the_same_bits(reranker):
    """Classifier tokens across two ranks (their logits rows computed by every rank, as a
    sampled row's): the bits of one. (A score head is replicated and applied on rank 0.)"""
    llm = reranker[0]
    expected = [s.outputs.score for s in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    config = llm.engine.model_config
    overrides = {
        "classifier_from_token": list(config.classifier.labels),
        "is_original_qwen3_reranker": True,
    }
    two = LLM(str(config.path), dtype="float64", tensor_parallel_size=2, hf_overrides=overrides,
              **DEVICE_KWARGS)  # fmt: skip
    try:
        assert [s.outputs.score for s in two.score(QUERY, DOCUMENTS, use_tqdm=False)] == expected
    finally:
        two.shutdown()
