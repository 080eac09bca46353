"""The engine-core process: an EngineCore behind two ZeroMQ sockets.

It pulls commands (messages.py: AddRequests, FinishRequests, SnapshotRequest, CoreCall,
Stop) from the front end and pushes one StepOutput per step (every sequence that advanced, plus
the core's stats). While it has no work it blocks on its input socket; while it has work it
applies whatever commands are pending between steps, so a new request joins the very next step.
It dies with its parent: PR_SET_PDEATHSIG where the kernel has it, and a check of the parent's
pid whenever it is idle.

Every frame is signed with a key made for this core (distributed/channel.py); each side binds
only its receiving socket (the core its commands' PULL, the front end its outputs' PULL) and
connects its sending one to the other's, after the core has said where it listens (Hello).
The key and the settings reach the core through its stdin: no file, no temporary folder, so a
front end that is killed leaves nothing behind on disk.

CoreProcess is the front end's handle on one such process. This module imports neither torch
nor the engine, so that `conveyor serve` starts the core first and imports the server while
the core loads the model. The model's ModelConfig is resolved by the front end, which needs
transformers for the tokenizer anyway, and handed over on stdin after the settings: the core
imports torch meanwhile and never imports transformers (~4 s less CPU per start on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from conveyor import heap
from conveyor.distributed.channel import (
    Opener,
    Sealer,
    die_with_parent,
    hand_over,
    local_address,
    new_key,
    read_settings,
)
from conveyor.messages import (
    CORE_CALLS,
    AddRequests,
    CoreCall,
    CoreReply,
    Dead,
    Failed,
    FinishRequests,
    Hello,
    Ready,
    Snapshot,
    SnapshotRequest,
    StepOutput,
    Stop,
)

if TYPE_CHECKING:
    from conveyor.engine.core_io import CoreInfo, CoreStats
    from conveyor.engine_args import EngineArgs
    from conveyor.model.config import ModelConfig

IDLE_POLL_MS = 1000
POLL_SECONDS = 0.5  # the front end's check that a starting core is still alive
# The labels of the two directions (distributed/channel.py).
COMMANDS, OUTPUTS = "core-commands", "core-outputs"


def encode(message: object) -> bytes:
    """A message as the core sends it, pickled and signed (under a throwaway key): what
    bench/split.py times per step."""
    return Sealer(new_key(), OUTPUTS).seal(message)


class CoreProcess:
    """One engine-core process (`python -m conveyor.engine.core_proc`) and the front end's ends
    of its sockets."""

    model_config: ModelConfig | None = None  # resolved here for the core; None: by the core

    def __init__(self, args: EngineArgs, context: zmq.Context) -> None:
        output_address = self._open(context, local_address("conveyor-core-out"))
        # PR_SET_PDEATHSIG fires when the *thread* that started the child exits: only the
        # main thread lives as long as the process.
        pdeathsig = threading.current_thread() is threading.main_thread()
        input_address = local_address("conveyor-core-in")
        settings = (args, self.key, input_address, output_address, os.getpid(), pdeathsig)
        command = [sys.executable, "-m", "conveyor.engine.core_proc"]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        hand_over(self.proc, settings, last=False)
        # The model's config next, resolved here while the core imports torch: transformers
        # (~3 s to import with a config class) is then imported by the front end alone, which
        # needs it for the tokenizer anyway. None: the core resolves it, and raises its error.
        self.model_config = _model_config(args)
        hand_over(self.proc, self.model_config)
        # Readable once the process has exited (Linux 5.3+); None: the watchdog polls instead.
        self.exit_fd = _pidfd(self.proc.pid)

    def _open(self, context: zmq.Context, output_address: str) -> str:
        """Makes the channel's key and the front end's sockets: PULL for the core's outputs,
        bound at `output_address` (returned as bound: a tcp://HOST:* address gets a free
        port), and PUSH for commands, connected when the core says where it listens."""
        self.key = new_key()
        self._sealer, self._opener = Sealer(self.key, COMMANDS), Opener(self.key, OUTPUTS)
        self._lock = threading.Lock()
        self.input_address: str | None = None
        self.input = context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # never block the front end on a slow core
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        return self.output.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str:
        try:
            code = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "the engine core process is still running"
        if code < 0:
            return f"the engine core process was killed by {signal.Signals(-code).name}"
        return f"the engine core process exited with code {code}"

    def open(self, frame: bytes):
        """A frame from the output socket as the core's message; None for a frame dropped
        unread (not signed by the core) and for Hello (the command socket connects then)."""
        message = self._opener.open(frame)
        if isinstance(message, Hello):
            if self.input_address is None:
                self.input_address = message.address
                self.input.connect(self.input_address)
            return None
        return message

    def receive(self):
        """The core's next message, blocking; None once the core is gone."""
        while True:
            while not self.output.poll(int(POLL_SECONDS * 1000)):
                if not self.alive:
                    return None
            message = self.open(self.output.recv())
            if message is not None:
                return message

    def wait_ready(self) -> tuple[CoreInfo, CoreStats]:
        """Blocks until the core has loaded the model; raises its error if it could not."""
        message = self.receive()
        match message:
            case None:
                raise RuntimeError(f"{self.exit_description()} before it was ready")
            case Ready(info=info, stats=stats):
                return info, stats
            case Failed():
                raise message.error("the engine core")
        raise RuntimeError(f"unexpected first message from the engine core: {message!r}")

    def send(self, message) -> None:
        """Thread-safe; a message to a core that is gone (or not listening yet) is dropped: it
        has failed already, or is being stopped before it was ready."""
        with self._lock:
            try:
                self.input.send(self._sealer.seal(message), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                pass

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self.send(Stop())
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Ends the process and closes the sockets (idempotent)."""
        if self.alive:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # in uninterruptible sleep; reaped by the OS later
            pass
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None
        for sock in (self.input, self.output):
            sock.close(linger=0)


def _model_config(args: EngineArgs):
    """resolve_model_config(args), or None when it raises (the core raises it again)."""
    try:
        from conveyor.engine.config import resolve_model_config

        return resolve_model_config(args)
    except Exception:  # noqa: BLE001 - the core's Failed message carries the error
        return None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def main() -> None:
    """`python -m conveyor.engine.core_proc`, started by CoreProcess with its settings on stdin.
    A plain subprocess rather than multiprocessing's spawn: the user's main module is not
    imported again (a script without a __main__ guard works) and no resource-tracker process
    comes along."""
    sys.exit(run_engine_core(*read_settings(), model_config=read_settings))


def run_engine_core(
    args: EngineArgs,
    key: bytes,
    input_address: str,
    output_address: str,
    parent_pid: int,
    pdeathsig: bool,
    model_config: Callable[[], ModelConfig | None] | None = None,
) -> int:
    """Runs the core until the front end stops it, is gone, or the core fails; the exit
    status. Binds the command socket at `input_address`, connects to the front end's output
    socket. model_config: gives the model's config worked out by the front end, or None
    (the core then reads it from the checkpoint, as it does without). Also the body of a Ray
    actor (engine/ray_placement.py)."""
    heap.pause()  # until the core is built (conveyor/heap.py)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C and SIGTERM go to the whole process group: the front end drains its streams
        # and then stops this process itself, so the core must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if pdeathsig:
        die_with_parent()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.bind(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)  # the last message (Failed, Dead) gets out
    outputs.connect(output_address)
    link = _Link(inputs, outputs, key)
    status = 1
    try:
        link.send(Hello(inputs.getsockopt_string(zmq.LAST_ENDPOINT)))
        status = _serve(args, link, parent_pid, model_config)
        return status
    finally:
        inputs.close(linger=0)
        # Stopped (or orphaned), the front end reads no more: a step sent after it stopped
        # reading is dropped, not waited on for the linger. A failure's last message gets out.
        outputs.close(linger=0 if status == 0 else None)
        context.term()


class _Link:
    """The core's ends of its channel: commands in (bound here), outputs out."""

    def __init__(self, inputs: zmq.Socket, outputs: zmq.Socket, key: bytes) -> None:
        self.inputs, self.outputs = inputs, outputs
        self._sealer, self._opener = Sealer(key, OUTPUTS), Opener(key, COMMANDS)

    def send(self, message) -> None:
        self.outputs.send(self._sealer.seal(message))

    def receive(self):
        """The next pending command, None when none is; frames dropped unread are skipped."""
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            message = self._opener.open(frame)
            if message is not None:
                return message


def _serve(args: EngineArgs, link: _Link, parent_pid: int, model_config=None) -> int:
    try:
        from conveyor.engine.core import EngineCore

        core = EngineCore(args, model_config=model_config() if model_config else None)
    except BaseException as error:  # noqa: BLE001 - the front end re-raises it
        link.send(Failed(type(error).__name__, str(error), traceback.format_exc()))
        return 1
    finally:  # before Ready: no request waits on its collection
        heap.freeze()
    try:
        link.send(Ready(core.info, core.get_stats()))
        _busy_loop(core, link, parent_pid)
    except BaseException as error:  # noqa: BLE001 - tell the front end, then exit non-zero
        link.send(Dead(f"{type(error).__name__}: {error}", traceback.format_exc()))
        return 1
    finally:
        core.close()
    return 0


def _busy_loop(core, link: _Link, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(link.inputs, zmq.POLLIN)
    while True:
        if not core.has_unfinished_requests():
            busy = core.idle_work()  # a slice of it, if any is left, then back to the sockets
            if not poller.poll(0 if busy else IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    return  # orphaned: the front end is gone
                continue
        applied = 0
        while (message := link.receive()) is not None:  # every pending command, between steps
            if isinstance(message, SnapshotRequest):  # between steps; the step path is untouched
                link.send(Snapshot(core.snapshot()))
                continue
            if isinstance(message, CoreCall):
                link.send(_core_call(core, message))
                applied += 1  # the stats (adapters held, blocks cached) go out after it
                continue
            if not _apply(core, message, link):
                return
            applied += 1
        if core.has_unfinished_requests():
            step_outputs = core.step()
            link.send(StepOutput(step_outputs, core.get_stats()))
        elif applied:  # the last requests were aborted: the front end's gauges go to idle
            link.send(StepOutput([], core.get_stats()))


def _core_call(core, call: CoreCall) -> CoreReply:
    """One of EngineCore's CORE_CALLS; a ValueError (a folder that cannot be applied, an
    adapter in use) is the caller's, sent back as text."""
    if call.method not in CORE_CALLS:
        return CoreReply(call.call_id, error=f"unknown engine-core call {call.method!r}")
    method = getattr(core, call.method)
    try:
        result = method() if call.argument is None else method(call.argument)
    except ValueError as error:
        return CoreReply(call.call_id, error=str(error))
    return CoreReply(call.call_id, True if call.method == "add_lora" else result)


def _apply(core, message: AddRequests | FinishRequests | Stop, link: _Link) -> bool:
    """Applies one command; False on Stop."""
    match message:
        case Stop():
            return False
        case FinishRequests(sequence_ids=ids, status=status):
            core.finish_requests(ids, status)
        case AddRequests(sequences=sequences):
            try:
                core.add_requests(sequences)
            except Exception as error:  # noqa: BLE001 - refused: the front end fails them
                from conveyor.engine.core_io import CoreOutput

                text = f"the engine core refused it: {type(error).__name__}: {error}"
                failed = [CoreOutput.failed(spec.request_id, text) for spec in sequences]
                link.send(StepOutput(failed, core.get_stats()))
    return True


if __name__ == "__main__":
    main()
