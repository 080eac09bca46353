"""vLLM's small endpoints beside the OpenAI API: GET /v1/models/{id}, /version, /ping,
/tokenizer_info, POST /reset_prefix_cache, and /tokenize's vLLM fields (`return_token_strs`,
`tools`).

/ping is /health under SageMaker's name (GET or POST), answered, like /health, before the API
key is checked (entrypoints/openai/api_server's _Guard), as vLLM does. Every other route here
needs the key when the server has one. vLLM checks its key on /v1/* alone, so it serves
/version and /tokenizer_info openly (the latter only behind a flag, as it shows the tokenizer's
configuration); conveyor keeps them behind the key, as it does all but its probes. vLLM serves
/reset_prefix_cache in its development mode only; conveyor always, behind the key: it costs
the next prompts their cache hits, nothing more.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from conveyor.engine.client import EngineClient
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.lora_routes import lora_card
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    InvalidParam,
    TokenizeRequest,
)
from conveyor.entrypoints.openai.serving import ChatTemplateOptions, OpenAIServing

# (path, method) answered before the API key is checked: the liveness probes.
PROBES = frozenset(
    {
        ("/health", "GET"),
        ("/health", "HEAD"),
        ("/ping", "GET"),
        ("/ping", "HEAD"),
        ("/ping", "POST"),
    }
)
# tokenizer_config.json keys that name files of the server's disk: not shown by /tokenizer_info.
_PATH_KEYS = ("name_or_path", "tokenizer_file", "vocab_file", "merges_file")


def model_card(model_name: str, max_model_len: int) -> dict:
    return {
        "id": model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "conveyor",
        "max_model_len": max_model_len,
    }


def add_vllm_routes(
    app: FastAPI,
    engine: EngineClient,
    serving: OpenAIServing,
    check_model: Callable[[str | None], Any],
    health: Callable[[], Response],
) -> None:
    """check_model: raises the server's 404 for a model it does not serve (returns the LoRA
    adapter a name is, or None for the base model)."""

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> dict:
        lora = check_model(model_id)
        if lora is not None:
            return lora_card(lora, serving.model_name)
        return model_card(model_id, engine.max_model_len)  # the name asked for, one of the served

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> dict:
        # conveyor's addition: which kernel and instruction set each op runs (model/plan.py)
        return {"version": package_version("conveyor"), "kernel_plan": engine.kernel_plan}

    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def ping() -> Response:  # answered by _Guard first; here for the schema
        return health()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await engine.reset_prefix_cache():
            raise APIError(
                409,
                "the prefix cache was not reset: requests are running and hold KV blocks; "
                "ask again when the server is idle",
                "ConflictError",
            )
        return Response(status_code=200)

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def info() -> dict:
        tokenizer = serving.tokenizer
        if tokenizer is None:
            raise HTTPException(404, "this server has no tokenizer (--skip-tokenizer-init)")
        return await serving.off_loop(tokenizer_info, tokenizer, engine.max_model_len)


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json as loaded,
    special tokens as their text) with `tokenizer_class` and `chat_template`; plus the special
    tokens' ids, the vocabulary size and the server's context length."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in _PATH_KEYS:
        config.pop(key, None)
    info = {str(key): _json_value(value) for key, value in config.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = _json_value(tokenizer.chat_template)
    for name in ("bos", "eos", "pad", "unk"):
        info[f"{name}_token"] = _json_value(getattr(tokenizer, f"{name}_token", None))
        info[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id", None)
    info["vocab_size"] = len(tokenizer)
    info["max_model_len"] = max_model_len
    return info


def _json_value(value: Any) -> Any:
    """A configuration value as JSON: special tokens (AddedToken) as their text, non-finite
    floats as null, anything else unknown as its str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


async def tokenize_response(serving: OpenAIServing, body: TokenizeRequest) -> dict:
    """/tokenize's answer, as vLLM's (with `token_strs`, null unless asked for)."""
    if body.messages is None:
        if chat_only := list(body.chat_fields()):
            raise InvalidParam(f"{chat_only[0]}: only with messages", chat_only[0])
        ids = await serving.off_loop(serving.encode, body.prompt, body.add_special_tokens)
    else:
        ids = await _chat_ids(serving, body)
    strs = None
    if body.return_token_strs:
        strs = await serving.off_loop(serving.tokenizer.convert_ids_to_tokens, ids)
    max_model_len = serving.engine.max_model_len
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


async def _chat_ids(serving: OpenAIServing, body: TokenizeRequest) -> list[int]:
    """The messages (with tools, template fields) as a chat request of them is checked and
    rendered: `count` is then the prompt_tokens that chat request reports."""
    if not body.messages:
        raise InvalidParam("messages: give at least one message", "messages")
    chat = ChatCompletionRequest(
        messages=body.messages,
        add_generation_prompt=body.add_generation_prompt,
        **body.chat_fields(),
    )
    chat.check_limits(serving.limits)
    chat.check_tools()
    serving.server_defaults.apply_template_kwargs(chat)
    return await serving.off_loop(
        serving.chat_prompt,
        chat.messages,
        chat.add_generation_prompt,
        chat.tool_dicts() or None,
        None,
        ChatTemplateOptions.of(chat),
    )
