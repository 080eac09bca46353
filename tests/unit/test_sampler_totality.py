"""The sampler is total: whatever a step's rows hold (penalties, bias, allowed and bad words,
min_tokens, top-k / top-p / min-p, logprobs, a grammar's mask; NaN, infinities, every token
banned), it never raises; a row with nothing to sample from is reported with why, and every
other row gets the bits it gets alone."""

from __future__ import annotations

import math

import llguidance
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.outputs import LOGITS_NOT_FINITE, NO_TOKEN_LEFT, PenaltyCounts, SamplingRow
from conveyor.sample.sampler import Sampler
from conveyor.sample.verifier import verify
from conveyor.sampling_params import SamplingParams
from conveyor.structured.backend import grammar_text
from conveyor.structured.grammar import Grammar, step_mask
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.sandbox import build_lltokenizer
from tests.tiny import build_tokenizer

EOS = 0
CONSTRAINTS = [
    StructuredOutputs(regex="[a-c]{1,4}"),
    StructuredOutputs(choice=["yes", "no"]),
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
]


@pytest.fixture(scope="module")
def world():
    """The tiny tokenizer's vocabulary and one real llguidance matcher per constraint."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    lltok = build_lltokenizer(None, lambda: tokenizer, vocab, [EOS])
    matchers = [llguidance.LLMatcher(lltok, grammar_text(c), log_level=0) for c in CONSTRAINTS]
    assert not any(m.is_error() for m in matchers)
    return vocab, matchers


SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@st.composite
def a_row(draw, vocab: int):
    """(params, output so far, prompt, grammar index or None, specials to write into the row's
    logits: (token, value) pairs, or 'all -inf' / 'all nan')."""
    ids = st.integers(0, vocab - 1)
    greedy = draw(st.booleans())
    params = dict(
        temperature=0.0 if greedy else draw(st.floats(0.05, 3.0)),
        top_k=draw(st.sampled_from([-1, 1, 2, 5, vocab])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3, 1e-6])),
        min_p=draw(st.sampled_from([0.0, 0.1, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.01, 1.3, 2.0])),
        presence_penalty=draw(st.sampled_from([0.0, -2.0, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 1.5])),
        min_tokens=draw(st.integers(0, 2)),
        max_tokens=8,
        logprobs=draw(st.none() | st.integers(0, 5)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(ids, max_size=2)),
        logit_bias=draw(st.none() | st.dictionaries(ids, st.floats(-100, 100), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(ids, min_size=1, max_size=4)),
        bad_words_token_ids=draw(st.none() | st.lists(st.lists(ids, min_size=1, max_size=2))),
    )
    output = draw(st.lists(ids, max_size=3))
    prompt = draw(st.lists(ids, max_size=4))
    grammar = draw(st.none() | st.integers(0, len(CONSTRAINTS) - 1))
    specials = draw(
        st.sampled_from(["none", "none", "all -inf", "all nan"])
        | st.lists(st.tuples(ids, SPECIAL), min_size=1, max_size=3)
    )
    return SamplingParams(**params), output, prompt, grammar, specials


def build(world, drawn, seed: int):
    """The SamplingRow and its raw logits row (float32, as the engine samples)."""
    vocab, matchers = world
    params, output, prompt, grammar_index, specials = drawn
    counts = None
    if params.has_penalties:
        counts = PenaltyCounts(prompt, vocab)
        for token in output:
            counts.add(token)
    grammar = None
    if grammar_index is not None:
        grammar = Grammar(matchers[grammar_index].deep_copy(), params.stop_token_ids, vocab)
    generator = torch.Generator().manual_seed(seed)
    row = SamplingRow(params, generator, list(output), counts, grammar)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed + 1)) * 4
    if specials == "all -inf":
        logits[:] = float("-inf")
    elif specials == "all nan":
        logits[:] = float("nan")
    elif specials != "none":
        for token, value in specials:
            logits[token] = value
    return row, logits


def fresh(world, drawn_rows, seeds):
    built = [build(world, d, s) for d, s in zip(drawn_rows, seeds, strict=True)]
    return [row for row, _ in built], torch.stack([logits for _, logits in built])


def processed_alone(sampler: Sampler, world, drawn, logits: torch.Tensor) -> torch.Tensor:
    """The row's logits after its own processing, its grammar's mask included."""
    rows, _ = fresh(world, [drawn], [0])
    mask = step_mask([r.grammar for r in rows], logits.shape[1])
    return sampler.process_logits(logits, rows, mask)


def assert_same_logprobs(a, b) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert a.keys() == b.keys()
    for token in a:
        assert a[token].rank == b[token].rank
        x, y = a[token].logprob, b[token].logprob
        assert x == y or (math.isnan(x) and math.isnan(y))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sampler_is_total_and_rows_keep_their_bits_in_any_batch(world, data):
    vocab = world[0]
    drawn = data.draw(st.lists(a_row(vocab), min_size=1, max_size=5))
    seeds = list(range(100, 100 + 2 * len(drawn), 2))
    sampler = Sampler([EOS], seed=7)
    rows, logits = fresh(world, drawn, seeds)
    batch = sampler(logits, rows)  # never raises
    for i in range(len(drawn)):
        alone_rows, alone_logits = fresh(world, drawn[i : i + 1], seeds[i : i + 1])
        alone = sampler(alone_logits, alone_rows)
        assert (i in batch.failures) == (0 in alone.failures)
        if i in batch.failures:
            assert batch.failures[i] == alone.failures[0]
            continue
        assert batch.token_ids[i] == alone.token_ids[0]
        assert_same_logprobs(batch.logprobs[i], alone.logprobs[0])
        token = batch.token_ids[i]
        assert 0 <= token < vocab
        # A sampled token is one the row's own processing left finite.
        processed = processed_alone(sampler, world, drawn[i], alone_logits)
        assert math.isfinite(processed[0, token])
        for logprob in (batch.logprobs[i] or {}).values():
            assert not math.isnan(logprob.logprob)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_row_fails_exactly_when_nothing_is_left_to_sample(world, data):
    vocab = world[0]
    drawn = data.draw(a_row(vocab))
    sampler = Sampler([EOS], seed=7)
    rows, logits = fresh(world, [drawn], [1])
    out = sampler(logits, rows)
    processed = processed_alone(sampler, world, drawn, logits)
    raw_bad = not bool(torch.isfinite(logits.amax()))
    empty = bool(torch.isneginf(processed).all())
    broken = bool(torch.isnan(processed).any() or torch.isposinf(processed).any())
    assert (0 in out.failures) == (raw_bad or empty or broken)
    if raw_bad:
        assert out.failures[0] == LOGITS_NOT_FINITE
    elif empty:
        assert out.failures[0] == NO_TOKEN_LEFT


def test_verification_reports_only_positions_it_reached(world):
    """A draft position with no finite logit fails its request only if verification gets
    there: after a rejected draft, the row is never read."""
    vocab = world[0]
    sampler = Sampler([EOS])
    params = SamplingParams(temperature=0.0, max_tokens=8)
    logits = torch.zeros(3, vocab)
    logits[0, 5] = logits[1, 6] = 1.0
    logits[2] = float("nan")
    row = SamplingRow(params, None, [])
    tokens, _, failures = verify(sampler, logits, [row], [[7, 6]])  # 7 is rejected at once
    assert tokens == [[5]] and failures == {}
    tokens, _, failures = verify(sampler, logits.clone(), [row], [[5, 6]])  # reaches row 2
    assert failures == {0: LOGITS_NOT_FINITE}


def test_the_rows_of_a_failed_request_leave_their_neighbours_untouched():
    """NaN in one row of a top-p batch used to raise (an index of -1); now it is reported and
    the other row samples what it samples alone."""
    sampler = Sampler([EOS], seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    logits = torch.tensor(np.random.default_rng(0).normal(size=(2, 50)), dtype=torch.float32)
    logits[0] = float("nan")
    rows = [SamplingRow(params, torch.Generator().manual_seed(5), []) for _ in range(2)]
    out = sampler(logits, rows)
    alone = sampler(logits[1:], [SamplingRow(params, torch.Generator().manual_seed(5), [])])
    assert out.failures == {0: LOGITS_NOT_FINITE}
    assert out.token_ids[1] == alone.token_ids[0]
