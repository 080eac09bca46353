"""Compiled CPU ops, built once per machine from the C++ sources shipped in this folder.

`load()` JIT-compiles them with torch's own extension tooling into
~/.cache/conveyor/kernels/conveyor_kernels-<hash>/, the hash covering the sources, torch and
Python versions, the compiler flags and the CPU's feature flags (the code is built with
-march=native), so a machine builds once (~1.5 min on 2 cores) and later processes just load
the library.
Without a compiler, or if the build fails, `load()` logs one warning and returns None; callers
then use the pure-PyTorch reference ops (conveyor/model/attention.py), which stay the readable
oracle. CONVEYOR_ATTENTION=reference forces the reference (see worker/model_runner.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from conveyor.paths import write_atomic

logger = logging.getLogger(__name__)

SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "small_gemm.cpp",
    "quant_gemm.cpp",
    "decoder_layer.cpp",
    "panel_gemm.cpp",
    "lora_gemm.cpp",
    "amx_gemm.cpp",
    "amx_attention.cpp",
)
HEADERS = ("balance.h", "ops.h", "vec.h")  # included by the sources; in the build key too
CFLAGS = ("-O3", "-march=native", "-fopenmp")
NAME = "conveyor_kernels"


def build_dir() -> Path:
    from conveyor.paths import cache_dir

    return cache_dir() / "kernels" / f"{NAME}-{build_key()}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled ops module, or None when it cannot be built here (one warning)."""
    try:
        return _build()
    except Exception as exc:  # a missing compiler or ninja shows up as many exception types
        logger.warning(
            "conveyor: compiled CPU kernels unavailable (%s: %s); using the PyTorch reference ops",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    put_ninja_on_path()
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(folder)
    sources = _copy_sources(folder / "src")
    return cpp_extension.load(
        name=NAME,
        sources=[str(sources / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def _copy_sources(folder: Path) -> Path:
    """The sources and headers, copied next to the build they belong to (the build key is their
    hash). torch's build compares the source paths too: compiled from the package itself, two
    checkouts of the same sources in one venv rebuilt the same kernels in turn."""
    here = Path(__file__).parent
    folder.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        text = (here / name).read_bytes()
        target = folder / name
        if not target.exists() or target.read_bytes() != text:
            write_atomic(target, text)  # a concurrent build never reads half a file
    return folder


# torch's build lock has no owner: a build killed mid-way (Ctrl-C at the first start) leaves
# it behind, and every later start then waited on it silently, for ever. A build takes 1.5-5
# minutes on 2 cores; a lock much older than that belongs to nobody.
STALE_LOCK_SECONDS = 900


def clear_stale_lock(folder: Path, stale_after: float = STALE_LOCK_SECONDS) -> None:
    """Removes the build lock in `folder` when it is older than `stale_after` seconds; says
    that it waits on a younger one."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > stale_after:
        logger.warning("conveyor: removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
    else:
        logger.warning(
            "conveyor: waiting for another process's kernel build (lock %s, %.0f s old; "
            "delete it if no build is running)",
            lock,
            age,
        )


def build_key() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    # The torch install too: its headers' paths are in the build's commands, so two venvs
    # sharing one folder rebuilt it in turn (~5 min at each switch).
    torch_dir = str(Path(torch.__file__).resolve().parent)
    for part in (torch.__version__, torch_dir, sys.version, platform.machine(), " ".join(CFLAGS)):
        digest.update(part.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's model name (build_key already covers its feature flags)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def put_ninja_on_path() -> None:
    # The pinned `ninja` wheel puts its binary next to the interpreter, which is not on PATH
    # when .venv/bin/python runs without an activated venv.
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
