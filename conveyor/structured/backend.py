"""Grammars from llguidance: a constraint is checked in a sandbox, then compiled once where
it is used.

GrammarCompiler has two duties, one per side of the engine:

    validate / check   (front end) the constraint within bounds (size, nesting), then compiled
                       in a sandboxed worker process (structured/sandbox.py): a grammar that
                       does not compile, crashes the compiler or runs past the time limit is
                       refused with a GrammarError for its request alone. The verdicts are
                       cached by constraint; a refused or timed-out one never is.
    submit             (engine core) the real compile of a constraint the front end checked,
                       on threads whose stack is COMPILE_STACK_RATIO times the sandbox's, in
                       an LRU cache of matchers; every request gets a copy (`deep_copy`).

So a constraint is compiled once in each place (the sandbox's to prove it, the core's to use
it), never in the front end's process, and never on the threads that tokenize prompts. If
llguidance cannot read the model's tokenizer, the engine serves as ever and a constrained
request is refused with the reason (GrammarUnavailable).

JSON is generated the way `json.dumps` writes it: ", " between items, ": " after keys, no
other whitespace, so a model cannot pad an object with newlines until max_tokens. Properties
come in the schema's order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from conveyor.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT
from conveyor.nesting import too_deep
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.sandbox import (
    COMPILE_STACK_RATIO,
    DEFAULT_WORKERS,
    JSON_OVERRIDES,
    SANDBOX_STACK_BYTES,
    BackendUnavailable,
    CompileRefused,
    Sandbox,
    build_lltokenizer,
    short,
)
from conveyor.structured.sandbox import grammar_text as _grammar_text

logger = logging.getLogger(__name__)

__all__ = ["JSON_OVERRIDES", "GrammarCompiler", "GrammarError", "GrammarUnavailable"]

CACHE_SIZE = 512
COMPILE_NICENESS = 10  # of the compile threads (Linux: per thread), see _lower_priority
# Bounds checked before anything compiles (the sandbox contains what passes them).
MAX_CONSTRAINT_BYTES = 1 << 20
# As deep as llguidance's JSON parser goes; the server refuses past --max-json-depth first.
MAX_SCHEMA_DEPTH = 128
# A caller waits this much past the limit, for a worker to start: the sandbox stops the compile
# itself at the limit, so its verdict (never cached) is what the caller sees.
CHECK_GRACE = 10.0


class GrammarError(ValueError):
    """A constraint that does not compile: "<param>: <detail>", where param names the request
    field it came from (the HTTP layer names its own field instead, e.g. response_format)."""

    def __init__(self, detail: str, param: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.detail = detail
        self.param = param


class GrammarUnavailable(GrammarError):
    """Structured output is off for this model (llguidance cannot read its tokenizer)."""


def grammar_text(constraint: StructuredOutputs) -> str:
    """llguidance's grammar (a JSON string) for a constraint. Checks nothing beyond JSON."""
    return _grammar_text(*constraint.key)


def check_bounds(constraint: StructuredOutputs) -> None:
    """Refuses, before any compile, a constraint too big or (a schema) too deeply nested to
    be worth one. GrammarError naming the field."""
    if constraint._bounded:
        return
    if constraint.kind == "json" and not isinstance(constraint.json, str):
        # Before .key writes it out, which recurses.
        if too_deep(constraint.json, MAX_SCHEMA_DEPTH):
            raise GrammarError(
                f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", constraint.param
            )
    size = len(constraint.key[1].encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise GrammarError(
            f"{size} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed", constraint.param
        )
    object.__setattr__(constraint, "_bounded", True)


class CompileStats:
    """What the compiler did since it was made: checks and cache hits, and the seconds each
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
        timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        cache_size: int = CACHE_SIZE,
        max_workers: int = 2,
        tokenizer_file: Path | None = None,
        tokenizer_dir: Path | None = None,
        sandbox_workers: int = DEFAULT_WORKERS,
    ) -> None:
        """tokenizer: returns the Hugging Face tokenizer (called once, if needed).
        tokenizer_file: its tokenizer.json, which llguidance reads in Rust, ~3x faster than
        walking the Hugging Face tokenizer's vocabulary in Python; tokenizer_dir: the folder
        the sandbox loads the Hugging Face tokenizer from when that fails. vocab_size: the
        width of the model's logits (padding beyond the tokenizer is never allowed).
        eos_token_ids: the model's end-of-sequence tokens, which end any grammar."""
        if not timeout > 0:
            raise ValueError(f"grammar compile timeout must be > 0 seconds, got {timeout!r}")
        self._tokenizer_factory = tokenizer
        self._tokenizer_file = tokenizer_file
        self._tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout = timeout
        self.cache_size = cache_size
        self.stats = CompileStats()
        self.num_compiled = 0  # real compiles in this process (submit)
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # apart: submit() never waits for a build
        self._lltok = None
        self._unavailable: str | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._checks: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = _StackPool(max_workers, SANDBOX_STACK_BYTES * COMPILE_STACK_RATIO)
        self._sandbox_workers = sandbox_workers
        self._sandbox: Sandbox | None = None
        self._waiters: ThreadPoolExecutor | None = None

    # ---- availability ----------------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why structured output is off for this model, once known; None while it may work."""
        if self._unavailable is None and self._sandbox is not None:
            return self._sandbox.unavailable
        return self._unavailable

    @property
    def lltokenizer(self):
        """llguidance's view of the tokenizer, built once (see prepare). GrammarUnavailable
        if llguidance cannot read it."""
        with self._tokenizer_lock:
            if self._lltok is None and self._unavailable is None:
                try:
                    self._lltok = build_lltokenizer(
                        str(self._tokenizer_file) if self._tokenizer_file else None,
                        self._tokenizer_factory,
                        self.vocab_size,
                        self.eos_token_ids,
                    )
                except Exception as error:  # noqa: BLE001 - an optional part: never fatal
                    self._unavailable = short(f"{type(error).__name__}: {error}")
                    logger.warning(
                        "structured output is off for this model: llguidance cannot read its "
                        "tokenizer (%s); every other request is served",
                        self._unavailable,
                    )
            if self._lltok is None:
                raise GrammarUnavailable(self._refusal(), "structured_outputs")
            return self._lltok

    def mark_unavailable(self, reason: str) -> None:
        """Structured output is off (the engine core found llguidance cannot read the
        tokenizer): every constraint is refused with the reason, none is checked."""
        self._unavailable = reason

    def _refusal(self) -> str:
        return f"structured output is unavailable for this model: {self.unavailable}"

    def prepare(self) -> None:
        """Builds llguidance's tokenizer now (for submit): 0.2-0.4 s for a 49k vocabulary
        that hold the interpreter lock, better spent at startup than as a stall of the step
        loop when the first constrained request arrives. Never raises: a tokenizer it cannot
        read turns structured output off, with one warning."""
        try:
            self.lltokenizer  # noqa: B018 - built for its side effect
        except GrammarUnavailable:
            pass

    def prepare_sandbox(self) -> None:
        """Starts a sandbox worker ahead of the first constraint (for validate)."""
        self._sandbox_pool().start()

    # ---- the front end: checked in the sandbox -----------------------------------------------

    def check(self, constraint: StructuredOutputs) -> Future:
        """A future of the constraint's verdict: None, or it raises GrammarError. Runs on
        the compiler's own waiter threads, never the caller's."""
        try:
            check_bounds(constraint)
        except GrammarError as error:
            future: Future = Future()
            future.set_exception(error)
            return future
        key = constraint.key
        with self._lock:
            self.stats.queries += 1
            future = self._checks.get(key)
            if future is not None:
                self.stats.hits += 1
                self._checks.move_to_end(key)
                return future
            if self._waiters is None:
                self._waiters = ThreadPoolExecutor(
                    self._sandbox_workers, thread_name_prefix="conveyor-grammar-check"
                )
            future = self._waiters.submit(self._check, constraint)
            self._checks[key] = future
            while len(self._checks) > self.cache_size:
                self._checks.popitem(last=False)
        return future

    def _check(self, constraint: StructuredOutputs) -> None:
        kind, text = constraint.key
        try:
            seconds = self._sandbox_pool().check(kind, text, self.timeout)
        except CompileRefused as error:
            self._forget(self._checks, constraint)
            raise GrammarError(error.detail, constraint.param) from None
        except BackendUnavailable:
            self._forget(self._checks, constraint)
            raise GrammarUnavailable(self._refusal(), constraint.param) from None
        with self._lock:
            self.stats.compile_seconds.append(seconds)

    def _sandbox_pool(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(
                    self._tokenizer_file,
                    self._tokenizer_dir,
                    self.vocab_size,
                    self.eos_token_ids,
                    max_workers=self._sandbox_workers,
                )
            return self._sandbox

    def validate(self, constraint: StructuredOutputs, timeout: float | None = None) -> None:
        """Raises GrammarError if the constraint does not compile in the sandbox, or not
        within the time limit (a check still queued then is dropped)."""
        self._check_available(constraint)
        wait = self.timeout + CHECK_GRACE if timeout is None else timeout
        future = self.check(constraint)
        try:
            future.result(timeout=wait)
        except FutureTimeout:
            raise self._late(future, constraint) from None

    async def validate_async(self, constraint: StructuredOutputs) -> None:
        """validate for the event loop: waits without holding any thread. The bounds and the
        cache key (a walk and a JSON dump of the schema) are taken on a thread, where the
        loop keeps its turns at the interpreter lock: on the loop, four 500 KB schemas held
        every stream's next token for a second."""
        self._check_available(constraint)
        future = await asyncio.to_thread(self.check, constraint)
        try:  # shielded: a client that leaves does not cancel a check others may share
            wait = self.timeout + CHECK_GRACE
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), wait)
        except TimeoutError:
            raise self._late(future, constraint) from None

    def _check_available(self, constraint: StructuredOutputs) -> None:
        if self.unavailable is not None:
            raise GrammarUnavailable(self._refusal(), constraint.param)

    def _late(self, future: Future, constraint: StructuredOutputs) -> GrammarError:
        """Waited past the limit for a busy sandbox. A check still queued is dropped; one
        running is stopped by the sandbox at its own deadline, and then forgotten."""
        if future.cancel():
            self._forget(self._checks, constraint)
        return GrammarError(
            f"the grammar did not compile within {self.timeout:g} s (the grammar compilers "
            "are busy)",
            constraint.param,
        )

    # ---- the engine core: compiled for use -------------------------------------------------

    def submit(self, constraint: StructuredOutputs) -> Future:
        """A future of the constraint's compiled matcher (a template: copy it, never advance
        it). Compiles on a worker thread unless cached; the future raises GrammarError. The
        constraint must have passed validate (in this process or the front end's)."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: StructuredOutputs):
        import llguidance

        try:
            lltok = self.lltokenizer
            text = grammar_text(constraint)
        except GrammarError:
            self._forget(self._cache, constraint)
            raise
        except (ValueError, TypeError) as error:
            self._forget(self._cache, constraint)
            raise GrammarError(str(error), constraint.param) from None
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        with self._lock:
            self.num_compiled += 1
        if matcher.is_error():
            self._forget(self._cache, constraint)
            raise GrammarError(short(matcher.get_error()), constraint.param)
        return matcher

    def _forget(self, cache: OrderedDict, constraint: StructuredOutputs) -> None:
        """Failed compiles are not cached: the next request with it gets its own error."""
        with self._lock:
            cache.pop(constraint.key, None)

    def take_stats(self) -> tuple[int, int, list[float]]:
        """(checks, cache hits, seconds of each sandbox compile since the last call)."""
        with self._lock:
            seconds, self.stats.compile_seconds = self.stats.compile_seconds, []
            return self.stats.queries, self.stats.hits, seconds

    @property
    def sandbox_pids(self) -> list[int]:
        return self._sandbox.pids if self._sandbox is not None else []

    def close(self) -> None:
        self._pool.shutdown()
        if self._waiters is not None:
            self._waiters.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()


class _StackPool:
    """A few daemon threads with a stack of their own size (ThreadPoolExecutor cannot set
    one): the engine core's compiles run here, with COMPILE_STACK_RATIO times the stack the
    sandbox proved a constraint to need."""

    def __init__(self, num_threads: int, stack_bytes: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._num_threads = num_threads
        self._stack_bytes = stack_bytes
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        with self._lock:
            if len(self._threads) < self._num_threads:  # started on first use
                old = threading.stack_size(self._stack_bytes)
                try:
                    thread = threading.Thread(
                        target=self._run, name="conveyor-grammar", daemon=True
                    )
                    thread.start()
                finally:
                    threading.stack_size(old)
                self._threads.append(thread)
        return future

    def _run(self) -> None:
        _lower_priority()
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the future's owner
                future.set_exception(error)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _lower_priority() -> None:
    """Compile threads yield the cores to the step loop: the model's threads (OpenMP) wait
    for their slowest member, so a compile competing with them at equal priority can stretch
    a step several times over, while at a lower one it runs in the gaps between steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: equal priority then
        pass


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
