"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one CPU node.

gloo moves every tensor through loopback TCP: on a 2-core machine an all-reduce of one
decode step's activations (32 x 576 float32) takes ~0.85 ms, and a step has 61 of them. Here
each rank copies its tensor into its own slot of a shared file in /dev/shm, publishes a
sequence number, waits until every rank has published the same one, and then adds (or
concatenates) all slots in rank order, so every rank computes bit-identical results.
Two sets of slots alternate between calls: a rank can only reuse a set once every rank has
finished reading it, which it knows from their sequence numbers of the call in between.

Used only on x86-64, where stores become visible to other cores in program order (the slot
is written before its sequence number); tensors larger than a slot go through gloo.
A wait checks the peers' processes every few milliseconds and gives up after the group's
timeout: a rank that died or hangs fails the collective instead of spinning forever.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch

SLOT_BYTES = 16 * 2**20  # per rank and phase: a 2048-token chunk of hidden 2048 in float32
HEADER_BYTES = 4096  # per rank: its sequence number (one cache line each) and its pid
LINE = 64 // 8  # int64s per cache line
SPIN_CHECKS = 200  # busy checks before a wait starts yielding the CPU
LIVENESS_PERIOD = 0.005  # seconds between checks of the peers' processes


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def create(size: int) -> str:
    """Rank 0: a zeroed shared file for `size` ranks, readable by this user alone (it holds
    every request's activations); its path (delete it with `remove`)."""
    path = f"/dev/shm/conveyor-tp-{os.getpid()}-{secrets.token_hex(8)}"
    # O_EXCL: never a file someone else prepared at that name; the mode is set at creation.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + 2 * size * SLOT_BYTES)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmCollectives:
    """One rank's view of the shared file."""

    def __init__(self, path: str, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), HEADER_BYTES + 2 * size * SLOT_BYTES)
        header = np.frombuffer(self._map, dtype=np.int64, count=HEADER_BYTES // 8)
        self._seq = header[: size * LINE : LINE]  # rank r's sequence number
        self._pids = header[size * LINE : size * LINE + size]
        self._pids[rank] = os.getpid()
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES)
        self._calls = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, into `tensor` (contiguous) and returned."""
        slots = self._exchange(tensor)
        torch.add(slots[0], slots[1], out=tensor.view(-1))
        for other in slots[2:]:
            tensor.view(-1).add_(other)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors side by side along the last dimension (rank order)."""
        slots = self._exchange(tensor)
        return torch.cat([s.view(tensor.shape) for s in slots], dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._calls += 1
        count = tensor.numel()
        phase = self._calls % 2
        slots = [self._slot(phase, r, tensor.dtype, count) for r in range(self.size)]
        slots[self.rank].copy_(tensor.reshape(-1))
        self._seq[self.rank] = self._calls  # after the slot: x86 keeps stores in order
        self._wait(self._calls)
        return slots

    def _slot(self, phase: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = (phase * self.size + rank) * SLOT_BYTES
        raw = self._slots[start : start + count * dtype.itemsize]
        return raw.view(dtype)

    def _wait(self, call: int) -> None:
        seq = self._seq
        checks = 0
        start = last_check = time.monotonic()
        while seq.min() < call:
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            os.sched_yield()  # let the front end and the OS have this core
            now = time.monotonic()
            if now - last_check > LIVENESS_PERIOD:
                last_check = now
                self._check_peers(now - start)

    def _check_peers(self, waited: float) -> None:
        for rank in range(self.size):
            if rank != self.rank and not _alive(int(self._pids[rank])):
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (shared-memory wait)")
        if waited > self.timeout:
            late = [r for r in range(self.size) if self._seq[r] < self._calls]
            raise RuntimeError(
                f"tensor-parallel ranks {late} did not reach a collective in {self.timeout:g} s"
            )

    def close(self) -> None:
        self._seq = self._pids = self._slots = None
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the OS frees it with the process
            pass


def _alive(pid: int) -> bool:
    """False for a process that exited, zombies (exited, not yet reaped) included."""
    if pid <= 0:
        return True  # not registered yet
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            state = file.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True
    return state not in (b"Z", b"X")
