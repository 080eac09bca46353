"""What transformers resolves from a checkpoint's small files, kept on disk by their contents.

Reading a config with transformers' AutoConfig, or picking a tokenizer class with AutoTokenizer,
imports the model's config class, and with it much of transformers (torch._dynamo,
torch.distributed.tensor, sympy): 3-4 s of a server start on 2 cores, spent while the engine
core waits for its config. What they resolve depends only on the files of the checkpoint's
folder (config.json, generation_config.json, the tokenizer's files) and on the transformers
version, so it is kept under conveyor.paths.cache_dir() / "resolved", keyed by a hash of those
files' bytes, and a later start with the same files reads it back (a few ms).

An entry is plain JSON, written atomically; one that cannot be read is resolved again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from conveyor.paths import cache_dir, write_atomic

FORMAT = 9  # bump when what an entry holds changes (the code that resolves it counts too)
# Weights and other large files are not what transformers resolves a config or tokenizer from.
WEIGHT_SUFFIXES = frozenset(
    {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz"}
)
MAX_HASHED_BYTES = 64 << 20  # a larger file counts by its size and modification time


def folder_digest(folder: Path) -> str:
    """A hash of the folder's non-weight files (names and bytes), the transformers version and
    the source of the modules that resolve them: an entry made by other code (an older
    conveyor's, or a working copy's before an edit) is never read back."""
    digest = hashlib.sha256(f"{FORMAT}|{_transformers_version()}|{_code_digest()}".encode())
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_file() or Path(entry.name).suffix in WEIGHT_SUFFIXES:
            continue
        stat = entry.stat()
        digest.update(f"|{entry.name}|{stat.st_size}|".encode())
        if stat.st_size > MAX_HASHED_BYTES:
            digest.update(str(stat.st_mtime_ns).encode())
        else:
            digest.update(Path(entry.path).read_bytes())
    return digest.hexdigest()[:32]


def cached(kind: str, folder: Path, compute: Callable[[], dict]) -> dict:
    """`compute()` for `folder`'s files, read back from the cache when it was kept before.
    Errors are not kept: a checkpoint that fails resolves (and fails) again."""
    try:
        path = _root() / f"{kind}-{folder_digest(folder)}.json"
    except OSError:
        return compute()  # an unreadable folder: transformers gives the error
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        write_atomic(path, json.dumps(value))  # a reader never sees half an entry
    except OSError:
        pass  # a read-only cache only costs the next start the same time
    return value


# The modules whose code decides what an entry holds (a family's Parts, a GGUF's config).
RESOLVING_MODULES = ("config.py", "model/config.py", "model/families.py", "model/gguf_config.py")


@functools.cache
def _code_digest() -> str:
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for name in RESOLVING_MODULES:
        digest.update((package / name).read_bytes())
    return digest.hexdigest()[:16]


def _root() -> Path:
    return cache_dir() / "resolved"


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"
