"""AsyncLLM, vLLM's engine for an asyncio program, on the tiny float64 checkpoint: the same
tokens as LLM.generate, outputs cumulative by default (or deltas, or the final one), requests
side by side, an abort that ends a request, and refused requests as ValueErrors."""

from __future__ import annotations

import asyncio

import pytest
from conftest import DEVICE_KWARGS

from conveyor import LLM, AsyncLLM, EngineArgs, SamplingParams
from conveyor.outputs import OutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)
    )
    yield engine
    engine.shutdown()


async def _all(engine, prompt, params, request_id, **kwargs) -> list:
    return [out async for out in engine.generate(prompt, params, request_id, **kwargs)]


def test_outputs_are_llms_tokens_cumulative_delta_or_final(engine, tiny_checkpoint):
    prompt = [5, 6, 7, 8]
    with LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS) as llm:
        (expected,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    want = expected.outputs[0]

    async def main():
        return await asyncio.gather(
            _all(engine, prompt, GREEDY, "cumulative"),
            _all(
                engine, {"prompt_token_ids": prompt}, GREEDY, "delta", output_kind=OutputKind.DELTA
            ),
            _all(engine, prompt, GREEDY, "final", output_kind=OutputKind.FINAL_ONLY),
        )

    cumulative, deltas, final = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(cumulative) > 1 and cumulative[-1].finished
    lengths = [len(out.outputs[0].token_ids) for out in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    for out in (cumulative[-1], final[-1]):
        got = out.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            "length",
        )
        assert [p[t].logprob for t, p in zip(got.token_ids, got.logprobs, strict=True)] == [
            p[t].logprob for t, p in zip(want.token_ids, want.logprobs, strict=True)
        ]
    assert len(final) == 1
    assert [t for out in deltas for t in out.outputs[0].token_ids] == want.token_ids
    assert "".join(out.outputs[0].text for out in deltas) == want.text


def test_abort_ends_a_request_and_bad_requests_are_value_errors(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        outputs = []
        async for out in engine.generate([5, 6], long, "long"):
            outputs.append(out)
            if len(outputs) == 3:
                await engine.abort("long")
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), 120))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 400

    async def refused(prompt, params, request_id):
        return await asyncio.wait_for(_all(engine, prompt, params, request_id), 120)

    with pytest.raises(ValueError, match="prompt token ids"):
        asyncio.run(refused([10**9], GREEDY, "bad-ids"))
    with pytest.raises(ValueError, match="exactly one"):
        asyncio.run(refused({"text": "x"}, GREEDY, "bad-dict"))

    async def twice():
        first = engine.generate([5, 6], long, "same")
        await first.__anext__()
        try:
            await _all(engine, [7], GREEDY, "same")
        finally:
            await first.aclose()  # leaving the loop aborts it

    with pytest.raises(ValueError, match="duplicate request_id"):
        asyncio.run(asyncio.wait_for(twice(), 120))
