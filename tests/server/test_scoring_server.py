"""vLLM's pooling routes (POST /classify, /score and /v1/score, /rerank, /v1/rerank and
/v2/rerank) over `conveyor serve`'s app: a Qwen3 served as vLLM serves Qwen3-Reranker (the
`classifier_from_token` overrides) and a model without a classifier (scores from its
embeddings), their answers equal to LLM.score's and LLM.classify's, and bad bodies 400s."""

from __future__ import annotations

import httpx
import pytest
from server_util import InThreadServer
from tiny import build_tokenizer, make_tiny_encoder

from conveyor import LLM

QUERY = "which fox is quick?"
DOCUMENTS = ["a slow green turtle", "the quick brown fox", "fox"]
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["Ġthe", "Ġcapital"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def reranker(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    server = InThreadServer(path, "reranker", hf_overrides=RERANKER)
    yield server, path
    server.stop()


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    server = InThreadServer(tiny_checkpoint("llama"), "plain")
    yield server
    server.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_score_and_rerank_by_the_classifier_equal_llm_score(reranker):
    server, path = reranker
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB", hf_overrides=RERANKER)
    try:
        expected = [s.outputs.score for s in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
        logits = llm.classify("the quick brown fox", use_tqdm=False)[0].outputs
    finally:
        llm.shutdown()
    for route in ("/score", "/v1/score"):
        reply = _post(server, route, {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["score"] for d in body["data"]] == expected
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"]["prompt_tokens"] > 0
    order = sorted(range(3), key=lambda i: -expected[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        reply = _post(server, route, body)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == order[:2]
        assert [r["relevance_score"] for r in results] == [expected[i] for i in order[:2]]
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order[:2]]
    reply = _post(server, "/classify", {"model": "reranker", "input": ["the quick brown fox"]})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert data[0]["probs"] == logits.probs and data[0]["num_classes"] == 1
    body = {"input": "the quick brown fox", "use_activation": False}
    raw = _post(server, "/classify", body).json()["data"]
    assert raw[0]["probs"] == logits.logits  # the raw logit, as vLLM answers without activation


def test_without_a_classifier_scores_are_cosines_and_classify_is_a_400(plain):
    reply = _post(plain, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    scores = [d["score"] for d in reply.json()["data"]]
    vectors = _post(plain, "/v1/embeddings", {"input": [QUERY, *DOCUMENTS]}).json()["data"]
    query = vectors[0]["embedding"]
    for score, document in zip(scores, vectors[1:], strict=True):
        expected = sum(a * b for a, b in zip(query, document["embedding"], strict=True))
        assert score == pytest.approx(expected, abs=1e-6)
    reply = _post(plain, "/classify", {"input": "hello"})
    assert reply.status_code == 400 and "has no classifier" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts"),
        ("/score", {"text_1": [], "text_2": "c"}, "text_1: a text or a non-empty list"),
        ("/rerank", {"query": "q", "documents": []}, "at least one document"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/score", {"text_1": "a", "text_2": "b", "temperature": 1}, "temperature"),
        ("/classify", {"input": [[1, 2], [99999]]}, ""),
        # refused from its length alone, never tokenized (a 4 MB document)
        ("/rerank", {"query": "q", "documents": ["x" * 2**22]}, "cannot fit in the model's"),
        ("/score", {"text_1": "", "text_2": "b"}, "must not be empty"),
        # more pairs than the server's input limit (64): refused before any is tokenized
        ("/rerank", {"query": "q", "documents": ["d"] * 65}, "at most 64 inputs"),
    ],
)
def test_bad_bodies_are_400s_and_the_server_goes_on(reranker, route, body, says):
    server, _ = reranker
    reply = _post(server, route, body)
    assert reply.status_code == 400, reply.text
    assert says in reply.text
    after = _post(server, "/score", {"text_1": "a", "text_2": "b"})
    assert after.status_code == 200


def test_the_tokens_named_are_tokens_of_the_tiny_vocabulary():
    tokenizer = build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(RERANKER["classifier_from_token"])
    assert None not in ids


def test_an_encoder_cross_encoder_and_embedder_serve_the_pooling_routes(tmp_path):
    """BERT-family encoders (model/bert.py) over the app: a cross-encoder's /v1/rerank and
    /score answer as LLM.score, an embedder's /v1/embeddings (the openai client) as
    LLM.embed with its sentence-transformers pooling; a completion is a 400 saying why."""
    import openai

    cross = make_tiny_encoder(tmp_path / "cross", "bert-cross", seed=1)
    llm = LLM(str(cross), dtype="float32", kv_cache_memory="32MiB")
    expected = [s.outputs.score for s in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    llm.shutdown()
    server = InThreadServer(cross, "cross")
    try:
        reply = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["relevance_score"] for r in results] == sorted(expected, reverse=True)
        scores = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()["data"]
        assert [d["score"] for d in scores] == expected
        reply = _post(server, "/v1/completions", {"prompt": "a fox", "max_tokens": 2})
        assert reply.status_code == 400 and "generates no text" in reply.text
    finally:
        server.stop()
    embedder = make_tiny_encoder(tmp_path / "embedder", "bert")
    llm = LLM(str(embedder), dtype="float32", kv_cache_memory="32MiB")
    vectors = [out.outputs.embedding for out in llm.embed(DOCUMENTS, use_tqdm=False)]
    llm.shutdown()
    server = InThreadServer(embedder, "embedder")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        reply = client.embeddings.create(model="embedder", input=DOCUMENTS)
        assert [d.embedding for d in reply.data] == vectors
    finally:
        server.stop()
