"""OpenAI's Responses API (POST /v1/responses): the request body (strict pydantic, as in
protocol.py) and its translation into the chat request the chat route runs, so both APIs go
through one chat template, one set of SamplingParams and one structured-output and tool-call
path (serving.py, structured/tools.py).

Taken: `input` (text, or items: messages with role user / system / developer / assistant
and text content; function_call and function_call_output items), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, `tools` (function tools),
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`previous_response_id`, `store`, `metadata`.

Accepted and ignored, as harmless hints: `user`, `service_tier`, `prompt_cache_key`,
`prompt_cache_retention`, `safety_identifier`, `stream_options.include_obfuscation`,
`text.verbosity`, a message's `phase`, an item's `id` and `status`, an output_text part's
`annotations` and `logprobs`; and, as asking for nothing, `include` when empty, `reasoning`
when all null, `top_logprobs` 0, `truncation` "disabled", `background` false.

Refused with a 400 that says why: hosted tools (web_search, file_search, ...), items and
content parts other than the above (reasoning, images, files, ...), `background` true,
`truncation` "auto", `reasoning` other than `effort` (which becomes the chat template's
reasoning_effort, as chat's reasoning_effort does), `conversation`,
`prompt`, `max_tool_calls`, `top_logprobs`, a non-empty `include`, two input items with one
`id` (input_items pages by id).

What a response echoes and the store keeps is bounded: the hint strings and item ids at
protocol.MAX_HINT_CHARS, `metadata` as OpenAI bounds it, and the input items, instructions,
tools and text format together as a prompt's text is (serving.ResponsesServing.prepare).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.entrypoints.openai.protocol import (
    ALIASED,
    REASONING_EFFORTS,
    STRICT,
    ChatCompletionRequest,
    HintText,
    InvalidParam,
    Metadata,
    _shown,
    check_depth,
)
from conveyor.limits import RequestLimits

_ITEM_TYPES = ("message", "function_call", "function_call_output")
_PART_TYPES = ("input_text", "output_text", "refusal")
_Status = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class InputText(BaseModel):
    model_config = STRICT

    type: Literal["input_text"]
    text: str


class OutputText(BaseModel):
    model_config = STRICT

    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None


class Refusal(BaseModel):
    model_config = STRICT

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


_Part = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _only_text_parts(value: Any, allowed: tuple[str, ...]) -> Any:
    for i, part in enumerate(value if isinstance(value, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ValueError(
                f"content part {i} has type {_shown(kind)}; this model reads text only "
                f"({', '.join(allowed)})"
            )
    return value


class MessageItem(BaseModel):
    model_config = STRICT

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: HintText | None = None
    status: _Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _only_text_parts(value, _PART_TYPES)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = STRICT

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: HintText | None = None
    status: _Status | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: HintText | None = None
    status: _Status | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _only_text_parts(value, ("input_text",))

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]
_ITEM_ADAPTER = TypeAdapter(InputItem)


def _typed_items(value: Any) -> Any:
    """Items with a type this server takes (a message may leave its type out), refusing the
    others by name before pydantic's union error would."""
    if not isinstance(value, list):
        return value
    typed = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {"type": "message", **item}
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in _ITEM_TYPES:
            raise ValueError(
                f"item {i} has type {_shown(kind)}; this server takes "
                f"{', '.join(_ITEM_TYPES)} items"
            )
        typed.append(item)
    return typed


class FunctionTool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class FunctionChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ALIASED

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> TextFormat:
        given = [self.name, self.schema_, self.description, self.strict]
        if self.type != "json_schema" and any(value is not None for value in given):
            raise ValueError("name, schema, description and strict belong to json_schema only")
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("json_schema needs a name and a schema")
        return self

    def response_format(self) -> dict | None:
        """The chat route's response_format of the same meaning."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        fields = {"name": self.name, "schema": self.schema_, "description": self.description}
        fields["strict"] = self.strict
        schema = {key: value for key, value in fields.items() if value is not None}
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: ignored


class StreamOptions(BaseModel):
    model_config = STRICT

    include_obfuscation: bool | None = None  # a hint: ignored (no padding is sent)


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: list[InputItem] = Field(default_factory=list)  # text: one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: Metadata | None = None
    background: bool | None = None
    reasoning: dict | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # Harmless hints: accepted, ignored; `user` is echoed and stored. Each is bounded
    # (protocol.MAX_HINT_CHARS).
    user: HintText | None = None
    service_tier: HintText | None = None
    prompt_cache_key: HintText | None = None
    prompt_cache_retention: HintText | None = None
    safety_identifier: HintText | None = None
    stream_options: StreamOptions | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_types(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        return _typed_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tool {i} has type {_shown(kind)}; this server runs function tools only "
                    "(no hosted tools such as web_search, file_search or code_interpreter)"
                )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(
                f"type {_shown(value.get('type'))} is not supported; give none, auto, required "
                'or {"type": "function", "name": ...}'
            )
        return value

    def refused(self) -> list[tuple[str, str]]:
        """(param, why) of each field set that this server cannot honour."""
        why = []
        if self.background:
            why.append(("background", "background responses are not supported; stream instead"))
        if self.truncation == "auto":
            why.append(("truncation", '"auto" is not supported: an input too long is refused'))
        reasoning = {k: v for k, v in (self.reasoning or {}).items() if v is not None}
        effort = reasoning.pop("effort", None)
        if effort is not None and effort not in REASONING_EFFORTS:
            why.append(
                ("reasoning.effort", f"{effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
            )
        if reasoning:
            why.append(
                (
                    "reasoning",
                    f"{', '.join(sorted(reasoning))}: this server makes no reasoning summaries; "
                    "only effort is taken (the chat template's reasoning_effort)",
                )
            )
        if self.include:
            why.append(("include", "no extra output data is available; leave include empty"))
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                why.append((name, "not supported by this server"))
        if self.top_logprobs:
            why.append(("top_logprobs", "not supported by this server"))
        return why

    def check(self, limits: RequestLimits) -> None:
        """InvalidParam for refused fields and JSON nested too deep, named in this API's
        terms (the chat request that runs this one checks the rest)."""
        if refused := self.refused():
            param, reason = refused[0]
            raise InvalidParam(f"{param}: {reason}", param)
        for i, tool in enumerate(self.tools or []):
            if tool.parameters is not None:
                check_depth(tool.parameters, limits.max_json_depth, f"tools.{i}.parameters")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.schema_ is not None:
            check_depth(fmt.schema_, limits.max_json_depth, "text.format.schema")
        for i, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                check_depth(item.arguments, limits.max_json_depth, f"input.{i}.arguments")
        self._check_ids()

    def _check_ids(self) -> None:
        """Each input item's id names one item: input_items pages by id."""
        first: dict[str, int] = {}
        for i, item in enumerate(self.input):
            if item.id is None:
                continue
            if item.id in first:
                raise InvalidParam(
                    f"input.{i}.id: {_shown(item.id)} is the id of input.{first[item.id]} as "
                    "well; each item's id must be unique",
                    f"input.{i}.id",
                )
            first[item.id] = i

    def echoed(self) -> dict:
        """The fields a response echoes and the store keeps beside its items."""
        return {
            "instructions": self.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "text": self.text_echo(),
        }

    def text_echo(self) -> dict:
        fmt = self.text.format if self.text else None
        echo = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else None}
        echo["format"] = echo["format"] or {"type": "text"}
        if self.text and self.text.verbosity:
            echo["verbosity"] = self.text.verbosity
        return echo

    def tool_choice_echo(self) -> str | dict:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto"

    def chat_request(self, items: list, first: int = 0) -> ChatCompletionRequest:
        """The chat request that runs this one: instructions, then `items` (the earlier
        turns', then this request's own from index `first`) as chat messages."""
        messages = chat_messages(items, first)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise InvalidParam("input: give at least one item (or instructions)", "input")
        fields = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [tool.chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "reasoning_effort": (self.reasoning or {}).get("effort"),
            "response_format": self.text.format.response_format()
            if self.text and self.text.format
            else None,
        }
        try:
            chat = ChatCompletionRequest.model_validate(
                {key: value for key, value in fields.items() if value is not None}
            )
        except ValidationError as error:  # not expected: every part was validated above
            first = error.errors()[0]
            raise ValueError(f"request could not be translated: {first['msg']}") from None
        return chat.named(CHAT_NAMES)


# The chat fields a response's chat request is made of, by this API's names: what the chat
# path's errors call them.
CHAT_NAMES = {
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


def _chat_tool_choice(choice: str | FunctionChoice | None) -> str | dict | None:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def chat_messages(items: list, first: int = 0) -> list[dict]:
    """Chat messages of Responses items: a function_call joins the assistant turn before it
    (one turn of output is a message and its calls), or starts one; a function_call_output
    is a tool message and must answer a call made earlier. Errors name the item by its
    index in the request's input, which starts at items[first]."""
    messages: list[dict] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            call_ids.add(item.call_id)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in call_ids:
                i -= first
                raise InvalidParam(
                    f"input.{i}: no function_call item with call_id {_shown(item.call_id)} "
                    "before this function_call_output",
                    f"input.{i}.call_id",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def stored_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem) -> dict:
    """An input item as the store keeps and input_items lists it: with an id and a status,
    a message's content as parts."""
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        if isinstance(item.content, str):
            parts = [{"type": kind, "text": item.content}]
        else:
            parts = [part.model_dump(exclude_none=True) for part in item.content]
        for part in parts:
            if part["type"] == "output_text":
                part.setdefault("annotations", [])
        data = {"type": "message", "role": item.role, "content": parts}
        return {"id": item.id or new_id("msg")} | data | {"status": "completed"}
    prefix = "fc" if isinstance(item, FunctionCallItem) else "fco"
    data = item.model_dump(exclude_none=True, exclude={"id", "status"})
    return {"id": item.id or new_id(prefix)} | data | {"status": "completed"}


def parse_items(items: list[dict]) -> list:
    """Stored items (this module's own output, valid by construction) as item models."""
    return [_ITEM_ADAPTER.validate_python(item) for item in items]


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
