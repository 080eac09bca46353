"""vLLM's pooling routes beside /v1/embeddings: POST /classify, POST /score (/v1/score) and
POST /rerank (/v1/rerank, /v2/rerank: Jina's and Cohere's rerank API, as vLLM serves it).

/classify needs the model's classifier (ModelConfig.classifier: a *ForSequenceClassification
checkpoint's score head, or vLLM's `classifier_from_token` hf_overrides, as Qwen3-Reranker is
served). /score and /rerank score each (text_1, text_2) or (query, document) pair: with a
classifier of one label as a cross-encoder (the pair joined as the tokenizer joins a text
pair, the sigmoid of its logit), else by the cosine similarity of the two texts' embeddings
(vLLM's score for embedding models). Every prompt is a prompt-only request scheduled as any
prompt is (SamplingParams.pooling); the arithmetic of the answers is conveyor/scoring.py's.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.entrypoints.openai.embeddings import _embedding
from conveyor.entrypoints.openai.protocol import HintText, InvalidParam, RequestId
from conveyor.entrypoints.openai.serving import OpenAIServing, reply_id
from conveyor.entrypoints.runner import header_request_id, until_disconnected
from conveyor.model.config import Classifier
from conveyor.sampling_params import SamplingParams
from conveyor.scoring import cosine, label_probs, one_label, pairs

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ClassificationRequest(BaseModel):
    model_config = _STRICT

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    # vLLM's: False answers the raw label logits in `probs` (a reward model's score);
    # `activation` its older name
    use_activation: bool | None = None
    activation: bool | None = None
    user: HintText | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: RequestId | None = None


class ScoreRequest(BaseModel):
    model_config = _STRICT

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: HintText | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    request_id: RequestId | None = None


class RerankRequest(BaseModel):
    model_config = _STRICT

    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    model: str | None = None
    user: HintText | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    request_id: RequestId | None = None


class _Run:
    """One request's prompts through the engine: the label logits or embeddings of each."""

    def __init__(self, serving: OpenAIServing, body, raw: Request, pooling: str) -> None:
        self.serving, self.raw, self.pooling = serving, raw, pooling
        if (given := header_request_id(raw.headers)) is not None:  # vLLM's: the header wins
            body = body.model_copy(update={"request_id": given})
        self.body = body
        self.num_tokens = 0

    async def prompts(self, texts) -> list[list[int]]:
        """Each input's token ids, its count checked against the server's limit first (a
        request of more inputs is refused before any is tokenized)."""
        serving, body = self.serving, self.body
        single = isinstance(texts, str) or all(isinstance(t, int) for t in texts)
        self.check_count(1 if single else len(texts))
        return await serving.off_loop(
            serving.completion_prompts,
            texts,
            getattr(body, "add_special_tokens", True),
            body.truncate_prompt_tokens,
            serving.engine.max_model_len,  # a prompt-only request may fill the context
        )

    def check_count(self, count: int) -> None:
        limit = self.serving.limits.max_prompts
        if count > limit:
            raise InvalidParam(
                f"at most {limit} inputs per request allowed by this server, got {count}", "input"
            )

    async def pooled(self, prefix: str, prompts: list[list[int]], pooling: str) -> list:
        """Each prompt's engine answer (label logits or embedding), in order; all prompts are
        accepted or none, and a client that goes away has them aborted (a 499)."""
        serving, body = self.serving, self.body
        self.num_tokens += sum(len(p) for p in prompts)
        params = SamplingParams(max_tokens=0, pooling=pooling)
        priority = serving.limits.clamp_priority(body.priority)
        streams = await serving.submit(prefix, prompts, params, priority, body.model,
                                       body.request_id)  # fmt: skip
        self.streams = streams

        async def work() -> list:
            try:
                return [await _embedding(stream) for stream in streams]
            finally:
                serving.abort_unfinished(streams)

        return await until_disconnected(self.raw, serving, streams, work())

    async def scores(self, prefix: str, joined: list[tuple[str, str]], classifier) -> list:
        """A score per pair (conveyor/scoring.py); a Response (499) if the client went away."""
        if classifier is not None:  # of one label (_scored checked it)
            self.check_count(len(joined))  # before any pair is tokenized
            encode = self.serving.encode_pair
            joined_ids = await self.serving.off_loop(lambda: [encode(a, b) for a, b in joined])
            logits = await self.pooled(prefix, await self.prompts(joined_ids), "classify")
            if isinstance(logits, Response):
                return logits
            return [label_probs(each)[0] for each in logits]
        texts = list(dict.fromkeys(t for pair in joined for t in pair))
        vectors = await self.pooled(prefix, await self.prompts(texts), self.pooling)
        if isinstance(vectors, Response):
            return vectors
        by_text = dict(zip(texts, vectors, strict=True))
        return [cosine(by_text[a], by_text[b]) for a, b in joined]

    def reply_id(self, prefix: str) -> str:
        return reply_id(prefix, self.body, self.streams)


def _classifier(serving: OpenAIServing) -> Classifier | None:
    return serving.engine.model_config.classifier


async def classify(serving: OpenAIServing, body: ClassificationRequest, raw: Request,
                   pooling: str) -> dict | Response:  # fmt: skip
    classifier = _classifier(serving)
    if classifier is None:
        raise InvalidParam(
            "this model has no classifier: serve a *ForSequenceClassification checkpoint, or "
            "name the tokens whose logits are the labels (--hf-overrides '{\"classifier_from_"
            'token": ["no", "yes"]}\')',
            "model",
        )
    run = _Run(serving, body, raw, pooling)
    logits = await run.pooled("classify", await run.prompts(body.input), "classify")
    if isinstance(logits, Response):
        return logits
    data = []
    activation = body.use_activation is not False and body.activation is not False
    for i, each in enumerate(logits):
        probs = label_probs(each) if activation else list(each)
        best = max(range(len(probs)), key=probs.__getitem__)
        label = classifier.labels[best] if len(classifier.labels) == len(probs) else str(best)
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return {
        "id": run.reply_id("classify"),
        "object": "list",
        "created": int(time.time()),
        "model": serving.served_name(body.model),
        "data": data,
        "usage": _usage(run.num_tokens),
    }


async def score(serving: OpenAIServing, body: ScoreRequest, raw: Request,
                pooling: str) -> dict | Response:  # fmt: skip
    try:
        joined = pairs(body.text_1, body.text_2)
    except ValueError as error:
        raise InvalidParam(str(error), "text_2") from None
    run, scores = await _scored(serving, body, raw, pooling, "score", joined)
    if isinstance(scores, Response):
        return scores
    return {
        "id": run.reply_id("score"),
        "object": "list",
        "created": int(time.time()),
        "model": serving.served_name(body.model),
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(run.num_tokens),
    }


async def rerank(serving: OpenAIServing, body: RerankRequest, raw: Request,
                 pooling: str) -> dict | Response:  # fmt: skip
    if not body.documents:
        raise InvalidParam("documents: at least one document", "documents")
    joined = [(body.query, document) for document in body.documents]
    run, scores = await _scored(serving, body, raw, pooling, "rerank", joined)
    if isinstance(scores, Response):
        return scores
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {
        "id": run.reply_id("rerank"),
        "model": serving.served_name(body.model),
        "usage": {"total_tokens": run.num_tokens},
        "results": results,
    }


async def _scored(serving: OpenAIServing, body, raw: Request, pooling: str, prefix: str,
                  joined: list[tuple[str, str]]) -> tuple[_Run, list | Response]:  # fmt: skip
    """The run and each pair's score (a Response: the client went away); a classifier that
    cannot score is a 400."""
    run = _Run(serving, body, raw, pooling)
    classifier = _classifier(serving)
    if classifier is not None:
        try:
            one_label(classifier.num_labels)
        except ValueError as error:
            raise InvalidParam(str(error), "model") from None
    return run, await run.scores(prefix, joined, classifier)


def _usage(num_tokens: int) -> dict:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
