"""The adapters in host memory, by lora_int_id.

The engine core registers a request's adapter when the request arrives (read from its folder
once, then kept); the slots (slots.py) copy from here into the resident set on demand. With
max_cpu_loras, the least recently used adapters that no live request names are dropped, and
read again from their folder when a request names them again.

The front end checks a request's adapter before the core sees it, so a bad folder is a
ValueError at add_request; in-process it shares the core's registry, in front of an engine-core
process it keeps its own that only checks (keep_weights=False).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from conveyor.config import LoRAConfig
from conveyor.lora.adapter import LoRAAdapter, LoRAShapes, load_adapter
from conveyor.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, shapes: LoRAShapes, config: LoRAConfig, keep_weights: bool = True) -> None:
        self.shapes = shapes
        self.config = config
        self.keep_weights = keep_weights
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recent first
        self._known: dict[int, tuple[str, str]] = {}  # id -> (name, path), checked once

    def check(self, request: LoRARequest) -> None:
        """Refuses (ValueError) a request whose adapter folder cannot be applied here, or
        whose id is already another adapter's."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        self._check_identity(request)
        if request.lora_int_id in self._known:
            return
        if self.keep_weights:
            self.register(request)
            return
        load_adapter(request, self.shapes, self.config.max_lora_rank)  # checked, then dropped
        self._known[request.lora_int_id] = (request.lora_name, request.lora_path)

    def register(self, request: LoRARequest, in_use: Iterable[int] = ()) -> LoRAAdapter:
        """The request's adapter, read from its folder unless held already."""
        self._check_identity(request)
        lora_id = request.lora_int_id
        adapter = self._adapters.get(lora_id)
        if adapter is None:
            adapter = load_adapter(request, self.shapes, self.config.max_lora_rank)
            self._adapters[lora_id] = adapter
            self._known[lora_id] = (request.lora_name, request.lora_path)
            self._evict({lora_id, *in_use})
        self._adapters.move_to_end(lora_id)
        return adapter

    def get(self, lora_id: int) -> LoRAAdapter:
        """A registered adapter (a live request's is never dropped)."""
        return self._adapters[lora_id]

    def remove(self, lora_id: int) -> bool:
        """Forgets an adapter; False when it was not known."""
        self._adapters.pop(lora_id, None)
        return self._known.pop(lora_id, None) is not None

    def ids(self) -> set[int]:
        return set(self._known)

    def requests(self) -> list[LoRARequest]:
        return [LoRARequest(name, i, path) for i, (name, path) in self._known.items()]

    def _check_identity(self, request: LoRARequest) -> None:
        known = self._known.get(request.lora_int_id)
        if known is not None and known != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is already adapter {known[0]!r} from "
                f"{known[1]!r}; give {request.lora_name!r} ({request.lora_path!r}) another id"
            )

    def _evict(self, keep: set[int]) -> None:
        limit = self.config.max_cpu_loras
        if limit is None:
            return
        for lora_id in list(self._adapters):
            if len(self._adapters) <= limit:
                break
            if lora_id not in keep:
                del self._adapters[lora_id]
