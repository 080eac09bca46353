"""Hostile scale-out: the sockets between conveyor's processes unpickle nothing a stranger sends
(an unsigned, a tampered or a replayed frame is dropped unread and logged, and the engine goes
on serving), whether the engine core is a child process or a Ray actor; a tensor-parallel run
keeps its shared memory to its user and its rendezvous on loopback; and lifetimes are clean:
`with LLM(...)`, a dropped LLM, a constructor that fails halfway and a SIGKILLed server leave
no process and no temporary folder behind."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq
from server_util import HTTP, ServerProcess

from conveyor import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
DROPPED = "dropped an unauthenticated frame"


class Exploit:
    """A pickle that creates `marker` wherever it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forged_frames(marker: Path, key: bytes | None, label: str) -> list[bytes]:
    """A bare pickle, one under a wrong MAC, and one signed with the right key and label but
    the channel's first sequence number, used already (a replay; send it after some traffic)."""
    bare = pickle.dumps(Exploit(marker))
    frames = [bare, b"\0" * 40 + bare]
    if key is not None:
        from conveyor.distributed.channel import Sealer

        frames.append(Sealer(key, label).seal(Exploit(marker)))
    return frames


def _send(address: str, frames: list[bytes]) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.connect(address)
    for frame in frames:
        sock.send(frame)
    sock.close(linger=5000)  # until they are delivered
    context.term()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int, needle: str) -> list[int]:
    """Live processes whose parent is pid and whose command line holds `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and needle in command and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.append(address)
    return found


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _attack(process, tmp_path: Path) -> Path:
    """Sends forged frames to both of an engine core's sockets; the marker they would make."""
    from conveyor.engine import core_proc

    marker = tmp_path / "pwned"
    output = process.output.getsockopt_string(zmq.LAST_ENDPOINT)
    key = getattr(process, "key", None)  # None: a front end that signs nothing
    _send(output, _forged_frames(marker, key, getattr(core_proc, "OUTPUTS", "")))
    # The core's own socket: it binds one (and says where) only when it checks frames.
    if key is not None:
        _send(process.input_address, _forged_frames(marker, key, core_proc.COMMANDS))
    return marker


def test_forged_frames_to_an_engine_core_process_are_dropped_unread(model, tmp_path, caplog, capfd):
    llm = LLM(model, dtype="float64", engine_process=True)
    try:
        before = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        process = llm.engine.core.process
        marker = _attack(process, tmp_path)
        time.sleep(0.5)
        after = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before  # the core still serves, and nothing it sent was lost
        assert not marker.exists(), "a forged frame was unpickled"
        assert process._opener.num_dropped == 3
    finally:
        llm.engine.shutdown()
    assert caplog.text.count(DROPPED) >= 1  # the front end's socket
    assert DROPPED in capfd.readouterr().err  # the core's (its stderr)
    assert not marker.exists()


def test_forged_frames_to_a_ray_engine_core_are_dropped_unread(model, tmp_path):
    ray = pytest.importorskip("ray")
    from conveyor.engine.core_client import AsyncMPEngine
    from conveyor.engine.ray_placement import RayCoreProcess, init_ray
    from conveyor.engine_args import EngineArgs

    init_ray()  # a local cluster: both ends listen on loopback only
    args = EngineArgs(model=model, dtype="float64", num_threads=1)

    async def generate(engine, request_id: str) -> list[int]:
        stream = await engine.add_request(request_id, [5, 6, 7], GREEDY)
        async for out in stream:
            if out.finished:
                return out.outputs[0].token_ids

    async def attack_then_generate() -> None:
        engine = AsyncMPEngine(args, spawn=RayCoreProcess)
        try:
            process = engine._process
            output = process.output.getsockopt_string(zmq.LAST_ENDPOINT)
            assert output.startswith("tcp://127.0.0.1:")
            assert process.input_address.startswith("tcp://127.0.0.1:")
            before = await generate(engine, "before")
            marker = _attack(process, tmp_path)
            assert await generate(engine, "after") == before
            assert not marker.exists(), "a forged frame was unpickled"
            assert process._opener.num_dropped == 3
        finally:
            engine.shutdown()

    try:
        asyncio.run(attack_then_generate())
    finally:
        ray.shutdown()


def test_tensor_parallel_shared_memory_is_owner_only_and_its_store_on_loopback():
    from conveyor.distributed import shm
    from conveyor.distributed.parallel import serve_store

    if shm.available():
        old = os.umask(0)  # the mode must not depend on the caller's umask
        try:
            path = shm.create(2)
        finally:
            os.umask(old)
        try:
            assert os.stat(path).st_mode & 0o777 == 0o600
        finally:
            shm.remove(path)
    store = serve_store("127.0.0.1", 2, timeout=5)
    assert _listeners(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 nor ::
    del store


def test_with_block_ends_every_rank_and_leaves_nothing_on_disk(model):
    with LLM(model, dtype="float64", tensor_parallel_size=2) as llm:
        workers = llm.engine.core.tp_workers
        pids = [p.pid for p in workers.procs]
        # The shared file (rank 0's, named after this process) is unlinked once mapped: a
        # crash cannot leave it behind.
        ours = f"conveyor-tp-{os.getpid()}-"
        assert [name for name in os.listdir("/dev/shm") if name.startswith(ours)] == []
        assert _children(os.getpid(), "conveyor.worker.tp_worker") == pids
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not _wait_gone(pids, timeout=0.5), "a rank outlived its `with` block"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent


def test_a_constructor_that_fails_halfway_leaves_no_rank(model, monkeypatch):
    import conveyor.engine.llm_engine as llm_engine

    def broken(config):
        raise OSError("tokenizer unreadable")

    monkeypatch.setattr(llm_engine, "load_tokenizer", broken)
    with pytest.raises(OSError, match="tokenizer unreadable"):
        LLM(model, dtype="float64", tensor_parallel_size=2)
    assert _children(os.getpid(), "conveyor.worker.tp_worker") == []


def test_a_dropped_llm_ends_its_ranks_and_the_script_exits(model, tmp_path):
    script = textwrap.dedent(
        f"""
        import gc, os
        from conveyor import LLM, SamplingParams
        llm = LLM({model!r}, dtype="float64", tensor_parallel_size=2)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        pids = [p.pid for p in llm.engine.core.tp_workers.procs]
        print("pids", *pids, flush=True)
        del llm
        print("alive", *[p for p in pids if os.path.exists(f"/proc/{{p}}")], flush=True)
        gc.collect()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = {
        line.split()[0]: [int(pid) for pid in line.split()[1:]]
        for line in result.stdout.splitlines()
        if line.startswith(("pids", "alive"))
    }
    assert printed["alive"] == [], "a rank outlived its dropped LLM"
    assert not _wait_gone(printed["pids"], timeout=5)


def test_a_killed_server_leaves_no_core_and_no_temporary_folder(model, tmp_path, monkeypatch):
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    server = ServerProcess([model, "--dtype", "float32"], tmp_path / "server.log")
    try:
        cores = _children(server.proc.pid, "conveyor.engine.core_proc")
        assert len(cores) == 1
        assert HTTP.get(f"{server.base_url}/health").status_code == 200
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert not _wait_gone(cores), "the engine core outlived its front end"
        assert [p.name for p in private.iterdir() if p.name.startswith("conveyor-")] == []
    finally:
        server.stop()
