"""The Responses API's serving: a request becomes the chat request that runs it (responses.py),
its outputs become output items and typed stream events (output.py), and its
response goes to the store (store.py). Responses still running are kept apart, so
that GET can show one in progress and cancel can end one.

Status: completed; incomplete (reason max_output_tokens) when the reply was cut by
max_output_tokens or the context; cancelled when POST .../cancel ended it; failed when the
server ended it (shutting down), or when a streamed one's request failed (an `error` event,
then response.failed; not streamed, such a failure is the route's 4xx or 5xx). A cancelled
stream ends with response.incomplete (the Responses stream has no event of its own for it)
whose response says "cancelled".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from conveyor.engine.streams import RequestStream, aborted_output
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, InvalidParam
from conveyor.entrypoints.openai.responses.output import OutputBuilder
from conveyor.entrypoints.openai.responses.protocol import (
    ResponsesRequest,
    dumps,
    new_id,
    parse_items,
    stored_item,
)
from conveyor.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from conveyor.entrypoints.openai.serving import OpenAIServing
from conveyor.entrypoints.pipeline import Finish, Tally, generate
from conveyor.entrypoints.runner import Answer, Failure, frame
from conveyor.sampling_params import SamplingParams

CANCEL_WAIT = 5.0  # seconds a cancel waits for its response's last output before answering
_TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


class _Numbered:
    """Stream events as server-sent events, numbered from 0 (their sequence_number)."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, event: dict) -> str:
        kind = event.pop("type")
        data = dumps({"type": kind, "sequence_number": self.number} | event)
        self.number += 1
        return frame(data, kind)


class ResponseNotFound(LookupError):
    def __init__(self, response_id: str, param: str | None = None) -> None:
        super().__init__(f"no response with id {response_id!r} (never made, not stored, or gone)")
        self.param = param


@dataclass(slots=True, eq=False)
class Turn:
    """One response while it runs: its request, the chat request that runs it, and what
    it has made so far."""

    id: str
    model: str
    request: ResponsesRequest
    chat: ChatCompletionRequest
    prompt: list[int]
    params: SamplingParams
    conversation: list[dict]  # earlier turns' items, then this request's own (store form)
    num_own: int
    output: OutputBuilder
    created_at: int = field(default_factory=lambda: int(time.time()))
    streams: list[RequestStream] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    cancelled: bool = False
    keep: bool = True  # store when done: request.store, unless deleted while running
    done: asyncio.Future | None = None  # its final response

    def response(self, status: str = "in_progress", **end) -> dict:
        """The response object; `end` (usage, incomplete_details, error, completed_at) once
        it has finished."""
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": end.get("error"),
            "incomplete_details": end.get("incomplete_details"),
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": self.output.current() if status == "in_progress" else self.output.items,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": None,
            "store": r.store,
            "temperature": self.params.temperature,  # the request's, else the model's default
            "text": r.text_echo(),
            "tool_choice": r.tool_choice_echo(),
            "tools": [tool.model_dump(exclude_none=True) for tool in r.tools or []],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": end.get("usage"),
            "user": r.user,
            "metadata": r.metadata or {},
            "completed_at": end.get("completed_at"),
        }

    def final(self, finish: str | None) -> tuple[dict, list[dict]]:
        """(the finished response, the events that close its output) for the chat finish
        reason the reply ended with."""
        end: dict = {"usage": self.usage()}
        if finish == "length":
            status = "incomplete"
            end["incomplete_details"] = {"reason": "max_output_tokens"}
        elif finish == "abort" or finish is None:
            status = "cancelled" if self.cancelled else "failed"
            if status == "failed":
                message = "the server ended this response before it finished (shutting down)"
                end["error"] = {"code": "server_error", "message": message}
        else:
            status = "completed"
        if status == "completed":
            end["completed_at"] = int(time.time())
        events = self.output.finish("completed" if status == "completed" else "incomplete")
        return self.response(status, **end), events

    def usage(self) -> dict:
        usage = self.tally.usage(len(self.prompt))
        return {
            "input_tokens": usage.num_prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": usage.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.num_prompt_tokens + usage.num_output_tokens,
        }

    def cancel(self, engine) -> None:
        """Ends the response: its request is aborted and its stream told so (an abort by
        itself ends a request whose client went away, and tells its stream nothing)."""
        self.cancelled = True
        for stream in self.streams:
            if not stream.finished:
                engine.abort(stream.request_id)
                stream.put_local(aborted_output(stream.request_id))


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        self.running: dict[str, Turn] = {}

    # ---- creating ------------------------------------------------------------------------

    async def prepare(self, request: ResponsesRequest) -> Turn:
        """The turn of a request, its prompt and params made: ValueError (a 400) for a field
        refused, ResponseNotFound for a previous_response_id not in the store."""
        request.check(self.serving.limits)
        history = self._history(request.previous_response_id)
        own = request.input
        # The store keeps what a response echoes as well as what its prompt renders: an item's
        # id and annotations, tools a tool_choice "none" leaves out of the prompt. Bounded
        # together as a prompt's text is, so no turn stores more than its context could hold.
        given = [item.model_dump(exclude_none=True) for item in own]
        self.serving.engine.inputs.check_texts({"input": given} | request.echoed())
        chat = request.chat_request(parse_items(history) + own, first=len(history))
        prompts, params = await self.serving.chat_params(chat)
        return Turn(
            id=new_id("resp"),
            model=self.serving.served_name(request.model),
            request=request,
            chat=chat,
            prompt=prompts[0],
            params=params,
            conversation=history + [stored_item(item) for item in own],
            num_own=len(own),
            output=OutputBuilder(chat.tool_mode in ("none", "auto"), chat.include_reasoning),
            keep=request.store,
        )

    def _history(self, response_id: str | None) -> list[dict]:
        """The items of the conversation up to and including response_id's output."""
        if response_id is None:
            return []
        entry = self.store.get(response_id)
        if entry is None:
            if response_id in self.running:
                raise InvalidParam(
                    f"previous_response_id: response {response_id!r} is still in progress",
                    "previous_response_id",
                )
            raise ResponseNotFound(response_id, "previous_response_id")
        # Earlier turns' reasoning is not read again, as chat templates drop it.
        output = [item for item in entry.response["output"] if item["type"] != "reasoning"]
        return entry.conversation + output

    def answer(self, turn: Turn) -> Callable[[list[RequestStream]], Answer]:
        """The response to a turn, once its stream is submitted: whole, or its stream events
        numbered from 0. A request that fails once the stream has begun ends it as the
        Responses API's streams end: an `error` event, then `response.failed` (code
        invalid_prompt when the request's own constraint could not be followed, else
        server_error), and the response is retrievable as failed."""
        write = _Numbered()

        def failed(failure: Failure) -> str:
            code = "invalid_prompt" if failure.status == 400 else "server_error"
            error = {"code": code, "message": failure.message}
            final = turn.response("failed", usage=turn.usage(), error=error)
            self._keep(turn, final)  # _events has settled turn.done
            closing = write({"type": "error", "param": None} | error)
            return closing + write({"type": "response.failed", "response": final})

        def answer(streams: list[RequestStream]) -> Answer:
            return Answer(
                lambda: self.respond(turn, streams),
                lambda: (write(event) async for event in self._events(turn, streams)),
                failed,
            )

        return answer

    async def respond(self, turn: Turn, streams: list[RequestStream]) -> dict:
        """The whole response (a non-streamed request)."""
        final = None
        async for event in self._events(turn, streams):
            final = event.get("response", final)
        return final

    async def _events(self, turn: Turn, streams: list[RequestStream]) -> AsyncIterator[dict]:
        turn.streams, turn.done = streams, asyncio.get_running_loop().create_future()
        self.running[turn.id] = turn
        try:
            yield {"type": "response.created", "response": turn.response()}
            yield {"type": "response.in_progress", "response": turn.response()}
            reader = self.serving.reply_reader(turn.chat, turn.prompt)
            finish = None
            async for event in generate(streams[0], reader, turn.prompt, turn.tally):
                if isinstance(event, Finish):
                    finish = event.reason
                    continue
                for item_event in turn.output.feed(event):
                    yield item_event
            final, closing = turn.final(finish)
            for event in closing:
                yield event
            self._finished(turn, final)
            yield {"type": _TERMINAL[final["status"]], "response": final}
        finally:
            self.running.pop(turn.id, None)
            if not turn.done.done():  # ended early: the client went away, or an error
                turn.done.set_result(turn.response("cancelled" if turn.cancelled else "failed"))

    def _finished(self, turn: Turn, final: dict) -> None:
        self._keep(turn, final)
        turn.done.set_result(final)

    def _keep(self, turn: Turn, final: dict) -> None:
        """Stores the finished response, unless the request said store: false."""
        if turn.keep:
            self.store.put(StoredResponse(final, turn.conversation, turn.num_own))

    # ---- retrieve, delete, cancel, input items ---------------------------------------------

    def retrieve(self, response_id: str) -> dict:
        turn = self.running.get(response_id)
        if turn is not None and turn.keep:
            return turn.response()
        entry = self.store.get(response_id)
        if entry is None:
            raise ResponseNotFound(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict:
        turn = self.running.get(response_id)
        found = self.store.delete(response_id)
        if turn is not None and turn.keep:
            turn.keep, found = False, True
        if not found:
            raise ResponseNotFound(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        turn = self.running.get(response_id)
        if turn is None:
            entry = self.store.get(response_id)
            if entry is None:
                raise ResponseNotFound(response_id)
            raise ValueError(f"Cannot cancel a {entry.response['status']} response.")
        turn.cancel(self.serving.engine)
        try:
            return await asyncio.wait_for(asyncio.shield(turn.done), CANCEL_WAIT)
        except TimeoutError:  # its stream's reader is slow: what it has so far
            return turn.response("cancelled")

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict:
        """This response's own input items (not the earlier turns'), newest first unless
        order is "asc", after the item `after` when given."""
        entry = self.store.get(response_id)
        if entry is None:
            raise ResponseNotFound(response_id)
        items = entry.own_items if order == "asc" else entry.own_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ValueError(f"after: no input item {after!r} in response {response_id!r}")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
