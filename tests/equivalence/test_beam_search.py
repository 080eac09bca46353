"""LLM.beam_search (entrypoints/beam_search.py) finds transformers' beams: the same sequences,
best first, with the same cumulative log-probabilities, in float64."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICE_KWARGS, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLM, BeamSearchParams

BEAM_WIDTH, MAX_TOKENS = 3, 6


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


def hf_beams(model, prompt: list[int], eos: int | None) -> list[tuple[list[int], float]]:
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=BEAM_WIDTH,
        num_return_sequences=BEAM_WIDTH,
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        early_stopping=False,
        length_penalty=0.0,  # scores are sums of log-probabilities, as at equal lengths
        eos_token_id=eos,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return [
        (seq[len(prompt) :].tolist(), score.item())
        for seq, score in zip(out.sequences, out.sequences_scores, strict=True)
    ]


def test_beam_search_finds_transformers_beams(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    prompts = random_prompts(3, model.config.vocab_size, seed=7, max_len=12)
    params = BeamSearchParams(BEAM_WIDTH, MAX_TOKENS, ignore_eos=True, length_penalty=0.0)
    with LLM(str(checkpoint), dtype="float64", **DEVICE_KWARGS) as llm:
        outputs = llm.beam_search(prompts, params)
        # vLLM's concurrency_limit: a prompt's beams at a time, the same beams
        one_by_one = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == [
        [s.tokens for s in o.sequences] for o in outputs
    ]
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        expected = hf_beams(model, prompt, eos=None)
        got = [(s.tokens[len(prompt) :], s.cum_logprob) for s in output.sequences]
        assert [t for t, _ in got] == [t for t, _ in expected], f"prompt {i}: other beams"
        for (_, a), (_, b) in zip(got, expected, strict=True):
            # transformers keeps its beam scores in float32
            assert abs(a - b) < 1e-5, f"prompt {i}: cumulative logprob {a} vs {b}"
        assert all(s.finish_reason == "length" for s in output.sequences)


def test_a_beam_that_writes_eos_is_complete_and_ranked_with_the_others(checkpoint):
    """With EOS counted: each returned beam either ends in EOS (finish "stop", its text
    without it) or ran to max_tokens; the ranking is by score, best first."""
    with LLM(str(checkpoint), dtype="float64", **DEVICE_KWARGS) as llm:
        eos = llm.get_tokenizer().eos_token_id
        prompts = random_prompts(4, 64, seed=0, max_len=8)  # one beam of one writes EOS
        outputs = llm.beam_search(prompts, BeamSearchParams(4, 8))
    finished = [s.finish_reason for o in outputs for s in o.sequences]
    assert "stop" in finished, "no beam wrote EOS: the case is not exercised"
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.sequences) == 4
        scores = [s.cum_logprob / (len(s.tokens) - (s.tokens[-1] == eos)) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in output.sequences:
            generated = s.tokens[len(prompt) :]
            if s.finish_reason == "stop":
                assert generated[-1] == eos and eos not in generated[:-1]
            else:
                assert len(generated) == 8 and eos not in generated


@pytest.mark.parametrize(
    "field, value",
    [
        ("beam_width", 0),
        ("beam_width", 1.5),
        ("max_tokens", 0),
        ("length_penalty", float("nan")),
        ("length_penalty", 1e308),
    ],
)
def test_bad_beam_search_params_are_refused_by_name(field, value):
    fields = {"beam_width": 2, "max_tokens": 4} | {field: value}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**fields)


def test_a_beam_width_past_half_the_vocabulary_is_refused_by_name(checkpoint):
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    with LLM(str(checkpoint), dtype="float64", **DEVICE_KWARGS) as llm:
        with pytest.raises(ValueError, match="beam_width"):
            llm.beam_search([[3, 4]], BeamSearchParams(vocab // 2 + 1, 2))
