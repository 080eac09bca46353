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
from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.openai.api_server import build_app

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MEMBERS = sorted(
    {name for name in vars(EngineClient) if not name.startswith("_")}
    | set(EngineClient.__annotations__)
)


@pytest.fixture(scope="module")
def args(tiny_checkpoint):
    return EngineArgs(model=str(tiny_checkpoint("llama")), dtype="float32", num_threads=1)


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


def test_every_engine_shape_is_an_engine_client_and_serves(args):
    local = AsyncEngine(LLMEngine(args.model, dtype="float32"))
    process = AsyncMPEngine(args)
    replicated = AsyncDPEngine(args, 2)
    try:
        answers = [_check(local, 1), _check(process, 1), _check(replicated, 2)]
        assert [r.replica_index for r in replicated.replicas] == [0, 1]
        assert all(r.device == "cpu" for r in replicated.replicas)
    finally:
        for engine in (local, process, replicated):
            engine.shutdown()
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 4


def test_an_llm_engine_is_wrapped_not_taken_for_a_client(args):
    engine = LLMEngine(args.model, dtype="float32")
    app = build_app(engine, "tiny", dashboard=False)
    try:
        assert isinstance(app.state.engine, AsyncEngine)
        assert app.state.engine.engine is engine
    finally:
        app.state.engine.shutdown()


def test_messages_are_torch_free_and_cross_a_signed_channel_as_they_are():
    """messages.py: the front end loads it before torch; every kind survives the
    channel's pickling (distributed/channel.py) with its type and fields."""
    import subprocess
    import sys

    code = (
        "import sys, conveyor.messages, conveyor.engine.core_proc\n"
        "heavy = [m for m in ('torch', 'conveyor.engine.core') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

    from conveyor import messages as m
    from conveyor.distributed.channel import Opener, Sealer, new_key

    key = new_key()
    sealer, opener = Sealer(key, "test"), Opener(key, "test")
    sent = [
        m.AddRequests(["spec"]),
        m.FinishRequests(["a", "b"], 5),
        m.SnapshotRequest(),
        m.Stop(),
        m.AllocateKV(7),
        m.RunStep({"step": 1}),
        m.Hello("ipc://@x", rank=2),
        m.Ready(rank=3),
        m.Failed("ValueError", "bad", "trace", rank=1),
        m.StepOutput([], None),
        m.Snapshot(None),
        m.Dead("RuntimeError: x", "trace"),
    ]
    received = [opener.open(sealer.seal(message)) for message in sent]
    assert received == sent and [type(r) for r in received] == [type(s) for s in sent]
    assert isinstance(m.Failed("ValueError", "bad", "").error("x"), ValueError)
    error = m.Failed("OSError", "disk", "tb", rank=1).error("tensor-parallel rank 1")
    assert isinstance(error, RuntimeError) and "rank 1 failed to start: OSError: disk" in str(error)
