"""A tensor-parallel rank > 0: `python -m conveyor.distributed.worker SETTINGS`, started by
executor.TPWorkers in the engine core's process.

It joins the process group, loads its share of the model, and then runs whatever step rank 0
sends: its share of the forward, in lockstep with the other ranks through the collectives.
It never samples and keeps no request state. It dies with its parent (PR_SET_PDEATHSIG, and a
check of the parent's pid while idle) and exits when a collective fails.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback

import zmq

IDLE_POLL_MS = 1000


def main(argv: list[str]) -> None:
    (path,) = argv
    with open(path, "rb") as file:
        settings = pickle.load(file)
    os.unlink(path)
    sys.exit(run_worker(settings))


def run_worker(settings: dict) -> int:
    from conveyor.distributed.executor import ALLOCATE, FAILED, HELLO, READY, STEP, STOP

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core stops this process itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if settings["pdeathsig"]:
        from conveyor.engine.core_proc import _die_with_parent

        _die_with_parent()
    rank = settings["rank"]
    context = zmq.Context()
    back = context.socket(zmq.PUSH)
    back.setsockopt(zmq.LINGER, 5000)
    back.connect(settings["back"])
    steps = context.socket(zmq.PULL)
    steps.connect(settings["steps"])
    back.send(pickle.dumps((HELLO, rank)))
    try:
        runner = _build_runner(settings)
    except BaseException as error:  # noqa: BLE001 - rank 0 re-raises it
        message = (FAILED, rank, type(error).__name__, str(error), traceback.format_exc())
        back.send(pickle.dumps(message))
        back.close()
        return 1
    back.send(pickle.dumps((READY, rank)))
    while True:
        if not steps.poll(IDLE_POLL_MS):
            if os.getppid() != settings["parent_pid"]:
                return 0  # orphaned: the engine core is gone
            continue
        kind, payload = pickle.loads(steps.recv())
        if kind == STOP:
            return 0
        try:
            if kind == STEP:
                runner.run_step(payload)
            elif kind == ALLOCATE:
                runner.allocate_kv_cache(payload)
        except Exception:  # noqa: BLE001 - a failed collective: rank 0 fails too
            traceback.print_exc()
            return 1


def _build_runner(settings: dict):
    import torch

    from conveyor.distributed.parallel import TPShard, connect
    from conveyor.worker.model_runner import ModelRunner

    if settings["num_threads"] is not None:
        torch.set_num_threads(settings["num_threads"])
    device = torch.device(settings["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = connect(
        TPShard(settings["rank"], settings["size"]),
        device,
        address=settings["store"],
        timeout=settings["timeout"],
        shm_path=settings["shm_path"],
    )
    torch.manual_seed(settings["seed"])
    return ModelRunner(
        settings["model_config"],
        device,
        settings["block_size"],
        settings["seed"],
        settings["kv_cache_dtype"],
        tp=group,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
