"""OpenAI request bodies (pydantic). Fields beyond OpenAI's are vLLM's: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority,
include_stop_str_in_output, skip_special_tokens, structured_outputs.

Unknown fields are refused (400 naming them), not ignored: a client that sends a field it
relies on must not get an answer that silently did not honour it. Accepted and ignored, as
harmless hints: `user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
`safety_identifier`; bounded all the same (a hint string at most MAX_HINT_CHARS, metadata as
OpenAI bounds it), as an API that echoes or stores them must. Non-finite floats (JSON 1e999)
are refused as well.

Nested JSON a request carries (schemas, tool parameters, tool-call arguments) is refused
beyond RequestLimits.max_json_depth levels: the server recurses over it (see
conveyor/nesting.py).

Constrained output comes from one of: `response_format` (json_object, json_schema),
`structured_outputs` (vLLM's: json, json_object, regex, choice, grammar), or, on chat,
`tool_choice` "required" or a named function (see conveyor/structured/tools.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from conveyor import nesting
from conveyor.entrypoints.beam_search import BeamSearchParams
from conveyor.limits import RequestLimits
from conveyor.listing import listed
from conveyor.sampling_params import (
    MAX_LOGPROB_TOKEN_IDS,
    MAX_SALT_CHARS,
    MAX_STREAM_INTERVAL,
    SamplingParams,
)
from conveyor.structured.backend import strict_schema
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.tools import required_schema

# strict: no bool where a number is due (JSON true is not n=1), no "2" for an integer.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
ALIASED = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# OpenAI's reasoning efforts (chat's reasoning_effort, the Responses API's reasoning.effort).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
REASONING_EFFORTS = get_args(ReasoningEffort)


# What a request carries beside its prompt that an API echoes or stores (the Responses API
# keeps `user` and `metadata` with the response): `user`, an end user's id, and the other hint
# strings at most MAX_HINT_CHARS characters; metadata as OpenAI bounds it, 16 pairs of keys of
# 64 and values of 512 characters.
MAX_HINT_CHARS = 256
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _bounded_metadata(value: dict | None) -> dict | None:
    if value is not None and len(value) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} pairs, got {len(value)}")
    for key, item in (value or {}).items():
        if len(key) > MAX_METADATA_KEY or len(item or "") > MAX_METADATA_VALUE:
            raise ValueError(
                f"keys may have at most {MAX_METADATA_KEY} characters, values at most "
                f"{MAX_METADATA_VALUE}"
            )
    return value


HintText = Annotated[str, Field(max_length=MAX_HINT_CHARS)]
# vLLM's request_id (and the X-Request-Id header): the id a client traces its request by, in the
# response's id and the server's logs; no control characters (it is written to the log).
MAX_REQUEST_ID_CHARS = 256
RequestId = Annotated[
    str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")
]


def _bounded_xargs(value: dict | None) -> dict | None:
    """vLLM's vllm_xargs: a few scalar (or list of scalar) values by name, bounded as metadata."""
    if value is not None and len(value) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} pairs, got {len(value)}")
    for key, item in (value or {}).items():
        items = item if isinstance(item, list) else [item]
        if (
            len(key) > MAX_METADATA_KEY
            or len(items) > MAX_METADATA
            or any(isinstance(i, str) and len(i) > MAX_METADATA_VALUE for i in items)
        ):
            raise ValueError(
                f"keys may have at most {MAX_METADATA_KEY} characters, lists at most "
                f"{MAX_METADATA} items, strings at most {MAX_METADATA_VALUE} characters"
            )
    return value


Metadata = Annotated[dict[str, str], AfterValidator(_bounded_metadata)]
ExtraArgs = Annotated[
    dict[str, str | int | float | list[str | int | float]], AfterValidator(_bounded_xargs)
]
OptionalMetadata = Annotated[dict[str, str | None], AfterValidator(_bounded_metadata)]


class InvalidParam(ValueError):
    """A request field with a value conveyor refuses: HTTP 400 whose error names `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_token_id(key: str) -> bool:
    return key.strip().isdigit()


def check_depth(value: Any, limit: int, param: str) -> None:
    """InvalidParam if `value` (a dict or list, or the JSON text of one) nests deeper than
    limit levels."""
    if isinstance(value, str):
        deep = nesting.text_too_deep(value, limit)
    else:
        deep = nesting.too_deep(value, limit)
    if deep:
        raise InvalidParam(
            f"{param}: nested deeper than {limit} levels, the most this server allows",
            param,
        )


class JsonSchemaFormat(BaseModel):
    model_config = ALIASED

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    model_config = ALIASED

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> StructuredOutputs:
        try:
            return StructuredOutputs(
                json=self.json_,
                json_object=bool(self.json_object),
                regex=self.regex,
                choice=self.choice,
                grammar=self.grammar,
            )
        except ValueError as error:
            raise InvalidParam(str(error), "structured_outputs") from None


class RepetitionDetectionField(BaseModel):
    """vLLM's repetition_detection (sampling_params.py: RepetitionDetectionParams)."""

    model_config = STRICT

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class _SamplingFields(BaseModel):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: whether the text puts a space between two special tokens. The Rust tokenizers
    # conveyor loads write them side by side either way, as vLLM's fast path does (its slow,
    # Python tokenizers are the ones it changes; transformers 5 loads none for these models).
    spaces_between_special_tokens: bool = True
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's: prompt logprobs (top-N per prompt token), the token ids in the response, the
    # prompt cut to its last N tokens, and what may or may not be sampled.
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] = "left"  # which end truncation cuts
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: the reasoning ends once it has this many tokens (its closing marker is forced).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # vLLM's: only requests with the same salt share the prompt's cached blocks.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    # vLLM's: the response's id is "<chatcmpl|cmpl>-<request_id>" (an X-Request-Id header wins).
    request_id: RequestId | None = None
    # vLLM's: these tokens' logprobs at every position in place of the top-N (with logprobs).
    logprob_token_ids: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS
    )
    # vLLM's: tokens a streamed chunk gathers (raised to the server's --stream-interval).
    stream_interval: int | None = Field(default=None, ge=1, le=MAX_STREAM_INTERVAL)
    # vLLM's: the reply ends (finish_reason "repetition") once it repeats a pattern.
    repetition_detection: RepetitionDetectionField | None = None
    # vLLM's beam search: n beams, scored by log-probability over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Harmless hints: accepted, ignored (and bounded).
    user: HintText | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: HintText | None = None
    prompt_cache_key: HintText | None = None
    safety_identifier: HintText | None = None
    # vLLM's: a conversation's stable id (for its KV events and routers), the engine's
    # watermark (none is configured here) and values for custom extensions (none are loaded).
    session_id: HintText | None = None
    watermarking: bool | None = None
    vllm_xargs: ExtraArgs | None = None
    # vLLM's: ignored by its generating endpoints too (render endpoints' and routed experts').
    return_token_offsets: bool | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    # vLLM's disaggregated prefill and encoder: refused when given (unsupported()).
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set that conveyor cannot honour yet: refused rather than silently ignored."""
        return self._transfer_fields()

    def _transfer_fields(self) -> list[str]:
        """vLLM's KV / encoder transfer fields, set: there is no disaggregated serving here."""
        fields = ("kv_transfer_params", "ec_transfer_params")
        return [f"{name} (no disaggregated serving)" for name in fields if getattr(self, name)]

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def num_prompt_logprobs(self, max_tokens: int | None) -> int | None:
        return self.prompt_logprobs

    def constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """(what the output is constrained to, the field it came from); InvalidParam if the
        fields asking for one are malformed or contradict each other."""
        found = None
        fmt, name = self.response_format, self.field_name("response_format")
        if fmt is not None and fmt.type == "json_object":
            found = StructuredOutputs(json_object=True), name
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidParam(
                    f"{name}: json_schema is required when type is json_schema", name
                )
            schema = fmt.json_schema.schema_
            if schema is None:
                found = StructuredOutputs(json_object=True), name
            else:
                strict = fmt.json_schema.strict
                found = StructuredOutputs(json=strict_schema(schema) if strict else schema), name
        if self.structured_outputs is not None:
            if found is not None:
                raise InvalidParam(
                    "give response_format or structured_outputs, not both", "structured_outputs"
                )
            found = self.structured_outputs.constraint(), "structured_outputs"
        return found or (None, None)

    def field_name(self, name: str) -> str:
        """The name errors give a field: its own, or, for a request that runs another API's
        request, that API's (ChatCompletionRequest.names)."""
        return name

    @property
    def budget_is_hint(self) -> bool:
        """Whether thinking_token_budget is ignored where nothing reasons (else refused)."""
        return False

    def check_limits(self, limits: RequestLimits) -> None:
        """Raises ValueError (-> 400) naming the first field beyond the server's limits."""
        self._check_vllm_forms()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        counts = [
            ("n", self.n, limits.max_n),
            ("logprobs", self.num_logprobs() or 0, limits.max_logprobs),
            ("logprob_token_ids", len(self.logprob_token_ids or ()), limits.max_logprobs),
            ("prompt_logprobs", self.prompt_logprobs or 0, limits.max_logprobs),
            ("bad_words", len(self.bad_words or []), limits.max_stop),
            ("stop", len(stops), limits.max_stop),
            ("stop_token_ids", len(self.stop_token_ids or []), limits.max_stop_token_ids),
            ("logit_bias", len(self.logit_bias or {}), limits.max_logit_bias),
        ]
        for name, value, limit in counts:
            if value > limit:
                raise ValueError(f"{name}: at most {limit} allowed by this server, got {value}")
        for name, texts in (("stop", stops), ("bad_words", self.bad_words or [])):
            longest = max((len(s) for s in texts), default=0)
            if longest > limits.max_stop_length:
                raise ValueError(
                    f"{name}: each string may have at most {limits.max_stop_length} "
                    f"characters, got {longest}"
                )
        for param, value in self.nested_fields():
            check_depth(value, limits.max_json_depth, param)

    def named_logprobs(self) -> list[int] | None:
        """logprob_token_ids, which takes the place of the top-N the request's logprobs asks
        for (and so needs it)."""
        if self.logprob_token_ids is not None and self.num_logprobs() is None:
            raise InvalidParam(
                "logprob_token_ids: needs logprobs (the tokens' logprobs are shown in its place)",
                "logprob_token_ids",
            )
        return self.logprob_token_ids

    def _check_vllm_forms(self) -> None:
        """What vLLM refuses as a whole: stream_options without a stream (it says how a
        stream ends), and logit_bias keys that are not token ids, every one named at once."""
        if self.stream_options is not None and not self.stream:
            raise InvalidParam(
                "stream_options: Stream options can only be defined when `stream=True`.",
                "stream_options",
            )
        bad = [key for key in self.logit_bias or {} if not _is_token_id(key)]
        if bad:
            raise InvalidParam(
                f"logit_bias: keys must be token ids (integers >= 0 as strings); "
                f"{listed([repr(key) for key in bad])} are not",
                "logit_bias",
            )

    def nested_fields(self) -> list[tuple[str, Any]]:
        """(param, value) of each field holding nested JSON: the schemas."""
        fields = []
        fmt = self.response_format
        if fmt is not None and fmt.json_schema is not None:
            fields.append(("response_format.json_schema.schema", fmt.json_schema.schema_))
        if self.structured_outputs is not None:
            fields.append(("structured_outputs.json", self.structured_outputs.json_))
        return [(param, value) for param, value in fields if value is not None]

    def beam_params(
        self,
        limits: RequestLimits,
        max_tokens: int,
        constrained_by: str | None,
        num_logprobs: int | None,
        skip_special_tokens: bool = True,
    ) -> BeamSearchParams:
        """use_beam_search's settings (n beams, each step asking for 2 x n logprobs, within
        the server's max_logprobs as vLLM bounds them); InvalidParam naming a field the search
        does not apply (it ranks the model's own log-probabilities, token by token), or the
        field whose grammar would constrain the reply (constrained_by). skip_special_tokens:
        as the request's own sampling would decode its reply (False: its parsers read
        markers)."""
        if constrained_by is not None:
            name = self.field_name(constrained_by)
            raise InvalidParam(f"{name}: not supported with use_beam_search", name)
        for name in _NOT_WITH_BEAMS:
            if getattr(self, name) not in (None, False, 0, []):
                name = self.field_name(name)
                raise InvalidParam(f"{name}: not supported with use_beam_search", name)
        widest = max(limits.max_logprobs // 2, 1)
        if not 1 <= self.n <= widest:
            raise InvalidParam(
                f"n: use_beam_search's beam width (n) must be in [1, {widest}]: each step asks "
                f"for 2 x n logprobs, at most this server's max_logprobs "
                f"({limits.max_logprobs}, --max-logprobs); got {self.n}",
                "n",
            )
        try:
            return BeamSearchParams(
                self.n,
                max_tokens,
                self.ignore_eos,
                self.temperature or 0.0,
                self.length_penalty,
                self.include_stop_str_in_output,
                num_logprobs,
                skip_special_tokens,
            )
        except ValueError as error:
            name = str(error).split()[0]  # BeamSearchParams' messages start with the field
            name = self.field_name("n" if name == "beam_width" else name)
            raise InvalidParam(f"{name}: {error}", name) from None

    def sampling_params(
        self,
        max_tokens: int | None,
        constraint: StructuredOutputs | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for values out of range or not supported. defaults:
        the server's value of each sampling field this request leaves out (the model's
        generation config, model/config.py: sampling_defaults)."""
        if names := self.unsupported():
            raise ValueError(f"not supported by this server: {', '.join(names)}")
        defaults = defaults or {}
        values = {}
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs() if self.logprob_token_ids is None else None,
            logprob_token_ids=self.named_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=constraint,
            prompt_logprobs=self.num_prompt_logprobs(max_tokens),
            cache_salt=self.cache_salt,
            stream_interval=self.stream_interval or 1,
            repetition_detection=(
                None
                if self.repetition_detection is None
                else self.repetition_detection.model_dump()
            ),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            **values,
        )


# What beam search does not apply: it ranks the model's own log-probabilities to max_tokens
# or EOS (vLLM ignores these; they are refused here rather than silently dropped).
_NOT_WITH_BEAMS = (
    "stop",
    "stop_token_ids",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
    "logprob_token_ids",
    "thinking_token_budget",
)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    def unsupported(self) -> list[str]:
        names = ["suffix"] if self.suffix else []
        names += ["best_of"] if self.best_of not in (None, self.n) else []
        return names + self._transfer_fields()

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self, max_tokens: int | None) -> int | None:
        """echo with logprobs: the prompt's logprobs as well (top `logprobs` each); echo with
        max_tokens 0: the prompt alone is computed, and echoed."""
        if not self.echo:
            return self.prompt_logprobs
        wanted = [n for n in (self.prompt_logprobs, self.logprobs) if n is not None]
        if wanted or max_tokens == 0:
            return max(wanted, default=0)
        return None

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        prompt = self.prompt
        num_prompts = 1 if isinstance(prompt, str) or _is_id_list(prompt) else len(prompt)
        if num_prompts > limits.max_prompts:
            raise ValueError(
                f"prompt: at most {limits.max_prompts} prompts per request allowed by this "
                f"server, got {num_prompts}"
            )


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


# OpenAI's roles; any other that matches _CUSTOM_ROLE reaches the chat template, which decides
# (vLLM's custom roles: ipython, observation, ...; a template that refuses one is a 400).
ROLES = ("system", "user", "assistant", "tool", "developer")
_CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,63}")


def _role(value: Any) -> Any:
    if isinstance(value, str) and (value in ROLES or _CUSTOM_ROLE.fullmatch(value)):
        return value
    raise ValueError(
        f"must be one of {', '.join(ROLES)}, or a custom role the chat template reads "
        f"(1-64 letters, digits, _ or -, starting with a letter), got {_shown(value)}"
    )


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Annotated[str, AfterValidator(_role)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn that called tools

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part of type {_shown(kind)} is not supported: this model "
                        "reads text only"
                    )
        return value

    def text(self) -> str | None:
        """The content as one string: its text parts one to a line, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content

    def parts(self) -> list[dict]:
        """The content as OpenAI's text parts (a string is one part), for the chat templates
        that read the parts themselves."""
        if isinstance(self.content, list):
            return [{"type": "text", "text": part.text} for part in self.content]
        return [] if self.content is None else [{"type": "text", "text": self.content}]


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # The request's fields by the names of the API it came in by, where that is not chat
    # (the Responses API's max_output_tokens, text.format, input): errors are written with
    # them when raised, so the client reads its own fields' names.
    _names: dict[str, str] = PrivateAttr(default_factory=dict)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message is continued rather than closed; extra variables
    # for the chat template (e.g. enable_thinking); a template of the request's own (only
    # with --trust-request-chat-template); the last assistant message's text in front of the
    # reply.
    continue_final_message: bool = False
    # vLLM's: the response's prompt_text is the prompt the model read (its tokens as text).
    return_prompt_text: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # vLLM's: the retrieved documents a RAG chat template reads (Granite's, Command R's), and
    # the tokenizer's own special tokens added to the rendered prompt (off: the template
    # writes them).
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False
    echo: bool = False
    # OpenAI's (and vLLM's): handed to the chat template as the variable reasoning_effort,
    # which templates of reasoning models read; others leave it unused, as they do any
    # chat_template_kwargs they do not know.
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: false leaves the reasoning (read by --reasoning-parser) out of the answer.
    include_reasoning: bool = True
    # Set by an API whose budget is a hint (Anthropic's thinking): without reasoning to bound
    # it is ignored, where chat's own field is refused.
    _budget_is_hint: bool = PrivateAttr(default=False)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def named(self, names: dict[str, str]) -> ChatCompletionRequest:
        """This request, its errors naming its fields by `names` (chat's name -> the API's)."""
        self._names = names
        return self

    def field_name(self, name: str) -> str:
        return self._names.get(name, name)

    def budget_hint(self) -> ChatCompletionRequest:
        """This request, its thinking_token_budget a hint: ignored if nothing reasons."""
        self._budget_is_hint = True
        return self

    @property
    def budget_is_hint(self) -> bool:
        return self._budget_is_hint

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required" or "named": how this request uses its tools."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        if self.chat_template_kwargs:
            check_depth(self.chat_template_kwargs, limits.max_json_depth, "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidParam(
                "continue_final_message and add_generation_prompt cannot both be true: give "
                "add_generation_prompt: false to continue the last message",
                "continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidParam(
                "continue_final_message: the last message must be the assistant's",
                "continue_final_message",
            )
        for i, message in enumerate(self.messages):
            for j, call in enumerate(message.tool_calls or []):
                param = f"messages.{i}.tool_calls.{j}"
                check_depth(call, limits.max_json_depth, param)
                function = call.get("function")
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if isinstance(arguments, str):  # JSON text, read when the prompt is written
                    check_depth(arguments, limits.max_json_depth, f"{param}.function.arguments")

    def nested_fields(self) -> list[tuple[str, Any]]:
        fields = super().nested_fields()
        for i, tool in enumerate(self.tools or []):
            if tool.function.parameters is not None:
                fields.append((f"tools.{i}.function.parameters", tool.function.parameters))
        return fields

    def check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        bad = [_shown(name) for name in names if not _FUNCTION_NAME.match(name)]
        if bad:
            raise InvalidParam(
                f"tools: function names must be 1-64 letters, digits, _ or -: {listed(bad)} "
                f"{'is' if len(bad) == 1 else 'are'} not",
                "tools",
            )
        repeated = sorted(name for name, count in Counter(names).items() if count > 1)
        if repeated:
            raise InvalidParam(
                f"tools: function names must be unique: {listed(repeated)} repeated", "tools"
            )
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            shown = _shown(choice) if isinstance(choice, str) else "a named function"
            raise InvalidParam(
                f"tool_choice: {shown} needs tools; without tools leave tool_choice out or "
                'give "none"',
                "tool_choice",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidParam(
                f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice"
            )

    def constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        self.check_tools()
        found, param = super().constraint()
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return found, param
        if found is not None:
            raise InvalidParam(
                f"tool_choice: a forced tool call cannot be combined with {param}", "tool_choice"
            )
        tools = self.tool_dicts()
        if mode == "named":
            name = self.tool_choice.function.name
            tool = next(t for t in tools if t["function"]["name"] == name)
            parameters = tool["function"].get("parameters") or {"type": "object"}
            return StructuredOutputs(json=strict_schema(parameters)), "tools"
        try:
            schema = required_schema(tools, parallel=self.parallel_tool_calls is not False)
        except ValueError as error:
            raise InvalidParam(str(error), "tools") from None
        return StructuredOutputs(json=schema), "tools"

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # vLLM's: the token strings beside the ids; with messages, the chat route's template
    # fields, rendered as it renders them (entrypoints/openai/vllm_routes.py).
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The fields set that only apply to messages."""
        names = (
            "tools",
            "continue_final_message",
            "chat_template_kwargs",
            "chat_template",
            "documents",
        )
        return {name: getattr(self, name) for name in names if getattr(self, name)}


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def _is_id_list(prompt: list) -> bool:
    return all(isinstance(t, int) for t in prompt)


def _shown(value: Any) -> str:
    """A value as JSON for an error message (never a Python repr), cut to 100 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 100 else text[:97] + "..."


logger = logging.getLogger(__name__)
MAX_UNKNOWN_LOGGED = 20  # fields named in one warning, each cut to 100 characters


def lenient(model: type[BaseModel]) -> type[BaseModel]:
    """`model` accepting top-level fields it does not know, as vLLM does (the server's
    --ignore-unknown-fields): they are logged and dropped before validation; nested objects
    stay strict, and fields it knows are checked as ever."""
    fields = model.model_fields.items()
    known = {name for name, _ in fields} | {f.alias for _, f in fields if f.alias is not None}

    class Lenient(model):  # type: ignore[valid-type, misc]
        @model_validator(mode="before")
        @classmethod
        def _drop_unknown(cls, data: Any) -> Any:
            if not isinstance(data, dict):
                return data
            unknown = [key for key in data if key not in known]
            if not unknown:
                return data
            shown = ", ".join(_shown(key) for key in unknown[:MAX_UNKNOWN_LOGGED])
            logger.warning("%s: ignored unknown field(s) %s", model.__name__, shown)
            return {key: value for key, value in data.items() if key in known}

    Lenient.__name__ = Lenient.__qualname__ = model.__name__
    return Lenient
