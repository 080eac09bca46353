"""What a request names: LoRARequest (the engine's settings are config.py's LoRAConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# An adapter folder's files, as PEFT saves them; a config larger than this is refused unread.
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to apply to a
    request, as vLLM spells it: `LoRARequest("sql", 1, "/adapters/sql")`. The id names the
    adapter inside the engine (its slot, its prefix-cache entries): one id, one folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {lora_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def local_lora_modules(
    entries: list[str] | tuple[str, ...] | None, download_dir: str | None = None
) -> list[str] | None:
    """`--lora-modules` entries with each adapter named by its Hub id (sql=org/sql-lora, as
    vLLM takes it) replaced by its folder in the Hub cache, its two files fetched there where
    they are not (conveyor/hub.py); adapters on disk stay as they are. Done once, at the start,
    by the process that reads the command line."""
    if not entries:
        return None if entries is None else list(entries)
    import json
    from pathlib import Path

    from conveyor import hub
    from conveyor.config import LoRAConfig

    resolved = []
    for name, path in LoRAConfig.parse_modules(entries):
        if not Path(path).expanduser().exists() and hub.looks_like_repo(path):
            files = [CONFIG_FILE, WEIGHTS_FILE]
            path = str(hub.download_files(path, files, None, download_dir, "LoRA adapter"))
        resolved.append(json.dumps({"name": name, "path": path}))
    return resolved


def module_requests(modules: tuple[tuple[str, str], ...]) -> list[LoRARequest]:
    """The LoRARequests of LoRAConfig.modules (`--lora-modules`): ids 1, 2, ... in order."""
    return [LoRARequest(name, i, path) for i, (name, path) in enumerate(modules, start=1)]


class LoRAStats(NamedTuple):
    """Part of the core's stats with LoRA on: the names of the adapters that the running batch
    and the waiting requests name (vLLM's lora_requests_info), and the ids of those held."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    loaded: tuple[int, ...] = ()
