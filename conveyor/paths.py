"""Where conveyor keeps what it makes once per machine: a leaf module (the standard library
and conveyor/envs.py only), so that the model's kernels, its GGUF loader and the configuration
all read it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path

from conveyor import envs


def cache_dir() -> Path:
    """conveyor's cache (converted GGUF metadata, compiled kernels): $CONVEYOR_CACHE_DIR, else
    $XDG_CACHE_HOME/conveyor, else ~/.cache/conveyor."""
    explicit = envs.cache_dir()
    if explicit:
        return Path(explicit).expanduser()
    return Path(envs.xdg_cache_home() or "~/.cache").expanduser() / "conveyor"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Writes `data` to `path` through a temporary file renamed over it: a process reading the
    path meanwhile sees the old file or the new one, never half of one. Makes the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
