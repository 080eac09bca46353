"""The offline face: LLM(...).generate(prompts, params) -> list[RequestOutput]."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from conveyor.entrypoints.openai.chat_content import (
    CONTENT_FORMATS,
    offline_message,
    resolve_content_format,
)
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.pipeline import (
    Parsers,
    ReplyReader,
    marker_terminal,
    special_texts,
    tokenized,
)
from conveyor.lora.request import LoRARequest
from conveyor.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from conveyor.pooling_params import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.scoring import cosine, label_probs, one_label, pairs
from conveyor.structured.tools import MAX_DEPTH

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
        self._queued: list[str] = []  # enqueue()'s requests, for wait_for_completion()
        self._finished: dict[str, RequestOutput] = {}  # theirs that a generate() ran to the end
        # Holds the engine, not the LLM: runs when the LLM is collected, or at exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, by vLLM's name for it (llm.llm_engine.model_config, ...)."""
        return self.engine

    def shutdown(self) -> None:
        """Stops the engine's processes and frees its sockets (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt block (vLLM's), e.g. between benchmark runs; False
        while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no SamplingParams: the model's
        generation config (its generation_config.json's temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), else SamplingParams()'s, as vLLM's
        LLM (generation_config="vllm" leaves the model's out)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: each prompt's output, in order. lora_request: one adapter for every prompt,
        or one (or None: the base model) per prompt; needs enable_lora=True. priority: one
        for every prompt or one per prompt (--scheduling-policy priority: lower runs first)."""
        ids = self.enqueue(prompts, sampling_params, lora_request, priority, queue=False)
        return self._run(ids, use_tqdm)

    def enqueue(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
        queue: bool = True,
    ) -> list[str]:
        """vLLM's: adds the prompts' requests (as generate's) without running them; their
        ids. wait_for_completion() runs them (a generate() call meanwhile runs them too, and
        keeps their outputs for it). One prompt refused refuses them all."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        if isinstance(priority, int) and not isinstance(priority, bool):
            priority = [priority] * len(prompts)
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
        if queue:
            self._queued.extend(ids)
        return ids

    def wait_for_completion(self, output_type=None, *, use_tqdm: bool = True) -> list:
        """vLLM's: runs every enqueued request to its end; their outputs, in enqueue order
        (output_type: accepted for vLLM's signature; they are RequestOutputs)."""
        ids, self._queued = self._queued, []
        missing = [i for i in ids if i not in self._finished]
        done = dict(zip(missing, self._run(missing, use_tqdm), strict=True))
        return [done.get(i) or self._finished.pop(i) for i in ids]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (entrypoints/beam_search.py): each output's sequences, best
        first, hold the prompt's and the beam's tokens, the beam's text and its cumulative
        log-probability. concurrency_limit: at most this many prompts' beams at once."""
        prompts = _as_prompt_list(prompts)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("beam_search needs a tokenizer; this LLM has none")
        ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if any(not p for p in ids):
            raise ValueError("a prompt must hold at least one token")
        vocab = self.engine.model_config.vocab_size
        if 2 * params.beam_width > vocab:  # each step's logprobs, from the vocabulary
            raise ValueError(
                f"beam_width: each step asks for 2 x beam_width logprobs, at most the "
                f"vocabulary's {vocab} tokens; got {params.beam_width}"
            )

        def generate(batch: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self.generate(batch, step, use_tqdm, lora_request=lora_request)

        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        step = concurrency_limit or max(len(ids), 1)
        return [
            out
            for start in range(0, len(ids), step)
            for out in beam_search(generate, tokenizer, ids[start : start + step], params)
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
        tokenization_kwargs: dict | None = None,
        pooling: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (`out.outputs.embedding`), the normalized final
        hidden state of its last token (pooling "last"), of its first ("cls": an encoder's
        [CLS]) or its mean over the prompt's tokens ("mean"); None: the model's own (its
        sentence-transformers pooling, else an encoder's first token, a decoder's last);
        prompts are scheduled as any prompt is. pooling_params: PoolingParams (one, or one a
        prompt)."""
        if tokenization_kwargs:
            raise ValueError(
                "tokenization_kwargs are not taken: prompts are tokenized as the model's "
                "tokenizer does (pass token ids for another tokenization)"
            )
        if pooling_params is not None:
            each = [pooling_params] if isinstance(pooling_params, PoolingParams) else pooling_params
            for one in each:
                if not isinstance(one, PoolingParams):
                    raise ValueError(f"pooling_params must be PoolingParams, got {one!r}")
                one.check(self.engine.model_config.hidden_size)
        pooling = pooling or self.engine.model_config.default_pooling
        params = SamplingParams(max_tokens=0, pooling=pooling)
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [
            EmbeddingRequestOutput(
                out.request_id,
                EmbeddingOutput(out.embedding),
                out.prompt_token_ids,
                out.num_cached_tokens,
                out.finished,
            )
            for out in outputs
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's label probabilities (`out.outputs.probs`) by the model's
        classifier at its last token (a *ForSequenceClassification checkpoint's score head,
        or `classifier_from_token`'s tokens, ModelConfig.classifier; an encoder's head pools
        its first token, or ModernBERT's the mean); ValueError for a model without one.
        pooling_params=PoolingParams(use_activation=False): `probs` holds the raw label
        logits (a reward model's score), as vLLM's."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {pooling_params!r}")
        activation = pooling_params is None or pooling_params.activation
        params = SamplingParams(max_tokens=0, pooling="classify")
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [
            ClassificationRequestOutput(
                out.request_id,
                ClassificationOutput(
                    label_probs(out.embedding) if activation else list(out.embedding),
                    out.embedding,
                ),
                out.prompt_token_ids,
                out.finished,
            )
            for out in outputs
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's: a score per pair (data_1 one text against each of data_2, or two lists
        pairwise; `out.outputs.score`): with a classifier of one label, the sigmoid of its
        logit on the pair joined as the tokenizer joins a text pair (a cross-encoder, such as
        Qwen3-Reranker with vLLM's `classifier_from_token` overrides); without one, the cosine
        similarity of the two texts' embeddings."""
        joined = pairs(data_1, data_2)
        classifier = self.engine.model_config.classifier
        if classifier is not None:
            one_label(classifier.num_labels)
            tokenizer = self.get_tokenizer()
            prompts = [tokenizer(a, text_pair=b)["input_ids"] for a, b in joined]
            outputs = self.classify(prompts, use_tqdm=use_tqdm, lora_request=lora_request)
            return [
                ScoringRequestOutput(
                    out.request_id, ScoringOutput(out.outputs.probs[0]), out.prompt_token_ids
                )  # fmt: skip
                for out in outputs
            ]
        texts = list(dict.fromkeys(t for pair in joined for t in pair))
        embedded = self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request)
        vectors = dict(zip(texts, embedded, strict=True))
        return [
            ScoringRequestOutput(
                vectors[b].request_id,
                ScoringOutput(cosine(vectors[a].outputs.embedding, vectors[b].outputs.embedding)),
                vectors[b].prompt_token_ids,
            )
            for a, b in joined
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        thinking_token_budget: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: str = "auto",
        continue_final_message: bool = False,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat. chat_template_kwargs: the template's own variables (e.g.
        enable_thinking); lora_request: as generate's; chat_template_content_format:
        "string", "openai" or "auto", and continue_final_message, as the server's. Each
        completion's text is also read as the server reads a chat reply (its `parsed`:
        reasoning, content, and with tools the calls of declared functions), by the parsers
        named (vLLM's names) or those the chat template makes unambiguous; and generated as
        the server generates it: stop strings are matched after the reasoning those parsers
        read, a structured output starts after it (in harmony's final channel for GPT-OSS),
        thinking_token_budget bounds it."""
        names = ParserNames(reasoning_parser, tool_call_parser)  # ValueError for a bad name
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(
                c,
                add_generation_prompt,
                chat_template,
                chat_template_kwargs,
                tools,
                continue_final_message,
                chat_template_content_format,
            )
            for c in conversations
        ]
        tokenizer = self.engine.tokenizer
        parsers = Parsers.of(names, chat_template or tokenizer.chat_template)
        specials = special_texts(tokenizer)
        hidden = parsers.hidden(specials, True, bool(tools))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        asked = _as_params_list(sampling_params, len(prompts))
        # the parsers must see their markers, as the server's do (unless all are asked for)
        hides = [hidden is not None and p.skip_special_tokens for p in asked]
        readers = [
            functools.partial(
                _read,
                parsers,
                tools,
                tokenizer.decode(prompt[-8:]),
                chat_template_kwargs,
                hidden if hide else (),
            )
            for prompt, hide in zip(prompts, hides, strict=True)
        ]
        marker = marker_terminal(tokenizer, specials)
        params = [
            _as_served(p, reader(), parsers, tokenizer, marker, hide, thinking_token_budget)
            for p, reader, hide in zip(asked, readers, hides, strict=True)
        ]
        outputs = self.generate(prompts, params, use_tqdm, lora_request, priority)
        for out, reader in zip(outputs, readers, strict=True):
            for completion in out.outputs:
                completion.parsed = reader().parse(completion.text)
        return outputs

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        content_format: str = "auto",
    ) -> list[int]:
        """The conversation's prompt token ids, made as the server makes a chat request's:
        its text bounded before the template renders it, a message's text parts given as the
        template reads them (content_format: chat_content.py), the rendered text bounded and
        tokenized (without the tokenizer's own special tokens: the template wrote them); a
        chat_template_kwargs name that is a parameter of transformers' apply_chat_template
        or of the tokenizer (padding, max_length, ...) is a ValueError. continue_final_message:
        the last (assistant) message is continued rather than closed."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM has none (skip_tokenizer_init)")
        template = chat_template or tokenizer.chat_template
        if not template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        if content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {content_format!r}"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message: add_generation_prompt "
                "must be False with it"
            )
        fmt = resolve_content_format(content_format, template)
        messages = [offline_message(m, fmt) if isinstance(m, dict) else m for m in messages]
        inputs = self.engine.inputs
        texts = {"messages": messages, "tools": tools, "chat_template_kwargs": chat_template_kwargs}
        inputs.check_texts(texts)
        return inputs.chat_prompt(
            messages,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools=tools,
            variables=chat_template_kwargs,
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm
        ) as bar:
            wanted = set(request_ids)
            while len(results) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                    elif out.finished:  # an enqueued request's: kept for wait_for_completion
                        self._finished[out.request_id] = out
                if not self.engine.has_unfinished_requests() and len(results) < len(request_ids):
                    raise RuntimeError("engine went idle with requests unfinished")
        return [results[i] for i in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [list(prompts)]
    prompts = [prompt_of(p) for p in prompts]
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def prompt_of(prompt) -> Prompt:
    """A prompt as the engine takes it: vLLM's prompt dicts ({"prompt": text} or
    {"prompt_token_ids": ids}) are read as their text or ids; a string or ids as they are."""
    if not isinstance(prompt, dict):
        return prompt
    if "multi_modal_data" in prompt:
        raise ValueError(
            "multi_modal_data: this engine runs text-only models; give the prompt as text or "
            "token ids"
        )
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or len(prompt) != 1:
        raise ValueError(
            "a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids' (ids); "
            f"got keys {sorted(prompt)}"
        )
    return prompt.get("prompt", prompt.get("prompt_token_ids"))


def _read(
    parsers: Parsers,
    tools: list[dict] | None,
    tail: str,
    kwargs: dict | None,
    hidden: tuple[str, ...],
) -> ReplyReader:
    """The reader of one LLM.chat reply: the server's (pipeline.ReplyReader)."""
    declared = None
    if tools:
        declared = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    parser = parsers.for_request(declared, MAX_DEPTH, tail, False, kwargs)
    return ReplyReader("auto" if declared else "none", parser, None, MAX_DEPTH, hidden)


def _as_served(
    params: SamplingParams,
    reader: ReplyReader,
    parsers: Parsers,
    tokenizer,
    marker: Callable[[str], str],
    hide: bool,
    budget: int | None,
) -> SamplingParams:
    """An LLM.chat reply's params as the server's would be: its reasoning's bounds (stop
    strings after it, a budget, a grammar after it), its answer's grammar in the family's
    form, its special tokens kept where the parsers read markers among them."""
    bounds = reader.reasoning_bounds()
    integer = isinstance(budget, int) and not isinstance(budget, bool)
    if budget is not None and not (integer and budget >= 0):
        raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
    if budget is not None and bounds is None:
        raise ValueError(
            "thinking_token_budget: this chat's reply has no reasoning that its parsers read "
            "(name a reasoning_parser)"
        )
    answer = parsers.answer_constraint(params.structured_outputs, marker)
    return params.clone(
        skip_special_tokens=params.skip_special_tokens and not hide,
        reasoning=tokenized(bounds, tokenizer, budget) if bounds else params.reasoning,
        structured_outputs=answer,
    )


def _as_lora_list(lora_request, num: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num
    loras = list(lora_request)
    if len(loras) != num:
        raise ValueError(f"got {len(loras)} lora_requests for {num} prompts")
    return loras


def _as_params_list(params, num: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * num
    params = list(params)
    if len(params) != num:
        raise ValueError(f"got {len(params)} SamplingParams for {num} prompts")
    return params
