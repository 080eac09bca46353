"""Rank 0's side of tensor parallelism: the other ranks as worker processes.

The engine core stays single: its scheduler runs on rank 0, which starts ranks 1..N-1
(`python -m conveyor.worker.tp_worker`), joins them in one torch.distributed process group
(gloo on CPU, NCCL on CUDA) and, every step, sends them the step's inputs (StepInputs) before
it runs its own share of the forward. The collectives inside the forward (two all-reduces per
layer, the embedding's all-reduce and the logits' all-gather) keep the ranks in lockstep.

Step descriptions travel over ZeroMQ, not over a collective: a worker idles on its socket
between steps as long as the engine has nothing to do, while every collective has a timeout.
So a rank that dies or hangs fails the step it is in (at once when its sockets close, after
the timeout when it hangs), and the engine goes down with an error that names the rank, never
a hang.

Each worker binds its own step socket (PULL, an abstract Unix socket) and says where in its
Hello (messages.py, as every message here); rank 0 connects one PUSH to each, and binds
only the PULL their replies come back on.
Every frame is signed (distributed/channel.py) with a key that reaches the workers on their
stdin, together with the rest of their settings: no file, no temporary folder. The process
group's store and gloo listen on 127.0.0.1 only, and the shared-memory file is the owner's
alone (0600) and unlinked once every rank has mapped it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from conveyor import envs
from conveyor.distributed.channel import Opener, Sealer, hand_over, local_address, new_key
from conveyor.distributed.parallel import DEFAULT_TIMEOUT, TPGroup, TPShard, connect, serve_store
from conveyor.messages import AllocateKV, Failed, Hello, Ready, RunStep, Stop

if TYPE_CHECKING:
    from conveyor.model.config import ModelConfig
    from conveyor.model.plan import PlanSettings

# The labels of the two directions (distributed/channel.py); every worker gets the same steps.
STEPS, REPLIES = "tp-steps", "tp-replies"

POLL_MS = 200


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What every rank needs to build its runner, the same as rank 0's."""

    model_config: ModelConfig
    block_size: int
    seed: int
    kv_cache_dtype: str
    num_threads: int | None  # each rank's CPU threads; None: torch's default
    plan_settings: PlanSettings | None = None  # the kernel plan's (None: the environment's)
    hybrid_kv: bool = True  # KV groups (model/kv_groups.py), as rank 0's runner has them


@dataclass(frozen=True, slots=True)
class RankSettings:
    """One worker's settings, handed over on its stdin: its runner's, and where it joins."""

    runner: WorkerSettings
    rank: int
    size: int
    device: str
    store: tuple[str, int]  # the process group's store
    timeout: float  # of a collective
    join_timeout: float
    key: bytes  # the channel's (distributed/channel.py)
    steps: str  # where its step socket binds
    back: str  # where its replies go
    shm_path: str | None  # the shared-memory all-reduce's file, if any
    parent_pid: int
    pdeathsig: bool


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or CUDA device r (after the first rank's own index)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPWorkers:
    """Ranks 1..N-1 of one engine, each in its own process, and rank 0's process group."""

    def __init__(
        self,
        settings: WorkerSettings,
        size: int,
        device: torch.device,
        timeout: float = DEFAULT_TIMEOUT,
        start_timeout: float = 600.0,
    ) -> None:
        """Starts the workers and returns at once: rank 0 loads its share of the model while
        they start (`group` is its TPGroup, without a process group until `connect`), then
        calls `connect` and `wait_ready`."""
        self.size = size
        self.device, self.timeout = rank_device(device, 0), timeout
        self.start_timeout = start_timeout
        self.group = TPGroup(TPShard(0, size))
        self._context = zmq.Context()
        key = new_key()
        self._sealer, self._opener = Sealer(key, STEPS), Opener(key, REPLIES, ordered=False)
        self._back = self._context.socket(zmq.PULL)
        self._back.setsockopt(zmq.LINGER, 0)
        self._back.bind(local_address("conveyor-tp-back"))
        back_address = self._back.getsockopt_string(zmq.LAST_ENDPOINT)
        self._steps: dict[int, zmq.Socket] = {}  # rank -> connected once it said Hello
        self._store = serve_store("127.0.0.1", size, max(timeout, start_timeout))
        # Ranks on one CPU node add their tensors up through shared memory, not loopback TCP.
        from conveyor.distributed import shm

        use_shm = device.type == "cpu" and shm.available()
        if not envs.tp_shm():  # gloo only (tests, comparisons)
            use_shm = False
        self.shm_path = shm.create(size) if use_shm else None
        self.procs: list[subprocess.Popen] = []
        # Ends the workers and the context at close(), collection or exit, whichever is first.
        self._finalizer = weakref.finalize(
            self, _release, self.procs, self._steps, self._back, self._context, self.shm_path
        )
        # PR_SET_PDEATHSIG fires when the thread that started the child exits.
        pdeathsig = threading.current_thread() is threading.main_thread()
        for rank in range(1, size):
            rank_settings = RankSettings(
                settings,
                rank=rank,
                size=size,
                device=str(rank_device(device, rank)),
                store=("127.0.0.1", self._store.port),
                timeout=timeout,
                join_timeout=start_timeout,
                key=key,
                steps=local_address(f"conveyor-tp-steps{rank}"),
                back=back_address,
                shm_path=self.shm_path,
                parent_pid=os.getpid(),
                pdeathsig=pdeathsig,
            )
            command = [sys.executable, "-m", "conveyor.worker.tp_worker"]
            self.procs.append(subprocess.Popen(command, stdin=subprocess.PIPE))
            hand_over(self.procs[-1], rank_settings)

    def connect(self) -> None:
        """Waits for every worker to be up, then joins the process group with them."""
        self._await(Hello)
        joined = connect(
            self.group.shard,
            self.device,
            store=self._store,
            timeout=self.timeout,
            shm_path=self.shm_path,
            join_timeout=self.start_timeout,
        )
        self.group.pg, self.group.shm = joined.pg, joined.shm

    def wait_ready(self) -> None:
        """Blocks until every worker has loaded its share of the model; raises its error."""
        self._await(Ready)
        if self.shm_path is not None:  # every rank has mapped it: nothing is left on a crash
            from conveyor.distributed.shm import remove

            remove(self.shm_path)

    def _await(self, kind: type[Hello] | type[Ready]) -> None:
        pending = set(range(1, self.size))
        what = "up" if kind is Hello else "ready"
        deadline = time.monotonic() + self.start_timeout
        while pending:
            if self._back.poll(POLL_MS):
                message = self._opener.open(self._back.recv())
                if message is None:  # not from a worker: dropped unread (logged)
                    continue
                if isinstance(message, Hello):
                    self._connect_worker(message.rank, message.address)
                if isinstance(message, Failed):
                    raise message.error(f"tensor-parallel rank {message.rank}")
                if isinstance(message, kind):
                    pending.discard(message.rank)
                continue
            dead = self.dead_ranks()
            if dead:
                raise RuntimeError(f"{self.describe(dead)} before it was {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel ranks {sorted(pending)} not {what} "
                    f"after {self.start_timeout:g} s"
                )

    def _connect_worker(self, rank: int, address: str) -> None:
        if rank in self._steps:
            return
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._steps[rank] = sock

    def send(self, message: AllocateKV | RunStep | Stop) -> None:
        """To every worker (one signed frame for all); never blocks. A worker that is gone
        fails the step's first collective, which names it (`failure`)."""
        frame = self._sealer.seal(message)
        for sock in self._steps.values():
            sock.send(frame, zmq.NOBLOCK)

    def publish(self, step) -> None:
        """Rank 0's runner calls it with each step's inputs, before its own forward."""
        self.send(RunStep(step))

    def allocate(self, num_blocks: int) -> None:
        self.send(AllocateKV(num_blocks))

    def dead_ranks(self) -> list[int]:
        return [rank for rank, proc in enumerate(self.procs, 1) if proc.poll() is not None]

    def describe(self, ranks: list[int]) -> str:
        parts = []
        for rank in ranks:
            code = self.procs[rank - 1].poll()
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
            parts.append(f"tensor-parallel rank {rank} {how}")
        return "; ".join(parts)

    def failure(self, error: BaseException) -> RuntimeError:
        """The error a failed collective becomes: which rank died, if one did."""
        for _ in range(10):  # a killed peer's exit may lag its closed sockets a little
            dead = self.dead_ranks()
            if dead:
                return RuntimeError(f"{self.describe(dead)}; the engine stops: {error}")
            time.sleep(0.05)
        return RuntimeError(f"a tensor-parallel collective failed: {error}")

    def close(self, timeout: float = 5.0) -> None:
        """Stops the workers (killed if they do not exit in time) and frees the sockets
        (idempotent)."""
        if not self._finalizer.alive:
            return
        if self._steps:
            try:
                self.send(Stop())
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()


def _release(
    procs: list[subprocess.Popen],
    steps: dict[int, zmq.Socket],
    back: zmq.Socket,
    context: zmq.Context,
    shm_path: str | None,
) -> None:
    """Kills the workers still running, closes the sockets, then ends the context (which
    would otherwise wait for them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    for sock in [*steps.values(), back]:
        sock.close(linger=0)
    context.destroy(linger=0)
    if shm_path is not None:
        from conveyor.distributed.shm import remove

        remove(shm_path)
