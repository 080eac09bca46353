"""The Responses API's store: finished responses kept in memory for GET, DELETE,
input_items and previous_response_id, bounded by count and by bytes (oldest evicted first).

Torch-free and FastAPI-free: `conveyor serve` adds its flags before the server's imports."""

from __future__ import annotations

import argparse
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreLimits:
    """How much of the finished responses the server keeps (each a `conveyor serve` flag)."""

    max_responses: int = 1000
    max_bytes: int = 64 * 2**20  # of the responses' JSON: output, input items, echoed fields

    def __post_init__(self) -> None:
        for name in ("max_responses", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass(slots=True)
class StoredResponse:
    """response: the response object as sent. conversation: the input items the model read
    (earlier turns' inputs and outputs, then this turn's own input), without instructions,
    which previous_response_id does not carry over; own_inputs: how many of them this
    turn's request gave."""

    response: dict
    conversation: list[dict]
    own_inputs: int
    num_bytes: int = 0

    @property
    def own_items(self) -> list[dict]:
        return self.conversation[len(self.conversation) - self.own_inputs :]


class ResponseStore:
    """Single event loop (the server's): no locking. Insertion order is age order."""

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, entry: StoredResponse) -> bool:
        """Keeps `entry`, evicting the oldest until both bounds hold; False (nothing kept,
        nothing evicted) for one larger than the whole byte bound."""
        response_id = entry.response["id"]
        self.delete(response_id)
        entry.num_bytes = len(json.dumps([entry.response, entry.conversation]).encode())
        if entry.num_bytes > self.limits.max_bytes or self.limits.max_responses == 0:
            logger.warning(
                "response %s (%d bytes) not stored: the store holds at most %d bytes",
                response_id,
                entry.num_bytes,
                self.limits.max_bytes,
            )
            return False
        while self._entries and (
            len(self._entries) >= self.limits.max_responses
            or self.num_bytes + entry.num_bytes > self.limits.max_bytes
        ):
            _, oldest = self._entries.popitem(last=False)
            self.num_bytes -= oldest.num_bytes
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True


def add_store_args(parser: argparse.ArgumentParser) -> None:
    defaults = StoreLimits()
    group = parser.add_argument_group("Responses API store (/v1/responses)")
    group.add_argument(
        "--responses-max-stored",
        type=int,
        default=defaults.max_responses,
        help="most finished responses kept for GET and previous_response_id; the oldest go "
        f"first (default {defaults.max_responses}; 0 keeps none)",
    )
    group.add_argument(
        "--responses-max-stored-bytes",
        type=int,
        default=defaults.max_bytes,
        help=f"most bytes of stored responses, as JSON (default {defaults.max_bytes})",
    )


def store_limits(args: argparse.Namespace) -> StoreLimits:
    return StoreLimits(args.responses_max_stored, args.responses_max_stored_bytes)
