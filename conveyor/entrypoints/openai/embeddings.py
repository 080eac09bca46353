"""POST /v1/embeddings: OpenAI's embeddings API over any loaded causal LM.

An embedding is the final hidden state (after the last norm) of the input's last token, or
the mean over its tokens (`conveyor serve --embedding-pooling`), L2-normalized. Each input is
a prompt-only request (SamplingParams.pooling, max_tokens 0): it is scheduled under the same
token budget as everything else, so an embedding batch rides along with decoding requests,
chunked like any prompt, and the result does not depend on the chunking.

A causal LM's hidden states are not trained as sentence embeddings: they serve retrieval only
when the model was fine-tuned for it (e5-mistral, gte-Qwen and the like use last-token
pooling); for a chat model they are a similarity signal at best (see README).
"""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.engine.streams import RequestFailedError
from conveyor.entrypoints.openai.protocol import HintText, InvalidParam, RequestId
from conveyor.entrypoints.openai.serving import OpenAIServing, reply_id
from conveyor.entrypoints.runner import header_request_id, until_disconnected
from conveyor.limits import RequestLimits
from conveyor.pooling_params import PoolingParams
from conveyor.sampling_params import SamplingParams


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: HintText | None = None  # a harmless hint: accepted, ignored (and bounded)
    # vLLM's
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] = "left"
    add_special_tokens: bool = True
    priority: int = 0
    request_id: RequestId | None = None  # the response's id is "embd-<request_id>"

    def check_limits(self, limits: RequestLimits) -> None:
        value = self.input
        single = isinstance(value, str) or all(isinstance(t, int) for t in value)
        count = 1 if single else len(value)
        if count > limits.max_prompts:
            raise InvalidParam(
                f"input: at most {limits.max_prompts} inputs per request allowed by this "
                f"server, got {count}",
                "input",
            )


async def embed(
    serving: OpenAIServing,
    request: EmbeddingRequest,
    pooling: str,
    hidden_size: int,
    raw: Request,
) -> dict | Response:
    """The embeddings of every input, in order (all inputs are accepted, or none). A client
    that goes away first has its inputs aborted, as every generating route's (a 499)."""
    request.check_limits(serving.limits)
    try:
        PoolingParams(dimensions=request.dimensions).check(hidden_size)
    except ValueError as e:
        raise InvalidParam(str(e), "dimensions") from None
    prompts = await serving.off_loop(
        serving.completion_prompts,
        request.input,
        request.add_special_tokens,
        request.truncate_prompt_tokens,
        serving.engine.max_model_len,  # a prompt-only request may fill the context
        request.truncation_side,
    )
    params = SamplingParams(max_tokens=0, pooling=pooling)
    priority = serving.limits.clamp_priority(request.priority)
    if (given := header_request_id(raw.headers)) is not None:  # vLLM's: the header wins
        request = request.model_copy(update={"request_id": given})
    model = request.model
    streams = await serving.submit("embd", prompts, params, priority, model, request.request_id)
    work = _embeddings(serving, request, prompts, streams)
    return await until_disconnected(raw, serving, streams, work)


async def _embeddings(serving: OpenAIServing, request: EmbeddingRequest, prompts, streams) -> dict:
    try:
        vectors = [await _embedding(stream) for stream in streams]
    finally:
        serving.abort_unfinished(streams)
    num_tokens = sum(len(p) for p in prompts)
    return {
        "id": reply_id("embd", request, streams),
        "object": "list",
        "created": int(time.time()),
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, request.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": serving.served_name(request.model),
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def _embedding(stream) -> list[float]:
    vector = None
    async for out in stream:
        if out.embedding is not None:
            vector = out.embedding
    if vector is None:  # aborted, or failed in the engine
        raise RequestFailedError(f"request {stream.request_id} ended without an embedding")
    return vector


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
