"""`python -m benchmarks attention`: the decode attention op alone, microseconds per layer.

Each case is B decode rows (one new token per sequence, each sequence its own shuffled KV
blocks) attending C tokens, with SmolLM2-135M's heads by default (9 query heads over 3 KV
heads, head_dim 64, block size 16), for each KV cache dtype. The op reads the cache as a real
step does, from memory: every call goes to the next of L layers, each with its own cache, L
chosen so the layers hold at least --cache-mib together (far more than L2; on a CPU whose L3 is
larger, raise it). --shared gives every row the same blocks instead (the cache read from L2:
the kernel's arithmetic alone).

--baseline names another build of the kernels (a conveyor_kernels.so, e.g. from
~/.cache/conveyor/kernels/ before a change): both are timed in alternating rounds in one
process, so load from elsewhere hits them alike, and their outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time
from types import ModuleType

import torch

from conveyor.model import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8": torch.float8_e4m3fn}  # fmt: skip


def load_build(path: str) -> ModuleType:
    """A kernels module from a given .so (another build of the same sources' module name)."""
    loader = importlib.machinery.ExtensionFileLoader(kernels.NAME, path)
    spec = importlib.util.spec_from_file_location(kernels.NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Case:
    """One shape's inputs: q, L layer caches and the step's metadata."""

    def __init__(self, args: argparse.Namespace, rows: int, context: int, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(0)
        bs, dim, kv_heads = args.block_size, args.head_dim, args.kv_heads
        blocks_per_row = -(-context // bs)
        num_blocks = blocks_per_row if args.shared else rows * blocks_per_row
        layer_bytes = 2 * num_blocks * kv_heads * bs * dim * dtype.itemsize
        self.num_layers = 1 if args.shared else max(2, -(-args.cache_mib * 2**20 // layer_bytes))
        self.num_layers = min(self.num_layers, 30)
        self.caches = []
        for _ in range(self.num_layers):
            cache = torch.randn(2, num_blocks, kv_heads, bs * dim, generator=gen)
            self.caches.append(cache.clamp(-448, 448).to(dtype))
        self.q = torch.randn(rows, kv_heads * args.group, dim, generator=gen)
        self.query_start = torch.arange(rows + 1, dtype=torch.long)
        self.seq_lens = torch.full((rows,), context, dtype=torch.long)
        if args.shared:
            tables = torch.randperm(num_blocks, generator=gen).repeat(rows, 1)
        else:
            tables = torch.randperm(num_blocks, generator=gen).view(rows, blocks_per_row)
        self.block_tables = tables.contiguous()
        self.block_size, self.scale = bs, dim**-0.5

    def run(self, ops: ModuleType, layer: int) -> torch.Tensor:
        return ops.paged_attention(self.q, self.caches[layer], self.block_size, self.query_start,
                                   self.seq_lens, self.block_tables, self.scale, True)  # fmt: skip


def time_builds(case: Case, builds: list[ModuleType], repeats: int) -> list[float]:
    """Median microseconds per call of each build, rounds alternating (one round: every
    layer once)."""
    times: list[list[float]] = [[] for _ in builds]
    for i in range(repeats + 1):
        for b, ops in enumerate(builds):
            start = time.perf_counter()
            for layer in range(case.num_layers):
                case.run(ops, layer)
            if i:  # the first round warms up
                times[b].append((time.perf_counter() - start) / case.num_layers * 1e6)
    return [statistics.median(t) for t in times]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,8,32,64,128", help="decode rows (sequences)")
    parser.add_argument("--contexts", default="256,1024,2048", help="tokens each row attends")
    parser.add_argument("--kv-dtypes", default="float32,bfloat16", help=",".join(DTYPES))
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shared", action="store_true", help="every row the same blocks")
    parser.add_argument("--cache-mib", type=int, default=1024, help="KV bytes over all layers")
    parser.add_argument("--baseline", default=None, help="another conveyor_kernels.so to time")
    parser.add_argument(
        "--build",
        default=None,
        help="a conveyor_kernels.so to time instead of this checkout's (kernels.load())",
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=2)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads)
    builds = [load_build(args.build) if args.build else kernels.load()]
    names = ["this build"]
    if args.baseline:
        builds.insert(0, load_build(args.baseline))
        names.insert(0, "baseline")
    print(f"threads={torch.get_num_threads()}  us per layer (median of {args.repeats} rounds)"
          f"{'  shared blocks' if args.shared else ''}  {kernels.cpu_model()}")  # fmt: skip
    header = f"{'rows':>5} {'ctx':>5} {'kv':>9} {'layers':>6}" + "".join(f"{n:>12}" for n in names)
    print(header + ("   speed-up  bits" if args.baseline else "   GB/s"))
    for dtype_name in args.kv_dtypes.split(","):
        for context in map(int, args.contexts.split(",")):
            for rows in map(int, args.rows.split(",")):
                case = Case(args, rows, context, DTYPES[dtype_name])
                us = time_builds(case, builds, args.repeats)
                line = f"{rows:5} {context:5} {dtype_name:>9} {case.num_layers:6}"
                line += "".join(f"{t:12.1f}" for t in us)
                if args.baseline:
                    same = all(torch.equal(case.run(builds[0], i), case.run(builds[1], i))
                               for i in range(min(2, case.num_layers)))  # fmt: skip
                    line += f"   {us[0] / us[1]:7.2f}x  {'same' if same else 'DIFFER'}"
                else:
                    kv_bytes = 2 * rows * context * args.kv_heads * args.head_dim
                    kv_bytes *= DTYPES[dtype_name].itemsize  # as read, shared or not
                    line += f"   {kv_bytes / (us[-1] * 1e3):6.1f}"
                print(line, flush=True)
    return 0
