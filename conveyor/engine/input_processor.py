"""The front end's half of admission: a prompt and its parameters, checked against what the
core can hold, become the core's sequences (one per completion, n of them)."""

from __future__ import annotations

import time
from typing import Any

from conveyor.engine.core import CoreInfo, CoreRequest
from conveyor.engine.output_processor import OutputProcessor
from conveyor.listing import listed
from conveyor.outputs import OutputKind
from conveyor.sampling_params import SamplingParams
from conveyor.structured.backend import GrammarCompiler


class InputProcessor:
    def __init__(
        self, info: CoreInfo, tokenizer: Any, grammars: GrammarCompiler | None = None
    ) -> None:
        """grammars: the core's compiler when it runs in this process (a grammar checked
        here is then compiled once); otherwise the front end keeps its own."""
        self.info = info
        self.tokenizer = tokenizer
        if grammars is None and tokenizer is not None:
            model = info.model_config
            grammars = GrammarCompiler(
                lambda: tokenizer,
                model.vocab_size,
                sorted(model.eos_token_ids),
                info.grammar_compile_timeout,
                tokenizer_file=model.tokenizer_path / "tokenizer.json",
            )
            grammars.prepare()
        self.grammars = grammars

    @property
    def max_model_len(self) -> int:
        return self.info.model_config.max_model_len

    def admit(
        self,
        outputs: OutputProcessor,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
        output_kind: OutputKind,
    ) -> tuple[list[int], list[CoreRequest]]:
        """Checks a request and registers it with the output processor; returns its prompt
        token ids and the sequences for the core. ValueError, with nothing registered, if
        it is refused."""
        if isinstance(request_id, str) and request_id in outputs:
            raise ValueError(f"duplicate request_id {request_id!r}: a request with it is running")
        text, token_ids, sequences = self.process(
            request_id, prompt, params, priority, arrival_time
        )
        children = [(s.request_id, s.params) for s in sequences]
        arrival = sequences[0].arrival_time
        outputs.add(request_id, text, token_ids, children, arrival, output_kind)
        return token_ids, sequences

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int = 0,
        arrival_time: float | None = None,
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
        self._check_token_ids(params)
        if params.structured_outputs is not None:  # compiled once, then cached
            self.grammars.validate(params.structured_outputs)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.n == 1:
            children = [(request_id, params)]
        else:  # seeds of the children are derived here, so a bad one is refused here
            children = [(f"{i}_{request_id}", params.child(i)) for i in range(params.n)]
        sequences = [
            CoreRequest(child_id, token_ids, child_params, max_tokens, priority, arrival)
            for child_id, child_params in children
        ]
        return text, token_ids, sequences

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
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                verb = "is" if len(outside) == 1 else "are"
                errors.append(f"{name}: {listed(outside)} {verb} not in [0, {vocab})")
        if errors:
            raise ValueError("; ".join(errors))

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """Resolves max_tokens and refuses what could never run."""
        num_prompt, limit = len(token_ids), self.max_model_len
        if num_prompt >= limit:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context length is {limit}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
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
