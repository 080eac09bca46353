"""Sampler: one sampled token (and optional logprobs) per row of a step's logits.

Pipeline, as in vLLM, on the rows of one engine step:

    raw logits ──> logprobs (log_softmax of the raw logits, for rows that ask)
        │
        ├─ grammar: tokens it forbids -> -inf             ─┐
        ├─ logit_bias (added)                              │
        ├─ penalties (repetition, presence, frequency)    │ process_logits
        ├─ min_tokens: stop ids and EOS -> -inf            │
        │    (unless the grammar allows nothing else: it wins)
        ├─ a forced token (a thinking budget spent): the   ─┘
        │    only one left (sample/reasoning.py)
        │
        ├─ greedy rows: argmax
        └─ other rows: / temperature -> top_k -> top_p -> min_p -> exponential race

The exponential race picks argmax(probs / E) with E ~ Exponential(1): an exact draw from probs.
Every random row draws one vocab-sized E from its own generator (or the sampler's), so a seeded
row gets the same tokens whatever else shares its batch.

The sampler is total: a row that has nothing to sample from (a NaN or an infinity in its raw or
processed logits, or every token masked to -inf by its own parameters) is reported in
`failures`, with why, and computed on zeros instead, so that it neither raises nor touches its
neighbours' bits; the engine ends that request with the reason (core/scheduler.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from conveyor.outputs import (
    LOGITS_NOT_FINITE,
    NO_TOKEN_LEFT,
    PARAMS_NOT_FINITE,
    Logprob,
    PositionLogprobs,
    SamplingRow,
)
from conveyor.sampling_params import SamplingParams
from conveyor.structured.grammar import StepMask, apply_bitmask, step_mask

NEG_INF = float("-inf")
# top-p looks for its nucleus among this many most likely tokens first and falls back to a full
# sort only for rows whose nucleus is larger: a full CPU sort of 256 x 49k logits takes ~1 s.
TOP_P_CANDIDATES = 1024


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one sampled token per row
    logprobs: list[PositionLogprobs | None]  # None where params.logprobs is None
    # Row index -> why it has no token (its token_ids entry is then meaningless).
    failures: dict[int, str]


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits, and nothing else is read from
    them: greedy, and no grammar, logit bias, penalty, allowed or bad words, min_tokens still
    to reach or logprobs. (Its drafts' positions then are too: a draft only adds output.)"""
    params = row.params
    return (
        params.greedy
        and row.grammar is None
        and row.forced_token_id is None
        and params.logprobs is None
        and not params.logit_bias
        and not params.has_penalties
        and not params.allowed_token_ids
        and not params.bad_words_token_ids
        and len(row.output_token_ids) >= params.min_tokens
    )


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int], seed: int | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        # One default generator per device, created on first use (generators are device-bound).
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if not rows:
            return SamplerOutput([], [])
        logits = logits.to(work_dtype(logits.dtype))
        mask = step_mask([row.grammar for row in rows], logits.shape[1])
        processed = self.process_logits(logits, rows, mask)
        failures = failed_rows(logits, processed)
        if failures:
            logits, processed = without_rows(logits, processed, failures)
        token_ids = self._sample(processed, rows)
        logprobs = collect_logprobs(logits, rows, token_ids)
        return SamplerOutput(token_ids.tolist(), logprobs, failures)

    def process_logits(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: StepMask | None = None
    ) -> torch.Tensor:
        """Grammar mask, logit bias, penalties and min_tokens applied. Never writes into
        `logits`; returns it (in the work dtype) when no row needs any of them. (A processor
        added here must also be excluded by plain_greedy: such rows never reach it.)"""
        logits = logits.to(work_dtype(logits.dtype))
        biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
        penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
        banned = self._min_tokens_bans(rows, logits.shape[1])
        allowed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
        words = _bad_word_bans(rows)
        forced = [i for i, row in enumerate(rows) if row.forced_token_id is not None]
        if mask is None and not (biased or penalized or banned[0] or allowed or words[0] or forced):
            return logits
        raw, logits = logits, logits.clone()  # the raw logits stay intact for logprobs
        if mask is not None:
            apply_bitmask(logits, mask.rows, mask.bitmask)
            _let_openings_through(logits, raw, rows)
        for i in allowed:
            ids = torch.tensor(rows[i].params.allowed_token_ids, device=logits.device)
            kept = logits[i, ids]
            logits[i] = NEG_INF
            logits[i, ids] = kept
        if words[0]:
            logits[words] = NEG_INF
        if biased:
            _apply_logit_bias(logits, rows, biased)
        if penalized:
            _apply_penalties(logits, rows, penalized)
        if banned[0]:
            both = sorted(set(mask.rows) & set(banned[0])) if mask is not None else []
            kept = logits[both] if both else None
            logits[banned] = NEG_INF
            if both:  # a grammar that allows only stop tokens wins over min_tokens
                dead = torch.isinf(logits[both]).all(dim=-1).tolist()
                for row, saved, is_dead in zip(both, kept, dead, strict=True):
                    if is_dead:
                        logits[row] = saved
        for i in forced:
            if rows[i].forced_token_id < logits.shape[1]:
                logits[i] = NEG_INF
                logits[i, rows[i].forced_token_id] = 0.0
        return logits

    def _min_tokens_bans(
        self, rows: list[SamplingRow], vocab_size: int
    ) -> tuple[list[int], list[int]]:
        """(row indices, token ids) to mask: rows below min_tokens may not stop yet."""
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) >= params.min_tokens:
                continue
            stops = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                stops |= self.eos_token_ids
            in_vocab = [t for t in stops if t < vocab_size]
            row_index += [i] * len(in_vocab)
            token_index += in_vocab
        return row_index, token_index

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [row.params.greedy for row in rows]
        if all(greedy):
            return logits.argmax(dim=-1)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if len(random_rows) == len(rows):
            return self._sample_random(logits, rows)
        token_ids = logits.argmax(dim=-1)
        index = torch.tensor(random_rows, device=logits.device)
        token_ids[index] = self._sample_random(logits[index], [rows[i] for i in random_rows])
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows that are all non-greedy: temperature, top-k, top-p, min-p, then the race."""
        probs = sampling_probs(logits, [row.params for row in rows])
        return probs.div_(self._exponentials(rows, probs)).argmax(dim=-1)

    def _exponentials(self, rows: list[SamplingRow], like: torch.Tensor) -> torch.Tensor:
        """Exponential(1) noise, one vocab-sized row per row, each from that row's generator."""
        uniform = torch.empty_like(like)
        if any(row.generator is None for row in rows):
            # Seeded rows' slots are drawn too and then overwritten: simpler than a scatter,
            # and only unseeded rows read the default generator's stream.
            uniform.uniform_(generator=self.default_generator(like.device))
        for i, row in enumerate(rows):
            if row.generator is not None:
                uniform[i].uniform_(generator=row.generator)
        # -log(u) is Exponential(1) and ~2x cheaper than exponential_ on CPU. u in [0, 1), so
        # E is in (0, inf]: an infinite E scores 0 and never makes 0/0 = nan out of a masked 0.
        return uniform.log_().neg_()

    def default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def _let_openings_through(logits: torch.Tensor, raw: torch.Tensor, rows: list[SamplingRow]) -> None:
    """A reply that may still open its reasoning may write the opening marker's next token
    beside what its grammar allows: the grammar starts after the reasoning."""
    for i, row in enumerate(rows):
        token_id = row.opening_token_id
        if token_id is not None and token_id < logits.shape[1]:
            logits[i, token_id] = raw[i, token_id]


def failed_rows(raw: torch.Tensor, processed: torch.Tensor) -> dict[int, str]:
    """Row index -> why the row has nothing to sample from. One max per row finds them all: it
    is NaN where any logit is NaN, +inf where any is +inf, -inf where every one is -inf."""
    raw_top = raw.amax(dim=-1)
    top = raw_top if processed is raw else processed.amax(dim=-1)
    finite = torch.isfinite(raw_top) & torch.isfinite(top)
    if bool(finite.all()):
        return {}
    failures = {}
    raw_top, top = raw_top.tolist(), top.tolist()
    for i in (~finite).nonzero().squeeze(1).tolist():
        if not math.isfinite(raw_top[i]):
            failures[i] = LOGITS_NOT_FINITE
        elif top[i] == NEG_INF:
            failures[i] = NO_TOKEN_LEFT
        else:
            failures[i] = PARAMS_NOT_FINITE
    return failures


def without_rows(
    raw: torch.Tensor, processed: torch.Tensor, failures: dict[int, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of both in which the failed rows are zeros: every later op is per row, so the
    other rows' results keep their bits, and none of them raises on a NaN or an empty row."""
    index = torch.tensor(sorted(failures), device=raw.device)
    clean_raw = raw.clone().index_fill_(0, index, 0.0)
    if processed is raw:
        return clean_raw, clean_raw
    return clean_raw, processed.clone().index_fill_(0, index, 0.0)


def _bad_word_bans(rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
    """(row indices, token ids) that would complete one of a row's bad words: a word's last
    token, where the output so far ends with the tokens before it."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        output = row.output_token_ids
        for word in row.params.bad_words_token_ids or ():
            head = len(word) - 1
            if head == 0 or (len(output) >= head and output[-head:] == word[:-1]):
                row_index.append(i)
                token_index.append(word[-1])
    return row_index, token_index


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 so exactness tests can compare logprobs to 1e-6.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], biased: list[int]) -> None:
    """In place: each row's bias added to its tokens' logits (ids were checked against the
    vocabulary when the request was added)."""
    row_index, token_index, values = [], [], []
    for i in biased:
        bias = rows[i].params.logit_bias
        row_index += [i] * len(bias)
        token_index += list(bias)
        values += list(bias.values())
    index = (torch.tensor(row_index), torch.tensor(token_index))
    logits.index_put_(
        tuple(t.to(logits.device) for t in index), logits.new_tensor(values), accumulate=True
    )


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], penalized: list[int]) -> None:
    """In place. Repetition as in transformers (tokens of prompt + output), then frequency and
    presence as in OpenAI (output only). Reads each request's running counts (PenaltyCounts),
    so the cost is O(vocab) per row whatever the length of the request's history."""
    device = logits.device
    counts_np = np.stack([rows[i].penalty_counts.output_counts for i in penalized])
    in_prompt_np = np.stack([rows[i].penalty_counts.in_prompt for i in penalized])
    counts = torch.from_numpy(counts_np).to(device)
    generated = counts > 0
    index = torch.tensor(penalized, device=device)
    sub = logits[index]  # (P, V)

    def column(name: str) -> torch.Tensor:
        return logits.new_tensor([getattr(rows[i].params, name) for i in penalized]).unsqueeze(1)

    repetition = column("repetition_penalty")
    seen = torch.from_numpy(in_prompt_np).to(device) | generated
    penalized_values = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized_values, sub)
    frequency = column("frequency_penalty") * counts.to(sub.dtype)
    sub -= frequency + column("presence_penalty") * generated.to(sub.dtype)
    logits[index] = sub


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What non-greedy rows sample from: probabilities after temperature, top-k, top-p and
    min-p, masked tokens 0, not renormalized after min-p."""
    temperature = logits.new_tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature  # a fresh tensor: the masking below is in place
    if any(p.top_k != -1 or p.top_p < 1.0 for p in params):
        _apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = logits.new_tensor([p.min_p for p in params]).unsqueeze(1)
        threshold = min_p * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place. Both keep every token tied with the last kept value (as vLLM's top-k does);
    top-p runs on the top-k-renormalized distribution."""
    vocab_size = logits.shape[1]
    top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
    needed = [k if p.top_k != -1 else 0 for k, p in zip(top_k, params, strict=True)]
    needed += [TOP_P_CANDIDATES for p in params if p.top_p < 1.0 and p.top_k == -1]
    num_candidates = min(max(needed), vocab_size)
    candidates = logits.topk(num_candidates, dim=-1).values  # sorted, descending
    k_index = torch.tensor([min(k, num_candidates) - 1 for k in top_k], device=logits.device)
    kth = candidates.gather(1, k_index.unsqueeze(1))
    no_top_k = torch.tensor([p.top_k == -1 for p in params], device=logits.device)
    kth.masked_fill_(no_top_k.unsqueeze(1), NEG_INF)
    logits.masked_fill_(logits < kth, NEG_INF)
    if all(p.top_p >= 1.0 for p in params):
        return
    candidates.masked_fill_(candidates < kth, NEG_INF)
    logits.masked_fill_(logits < _top_p_cutoff(logits, candidates, params), NEG_INF)


def _top_p_cutoff(
    logits: torch.Tensor, candidates: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """[num_rows, 1] smallest logit kept by top-p (-inf keeps all). `logits` are top-k masked;
    `candidates` are their largest values, sorted descending."""
    top_p = logits.new_tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
    log_total = _log_total(logits)
    cutoff, resolved = _nucleus_end(candidates, log_total, top_p.unsqueeze(1))
    # The nucleus ends inside the candidates, or top-k already left nothing beyond them.
    resolved |= torch.tensor([p.top_k != -1 for p in params], device=logits.device)
    if candidates.shape[1] < logits.shape[1] and not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        full = logits[rows].sort(dim=-1, descending=True).values
        cutoff[rows] = _nucleus_end(full, log_total[rows], top_p[rows].unsqueeze(1))[0]
    return cutoff.masked_fill_(top_p.unsqueeze(1) > 1.0, NEG_INF)


def _log_total(logits: torch.Tensor) -> torch.Tensor:
    """[num_rows, 1] log of each row's total probability mass, logsumexp's value computed so
    that a row gets the same bits alone and in any batch. torch's logsumexp does not (on an
    AVX-512 CPU, 2 of 64 rows of 49152 logits differed in the last bit alone vs batched, which
    could move a seeded top-p row's cutoff with its neighbours); log_softmax does. At a row's
    largest logit x_j, log_softmax_j = x_j - logsumexp, so logsumexp = x_j - log_softmax_j."""
    top = logits.argmax(dim=-1, keepdim=True)
    return logits.gather(1, top) - torch.log_softmax(logits, dim=-1).gather(1, top)


def _nucleus_end(
    sorted_logits: torch.Tensor, log_total: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(last kept logit, whether the kept prefix ends before the last column), per row.
    A token is kept while the mass before it is below top_p: the smallest set reaching top_p,
    never empty since top_p > 0."""
    probs = (sorted_logits - log_total).exp_()
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)
    cutoff = sorted_logits.gather(1, num_kept - 1)
    return cutoff, (num_kept < sorted_logits.shape[1]).squeeze(1)


def collect_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> list[PositionLogprobs | None]:
    """Raw-distribution logprobs: the sampled token first, then the top-N by rank, or the
    tokens a row names (logprob_token_ids), in its order, each with its rank."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[PositionLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits if len(wanted) == len(rows) else logits[index], dim=-1)
    sampled = token_ids[index].unsqueeze(1)
    sampled_logprobs = logprobs.gather(1, sampled)
    sampled_ranks = (logprobs > sampled_logprobs).sum(dim=-1, dtype=torch.int32) + 1
    max_n = max((rows[i].params.logprobs for i in wanted if not _named(rows[i])), default=0)
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1)
    columns = zip(
        sampled.squeeze(1).tolist(),
        sampled_logprobs.squeeze(1).tolist(),
        sampled_ranks.tolist(),
        top_ids.tolist(),
        top_logprobs.tolist(),
        strict=True,
    )
    for k, (i, (token, logprob, rank, ids, values)) in enumerate(zip(wanted, columns, strict=True)):
        position = {token: Logprob(logprob, rank)}
        if _named(rows[i]):
            position |= _named_logprobs(logprobs[k], rows[i].params.logprob_token_ids, token)
        else:
            for r in range(rows[i].params.logprobs):
                position.setdefault(ids[r], Logprob(values[r], r + 1))
        result[i] = position
    return result


def _named(row: SamplingRow) -> bool:
    return row.params.logprob_token_ids is not None


def _named_logprobs(row: torch.Tensor, token_ids: list[int], sampled: int) -> PositionLogprobs:
    """The named tokens' logprobs in one row of log-probabilities, each with its rank (as a
    sampled token's: 1 + the tokens more likely), the sampled one left as it is."""
    ids = torch.tensor(token_ids, device=row.device)
    values = row[ids]
    ranks = (row.unsqueeze(0) > values.unsqueeze(1)).sum(dim=-1, dtype=torch.int32) + 1
    return {
        t: Logprob(v, r)
        for t, v, r in zip(token_ids, values.tolist(), ranks.tolist(), strict=True)
        if t != sampled
    }


def target_logprobs(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> list[PositionLogprobs]:
    """Prompt logprobs: per row, the logprob and rank of its target (the next prompt token)
    under the raw distribution, as collect_logprobs ranks a sampled token, and the top
    num_top tokens (vLLM's prompt_logprobs)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(targets, device=logits.device).unsqueeze(1)
    target_values = logprobs.gather(1, target)
    ranks = (logprobs > target_values).sum(dim=-1, dtype=torch.int32) + 1
    top_ids, top_values = [[]] * len(targets), [[]] * len(targets)
    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    columns = zip(
        targets, target_values.squeeze(1).tolist(), ranks.tolist(), top_ids, top_values, strict=True
    )
    positions = []
    for token, value, rank, ids, values in columns:
        position = {token: Logprob(value, rank)}
        for r, (t, v) in enumerate(zip(ids, values, strict=True)):
            position.setdefault(t, Logprob(v, r + 1))
        positions.append(position)
    return positions
