"""glibc's allocator in a process that runs the model on the CPU.

A step allocates and frees its activations layer by layer: at a 2048-token step a layer's
gate/up product alone is 25 MB. Left as it is, glibc maps a block above its mmap threshold
afresh and unmaps it when freed, and gives the heap's free top back to the OS past its trim
threshold (both start at 128 KiB and only follow the sizes freed), so the step faults in and
zeroes its memory again and again. Measured on the 2-vCPU Xeon, 128 prompts (27k tokens)
prefilled through `conveyor serve --max-num-batched-tokens 2048`: 12.2-14.2 s as it is, 7.6-8.0 s
with both thresholds below, 7.0 s at the default 512-token budget either way (offline
`LLM.generate` with a 2048 budget swung between 2.9 and 6.3 s before, 2.7-3.1 s after). vLLM asks
its CPU users to preload tcmalloc for the same reason.

`keep_pages()` sets the mmap threshold to glibc's largest (32 MiB: smaller blocks come from the
heap and are reused) and the trim threshold to 1 GiB (the heap keeps what a step used). The
process keeps the memory its largest step needed, as a caching allocator does. Nothing is done
where the allocator is not glibc's, or where the user set either threshold through glibc's own
environment variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import numpy as np
import torch

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_kept: bool | None = None


def keep_pages() -> bool:
    """Sets both thresholds once per process; whether they are set (False: not glibc, or the
    user's own settings stand)."""
    global _kept
    if _kept is None:
        _kept = _set_thresholds()
    return _kept


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc's own: absent from musl
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    return (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, align: int = 4096) -> torch.Tensor:
    """A CPU tensor of zero bytes, page-aligned, whose pages the OS provides on first touch.

    calloc (numpy's zeros) promises zeros; above the mmap threshold it takes them as fresh
    pages from the OS and writes nothing. The KV cache (2 GiB by default) was allocated and
    then zeroed: every page faulted in at start, 3 s of a 2-vCPU Zen 3's start for memory most
    servers never fill. The pages are still unwritten here, so a madvise (huge pages) after
    this call applies before their first touch."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing their bytes
HUGE_PAGE = 2 << 20
_populate_ok = True
_libc = None


def populate(tensor: torch.Tensor, start: int, nbytes: int) -> bool:
    """Faults in the pages under bytes [start, start + nbytes) of a CPU tensor's memory (rounded
    out to whole pages) as a first write would, leaving every byte as it is: the OS zeroes a
    fresh page then, not in a step's write (zeroed's pages). False where the kernel cannot
    (before Linux 5.14, or not Linux): the pages are then faulted in by the steps as before."""
    global _populate_ok, _libc
    if not _populate_ok or not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    first = (tensor.data_ptr() + start) // page * page
    end = tensor.data_ptr() + min(start + nbytes, tensor.nbytes)
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if _libc.madvise(first, end - first, MADV_POPULATE_WRITE) != 0:
        _populate_ok = False
        return False
    return True
