"""ReasoningPhase: where a reply's reasoning ends, in token ids, for the engine core.

A request whose reasoning the server parses (SamplingParams.reasoning) and that either has a
thinking budget or a grammar gets one. With a budget, once the reasoning holds that many
tokens the sampler is made to write the closing marker (its tokens one per step, whatever the
logits say), so the reply goes on to its answer; with a grammar (structured output, a JSON
schema), the reasoning is free text and the grammar applies from the token after the closing
marker, so a model trained to think first still can.

The markers are matched as the token ids the server's tokenizer encodes them as
(ReasoningBounds.opening_ids / closing_ids), as vLLM's thinking budget matches them: the
families' markers are single special tokens (Qwen3's <think>, Mistral's [THINK]). A marker the
model spells in other tokens is not seen here, though the reply's parser still reads it as
text: a budget then forces the marker once spent, and a grammar waits for it.

States:

    head       the reply may still open its reasoning: its tokens so far are a proper prefix
               of an opening marker (a grammar's mask lets the next marker token through too);
               a token that is no marker's ends the head, which is then the answer's start
    reasoning  counted (the opening marker not), until its tokens end with a closing marker;
               a prompt that opened the block (ReasoningBounds.opened) starts here
    answer     what follows the closing marker; a grammar applies from here on. When the
               budget forced the closing marker and no grammar writes the answer's start, the
               format's forced tail (ReasoningBounds.forced_tail_ids: harmony's final-channel
               header) is forced first

A grammar that may itself write an opening marker first (a `choice` or regex that spells a
whole reply, reasoning and all) is not delayed: it shapes the whole reply (Request.attach_grammar).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.sampling_params import ReasoningBounds, SamplingParams

if TYPE_CHECKING:
    from conveyor.structured.grammar import Grammar

HEAD, REASONING, ANSWER = "head", "reasoning", "answer"


class ReasoningPhase:
    __slots__ = ("bounds", "state", "num_reasoning_tokens", "_head", "_recent", "_keep")
    __slots__ += ("_num_taken", "_committed", "_tail", "_tail_ids")

    def __init__(
        self, bounds: ReasoningBounds, prompt_token_ids: list[int] = (), grammar: bool = False
    ) -> None:
        self.bounds = bounds
        self.state = REASONING if bounds.opened_by(list(prompt_token_ids)) else HEAD
        self.num_reasoning_tokens = 0  # the reasoning's own, closing marker tokens included
        self._head: list[int] = []  # the head's tokens: a proper prefix of an opening marker
        self._recent: list[int] = []  # the reasoning's last tokens, as long as a closing marker
        self._keep = max(len(ids) for ids in bounds.closing_ids)
        self._num_taken = 0  # of the head's tokens, those the grammar took tentatively
        self._committed = False  # the grammar refused a head token: the marker must follow
        # the forced tail, when the budget ends the reasoning and no grammar writes its start
        self._tail_ids = () if grammar else bounds.forced_tail_ids
        self._tail: list[int] = []  # its tokens still to force, once in the answer

    @staticmethod
    def of(params: SamplingParams, prompt_token_ids: list[int] = ()) -> ReasoningPhase | None:
        """The phase a request needs: its reasoning is parsed in marked form, and a budget or
        a grammar depends on where it ends; None otherwise (the core then ignores it)."""
        bounds = params.reasoning
        if bounds is None or not bounds.closing_ids or not all(bounds.closing_ids):
            return None
        if bounds.budget is None and params.structured_outputs is None:
            return None
        return ReasoningPhase(bounds, prompt_token_ids, params.structured_outputs is not None)

    @property
    def answering(self) -> bool:
        return self.state == ANSWER

    @property
    def grammar_applies(self) -> bool:
        """Whether a grammar masks the next token (in the head, beside the opening marker)."""
        return self.state == ANSWER or (self.state == HEAD and not self._committed)

    def spelled_by(self, grammar: Grammar) -> bool:
        """Whether a fresh grammar may write an opening marker itself (the reply's head)."""
        if self.state != HEAD:
            return False
        openings = self.bounds.opening_ids
        return any(grammar.valid_prefix(list(ids), frozenset()) == len(ids) for ids in openings)

    def forced_token_id(self) -> int | None:
        """The token the next step must write: the closing marker's next one, once the
        budget is spent (a closing marker the model began itself is finished, not restarted)."""
        if self.state == HEAD and self._committed:
            return self.opening_token_id()  # the head is the marker's, not the grammar's
        if self.state == ANSWER:
            return self._tail[0] if self._tail else None
        budget = self.bounds.budget
        if self.state != REASONING or budget is None or self.num_reasoning_tokens < budget:
            return None
        closing = self.bounds.closing_ids[0]
        return closing[_begun(self._recent, closing)]

    def opening_token_id(self) -> int | None:
        """In the head: the next token of an opening marker that the head's tokens begin."""
        if self.state != HEAD:
            return None
        num = len(self._head)
        for ids in self.bounds.opening_ids:
            if len(ids) > num and list(ids[:num]) == self._head:
                return ids[num]
        return None

    def advance(self, token_id: int, grammar: Grammar | None = None) -> list[int]:
        """Takes the request's next output token; returns the tokens that the request's
        grammar is still to consume, in order: none while in the head or the reasoning, the
        head's tokens it did not take and this one when the head opens no reasoning."""
        if self.state == ANSWER:
            if self._tail:
                self._tail.pop(0)
            return [token_id]
        if self.state == HEAD:
            return self._advance_head(token_id, grammar)
        forced = self.forced_token_id() is not None
        self._recent = (self._recent + [token_id])[-self._keep :]
        if not forced:
            self.num_reasoning_tokens += 1
        if any(_ends_with(self._recent, ids) for ids in self.bounds.closing_ids):
            self.state = ANSWER
            self._tail = list(self._tail_ids) if forced else []
        return []

    def _advance_head(self, token_id: int, grammar: Grammar | None) -> list[int]:
        """The grammar takes each head token it allows as it comes, so that its mask reads
        what the answer would be so far (a marker and the answer may begin alike: `<`), and
        gives them back if the head opens the reasoning. Once it refuses one (`<th` where the
        answer is `<tool_call>`), the head can only be the marker: its rest is forced."""
        head = self._head + [token_id]
        if grammar is not None and not self._committed:
            if grammar.valid_prefix([token_id], frozenset()) == 1 and grammar.accept(token_id):
                self._num_taken += 1
            else:
                self._committed = True
        openings = self.bounds.opening_ids
        if any(list(ids) == head for ids in openings):
            if grammar is not None:
                grammar.take_back(self._num_taken)
            self.state, self._head, self._num_taken, self._committed = REASONING, [], 0, False
            return []
        if any(len(ids) > len(head) and list(ids[: len(head)]) == head for ids in openings):
            self._head = head
            return []
        taken, self._num_taken = self._num_taken, 0
        self.state, self._head = ANSWER, []
        return head[taken:]


def _ends_with(tokens: list[int], ids: tuple[int, ...]) -> bool:
    return len(tokens) >= len(ids) and tuple(tokens[len(tokens) - len(ids) :]) == ids


def _begun(tokens: list[int], ids: tuple[int, ...]) -> int:
    """How many of `ids` the tokens end with: the longest proper prefix of ids they end with."""
    for num in range(min(len(ids) - 1, len(tokens)), 0, -1):
        if tuple(tokens[len(tokens) - num :]) == ids[:num]:
            return num
    return 0
