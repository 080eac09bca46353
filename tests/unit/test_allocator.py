"""conveyor/allocator.py: a process that runs the model keeps the memory its steps allocate,
instead of faulting it in afresh each step (glibc's thresholds, set once)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A few steps' worth of a layer's activations at 700-2048 tokens, allocated and freed as a step
# does; prints the page faults of the last 60 steps. Transparent huge pages off for the process,
# so that a fault is one 4 KiB page whatever the machine's setting.
STEPS = """
import ctypes, resource, sys, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
if sys.argv[1] == "kept":
    from conveyor import allocator
    assert allocator.keep_pages()
torch.set_num_threads(1)

def step(t):
    x, qkv, attn = torch.ones(t, 576), torch.ones(t, 960), torch.ones(t, 576)
    gate_up = torch.ones(t, 3072)
    act = gate_up[:, :1536] * gate_up[:, 1536:]
    return float((act[:, :576] + x + attn)[0, 0] + qkv[0, 0])

SIZES = (2048, 1500, 700, 2048)
for i in range(8):
    step(SIZES[i % 4])
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(60):
    step(SIZES[i % 4])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc's allocator only",
)


def _faults(mode: str, env: dict | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | (env or {})
    run = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, env=env, check=True
    )
    return int(run.stdout.split()[-1])


@glibc
def test_steps_reuse_their_memory_once_pages_are_kept():
    # glibc's own thresholds: 0-200k faults over these 60 steps (its mmap threshold follows the
    # sizes freed, so it varies run to run); a heap that gave its pages back would fault in at
    # least a 2048-token step's gate/up product (6144 pages) at each of the 30 such steps.
    # Kept: none once the largest step has been seen, but the heap may still grow once, when a
    # step's frees leave it fragmented (CI saw 2304 faults: two 2048 x 576 blocks); one whole
    # 2048-token step's activations (below) are allowed, under a tenth of what one refault per
    # 2048-token step would cost.
    one_step = 2048 * (576 + 960 + 576 + 3072 + 1536 + 2 * 576) * 4 // 4096
    kept = _faults("kept")
    assert kept <= one_step, (kept, "faults; glibc's defaults:", _faults("plain"))
    # The bound tells the two apart: glibc held at its first mmap threshold faults ~700k.
    assert _faults("plain", {"MALLOC_MMAP_THRESHOLD_": "131072"}) > 10 * one_step


@glibc
def test_the_user_s_own_malloc_settings_stand(monkeypatch):
    from conveyor import allocator

    monkeypatch.setattr(allocator, "_kept", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_pages() is False


def test_the_model_s_process_keeps_pages(tiny_checkpoint):
    from conveyor import LLM, allocator

    LLM(str(tiny_checkpoint("llama")), dtype="float32")
    glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    user_set = any(name in os.environ for name in allocator.USER_SETTINGS)
    assert allocator._kept is (glibc and not user_set)


# Faults in a 16 MiB zeroed tensor's first half with populate, after writing a pattern into a
# page of it; prints the pattern's checksum and the page faults of then writing every page of
# each half. 4 KiB pages (no huge pages), as STEPS.
POPULATE = """
import ctypes, resource, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from conveyor import allocator
t = allocator.zeroed((16 << 20,), torch.uint8)
t[4096:8192] = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
ok = allocator.populate(t, 0, 8 << 20)
kept = int(t[4096:8192].to(torch.int64).sum())
faults = []
for half in (t[: 8 << 20], t[8 << 20 :]):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    half[::4096] = 1
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(ok, kept, *faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise's populate: Linux")
def test_populate_faults_pages_in_and_keeps_their_bytes():
    run = subprocess.run(
        [sys.executable, "-c", POPULATE], capture_output=True, text=True, check=True
    )
    ok, kept, populated, untouched = run.stdout.split()
    if ok != "True":
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert int(kept) == sum(i % 251 for i in range(4096))  # the written page as it was
    assert int(populated) < 16 and int(untouched) >= 2048 - 16  # 2048 pages of 4 KiB a half


def test_an_idle_engine_faults_in_its_cache_ahead_of_its_load(tiny_checkpoint):
    """EngineCore.idle_work, prefix caching on: a huge page a call, every layer's keys and
    values from block 0 up, up to twice the blocks ever taken plus POPULATE_AHEAD's; cached
    blocks keep their bytes (the same answer from a prefix hit after it). Off, nothing (freed
    blocks are taken again first: core/block_pool.py)."""
    from conveyor import LLM, SamplingParams
    from conveyor.allocator import HUGE_PAGE

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt_token_ids": list(range(3, 70))}
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="256MiB")
    core = llm.llm_engine.core
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    caches = [c for c in core.runner.kv_caches if hasattr(c, "nbytes")]
    half = caches[0].nbytes // 2
    per_block = half // caches[0].shape[1]
    blocks = min(core.num_blocks, 2 * core.kv_cache.pool.high_water + core._populate_ahead)
    assert 0 < core.kv_cache.pool.high_water and blocks < core.num_blocks  # ahead, not all
    pages = -(-min(half, blocks * per_block) // HUGE_PAGE) * 2 * len(caches)
    calls = 0
    while core.idle_work() and calls <= pages:
        calls += 1
    if calls == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert calls == pages
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    off = LLM(str(tiny_checkpoint("llama")), dtype="float32", enable_prefix_caching=False)
    assert not off.llm_engine.core.idle_work()
