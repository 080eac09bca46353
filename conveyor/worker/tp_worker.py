"""A tensor-parallel rank > 0: `python -m conveyor.worker.tp_worker`, started by
executor.TPWorkers in the engine core's process, with its settings (and its channel's key) on
stdin.

It joins the process group, loads its share of the model, and then runs whatever step rank 0
sends: its share of the forward, in lockstep with the other ranks through the collectives.
It never samples and keeps no request state. It dies with its parent (PR_SET_PDEATHSIG, and a
check of the parent's pid while idle) and exits when a collective fails.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

import zmq

from conveyor.distributed.channel import Opener, Sealer, die_with_parent, read_settings

if TYPE_CHECKING:
    from conveyor.worker.executor import RankSettings

IDLE_POLL_MS = 1000


def main() -> None:
    sys.exit(run_worker(read_settings()))


def run_worker(settings: RankSettings) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core stops this process itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if settings.pdeathsig:
        die_with_parent()
    context = zmq.Context()
    back = context.socket(zmq.PUSH)
    back.setsockopt(zmq.LINGER, 5000)  # Failed gets out before the exit
    back.connect(settings.back)
    steps = context.socket(zmq.PULL)
    steps.setsockopt(zmq.LINGER, 0)
    steps.bind(settings.steps)
    status = 1
    try:
        status = _serve(settings, steps, back)
        return status
    finally:
        steps.close(linger=0)
        # Stopped (or orphaned), rank 0 reads no more: a reply it will not read is dropped, not
        # waited on for the linger. A failure's message gets out.
        back.close(linger=0 if status == 0 else None)
        context.term()


def _serve(settings: RankSettings, steps: zmq.Socket, back: zmq.Socket) -> int:
    from conveyor.messages import AllocateKV, Failed, Hello, Ready, RunStep, Stop
    from conveyor.worker.executor import REPLIES, STEPS

    rank = settings.rank
    sealer, opener = Sealer(settings.key, REPLIES), Opener(settings.key, STEPS)
    back.send(sealer.seal(Hello(steps.getsockopt_string(zmq.LAST_ENDPOINT), rank)))
    try:
        runner = _build_runner(settings)
    except BaseException as error:  # noqa: BLE001 - rank 0 re-raises it
        failed = Failed(type(error).__name__, str(error), traceback.format_exc(), rank)
        back.send(sealer.seal(failed))
        return 1
    back.send(sealer.seal(Ready(rank=rank)))
    while True:
        if not steps.poll(IDLE_POLL_MS):
            if os.getppid() != settings.parent_pid:
                return 0  # orphaned: the engine core is gone
            continue
        message = opener.open(steps.recv())
        if message is None:  # not from rank 0: dropped unread (logged)
            continue
        if isinstance(message, Stop):
            return 0
        try:
            match message:
                case RunStep(step=step):
                    runner.run_step(step)
                case AllocateKV(num_blocks=num_blocks):
                    runner.allocate_kv_cache(num_blocks)
        except Exception:  # noqa: BLE001 - a failed collective: rank 0 fails too
            traceback.print_exc()
            return 1


def _build_runner(settings: RankSettings):
    import torch

    from conveyor.distributed.parallel import TPShard, connect
    from conveyor.worker.model_runner import ModelRunner

    own = settings.runner
    if own.num_threads is not None:
        torch.set_num_threads(own.num_threads)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = connect(
        TPShard(settings.rank, settings.size),
        device,
        address=settings.store,
        timeout=settings.timeout,
        join_timeout=settings.join_timeout,
        shm_path=settings.shm_path,
    )
    torch.manual_seed(own.seed)
    return ModelRunner(
        own.model_config,
        device,
        own.block_size,
        own.seed,
        own.kv_cache_dtype,
        tp=group,
        plan_settings=own.plan_settings,
        hybrid_kv=own.hybrid_kv,
    )


if __name__ == "__main__":
    main()
