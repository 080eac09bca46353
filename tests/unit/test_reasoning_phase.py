"""ReasoningPhase (the engine core's view of where a reply's reasoning ends, by token ids) and
what the sampler does with it: a spent thinking budget forces the closing marker, token by
token; a grammar applies from the token after it, and lets the opening marker through while
the reply may still open its reasoning."""

from __future__ import annotations

import numpy as np
import torch

from conveyor.outputs import SamplingRow
from conveyor.sample.reasoning import ReasoningPhase
from conveyor.sample.sampler import Sampler
from conveyor.sampling_params import ReasoningBounds, SamplingParams
from conveyor.structured.grammar import StepMask, new_bitmask
from conveyor.structured.params import StructuredOutputs

OPEN, CLOSE = (1, 2), (3, 4, 5)  # markers of two and three tokens


def phase(budget: int | None = None, opened: bool = False) -> ReasoningPhase:
    bounds = ReasoningBounds(("<t>",), ("</t>",), opened, (OPEN,), (CLOSE,), budget)
    return ReasoningPhase(bounds)


def run(state: ReasoningPhase, model: list[int]) -> tuple[list[int], list[int]]:
    """The reply the phase makes of what the model would write (each forced token replaces
    the model's next), and the tokens it hands a grammar."""
    reply, answer, model = [], [], list(model)
    while model:
        forced = state.forced_token_id()
        token = forced if forced is not None else model.pop(0)
        reply.append(token)
        answer += state.advance(token)
    return reply, answer


def test_a_spent_budget_forces_every_token_of_the_closing_marker():
    reply, answer = run(phase(budget=2), [*OPEN, 7, 8, 9, 9, 6])
    assert reply == [*OPEN, 7, 8, *CLOSE, 9, 9, 6]
    assert answer == [9, 9, 6]


def test_budget_zero_closes_at_once_and_a_prompt_that_opened_counts_from_the_start():
    assert run(phase(budget=0), [*OPEN, 7, 6]) == ([*OPEN, *CLOSE, 7, 6], [7, 6])
    assert run(phase(budget=1, opened=True), [7, 8, 6]) == ([7, *CLOSE, 8, 6], [8, 6])


def test_a_closing_marker_the_model_began_is_finished_not_restarted():
    reply, _ = run(phase(budget=3), [*OPEN, 7, 3, 4, 9])
    assert reply == [*OPEN, 7, 3, 4, 5, 9]


def test_a_reasoning_closed_within_the_budget_is_left_alone():
    state = phase(budget=10)
    assert run(state, [*OPEN, 7, *CLOSE, 6]) == ([*OPEN, 7, *CLOSE, 6], [6])
    assert state.answering and state.forced_token_id() is None


TAIL = (10, 11)  # a format's answer header (harmony's <|channel|>final<|message|>)


def tailed(budget: int, grammar: bool = False) -> ReasoningPhase:
    bounds = ReasoningBounds(("<t>",), ("</t>",), False, (OPEN,), (CLOSE,), budget, "h", TAIL)
    return ReasoningPhase(bounds, grammar=grammar)


def test_a_spent_budget_forces_the_formats_answer_header_after_the_closing_marker():
    reply, answer = run(tailed(budget=1), [*OPEN, 7, 8, 9])
    assert reply == [*OPEN, 7, *CLOSE, *TAIL, 8, 9]
    assert answer == [*TAIL, 8, 9]


def test_the_answer_header_is_the_grammars_or_the_models_own_when_not_forced():
    # a grammar writes the answer's start itself (harmony: a final or commentary header)
    assert run(tailed(budget=1, grammar=True), [*OPEN, 7, 8, 9])[0] == [*OPEN, 7, *CLOSE, 8, 9]
    # a reasoning the model closed itself goes on as the model writes it
    assert run(tailed(budget=5), [*OPEN, 7, *CLOSE, 8])[0] == [*OPEN, 7, *CLOSE, 8]


def test_a_reply_that_opens_no_reasoning_is_all_answer_its_head_included():
    state = phase(budget=0)
    assert state.opening_token_id() == 1 and state.grammar_applies
    assert state.advance(1) == [] and state.opening_token_id() == 2
    assert state.advance(6) == [1, 6] and state.answering
    assert state.opening_token_id() is None and state.forced_token_id() is None


def test_the_reasoning_is_not_the_grammars():
    state = phase(opened=True)
    assert not state.grammar_applies and state.advance(7) == []
    assert [state.advance(t) for t in CLOSE] == [[], [], []]
    assert state.grammar_applies and state.advance(6) == [6]


def test_a_phase_only_where_a_budget_or_a_grammar_needs_one():
    def of(budget=None, closing_ids=(CLOSE,), grammar=None):
        bounds = ReasoningBounds(("<t>",), ("</t>",), False, (OPEN,), closing_ids, budget)
        return ReasoningPhase.of(SamplingParams(reasoning=bounds, structured_outputs=grammar))

    assert of() is None
    assert of(grammar=StructuredOutputs(json_object=True)) is not None
    assert of(budget=3).bounds.budget == 3
    assert of(budget=3, closing_ids=()) is None  # markers the tokenizer could not encode
    assert ReasoningPhase.of(SamplingParams()) is None


def test_the_sampler_writes_the_forced_token_whatever_the_logits_and_params():
    logits = torch.randn(2, 16, dtype=torch.float64)
    params = SamplingParams(temperature=1.0, seed=1, min_tokens=5, logit_bias={"4": -100.0})
    rows = [SamplingRow(params, None, [], forced_token_id=4), SamplingRow(params, None, [])]
    processed = Sampler([0]).process_logits(logits, rows)
    assert torch.isinf(processed[0]).sum() == 15 and processed[0, 4] == 0
    assert torch.isfinite(processed[1]).sum() >= 14  # its neighbour untouched by the forcing
    assert Sampler([0])(logits, rows).token_ids[0] == 4


def test_a_grammar_lets_the_opening_marker_through_in_the_head():
    logits = torch.randn(2, 64, dtype=torch.float64)
    bitmask = new_bitmask(2, 64)
    bitmask[:] = 0
    bitmask.view(np.uint32)[:, 0] = 1 << 9  # the grammar allows token 9 only
    params = SamplingParams()
    rows = [SamplingRow(params, None, [], opening_token_id=1), SamplingRow(params, None, [])]
    processed = Sampler([0]).process_logits(logits, rows, StepMask([0, 1], bitmask))
    allowed = [torch.isfinite(processed[i]).nonzero().flatten().tolist() for i in range(2)]
    assert allowed == [[1, 9], [9]]
    assert processed[0, 1] == logits[0, 1]


class ListGrammar:
    """A grammar of one token sequence, with Grammar's methods the phase calls."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.num_consumed = tokens, 0

    def valid_prefix(self, token_ids: list[int], stops: frozenset[int]) -> int:
        rest = self.tokens[self.num_consumed :]
        return next(
            (i for i, t in enumerate(token_ids) if i >= len(rest) or rest[i] != t), len(token_ids)
        )

    def accept(self, token_id: int) -> bool:
        self.num_consumed += 1
        return True

    def take_back(self, num_tokens: int) -> None:
        self.num_consumed -= num_tokens


def test_a_head_token_the_answer_also_begins_with_is_the_grammars_until_the_marker_decides():
    # the answer 1 6 begins as the opening marker 1 2 does (`<tool_call>` and `<think>`)
    grammar, state = ListGrammar([1, 6]), phase()
    assert state.advance(1, grammar) == [] and grammar.num_consumed == 1  # taken tentatively
    assert state.advance(6, grammar) == [] and state.answering  # nothing left to consume
    grammar, state = ListGrammar([1, 6]), phase()
    assert [state.advance(t, grammar) for t in OPEN] == [[], []]
    assert grammar.num_consumed == 0 and not state.answering  # given back: it was the marker
    grammar, state = ListGrammar([6]), phase()
    assert state.advance(1, grammar) == [] and grammar.num_consumed == 0
    # refused by the grammar, the head can only be the marker: its rest is forced
    assert state.forced_token_id() == 2 and not state.grammar_applies
    assert state.advance(2, grammar) == [] and state.state == "reasoning"


def test_a_completions_prompt_opened_the_reasoning_when_its_last_marker_opens_it():
    bounds = ReasoningBounds(("<t>",), ("</t>",), None, (OPEN,), (CLOSE,), 0)
    assert bounds.opened_by([9, *OPEN, 7])
    assert not bounds.opened_by([9, *OPEN, 7, *CLOSE, 6])
    assert bounds.opened_by([*OPEN, *CLOSE, *OPEN])
    assert not bounds.opened_by([9, 1, 9, 2]) and not bounds.opened_by([])
    assert ReasoningPhase(bounds, [9, *OPEN]).state == "reasoning"
    assert ReasoningPhase(bounds, [9]).state == "head"
