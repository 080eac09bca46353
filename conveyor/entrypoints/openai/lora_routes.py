"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (from
--lora-modules or loaded at run time), /v1/models lists each with `parent` = the base model and
`root` = its folder, and POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
/v1/unload_lora_adapter {"lora_name"} change the set while the server runs, when the operator
allows it (--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING; otherwise the two
routes do not exist: 404, as vLLM).

Unloading takes the name away at once (a request naming it then gets the 404 of an unknown
model) and answers once the requests already running with the adapter have finished: they are
never cut short, and no 409 asks the caller to retry.

A folder is checked before the engine reads it: it must exist (404, vLLM's "No adapter found"),
lie inside --lora-allowed-dir when one is set (after resolving symlinks), hold its two files
as regular files inside the folder itself (a symlink leaving it is refused), and its weights
must not be larger than an adapter of rank max_lora_rank for this model can be. The engine's
own checks (lora/adapter.py: shapes of another base model, ranks over the maximum, NaN weights,
unsupported modules, every malformed adapter_config.json field, a scaling that overflows the
model's dtype) answer 400 with the engine's message, which names the folder as the client did
(never where its links lead). The engine reads the folder off the event loop (a thread of the
front end, then the engine core), bounded: the config's size and nesting, the weights' size.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from conveyor.engine.client import EngineClient
from conveyor.entrypoints.openai.errors import APIError
from conveyor.lora.request import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    LoRARequest,
    module_requests,
)

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_NAME_CHARS = 256
UNLOAD_POLL_SECONDS = 0.05


def runtime_updates_allowed(flag: bool) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable set to a true value."""
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = ""
    lora_int_id: int | None = None


def lora_card(lora: LoRARequest, parent: str) -> dict:
    return {
        "id": lora.lora_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "conveyor",
        "root": lora.lora_path,
        "parent": parent,
    }


class ServedLoRAs:
    """The adapters this server serves, by name. Requests resolve their `model` here when
    they are submitted (`using`), so an unload waits for those between resolution and the
    engine too."""

    def __init__(
        self,
        engine: EngineClient,
        base_name: str,
        allowed_dir: str | None = None,
        aliases: tuple[str, ...] = (),
    ) -> None:
        """aliases: the base model's other served names (--served-model-name's after the
        first)."""
        self.engine = engine
        self.base_name = base_name
        self.base_names = {base_name, *aliases}
        info = engine.inputs.info
        self.config = info.lora_config  # None: LoRA is off
        self.allowed_dir = None if allowed_dir is None else Path(allowed_dir).resolve()
        modules = () if self.config is None else self.config.modules
        self._by_name = {r.lora_name: r for r in module_requests(modules)}  # as the core's ids
        self._ids = itertools.count(len(modules) + 1)
        self._submitting: dict[str, int] = {}  # name -> submissions under way
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._max_weight_bytes = _max_weight_bytes(info.model_config, self.config)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def cards(self) -> list[dict]:
        return [lora_card(r, self.base_name) for r in self._by_name.values()]

    @contextmanager
    def using(self, name: str | None) -> Iterator[LoRARequest | None]:
        """The adapter `name` runs with (None: the base model) while its requests are handed
        to the engine; 404 if no adapter has that name (any more)."""
        if name is None or name in self.base_names:
            yield None
            return
        lora = self._by_name.get(name)
        if lora is None:
            raise not_found(name, self.base_name)
        self._submitting[name] = self._submitting.get(name, 0) + 1
        try:
            yield lora
        finally:
            self._submitting[name] -= 1
            if not self._submitting[name]:
                del self._submitting[name]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        name, path = body.lora_name, body.lora_path
        if not self.enabled:
            message = "LoRA is off: start the server with --enable-lora"
            raise APIError(400, message, "BadRequestError")
        if not name or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            raise APIError(400, message, "BadRequestError")
        if body.load_inplace:
            message = "load_inplace is not supported: unload the adapter, then load it again"
            raise APIError(400, message, "BadRequestError", "load_inplace")
        if len(name) > MAX_NAME_CHARS or not name.isprintable() or "," in name:
            message = f"lora_name must be printable, without commas, at most {MAX_NAME_CHARS} chars"
            raise APIError(400, message, "BadRequestError", "lora_name")
        async with self._lock:
            if name in self._by_name or name in self.base_names:
                message = f"The lora adapter '{name}' has already been loaded."
                raise APIError(400, message, "BadRequestError", "lora_name")
            loop = asyncio.get_running_loop()
            folder = await loop.run_in_executor(None, self._check_folder, path)
            lora = LoRARequest(name, next(self._ids), folder)
            try:
                await self.engine.add_lora(lora)
            except ValueError as error:
                message = str(error).replace(repr(folder), repr(path))  # the client's spelling
                raise APIError(400, message, "BadRequestError", "lora_path") from None
            self._by_name[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        name = body.lora_name
        if not name:
            message = "either 'lora_name' and 'lora_int_id' needs to be provided."
            raise APIError(400, message, "BadRequestError")
        async with self._lock:
            lora = self._by_name.pop(name, None)  # from now on, requests naming it get a 404
            if lora is None:
                message = f"The lora adapter '{name}' cannot be found."
                raise APIError(404, message, "NotFoundError", "lora_name")
            while self._submitting.get(name):
                await asyncio.sleep(UNLOAD_POLL_SECONDS)
            while True:
                try:
                    await self.engine.remove_lora(lora.lora_int_id)
                    break
                except ValueError:  # requests still run with it: they finish first
                    await asyncio.sleep(UNLOAD_POLL_SECONDS)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_folder(self, path: str) -> str:
        """The folder, resolved; a 4xx unless it is a plain adapter folder inside the allowed
        one, whose files do not lead outside it."""
        if "\x00" in path:  # no file name holds one; os calls raise ValueError on it
            raise APIError(
                400, "lora_path must not contain a NUL character", "BadRequestError", "lora_path"
            )
        folder = Path(path).expanduser()
        try:
            resolved = folder.resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            resolved = None
        if resolved is None or not resolved.is_dir():
            raise APIError(404, f"No adapter found at {path!r}", "NotFoundError", "lora_path")
        if self.allowed_dir is not None and not resolved.is_relative_to(self.allowed_dir):
            message = f"lora_path {path!r} is outside the allowed folder (--lora-allowed-dir)"
            raise APIError(400, message, "BadRequestError", "lora_path")
        for file_name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, None)):
            _check_file(resolved, file_name, limit or self._max_weight_bytes, path)
        return str(resolved)


def _check_file(folder: Path, file_name: str, max_bytes: int, path: str) -> None:
    file = folder / file_name
    if not file.exists():
        return  # the engine names what is missing
    target = file.resolve()
    if target.parent != folder:
        message = f"{path!r}: {file_name} is a link that leads outside the adapter folder"
        raise APIError(400, message, "BadRequestError", "lora_path")
    if not target.is_file():
        raise APIError(400, f"{path!r}: {file_name} is not a file", "BadRequestError", "lora_path")
    size = target.stat().st_size
    if size > max_bytes:
        message = (
            f"{path!r}: {file_name} has {size} bytes, more than an adapter of this model within "
            f"max_lora_rank can have ({max_bytes})"
        )
        raise APIError(400, message, "BadRequestError", "lora_path")


def _max_weight_bytes(model_config, lora_config) -> int:
    """The largest adapter_model.safetensors an acceptable adapter can be: every projection of
    every layer at rank max_lora_rank in float64, plus room for the header."""
    if lora_config is None:
        return 0
    from conveyor.lora.adapter import LoRAShapes

    shapes = LoRAShapes.of(model_config)
    per_layer = sum(  # A (r, in) and B (out, r) per slice (q, k, v; gate, up; or whole)
        shape.in_features + out for shape in shapes.projections.values() for out in shape.out_sizes
    )
    return shapes.num_layers * per_layer * lora_config.max_lora_rank * 8 + (1 << 20)


def not_found(name: str, base_name: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist; this server serves {base_name!r} and its adapters "
        "(GET /v1/models)",
        "NotFoundError",
        "model",
        "model_not_found",
    )


def add_lora_routes(app: FastAPI, loras: ServedLoRAs, admitted: Callable[[Request], None]) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (only when runtime updates are on);
    admitted(raw) frees the request's admission slot (see guard.Guard)."""

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
        admitted(raw)
        return PlainTextResponse(await loras.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
        admitted(raw)  # it may wait for the adapter's requests: it holds no admission slot
        return PlainTextResponse(await loras.unload(body))
