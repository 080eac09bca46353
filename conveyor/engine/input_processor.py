"""The front end's half of admission: a prompt and its parameters, checked against what the
core can hold, become the core's sequences (one per completion, n of them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conveyor.engine.core import CoreInfo, CoreRequest
from conveyor.engine.output_processor import OutputProcessor
from conveyor.listing import listed
from conveyor.lora.request import LoRARequest
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

    def check_text_length(self, num_chars: int, param: str = "prompt") -> None:
        """Refuses, before tokenizing, a text that cannot fit in the context: tokenizing a
        30 MB prompt only to count it took minutes and gigabytes."""
        if self._char_limit is _UNKNOWN:
            self._char_limit = max_prompt_chars(self.tokenizer, self.max_model_len)
        limit = self._char_limit
        if limit is not None and num_chars > limit:
            raise ValueError(
                f"{param}: {num_chars} characters cannot fit in the model's context length of "
                f"{self.max_model_len} tokens (no {self.max_model_len} tokens of this "
                f"tokenizer hold more than {limit} characters)"
            )

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
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
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

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """Resolves max_tokens and refuses what could never run."""
        num_prompt, limit = len(token_ids), self.max_model_len
        if num_prompt >= limit:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context length is {limit}"
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
        needed_blocks = -(-(num_prompt + max_tokens) // block_size)
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
