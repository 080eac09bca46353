"""The engine-core process: an EngineCore behind two ZeroMQ sockets.

It pulls commands (add, finish, stop) from the front end and pushes one message per step
(every sequence that advanced, plus the core's stats). While it has no work it blocks on its
input socket; while it has work it applies whatever commands are pending between steps, so a new
request joins the very next step. It dies with its parent: PR_SET_PDEATHSIG where the kernel
has it, and a check of the parent's pid whenever it is idle.

CoreProcess is the front end's handle on one such process. This module imports neither torch
nor the engine, so that `conveyor serve` starts the core first and imports the server while
the core loads the model (~2 s of a start on 2 cores).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import TYPE_CHECKING

import zmq

from conveyor import heap

if TYPE_CHECKING:
    from conveyor.engine.core import CoreInfo, CoreStats

# Front end -> core.
ADD, FINISH, STOP = "add", "finish", "stop"
# Core -> front end.
READY, FAILED, STEP, DEAD = "ready", "failed", "step", "dead"
# Both ways: the front end asks for a snapshot (the dashboard), the core answers with one.
SNAPSHOT = "snapshot"

IDLE_POLL_MS = 1000
POLL_SECONDS = 0.5  # the front end's check that a starting core is still alive
PR_SET_PDEATHSIG = 1


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=5)


def decode(frame: bytes):
    return pickle.loads(frame)


class CoreProcess:
    """One engine-core process (`python -m conveyor.engine.core_proc`) and the front end's ends
    of its sockets."""

    def __init__(self, kwargs: dict, context: zmq.Context) -> None:
        self._dir = tempfile.mkdtemp(prefix="conveyor-core-")
        input_address, output_address = self._bind(
            context, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        )
        config = os.path.join(self._dir, "config.pickle")
        with open(config, "wb") as file:
            pickle.dump(kwargs, file, protocol=5)
        # PR_SET_PDEATHSIG fires when the *thread* that started the child exits: only the
        # main thread lives as long as the process.
        pdeathsig = threading.current_thread() is threading.main_thread()
        args = [config, input_address, output_address, str(os.getpid()), str(int(pdeathsig))]
        command = [sys.executable, "-m", "conveyor.engine.core_proc", *args]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        # Readable once the process has exited (Linux 5.3+); None: the watchdog polls instead.
        self.exit_fd = _pidfd(self.proc.pid)

    def _bind(self, context: zmq.Context, input_address: str, output_address: str):
        """Binds the front end's two sockets; returns their addresses (a tcp://HOST:* address
        gets a free port)."""
        self._lock = threading.Lock()
        self.input = context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # never block the front end on a slow core
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_address)
        self.output = context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_address)
        endpoint = zmq.LAST_ENDPOINT
        return self.input.getsockopt_string(endpoint), self.output.getsockopt_string(endpoint)

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

    def wait_ready(self) -> tuple[CoreInfo, CoreStats]:
        """Blocks until the core has loaded the model; raises its error if it could not."""
        while not self.output.poll(int(POLL_SECONDS * 1000)):
            if not self.alive:
                raise RuntimeError(f"{self.exit_description()} before it was ready")
        message = decode(self.output.recv())
        if message[0] == READY:
            return message[1], message[2]
        if message[0] == FAILED:
            _, kind, text, trace = message
            if kind == "ValueError":
                raise ValueError(text)
            raise RuntimeError(f"the engine core failed to start: {kind}: {text}\n{trace}")
        raise RuntimeError(f"unexpected first message from the engine core: {message[0]!r}")

    def send(self, message) -> None:
        """Thread-safe; a message to a core that is gone is dropped (it has failed already)."""
        with self._lock:
            try:
                self.input.send(encode(message), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                pass

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self.send((STOP, None))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
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
        shutil.rmtree(self._dir, ignore_errors=True)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def main(argv: list[str]) -> None:
    """`python -m conveyor.engine.core_proc CONFIG INPUT OUTPUT PARENT_PID PDEATHSIG`, started by
    core_client.CoreProcess. A plain subprocess rather than multiprocessing's spawn: the
    user's main module is not imported again (a script without a __main__ guard works) and no
    resource-tracker process comes along."""
    config, input_address, output_address, parent_pid, pdeathsig = argv
    with open(config, "rb") as file:
        kwargs = pickle.load(file)
    os.unlink(config)  # read once: the settings do not stay on disk while the core runs
    sys.exit(
        run_engine_core(kwargs, input_address, output_address, int(parent_pid), pdeathsig == "1")
    )


def run_engine_core(
    kwargs: dict, input_address: str, output_address: str, parent_pid: int, pdeathsig: bool
) -> int:
    """Runs the core until the front end stops it, is gone, or the core fails; the exit
    status. Also the body of a Ray actor (distributed/ray_placement.py)."""
    heap.pause()  # until the core is built (conveyor/heap.py)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C and SIGTERM go to the whole process group: the front end drains its streams
        # and then stops this process itself, so the core must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if pdeathsig:
        _die_with_parent()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(output_address)
    try:
        from conveyor.engine.core import EngineCore

        core = EngineCore(**kwargs)
    except BaseException as error:  # noqa: BLE001 - the front end re-raises it
        outputs.send(encode((FAILED, type(error).__name__, str(error), traceback.format_exc())))
        outputs.close()
        return 1
    finally:  # before READY: no request waits on its collection
        heap.freeze()
    outputs.send(encode((READY, core.info, core.get_stats())))
    try:
        _busy_loop(core, inputs, outputs, parent_pid)
    except BaseException as error:  # noqa: BLE001 - tell the front end, then exit non-zero
        outputs.send(encode((DEAD, f"{type(error).__name__}: {error}", traceback.format_exc())))
        outputs.close()
        core.close()
        return 1
    outputs.close()
    core.close()
    return 0


def _busy_loop(core, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        if not core.has_unfinished_requests() and not poller.poll(IDLE_POLL_MS):
            if os.getppid() != parent_pid:
                return  # orphaned: the front end is gone
            continue
        applied = 0
        while True:  # every pending command, between two steps
            try:
                frame = inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = decode(frame)
            if message[0] == SNAPSHOT:  # answered between steps; the step path is untouched
                outputs.send(encode((SNAPSHOT, core.snapshot())))
                continue
            if not _apply(core, message, outputs):
                return
            applied += 1
        if core.has_unfinished_requests():
            step_outputs = core.step()
            outputs.send(encode((STEP, step_outputs, core.get_stats())))
        elif applied:  # the last requests were aborted: the front end's gauges go to idle
            outputs.send(encode((STEP, [], core.get_stats())))


def _apply(core, message, outputs: zmq.Socket) -> bool:
    """Applies one command; False on stop."""
    kind, payload = message
    if kind == STOP:
        return False
    if kind == FINISH:
        request_ids, status = payload
        core.finish_requests(request_ids, status)
    elif kind == ADD:
        try:
            core.add_requests(payload)
        except Exception as error:  # noqa: BLE001 - refused: the front end fails this request
            from conveyor.engine.core import CoreOutput

            message = f"the engine core refused it: {type(error).__name__}: {error}"
            failed = [CoreOutput.failed(spec.request_id, message) for spec in payload]
            outputs.send(encode((STEP, failed, core.get_stats())))
    return True


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when the thread that started it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the idle pid check still applies
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
