"""AsyncLLM: the engine for an asyncio program, as vLLM's AsyncLLM (its AsyncLLMEngine).

    engine = AsyncLLM.from_engine_args(EngineArgs(model="..."))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)   # the text so far (vLLM's default, cumulative)

The engine runs on its own thread (engine/async_engine.py: AsyncEngine, the server's engine
client without an engine-core process) or, with engine_process=True, in a child process
behind it; the event loop never waits for a step. Each output is handed over as the step that
made it ends: cumulative (all text and tokens so far, vLLM's default), or only what is new
(OutputKind.DELTA), or once at the end (OutputKind.FINAL_ONLY).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.streams import RequestStream, aborted_output
from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.llm import prompt_of
from conveyor.lora.request import LoRARequest
from conveyor.outputs import CompletionOutput, OutputKind, RequestOutput
from conveyor.sampling_params import SamplingParams


class AsyncLLM:
    """vLLM's AsyncLLM: generate() per request, as an async iterator of RequestOutputs."""

    def __init__(self, model: str | EngineArgs | None = None, **settings) -> None:
        """The engine LLM(model, **settings) would build, started on its own thread."""
        self.engine = AsyncEngine(lambda: LLMEngine(model, **settings))
        self._streams: dict[str, RequestStream] = {}  # the running requests' own

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_vllm_options) -> AsyncLLM:
        """vLLM's constructor (its usage_context and similar options change nothing here)."""
        return cls(engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self.engine.is_alive

    @property
    def errored(self) -> bool:
        return self.engine.error is not None

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its steps end (output_kind: OutputKind.CUMULATIVE, all so
        far, vLLM's default; DELTA, what each step added; FINAL_ONLY, the whole output once).
        prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}. A request
        id already running, or a request the engine refuses, is a ValueError; a caller that
        stops iterating (or is cancelled) aborts the request, its KV cache freed."""
        if not isinstance(output_kind, OutputKind):
            raise ValueError(f"output_kind must be an OutputKind, got {output_kind!r}")
        params = sampling_params or self.get_default_sampling_params()
        stream = await self.engine.add_request(
            request_id, prompt_of(prompt), params, priority, lora_request=lora_request
        )
        self._streams[request_id] = stream
        so_far: dict[int, CompletionOutput] = {}
        try:
            async for out in stream:
                if output_kind == OutputKind.DELTA:
                    yield out
                    continue
                for delta in out.outputs:
                    so_far[delta.index] = _joined(so_far.get(delta.index), delta)
                if output_kind == OutputKind.FINAL_ONLY and not out.finished:
                    continue
                yield replace(out, outputs=[_copied(so_far[i]) for i in sorted(so_far)])
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self.engine.abort(request_id)

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation config's sampling (as LLM.get_default_sampling_params)."""
        return SamplingParams(**self.engine.default_sampling)

    async def abort(self, request_id: str | list[str]) -> None:
        """vLLM's: ends the request(s) now, each stream with finish_reason "abort"."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(one)
            stream = self._streams.get(one)
            if stream is not None and not stream.finished:
                stream.put(aborted_output(one))  # its last output (from any thread)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the engine thread (and its engine-core process, if any)."""
        self.engine.shutdown()
        core = getattr(self.engine.engine, "shutdown", None)
        if core is not None:
            core()


AsyncLLMEngine = AsyncLLM  # vLLM's older name


def _copied(output: CompletionOutput) -> CompletionOutput:
    """A cumulative output as handed over: its lists the caller's own (later steps extend the
    engine's)."""
    logprobs = None if output.logprobs is None else list(output.logprobs)
    return replace(output, token_ids=list(output.token_ids), logprobs=logprobs)


def _joined(so_far: CompletionOutput | None, delta: CompletionOutput) -> CompletionOutput:
    """A completion's cumulative output after its next delta."""
    if so_far is None:
        logprobs = None if delta.logprobs is None else list(delta.logprobs)
        return replace(delta, token_ids=list(delta.token_ids), logprobs=logprobs)
    so_far.text += delta.text
    so_far.token_ids.extend(delta.token_ids)
    if so_far.logprobs is not None and delta.logprobs is not None:
        so_far.logprobs.extend(delta.logprobs)
    so_far.cumulative_logprob = delta.cumulative_logprob
    so_far.finish_reason, so_far.stop_reason = delta.finish_reason, delta.stop_reason
    return so_far
