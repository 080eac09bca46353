"""Anthropic Messages API request bodies (pydantic), and their translation into conveyor's
chat request: the prompt, the sampling and the tool modes are the OpenAI chat route's own.

    system                      a first "system" message
    text blocks                 joined into the turn's content
    tool_use blocks             the assistant turn's tool_calls (input as JSON arguments)
    tool_result blocks          "tool" messages (is_error: the content starts "Error: ")
    tool_choice auto / any      tool_choice "auto" / "required" (disable_parallel_tool_use:
                                parallel_tool_calls false); tool / none: a named function / "none"
    stop_sequences              stop
    output_config.format        response_format json_schema, strict (structured outputs)
    thinking                    enabled / disabled: chat_template_kwargs.enable_thinking;
                                budget_tokens: thinking_token_budget (a hint: ignored when no
                                reasoning is parsed); display omitted: include_reasoning false

Unknown fields are refused (400 naming them), as on the OpenAI routes. Accepted and ignored,
as harmless hints: `metadata`, `service_tier`, `cache_control` (top level, on blocks, system
blocks and tools: conveyor caches every prompt's prefix on its own), `citations` on a text
block (an earlier reply's, sent back), a tool's `type: "custom"`, `output_config.effort`.
Refused with a 400 that says why: image and document blocks (the models read text only),
other block types (thinking, server tools), tool_use blocks in a final assistant turn (a
prefill, which the reply continues: continue_final_message), a format together with a forced
tool_choice.

Nested JSON (input_schema, a tool_use block's input, the format's schema) is refused beyond
RequestLimits.max_json_depth, named in this API's terms, before it is translated.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from conveyor.entrypoints.openai.protocol import (
    ALIASED,
    STRICT,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    HintText,
    InvalidParam,
    JsonSchemaFormat,
    NamedToolChoice,
    OptionalMetadata,
    ResponseFormat,
    Tool,
    check_depth,
)
from conveyor.limits import RequestLimits

_TEXT_ONLY = ("image", "document")


class CacheControl(BaseModel):
    model_config = STRICT

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict] | None = None


class ToolUseBlock(BaseModel):
    model_config = STRICT

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = STRICT

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, value: Any) -> Any:
        return _known_blocks(value, ("text",))

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = STRICT

    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        return _known_blocks(value, ("text", "tool_use", "tool_result"), empty=False)

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> Message:
        wrong = "tool_result" if self.role == "assistant" else "tool_use"
        if isinstance(self.content, list) and any(b.type == wrong for b in self.content):
            raise ValueError(f"a {self.role} turn cannot hold {wrong} blocks")
        return self

    def chat_messages(self) -> list[ChatMessage]:
        """The OpenAI chat messages of this turn: a user turn's tool results become "tool"
        messages in place; an assistant turn's tool uses become its tool_calls."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        if self.role == "assistant":
            return [self._assistant_message()]
        messages: list[ChatMessage] = []
        texts: list[TextBlock] = []
        for block in self.content:
            if isinstance(block, TextBlock):
                texts.append(block)
                continue
            if texts:
                messages.append(ChatMessage(role="user", content=_joined(texts)))
                texts = []
            messages.append(
                ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text())
            )
        if texts:
            messages.append(ChatMessage(role="user", content=_joined(texts)))
        return messages

    def _assistant_message(self) -> ChatMessage:
        texts = [b for b in self.content if isinstance(b, TextBlock)]
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        content = _joined(texts) if texts else None
        return ChatMessage(role="assistant", content=content, tool_calls=calls or None)


class AnthropicTool(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None

    def chat_tool(self) -> Tool:
        function = FunctionDefinition(
            name=self.name,
            description=self.description,
            parameters=self.input_schema,
            strict=self.strict,
        )
        return Tool(type="function", function=function)


class ToolChoiceAuto(BaseModel):
    model_config = STRICT

    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(BaseModel):
    model_config = STRICT

    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(BaseModel):
    model_config = STRICT

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(BaseModel):
    model_config = STRICT

    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class OutputFormat(BaseModel):
    model_config = ALIASED

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint: ignored


class ThinkingEnabled(BaseModel):
    model_config = STRICT

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)  # Anthropic's floor; below max_tokens as well
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(BaseModel):
    model_config = STRICT

    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    model_config = STRICT

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")
]


class CountTokensRequest(BaseModel):
    """The body of /v1/messages/count_tokens: what renders the prompt."""

    model_config = STRICT

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # a hint: ignored

    def check_limits(self, limits: RequestLimits) -> None:
        """InvalidParam (-> 400) naming the first field, in this API's names, that the chat
        request it becomes would refuse under another name or could not be built from."""
        depth = limits.max_json_depth
        self._check_turns(depth)
        self._check_tools(depth)
        self._check_format(depth)

    def _check_turns(self, depth: int) -> None:
        for i, message in enumerate(self.messages):
            blocks = message.content if isinstance(message.content, list) else []
            for j, block in enumerate(blocks):
                if not isinstance(block, ToolUseBlock):
                    continue
                check_depth(block.input, depth, f"messages.{i}.content.{j}.input")
                if i == len(self.messages) - 1:
                    raise InvalidParam(
                        f"messages.{i}: a final assistant turn (a prefill the reply continues) "
                        "may hold text only, not tool_use blocks",
                        f"messages.{i}",
                    )

    def _check_tools(self, depth: int) -> None:
        for i, tool in enumerate(self.tools or []):
            check_depth(tool.input_schema, depth, f"tools.{i}.input_schema")
        if self._forced_tool and not self.tools:
            raise InvalidParam(
                f'tool_choice: {{"type": "{self.tool_choice.type}"}} needs tools; without '
                "tools leave tool_choice out",
                "tool_choice",
            )

    def _check_format(self, depth: int) -> None:
        output = self._format()
        if output is None:
            return
        check_depth(output.schema_, depth, "output_config.format.schema")
        if self._forced_tool and self.tools:
            raise InvalidParam(
                "output_config.format: cannot be combined with tool_choice "
                f'{{"type": "{self.tool_choice.type}"}} (both constrain the reply)',
                "output_config.format",
            )

    @property
    def _forced_tool(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.type in ("any", "tool")

    @property
    def _prefill(self) -> bool:
        """A final assistant turn: the reply continues it (the chat route's
        continue_final_message)."""
        return self.messages[-1].role == "assistant"

    def _format(self) -> OutputFormat | None:
        return self.output_config.format if self.output_config is not None else None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The equivalent OpenAI chat request; `sampling`: its sampling fields."""
        messages = [m for message in self.messages for m in message.chat_messages()]
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _joined(self.system)
            messages.insert(0, ChatMessage(role="system", content=system))
        choice, parallel = self._chat_tool_choice()
        output = self._format()
        if output is not None:  # Anthropic's structured outputs are strict
            schema = JsonSchemaFormat(name="output", schema_=output.schema_, strict=True)
            sampling["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
        chat = ChatCompletionRequest(
            model=self.model,
            messages=messages,
            add_generation_prompt=not self._prefill,
            continue_final_message=self._prefill,
            tools=[tool.chat_tool() for tool in self.tools] if self.tools else None,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            **sampling,
            **self._thinking_fields(),
        )
        return chat.named({"thinking_token_budget": "thinking.budget_tokens"}).budget_hint()

    def _thinking_fields(self) -> dict[str, Any]:
        """thinking as chat's fields: enabled or disabled reaches the template as
        enable_thinking (Qwen3's switch), the budget bounds the reasoning the server reads (a
        hint, as Anthropic's: ignored without a reasoning parser), display "omitted" leaves
        the thinking out."""
        thinking = self.thinking
        if thinking is None:
            return {}
        fields: dict[str, Any] = {}
        if thinking.type != "adaptive":
            fields["chat_template_kwargs"] = {"enable_thinking": thinking.type == "enabled"}
        if isinstance(thinking, ThinkingEnabled):
            fields["thinking_token_budget"] = thinking.budget_tokens
        if getattr(thinking, "display", None) == "omitted":
            fields["include_reasoning"] = False
        return fields

    def _chat_tool_choice(self) -> tuple[Any, bool | None]:
        """(OpenAI tool_choice, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None or not self.tools:  # "auto" or "none" without tools: no tools
            return None, None
        parallel = False if getattr(choice, "disable_parallel_tool_use", False) else None
        if isinstance(choice, ToolChoiceTool):
            return NamedToolChoice(type="function", function=FunctionName(name=choice.name)), None
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # Harmless hints: accepted, ignored (and bounded).
    metadata: OptionalMetadata | None = None
    service_tier: HintText | None = None

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        stops = self.stop_sequences or []
        if len(stops) > limits.max_stop:
            raise InvalidParam(
                f"stop_sequences: at most {limits.max_stop} allowed by this server, "
                f"got {len(stops)}",
                "stop_sequences",
            )
        if any(not stop for stop in stops):
            raise InvalidParam("stop_sequences: each must be a non-empty string", "stop_sequences")
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise InvalidParam(
                f"thinking.budget_tokens: must be less than max_tokens ({self.max_tokens}), "
                f"got {thinking.budget_tokens}",
                "thinking.budget_tokens",
            )
        if max((len(stop) for stop in stops), default=0) > limits.max_stop_length:
            raise InvalidParam(
                f"stop_sequences: each may have at most {limits.max_stop_length} characters",
                "stop_sequences",
            )

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        return super().chat_request(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            **sampling,
        )


def _known_blocks(value: Any, allowed: tuple[str, ...], empty: bool = True) -> Any:
    """A clear refusal for a block this server does not read (pydantic's own message for a
    discriminated union lists tags, not the reason)."""
    if not isinstance(value, list):
        return value
    if not value and not empty:
        raise ValueError("must be a string or a non-empty list of content blocks")
    for block in value:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in allowed:
            continue
        if kind in _TEXT_ONLY:
            raise ValueError(f"{kind} blocks are not supported: this model reads text only")
        if not isinstance(kind, str):
            raise ValueError("each content block must be an object with a type")
        choices = f"{', '.join(allowed[:-1])} or {allowed[-1]}" if allowed[1:] else allowed[0]
        raise ValueError(
            f"content block of type {json.dumps(kind)[:60]} is not supported here; use {choices}"
        )
    return value


def _joined(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)
