"""Untrusted grammars are compiled first in a sandbox: a worker process that can crash or be
killed without taking anyone else with it.

A request's schema, regex or grammar is untrusted input, and llguidance's compiler recurses
in native code: a chain of ~3,000 Lark rules or $refs overflows a thread's stack (SIGSEGV,
which no Python code can catch), and a schema of 10,000 optional properties compiles for
minutes. So the front end never compiles one in its own process. Each constraint goes to a
worker of this pool, which compiles it (and computes its first token mask) under a memory
limit, a smaller stack than the engine core's compile threads, and a deadline at which it is
killed. Its verdict is the request's: a grammar error, a crash or the deadline is a 400 for
that request alone, and a dead worker is replaced. Only a constraint the sandbox compiled
reaches the engine core, which compiles it once more for its own matcher, on threads whose
stack is many times the sandbox's (see backend.GrammarCompiler): the same compile, proven
to finish.

The worker is this file run as a script. It imports llguidance and nothing of conveyor, so
it starts in ~0.3 s; it reads length-prefixed JSON messages on stdin and answers on stdout:

    setup   {"tokenizer_file", "tokenizer_dir", "n_vocab", "eos", "memory_bytes"}
            -> {"ready": true} | {"ready": false, "error": "..."} (then it exits)
    check   {"kind", "text"} -> {"error": null | "...", "seconds": float}
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence

# Fixed by the server, after the schema's own "x-guidance" options, so no request can loosen it.
JSON_OVERRIDES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The sandbox compiles on a thread with this stack; the engine core's compile threads have
# COMPILE_STACK_RATIO times more, so what fits here fits there with room to spare.
SANDBOX_STACK_BYTES = 16 << 20
COMPILE_STACK_RATIO = 8
DEFAULT_MEMORY_BYTES = 4 << 30  # address space of a worker (its tokenizer takes ~100 MB)
DEFAULT_WORKERS = 4
WORKER_NICENESS = 10  # compiles run in the gaps between the model's steps
START_TIMEOUT = 60.0
_HEADER = struct.Struct(">I")


class CompileRefused(Exception):
    """The sandbox refused a constraint: it does not compile, crashed the compiler, or did
    not finish in time. `detail` says which, in words fit for the client."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class BackendUnavailable(Exception):
    """No worker can be started: llguidance cannot read this model's tokenizer (or is not
    installed). Structured output is then off for the model; nothing else is."""


# ---- shared with the engine core (it imports these; they import only llguidance) ----------


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar (a JSON string) for a constraint's (kind, text) key."""
    import llguidance

    if kind == "json":  # its JSON text: parsed in Rust, ~4x faster than from a dict
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OVERRIDES)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OVERRIDES
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # One regex lexeme of the alternatives, not llguidance's choice grammar (a rule
        # alternative each): that one fills a parser row with every alternative, and from
        # 2,000 of them it gives up at the first token. The lexer takes 10,000 in 30 ms.
        alternatives = "|".join(regex_literal(c) for c in json.loads(text))
        return llguidance.LLMatcher.grammar_from_regex(f"({alternatives})")
    return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark


# The characters a regex (llguidance's syntax: Rust's regex-syntax) gives a meaning to.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def regex_literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def build_lltokenizer(tokenizer_file: str | None, load_hf, n_vocab: int, eos: Sequence[int]):
    """llguidance's tokenizer: from tokenizer.json (read in Rust, ~3x faster), else from the
    Hugging Face tokenizer that load_hf() returns. Raises whatever llguidance raises for a
    tokenizer it cannot read (e.g. ValueError: can't determine decoder type)."""
    import llguidance

    if tokenizer_file and os.path.isfile(tokenizer_file):
        try:
            return llguidance.LLTokenizer(tokenizer_file, n_vocab=n_vocab, eos_token=list(eos))
        except ValueError:  # more tokens than logits, or a format it cannot read
            pass
    import llguidance.hf

    hf = load_hf()
    return llguidance.hf.from_tokenizer(hf, n_vocab=max(n_vocab, len(hf)), eos_token=list(eos))


# llguidance's stop reasons, when one is all its error says.
_NO_TEXT = "no text satisfies the constraint from here (e.g. a schema whose every instance "
_NO_TEXT += "nests forever)"
_TOO_COMPLEX = "the constraint is too complex for the grammar engine to follow"
_TOO_LONG = "the constraint ran past the grammar engine's token limit"
_STOP_REASONS = {
    "NoExtension": _NO_TEXT,
    "NoExtensionBias": _NO_TEXT,
    "ParserTooComplex": _TOO_COMPLEX,
    "LexerTooComplex": _TOO_COMPLEX,
    "MaxTokensParser": _TOO_LONG,
    "MaxTokensTotal": _TOO_LONG,
}


def short(message: str, limit: int = 500) -> str:
    """An error for the client, on one line. llguidance appends a dump of its parser state and
    of the grammar (<state>...</state><grammar>...</grammar>): the client sent the grammar, and
    the state is for llguidance's own debugging, so both are cut; a bare stop reason
    (NoExtensionBias) is put in words."""
    message = str(message)
    for tag in ("<state>", "<grammar>"):
        message = message.split(tag, 1)[0]
    message = " ".join(message.split()).rstrip(" (")
    if message in _STOP_REASONS:
        message = f"{_STOP_REASONS[message]} (llguidance: {message})"
    return message if len(message) <= limit else message[: limit - 3] + "..."


# ---- the pool (front end side) -------------------------------------------------------------


class Sandbox:
    """Up to max_workers worker processes; check() borrows an idle one (or starts one) for
    one constraint. Thread-safe; blocks its caller for at most the given timeout."""

    def __init__(
        self,
        tokenizer_file: str | None,
        tokenizer_dir: str | None,
        n_vocab: int,
        eos: Sequence[int],
        max_workers: int = DEFAULT_WORKERS,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        self._setup = {
            "tokenizer_file": str(tokenizer_file) if tokenizer_file else None,
            "tokenizer_dir": str(tokenizer_dir) if tokenizer_dir else None,
            "n_vocab": int(n_vocab),
            "eos": [int(t) for t in eos],
            "memory_bytes": int(memory_bytes),
        }
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self.unavailable: str | None = None  # why no worker can start, once known
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def start(self) -> None:
        """Starts one worker ahead of the first constraint (in the background)."""
        threading.Thread(target=self._warm, name="conveyor-sandbox-start", daemon=True).start()

    def _warm(self) -> None:
        try:
            worker = self._spawn()
        except (BackendUnavailable, CompileRefused):
            return
        with self._lock:
            self._idle.append(worker)

    def check(self, kind: str, text: str, timeout: float) -> float:
        """Compiles (kind, text) in a worker; returns the compile's seconds. Raises
        CompileRefused (the constraint's fault) or BackendUnavailable."""
        if self.unavailable is not None:
            raise BackendUnavailable(self.unavailable)
        if not self._slots.acquire(timeout=timeout):
            raise CompileRefused(f"the grammar did not compile within {timeout:g} s")
        try:
            worker = self._take()
            deadline = time.monotonic() + timeout  # the compile's own time, from here
            try:
                reply = worker.ask({"kind": kind, "text": text}, deadline)
            except TimeoutError:
                self._discard(worker)
                raise CompileRefused(
                    f"the grammar did not compile within {timeout:g} s (its compile was stopped)"
                ) from None
            except (EOFError, ValueError):
                how = worker.death()
                self._discard(worker)
                raise CompileRefused(f"compiling it crashed the grammar compiler ({how})") from None
            with self._lock:
                self._idle.append(worker)
        finally:
            self._slots.release()
        if reply.get("error"):
            raise CompileRefused(str(reply["error"]))
        return float(reply.get("seconds", 0.0))

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                self._all.discard(worker)
        return self._spawn()

    def _spawn(self) -> _Worker:
        worker = _Worker()
        with self._lock:
            self._all.add(worker)
        try:
            reply = worker.ask(self._setup, time.monotonic() + START_TIMEOUT)
        except (TimeoutError, EOFError, ValueError):
            how = "it did not answer in time" if worker.alive else worker.death()
            self._discard(worker)
            raise CompileRefused(f"the grammar worker did not start ({how})") from None
        if not reply.get("ready"):
            self._discard(worker)
            self.unavailable = str(reply.get("error") or "the grammar worker did not start")
            raise BackendUnavailable(self.unavailable)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [worker.proc.pid for worker in self._all]

    def close(self) -> None:
        self._finalizer()


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


class _Worker:
    """One worker process and its two pipes; used by one caller at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-s", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            env=_worker_env(),
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, message: dict, deadline: float) -> dict:
        """Sends one message and waits for the answer until the deadline. TimeoutError at
        the deadline (the caller kills the worker), EOFError if the worker died."""
        data = json.dumps(message).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it died
            raise EOFError from None
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return json.loads(self._read(size, deadline))

    def death(self) -> str:
        """How the worker ended, in words (after EOFError)."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        return _how(code)

    def _read(self, size: int, deadline: float) -> bytes:
        out = self.proc.stdout
        chunks, left = [], size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError
            ready, _, _ = select.select([out], [], [], wait)
            if not ready:
                raise TimeoutError
            chunk = os.read(out.fileno(), left)
            if not chunk:
                self.proc.wait()
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # One thread each: a compile is single-threaded, and the model owns the cores.
    env.update(OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


# ---- the worker (this file run as a script) ------------------------------------------------


def _serve() -> None:
    _die_with_parent()
    try:
        os.nice(WORKER_NICENESS)
    except OSError:
        pass
    setup = _receive()
    if setup is None:
        return
    _limit_memory(setup["memory_bytes"])
    try:
        tokenizer = build_lltokenizer(
            setup["tokenizer_file"],
            lambda: _load_hf(setup["tokenizer_dir"]),
            setup["n_vocab"],
            setup["eos"],
        )
    except Exception as error:  # noqa: BLE001 - any failure means "unavailable", said once
        _send({"ready": False, "error": short(f"{type(error).__name__}: {error}")})
        return
    _send({"ready": True})
    while (message := _receive()) is not None:
        _send(_check(tokenizer, message["kind"], message["text"]))


def _check(tokenizer, kind: str, text: str) -> dict:
    """Compiles on a thread with the sandbox's stack, as the engine core would (plus its
    first token mask, which builds the lexer's first states)."""
    result: dict = {"error": "the compile thread ended without an answer"}

    def run() -> None:
        import llguidance
        import llguidance.numpy as lnp

        start = time.perf_counter()
        try:
            grammar = grammar_text(kind, text)
        except (ValueError, TypeError) as error:
            result["error"] = short(str(error))
            return
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            bitmask = lnp.allocate_token_bitmask(1, tokenizer.vocab_size)
            lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            result["error"] = short(matcher.get_error())
        else:
            result.update(error=None, seconds=time.perf_counter() - start)

    old = threading.stack_size(SANDBOX_STACK_BYTES)
    try:
        thread = threading.Thread(target=run, name="conveyor-sandbox-compile")
        thread.start()
    finally:
        threading.stack_size(old)
    thread.join()
    return result


def _load_hf(directory: str | None):
    if not directory:
        raise ValueError("no tokenizer.json llguidance can read, and no tokenizer folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _die_with_parent() -> None:
    """Exits when the process that started us dies, so a killed server leaves no worker
    compiling on. (Not PR_SET_PDEATHSIG: that fires when the parent's *thread* that spawned
    us ends, and workers are spawned from short-lived threads.) The compile thread drops the
    interpreter lock in llguidance, so this watch runs even mid-compile."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="conveyor-sandbox-watch", daemon=True).start()


def _limit_memory(limit: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def _receive() -> dict | None:
    stdin = sys.stdin.buffer
    header = stdin.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    return json.loads(stdin.read(size))


def _send(message: dict) -> None:
    data = json.dumps(message).encode()
    sys.stdout.buffer.write(_HEADER.pack(len(data)) + data)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve()
