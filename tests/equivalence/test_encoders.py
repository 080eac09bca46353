"""BERT-family encoders (model/bert.py: BERT, RoBERTa, XLM-RoBERTa) against transformers in
float64: a sentence-transformers embedder's embeddings (its own pooling: mean, or the first
token), a cross-encoder's logits and scores on text pairs (BERT's token types, RoBERTa's
positions), the same bits alone or batched; and what an encoder refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_KWARGS
from tiny import make_tiny_encoder
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from conveyor import LLM, LLMEngine, PoolingParams, SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France",
    "fox",
    "def add(a, b): return a + b, and a longer text that fills more of the context window",
]
QUERY = "which is the capital of France?"


@pytest.fixture(scope="module", params=["bert", "xlm-roberta", "modernbert"])
def embedder(request, tmp_path_factory):
    path = make_tiny_encoder(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path


@pytest.fixture(scope="module", params=["bert-cross", "xlm-roberta-cross", "modernbert-cross"])
def cross_encoder(request, tmp_path_factory):
    path = make_tiny_encoder(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    return request.param, path


def test_embeddings_equal_transformers_with_the_checkpoints_pooling(embedder):
    """bert states mean pooling in its modules.json (sentence-transformers'); xlm-roberta
    states none: an encoder's first token ([CLS] / <s>), as vLLM pools one."""
    kind, path = embedder
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    mean = kind in ("bert", "modernbert")  # their modules.json says so
    assert llm.engine.model_config.default_pooling == ("mean" if mean else "cls")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outputs, strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        assert out.prompt_token_ids == encoded["input_ids"][0].tolist()
        with torch.no_grad():
            hidden = reference(**encoded).last_hidden_state[0]
        pooled = hidden.mean(dim=0) if mean else hidden[0]
        expected = torch.nn.functional.normalize(pooled, dim=0)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert (got - expected).abs().max().item() < 1e-12, text
    # the other poolings on request: the first and last token's
    ids = tokenizer(TEXTS[1])["input_ids"]
    with torch.no_grad():
        hidden = reference(torch.tensor([ids])).last_hidden_state[0]
    for pooling, row in (("cls", hidden[0]), ("last", hidden[-1])):
        [out] = llm.embed([ids], use_tqdm=False, pooling=pooling)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        expected = torch.nn.functional.normalize(row, dim=0)
        assert (got - expected).abs().max().item() < 1e-12, pooling


def test_cross_encoder_logits_and_scores_equal_transformers(cross_encoder):
    """A pair is joined as the tokenizer joins it (BERT: [CLS] a [SEP] b [SEP], b's tokens of
    type 1; RoBERTa: <s> a </s></s> b </s>); its one label's logit is transformers', the
    score its sigmoid."""
    kind, path = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64)
    reference.eval()
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    expected = []
    for text in TEXTS:
        encoded = tokenizer(QUERY, text, return_tensors="pt")
        if kind == "bert-cross":  # the second text's types: a model that reads them
            assert encoded["token_type_ids"].sum() > 0
        with torch.no_grad():
            expected.append(reference(**encoded).logits[0, 0].item())
    pairs = [tokenizer(QUERY, text)["input_ids"] for text in TEXTS]
    raw = llm.classify(pairs, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    for want, out in zip(expected, raw, strict=True):
        assert abs(out.outputs.probs[0] - want) < 1e-12
    scores = [s.outputs.score for s in llm.score(QUERY, TEXTS, use_tqdm=False)]
    assert scores == pytest.approx([torch.sigmoid(torch.tensor(x)).item() for x in expected])
    assert len(set(scores)) == len(TEXTS)


def test_long_sequences_attend_through_the_fused_kernel_as_transformers(embedder, monkeypatch):
    """Past MATMUL_ATTENTION_TOKENS (lowered here to 8) a sequence attends through torch's
    fused attention (no (L, L) scores in memory): the same embeddings as transformers."""
    from conveyor.model import bert

    monkeypatch.setattr(bert, "MATMUL_ATTENTION_TOKENS", 8)
    kind, path = embedder
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    for out, text in zip(llm.embed(TEXTS, use_tqdm=False), TEXTS, strict=True):
        with torch.no_grad():
            hidden = reference(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        pooled = hidden.mean(dim=0) if kind in ("bert", "modernbert") else hidden[0]
        expected = torch.nn.functional.normalize(pooled, dim=0)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert (got - expected).abs().max().item() < 1e-12, text


def test_a_sequence_is_the_same_bits_alone_or_batched(cross_encoder, tmp_path):
    """float32 (the step's rows share the panel kernels) and bfloat16 (which they do not
    take: each sequence's projections run alone)."""
    _, path = cross_encoder
    embedder = make_tiny_encoder(tmp_path / "bert", "bert")
    for source, dtype in ((path, "float32"), (embedder, "float32"), (embedder, "bfloat16")):
        llm = LLM(str(source), dtype=dtype, **DEVICE_KWARGS)
        batched = [out.outputs.embedding for out in llm.embed(TEXTS, use_tqdm=False)]
        alone = [llm.embed([text], use_tqdm=False)[0].outputs.embedding for text in TEXTS]
        assert alone == batched, dtype
    llm = LLM(str(path), dtype="float32", **DEVICE_KWARGS)
    batched = [out.outputs.probs for out in llm.classify(TEXTS, use_tqdm=False)]
    assert [llm.classify(t, use_tqdm=False)[0].outputs.probs for t in TEXTS] == batched


def test_a_sequence_runs_whole_and_an_encoder_generates_nothing(embedder):
    """Bidirectional attention: a prompt of the whole context runs in one step (the budget
    takes it; a smaller one given is refused); a longer prompt, a generation and prompt
    logprobs are refused with the reason."""
    _, path = embedder
    engine = LLMEngine(str(path), dtype="float64", **DEVICE_KWARGS)
    limit = engine.max_model_len
    assert limit == 128
    config = engine.core.scheduler_config
    assert not config.enable_chunked_prefill and config.max_num_batched_tokens >= limit
    params = SamplingParams(max_tokens=0, pooling="cls")
    engine.add_request("whole", [5] * limit, params)
    engine.add_request("short", [5] * 7, params)
    outputs = engine.step()
    assert {out.request_id for out in outputs if out.finished} == {"whole", "short"}
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", [5] * (limit + 1), params)
    with pytest.raises(ValueError, match="encoder .*generates no text"):
        engine.add_request("generate", [5, 6], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="whole in one step"):
        LLMEngine(str(path), dtype="float64", max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="encoder .*unquantized"):
        LLMEngine(str(path), quantization="int8")
