"""Shared fixtures: tiny random checkpoints (float64) and transformers references."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from pathlib import Path

import pytest

# Two test workers on two cores, each with torch's two threads, and the servers they start: by
# default OpenMP's threads spin at every barrier (libgomp: ~300k turns before sleeping) and, with
# more threads than cores, spin through the time slices the other worker's threads need. Waiting
# passively, test_kernels.py and test_quant.py run side by side in 29 s instead of 69 s here (a
# Zen 3, 2 vCPUs). Read when torch loads libgomp, so set before the import; the servers and
# engine processes the tests start inherit it. Serving keeps OpenMP's default: one engine on its
# cores, where spinning is the faster wait (the default model served passively made 0.79-0.91x
# the tokens at 8 and 32 streams in two rounds side by side).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tests never download: a model named by its Hub id (conveyor/hub.py) comes from a cache
# they build, and the servers they start inherit it. Read when huggingface_hub is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
# pytest rewrites each test module's asserts on import and caches the result in __pycache__,
# but not where bytecode is not written (PYTHONDONTWRITEBYTECODE, as some sandboxes set): then
# the controller and each worker rewrote all ~110 modules again (~4 s of CPU each). Written
# for this process's imports from here on; the processes the tests start keep the setting.
sys.dont_write_bytecode = False

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny import ARCHS, make_tiny_checkpoint  # noqa: E402

SERVER_THREADS = torch.get_num_threads()  # what a server the tests start runs with
torch.set_num_threads(2)

# Where the engines under test run: CONVEYOR_TEST_DEVICE=cuda runs the in-process engines of the
# equivalence, engine, speculative-decoding and structured-output tests on the GPU (the
# transformers references stay on the CPU in float64).
DEVICE = os.environ.get("CONVEYOR_TEST_DEVICE", "cpu")
# By default an engine on CUDA takes 90% of the free GPU memory for its KV cache: millions of
# blocks for a tiny model (slow to build and to check after every step), and engines that live
# side by side (module fixtures, pytest-xdist workers) would compete for it. The tests use a
# fixed budget instead, about what the CPU default gives the tiny models.
CUDA_KV_CACHE_MEMORY = "256MiB"
# Keyword arguments for LLM / LLMEngine / EngineCore, and the same as `conveyor serve` flags.
DEVICE_KWARGS: dict = {"device": DEVICE}
DEVICE_FLAGS: list[str] = ["--device", DEVICE]
if DEVICE != "cpu":
    DEVICE_KWARGS["kv_cache_memory"] = CUDA_KV_CACHE_MEMORY
    DEVICE_FLAGS += ["--kv-cache-memory", CUDA_KV_CACHE_MEMORY]


def pytest_configure(config):
    """Once per session, before any worker starts (the controller, or a run without workers):
    the matmul forms measured and kept where none are for this build (model/layers.py), at
    the thread counts of the tests' engines (2) and servers (torch's default), and of the
    engines that split those between ranks or replicas (tensor parallelism and data
    parallelism over 2: engine/config.py, engine/data_parallel.py) or are given one thread:
    without the one-thread forms, every tensor-parallel rank and data-parallel replica on a
    2-core machine measured for itself (~2.4 s of CPU a start: test_tensor_parallel.py 46 ->
    ~22 s alone, a Zen 4). Kept by the
    kernel sources' hash, they are missing after a kernel change until the next set-up, and
    each of the suite's ~100 engines and servers then measured for itself: ~1.5-3.5 s of CPU
    a start, on cores the other worker shares (the parallel phase 724-730 s against 614 s
    with the forms kept, a Zen 3)."""
    if DEVICE != "cpu" or hasattr(config, "workerinput"):
        return
    from conveyor.model.layers import keep_measured_forms

    for threads in sorted({1, 2, SERVER_THREADS, max(1, SERVER_THREADS // 2)}):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.float64):
            with contextlib.suppress(OSError):  # a read-only cache: each measures for itself
                keep_measured_forms(dtype, again=False)
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _kernel_plan_restored():
    """An engine's kernel plan narrows the process-wide C++ ops (model/plan.py): after a test,
    the plan in force before it (a module fixture's engine's, or none) is put back, whatever
    the test built (CONVEYOR_ISA=avx2, ...)."""
    from conveyor.model import plan

    before = plan.applied()
    yield
    plan.restore(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: arch -> folder of a float64 random checkpoint with a tokenizer (cached)."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            # mistral is saved in several shards, to cover the sharded safetensors index.
            shard = "100KB" if arch == "mistral" else None
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = make_tiny_checkpoint(path, arch, max_shard_size=shard)
        return cache[arch]

    return get


def run_lab(argv: list[str]) -> str:
    """`python -m benchmarks ARGV` in this process: its stdout; torch's thread count (which a
    lab command may set) put back."""
    import contextlib
    import io

    from benchmarks.cli import main

    threads, stdout = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return stdout.getvalue()


def random_prompts(num: int, vocab_size: int, seed: int = 0, max_len: int = 70) -> list[list[int]]:
    """Prompts of mixed lengths (1 .. max_len) without special tokens (ids 0-2)."""
    rng = random.Random(seed)
    lengths = [1, 2, max_len] + [rng.randrange(1, max_len) for _ in range(num - 3)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:num]]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int):
    """transformers' greedy generate, one prompt at a time: (tokens, logprobs of each token)."""
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(step[0].double(), -1)[t].item()
            for step, t in zip(out.logits, tokens, strict=False)
        ]
        results.append((tokens, logprobs))
    return results


# transformers' RMSNorm computes in float32 even for a float64 model (and so does conveyor, to
# match it), so the reference on the CPU and an engine on CUDA differ by float32 reduction
# order: measured on an H200, greedy tokens equal, logprobs within 2.4e-6.
LOGPROB_TOL = 1e-6 if DEVICE == "cpu" else 1e-5


def assert_matches_reference(outputs, reference, tol: float = LOGPROB_TOL) -> None:
    assert len(outputs) == len(reference)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, reference, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i}: tokens differ from transformers"
        if completion.logprobs is not None:
            got = [pos[t].logprob for pos, t in zip(completion.logprobs, tokens, strict=True)]
            worst = max((abs(a - b) for a, b in zip(got, logprobs, strict=True)), default=0.0)
            assert worst < tol, f"prompt {i}: logprob differs by {worst}"


__all__ = [
    "ARCHS",
    "DEVICE",
    "DEVICE_FLAGS",
    "DEVICE_KWARGS",
    "random_prompts",
    "hf_greedy",
    "assert_matches_reference",
]


@pytest.fixture(scope="module")
def quiet_transformers():
    """transformers' warnings off for a module (GGUF conversion prints one per tensor)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity_warning()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU thread count set to n inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ops():
    """The compiled CPU kernels (model/kernels); skips without a C++ compiler."""
    import shutil

    from conveyor.model import kernels

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    module = kernels.load()
    assert module is not None, "a compiler is present but the kernels did not build"
    return module
