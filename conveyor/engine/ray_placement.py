"""Engine cores as Ray actors (`--distributed-executor-backend ray`).

Ray places each data-parallel replica's engine core on whatever cluster `ray.init()` joins
(`--ray-address`; a local cluster is started when none is given), as an actor that asks for
the CPUs (or GPUs) the core needs: its threads on CPU, one GPU per tensor-parallel rank on
CUDA. The front end stays where the server runs and talks to each actor over the same two
ZeroMQ sockets as to a local core process, with the same signed frames (a key per actor, sent
as an argument of its run() call): on 127.0.0.1 when Ray runs on this machine alone (a cluster
started here), else on each node's address, where anyone who reaches the port may connect. A core's
tensor-parallel ranks are the actor's own child processes, on the actor's node: a TP group
spans one machine, DP replicas span machines.

A dead actor is found by its run() call ending (the front end's watchdog asks Ray every
second); its requests are moved or failed as for a local core, and a new actor is placed
(restart is on by default with Ray) and rejoins the router.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from conveyor.engine.core_client import CoreProcess
from conveyor.engine_args import EngineArgs
from conveyor.messages import Stop

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # conveyor passes no objects through Ray's store
_init_lock = threading.Lock()
# Whether init_ray started the cluster itself (one node, this one): the registry of this
# process's one Ray connection.
_cluster = {"local": False}


def init_ray(address: str | None = None) -> None:
    """Joins the Ray cluster at `address` ("auto": the one this node belongs to), or starts
    a local one; ValueError when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--distributed-executor-backend ray needs Ray: pip install 'conveyor[ray]'"
        ) from None
    with _init_lock:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                logging_level=logging.WARNING,
            )
            _cluster["local"] = True
        logger.info("conveyor: Ray cluster resources %s", ray.cluster_resources())


def actor_resources(args: EngineArgs) -> dict:
    """What one engine core asks Ray for: one GPU per tensor-parallel rank on CUDA (and a
    CPU), else its CPU threads."""
    import torch

    tp = args.tensor_parallel_size
    if args.on_cuda:
        return {"num_cpus": 1, "num_gpus": tp}
    threads = args.num_threads or torch.get_num_threads()
    return {"num_cpus": max(threads, tp), "num_gpus": 0}


def check_capacity(args: EngineArgs, num_replicas: int) -> None:
    """Refuses, before any actor waits forever for resources, a placement the cluster cannot
    hold."""
    import ray

    need = actor_resources(args)
    have = ray.cluster_resources()
    for key, ray_key in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        wanted = need[key] * num_replicas
        if wanted > have.get(ray_key, 0):
            raise ValueError(
                f"{num_replicas} engine core(s) need {wanted:g} {ray_key}s in all, the Ray "
                f"cluster has {have.get(ray_key, 0):g} (lower --num-threads, "
                "--data-parallel-size or --tensor-parallel-size, or add nodes)"
            )


class EngineCoreActor:
    """The Ray actor around one engine core: run() is the core's whole life."""

    def run(self, args: EngineArgs, key: bytes, host: str | None, output_address: str) -> int:
        """host: where the core's command socket listens (None: this node's address)."""
        import ray

        from conveyor.engine.core_proc import run_engine_core

        host = host or ray.util.get_node_ip_address()
        input_address = f"tcp://{host}:*"
        return run_engine_core(args, key, input_address, output_address, os.getppid(), False)

    def pid(self) -> int:
        return os.getpid()


class RayCoreProcess(CoreProcess):
    """CoreProcess's interface over an engine core that runs in a Ray actor."""

    def __init__(self, args: EngineArgs, context: zmq.Context) -> None:
        import ray

        local = _cluster["local"]
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        output_address = self._open(context, f"tcp://{host}:*")
        # Two method slots: pid() answers while run() holds the core.
        actor = ray.remote(max_concurrency=2, max_restarts=0)(EngineCoreActor)
        self.actor = actor.options(**actor_resources(args)).remote()
        self.ref = self.actor.run.remote(args, self.key, host if local else None, output_address)
        self.exit_fd = None  # no pidfd for a process on another node: the watchdog asks Ray
        self._pid: int | None = None

    check_capacity = staticmethod(check_capacity)

    @property
    def pid(self) -> int:
        import ray

        if self._pid is None:
            self._pid = ray.get(self.actor.pid.remote(), timeout=30)
        return self._pid

    @property
    def alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def exit_description(self) -> str:
        import ray

        try:
            code = ray.get(self.ref, timeout=1)
        except ray.exceptions.GetTimeoutError:
            return "the engine core's Ray actor is still running"
        except ray.exceptions.RayError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            return f"the engine core's Ray actor died: {reason}"
        return f"the engine core's Ray actor ended with status {code}"

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        if self.alive:
            self.send(Stop())
            ray.wait([self.ref], timeout=timeout)
        self.kill()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray is shutting down
            pass
        deadline = time.monotonic() + 5
        while self.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        for sock in (self.input, self.output):
            sock.close(linger=0)
