"""A request's grammar state and the token bitmask of a step.

Grammar wraps one request's llguidance matcher. It is advanced only with tokens the request
keeps (its own token and accepted drafts, never a rejected draft), and never with a stop
token: the model's EOS ids and the request's stop_token_ids end the request in the
scheduler, so the matcher counts exactly the request's content tokens.

The bitmask has one row of ceil(V / 32) int32 words per constrained logits row; bit t set
means token t is allowed. Rows after drafts (speculative decoding) are filled with the drafts
tentatively consumed and then rolled back. Token ids beyond the tokenizer (a padded
vocabulary) are never allowed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from conveyor.structured.sandbox import short

NEG_INF = float("-inf")


class Grammar:
    __slots__ = ("matcher", "stop_token_ids", "vocab_size", "num_consumed")

    def __init__(
        self, matcher: Any, stop_token_ids: list[int] | None = None, vocab_size: int = 0
    ) -> None:
        self.matcher = matcher  # the request's own copy
        # The request's stop_token_ids: allowed wherever the grammar may end, as EOS is.
        self.stop_token_ids = [t for t in stop_token_ids or ()]
        # llguidance's vocabulary (a bitmask row must have exactly its words); it may exceed
        # the logits' width when a tokenizer has more tokens than the model has logits.
        self.vocab_size = vocab_size
        self.num_consumed = 0

    @property
    def is_terminated(self) -> bool:
        """The output is complete and nothing may follow it."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete (it may still go on)."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher gave up, on one line (llguidance's dumps cut: sandbox.short)."""
        return short(self.matcher.get_error()) if self.matcher.is_error() else None

    def accept(self, token_id: int) -> bool:
        """Advances by one content token; False if the grammar forbids it."""
        ok = self.matcher.consume_token(token_id)
        self.num_consumed += ok
        return bool(ok)

    def take_back(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted (a reply's head that opened its reasoning)."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")
        self.num_consumed -= num_tokens

    def valid_prefix(self, token_ids: list[int], stops: frozenset[int]) -> int:
        """How many of `token_ids` (drafts) the grammar accepts in turn, without changing its
        state: up to the first one it forbids, or the first stop token (which, accepted,
        ends the request)."""
        count = 0
        for token_id in token_ids:
            if token_id in stops:
                break
            count += 1
        if count == 0 or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(token_ids[:count])

    def fill(self, bitmask: np.ndarray, row: int, drafts: list[int], stops: frozenset[int]) -> None:
        """Rows row .. row + len(drafts): the allowed tokens after each prefix of the drafts.
        Rows after a draft the grammar forbids (or after a stop token) are left as they are:
        that draft is banned in the row before, so verification never reaches them. Only
        drafts known to be valid are consumed: a refused token would leave the matcher in
        its (sticky) error state."""
        import llguidance.numpy as lnp

        matcher = self.matcher
        num_valid = self.valid_prefix(drafts, stops) if drafts else 0
        for j in range(num_valid + 1):
            lnp.fill_next_token_bitmask(matcher, bitmask, row + j)
            if self.stop_token_ids and matcher.is_accepting():
                allow(bitmask, row + j, self.stop_token_ids)
            if j < num_valid and not matcher.consume_token(drafts[j]):
                raise RuntimeError(f"grammar refused a validated draft: {matcher.get_error()}")
        if num_valid and not matcher.rollback(num_valid):
            raise RuntimeError(f"grammar rollback failed: {matcher.get_error()}")


def allow(bitmask: np.ndarray, row: int, token_ids: list[int]) -> None:
    words = bitmask.view(np.uint32)
    for token_id in token_ids:
        if token_id < words.shape[1] * 32:
            words[row, token_id >> 5] |= np.uint32(1 << (token_id & 31))


def new_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """All tokens allowed: rows nobody fills constrain nothing."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


_EXECUTOR = None


def _executor():
    """llguidance's pool for filling many rows at once (two threads: this machine's cores)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(num_threads=2)
    return _EXECUTOR


class StepMask(NamedTuple):
    """The bitmask of a step's constrained logits rows: bitmask row k is logits row rows[k]."""

    rows: list[int]
    bitmask: np.ndarray


def step_mask(
    grammars: list[Grammar | None],
    vocab_size: int,
    drafts: list[list[int]] | None = None,
    stops: list[frozenset[int]] | None = None,
) -> StepMask | None:
    """The mask of one step, None when no request is constrained. grammars[i] is request i's;
    without drafts request i has logits row i, with drafts rows for each of its drafts and
    one more, in order (stops[i]: the tokens that end request i)."""
    constrained = [i for i, g in enumerate(grammars) if g is not None]
    if not constrained:
        return None
    vocab_size = max(vocab_size, *(grammars[i].vocab_size for i in constrained))
    if drafts is None or not any(drafts[i] for i in constrained):
        bitmask = new_bitmask(len(constrained), vocab_size)
        chosen = [grammars[i] for i in constrained]
        if len(chosen) > 1:
            import llguidance.numpy as lnp

            pairs = [(g.matcher, k) for k, g in enumerate(chosen)]
            lnp.fill_next_token_bitmask_par(_executor(), pairs, bitmask)
            for k, grammar in enumerate(chosen):
                if grammar.stop_token_ids and grammar.matcher.is_accepting():
                    allow(bitmask, k, grammar.stop_token_ids)
        else:
            chosen[0].fill(bitmask, 0, [], frozenset())
        if drafts is None:
            return StepMask(constrained, bitmask)
        starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
        return StepMask([starts[i] for i in constrained], bitmask)
    starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
    rows = [r for i in constrained for r in range(starts[i], starts[i + 1])]
    bitmask = new_bitmask(len(rows), vocab_size)
    k = 0
    for i in constrained:
        grammars[i].fill(bitmask, k, drafts[i], stops[i])
        k += 1 + len(drafts[i])
    return StepMask(rows, bitmask)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: logits of `rows` whose token is not allowed by its bitmask row become -inf
    (bitmask row k belongs to logits row rows[k]); columns beyond the mask too."""
    vocab = logits.shape[1]
    # The inverted words unpacked are the banned tokens, as bools without another pass.
    banned = np.unpackbits((~bitmask).view(np.uint8), axis=1, count=vocab, bitorder="little").view(
        np.bool_
    )
    banned = torch.from_numpy(banned).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(banned, NEG_INF)
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(banned, NEG_INF)
