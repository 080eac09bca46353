"""Authenticated frames between conveyor's processes, and where their sockets listen.

Every ZeroMQ frame that carries a pickle (front end <-> engine core, whether the core is a child
process or a Ray actor on another node; engine core <-> tensor-parallel workers) is

    HMAC-SHA256(key, label | sequence | pickle) (32 bytes) | sequence (8 bytes) | pickle

The key is made per channel at start (`new_key`) and reaches the peer only through its stdin or
its Ray actor's arguments, never through a file or a socket. A receiver drops, and logs, a frame
whose MAC does not match or whose sequence number does not rise (a replay) before unpickling
anything. The label names the channel and its direction, so that a frame cannot be reflected
back to its sender or moved to another channel.

A second rule closes the other half of the hole: a bound socket only ever receives (PULL). Each
side connects its PUSH to the other's bound PULL, because a stranger who connects to a bound
PUSH is handed its share of the messages, round robin.

Why an HMAC rather than CurveZMQ (which this pyzmq has): without a ZAP authenticator, a thread
per context with a lifetime of its own to end at shutdown, a CURVE server accepts any client
that knows its public key; the HMAC is a few lines of the standard library, works with every
libzmq build, and lets the receiver log each frame it refuses. It does not encrypt: in Ray mode
prompts and outputs cross the network in clear, as they do between Ray's own processes.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import pickle
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

KEY_BYTES = 32
MAC_BYTES = 32
SEQ_BYTES = 8
LOG_PERIOD = 1.0  # seconds between two warnings about dropped frames on one channel

logger = logging.getLogger(__name__)


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when the thread that started it exits (the engine
    core's process and the tensor-parallel workers)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the idle pid check still applies
        pass


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def local_address(name: str) -> str:
    """Where a socket that only this host's processes need listens: an abstract Unix socket on
    Linux (no file to leave behind, nothing on the network), else a free loopback port (read
    the actual one from the socket's LAST_ENDPOINT)."""
    if sys.platform.startswith("linux"):
        return f"ipc://@{name}-{secrets.token_hex(8)}"
    return "tcp://127.0.0.1:*"


def hand_over(proc: subprocess.Popen, settings, last: bool = True) -> None:
    """Writes a child's settings (its key among them) to its stdin, never to a file. last=False
    leaves stdin open for one more hand_over (what the parent works out while the child
    starts)."""
    try:
        proc.stdin.write(pickle.dumps(settings, protocol=5))
        proc.stdin.flush()
        if last:
            proc.stdin.close()
    except BrokenPipeError:  # it died at once: its exit status tells why
        pass


def read_settings():
    """The child's side of `hand_over`: the next object handed over, None when stdin was closed
    without one."""
    try:
        return pickle.load(sys.stdin.buffer)
    except EOFError:
        return None


class Sealer:
    """The sending end of one channel: pickles and signs. Not thread-safe (callers that send
    from several threads hold a lock around `seal` and the send)."""

    def __init__(self, key: bytes, label: str) -> None:
        self._mac = hmac.new(key, label.encode(), hashlib.sha256)
        self._seq = 0

    def seal(self, message) -> bytes:
        self._seq += 1
        head = self._seq.to_bytes(SEQ_BYTES, "big")
        payload = pickle.dumps(message, protocol=5)
        mac = self._mac.copy()  # the key schedule and label are hashed once
        mac.update(head)
        mac.update(payload)
        return mac.digest() + head + payload


class Opener:
    """The receiving end of one channel: checks, then unpickles. ordered=False accepts any
    sequence number: a socket that several senders share (each counts on its own)."""

    def __init__(self, key: bytes, label: str, ordered: bool = True) -> None:
        self.label = label
        self._mac = hmac.new(key, label.encode(), hashlib.sha256)
        self._ordered = ordered
        self._last_seq = 0
        self.num_dropped = 0
        self._last_log = -LOG_PERIOD

    def open(self, frame: bytes) -> Any | None:
        """The message, or None when the frame was dropped unread (and logged)."""
        view = memoryview(frame)
        body = view[MAC_BYTES:]
        if len(body) < SEQ_BYTES:
            return self._drop("too short")
        mac = self._mac.copy()
        mac.update(body)
        if not hmac.compare_digest(mac.digest(), view[:MAC_BYTES]):
            return self._drop("bad MAC")
        seq = int.from_bytes(body[:SEQ_BYTES], "big")
        if self._ordered:
            if seq <= self._last_seq:
                return self._drop("replayed")
            self._last_seq = seq
        return pickle.loads(body[SEQ_BYTES:])

    def _drop(self, reason: str) -> None:
        self.num_dropped += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_PERIOD:
            self._last_log = now
            logger.warning(
                "conveyor: dropped an unauthenticated frame on channel %r (%s; %d so far), "
                "not unpickled",
                self.label,
                reason,
                self.num_dropped,
            )
        return None
