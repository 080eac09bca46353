"""conveyor's environment switches: every CONVEYOR_* variable is read here, and only here.

One module so that a reader finds each switch, its values and its default in one place, and so
that compiled code never reads the environment: the kernel choices among them feed the kernel
plan (model/plan.py), built once at load, which passes them to the C++ ops. Each reader below is
called when its value is needed (never cached at import), so a test's monkeypatch.setenv takes
effect for the next engine it builds. A leaf module: the standard library only.

Switch                        values (default first)      what it does
CONVEYOR_ISA                  auto|amx|avx512|avx2|scalar the widest instruction set any kernel
                                                          may use (auto: the CPU's best)
CONVEYOR_MATMUL               auto|linear|transposed|kernel  one matmul form for every row count
                                                          of a model that is not batch-invariant
CONVEYOR_PROMPT_TILES         1|0                         prompt rows' projections on AMX tiles
CONVEYOR_PROMPT_ATTENTION     1|0                         prompt rows' attention in bfloat16
CONVEYOR_COMPILED_LAYERS      1|0                         a step's layers as one compiled call
CONVEYOR_ATTENTION            auto|reference              reference: the PyTorch attention
CONVEYOR_QUANT_INT8           0|1                         int8 copies of block weights (VNNI)
CONVEYOR_DECODE_TILES_FROM    32|N|0                      generated rows' int8 blocks on AMX-INT8
                                                          tiles from N rows a call (0: never)
CONVEYOR_QUANT_OUTLIER_RATIO  4                           the int8 route's outlier threshold
CONVEYOR_TP_SHM               1|0                         tensor-parallel sums in shared memory
CONVEYOR_CUDA_GRAPHS          ''|1|0|eager                decode steps' CUDA graphs
CONVEYOR_CACHE_DIR            (unset)                     conveyor's cache folder
CONVEYOR_FAULT_INJECT         (unset)                     raise@N | hang@N | exit@N (tests)
CONVEYOR_API_KEY              (unset)                     the server's bearer key

Read here for torch's sake: OMP_NUM_THREADS, then MKL_NUM_THREADS (torch's default thread
count where set; data-parallel replicas divide it without importing torch).
"""

from __future__ import annotations

import os

ISAS = ("amx", "avx512", "avx2", "scalar")  # widest first
MATMUL_FORMS = ("linear", "transposed", "kernel")


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def _flag(name: str, default: bool) -> bool:
    """A 1|0 switch: "0" turns it off, any other value on (as the kernels always read them)."""
    value = _get(name)
    return default if not value else value != "0"


def isa() -> str:
    """CONVEYOR_ISA: "auto" or the widest instruction set the kernels may use."""
    value = _get("CONVEYOR_ISA", "auto").lower() or "auto"
    if value != "auto" and value not in ISAS:
        raise ValueError(f"CONVEYOR_ISA={value!r}: expected auto, {', '.join(ISAS)}")
    return value


def matmul() -> str:
    """CONVEYOR_MATMUL: "auto" (the measured forms) or the one form forced for every count."""
    value = _get("CONVEYOR_MATMUL", "auto").lower() or "auto"
    if value != "auto" and value not in MATMUL_FORMS:
        raise ValueError(f"CONVEYOR_MATMUL={value!r}: expected linear, transposed or kernel")
    return value


def prompt_tiles() -> bool:
    """CONVEYOR_PROMPT_TILES=0 keeps prompt rows' projections on the blocks."""
    return _flag("CONVEYOR_PROMPT_TILES", True)


def prompt_attention() -> bool:
    """CONVEYOR_PROMPT_ATTENTION=0 keeps prompt rows' attention on the float32 kernel."""
    return _flag("CONVEYOR_PROMPT_ATTENTION", True)


def compiled_layers() -> bool:
    """CONVEYOR_COMPILED_LAYERS=0 runs the Python modules at every step."""
    return _flag("CONVEYOR_COMPILED_LAYERS", True)


def attention() -> str:
    """CONVEYOR_ATTENTION=reference forces the PyTorch attention; anything else: "auto"."""
    return "reference" if _get("CONVEYOR_ATTENTION").lower() == "reference" else "auto"


def quant_int8() -> bool:
    """CONVEYOR_QUANT_INT8=1 builds int8 copies of block weights at load (model/quant/)."""
    return _get("CONVEYOR_QUANT_INT8", "0") == "1"


def decode_tiles_from() -> int:
    """CONVEYOR_DECODE_TILES_FROM: the row count from which generated rows' block projections
    take AMX-INT8 tiles (the same bits as the panel kernel); 0 never."""
    value = _get("CONVEYOR_DECODE_TILES_FROM", "32") or "32"
    if not value.isdigit():
        raise ValueError(f"CONVEYOR_DECODE_TILES_FROM={value!r}: expected a row count >= 0")
    return int(value)


def quant_outlier_ratio() -> float:
    """CONVEYOR_QUANT_OUTLIER_RATIO: the int8 route's outlier threshold (model/quant/)."""
    return float(_get("CONVEYOR_QUANT_OUTLIER_RATIO", "4") or "4")


def tp_shm() -> bool:
    """CONVEYOR_TP_SHM=0: tensor-parallel ranks add through gloo only (tests, comparisons)."""
    return _flag("CONVEYOR_TP_SHM", True)


def cuda_graphs() -> str:
    """CONVEYOR_CUDA_GRAPHS, lower case: "" (the device's default), 0, 1 or eager."""
    return _get("CONVEYOR_CUDA_GRAPHS").lower()


def cache_dir() -> str | None:
    """CONVEYOR_CACHE_DIR, where set (paths.py falls back to XDG_CACHE_HOME, then ~/.cache)."""
    return _get("CONVEYOR_CACHE_DIR") or None


def xdg_cache_home() -> str | None:
    """XDG_CACHE_HOME, the cache folder's fallback (paths.py)."""
    return _get("XDG_CACHE_HOME") or None


def fault_inject() -> str | None:
    """CONVEYOR_FAULT_INJECT: raise@N, hang@N or exit@N in the core's step N (a test hook)."""
    return _get("CONVEYOR_FAULT_INJECT") or None


def api_key() -> str | None:
    """CONVEYOR_API_KEY: the server's bearer key where --api-key is not given."""
    return _get("CONVEYOR_API_KEY") or None


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS, else MKL_NUM_THREADS, where one is a positive integer: the thread
    count torch takes by default."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = _get(name).strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None
