"""The messages between processes: typed, torch-free, one class per kind.

Every frame on a channel is one of these, pickled and signed (distributed/channel.py); a
receiver dispatches on the message's type (`match`), never on a string tag. Payloads are the
engine's own picklable records (core_io.py's CoreRequest, CoreOutput, CoreInfo, CoreStats;
the model runner's step), named in comments, not imported: this module imports nothing of
conveyor's (no import circle runs through it) and neither torch nor the engine, so the front
end and the core process load it before either.

Front end -> engine core (engine/core_proc.py):
  AddRequests, FinishRequests, SnapshotRequest, CoreCall, Stop
Engine core -> front end:
  Hello (first: where the core's command socket listens), then Ready or Failed; then
  StepOutput per step, Snapshot per SnapshotRequest, CoreReply per CoreCall, and Dead if the
  core failed.
Rank 0 -> tensor-parallel worker (worker/executor.py, worker/tp_worker.py):
  AllocateKV, RunStep, Stop
Worker -> rank 0:
  Hello (with its rank), then Ready or Failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ---- to the engine core / to a worker ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequests:
    sequences: list[Any]  # core_io.CoreRequest: admitted and tokenized by the front end


@dataclass(frozen=True, slots=True)
class FinishRequests:
    sequence_ids: list[str]
    status: int  # a finished RequestStatus


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """The dashboard asks for the KV block map; answered between two steps."""


@dataclass(frozen=True, slots=True)
class CoreCall:
    """One of CORE_CALLS on the core, answered between two steps by a CoreReply with the same
    call_id."""

    call_id: int
    method: str  # one of CORE_CALLS
    argument: Any = None  # lora.LoRARequest for add_lora, a lora_int_id for remove_lora


# The engine core's methods a front end may call (EngineCore's, LLMEngine's of the same name).
CORE_CALLS = ("add_lora", "remove_lora", "list_loras", "reset_prefix_cache")


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit after the commands before it (a core, or a tensor-parallel worker)."""


@dataclass(frozen=True, slots=True)
class AllocateKV:
    num_blocks: int


@dataclass(frozen=True, slots=True)
class RunStep:
    step: Any  # the model runner's step, the same on every rank


# ---- from the engine core / from a worker -----------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    address: str  # where the sender's command socket listens
    rank: int = 0  # a tensor-parallel worker's rank


@dataclass(frozen=True, slots=True)
class Ready:
    info: Any = None  # core.CoreInfo; None from a worker
    stats: Any = None  # core.CoreStats
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    """Building the core (or a worker's runner) raised: the front end raises it again."""

    kind: str  # the exception's class name: ValueError is the user's, re-raised as such
    text: str
    trace: str
    rank: int = 0

    def error(self, what: str) -> Exception:
        if self.kind == "ValueError":
            return ValueError(self.text)
        return RuntimeError(f"{what} failed to start: {self.kind}: {self.text}\n{self.trace}")


@dataclass(frozen=True, slots=True)
class StepOutput:
    outputs: list[Any]  # core_io.CoreOutput of every sequence that advanced (or failed)
    stats: Any  # core.CoreStats


@dataclass(frozen=True, slots=True)
class Snapshot:
    snapshot: Any  # records.CoreSnapshot


@dataclass(frozen=True, slots=True)
class CoreReply:
    call_id: int
    result: Any = None  # True / False, or the set of lora_int_ids for list_loras
    error: str | None = None  # a ValueError's text: the call was refused


@dataclass(frozen=True, slots=True)
class Dead:
    """The core failed while serving; it exits non-zero after this."""

    error: str
    trace: str
