"""The front end's half of admission: a prompt and its parameters, checked against what the
core can hold, become the core's sequences (one per completion, n of them)."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from conveyor.engine.core_io import CoreInfo, CoreRequest
from conveyor.engine.output_processor import OutputProcessor
from conveyor.listing import listed
from conveyor.lora.request import LoRARequest
from conveyor.model.kv_groups import blocks_held
from conveyor.outputs import OutputKind
from conveyor.sampling_params import SamplingParams
from conveyor.structured.backend import GrammarCompiler


class InputProcessor:
    def __init__(
        self,
        info: CoreInfo,
        tokenizer: Any,
        grammars: GrammarCompiler | None = None,
        add_lora: Callable[[LoRARequest], Any] | None = None,
    ) -> None:
        """grammars: the core's compiler when it runs in this process; otherwise the front
        end keeps its own, which only checks constraints (in its sandbox) and never compiles
        one in this process. add_lora: the in-process core's (it loads an adapter once);
        otherwise, with LoRA on, a registry of its own checks adapter folders."""
        self.info = info
        self.tokenizer = tokenizer
        self.lora_registry = None  # the front end's own (checks only), before a core process
        if add_lora is None and info.lora_config is not None:
            from conveyor.lora.adapter import LoRAShapes
            from conveyor.lora.registry import LoRARegistry

            shapes = LoRAShapes.of(info.model_config)
            self.lora_registry = LoRARegistry(shapes, info.lora_config, keep_weights=False)
            add_lora = self.lora_registry.check
        self.add_lora = add_lora
        if grammars is None and tokenizer is not None:
            model = info.model_config
            grammars = GrammarCompiler(
                lambda: tokenizer,
                model.vocab_size,
                sorted(model.eos_token_ids),
                info.grammar_compile_timeout,
                tokenizer_file=model.tokenizer_path / "tokenizer.json",
                tokenizer_dir=model.tokenizer_path,
            )
        if grammars is not None and info.grammar_unavailable is not None:
            grammars.mark_unavailable(info.grammar_unavailable)  # the core cannot compile
        elif grammars is not None and tokenizer is not None:
            grammars.prepare_sandbox()
        self.grammars = grammars
        self._char_limit: int | None | object = _UNKNOWN

    @property
    def max_model_len(self) -> int:
        return self.info.model_config.max_model_len

    def register(
        self,
        outputs: OutputProcessor,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
        output_kind: OutputKind,
        lora_request: LoRARequest | None = None,
    ) -> tuple[list[int], list[CoreRequest]]:
        """Checks a request and registers it with the output processor; returns its prompt
        token ids and the sequences for the core. ValueError, with nothing registered, if
        it is refused."""
        if isinstance(request_id, str) and request_id in outputs:
            raise ValueError(f"duplicate request_id {request_id!r}: a request with it is running")
        text, token_ids, sequences = self.process(
            request_id, prompt, params, priority, arrival_time, lora_request
        )
        children = [(s.request_id, s.params) for s in sequences]
        arrival = sequences[0].arrival_time
        max_tokens = sequences[0].max_tokens
        outputs.add(request_id, text, token_ids, children, arrival, output_kind, max_tokens)
        return token_ids, sequences

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, list[int], list[CoreRequest]]:
        """Returns (prompt text, prompt token ids, the sequences); ValueError if refused."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if params.n > 1 and params.max_tokens == 0:
            raise ValueError(
                "n must be 1 with max_tokens=0: the prompt alone is computed, the same for "
                "every completion"
            )
        self._check_task(params)
        if self.tokenizer is None:
            self._check_without_tokenizer(params)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        params = self._with_bad_words(params)
        self._check_token_ids(params)
        params.check_leaves_a_token(self.info.model_config.eos_token_ids)
        if params.structured_outputs is not None:  # checked once, then cached
            self.grammars.validate(params.structured_outputs)
        if lora_request is not None:
            if self.add_lora is None:
                raise ValueError("lora_request needs an engine with enable_lora=True")
            self.add_lora(lora_request)  # its folder read and checked (once per adapter)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.n == 1:
            children = [(request_id, params)]
        else:  # seeds of the children are derived here, so a bad one is refused here
            children = [(f"{i}_{request_id}", params.child(i)) for i in range(params.n)]
            # The prompt is the same for all: its logprobs are computed by the first alone.
            children[1:] = [(i, p.clone(prompt_logprobs=None)) for i, p in children[1:]]
        sequences = [
            CoreRequest(
                child_id, token_ids, child_params, max_tokens, priority, arrival, lora_request
            )
            for child_id, child_params in children
        ]
        return text, token_ids, sequences

    @property
    def max_text_chars(self) -> int | None:
        """The most characters a prompt of this tokenizer may have (see max_prompt_chars)."""
        if self._char_limit is _UNKNOWN:
            self._char_limit = max_prompt_chars(self.tokenizer, self.max_model_len)
        return self._char_limit

    def check_text_length(self, num_chars: int, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a text that cannot fit in the context: tokenizing a
        30 MB prompt only to count it took minutes and gigabytes."""
        self.check_texts({param: num_chars})

    def check_texts(self, fields: dict[str, Any]) -> None:
        """check_text_length of everything a prompt is made of at once: `fields` maps each
        field's name to its text, its JSON-like value (messages, tools, template variables:
        num_chars; None: not given) or its number of characters; the error's param is the
        field with the most."""
        limit = self.max_text_chars
        if limit is None:
            return
        counts = {
            name: value if isinstance(value, int) else num_chars(value, limit)
            for name, value in fields.items()
            if value is not None
        }
        total = sum(counts.values())
        if total > limit:
            raise FieldError(
                f"{listed(list(counts))}: {total} characters cannot fit in the model's context "
                f"length of {self.max_model_len} tokens (no {self.max_model_len} tokens of this "
                f"tokenizer hold more than {limit} characters)",
                max(counts, key=counts.get),
            )

    def chat_prompt(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        variables: dict | None = None,
        field: str = "messages",
        documents: list[dict] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The token ids of a conversation: the chat template renders text (its special
        tokens written by the template), which is bounded as a prompt is and tokenized
        without the tokenizer's own special tokens, as transformers' tokenize=True does.
        variables: the template's own (chat_template_kwargs); none may name a parameter of
        the template's caller or of the tokenizer (reserved_template_variables). The caller
        bounds the texts before (check_texts). field: what the request calls its messages
        (the Responses API's input), for its errors. documents: the retrieved documents of a
        RAG template (transformers' `documents`); add_special_tokens: the tokenizer's own
        special tokens (a BOS) added to the rendered text too, as vLLM's chat field asks."""
        variables = dict(variables or {})
        reserved = sorted(reserved_template_variables(self.tokenizer) & variables.keys())
        if reserved:
            raise FieldError(
                f"chat_template_kwargs: {listed(reserved)} cannot be set here: parameters of "
                "the chat template's caller or of the tokenizer, not template variables",
                "chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **variables,
            )
        except Exception as error:  # the template refused the conversation (jinja raise)
            raise ValueError(
                f"{field} could not be rendered by the chat template: {_template_error(error)}"
            ) from None
        self.check_text_length(len(text), field)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as error:  # e.g. a lone surrogate the tokenizer cannot encode
            raise ValueError(f"{field} could not be tokenized: {error}") from error

    def _check_without_tokenizer(self, params: SamplingParams) -> None:
        """skip_tokenizer_init: what needs text is refused."""
        needs = [
            name
            for name, used in (
                ("stop strings", params.stop_strings),
                ("structured output", params.structured_outputs is not None),
            )
            if used
        ]
        if needs:
            raise ValueError(
                f"{' and '.join(needs)} need a tokenizer; this engine has none "
                "(skip_tokenizer_init=True)"
            )

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(
                "this engine has no tokenizer (skip_tokenizer_init=True): "
                "give the prompt as a list of token ids"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self.check_text_length(len(prompt), "prompt")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.info.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, list(prompt)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Every token id a request names is in the vocabulary; the error names each that is
        not, field by field."""
        vocab = self.info.model_config.vocab_size
        errors = []
        bad_words = [t for ids in params.bad_words_token_ids or () for t in ids]
        if len(params.allowed_token_ids or ()) > vocab:
            errors.append(f"allowed_token_ids: more than the vocabulary's {vocab} tokens")
        for name in ("logprobs", "prompt_logprobs"):  # a server bounds them by --max-logprobs
            if (getattr(params, name) or 0) > vocab and not params.logprob_token_ids:
                errors.append(f"{name}: more than the vocabulary's {vocab} tokens")
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logprob_token_ids", params.logprob_token_ids or ()),
            ("bad_words", bad_words),
        ):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                verb = "is" if len(outside) == 1 else "are"
                errors.append(f"{name}: {listed(outside)} {verb} not in [0, {vocab})")
        if errors:
            raise ValueError("; ".join(errors))

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """bad_words as token id sequences, each word as it starts the output and after a
        space (as vLLM tokenizes them)."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; give bad_words_token_ids instead")
        sequences = list(params.bad_words_token_ids or [])
        for word in params.bad_words:
            for text in (word, f" {word.lstrip()}"):
                ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return params.clone(bad_words_token_ids=sequences)

    def _check_task(self, params: SamplingParams) -> None:
        """A classify request needs the model's classifier; a sequence classifier (its head
        no vocabulary's) computes no tokens."""
        model = self.info.model_config
        if params.pooling == "classify" and model.classifier is None:
            raise ValueError(
                "this model has no classifier: serve a *ForSequenceClassification checkpoint, "
                "or name the tokens whose logits are the labels (--hf-overrides "
                '\'{"classifier_from_token": ["no", "yes"]}\')'
            )
        if model.is_sequence_classifier and params.pooling is None:
            raise ValueError(
                f"{model.path.name} is a sequence classifier ({model.classifier.num_labels} "
                "labels): it classifies, scores and embeds (/classify, /score, /rerank, "
                "/v1/embeddings; LLM.classify, LLM.score, LLM.embed), it generates no text"
            )
        if model.is_encoder and params.pooling is None:
            raise ValueError(
                f"{model.path.name} is an encoder (BERT family): it embeds"
                + (", classifies and scores" if model.classifier is not None else "")
                + " (/v1/embeddings, /classify, /score, /rerank; LLM.embed, LLM.classify, "
                "LLM.score), it generates no text"
            )
        if model.is_encoder and params.prompt_logprobs is not None:
            raise ValueError("an encoder (BERT family) has no prompt logprobs")

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """Resolves max_tokens and refuses what could never run."""
        num_prompt, limit = len(token_ids), self.max_model_len
        # A prompt-only request (pooling, max_tokens 0) needs no room for an output token.
        prompt_only = params.pooling is not None or params.max_tokens == 0
        if num_prompt > limit or (num_prompt == limit and not prompt_only):
            room = "" if prompt_only else " (one position is kept for the output)"
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context length is {limit}{room}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if params.pooling is not None:
            max_tokens = 0
        if num_prompt + max_tokens > limit:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is "
                f"{num_prompt + max_tokens} tokens, beyond the model's context length {limit}"
            )
        if params.min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens the "
                "context leaves for output"
            )
        block_size, num_blocks = self.info.cache_config.block_size, self.info.num_blocks
        # a sliding group's table holds at most its window and a step's tokens at once
        step = self.info.scheduler_config.max_num_batched_tokens
        needed_blocks = blocks_held(self.info.kv_windows, num_prompt + max_tokens, block_size, step)
        if needed_blocks > num_blocks:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs "
                f"{needed_blocks} KV blocks; the whole cache has {num_blocks}"
            )
        sched = self.info.scheduler_config
        if not sched.enable_chunked_prefill and num_prompt > sched.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) with chunked prefill disabled"
            )
        return max_tokens


class FieldError(ValueError):
    """A request's input refused; param: the field it came from (an HTTP 400 names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# Names a chat template's caller takes for itself, whatever its release: apply_chat_template's
# parameters and the tokenizer's (__call__, encode), which it forwards. A template variable of
# one of these names would set how the prompt is made (padded to millions of tokens, cut,
# returned as tensors, tokenized with other arguments), not what the template writes; those of
# the installed release are read from its signatures as well (reserved_template_variables).
TEMPLATE_CALLER_PARAMETERS = frozenset(
    {
        "self",
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "text",
        "text_pair",
        "text_target",
        "text_pair_target",
        "add_special_tokens",
        "stride",
        "is_split_into_words",
        "pad_to_multiple_of",
        "padding_side",
        "return_token_type_ids",
        "return_attention_mask",
        "return_overflowing_tokens",
        "return_special_tokens_mask",
        "return_offsets_mapping",
        "return_length",
        "verbose",
        "split_special_tokens",
    }
)


def reserved_template_variables(tokenizer: Any = None) -> frozenset[str]:
    """TEMPLATE_CALLER_PARAMETERS, with every named parameter of transformers' and the
    tokenizer's own apply_chat_template, __call__ and encode."""
    from transformers import PreTrainedTokenizerBase

    names = _signature_names(PreTrainedTokenizerBase)
    return names if tokenizer is None else names | _signature_names(type(tokenizer))


@functools.cache
def _signature_names(cls: type) -> frozenset[str]:
    names = set(TEMPLATE_CALLER_PARAMETERS)
    for method in ("apply_chat_template", "__call__", "encode", "encode_plus"):
        function = getattr(cls, method, None)
        if function is None:
            continue
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        names.update(p.name for p in parameters if p.kind not in _VARIADIC)
    return frozenset(names)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _template_error(error: Exception) -> str:
    """What a client may read of a template's failure: a Jinja error's own message (the
    template's raise_exception, an undefined name), else only the kind of error: another
    exception may carry the tokenizer's repr, with the model's folder on the server's disk."""
    from jinja2 import TemplateError

    if isinstance(error, TemplateError):
        return str(error)[:500]
    return f"the template failed ({type(error).__name__})"


def num_chars(value: Any, stop_above: int | None = None) -> int:
    """Characters a JSON-like value writes at the least: every string and key, one for each
    other scalar (iteratively: it may nest deep). Counting stops once past stop_above."""
    total, stack = 0, [value]
    while stack and (stop_above is None or total <= stop_above):
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) if isinstance(key, str) else 1 for key in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            total += 1
    return total


_UNKNOWN = object()
# Normalizers that never shrink a text by more than MAX_NORMALIZED_SHRINK (Unicode composition
# joins at most 3 code points, e.g. Hangul jamo) and never delete what they are given.
_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"}
MAX_NORMALIZED_SHRINK = 4


def max_prompt_chars(tokenizer: Any, num_tokens: int) -> int | None:
    """The most characters num_tokens tokens of this tokenizer can spell: num_tokens times its
    longest token's text (a byte-level or SentencePiece token's text is at least as long as
    what it decodes to), times MAX_NORMALIZED_SHRINK if a normalizer may compose characters.
    None (no bound) for a tokenizer this cannot reason about: one whose normalizer may
    delete text, or that is not a Hugging Face fast tokenizer."""
    import json

    try:
        vocab = tokenizer.get_vocab()
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("normalizer")
    except (AttributeError, TypeError, ValueError):
        return None
    longest = max((len(token) for token in vocab), default=0)
    if not longest:
        return None
    if spec is not None and not _never_shrinks_much(spec):
        return None
    return num_tokens * longest * (1 if spec is None else MAX_NORMALIZED_SHRINK)


def _never_shrinks_much(spec: dict) -> bool:
    """Whether a normalizer (its JSON form) shrinks no text by more than
    MAX_NORMALIZED_SHRINK: compositions, case, prefixes, and a Replace of a fixed string
    by one at most that many times shorter (SentencePiece's " " -> "▁")."""
    stack = [spec]
    while stack:
        node = stack.pop()
        kind = node.get("type")
        if kind == "Sequence":
            stack.extend(node.get("normalizers") or ())
        elif kind == "Replace":
            pattern, content = node.get("pattern") or {}, node.get("content") or ""
            fixed = pattern.get("String")
            if fixed is None or len(fixed) > MAX_NORMALIZED_SHRINK * len(content):
                return False
        elif kind not in _SAFE_NORMALIZERS:
            return False
    return True
