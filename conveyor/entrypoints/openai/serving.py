"""Requests in, OpenAI responses out: prompts and chat templates, and chat's and completions'
shapes of the shared pipeline's choices (pipeline.Choices: the one loop, usage and events)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace

from conveyor.engine.client import EngineClient
from conveyor.engine.input_processor import reserved_template_variables
from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.beam_search import BeamSearch, BeamSearchParams, BeamStream
from conveyor.entrypoints.openai.chat_content import (
    message_dict,
    resolve_content_format,
    with_text,
)
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    InvalidParam,
    StreamOptions,
)
from conveyor.entrypoints.pacer import Pacer
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    Parsed,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)
from conveyor.entrypoints.parsers.tools.forced import FORCED_FAMILIES, forced_grammar
from conveyor.entrypoints.pipeline import (
    Choice,
    Choices,
    Parsers,
    PromptState,
    ReplyParser,
    ReplyReader,
    Step,
    Usage,
    finish_reason,
    marker_terminal,
    special_texts,
    timing_metrics,
    tokenized,
)
from conveyor.entrypoints.runner import DONE, Submission, frame
from conveyor.limits import RequestLimits
from conveyor.listing import listed
from conveyor.outputs import CompletionOutput, PositionLogprobs
from conveyor.sampling_params import ReasoningBounds, SamplingParams
from conveyor.structured.backend import GrammarError
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.tools import MAX_DEPTH, ToolCall, tools_prompt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Callers of off_loop that go on per pass of the event loop: each then submits its request
# (~3-5 ms of the loop), so a pass stays near 20 ms however many prompts were ready.
OFF_LOOP_PER_PASS = 4


@dataclass(frozen=True)
class ServerDefaults:
    """What the server's flags set on every chat and completion request, as vLLM's: logprobs
    that name tokens "token_id:N" (--return-tokens-as-token-ids), a usage chunk at the end of
    every stream (--enable-force-include-usage), the chat template's variables a request does
    not set (--default-chat-template-kwargs), how a message's content reaches the template
    (--chat-template-content-format: chat_content.py), whether a request's tools reach it
    when its tool_choice is "none" (--expand-tools-even-if-tool-choice-none), and the tokens a
    stream's chunk gathers at least (--stream-interval; a request's stream_interval may ask
    for more; a reply that is not streamed ignores both), and how long a stream may go
    without a chunk before an SSE comment keeps its connection (--sse-keep-alive-interval)."""

    tokens_as_ids: bool = False
    force_include_usage: bool = False
    chat_template_kwargs: dict | None = None
    content_format: str = "auto"
    tools_when_none: bool = False
    stream_interval: int = 1
    keep_alive: float = 0.0  # seconds without a chunk before an SSE comment (0: none)
    per_request_metrics: bool = False  # a reply's own timings (--enable-per-request-metrics)

    def apply(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        if self.tokens_as_ids:
            request.return_tokens_as_token_ids = True
        asked = request.stream_interval or 1
        request.stream_interval = max(asked, self.stream_interval) if request.stream else None
        if self.force_include_usage and request.stream:
            options = request.stream_options or StreamOptions()
            request.stream_options = options.model_copy(update={"include_usage": True})
        if isinstance(request, ChatCompletionRequest):
            self.apply_template_kwargs(request)

    def apply_template_kwargs(self, request: ChatCompletionRequest) -> None:
        if self.chat_template_kwargs:
            own = request.chat_template_kwargs or {}
            request.chat_template_kwargs = {**self.chat_template_kwargs, **own}

    def rendered_tools(self, request: ChatCompletionRequest) -> list[dict] | None:
        """The tools the chat template is given."""
        if request.tool_mode != "none" or (self.tools_when_none and request.tools):
            return request.tool_dicts()
        return None


class RequestLogger:
    """vLLM's --enable-log-requests: one INFO line per engine request as it is submitted, its
    id, prompt (text and token ids, each cut to --max-log-len characters / ids), sampling
    parameters and LoRA adapter, on the `conveyor.requests` logger; with --enable-log-outputs
    one more per sequence as it finishes, its text, token ids and finish reason."""

    def __init__(self, max_log_len: int | None = None, outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.outputs = outputs

    def watch(self, stream):
        """The stream, its finished sequences logged as they are read (where outputs are)."""
        return _LoggedStream(stream, self) if self.outputs else stream

    def log_output(self, request_id: str, output: CompletionOutput) -> None:
        if not _REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        cut = self.max_log_len
        _REQUEST_LOG.info(
            "Generated response %s (sequence %d): output: %r, output_token_ids: %s, "
            "finish_reason: %s",
            request_id,
            output.index,
            output.text if cut is None else output.text[:cut],
            output.token_ids if cut is None else output.token_ids[:cut],
            output.finish_reason,
        )

    def log(self, request_id: str, prompt: list[int], params, lora_request, tokenizer) -> None:
        if not _REQUEST_LOG.isEnabledFor(logging.INFO):
            return
        ids = prompt if self.max_log_len is None else prompt[: self.max_log_len]
        text = tokenizer.decode(ids) if tokenizer is not None else None
        if text is not None and self.max_log_len is not None:
            text = text[: self.max_log_len]
        _REQUEST_LOG.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s",
            request_id,
            text,
            params,
            ids,
            lora_request,
        )


_REQUEST_LOG = logging.getLogger("conveyor.requests")


class _LoggedStream:
    """A request's stream whose sequences are logged as they finish, their text and token
    ids gathered from its deltas (a server's engine streams deltas)."""

    def __init__(self, stream, log: RequestLogger) -> None:
        self._stream, self._log = stream, log
        self._text: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    async def __aiter__(self):
        async for item in self._stream:
            for output in item.outputs:
                self._gather(item.request_id, output)
            yield item

    def _gather(self, request_id: str, output: CompletionOutput) -> None:
        text = self._text.setdefault(output.index, [])
        ids = self._ids.setdefault(output.index, [])
        text.append(output.text)
        ids.extend(output.token_ids)
        if output.finish_reason is not None:
            whole = replace(output, text="".join(text), token_ids=list(ids))
            self._log.log_output(request_id, whole)


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: RequestLimits | None = None,
        trust_request_chat_template: bool = False,
        parsers: ParserNames | None = None,
        response_role: str = "assistant",
        server_defaults: ServerDefaults | None = None,
    ) -> None:
        self.engine = engine
        self.response_role = response_role  # vLLM's --response-role
        self.server_defaults = server_defaults or ServerDefaults()
        self.request_logger: RequestLogger | None = None  # --enable-log-requests
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.limits = limits or RequestLimits()
        # A request's own chat_template runs in transformers' sandboxed Jinja, which bounds
        # what it may touch but not how long it loops: only an operator who trusts the clients
        # turns it on (vLLM's --trust-request-chat-template).
        self.trust_request_chat_template = trust_request_chat_template
        template = getattr(self.tokenizer, "chat_template", None)
        self.parsers = Parsers.of(parsers or ParserNames(), template)
        self._specials = special_texts(self.tokenizer)
        self._lark_marker = marker_terminal(self.tokenizer, self._specials)
        self.loras = None  # the LoRA adapters served by name (lora_routes.ServedLoRAs)
        # The model's default sampling parameters for the fields a request leaves out, and
        # the cap on max_tokens (--generation-config, --override-generation-config; vLLM's).
        self.defaults = dict(engine.default_sampling)
        # Tokenizing and chat templating a long prompt takes a while: never on the event loop.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="conveyor-tokenize")
        self._pacer = Pacer(OFF_LOOP_PER_PASS)

    async def off_loop(self, fn: Callable, *args):
        """Runs fn(*args) on the tokenizer threads, so open streams keep flowing meanwhile;
        its caller goes on a few per pass of the loop (Pacer)."""
        result = await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        await self._pacer.turn()
        return result

    def tool_reply(self, request: ChatCompletionRequest, prompt: list[int]) -> _ToolReply:
        """How one choice's reply is read: the server's parsers, for this request."""
        mode = self.reading_mode(request)
        # A grammar starts after the reasoning that a reasoning parser reads (the engine core
        # finds where it ends: sample/reasoning.py); a generic forced call shapes the reply
        # from the start.
        structured = request.response_format is not None or request.structured_outputs is not None
        constrained = mode in ("required", "named") or (
            (structured or mode == "forced") and not self.parsers.marks_reasoning
        )
        tools = _declared(request) if mode in ("auto", "forced") else None
        if mode == "forced" and request.tool_mode == "named":
            name = request.tool_choice.function.name
            tools = {name: tools[name]}
        tail = self.tokenizer.decode(prompt[-8:]) if self.tokenizer is not None else ""
        parser = self.parsers.for_request(
            tools, self.limits.max_json_depth, tail, constrained, request.chat_template_kwargs
        )
        hidden = self.hidden_specials(request) or ()
        return _ToolReply(request, self.limits.max_json_depth, parser, hidden, mode)

    def reading_mode(self, request: ChatCompletionRequest) -> str:
        """The request's tool mode, or "forced": a forced call (required, named) that the
        server's tool-call parser reads, its grammar written in that family's syntax."""
        mode = request.tool_mode
        if mode in ("required", "named") and self.parsers.names.tool_call in FORCED_FAMILIES:
            return "forced"
        return mode

    def forced_constraint(self, request: ChatCompletionRequest) -> StructuredOutputs | None:
        """The grammar of a forced call in the family's syntax (None: no such grammar)."""
        if self.reading_mode(request) != "forced":
            return None
        tools = request.tool_dicts()
        if request.tool_mode == "named":
            name = request.tool_choice.function.name
            tools = [tool for tool in tools if tool["function"]["name"] == name]
        parallel = request.tool_mode == "required" and request.parallel_tool_calls is not False
        try:
            grammar = forced_grammar(
                self.parsers.names.tool_call, tools, parallel, self._lark_marker
            )
        except ValueError as error:  # two tools' $defs at odds
            raise InvalidParam(str(error), "tools") from None
        return StructuredOutputs(grammar=grammar)

    async def _answer(
        self, constraint: StructuredOutputs | None, param: str | None
    ) -> StructuredOutputs | None:
        """The request's own constraint as the reply's answer is written: in harmony's final
        channel when the replies are harmony's (checked first as the request gave it, so that
        an error names what the client wrote); a Lark grammar is the whole answer's."""
        answer = self.parsers.answer_constraint(constraint, self._lark_marker)
        if answer is not constraint:
            await self.check_constraint(constraint, param)
        return answer

    def hidden_specials(self, request: ChatCompletionRequest) -> tuple[str, ...] | None:
        """None: the reply is decoded as the request asks. Otherwise the request's parsers
        read markers that are special tokens of this tokenizer, which skip_special_tokens
        would remove before they are read: the reply is decoded with its special tokens, and
        these, the others, are removed from what the client sees (vLLM reads such markers as
        token ids)."""
        if not request.skip_special_tokens:
            return None
        mode = self.reading_mode(request)
        reasoning = mode in ("auto", "none", "forced")
        return self.parsers.hidden(self._specials, reasoning, mode in ("auto", "forced"))

    def reply_reader(self, request: ChatCompletionRequest, prompt: list[int]) -> ReplyReader:
        """How one reply is read into events, the same for every API."""
        return self.tool_reply(request, prompt).reader

    # ---- prompts -------------------------------------------------------------------------

    def completion_prompts(
        self,
        prompt,
        add_special_tokens: bool = True,
        truncate: int | None = None,
        fit: int | None = None,
        side: str = "left",
    ) -> list[list[int]]:
        """Token ids of each prompt; truncate (vLLM's truncate_prompt_tokens): keep only the
        last `truncate` tokens of each (-1: the last `fit`, what the context holds beside the
        output; by default all but one of its positions), or the first (side "right", vLLM's
        truncation_side)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [
                self.encode(p, add_special_tokens) if isinstance(p, str) else list(p)
                for p in prompt
            ]
        fit = fit if fit is not None else self.engine.max_model_len - 1
        return [truncated(p, truncate, fit, side) for p in prompts]

    def prompt_texts(self, prompt, prompts: list[list[int]], truncate: int | None) -> list[str]:
        """What echo sends back for each prompt: its own text, or its tokens decoded when it
        came as token ids or was truncated."""
        texts = [prompt] if isinstance(prompt, str) else prompt
        if truncate is None and all(isinstance(t, str) for t in texts):
            return list(texts)
        return [self.tokenizer.decode(p) for p in prompts]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise ValueError("prompt must not be empty")
        self.engine.inputs.check_text_length(len(text), "prompt")
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as error:  # e.g. a lone surrogate the tokenizer cannot encode
            raise ValueError(f"prompt could not be tokenized: {error}") from error

    def encode_pair(self, text_1: str, text_2: str) -> list[int]:
        """A text pair's token ids, joined as the tokenizer joins a pair (a cross-encoder's
        prompt: /score, /rerank); refused before tokenizing where it cannot fit, as encode."""
        if not text_1 or not text_2:
            raise ValueError("a text of a scored pair must not be empty")
        self.engine.inputs.check_texts({"text_1": len(text_1), "text_2": len(text_2)})
        try:
            return list(self.tokenizer(text_1, text_pair=text_2).input_ids)
        except Exception as error:  # e.g. a lone surrogate the tokenizer cannot encode
            raise ValueError(f"the pair could not be tokenized: {error}") from error

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice=None,
        options: ChatTemplateOptions | None = None,
    ) -> list[int]:
        """The prompt's token ids. With tools: the template's own tool prompt when it reads
        `tools`, otherwise a system message that describes them (tools.tools_prompt)."""
        options = options or ChatTemplateOptions()
        template = options.chat_template or self.tokenizer.chat_template
        if options.chat_template and not self.trust_request_chat_template:
            raise InvalidParam(
                "chat_template: this server renders only its model's own chat template "
                "(start it with --trust-request-chat-template to allow a request's own)",
                "chat_template",
            )
        if not template:
            raise ValueError("this model has no chat template; use /v1/completions")
        native = "tools" in template
        fmt = resolve_content_format(self.server_defaults.content_format, template)
        dicts = [message_dict(m, native, fmt) for m in messages]
        kwargs = options.template_kwargs()
        # Everything the request renders into the prompt is counted before the template or
        # the tokenizer sees any of it: too much text for the context is refused at once.
        inputs = self.engine.inputs
        texts = {options.messages_field: dicts, "tools": tools, "chat_template_kwargs": kwargs}
        texts["documents"] = options.documents
        inputs.check_texts(texts)
        if tools and not native:
            hint = tools_prompt(tools, tool_choice)
            if dicts[0].get("role") == "system":
                dicts[0]["content"] = with_text(dicts[0]["content"], hint, "\n\n")
            else:
                dicts.insert(0, {"role": "system", "content": hint})
        return inputs.chat_prompt(
            dicts,
            template,
            add_generation_prompt,
            options.continue_final_message,
            tools if tools and native else None,
            kwargs,
            options.messages_field,
            options.documents,
            options.add_special_tokens,
        )

    async def check_constraint(self, constraint: StructuredOutputs | None, param: str) -> None:
        """Checks the request's grammar in the sandbox (structured/sandbox.py; the verdict is
        cached for admission) without holding a tokenizer thread; a schema, regex or grammar
        that does not compile, crashes the compiler or runs past the limit is a 400 naming
        `param`, and so is any constraint when structured output is unavailable."""
        if constraint is None:
            return
        try:
            await self.engine.inputs.grammars.validate_async(constraint)
        except GrammarError as error:
            if param == "structured_outputs":  # name its field: structured_outputs.regex
                param = error.param
            raise InvalidParam(f"{param}: {error.detail}", param) from None

    # ---- submission ----------------------------------------------------------------------

    async def submit(
        self,
        prefix: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        model: str | None = None,
        request_id: str | None = None,
    ) -> list[RequestStream]:
        """All prompts are accepted, or none: a refused one aborts those before it. model:
        the request's `model`, which may name a LoRA adapter (resolved now, so that an unload
        waits for the submission; 404 if no adapter has that name any more). request_id: the
        client's own (vLLM's field), in the engine's ids. Beam search (params:
        BeamSearchParams): a BeamStream per prompt, whose steps are submitted here as ordinary
        requests when it is read."""
        if isinstance(params, BeamSearchParams):
            return self._beam_streams(prefix, prompts, params, priority, model, request_id)
        streams = []
        base = engine_id(prefix, request_id)
        using = self.loras.using(model) if self.loras is not None else nullcontext()
        request_ids = []
        try:
            with using as lora_request:
                for i, prompt in enumerate(prompts):
                    request_ids.append(base if len(prompts) == 1 else f"{base}-{i}")
                    stream = await self.engine.add_request(
                        request_ids[-1], prompt, params, priority, lora_request=lora_request
                    )
                    if self.request_logger is not None:
                        tokenizer = getattr(self.engine, "tokenizer", None)
                        self.request_logger.log(
                            request_ids[-1], prompt, params, lora_request, tokenizer
                        )
                        stream = self.request_logger.watch(stream)
                    streams.append(stream)
        except (ValueError, asyncio.CancelledError):
            # Refused, or its caller went away meanwhile (a beam search's step, cancelled with
            # its client): none of it runs on, the one being added included.
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        return streams

    def _beam_streams(
        self,
        prefix: str,
        prompts: list[list[int]],
        params: BeamSearchParams,
        priority: int,
        model: str | None,
        request_id: str | None,
    ) -> list[BeamStream]:
        async def step(batch: list[list[int]], step_params: SamplingParams) -> list:
            return await self.submit(
                f"{prefix}-beam", batch, step_params, priority, model, request_id
            )

        base = engine_id(prefix, request_id)
        return [
            BeamStream(
                base if len(prompts) == 1 else f"{base}-{i}",
                BeamSearch(self.tokenizer, [prompt], params),
                prompt,
                step,
                params.num_logprobs,
            )
            for i, prompt in enumerate(prompts)
        ]

    def submission(self, prefix: str, body, prompts: list[list[int]], params) -> Submission:
        """A validated request of any API as the engine runs it (body: its priority, model
        and stream fields, where it has them)."""
        priority = self.limits.clamp_priority(getattr(body, "priority", 0))
        model = getattr(body, "model", None)  # may name a LoRA adapter
        request_id = getattr(body, "request_id", None)
        return Submission(prefix, prompts, params, priority, model, bool(body.stream), request_id)

    def capped(self, max_tokens: int | None) -> int | None:
        """A request's max_tokens under the generation config's max_new_tokens, which bounds
        every request as in vLLM (None: up to the context)."""
        cap = self.defaults.get("max_tokens")
        if cap is None or (max_tokens is not None and max_tokens <= cap):
            return max_tokens
        return cap

    def reply_role(self, request: ChatCompletionRequest) -> str:
        """A chat reply's role, as vLLM's: --response-role where the request adds a
        generation prompt, else its last message's (the reply continues it)."""
        if request.add_generation_prompt:
            return self.response_role
        return request.messages[-1].role

    def served_name(self, model: str | None) -> str:
        """The `model` a response names, as vLLM's: the LoRA adapter the request named, else the
        served model's name."""
        if self.loras is not None and self.loras.get(model) is not None:
            return model
        return self.model_name

    def abort_unfinished(self, streams: list[RequestStream | BeamStream]) -> None:
        for stream in streams:
            for live in stream.live if isinstance(stream, BeamStream) else [stream]:
                if not live.finished:
                    self.engine.abort(live.request_id)

    # ---- /v1/completions -----------------------------------------------------------------

    async def completion_params(self, request: CompletionRequest) -> tuple[list, SamplingParams]:
        request.check_limits(self.limits)
        self.server_defaults.apply(request)
        max_tokens = self.capped(
            request.max_tokens if request.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        )
        if max_tokens == 0 and not request.echo and request.prompt_logprobs is None:
            raise InvalidParam(
                "max_tokens must be an integer >= 1 (0 only with echo or prompt_logprobs: the "
                "prompt alone is computed)",
                "max_tokens",
            )
        constraint, param = request.constraint()
        params = request.sampling_params(max_tokens, constraint, self.defaults)
        await self.check_constraint(constraint, param)
        if max_tokens == 0 and request.n > 1:  # one prompt-only computation serves all n
            params = params.clone(n=1)
        if request.thinking_token_budget is not None and not request.use_beam_search:
            params = self._with_reasoning(request, params, self._prompt_reasoning())
        prompts = await self.off_loop(
            self.completion_prompts,
            request.prompt,
            request.add_special_tokens,
            request.truncate_prompt_tokens,
            self.room_for_prompt(max_tokens),
            request.truncation_side,
        )
        if request.use_beam_search:  # its steps are requests for one token each: check now
            for prompt in prompts:
                self._check_room(len(prompt), max_tokens, "max_tokens")
            skip = request.skip_special_tokens
            beams = request.beam_params(self.limits, max_tokens, param, request.logprobs, skip)
            return prompts, beams
        return prompts, params

    def room_for_prompt(self, max_tokens: int | None) -> int:
        """The most prompt tokens the context holds beside max_tokens of output (None: at
        least one token), what truncate_prompt_tokens -1 keeps."""
        limit = self.engine.max_model_len
        return max(limit - (1 if max_tokens is None else max_tokens), 1)

    async def complete(self, request: CompletionRequest, prompts, streams) -> dict:
        choices = await self._choices(request, prompts, keep=True)
        whole = await choices.collect(streams)
        return {
            "id": reply_id("cmpl", request, streams),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_name(request.model),
            "choices": [self._completion_choice(request, choice) for choice in whole],
            "usage": openai_usage(choices.usage()),
        } | self._timings(request, choices)

    def _completion_choice(self, request: CompletionRequest, choice: Choice) -> dict:
        state = choice.prompt
        echo = state if request.echo else None
        body = {
            "index": choice.index,
            "text": (state.text if echo else "") + choice.text,
            "logprobs": self._completion_logprobs(
                choice.logprobs, echo, request.logprobs, request.return_tokens_as_token_ids
            )
            if request.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        return body | self._prompt_extras(request, state, choice.token_ids, with_prompt=True)

    def _prompt_extras(
        self, request, state: PromptState, token_ids: list[int], with_prompt: bool
    ) -> dict:
        """vLLM's prompt_logprobs, prompt_token_ids and token_ids fields of a completion
        choice (with_prompt: the prompt's too)."""
        extras = self._prompt_fields(request, state) if with_prompt else {}
        return extras | ({"token_ids": token_ids} if request.return_token_ids else {})

    def _prompt_fields(self, request, state: PromptState) -> dict:
        """vLLM's prompt_logprobs, prompt_token_ids and prompt_text, where the request asks
        for them (a chat completion's at its top level, a completion's in each choice)."""
        extras = {}
        if request.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self._vllm_prompt_logprobs(
                state.logprobs, request.prompt_logprobs
            )
        if request.return_token_ids:
            extras["prompt_token_ids"] = state.token_ids
        if getattr(request, "return_prompt_text", None):  # chat's: the rendered template
            extras["prompt_text"] = self.tokenizer.decode(state.token_ids)
        return extras

    def _timings(self, request, choices) -> dict:
        """vLLM's per-request metrics (--enable-per-request-metrics) of a finished reply of one
        choice, as {"metrics": ...} ({} otherwise: n or several prompts have no one timing)."""
        if not self.server_defaults.per_request_metrics or len(choices.choices) != 1:
            return {}
        tokens = choices.usage().num_output_tokens
        return {"metrics": timing_metrics(choices.prompts[0].metrics, tokens)}

    def _writer(
        self, request, streams: list[RequestStream], prefix: str, kind: str
    ) -> _ChunkWriter:
        """The SSE chunk writer of a streamed answer whose chunks are objects of `kind`."""
        head = {"id": reply_id(prefix, request, streams), "object": kind}
        head["created"] = int(time.time())
        return _ChunkWriter(head | {"model": self.served_name(request.model)})

    async def complete_stream(
        self, request: CompletionRequest, prompts, streams
    ) -> AsyncIterator[str]:
        chunk = self._writer(request, streams, "cmpl", "text_completion")
        choices = await self._choices(request, prompts)
        continuous = _continuous_usage(request)
        async for step in choices.steps(streams):
            body = self._completion_piece(request, step.choice, step.output)
            if body is not None:
                yield chunk(body, openai_usage(choices.usage()) if continuous else None)
        if request.stream_options and request.stream_options.include_usage:
            yield chunk.usage(openai_usage(choices.usage()), self._timings(request, choices))
        yield DONE

    def _completion_piece(
        self, request: CompletionRequest, choice: Choice, delta: CompletionOutput
    ) -> dict | None:
        """One streamed piece of a completion choice (None: nothing to send); its first
        carries the echo and the prompt's fields."""
        first = choice.num_steps == 1
        state = choice.prompt
        echo = state if request.echo and first else None
        logprobs = None
        if request.logprobs is not None and (delta.logprobs or echo):
            entries = list(zip(delta.token_ids, delta.logprobs or [], strict=True))
            logprobs = self._completion_logprobs(
                entries, echo, request.logprobs, request.return_tokens_as_token_ids
            )
        text = (state.text if echo else "") + delta.text
        ids = request.return_token_ids and delta.token_ids  # tokens whose text is held back
        if not text and delta.finish_reason is None and not logprobs and not first and not ids:
            return None
        body = {"index": choice.index, "text": text, "logprobs": logprobs}
        body |= {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        return body | self._prompt_extras(request, state, delta.token_ids, with_prompt=first)

    async def _choices(
        self,
        request,
        prompts: list[list[int]],
        keep: bool = False,
        readers: Callable[[int], ReplyReader] | None = None,
    ) -> Choices:
        """The request's choices on the shared pipeline; a completion's prompts carry their
        text for echo."""
        states = [PromptState(list(p)) for p in prompts]
        if isinstance(request, CompletionRequest) and request.echo:
            truncate = request.truncate_prompt_tokens
            texts = await self.off_loop(self.prompt_texts, request.prompt, prompts, truncate)
            for state, text in zip(states, texts, strict=True):
                state.text = text
        copies = _copies(request) if isinstance(request, CompletionRequest) else 1
        return Choices(states, request.n // copies, copies, readers, keep)

    # ---- /v1/chat/completions ------------------------------------------------------------

    async def chat_params(self, request: ChatCompletionRequest) -> tuple[list, SamplingParams]:
        request.check_limits(self.limits)
        self.server_defaults.apply(request)
        max_tokens = self.capped(request.max_completion_tokens or request.max_tokens)
        constraint, param = request.constraint()
        constraint = self.forced_constraint(request) or await self._answer(constraint, param)
        params = request.sampling_params(max_tokens, constraint, self.defaults)
        await self.check_constraint(constraint, param)
        prompt = await self.off_loop(
            self.chat_prompt,
            request.messages,
            request.add_generation_prompt,
            self.server_defaults.rendered_tools(request),
            request.tool_choice,
            ChatTemplateOptions.of(request),
        )
        fit = self.room_for_prompt(max_tokens)
        prompt = truncated(prompt, request.truncate_prompt_tokens, fit, request.truncation_side)
        limited = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        self._check_room(len(prompt), max_tokens, request.field_name(limited))
        if self.hidden_specials(request) is not None:  # the parsers must see their markers
            params = params.clone(skip_special_tokens=False)
        if request.use_beam_search:
            room = max_tokens if max_tokens is not None else self.engine.max_model_len - len(prompt)
            forced = "tool_choice" if request.tool_mode in ("required", "named") else None
            top = (request.top_logprobs or 0) if request.logprobs else None
            skip = params.skip_special_tokens  # off where the parsers read special markers
            return [prompt], request.beam_params(self.limits, room, forced or param, top, skip)
        bounds = self.reply_reader(request, prompt).reasoning_bounds()
        return [prompt], self._with_reasoning(request, params, bounds)

    def _with_reasoning(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        params: SamplingParams,
        bounds: ReasoningBounds | None,
    ) -> SamplingParams:
        """params with the reply's reasoning bounds, when it has reasoning this server reads:
        stop strings then end the answer, not the reasoning, and the engine core finds its
        markers by their token ids to bound it (thinking_token_budget) and to start a grammar
        after it."""
        budget = request.thinking_token_budget
        if bounds is None:
            if budget is not None and not request.budget_is_hint:
                name = request.field_name("thinking_token_budget")
                raise InvalidParam(
                    f"{name}: this request's reply has no reasoning that this server reads "
                    "(start it with --reasoning-parser; a forced tool call has none)",
                    name,
                )
            return params
        return params.clone(reasoning=tokenized(bounds, self.tokenizer, budget))

    def _prompt_reasoning(self) -> ReasoningBounds | None:
        """A completion's reasoning bounds: the server's reasoning, open where the prompt's
        own tokens opened it (the client wrote the prompt: no template says)."""
        reasoning = self.parsers.for_request(None, self.limits.max_json_depth).reasoning
        if reasoning is None:
            return None
        return replace(reasoning.bounds(), opened=None)

    def _check_room(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        """A prompt and max_tokens beyond the context, refused naming the request's own field
        (the engine refuses it as well, in its own words)."""
        limit = self.engine.max_model_len
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise InvalidParam(
                f"{param}: prompt ({num_prompt} tokens) plus {param} ({max_tokens}) is "
                f"{num_prompt + max_tokens} tokens, beyond the model's context length {limit}",
                param,
            )

    async def chat(self, request: ChatCompletionRequest, prompts, streams) -> dict:
        choices = await self._choices(request, prompts, keep=True)
        whole = await choices.collect(streams)
        replies = [
            self.tool_reply(request, prompts[0]).message(c.text, c.finish_reason) for c in whole
        ]
        echoed = _chat_echo(request)
        role = {"role": self.reply_role(request)}
        body = {
            "id": reply_id("chatcmpl", request, streams),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_name(request.model),
            "choices": [
                {
                    "index": c.index,
                    "message": _echoed(message | role, echoed),
                    "logprobs": self._chat_logprobs(
                        c.logprobs,
                        request.top_logprobs or 0,
                        request.return_tokens_as_token_ids,
                        request.logprob_token_ids is not None,
                    )
                    if request.logprobs
                    else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                | ({"token_ids": c.token_ids} if request.return_token_ids else {})
                for c, (message, finish_reason) in zip(whole, replies, strict=True)
            ],
            "usage": openai_usage(choices.usage()),
        }
        return (
            body
            | self._prompt_fields(request, choices.prompts[0])
            | self._timings(request, choices)
        )

    async def chat_stream(
        self, request: ChatCompletionRequest, prompts, streams
    ) -> AsyncIterator[str]:
        chunk = self._writer(request, streams, "chatcmpl", "chat.completion.chunk")
        echoed = _chat_echo(request)
        for index in range(request.n):
            delta = {"role": self.reply_role(request), "content": echoed or ""}
            yield chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
        replies = [self.tool_reply(request, prompts[0]) for _ in range(request.n)]
        choices = await self._choices(request, prompts, readers=lambda i: replies[i].reader)
        continuous = _continuous_usage(request)
        extras = None  # the prompt's fields go with the first chunk after the role's
        async for step in choices.steps(streams):
            for body in self._chat_pieces(request, replies[step.choice.index], choices, step):
                usage = openai_usage(choices.usage()) if continuous else None
                if extras is None:
                    extras = self._prompt_fields(request, choices.prompts[0])
                    yield chunk(body, usage, extras)
                else:
                    yield chunk(body, usage)
        if request.stream_options and request.stream_options.include_usage:
            yield chunk.usage(openai_usage(choices.usage()), self._timings(request, choices))
        yield DONE

    def _chat_pieces(
        self, request: ChatCompletionRequest, reply: _ToolReply, choices: Choices, step: Step
    ) -> list[dict]:
        """The chunks' choice bodies for one step; token ids (return_token_ids) go with the
        next body sent, so none is lost with text a parser holds back."""
        delta = step.output
        reply.token_ids += delta.token_ids
        entries = []
        if request.logprobs and delta.logprobs:
            entries = list(zip(delta.token_ids, delta.logprobs, strict=True))
        finish = choices.finish(step.choice).reason if delta.finish_reason is not None else None
        bodies = []
        for content, held, ended in reply.feed(step.events, entries, finish):
            as_ids = request.return_tokens_as_token_ids
            named = request.logprob_token_ids is not None
            logprobs = (
                self._chat_logprobs(held, request.top_logprobs or 0, as_ids, named)
                if held
                else None
            )
            body = {"index": step.choice.index, "delta": content, "logprobs": logprobs}
            bodies.append(body | {"finish_reason": ended})
        if request.return_token_ids and bodies:
            bodies[-1]["token_ids"], reply.token_ids = reply.token_ids, []
        return bodies

    def _token_text(self, token_id: int, logprob, as_id: bool = False) -> str:
        """A token as logprobs name it: its text, or (vLLM's return_tokens_as_token_ids)
        "token_id:N", which names a token whose text is not valid UTF-8 on its own."""
        if as_id:
            return f"token_id:{token_id}"
        return (
            logprob.decoded_token
            if logprob.decoded_token is not None
            else self.tokenizer.decode([token_id])
        )

    def _completion_logprobs(
        self,
        entries: list[tuple[int, PositionLogprobs]],
        echo: PromptState | None = None,
        num_top: int = 0,
        as_ids: bool = False,
    ) -> dict:
        """OpenAI's legacy logprobs; echo: the prompt's tokens first (the first without a
        logprob, as in OpenAI's and vLLM's echo), each with its top num_top."""
        tokens, token_logprobs, top = [], [], []
        if echo is not None:
            tokens, token_logprobs, top = self._echoed_logprobs(echo, num_top, as_ids)
        for token_id, position in entries:
            tokens.append(self._token_text(token_id, position[token_id], as_ids))
            token_logprobs.append(position[token_id].logprob)
            top.append({self._token_text(t, lp, as_ids): lp.logprob for t, lp in position.items()})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": _offsets(tokens),
        }

    def _echoed_logprobs(
        self, state: PromptState, num_top: int, as_ids: bool = False
    ) -> tuple[list, list, list]:
        positions = state.logprobs or [None] * len(state.token_ids)
        tokens, values, top = [], [], []
        for token_id, position in zip(state.token_ids, positions, strict=True):
            if position is None:  # the first token: nothing before it to predict it
                tokens.append(
                    f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])
                )
                values.append(None)
                top.append(None)
                continue
            tokens.append(self._token_text(token_id, position[token_id], as_ids))
            values.append(position[token_id].logprob)
            ranked = sorted(position.items(), key=lambda item: item[1].rank)
            kept = [(t, lp) for t, lp in ranked if lp.rank <= num_top or t == token_id]
            top.append({self._token_text(t, lp, as_ids): lp.logprob for t, lp in kept})
        return tokens, values, top

    def _vllm_prompt_logprobs(self, positions, num_top: int) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} with the prompt token and the top num_top."""
        if positions is None:
            return None
        out = []
        for position in positions:
            if position is None:
                out.append(None)
                continue
            out.append(
                {
                    str(t): {
                        "logprob": lp.logprob,
                        "rank": lp.rank,
                        "decoded_token": self._token_text(t, lp),
                    }
                    for t, lp in position.items()
                }
            )
        return out

    def _chat_logprobs(
        self,
        entries: list[tuple[int, PositionLogprobs]],
        num_top: int,
        as_ids: bool = False,
        named: bool = False,
    ) -> dict:
        """OpenAI's chat logprobs: each token's, with its top num_top; named (vLLM's
        logprob_token_ids): every entry instead, the sampled token's first, as vLLM shows them."""
        content = []
        for token_id, position in entries:
            text = self._token_text(token_id, position[token_id], as_ids)
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:num_top]
            if named:
                ranked = list(position.items())
            content.append(
                {
                    "token": text,
                    "logprob": position[token_id].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": self._token_text(t, lp, as_ids),
                            "logprob": lp.logprob,
                            "bytes": list(self._token_text(t, lp, as_ids).encode()),
                        }
                        for t, lp in ranked
                    ],
                }
            )
        return {"content": content}


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """vLLM's chat-template fields of a request."""

    continue_final_message: bool = False
    chat_template: str | None = None
    kwargs: dict | None = None
    reasoning_effort: str | None = None
    messages_field: str = "messages"  # what errors call the messages (chat_request.names)
    documents: list[dict] | None = None
    add_special_tokens: bool = False

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> ChatTemplateOptions:
        return cls(
            request.continue_final_message,
            request.chat_template,
            request.chat_template_kwargs,
            request.reasoning_effort,
            request.field_name("messages"),
            request.documents,
            request.add_special_tokens,
        )

    def template_kwargs(self) -> dict:
        kwargs = dict(self.kwargs or {})
        reserved = sorted(reserved_template_variables() & kwargs.keys())
        if reserved:
            raise InvalidParam(
                f"chat_template_kwargs: {listed(reserved)} cannot be set here: the request's "
                "own fields set them, or they are parameters of the template's caller or of "
                "the tokenizer, not template variables",
                "chat_template_kwargs",
            )
        effort = self.reasoning_effort
        if effort is not None:
            if kwargs.get("reasoning_effort", effort) != effort:
                raise InvalidParam(
                    "reasoning_effort and chat_template_kwargs.reasoning_effort disagree",
                    "reasoning_effort",
                )
            kwargs["reasoning_effort"] = effort
        return kwargs


def engine_id(prefix: str, request_id: str | None) -> str:
    """The engine's id of a request (its prompts' ids add "-<i>"): the client's request_id,
    where it gave one, then a suffix that keeps two requests of the same id apart (a retry of
    one still running, say); else a new uuid."""
    if request_id is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    return f"{prefix}-{request_id}-{uuid.uuid4().hex[:8]}"


def reply_id(prefix: str, request, streams: list) -> str:
    """A response's id: "<prefix>-<request_id>" where the client named its request (vLLM's),
    else the engine's id of its first prompt."""
    if request.request_id is not None:
        return f"{prefix}-{request.request_id}"
    return streams[0].request_id


def truncated(prompt: list[int], keep: int | None, fit: int, side: str = "left") -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens; -1: the last `fit`,
    as many as the context holds beside the output (all of it for a prompt-only request).
    side "right" (vLLM's truncation_side) keeps the first ones instead."""
    if keep is None:
        return prompt
    if keep == 0:
        raise InvalidParam(
            "truncate_prompt_tokens must be -1 (what the context holds) or >= 1",
            "truncate_prompt_tokens",
        )
    keep = fit if keep == -1 else keep
    if len(prompt) <= keep:
        return prompt
    return prompt[:keep] if side == "right" else prompt[-keep:]


class _ToolReply:
    """One choice's reply as the chat API shows it: the events of pipeline.ReplyReader (the
    same reading as every API's) rendered as chat's message (whole) or deltas (streamed).
    A call's start and the arguments that came with it are one delta; arguments that come
    later are deltas of their own. Logprobs are held until a chunk goes out, so none is lost
    with text a parser holds back. Reading a reply is linear in its length, and a stream
    reads each delta once."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        max_depth: int = MAX_DEPTH,
        parser: ReplyParser | None = None,
        hidden: tuple[str, ...] = (),
        mode: str | None = None,
    ) -> None:
        mode = mode or request.tool_mode
        name = request.tool_choice.function.name if mode == "named" else None
        if parser is None and mode in ("auto", "none"):
            tools = _declared(request) if mode == "auto" else None
            parser = Parsers(ParserNames()).for_request(tools, max_depth)
        self.reader = ReplyReader(mode, parser, name, max_depth, hidden)
        self.include_reasoning = request.include_reasoning
        self.held: list = []
        self.token_ids: list[int] = []  # streamed, not sent yet (return_token_ids)

    def parsed(self, text: str) -> Parsed:
        """The whole reply's reasoning, content and calls; content None for a forced call."""
        return self.reader.parse(text)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the whole reply."""
        parsed = self.parsed(text)
        return parsed.content, [ToolCall(name, arguments) for name, arguments in parsed.calls]

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        parsed = self.parsed(text)
        content = parsed.content
        plain = (
            parsed.reasoning is None and not parsed.calls and self.reader.mode in ("auto", "none")
        )
        if content is None and plain:
            content = ""  # an empty reply (a stop at once), as vLLM and OpenAI write it
        message: dict = {"role": "assistant", "content": content}
        if parsed.reasoning is not None and self.include_reasoning:
            message |= {"reasoning": parsed.reasoning, "reasoning_content": parsed.reasoning}
        if not parsed.calls:
            return message, finish
        calls = [ToolCall(name, arguments).to_openai() for name, arguments in parsed.calls]
        return message | {"tool_calls": calls}, finish_reason(finish, True)

    def feed(self, events: list[Event], logprobs: list, finish: str | None) -> list[tuple]:
        """(delta, logprob entries, finish_reason) chunks for one step's events, read by this
        reply's reader (finish: the choice's finish reason, once it has finished)."""
        deltas = chat_deltas(events, self.include_reasoning)
        self.held += logprobs
        if finish is not None:
            if not deltas or "tool_calls" in deltas[-1]:
                deltas.append({})  # a call's chunk is the call alone
        elif not deltas:
            return []  # logprobs, if any, go with the next chunk
        chunks = [(d, [], None) for d in deltas]
        held, self.held = self.held, []
        chunks[-1] = (deltas[-1], held, finish)
        return chunks


def chat_deltas(events: list[Event], include_reasoning: bool = True) -> list[dict]:
    """Chat's deltas for a reply's events: a call's start opens one with its id and name, and
    the arguments that follow in the same events join it."""
    deltas: list[dict] = []
    for event in events:
        if isinstance(event, ReasoningDelta) and include_reasoning:
            deltas.append({"reasoning": event.text, "reasoning_content": event.text})
        elif isinstance(event, ContentDelta):
            deltas.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            deltas.append({"tool_calls": [ToolCall(event.name, "").to_openai(event.index)]})
        elif isinstance(event, ToolArgsDelta):
            last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
            if last is not None and last["index"] == event.index:
                last["function"]["arguments"] += event.text
            else:
                function = {"arguments": event.text}
                deltas.append({"tool_calls": [{"index": event.index, "function": function}]})
    return deltas


def _declared(request: ChatCompletionRequest) -> dict[str, dict]:
    """Each declared function's parameters schema, by name."""
    return {tool.function.name: tool.function.parameters or {} for tool in request.tools or []}


def openai_usage(usage: Usage) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompts' prefix-cache hits."""
    return {
        "prompt_tokens": usage.num_prompt_tokens,
        "completion_tokens": usage.num_output_tokens,
        "total_tokens": usage.num_prompt_tokens + usage.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.num_cached_tokens},
    }


def _copies(request: CompletionRequest) -> int:
    """How many choices each completion the engine makes is sent as: a prompt-only request
    (max_tokens 0: echo, prompt logprobs) is computed once for all n choices, each the same,
    as vLLM sends them."""
    return request.n if request.max_tokens == 0 else 1


def _continuous_usage(request) -> bool:
    options = request.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def _chat_echo(request: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the last message's text, when it is the assistant's."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return None
    return last.text() or ""


def _echoed(message: dict, echoed: str | None) -> dict:
    if echoed is None:
        return message
    return message | {"content": echoed + (message.get("content") or "")}


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _ChunkWriter:
    """SSE chunks of one stream: the fields every chunk repeats (id, object, created, model)
    are encoded once, so a token costs the encoding of its own choice only."""

    def __init__(self, head: dict) -> None:
        self._head = _json(head)[:-1] + ',"choices":['

    def __call__(self, choice: dict, usage: dict | None = None, extras: dict | None = None) -> str:
        """extras: fields beside choices (vLLM's prompt_token_ids, prompt_logprobs)."""
        tail = f',"usage":{_json(usage)}' if usage is not None else ""
        return frame(f"{self._head}{_json(choice)}]{_fields(extras)}{tail}}}")

    def usage(self, usage: dict, extras: dict | None = None) -> str:
        """The usage chunk; extras: fields beside it (vLLM's per-request metrics)."""
        return frame(f'{self._head}],"usage":{_json(usage)}{_fields(extras)}}}')


def _fields(extras: dict | None) -> str:
    """extras as the JSON of fields to append to an object: `,"key":value` each."""
    return "".join(f",{_json(k)}:{_json(v)}" for k, v in (extras or {}).items())
