"""`python -m benchmarks attention`: the attention op alone, microseconds per layer.

Each case is B decode rows (one new token per sequence, each sequence its own shuffled KV
blocks) attending C tokens, with SmolLM2-135M's heads by default (9 query heads over 3 KV
heads, head_dim 64, block size 16), for each KV cache dtype. The op reads the cache as a real
step does, from memory: every call goes to the next of L layers, each with its own cache, L
chosen so the layers hold at least --cache-mib together (far more than L2; on a CPU whose L3 is
larger, raise it). --shared gives every row the same blocks instead (the cache read from L2:
the kernel's arithmetic alone).

--prompts adds prompt cases: one sequence whose N tokens are all new (rows "p"), the prompt
chunk's causal attention, with its GFLOP/s.

--baseline names another build of the kernels (a conveyor_kernels.so, e.g. from
~/.cache/conveyor/kernels/ before a change): both are timed in alternating rounds, so load from
elsewhere hits them alike, and their outputs are compared bit for bit. Each build runs in a
process of its own: Python keeps one module per extension name, so a second build of
`conveyor_kernels` loaded into the same process is the first one again (this command's earlier
in-process comparisons timed one build against itself).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
import time
from types import ModuleType

import torch

from conveyor.model import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8": torch.float8_e4m3fn}  # fmt: skip


def load_build(path: str) -> ModuleType:
    """A kernels module from a given .so (another build of the same sources' module name).
    One per process: Python hands back the build it loaded first under that name, which is
    refused here (RuntimeError) rather than timed as if it were this one."""
    loader = importlib.machinery.ExtensionFileLoader(kernels.NAME, path)
    spec = importlib.util.spec_from_file_location(kernels.NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if getattr(module, "__file__", path) != path:
        raise RuntimeError(f"{kernels.NAME} is loaded from {module.__file__} already")
    return module


class Case:
    """One shape's inputs: q, L layer caches and the step's metadata."""

    def __init__(self, args: argparse.Namespace, rows: int, context: int, dtype: torch.dtype):
        """rows 0: a prompt, one sequence whose `context` tokens are all new (causal)."""
        gen = torch.Generator().manual_seed(0)
        bs, dim, kv_heads = args.block_size, args.head_dim, args.kv_heads
        sequences = max(rows, 1)
        blocks_per_row = -(-context // bs)
        num_blocks = blocks_per_row if args.shared else sequences * blocks_per_row
        self.num_layers = self.num_layers_for(args, rows, context, dtype)
        self.caches = []
        for _ in range(self.num_layers):
            cache = torch.randn(2, num_blocks, kv_heads, bs * dim, generator=gen)
            self.caches.append(cache.clamp(-448, 448).to(dtype))
        tokens = rows or context
        self.q = torch.randn(tokens, kv_heads * args.group, dim, generator=gen)
        self.query_start = torch.arange(sequences + 1, dtype=torch.long) * (tokens // sequences)
        self.seq_lens = torch.full((sequences,), context, dtype=torch.long)
        if args.shared:
            tables = torch.randperm(num_blocks, generator=gen).repeat(sequences, 1)
        else:
            tables = torch.randperm(num_blocks, generator=gen).view(sequences, blocks_per_row)
        self.block_tables = tables.contiguous()
        self.block_size, self.scale = bs, dim**-0.5

    @staticmethod
    def num_layers_for(args: argparse.Namespace, rows: int, context: int, dtype) -> int:
        """Layers whose caches together hold at least --cache-mib (at most 30; 1 shared)."""
        if args.shared:
            return 1
        blocks = max(rows, 1) * -(-context // args.block_size)
        layer_bytes = 2 * blocks * args.kv_heads * args.block_size * args.head_dim
        layer_bytes *= dtype.itemsize
        return min(30, max(2, -(-args.cache_mib * 2**20 // layer_bytes)))

    def run(self, ops: ModuleType, layer: int) -> torch.Tensor:
        return ops.paged_attention(self.q, self.caches[layer], self.block_size, self.query_start,
                                   self.seq_lens, self.block_tables, self.scale, True)  # fmt: skip


def time_round(case: Case, ops: ModuleType) -> float:
    """Microseconds per call over one round: every layer once."""
    start = time.perf_counter()
    for layer in range(case.num_layers):
        case.run(ops, layer)
    return (time.perf_counter() - start) / case.num_layers * 1e6


def digest(case: Case, ops: ModuleType) -> str:
    """The outputs of the first two layers' calls, hashed: equal digests, the same bits."""
    sha = hashlib.sha256()
    for layer in range(min(2, case.num_layers)):
        sha.update(case.run(ops, layer).numpy().tobytes())
    return sha.hexdigest()


def cases(args: argparse.Namespace):
    """(kv dtype name, context, rows) of every case, in the order they are reported; rows 0:
    a prompt of `context` tokens (--prompts)."""
    for dtype_name in args.kv_dtypes.split(","):
        for context in map(int, args.contexts.split(",")):
            for rows in map(int, args.rows.split(",")):
                yield dtype_name, context, rows
        for tokens in map(int, filter(None, args.prompts.split(","))):
            yield dtype_name, tokens, 0


class Worker:
    """One build's process (`--worker SO`): it builds the same cases and, asked, times a round
    of one or hashes its outputs. Rounds alternate between the workers; each waits on its pipe
    while the other runs."""

    def __init__(self, build: str, args: argparse.Namespace) -> None:
        flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _CASE_FLAGS]
        flags += ["--shared"] if args.shared else []
        command = [sys.executable, "-m", "benchmarks", "attention", "--worker", build, *flags]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker for {line!r} exited ({self.proc.wait()})")
        return answer.strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# The flags that shape the cases, forwarded to each worker.
_CASE_FLAGS = ("rows", "contexts", "prompts", "kv_dtypes", "group", "kv_heads", "head_dim",
               "block_size", "cache_mib", "num_threads")  # fmt: skip


def serve_worker(args: argparse.Namespace) -> int:
    """--worker: "time I" -> one round of case I in microseconds; "digest I" -> its outputs'
    hash; EOF ends it."""
    torch.set_num_threads(args.num_threads)
    ops = kernels.load() if args.worker == "this" else load_build(args.worker)
    shapes, built = list(cases(args)), {}
    for line in sys.stdin:
        command, index = line.split()
        if index not in built:
            built.clear()  # the cases come in order: one built at a time
            dtype_name, context, rows = shapes[int(index)]
            built[index] = Case(args, rows, context, DTYPES[dtype_name])
        case = built[index]
        answer = time_round(case, ops) if command == "time" else digest(case, ops)
        print(answer, flush=True)
    return 0


def time_workers(index: int, workers: list[Worker], repeats: int) -> list[float]:
    """Median microseconds per call of each worker's build, rounds alternating."""
    times: list[list[float]] = [[] for _ in workers]
    for i in range(repeats + 1):
        for w, worker in enumerate(workers):
            us = float(worker.ask(f"time {index}"))
            if i:  # the first round warms up
                times[w].append(us)
    return [statistics.median(t) for t in times]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,8,32,64,128", help="decode rows (sequences)")
    parser.add_argument(
        "--prompts",
        default="",
        help="prompt lengths, e.g. 512,2048: one sequence's tokens all new (its GFLOP/s shown)",
    )
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
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one build's process


def main(args: argparse.Namespace) -> int:
    if args.worker is not None:
        return serve_worker(args)
    torch.set_num_threads(args.num_threads)
    names = ["baseline", "this build"] if args.baseline else ["this build"]
    print(f"threads={torch.get_num_threads()}  us per layer (median of {args.repeats} rounds)"
          f"{'  shared blocks' if args.shared else ''}  {kernels.cpu_model()}")  # fmt: skip
    header = f"{'rows':>5} {'ctx':>5} {'kv':>9} {'layers':>6}" + "".join(f"{n:>12}" for n in names)
    print(header + ("   speed-up  bits" if args.baseline else "   GB/s"))
    builds = [args.baseline] if args.baseline else []
    builds.append(args.build or "this")
    workers = [Worker(build, args) for build in builds]
    try:
        for index, (dtype_name, context, rows) in enumerate(cases(args)):
            us = time_workers(index, workers, args.repeats)
            layers = Case.num_layers_for(args, rows, context, DTYPES[dtype_name])
            line = f"{rows or 'p':>5} {context:5} {dtype_name:>9} {layers:6}"
            line += "".join(f"{t:12.1f}" for t in us)
            if args.baseline:
                same = len({worker.ask(f"digest {index}") for worker in workers}) == 1
                line += f"   {us[0] / us[1]:7.2f}x  {'same' if same else 'DIFFER'}"
            elif rows == 0:  # a prompt: causal Q K^T and P V, 2 FLOPs a multiply-add
                heads = args.kv_heads * args.group
                flops = 4 * heads * args.head_dim * context * (context + 1) / 2
                line += f"   {flops / (us[-1] * 1e3):6.1f} GFLOP/s"
            else:
                kv_bytes = 2 * rows * context * args.kv_heads * args.head_dim
                kv_bytes *= DTYPES[dtype_name].itemsize  # as read, shared or not
                line += f"   {kv_bytes / (us[-1] * 1e3):6.1f}"
            print(line, flush=True)
    finally:
        for worker in workers:
            worker.close()
    return 0
