"""Compiled CPU ops, built once per machine from the C++ sources shipped in this folder.

The sources are organised by op, one folder each: gemm/ (the panel, block, small-row and AMX
matmuls), attention/ (paged attention, K/V writes and rotary embedding; the prompt rows'
bfloat16 attention), layer/ (the compiled decoder layer, rms_norm), lora/ (LoRA deltas), isa/
(the vectors per instruction set, the balanced thread split), moe/ (the mixture of experts'
grouping and row loops, used by layer/); ops.h declares every op and
bindings.cpp binds them. Includes name paths from this folder ("isa/vec.h"), which is the
build's include path. The C++ is in namespace conveyor, one sub-namespace per op.

`load()` JIT-compiles them with torch's own extension tooling into
~/.cache/conveyor/kernels/conveyor_kernels-<hash>/, the hash covering the sources, torch and
Python versions, the compiler flags and the CPU's feature flags (the code is built with
-march=native), so a machine builds once (~1.5 min on 2 cores) and later processes just load
the library.
One process builds a folder at a time: it holds an advisory lock (flock) on BUILD_LOCK there
for the whole build, which the kernel releases when the process ends however it ends, so a
build killed mid-way (Ctrl-C, a CI timeout) never blocks the next start (see build_lock).
Without a compiler, or if the build fails, `load()` logs one warning and returns None; callers
then use the pure-PyTorch reference ops (conveyor/model/attention.py), which stay the readable
oracle. CONVEYOR_ATTENTION=reference forces the reference (the kernel plan, model/plan.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from conveyor.paths import write_atomic

logger = logging.getLogger(__name__)

SOURCES = (
    "bindings.cpp",
    "attention/paged_attention.cpp",
    "gemm/small_gemm.cpp",
    "gemm/quant_gemm.cpp",
    "layer/decoder_layer.cpp",
    "layer/deltanet.cpp",
    "layer/mamba.cpp",
    "gemm/panel_gemm.cpp",
    "lora/lora_gemm.cpp",
    "gemm/amx_gemm.cpp",
    "attention/amx_attention.cpp",
)
# Included by the sources (paths from this folder, the build's include path); in the build key
# too.
HEADERS = ("isa/balance.h", "ops.h", "isa/vec.h", "moe/moe.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
NAME = "conveyor_kernels"
BUILD_LOCK = "conveyor-build.lock"  # ours, flocked; torch's own lock file is `lock`
# A start that finds the kernels built holds the lock for well under a second (torch's no-op
# ninja run and the import): processes starting together (data-parallel engine cores) wait on
# each other that long without a word; a longer wait is a build, and is logged.
QUIET_WAIT_SECONDS = 5.0


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
    with build_lock(folder):
        sources = _copy_sources(folder / "src")
        return cpp_extension.load(
            name=NAME,
            sources=[str(sources / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(sources)],
            build_directory=str(folder),
            verbose=False,
        )


def _copy_sources(folder: Path) -> Path:
    """The sources and headers, copied next to the build they belong to (the build key is their
    hash), each in its subfolder. torch's build compares the source paths too: compiled from the
    package itself, two checkouts of the same sources in one venv rebuilt the same kernels in
    turn."""
    here = Path(__file__).parent
    folder.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        text = (here / name).read_bytes()
        target = folder / name  # write_atomic makes its subfolder
        if not target.exists() or target.read_bytes() != text:
            write_atomic(target, text)  # a concurrent build never reads half a file
    return folder


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """The right to build in `folder` (made if missing), held until the block ends: an
    exclusive flock on its BUILD_LOCK, waited for while another live process holds it. torch's
    own build lock (a file named `lock`, made and removed by cpp_extension.load) has no owner:
    one left by a killed build made every later start wait for ever. Under this lock no other
    process builds here, so a `lock` file present is a dead build's, and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / BUILD_LOCK, "a") as file:
        _lock(file, folder)
        try:
            _remove_dead_torch_lock(folder)
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _lock(file, folder: Path) -> None:
    deadline = time.monotonic() + QUIET_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    logger.warning("conveyor: waiting for another process's kernel build in %s", folder)
    fcntl.flock(file, fcntl.LOCK_EX)


def _remove_dead_torch_lock(folder: Path) -> None:
    lock = folder / "lock"
    if lock.exists():
        logger.warning("conveyor: removing the lock of a kernel build that did not finish: %s",
                       lock)  # fmt: skip
        lock.unlink(missing_ok=True)


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
