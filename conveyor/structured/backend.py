"""Grammars from llguidance: a constraint becomes a compiled matcher, once per constraint.

GrammarCompiler compiles on worker threads (llguidance releases the interpreter lock while it
compiles), keeps the compiled matchers in an LRU cache keyed by the constraint, and hands
every request a copy of its own (`deep_copy` takes microseconds). The front end uses it to
refuse a bad schema, regex or grammar before the request is admitted; the engine core uses it
to give each request its matcher without ever compiling on the step loop's thread.

JSON is generated the way `json.dumps` writes it: ", " between items, ": " after keys, no
other whitespace, so a model cannot pad an object with newlines until max_tokens. Properties
come in the schema's order.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from conveyor.structured.params import StructuredOutputs

# Fixed by the server, after the schema's own "x-guidance" options, so no request can loosen it.
JSON_OVERRIDES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT = 30.0
CACHE_SIZE = 512
COMPILE_NICENESS = 10  # of the compile threads (Linux: per thread), see _lower_priority


class GrammarError(ValueError):
    """A constraint that does not compile: "<param>: <detail>", where param names the request
    field it came from (the HTTP layer names its own field instead, e.g. response_format)."""

    def __init__(self, detail: str, param: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.detail = detail
        self.param = param


def grammar_text(constraint: StructuredOutputs) -> str:
    """llguidance's grammar (a JSON string) for a constraint. Checks nothing beyond JSON."""
    import llguidance

    kind, text = constraint.key
    if kind == "json":  # its JSON text: parsed in Rust, ~4x faster than from a dict
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OVERRIDES)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OVERRIDES
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark


class CompileStats:
    """What the compiler did since it was made: cache lookups and hits, and the seconds each
    compile took (a list the metrics drain)."""

    __slots__ = ("queries", "hits", "compile_seconds")

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.compile_seconds: list[float] = []


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: list[int],
        timeout: float = DEFAULT_COMPILE_TIMEOUT,
        cache_size: int = CACHE_SIZE,
        max_workers: int = 2,
        tokenizer_file: Path | None = None,
    ) -> None:
        """tokenizer: returns the Hugging Face tokenizer (called once, if needed).
        tokenizer_file: its tokenizer.json, which llguidance reads in Rust, ~3x faster than
        walking the Hugging Face tokenizer's vocabulary in Python. vocab_size: the width of
        the model's logits (padding beyond the tokenizer is never allowed). eos_token_ids:
        the model's end-of-sequence tokens, which end any grammar."""
        if not timeout > 0:
            raise ValueError(f"grammar compile timeout must be > 0 seconds, got {timeout!r}")
        self._tokenizer_factory = tokenizer
        self._tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout = timeout
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # apart: submit() never waits for a build
        self._lltok = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(
            max_workers, thread_name_prefix="conveyor-grammar", initializer=_lower_priority
        )

    @property
    def lltokenizer(self):
        """llguidance's view of the tokenizer, built once (see prepare)."""
        with self._tokenizer_lock:
            if self._lltok is None:
                self._lltok = self._build_lltokenizer()
            return self._lltok

    def prepare(self) -> None:
        """Builds llguidance's tokenizer now: 0.2-0.4 s for a 49k vocabulary that hold the
        interpreter lock, better spent at startup than as a stall of the step loop when the
        first constrained request arrives."""
        self.lltokenizer  # noqa: B018 - built for its side effect

    def _build_lltokenizer(self):
        import llguidance
        import llguidance.hf

        eos = self.eos_token_ids
        file = self._tokenizer_file
        if file is not None and file.is_file():
            try:
                return llguidance.LLTokenizer(str(file), n_vocab=self.vocab_size, eos_token=eos)
            except ValueError:  # more tokens than logits, or a format it cannot read
                pass
        hf = self._tokenizer_factory()
        return llguidance.hf.from_tokenizer(
            hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=eos
        )

    def submit(self, constraint: StructuredOutputs) -> Future:
        """A future of the constraint's compiled matcher (a template: copy it, never advance
        it). Compiles on a worker thread unless cached; the future raises GrammarError."""
        key = constraint.key
        with self._lock:
            self.stats.queries += 1
            future = self._cache.get(key)
            if future is not None:
                self.stats.hits += 1
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: StructuredOutputs):
        import llguidance

        start = time.perf_counter()
        lltok = self.lltokenizer
        try:
            text = grammar_text(constraint)
        except GrammarError:
            self._forget(constraint)
            raise
        except (ValueError, TypeError) as error:
            self._forget(constraint)
            raise GrammarError(str(error), constraint.param) from None
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        with self._lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
        if matcher.is_error():
            self._forget(constraint)
            raise GrammarError(_short(matcher.get_error()), constraint.param)
        return matcher

    def _forget(self, constraint: StructuredOutputs) -> None:
        """Failed compiles are not cached: the next request with it gets its own error."""
        with self._lock:
            self._cache.pop(constraint.key, None)

    def validate(self, constraint: StructuredOutputs, timeout: float | None = None) -> None:
        """Raises GrammarError if the constraint does not compile, or not within the time
        limit. The compiled matcher stays cached for the engine."""
        wait = self.timeout if timeout is None else timeout
        try:
            self.submit(constraint).result(timeout=wait)
        except FutureTimeout:
            raise GrammarError(
                f"the grammar did not compile within {wait:g} s", constraint.param
            ) from None

    def take_stats(self) -> tuple[int, int, list[float]]:
        """(cache lookups, cache hits, seconds of each compile since the last call)."""
        with self._lock:
            seconds, self.stats.compile_seconds = self.stats.compile_seconds, []
            return self.stats.queries, self.stats.hits, seconds

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Compile threads yield the cores to the step loop: the model's threads (OpenMP) wait
    for their slowest member, so a compile competing with them at equal priority can stretch
    a step several times over, while at a lower one it runs in the gaps between steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: equal priority then
        pass


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def strict_schema(schema: Any) -> Any:
    """OpenAI's `strict: true`: a copy in which every object with `properties` and no
    `additionalProperties` allows no other keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
