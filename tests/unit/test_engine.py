"""Engine behaviour on a tiny float64 checkpoint: batch occupancy, stop conditions,
n > 1, seeded sampling and UTF-8-safe text."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
from conftest import DEVICE_KWARGS, random_prompts
from tiny import build_tokenizer, byte_token_ids, make_scripted_checkpoint

from conveyor import LLM, LLMEngine, SamplingParams
from conveyor.outputs import OutputKind
from conveyor.request import RepetitionRuns
from conveyor.sampling_params import RepetitionDetectionParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS, record_trace=True)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_trace_shows_a_request_joining_mid_generation_and_one_leaving_early(tiny_checkpoint):
    engine = LLMEngine(
        str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS, record_trace=True
    )
    engine.add_request("short", [5, 6, 7], greedy(2))
    engine.add_request("long", [8, 9, 10, 11], greedy(8))
    for _ in range(2):
        engine.step()
    engine.add_request("late", [12, 13], greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    trace = engine.trace
    first = {
        rid: next(s.step for s in trace if rid in s.num_scheduled_tokens)
        for rid in ("short", "long", "late")
    }
    last = {rid: max(s.step for s in trace if rid in s.num_scheduled_tokens) for rid in first}
    # "late" joined at the next step, while "long" was mid-generation (one token per step).
    assert first["late"] == 3
    late_step = next(s for s in trace if s.step == 3)
    assert late_step.num_scheduled_tokens == {"long": 1, "late": 2}
    # "short" left at the step it finished; "long" kept running without it.
    finished_short = next(s.step for s in trace if "short" in s.finished_request_ids)
    assert finished_short == last["short"] == 2
    assert last["long"] > finished_short
    assert all("short" not in s.num_scheduled_tokens for s in trace if s.step > finished_short)


def test_stop_string_ends_the_text_before_it(llm):
    prompt = [5, 6, 7, 8]
    full = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:5]
    first = full.index(stop)
    out = llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        prompt, greedy(24, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full[: first + len(stop)]


def test_stop_token_ids_end_generation(llm):
    prompt = [9, 10, 11]
    tokens = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    target = tokens[4]
    out = llm.generate(prompt, greedy(12, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


@pytest.fixture(scope="module")
def eos_case(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny model whose EOS is the 4th token of a greedy run of `prompt`."""
    src = tiny_checkpoint("llama")
    prompt = [20, 21, 22, 23]
    base = LLM(str(src), dtype="float64", **DEVICE_KWARGS).generate(
        prompt, greedy(12), use_tqdm=False
    )
    tokens = base[0].outputs[0].token_ids
    eos = tokens[3]
    assert eos not in tokens[:3]
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(src, path)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = eos
        (path / name).write_text(json.dumps(data))
    return LLM(str(path), dtype="float64", **DEVICE_KWARGS), prompt, tokens, eos


def test_eos_ends_generation_and_ignore_eos_runs_on(eos_case):
    llm, prompt, tokens, eos = eos_case
    plain = SamplingParams(temperature=0, max_tokens=12)
    stopped = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[:4] and stopped.finish_reason == "stop"
    ignored = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_min_tokens_holds_back_eos(eos_case):
    llm, prompt, tokens, eos = eos_case
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=7)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 7
    assert eos not in out.token_ids[:7]
    assert out.token_ids[:3] == tokens[:3]


def test_n_completions_per_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([3, 4, 5], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "n samples were all identical"
    again = llm.generate([3, 4, 5], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    same = llm.generate([3, 4, 5], greedy(8, n=2), use_tqdm=False)[0]
    assert same.outputs[0].token_ids == same.outputs[1].token_ids


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_32(llm):
    prompt = [30, 31, 32, 33, 34]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(31, 384, seed=5)
    mix = [
        SamplingParams(temperature=1.0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0.7, seed=99, top_k=20, max_tokens=9, presence_penalty=0.5),
    ]
    batch_params = [mix[i % 3] for i in range(31)]
    outs = llm.generate(
        others[:16] + [prompt] + others[16:],
        batch_params[:16] + [seeded] + batch_params[16:],
        use_tqdm=False,
    )
    assert outs[16].outputs[0].token_ids == alone


TEXT = "A\u00e9\U0001f600\u0436\u65e5Z"  # 1-, 2-, 4-, 2- and 3-byte characters


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint, tmp_path_factory):
    """A model that writes TEXT one UTF-8 byte per token after the prompt "A", then EOS."""
    tokenizer = build_tokenizer()
    ids = byte_token_ids(tokenizer, TEXT)
    successor = dict(zip(ids, ids[1:], strict=False)) | {ids[-1]: tokenizer.eos_token_id}
    path = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), successor)
    engine = LLMEngine(str(path), dtype="float64", **DEVICE_KWARGS)
    return engine, ids


def test_multibyte_characters_split_over_tokens_stream_whole(scripted):
    engine, ids = scripted
    engine.add_request("utf8", ids[:1], SamplingParams(temperature=0, max_tokens=20))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            deltas.append(text)
            final = out
    assert final.outputs[0].token_ids == ids[1:] + [engine.tokenizer.eos_token_id]
    assert final.outputs[0].text == TEXT[1:]
    # At every step the text so far is whole characters: a prefix of TEXT, never U+FFFD.
    assert all(TEXT[1:].startswith(d) and "\ufffd" not in d for d in deltas)
    # 13 tokens, but the text grew only when a character was complete.
    assert sorted(set(deltas), key=len) == [TEXT[1:i] for i in range(1, len(TEXT) + 1)]


def test_stop_string_inside_a_multibyte_run(scripted):
    engine, ids = scripted
    params = SamplingParams(temperature=0, max_tokens=20, stop=["\u0436"])
    engine.add_request("stop-utf8", ids[:1], params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    completion = final.outputs[0]
    assert completion.text == "\u00e9\U0001f600"
    assert completion.finish_reason == "stop" and completion.stop_reason == "\u0436"
    engine.check_integrity()


def test_allocated_kv_stays_under_one_spare_block_per_request(tiny_checkpoint):
    engine = LLMEngine(
        str(tiny_checkpoint("llama")),
        dtype="float64",
        **DEVICE_KWARGS,
        block_size=4,
        max_num_batched_tokens=24,
    )
    for i, prompt in enumerate(random_prompts(12, 384, seed=9, max_len=40)):
        engine.add_request(str(i), prompt, greedy(6 + i))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request_id, [blocks] in engine.kv_cache.req_to_blocks.items():
            request = engine.scheduler.requests[request_id]
            # After a step every allocated slot holds computed KV, but for the last block's tail.
            assert len(blocks) == -(-request.num_computed_tokens // 4)
            checked += 1
    assert checked > 50


def _repeats_vllm(token_ids: list[int], max_size: int, min_size: int, min_count: int) -> bool:
    """vLLM's check_sequence_repetition (v1/core/sched/utils.py), written out: the output's
    last size * min_count tokens are min_count copies of its last size tokens."""
    for size in range(max(1, min_size), max_size + 1):
        if size * min_count > len(token_ids):
            return False
        tail = token_ids[-size:]
        if all(
            token_ids[-size * (m + 1) : len(token_ids) - size * m] == tail for m in range(min_count)
        ):
            return True
    return False


def test_repetition_runs_agree_with_vllms_check_at_every_token():
    """RepetitionRuns, one comparison per pattern size and token, says what vLLM's tail
    comparison says after every token, on sequences of few distinct tokens (many repeats)."""
    rng = random.Random(7)
    for _ in range(300):
        params = RepetitionDetectionParams(
            max_pattern_size=rng.randint(1, 6), min_count=rng.randint(2, 4)
        )
        params = RepetitionDetectionParams(
            params.max_pattern_size, rng.randint(0, params.max_pattern_size), params.min_count
        )
        runs, output = RepetitionRuns(params), []
        for _ in range(40):
            pattern_step = rng.random() < 0.7 and len(output) >= 3
            output.append(output[-rng.randint(1, 3)] if pattern_step else rng.randint(0, 2))
            expected = _repeats_vllm(output, *dataclasses.astuple(params))
            assert runs.advance(output) == expected, (params, output)


def test_a_reply_that_repeats_itself_ends_with_finish_reason_repetition(llm):
    """repetition_detection: the reply is the undetected one cut at the first token where its
    tail repeats a pattern min_count times (after min_tokens), finish_reason "repetition" and
    stop_reason "repetition_detected"; a bad setting is a ValueError naming the field."""
    prompt = [5, 6, 7, 8]
    full = llm.generate(prompt, greedy(48), use_tqdm=False)[0].outputs[0].token_ids
    tried = 0
    for max_size, min_count, min_tokens in [(4, 3, 0), (8, 2, 0), (2, 2, 0), (8, 2, 6)]:
        cut = next(
            (
                n
                for n in range(max(1, min_tokens), len(full) + 1)
                if _repeats_vllm(full[:n], max_size, 0, min_count)
            ),
            None,
        )
        if cut is None:
            continue
        tried += 1
        detection = {"max_pattern_size": max_size, "min_count": min_count}
        params = greedy(48, repetition_detection=detection, min_tokens=min_tokens)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:cut]
        assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    assert tried >= 2, full  # the tiny model's greedy reply loops within 48 tokens
    for bad in [
        {"max_pattern_size": 4, "min_count": 1},
        {"max_pattern_size": 2000, "min_count": 2},
        {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
        {"pattern": 3},
    ]:
        with pytest.raises(ValueError, match="repetition_detection"):
            greedy(4, repetition_detection=bad)


def test_logprob_token_ids_are_those_tokens_entries_of_the_whole_distribution(llm):
    """vLLM's logprob_token_ids: at every generated position the sampled token's entry, then
    each named token's logprob and rank, in the order named: the very entries of the same
    position's whole distribution (logprobs = the vocabulary); out-of-vocabulary ids and a
    logprobs count that disagrees are ValueErrors naming the field."""
    prompt, vocab = [5, 6, 7, 8], llm.llm_engine.model_config.vocab_size
    whole = llm.generate(prompt, greedy(6, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    named = [vocab - 1, 3, whole.token_ids[2], 40]
    out = llm.generate(prompt, greedy(6, logprob_token_ids=named), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == whole.token_ids
    for token_id, position, full in zip(out.token_ids, out.logprobs, whole.logprobs, strict=True):
        assert list(position) == [token_id] + [t for t in named if t != token_id]
        for t, entry in position.items():
            assert (entry.logprob, entry.rank) == (full[t].logprob, full[t].rank)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        llm.generate(prompt, greedy(2, logprob_token_ids=[vocab]), use_tqdm=False)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        greedy(2, logprob_token_ids=[1, 2], logprobs=5)


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_interval_gathers_tokens_into_fewer_outputs_of_the_same_reply(tiny_checkpoint, n):
    """SamplingParams.stream_interval (vLLM's): delta outputs carry that many new tokens each,
    the first token and the end going out at once; the deltas join into the very tokens,
    text and logprobs of interval 1."""
    engine = LLMEngine(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)

    def deltas(interval: int) -> dict[int, list]:
        params = SamplingParams(
            temperature=0.8,
            seed=3,
            n=n,
            max_tokens=23,
            ignore_eos=True,
            logprobs=2,
            stream_interval=interval,
        )
        engine.add_request("r", [5, 6, 7, 8], params, output_kind=OutputKind.DELTA)
        got: dict[int, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    got.setdefault(c.index, []).append(c)
        return got

    every, gathered = deltas(1), deltas(5)
    for index in range(n):
        one, five = every[index], gathered[index]
        assert [len(c.token_ids) for c in one if c.token_ids] == [1] * 23
        sizes = [len(c.token_ids) for c in five]
        assert sizes[0] == 1 and all(s == 5 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 5
        assert sum(sizes) == 23
        for field in ("token_ids", "logprobs"):
            joined = [x for c in five for x in getattr(c, field)]
            assert joined == [x for c in one for x in getattr(c, field)]
        assert "".join(c.text for c in five) == "".join(c.text for c in one)
        assert five[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0)


def test_enqueue_then_wait_for_completion_as_vllms_llm(llm):
    """vLLM's LLM.enqueue / wait_for_completion: requests added without running, run by the
    wait (in enqueue order) with the same outputs as generate's; a generate() in between runs
    its own and keeps the queued ones' outputs for the wait; a bad prompt queues nothing."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    first = llm.enqueue(prompts[:2], greedy(6), use_tqdm=False)
    alone = llm.generate([[40, 41]], greedy(3), False, None, 0)  # vLLM's positional order
    second = llm.enqueue(prompts[2:], greedy(6), priority=0, use_tqdm=False)
    assert len(first) == 2 and len(second) == 1 and len(alone[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError):
        llm.enqueue([[5], []], greedy(2), use_tqdm=False)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == first + second
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.wait_for_completion(use_tqdm=False) == []
