"""`python -m benchmarks kernels`: side-by-side timing of ModelRunner.execute over each
attention path.

Each case is a synthetic SchedulerOutput (random tokens, shuffled block ids, greedy sampling)
timed for every attention path in turn, so the paths are compared under the same machine load.
"reference" runs the PyTorch attention ops, "compiled" the C++ kernels (same model, same cache).
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

import torch

from conveyor.model import kernels
from conveyor.model.config import ModelConfig
from conveyor.outputs import ScheduledRequest, SchedulerOutput
from conveyor.sample.sampler import SamplingRow
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

# (name, number of requests, context tokens already cached, new tokens per request)
CASES = [
    ("decode b=1 ctx=256", 1, 256, 1),
    ("decode b=8 ctx=256", 8, 256, 1),
    ("decode b=32 ctx=256", 32, 256, 1),
    ("decode b=1 ctx=512", 1, 512, 1),
    ("decode b=8 ctx=512", 8, 512, 1),
    ("decode b=32 ctx=512", 32, 512, 1),
    ("prefill 512 tokens", 1, 0, 512),
]


def make_step(
    num_requests: int, context: int, num_new: int, block_size: int, rng
) -> SchedulerOutput:
    blocks_per_request = -(-(context + num_new) // block_size)
    pool = list(range(num_requests * blocks_per_request))
    rng.shuffle(pool)  # non-contiguous block tables, as after some churn
    greedy = SamplingParams(temperature=0.0)
    scheduled = []
    for i in range(num_requests):
        table = pool[i * blocks_per_request : (i + 1) * blocks_per_request]
        tokens = [rng.randrange(3, 1000) for _ in range(num_new)]
        row = SamplingRow(greedy, None, [], [])
        scheduled.append(ScheduledRequest(f"r{i}", tokens, context, [table], row))
    return SchedulerOutput(scheduled, num_requests * num_new)


def time_paths(runner: ModelRunner, sched: SchedulerOutput, paths: list[str], repeats: int):
    """Best time of each path in ms; the paths alternate run by run, so a burst of load from
    elsewhere on the machine hits them alike."""
    times: dict[str, list[float]] = {path: [] for path in paths}
    for i in range(repeats + 1):
        for path in paths:
            runner.attention_ops = None if path == "reference" else kernels.load()
            start = time.perf_counter()
            runner.execute(sched)
            if i:  # the first round warms up
                times[path].append(time.perf_counter() - start)
    return [min(times[path]) * 1e3 for path in paths]


def _float_weights() -> dict:
    # This benchmark is about the float model: keep the projections unquantized where the
    # config offers quantization.
    if "quantization" in inspect.signature(ModelConfig.from_hf).parameters:
        return {"quantization": "none"}
    return {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--paths", default="reference,compiled")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--cases", default=None, help="comma-separated substrings of case names")


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = ModelConfig.from_hf(args.model, args.dtype, "cpu", **_float_weights())
    runner = ModelRunner(cfg, torch.device("cpu"), block_size=16, seed=0)
    runner.allocate_kv_cache(32 * (512 // 16 + 1) + 8)
    cases = CASES
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in CASES if any(w in c[0] for w in wanted)]
    paths = args.paths.split(",")
    print(f"threads={torch.get_num_threads()}  ms per runner.execute (best of {args.repeats})")
    print(f"{'case':24}" + "".join(f"{p:>12}" for p in paths))
    for name, num_requests, context, num_new in cases:
        sched = make_step(num_requests, context, num_new, 16, random.Random(0))
        row = time_paths(runner, sched, paths, args.repeats)
        print(f"{name:24}" + "".join(f"{ms:12.1f}" for ms in row), flush=True)
    return 0
