"""Sampler: exact distributions, seeded reproducibility in any batch, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conveyor.outputs import PenaltyCounts, SamplingRow
from conveyor.sample.sampler import Sampler, sampling_probs
from conveyor.sampling_params import SamplingParams

EOS = 0
NUM_SAMPLES = 20_000
# Distinct, unsorted logits over 10 tokens, so sort/scatter mistakes show up as wrong token ids.
LOGITS10 = np.array([0.3, 2.0, -1.0, 1.2, -0.4, 1.5, 0.0, -2.5, 0.9, -1.7])
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
    vocab: int = 500,
) -> SamplingRow:
    """A row as the scheduler makes one; penalty counts sized to the logits' vocabulary."""
    counts = PenaltyCounts(prompt or [], vocab) if params.has_penalties else None
    new = SamplingRow(params, generator, [], counts)
    for token in output or []:
        append(new, token)
    return new


def append(r: SamplingRow, token: int) -> None:
    """What Request.append_output_token does to the state a row references."""
    r.output_token_ids.append(token)
    if r.penalty_counts is not None:
        r.penalty_counts.add(token)


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def expected_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution vLLM defines, computed independently in float64 numpy."""
    z = logits / params.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_k != -1:
        probs[z < np.sort(z)[::-1][params.top_k - 1]] = 0.0
        probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        mass_before = np.cumsum(probs[order]) - probs[order]
        probs[order[mass_before >= params.top_p]] = 0.0
        probs /= probs.sum()
    probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.2, min_p=0.15),
    "combined": SamplingParams(temperature=1.3, top_k=7, top_p=0.85, min_p=0.1),
}


@pytest.mark.parametrize("name", DISTRIBUTION_CASES)
def test_sampling_probs_equal_numpy_distribution(name: str) -> None:
    params = DISTRIBUTION_CASES[name]
    probs = sampling_probs(torch.tensor(LOGITS10).unsqueeze(0), [params])[0]
    np.testing.assert_allclose(
        probs / probs.sum(), expected_distribution(LOGITS10, params), atol=1e-12
    )


@pytest.mark.parametrize("name", DISTRIBUTION_CASES)
def test_samples_follow_the_filtered_distribution(name: str) -> None:
    params = DISTRIBUTION_CASES[name]
    logits = torch.tensor(LOGITS10, dtype=torch.float32).expand(NUM_SAMPLES, -1)
    if name == "combined":  # seeded rows (one seed each) mixed with the sampler's generator
        rows = [row(params, generator=seeded(i) if i % 2 else None) for i in range(NUM_SAMPLES)]
    else:  # the sampler's own generator, one draw for the whole batch
        rows = [row(params)] * NUM_SAMPLES
    tokens = Sampler([EOS], seed=1234)(logits, rows).token_ids
    _assert_samples_match(
        np.bincount(tokens, minlength=len(LOGITS10)), expected_distribution(LOGITS10, params)
    )


def _assert_samples_match(counts: np.ndarray, expected: np.ndarray) -> None:
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"excluded tokens drawn: {counts}"
    assert kept.sum() >= 2, "a single kept token proves nothing"
    result = chisquare(counts[kept], expected[kept] * counts.sum())
    assert result.pvalue > 0.001, (counts, expected * counts.sum())


def test_top_p_nucleus_beyond_the_candidate_window_matches_full_sort() -> None:
    vocab = 5000  # flat logits: a 0.9 nucleus spans thousands of tokens, past TOP_P_CANDIDATES
    gen = np.random.default_rng(0)
    logits = np.stack([gen.normal(0, 0.3, vocab), gen.normal(0, 4.0, vocab)])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9, top_k=3000)]
    probs = sampling_probs(torch.tensor(logits), params)
    for i, p in enumerate(params):
        np.testing.assert_allclose(
            probs[i] / probs[i].sum(), expected_distribution(logits[i], p), atol=1e-12
        )
    assert 1024 < int((probs[0] > 0).sum()) < vocab


def _run_steps(
    sampler: Sampler, batch: list[SamplingRow], target: int, steps: int, device: str
) -> list[int]:
    """Decode `steps` tokens for the batch on shared per-step random logits; the target's ids."""
    vocab = 500
    logit_gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        step_logits = torch.randn(vocab, generator=logit_gen) * 2
        logits = step_logits.expand(len(batch), -1).contiguous().to(device)
        tokens = sampler(logits, batch).token_ids
        for r, token in zip(batch, tokens, strict=True):
            append(r, token)
    return batch[target].output_token_ids


def _mixed_rows(device: str) -> list[SamplingRow]:
    kinds = [
        lambda i: row(SamplingParams(temperature=0.0)),
        lambda i: row(SamplingParams(temperature=0.8, seed=i), generator=seeded(i, device)),
        lambda i: row(SamplingParams(temperature=1.1, top_k=20)),
        lambda i: row(
            SamplingParams(
                temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
            ),
            prompt=[1, 2, 3],
        ),
        lambda i: row(SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, logprobs=3)),
    ]
    return [kinds[i % len(kinds)](i) for i in range(31)]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_gives_same_tokens_alone_and_in_a_mixed_batch(device: str) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    alone = _run_steps(Sampler([EOS]), [row(params, generator=seeded(7, device))], 0, 12, device)
    batch = _mixed_rows(device)
    batch.insert(13, row(params, generator=seeded(7, device)))
    in_batch = _run_steps(Sampler([EOS]), batch, 13, 12, device)
    assert alone == in_batch
    other_seed = _run_steps(
        Sampler([EOS]), [row(params, generator=seeded(8, device))], 0, 12, device
    )
    assert other_seed != alone, "the seed must matter, or the comparison proves nothing"


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(16, 300, generator=seeded(3))
    rows = [row(SamplingParams(temperature=0.0 if i % 2 else 1.0)) for i in range(16)]
    tokens = Sampler([EOS], seed=0)(logits, rows).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(tokens) if i % 2] == argmax[1::2]
    all_greedy = Sampler([EOS])(logits, [row(SamplingParams(temperature=0.0))] * 16)
    assert all_greedy.token_ids == argmax


PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5]
PENALTY_CASES = {
    # prompt [0, 1], output [3, 3, 2]; every expected value is exact in binary floating point
    "repetition": (dict(repetition_penalty=2.0), [1.0, -2.0, 0.25, 1.5, -0.5]),
    "presence": (dict(presence_penalty=0.5), [2.0, -1.0, 0.0, 2.5, -0.5]),
    "frequency": (dict(frequency_penalty=0.25), [2.0, -1.0, 0.25, 2.5, -0.5]),
    "all": (
        dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        [1.0, -2.0, -0.5, 0.5, -0.5],
    ),
    "none": (dict(), PENALTY_LOGITS),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalties_change_logits_exactly_as_hand_computed(dtype: torch.dtype) -> None:
    logits = torch.tensor([PENALTY_LOGITS] * len(PENALTY_CASES), dtype=dtype)
    rows = [
        row(SamplingParams(**kwargs), output=[3, 3, 2], prompt=[0, 1], vocab=len(PENALTY_LOGITS))
        for kwargs, _ in PENALTY_CASES.values()
    ]
    processed = Sampler([EOS]).process_logits(logits, rows)
    expected = torch.tensor([want for _, want in PENALTY_CASES.values()], dtype=dtype)
    assert torch.equal(processed, expected)
    assert torch.equal(logits[0], torch.tensor(PENALTY_LOGITS, dtype=dtype)), "input modified"


def test_frequency_penalty_flips_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9]] * 2)
    plain = row(SamplingParams(temperature=0.0), output=[1])
    penalized = row(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[1], vocab=3)
    assert Sampler([EOS])(logits, [plain, penalized]).token_ids == [1, 2]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 0.0, 4.0]] * 4)  # EOS 0 and stop id 5 lead
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    ignore = params.clone(ignore_eos=True)
    rows = [
        row(params, output=[1]),
        row(params, output=[1, 1]),
        row(ignore, output=[1]),
        row(params.clone(stop_token_ids=[], min_tokens=0), output=[]),
    ]
    sampler = Sampler([EOS])
    processed = sampler.process_logits(logits, rows)
    assert processed[0, 0] == processed[0, 5] == float("-inf")
    assert processed[2, 0] == 5.0 and processed[2, 5] == float("-inf")
    assert sampler(logits, rows).token_ids == [1, 0, 0, 0]


def test_logprobs_are_raw_log_softmax_with_ranks_and_the_sampled_token() -> None:
    raw = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.0, -1.0]] * 3)
    reference = torch.log_softmax(raw[0], dim=-1).tolist()
    # min_tokens bans EOS 0 and stop ids 1, 2, so greedy samples token 3: rank 4
    masked = SamplingParams(
        temperature=0.0, min_tokens=1, stop_token_ids=[1, 2], logprobs=2, repetition_penalty=1.5
    )
    rows = [
        row(masked, prompt=[3], vocab=7),
        row(masked.clone(logprobs=0), prompt=[3], vocab=7),
        row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler([EOS])(raw, rows)
    assert out.token_ids == [3, 3, 0]
    assert out.logprobs[0] == {
        3: (reference[3], 4, None),
        0: (reference[0], 1, None),
        1: (reference[1], 2, None),
    }
    assert list(out.logprobs[0]) == [3, 0, 1], "sampled token first, then by rank"
    assert out.logprobs[1] == {3: (reference[3], 4, None)}
    assert out.logprobs[2] is None


def test_sampled_token_inside_top_n_appears_once_with_its_rank() -> None:
    logits = torch.randn(64, 50, generator=seeded(5))
    out = Sampler([EOS], seed=0)(logits, [row(SamplingParams(temperature=1.5, logprobs=5))] * 64)
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top = reference[i].argsort(descending=True)[:5].tolist()
        assert list(position) == [token] + [t for t in top if t != token]
        for token_id, (logprob, rank, decoded) in position.items():
            assert logprob == pytest.approx(reference[i, token_id].item(), abs=1e-6)
            assert rank == 1 + int((reference[i] > reference[i, token_id]).sum())
            assert decoded is None


def test_float64_logits_keep_float64_logprob_precision() -> None:
    logits = torch.randn(2, 50_000, generator=seeded(11), dtype=torch.float64) * 8
    rows = [row(SamplingParams(temperature=0.0, logprobs=3))] * 2
    out = Sampler([EOS])(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    float32 = torch.log_softmax(logits.float(), dim=-1).double()
    worst = max(
        abs(lp.logprob - reference[i, t].item())
        for i, position in enumerate(out.logprobs)
        for t, lp in position.items()
    )
    assert worst < 1e-12
    assert (float32 - reference).abs().max() > 1e-9, "float32 would be distinguishable"
