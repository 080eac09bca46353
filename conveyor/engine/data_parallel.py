"""Data-parallel replicas: N engine cores behind the one front end, each in its own process.

AsyncDPEngine is an EngineClient (engine/client.py). Each replica is an AsyncMPEngine (its own
core process, detokenizer and streams); a request lives on one replica from admission to its
end.
Which one is the router's choice:

  cache (default)  the replica that already holds the longest prefix of the prompt, judged
                   by the chained hashes of its full blocks that earlier requests sent there
                   (what that replica's prefix cache most likely holds); ties and misses go
                   to the least loaded (prompt + output tokens of its open requests), then to
                   the one holding the fewest blocks, so that new prefixes spread out; and a
                   replica loaded beyond twice the least loaded one (plus IMBALANCE_SLACK
                   tokens) gives way to it: a cache hit is not worth a queue;
  round_robin      in turn, for comparison.

A replica that dies moves its open requests that have produced nothing yet to another
replica (the client never notices), fails the others with an error (the other replicas go on),
the router stops sending it work, and /health stays 200 while one replica serves; with
restart, a dead replica starts a new core and rejoins. Only when every replica is gone is the
engine dead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import numpy as np

from conveyor import envs
from conveyor.engine.core_client import AsyncMPEngine, CoreProcess
from conveyor.engine.core_io import EngineStats
from conveyor.engine.records import CoreSnapshot
from conveyor.engine.streams import EngineDeadError, RequestStream
from conveyor.engine_args import EngineArgs
from conveyor.lora.request import LoRARequest
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
ROUTING_POLICIES = ("cache", "round_robin")
TRACKED_BLOCKS = 1 << 16  # block hashes remembered per replica (LRU)
IMBALANCE_SLACK = 2048  # tokens of open requests a cache hit may cost in balance


class Placement(NamedTuple):
    """Where an open request runs, the load it counts there, and what it was submitted
    with (to start it again elsewhere if its replica dies before it produced anything)."""

    replica: int
    tokens: int
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    lora_request: LoRARequest | None = None


class PrefixRouter:
    """Chooses a replica per prompt. Tracks, per replica, the block hashes of the prompts it
    was given (an LRU, like the replica's own prefix cache), and the tokens it has open."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "cache") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"data-parallel routing must be one of {', '.join(ROUTING_POLICIES)}, "
                f"got {policy!r}"
            )
        self.policy = policy
        self.block_size = block_size
        self.blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.load = [0] * num_replicas  # prompt + max output tokens of open requests
        self._next = 0

    def block_hashes(self, prompt: list[int]) -> list[bytes]:
        """Chained digests of the prompt's full blocks: block i's covers blocks 0..i."""
        digests, parent = [], b""
        data = np.asarray(prompt, dtype=np.int64)
        for end in range(self.block_size, len(prompt) + 1, self.block_size):
            parent = hashlib.sha256(parent + data[end - self.block_size : end].tobytes()).digest()
            digests.append(parent)
        return digests

    def choose(self, prompt: list[int] | None, alive: list[bool]) -> int:
        candidates = [i for i, ok in enumerate(alive) if ok]
        if not candidates:
            raise EngineDeadError("every data-parallel replica is down")
        if self.policy == "round_robin":
            for _ in range(len(alive)):
                index, self._next = self._next, (self._next + 1) % len(alive)
                if alive[index]:
                    return index
        hashes = self.block_hashes(prompt) if prompt else []

        def matched(i: int) -> int:
            count = 0
            for digest in hashes:
                if digest not in self.blocks[i]:
                    break
                count += 1
            return count

        load, blocks = self.load, self.blocks
        best = max(candidates, key=lambda i: (matched(i), -load[i], -len(blocks[i]), -i))
        least = min(candidates, key=lambda i: (load[i], len(blocks[i]), i))
        if load[best] > 2 * load[least] + IMBALANCE_SLACK:
            return least
        return best

    def assign(self, replica: int, prompt: list[int] | None, tokens: int) -> None:
        self.load[replica] += tokens
        if not prompt:
            return
        blocks = self.blocks[replica]
        for digest in self.block_hashes(prompt):
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > TRACKED_BLOCKS:
            blocks.popitem(last=False)

    def release(self, replica: int, tokens: int) -> None:
        self.load[replica] = max(0, self.load[replica] - tokens)

    def forget(self, replica: int) -> None:
        """A replica that died lost its cache."""
        self.blocks[replica].clear()
        self.load[replica] = 0


class AsyncDPEngine:
    """N AsyncMPEngine replicas behind one EngineClient."""

    def __init__(
        self,
        args: EngineArgs,
        num_replicas: int,
        *,
        routing: str = "cache",
        iteration_timeout: float | None = None,
        restart: bool = False,
        spawn: Callable = CoreProcess,
    ) -> None:
        """spawn: starts one replica's core (CoreProcess: a local process; RayCoreProcess:
        a Ray actor). On CUDA, replica i's ranks take GPUs i * TP .. i * TP + TP - 1."""
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        if args.num_threads is None and args.device == "cpu":
            # The cores are shared out: N replicas with all threads each would oversubscribe.
            threads = max(1, default_num_threads() // num_replicas)
            args = dataclasses.replace(args, num_threads=threads)
        check_capacity = getattr(spawn, "check_capacity", None)
        if check_capacity is not None:
            check_capacity(args, num_replicas)
        per_replica = [_replica_args(args, i, spawn is CoreProcess) for i in range(num_replicas)]
        self.num_replicas = num_replicas
        self.on_step: Callable | None = None
        self.on_abort: Callable | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.fatal = False
        _resolve_once(args)

        # Started side by side: each waits for its core process to load the model.
        with ThreadPoolExecutor(num_replicas, thread_name_prefix="conveyor-replica") as pool:
            futures = [
                pool.submit(
                    AsyncMPEngine,
                    replica_args,
                    iteration_timeout=iteration_timeout,
                    restart=restart,
                    spawn=spawn,
                )
                for replica_args in per_replica
            ]
            wait(futures)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for future in futures:
                if future.exception() is None:
                    future.result().shutdown()
            raise failed[0]
        self.replicas: list[AsyncMPEngine] = [f.result() for f in futures]
        self._share_grammars()
        for index, replica in enumerate(self.replicas):
            replica.replica_index = index
            replica.on_step = self._on_step
            replica.on_abort = self._on_abort
            replica.on_fatal = self._replica_died
        first = self.replicas[0]
        self.info = first.info
        self.model_config = first.model_config
        self.default_sampling = first.default_sampling
        self.tokenizer = first.tokenizer
        self.router = PrefixRouter(num_replicas, self.info.cache_config.block_size, routing)
        self._placed: dict[str, Placement] = {}  # open requests, by id
        self._restarts = [0] * num_replicas
        for replica in self.replicas:
            replica.on_lost = self._move_lost

    # ---- EngineClient (engine/client.py) --------------------------------------------------

    @property
    def inputs(self):
        return self.replicas[0].inputs

    @property
    def device(self) -> str:
        return self.replicas[0].device

    @property
    def kernel_plan(self) -> dict[str, str]:
        return self.replicas[0].kernel_plan

    replica_index = 0  # callbacks get the replica itself, numbered from 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def is_alive(self) -> bool:
        return any(r.is_alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        if self.is_alive:
            return None
        return next((r.error for r in self.replicas if r.error is not None), None)

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Admits the request on the router's replica; ValueError if it is refused."""
        self._forget_restarted()
        await self.start()
        return self._place(request_id, prompt, params, priority, lora_request=lora_request)

    def _place(
        self, request_id, prompt, params: SamplingParams, priority, stream=None, lora_request=None
    ):
        alive = [r.is_alive for r in self.replicas]
        ids = prompt if isinstance(prompt, list) else None
        index = self.router.choose(ids, alive)
        stream = self.replicas[index].submit(
            request_id, prompt, params, priority, stream, lora_request
        )
        max_tokens = params.max_tokens or self.max_model_len
        tokens = (len(ids) if ids else 0) + max_tokens * params.n
        self.router.assign(index, ids, tokens)
        placed = Placement(index, tokens, prompt, params, priority, lora_request)
        self._placed[request_id] = placed
        return stream

    # ---- LoRA adapters: every replica holds the same ones ------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        for replica in self.replicas:
            await replica.add_lora(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """ValueError while requests on any replica use it (the others forgot it then)."""
        removed = [await replica.remove_lora(lora_id) for replica in self.replicas]
        return any(removed)

    async def list_loras(self) -> set[int]:
        return set().union(*[await replica.list_loras() for replica in self.replicas])

    async def reset_prefix_cache(self) -> bool:
        """Every replica's (True only if each forgot its cached blocks)."""
        return all([await replica.reset_prefix_cache() for replica in self.replicas])

    def _move_lost(self, dying: AsyncMPEngine, streams: list[RequestStream]) -> set[str]:
        """A replica died: its requests that produced nothing yet start again on another
        replica, into the same streams. Returns the ids moved."""
        moved = set()
        for stream in streams:
            placed = self._placed.get(stream.request_id)
            if placed is None:
                continue
            self._release(stream.request_id)
            try:
                self._place(
                    stream.request_id,
                    placed.prompt,
                    placed.params,
                    placed.priority,
                    stream,
                    placed.lora_request,
                )
            except (ValueError, EngineDeadError):
                continue  # no replica takes it: it fails with the dead replica's error
            moved.add(stream.request_id)
        if moved:
            logger.warning(
                "moved %d request(s) without output off replica %d",
                len(moved),
                dying.replica_index,
            )
        return moved

    def _share_grammars(self) -> None:
        """One grammar compiler for all replicas: the serving layer compiles a constraint off
        the event loop before admission, and the chosen replica must find it cached."""
        shared = self.replicas[0].inputs.grammars
        for replica in self.replicas[1:]:
            own = replica.inputs.grammars
            if own is not None and own is not shared:
                own.close()  # its sandbox worker would idle beside the shared one's
            replica.inputs.grammars = shared

    def _forget_restarted(self) -> None:
        """A replica that restarted (--restart-engine) lost its cache and its requests."""
        for index, replica in enumerate(self.replicas):
            if replica.num_restarts != self._restarts[index]:
                self._restarts[index] = replica.num_restarts
                self.router.forget(index)
                self._share_grammars()
                for request_id, placed in list(self._placed.items()):
                    if placed.replica == index:
                        del self._placed[request_id]

    def abort(self, request_id: str) -> None:
        placed = self._placed.get(request_id)
        if placed is not None:
            self.replicas[placed.replica].abort(request_id)

    def drain(self) -> None:
        for replica in self.replicas:
            replica.drain()

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def get_stats(self) -> EngineStats:
        """The replicas' stats summed (KV usage: their mean)."""
        import dataclasses

        stats = [r.get_stats() for r in self.replicas]
        scheduler = stats[0].scheduler
        summed = {
            f.name: sum(getattr(s.scheduler, f.name) for s in stats)
            for f in dataclasses.fields(scheduler)
        }
        summed["kv_cache_usage"] /= len(stats)
        return EngineStats(
            scheduler=type(scheduler)(**summed),
            num_steps=sum(s.num_steps for s in stats),
            num_prompt_tokens_total=sum(s.num_prompt_tokens_total for s in stats),
            num_generation_tokens_total=sum(s.num_generation_tokens_total for s in stats),
            num_blocks=sum(s.num_blocks for s in stats),
        )

    async def snapshots(self) -> list[CoreSnapshot | None]:
        """Each replica's KV block map and request list (None where one did not answer)."""
        answers = await asyncio.gather(*(r.snapshots() for r in self.replicas))
        return [snapshot for answer in answers for snapshot in answer]

    def arrival_time(self, request_id: str) -> float | None:
        placed = self._placed.get(request_id)
        return None if placed is None else self.replicas[placed.replica].arrival_time(request_id)

    # ---- replicas' callbacks -------------------------------------------------------------

    def _on_step(self, replica: AsyncMPEngine, outputs: list) -> None:
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        if self.on_step is not None:
            self.on_step(replica, outputs)

    def _on_abort(self, replica: AsyncMPEngine, request_id: str) -> None:
        self._release(request_id)
        if self.on_abort is not None:
            self.on_abort(replica, request_id)

    def _release(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self.router.release(placed.replica, placed.tokens)

    def _replica_died(self) -> None:
        """A replica is gone for good (no restart, or its restart failed): its requests have
        ended with an error; the router no longer sees it as alive."""
        for index, replica in enumerate(self.replicas):
            if replica.fatal:
                self.router.forget(index)
        for request_id, placed in list(self._placed.items()):
            if self.replicas[placed.replica].fatal:
                del self._placed[request_id]
        dead = [i for i, r in enumerate(self.replicas) if r.fatal]
        logger.error(
            "data-parallel replica(s) %s down; %d serving", dead, self.num_replicas - len(dead)
        )
        if len(dead) == self.num_replicas:
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal()


def _replica_args(args: EngineArgs, index: int, local: bool) -> EngineArgs:
    """Replica `index`'s engine settings: on CUDA, local replicas take GPUs of their own
    (Ray gives each actor its own GPUs already, as its device 0)."""
    if not local or not args.on_cuda or index == 0:
        return args
    first = int(args.device.partition(":")[2] or 0)
    device = f"cuda:{first + index * args.tensor_parallel_size}"
    return dataclasses.replace(args, device=device)


def _resolve_once(args: EngineArgs) -> None:
    """The model's config and tokenizer resolved on this thread, before the replicas' threads
    do it side by side: transformers' package is imported lazily, name by name, and two
    threads asking for its first names at once could get "cannot import name ...". The same
    imports as one engine's front end (no torch where the checkpoint's answers are kept,
    model/resolve_cache.py); an error is left for the replicas to raise."""
    from conveyor.engine.config import resolve_model_config
    from conveyor.model.config import load_tokenizer

    try:
        model_config = resolve_model_config(args)
        if not args.skip_tokenizer_init:
            load_tokenizer(model_config)
    except Exception:  # noqa: BLE001 - each replica raises it again, with its own context
        pass


def default_num_threads() -> int:
    """torch's default CPU thread count, read without importing torch: OMP_NUM_THREADS or
    MKL_NUM_THREADS where set, else one per physical core this process may run on (Linux's
    topology files; without them, each CPU)."""
    if (given := envs.omp_num_threads()) is not None:
        return given
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores) or os.cpu_count() or 1)
