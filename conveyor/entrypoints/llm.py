"""The offline face: LLM(...).generate(prompts, params) -> list[RequestOutput]."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

from tqdm.auto import tqdm

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine_args import EngineArgs
from conveyor.lora.request import LoRARequest
from conveyor.outputs import OutputKind, RequestOutput
from conveyor.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs many prompts through one continuously batched engine and returns the outputs in
    input order. `model` is a checkpoint path (None: the default model) or EngineArgs; keyword
    arguments are EngineArgs' settings (dtype, device, max_num_seqs, max_num_batched_tokens,
    kv_cache_memory, ...: an unknown one is a TypeError at once) and LLMEngine's
    engine_process.

    Its processes (an engine core, tensor-parallel ranks) end at `shutdown()`, at the end of a
    `with LLM(...) as llm:` block, when the LLM is dropped, or at interpreter exit, whichever
    comes first; a constructor that fails leaves none behind."""

    def __init__(self, model: str | EngineArgs | None = None, **settings) -> None:
        self.engine = LLMEngine(model, **settings)
        self._counter = itertools.count()
        # Holds the engine, not the LLM: runs when the LLM is collected, or at exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stops the engine's processes and frees its sockets (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None: the base model) per
        prompt; needs enable_lora=True."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        loras = _as_lora_list(lora_request, len(prompts))
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"llm-{next(self._counter)}"
                prio = priority[i] if priority is not None else 0
                self.engine.add_request(
                    request_id,
                    prompt,
                    params[i],
                    priority=prio,
                    output_kind=OutputKind.FINAL_ONLY,
                    lora_request=loras[i],
                )
                ids.append(request_id)
        except ValueError:
            self.engine.abort_request(ids)  # one bad prompt fails the call, nothing left behind
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str = "last", use_tqdm: bool = True
    ) -> list[list[float]]:
        """The normalized final hidden state of each prompt's last token ("last") or its mean
        over the prompt's tokens ("mean"); prompts are scheduled as any prompt is."""
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return [out.embedding for out in self.generate(prompts, params, use_tqdm)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """chat_template_kwargs: the template's own variables (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(c, add_generation_prompt, chat_template, chat_template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """The conversation's prompt token ids, made as the server makes a chat request's:
        its text bounded before the template renders it, the rendered text bounded and
        tokenized (without the tokenizer's own special tokens: the template wrote them); a
        chat_template_kwargs name that is a parameter of transformers' apply_chat_template
        or of the tokenizer (padding, max_length, ...) is a ValueError."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM has none (skip_tokenizer_init)")
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        inputs = self.engine.inputs
        inputs.check_texts({"messages": messages, "chat_template_kwargs": chat_template_kwargs})
        return inputs.chat_prompt(
            messages, chat_template, add_generation_prompt, variables=chat_template_kwargs
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm
        ) as bar:
            while len(results) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(request_ids):
                    raise RuntimeError("engine went idle with requests unfinished")
        return [results[i] for i in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _as_lora_list(lora_request, num: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num
    loras = list(lora_request)
    if len(loras) != num:
        raise ValueError(f"got {len(loras)} lora_requests for {num} prompts")
    return loras


def _as_params_list(params, num: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num
    if isinstance(params, SamplingParams):
        return [params] * num
    params = list(params)
    if len(params) != num:
        raise ValueError(f"got {len(params)} SamplingParams for {num} prompts")
    return params
