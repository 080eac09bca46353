"""Verification of drafts: which proposed tokens the target model keeps, and its own next one.

A request with d drafts brings d + 1 rows of logits: row j scores the token after its j first
drafts. Every row is processed as the sampler processes a step's row (logit bias, penalties
and min_tokens as of that position, i.e. counting the drafts before it as generated), then:

  - greedy requests keep drafts while draft == argmax and then take the argmax: exactly the
    tokens that decoding one at a time would give;
  - sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft j
    is kept with probability min(1, p_j(draft) / q_j(draft)), where p_j is the target's
    distribution after temperature, top-k, top-p and min-p, and q_j the proposer's (a point
    mass for n-gram and greedy draft-model drafts, so the test is u < p_j(draft)). At the
    first rejection the token is drawn from max(p_j - q_j, 0), renormalized; when all are
    kept, one more token is drawn from p_d. Every output token then follows the target's
    distribution, whatever the drafts.

Random numbers come from the request's own generator (or the sampler's), d uniforms and then
one vocab-sized draw, so a seeded request gets the same tokens whatever shares its batch; a
request with no drafts draws exactly what the plain sampler draws.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from conveyor.outputs import PositionLogprobs, SamplingRow
from conveyor.sample.sampler import (
    Sampler,
    collect_logprobs,
    failed_rows,
    sampling_probs,
    without_rows,
    work_dtype,
)
from conveyor.structured.grammar import step_mask


class Verified(NamedTuple):
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token of its own
    logprobs: list[list[PositionLogprobs] | None]  # None where the request asks for none
    # Request index -> why a position it reached had nothing to sample from (sampler.py).
    failures: dict[int, str]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,  # (sum of 1 + d_i, V): the rows of each request, in order
    rows: list[SamplingRow],
    drafts: list[list[int]],
) -> Verified:
    """Per request: the accepted drafts and one token of the target's own, and their
    logprobs (None where the request asks for none)."""
    starts = [0]
    position_rows = []
    for row, draft in zip(rows, drafts, strict=True):
        position_rows += [row_at(row, draft[:j]) for j in range(len(draft) + 1)]
        starts.append(len(position_rows))
    assert logits.shape[0] == len(position_rows), (logits.shape, len(position_rows))
    logits = logits.to(work_dtype(logits.dtype))
    mask = None
    if any(row.grammar is not None for row in rows):
        stops = [sampler.eos_token_ids | set(row.params.stop_token_ids) for row in rows]
        grammars = [row.grammar for row in rows]
        mask = step_mask(grammars, logits.shape[1], drafts, stops)
    processed = sampler.process_logits(logits, position_rows, mask)
    row_failures = failed_rows(logits, processed)
    if row_failures:
        logits, processed = without_rows(logits, processed, row_failures)
    greedy = [row.params.greedy for row in position_rows]
    if any(greedy):
        argmax = processed.argmax(dim=-1).tolist()
    random_rows = [r for r, g in enumerate(greedy) if not g]
    if random_rows:
        # Unnormalized after min-p, as the plain sampler draws from them; normalized by
        # their sums only for the acceptance test.
        probs = torch.zeros_like(processed)
        probs[random_rows] = sampling_probs(
            processed[random_rows], [position_rows[r].params for r in random_rows]
        )
    tokens: list[list[int]] = []
    for i, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
        start, end = starts[i], starts[i + 1]
        if row.params.greedy:
            tokens.append(accept_greedy(draft, argmax[start:end]))
        else:
            generator = row.generator or sampler.default_generator(logits.device)
            tokens.append(rejection_sample(probs[start:end], draft, generator))
    failures = reached_failures(row_failures, starts, tokens)
    return Verified(tokens, _logprobs(logits, position_rows, starts, tokens), failures)


def reached_failures(
    row_failures: dict[int, str], starts: list[int], tokens: list[list[int]]
) -> dict[int, str]:
    """Request index -> the failure of the first of its rows that gave it a token: a failed
    row after its first rejected draft was never reached, and does not end the request."""
    failures = {}
    if not row_failures:
        return failures
    for i, (start, kept) in enumerate(zip(starts[:-1], tokens, strict=True)):
        for row in range(start, start + len(kept)):
            if row in row_failures:
                failures[i] = row_failures[row]
                break
    return failures


def row_at(row: SamplingRow, earlier_drafts: list[int]) -> SamplingRow:
    """The sampling state of the position after `earlier_drafts` (taken as generated)."""
    if not earlier_drafts:
        return row
    counts = row.penalty_counts
    return SamplingRow(
        row.params,
        row.generator,
        row.output_token_ids + earlier_drafts,
        None if counts is None else counts.with_tokens(earlier_drafts),
        row.grammar,
    )


def accept_greedy(draft: list[int], argmax: list[int]) -> list[int]:
    """Drafts kept while they equal the target's argmax, then the target's own token."""
    for j, token in enumerate(draft):
        if token != argmax[j]:
            return draft[:j] + [argmax[j]]
    return draft + [argmax[len(draft)]]


def rejection_sample(
    probs: torch.Tensor,  # (d + 1, V): the target's distributions (rows of any scale)
    draft: list[int],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # (d, V) the proposer's; None: point masses
) -> list[int]:
    d = len(draft)
    if d:
        uniforms = torch.rand(d, generator=generator, device=probs.device, dtype=probs.dtype)
        index = torch.arange(d, device=probs.device)
        draft_ids = torch.tensor(draft, device=probs.device)
        p = probs[index, draft_ids] / probs[:d].sum(dim=-1)
        q = torch.ones_like(p) if draft_probs is None else draft_probs[index, draft_ids]
        # Draft j is kept when u_j < p / q (a ratio >= 1 always keeps it).
        rejected = (uniforms * q >= p).tolist()
        for j in range(d):
            if rejected[j]:
                if draft_probs is None:  # max(p - q, 0) for a point mass q: p without the draft
                    residual = probs[j].clone()
                    residual[draft[j]] = 0.0
                else:
                    residual = (probs[j] / probs[j].sum() - draft_probs[j]).clamp_(min=0.0)
                return draft[:j] + [_race(residual, generator)]
    return draft + [_race(probs[d], generator)]


def _race(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from `weights` (any scale): argmax(weights / E), E ~ Exponential(1), the
    sampler's exponential race on one row."""
    uniform = torch.empty_like(weights).uniform_(generator=generator)
    return int(weights.div(uniform.log_().neg_()).argmax())


def _logprobs(
    logits: torch.Tensor,
    position_rows: list[SamplingRow],
    starts: list[int],
    tokens: list[list[int]],
) -> list[list[PositionLogprobs] | None]:
    """Logprobs of the raw distribution at every position that produced a token."""
    result: list[list[PositionLogprobs] | None] = [None] * len(tokens)
    rows, sampled = [], []
    for i, out in enumerate(tokens):
        if position_rows[starts[i]].params.logprobs is not None:
            rows += range(starts[i], starts[i] + len(out))
            sampled += out
    if not rows:
        return result
    collected = collect_logprobs(
        logits[rows], [position_rows[r] for r in rows], torch.tensor(sampled, device=logits.device)
    )
    k = 0
    for i, out in enumerate(tokens):
        if position_rows[starts[i]].params.logprobs is not None:
            result[i] = collected[k : k + len(out)]
            k += len(out)
    return result
