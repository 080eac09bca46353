"""Incremental detokenization and stop-string matching for one streamed request.

Generated text only ever grows: each token appends the text it completes, and a token that leaves
a UTF-8 sequence unfinished appends nothing until a later token completes it. On top of that text:

    output_text:  |<------ returned by get_delta ------>|<- held back ->|
                                                        ^ _num_sent     ^ _num_chars

The held-back tail is the longest suffix (at most len(longest stop) - 1 chars) that is still a
proper prefix of some stop string, so a streamed delta never shows text a stop string removes.

A request whose reasoning the server parses (params.reasoning) has its stop strings matched in
the answer only, the text after the reasoning's closing marker (_ReasoningGate): a stop string
the model writes while it thinks does not end the reply. Stop tokens and EOS are the core's, and
end it wherever they come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from conveyor.sampling_params import ReasoningBounds, SamplingParams

# Prompt tokens decoded as context before the first generated token (vLLM primes with 4 to 24),
# so e.g. a SentencePiece leading space is kept, as decode(prompt + output) would.
MIN_CONTEXT_TOKENS = 4
MAX_CONTEXT_TOKENS = 24
REPLACEMENT_CHAR = "\ufffd"
# Output text lives in sealed head pieces plus a short recent string that keeps the last
# RECENT_KEEP chars after each roll, so stop checks and deltas slice a small string per step.
RECENT_ROLL = 1024
RECENT_KEEP = 256
_INVALID_PREFIX = "Invalid prefix"


class _TokenDecoder(Protocol):
    def step(self, token_id: int) -> str | None: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, stop strings and streamed deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        if tokenizer is None:  # skip_tokenizer_init: token ids in, token ids out, no text
            self._backend, self._decoder = None, _NoText()
        else:
            self._backend = _backend_of(tokenizer)
            self._decoder = _make_decoder(
                tokenizer, self._backend, prompt_token_ids, params.skip_special_tokens
            )
        self._stops = list(params.stop_strings)
        self._stop_first_chars = {stop[0] for stop in self._stops}
        self._max_hold = max((len(stop) for stop in self._stops), default=1) - 1
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._head: list[str] = []
        self._recent = ""
        self._num_chars = 0
        self._num_sent = 0
        self._num_checked = 0  # stop matches ending at or before this char were looked for
        reasoning = params.reasoning
        self._gate = (
            _ReasoningGate(reasoning, reasoning.opened_by(prompt_token_ids)) if reasoning else None
        )
        self._stopped = False

    @property
    def output_text(self) -> str:
        if len(self._head) > 1:
            self._head = ["".join(self._head)]
        return self._head[0] + self._recent if self._head else self._recent

    @property
    def num_tokens(self) -> int:
        """Tokens taken so far (update() stops taking them at a stop string)."""
        return self._num_tokens

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated tokens. Returns the stop string if one now matched; the text is then
        truncated (stop string excluded unless include_stop_str_in_output) and the request must
        not be updated again."""
        assert not self._stopped, "update() after a stop string matched"
        for token_id in new_token_ids:
            self._num_tokens += 1
            piece = self._decoder.step(token_id)
            stop = self._take(piece) if piece else None
            if stop is not None:
                return stop
        return None

    def finish(self) -> str | None:
        """The request ended without a stop string (EOS, length, abort). Text held back as an
        unfinished UTF-8 sequence is appended as the tokenizer's full decode shows it (U+FFFD for
        the broken bytes), so no complete character before it is lost. Returns a stop string
        if one now matched."""
        if self._stopped:
            return None
        piece = self._decoder.flush()
        return self._take(piece) if piece else None

    def get_delta(self, finished: bool) -> str:
        """Text not returned before; while unfinished, minus a tail a stop string could claim."""
        end = self._num_chars
        if not (finished or self._stopped):
            end -= self._num_held_back()
        if end <= self._num_sent:
            return ""
        delta = self._tail(self._num_chars - self._num_sent)[: end - self._num_sent]
        self._num_sent = end
        return delta

    def decode_token(self, token_id: int) -> str | None:
        """One token's own text, for logprobs; special tokens are shown, a lone byte is U+FFFD
        (None without a tokenizer)."""
        if self._tokenizer is None:
            return None
        if self._backend is not None:
            return self._backend.decode([token_id], skip_special_tokens=False)
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _take(self, piece: str) -> str | None:
        """Appends a piece of text; returns the stop string that now ends the reply, if any."""
        self._append(piece)
        if self._gate is not None:
            self._gate.feed(piece)
        answer = self._answer_start()
        if answer is None:
            return None  # the answer has not begun: what comes so far is never matched
        # Like vLLM, stop strings count only once min_tokens tokens exist.
        stop = None
        if self._stops and self._num_tokens >= self._min_tokens:
            stop = self._match_stop(max(self._num_checked, answer), answer)
        self._num_checked = self._num_chars
        return stop

    def _answer_start(self) -> int | None:
        """Where stop strings may match from; None while that is not known yet."""
        return 0 if self._gate is None else self._gate.answer_start

    def _match_stop(self, start: int, answer: int) -> str | None:
        # Only matches that end after start are new; older ones were checked before (or
        # ignored under min_tokens), so each search starts where such a match could begin,
        # and never before the answer's start.
        num_new_chars = self._num_chars - start
        num_old = min(self._max_hold, start - answer)
        window = self._tail(num_old + num_new_chars)
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop, max(0, num_old - len(stop) + 1))
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        if best is None:
            return None
        start, length, stop = best
        match_start = self._num_chars - len(window) + start
        self._truncate(match_start + length if self._include_stop else match_start)
        self._stopped = True
        return stop

    def _truncate(self, num_chars: int) -> None:
        assert self._num_sent <= num_chars, "a streamed delta included text past a stop string"
        self._recent = self.output_text[:num_chars]
        self._head = []
        self._num_chars = num_chars

    def _num_held_back(self) -> int:
        """Length of the longest output suffix that is a proper prefix of some stop string."""
        floor = 0 if self._gate is None else self._gate.hold_floor(self._num_chars)
        if floor is None:
            return self._num_chars if self._stops else 0
        tail = self._tail(min(self._max_hold, self._num_chars - floor))
        for start, char in enumerate(tail):
            if char in self._stop_first_chars:
                suffix = tail[start:]
                if any(stop.startswith(suffix) for stop in self._stops):
                    return len(suffix)
        return 0

    def _append(self, piece: str) -> None:
        self._recent += piece
        self._num_chars += len(piece)
        if len(self._recent) > RECENT_ROLL:
            self._head.append(self._recent[:-RECENT_KEEP])
            self._recent = self._recent[-RECENT_KEEP:]

    def _tail(self, num_chars: int) -> str:
        """The last num_chars chars of the output; joins the head only when asked for more than
        the recent string holds (a long unread delta or a stop string over RECENT_KEEP chars)."""
        if num_chars <= len(self._recent):
            return self._recent[len(self._recent) - num_chars :]
        text = self.output_text
        return text[max(0, len(text) - num_chars) :]


class _ReasoningGate:
    """Finds where a reply's answer starts, reading its text as the server's reasoning parser
    does (ReasoningBounds): fed each piece once, it keeps a marker's length of text at most.

    States: head (the reply's start, until it is known whether it opens reasoning), reasoning
    (until a closing marker), answer (answer_start is then set)."""

    __slots__ = ("_bounds", "_state", "_head", "_carry", "_num_seen", "answer_start")

    def __init__(self, bounds: ReasoningBounds, opened: bool) -> None:
        self._bounds = bounds
        self._state = _REASONING if opened else _HEAD
        self._head = ""  # the head from its first non-blank, shorter than an opening marker
        self._carry = ""  # the reasoning's last chars, which may begin a closing marker
        self._num_seen = 0
        self.answer_start: int | None = None

    def feed(self, piece: str) -> None:
        offset = self._num_seen  # the piece's first char, in the whole reply
        self._num_seen += len(piece)
        if self._state == _HEAD:
            piece, offset = self._feed_head(piece, offset)
        if self._state == _REASONING:
            self._feed_reasoning(piece, offset)

    def hold_floor(self, num_chars: int) -> int | None:
        """Where a held-back tail may begin: no stop string claims reasoning text. None: hold
        back all, the head (blanks, then less than a marker) is not matched until it is read."""
        if self._state == _HEAD:
            return None
        return num_chars if self._state == _REASONING else self.answer_start

    def _feed_head(self, piece: str, offset: int) -> tuple[str, int]:
        """Reads the head; returns the text after an opening marker (and its offset)."""
        if not self._head:
            stripped = piece.lstrip()
            offset += len(piece) - len(stripped)
            piece = stripped
        head_offset = offset - len(self._head)
        self._head += piece
        if not self._head:
            return "", offset
        for marker in self._bounds.opening:
            if self._head.startswith(marker):
                self._state = _REASONING
                return self._head[len(marker) :], head_offset + len(marker)
        if not any(marker.startswith(self._head) for marker in self._bounds.opening):
            self._state, self.answer_start = _ANSWER, 0
        return "", offset

    def _feed_reasoning(self, text: str, offset: int) -> None:
        window, start = self._carry + text, offset - len(self._carry)
        found = [(window.find(m), -len(m)) for m in self._bounds.closing if m in window]
        if found:
            index, minus_length = min(found)
            self._state, self.answer_start = _ANSWER, start + index - minus_length
            return
        keep = max(len(m) for m in self._bounds.closing) - 1
        self._carry = window[-keep:] if keep > 0 else ""


_HEAD, _REASONING, _ANSWER = "head", "reasoning", "answer"


class _NoText:
    """The decoder of an engine without a tokenizer: every token adds no text."""

    def step(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class _StreamDecoder:
    """tokenizers' DecodeStream: decodes a short id window per step, in Rust."""

    def __init__(self, backend: Tokenizer, context_ids: list[int], skip_special: bool) -> None:
        self._backend = backend
        self._skip_special = skip_special
        self._stream = DecodeStream(context_ids, skip_special_tokens=skip_special)
        # For flush(): a few ids already emitted (decoding context) and those not yet emitted.
        self._emitted = list(context_ids[-MIN_CONTEXT_TOKENS:])
        self._pending: list[int] = []

    def step(self, token_id: int) -> str | None:
        self._pending.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as error:
            # DecodeStream's state breaks when lossy decoding of invalid UTF-8 makes the text
            # non-monotonic (vllm-project/vllm#17448); restart without context, as vLLM does.
            if _INVALID_PREFIX not in str(error):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            self._emitted, self._pending = [], [token_id]
            piece = self._stream.step(self._backend, token_id)
        if piece:
            self._emitted = (self._emitted + self._pending)[-MIN_CONTEXT_TOKENS:]
            self._pending = []
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        decode = self._backend.decode
        prefix = decode(self._emitted, skip_special_tokens=self._skip_special)
        text = decode(self._emitted + self._pending, skip_special_tokens=self._skip_special)
        self._emitted, self._pending = [], []
        return text[len(prefix) :] if text.startswith(prefix) else text


class _WindowDecoder:
    """Fallback for tokenizers without a Rust backend: decodes ids[prefix:] against ids[prefix:read]
    and emits the difference once it no longer ends in U+FFFD (an unfinished UTF-8 sequence)."""

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids = list(context_ids)
        self._read = len(self._ids)  # ids before this index have been emitted (or are prompt)
        self._prefix_text = self._decode(self._ids)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return None
        new_text = text[len(self._prefix_text) :]
        # The ids just emitted become the next prefix; older ones are no longer needed.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def flush(self) -> str:
        if len(self._ids) <= self._read:
            return ""
        text = self._decode(self._ids)
        self._read = len(self._ids)
        return text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _backend_of(tokenizer: Any) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _make_decoder(
    tokenizer: Any, backend: Tokenizer | None, prompt_ids: list[int], skip_special: bool
) -> _TokenDecoder:
    decode = backend.decode if backend is not None else tokenizer.decode
    context_ids = _context_ids(
        prompt_ids, lambda ids: decode(ids, skip_special_tokens=skip_special)
    )
    if backend is not None:
        return _StreamDecoder(backend, context_ids, skip_special)
    return _WindowDecoder(tokenizer, context_ids, skip_special)


def _context_ids(prompt_ids: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The shortest prompt tail (4 to 24 tokens) that decodes to whole characters: a tail that
    ends inside a UTF-8 sequence would make the first output text wrong, so it gets none."""
    for num_ids in range(min(MIN_CONTEXT_TOKENS, len(prompt_ids)), len(prompt_ids) + 1):
        if num_ids > MAX_CONTEXT_TOKENS:
            break
        tail = prompt_ids[len(prompt_ids) - num_ids :]
        if REPLACEMENT_CHAR not in decode(tail):
            return tail
    return []
