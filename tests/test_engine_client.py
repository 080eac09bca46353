"""The server's three engine shapes are one EngineClient (engine/client.py): each has every
member the server uses, says where it runs and how many replicas it has, and serves a request
through the Protocol's own methods; build_app takes any of them as it is."""

from __future__ import annotations

import asyncio

import pytest

from conveyor import SamplingParams
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.client import EngineClient
from conveyor.engine.core_client import AsyncMPEngine
from conveyor.engine.data_parallel import AsyncDPEngine
from conveyor.engine.llm_engine import LLMEngine
from conveyor.entrypoints.openai.api_server import build_app

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MEMBERS = sorted(
    {name for name in vars(EngineClient) if not name.startswith("_")}
    | set(EngineClient.__annotations__)
)


@pytest.fixture(scope="module")
def kwargs(tiny_checkpoint):
    return dict(model=str(tiny_checkpoint("llama")), dtype="float32", num_threads=1)


async def _generate(engine: EngineClient, request_id: str) -> list[int]:
    await engine.start()
    stream = await engine.add_request(request_id, [5, 6, 7], GREEDY)
    tokens: list[int] = []
    async for out in stream:
        tokens += out.outputs[0].token_ids
    return tokens


def _check(engine: EngineClient, replicas: int) -> list[int]:
    assert isinstance(engine, EngineClient)
    missing = [name for name in MEMBERS if not hasattr(engine, name)]
    assert not missing, missing
    assert {"device", "num_replicas", "replica_index", "snapshots", "on_step"} <= set(MEMBERS)
    assert engine.device == "cpu"
    assert engine.num_replicas == replicas
    assert engine.replica_index == 0
    assert engine.is_alive and engine.error is None
    app = build_app(engine, "tiny", dashboard=True)
    assert app.state.engine is engine  # taken as it is, not wrapped
    return asyncio.run(_generate(engine, "r0"))


def test_every_engine_shape_is_an_engine_client_and_serves(kwargs):
    local = AsyncEngine(LLMEngine(kwargs["model"], dtype="float32"))
    process = AsyncMPEngine(kwargs)
    replicated = AsyncDPEngine(kwargs, 2)
    try:
        answers = [_check(local, 1), _check(process, 1), _check(replicated, 2)]
        assert [r.replica_index for r in replicated.replicas] == [0, 1]
        assert all(r.device == "cpu" for r in replicated.replicas)
    finally:
        for engine in (local, process, replicated):
            engine.shutdown()
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 4


def test_an_llm_engine_is_wrapped_not_taken_for_a_client(kwargs):
    engine = LLMEngine(kwargs["model"], dtype="float32")
    app = build_app(engine, "tiny", dashboard=False)
    try:
        assert isinstance(app.state.engine, AsyncEngine)
        assert app.state.engine.engine is engine
    finally:
        app.state.engine.shutdown()
