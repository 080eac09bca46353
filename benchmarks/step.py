"""`python -m benchmarks step`: one model step, measured against this machine's own limits.

For decode steps (B requests, one token each, attending C tokens) and prefill chunks (one
request, T prompt tokens), in one run:

  1. The step's plan comes from the real engine: requests with random prompts are added to an
     LLMEngine whose forward is stubbed out (the stub hands every sampling request a random
     token), and the engine is stepped until the batch is in the wanted shape. So block tables,
     sampling rows and positions are exactly what serving produces, and the engine's own work
     per step (schedule, update, detokenize, outputs) is timed for real, without a forward.
  2. That SchedulerOutput is replayed over the engine's real ModelRunner: warm-up, then
     plain `execute` calls (their median is the headline) alternating with calls under module
     hooks that time each category exclusively (innermost labelled module wins):
       projections      every linear-like module (class name has "Linear", or name "*_proj")
       attention        the attention module minus its projections, norms and rotary
                        (a compiled attention op inside it is counted here too)
       other            norms, rotary, activation, residual, embedding
       logits_sampling  lm_head and the sampler
       engine           what `execute` does outside the model (input preparation) plus the
                        engine's own work from step 1
     Classification is by module, not by op name, so it survives compiled or quantized ops.
  3. The floor: bytes over a measured read bandwidth (a large tensor sum, same threads) and
     each kind of arithmetic over the peak rate of the instructions that do it, measured in
     the same run: the compiled kernels' own multiply-adds in registers on every thread
     (`peak_rate`: float32 / float64 FMA, the int8 dot product, bf16 dot products where the
     CPU has them, and AMX bf16 tile dot products, the roof of a quantized model's prompt
     tokens where they take the tiles: model/prompt_route.py), at the instruction set the
     kernels run (AVX-512, AVX2 or scalar; on CUDA, torch's matmul at 4096^3). floor = the
     larger of the two; % of floor = floor / step * 100.
     Bytes = every weight the step reads in full (an untied embedding only by its rows) plus
     the KV of every token attended or written. Operations = the projections (2 * tokens *
     weights: int8 dot products when they are quantized, else the model's float type), the
     logits of the sampled rows (float) and 4 * heads * head_dim per attended (query, key)
     pair (float). Activation traffic is left out: the floor is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from conveyor import envs
from conveyor.model import prompt_route
from conveyor.model.layers import matmul_forms
from conveyor.model.quant import QuantLinear
from conveyor.model.recurrent import RecurrentState
from conveyor.outputs import ModelRunnerOutput, OutputKind, SchedulerOutput

FULL_GRID = dict(batches=(1, 8, 32, 64), contexts=(128, 512, 2048), prefill_chunks=(512, 2048))
QUICK_GRID = dict(batches=(1, 8, 32), contexts=(128, 512), prefill_chunks=(512,))
CATEGORIES = ("projections", "attention", "other", "logits_sampling", "engine")
COMPILED_CATEGORIES = ("projections", "attention", "other")  # as decoder_layers reports them
BANDWIDTH_BYTES = 256 * 2**20  # far beyond any CPU cache, small enough for a shared machine
ROOF_KINDS = ("f32_fma", "f64_fma", "int8_dot", "bf16_dot", "amx_bf16")  # kernels.peak_rate's
ROOF_ITERS = 2_000_000  # per call: a few ms of each kind on one core
FIRST_TOKEN_ID = 3  # random tokens avoid the special ids at the bottom of most vocabularies


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # "decode" | "prefill"
    batch: int  # requests in the step
    length: int  # decode: tokens each request attends; prefill: the chunk's tokens

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode b={self.batch} ctx={self.length}"
        return f"prefill {self.length}"

    @property
    def num_tokens(self) -> int:
        return self.batch if self.kind == "decode" else self.length


class Floor(NamedTuple):
    weight_bytes: int
    kv_bytes: int
    flops: float  # every operation of the step (a multiply-add counts 2)
    work: dict[str, dict]  # projections / logits / attention: ops, roof (its kind), ms
    roof_flops_per_s: float  # flops / compute time: the step's mix at the peak rates
    memory_ms: float
    compute_ms: float
    ms: float
    bound: str  # "memory" | "compute"


class Limits(NamedTuple):
    """What this machine can do, measured at the start of the run with the run's threads."""

    bandwidth: float  # bytes/s read
    roofs: dict[str, float]  # ops/s by kind (ROOF_KINDS on CPU; "matmul" elsewhere)
    isa: str  # the instruction set of the CPU kernels and so of the roofs, or the device


class Timings(NamedTuple):
    """Medians over repetitions, milliseconds per step."""

    runner_ms: float  # ModelRunner.execute, no hooks
    engine_ms: float  # the engine's own work around execute (from the stubbed engine)
    parts_ms: dict[str, float]  # CATEGORIES, measured with hooks


# ---- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conveyor.entrypoints.args import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--quantization", default=None, help="passed to the engine as quantization= when given"
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the batch-invariant kernels (default) or the earlier ones, chosen by row count",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads for the steps and the limits (default 1: on a small shared CPU "
        "a second OpenMP thread stalls at every barrier when a core is taken); 0 keeps torch's "
        "default",
    )
    parser.add_argument("--batches", type=_int_list, default=None, help="e.g. 1,8,32,64")
    parser.add_argument("--contexts", type=_int_list, default=None, help="e.g. 128,512,2048")
    parser.add_argument("--prefill-chunks", type=_int_list, default=None, help="e.g. 512,2048")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller grid (batches 1,8,32; contexts 128,512; chunk 512) and 3 repetitions",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="2GiB",
        help="KV budget; decode cases that do not fit in it are skipped (default 2GiB)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-dtype", default=None, help="passed to the engine as kv_cache_dtype= when given"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG (roofline + breakdown) here")
    parser.add_argument("--disable-tqdm", action="store_true")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def check_args(args: argparse.Namespace) -> None:
    if args.num_threads < 0:
        raise ValueError(f"--num-threads must be >= 0, got {args.num_threads}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")


def build_grid(args: argparse.Namespace) -> list[Case]:
    """Explicit lists win over --quick, which wins over the full grid."""
    base = QUICK_GRID if args.quick else FULL_GRID
    batches = args.batches or base["batches"]
    contexts = args.contexts or base["contexts"]
    chunks = args.prefill_chunks or base["prefill_chunks"]
    cases = [Case("decode", b, c) for c in contexts for b in batches]
    return cases + [Case("prefill", 1, n) for n in chunks]


def num_repeats(args: argparse.Namespace) -> int:
    return args.repeats or (3 if args.quick else 5)


def main(args: argparse.Namespace) -> int:
    check_args(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    grid = build_grid(args)
    engine = build_engine(args, grid)
    cases, skipped = fit_cases(engine, grid, num_repeats(args))
    limits = measure_limits(engine)
    results = []
    for case in tqdm(cases, desc="bench step", unit="case", disable=args.disable_tqdm):
        results.append(run_case(engine, case, args, limits))
    report = build_report(args, engine, limits, results, skipped)
    print(format_table(report))
    for path in save(report, args):
        print(f"wrote {path}")
    return 0


# ---- engine and cases ---------------------------------------------------------------------


def build_engine(args: argparse.Namespace, grid: list[Case]):
    from conveyor.engine.llm_engine import LLMEngine

    memory = args.kv_cache_memory
    kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=max(c.batch for c in grid),
        max_num_batched_tokens=max(2048, *(c.num_tokens for c in grid)),
        block_size=args.block_size,
        kv_cache_memory=int(memory) if memory.isdigit() else memory,
        seed=args.seed,
        batch_invariant=args.batch_invariant,
    )
    if args.quantization is not None:  # only engines that know the keyword get it
        kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    try:
        return LLMEngine(args.model, **kwargs)
    except TypeError as error:
        raise ValueError(f"the engine refused an argument: {error}") from None


def fit_cases(engine, grid: list[Case], repeats: int) -> tuple[list[Case], list[dict]]:
    """Cases whose requests fit the model's length and the KV budget; the rest with a reason."""
    fits, skipped = [], []
    block_size = engine.cache_config.block_size
    # a hybrid's state slots (model/recurrent.py): at most that many sequences run at once
    slots = getattr(engine.core, "num_state_slots", 0) if engine.model_config.parts.recurrent else 0
    for case in grid:
        prompt_len, max_tokens = _request_shape(engine, case, repeats)
        per_request = -(-(prompt_len + max_tokens) // block_size)
        if prompt_len < 1 or prompt_len + max_tokens > engine.max_model_len:
            reason = f"longer than the model's context ({engine.max_model_len})"
        elif case.batch * per_request > engine.num_blocks:
            reason = (
                f"needs {case.batch * per_request} KV blocks, the budget holds {engine.num_blocks}"
            )
        elif slots and case.batch > slots:
            reason = (
                f"needs {case.batch} recurrent state slots, the budget holds {slots} "
                f"(--kv-cache-memory)"
            )
        else:
            fits.append(case)
            continue
        skipped.append({"case": case.name, "reason": reason})
    return fits, skipped


def _request_shape(engine, case: Case, repeats: int) -> tuple[int, int]:
    """(prompt length, max_tokens) so that the last timed decode step attends ~case.length."""
    if case.kind == "prefill":
        return case.length, 2
    budget = engine.scheduler_config.max_num_batched_tokens
    # While the batch prefills, requests that are done already decode: bound those tokens.
    max_tokens = repeats + 2 + -(-case.batch * case.length // budget)
    return case.length - repeats - 1, max_tokens


class _StubExecute:
    """Stands in for ModelRunner.execute: records the step's plan and gives every sampling
    request a random token, so the engine's own work runs for real without a forward."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.last: SchedulerOutput | None = None
        self.seconds = 0.0

    def __call__(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        self.last = sched
        ids = [s.request_id for s in sched.scheduled if s.sampling is not None]
        tokens = self.rng.integers(FIRST_TOKEN_ID, self.vocab_size, len(ids)).tolist()
        out = ModelRunnerOutput(ids, [[t] for t in tokens], [None] * len(ids))
        self.seconds = time.perf_counter() - start
        return out


def plan_step(engine, case: Case, repeats: int, seed: int) -> tuple[SchedulerOutput, list[float]]:
    """Drives the real engine (forward stubbed) into the case's shape. Returns the last step's
    SchedulerOutput (its requests still running) and the engine's own ms of each timed step."""
    from conveyor.sampling_params import SamplingParams

    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    stub = _StubExecute(vocab, seed)
    rng = np.random.default_rng(seed)
    prompt_len, max_tokens = _request_shape(engine, case, repeats)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.runner.execute = stub  # an instance attribute shadows the method until deleted
    try:
        if case.kind == "decode":
            return _plan_decode(engine, case, stub, rng, prompt_len, params, repeats)
        return _plan_prefill(engine, stub, rng, prompt_len, params, repeats)
    finally:
        del engine.runner.execute


def _add_random(engine, request_id: str, rng, vocab: int, length: int, params) -> None:
    prompt = rng.integers(FIRST_TOKEN_ID, vocab, length).tolist()
    # DELTA, as the server asks: engine time is measured as a user's request costs it.
    engine.add_request(request_id, prompt, params, output_kind=OutputKind.DELTA)


def _plan_decode(engine, case, stub, rng, prompt_len, params, repeats):
    for i in range(case.batch):
        _add_random(engine, f"step-{i}", rng, stub.vocab_size, prompt_len, params)
    for _ in range(case.batch * prompt_len + 1):  # prefill, until every request decodes
        engine.step()
        sched = stub.last
        if len(sched.scheduled) == case.batch == sched.total_num_scheduled_tokens:
            break
    else:
        raise RuntimeError(f"{case.name}: the batch never reached a pure decode step")
    engine_ms = [_timed_step(engine, stub) for _ in range(repeats)]
    return stub.last, engine_ms  # the plan of the last timed step, read after it ran


def _plan_prefill(engine, stub, rng, prompt_len, params, repeats):
    engine_ms = []
    for i in range(repeats):  # a fresh prompt each time: no prefix-cache hit
        if i:
            engine.abort_request(f"step-{i - 1}")
        _add_random(engine, f"step-{i}", rng, stub.vocab_size, prompt_len, params)
        engine_ms.append(_timed_step(engine, stub))
    return stub.last, engine_ms


def _timed_step(engine, stub: _StubExecute) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start - stub.seconds) * 1e3


def run_case(engine, case: Case, args: argparse.Namespace, limits: Limits) -> dict:
    repeats = num_repeats(args)
    sched, engine_ms = plan_step(engine, case, repeats, args.seed)
    try:
        timings = time_step(engine.runner, sched, engine_ms, args.warmup, repeats)
    finally:
        engine.abort_request([s.request_id for s in sched.scheduled])
    floor = step_floor(engine, sched, limits)
    step_ms = timings.runner_ms + timings.engine_ms
    return {
        "case": case.name,
        **asdict(case),
        "num_tokens": sched.total_num_scheduled_tokens,
        "mean_context": _mean_context(sched),
        "step_ms": step_ms,
        "runner_ms": timings.runner_ms,
        "engine_ms": timings.engine_ms,
        "tokens_per_s": sched.total_num_scheduled_tokens / step_ms * 1e3,
        "breakdown_ms": timings.parts_ms,
        "floor": floor._asdict(),
        "pct_of_floor": floor.ms / step_ms * 100,
    }


def _mean_context(sched: SchedulerOutput) -> float:
    """Tokens attended by the last query of each request, averaged."""
    lengths = [s.num_computed_tokens + len(s.token_ids) for s in sched.scheduled]
    return sum(lengths) / len(lengths)


# ---- timing -------------------------------------------------------------------------------


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_step(runner, sched: SchedulerOutput, engine_ms: list[float], warmup: int, repeats: int):
    """Plain and hooked executes alternate, so that both see the same interference from
    whatever else runs on the machine; each gives its median."""
    sync = _synchronizer(runner.device)
    for _ in range(warmup):
        runner.execute(sched)
    runner_ms, samples = [], []
    for _ in range(repeats):
        runner_ms.append(_execute_seconds(runner, sched, sync) * 1e3)
        samples.append(profile_execute(runner, sched))
    engine_median = statistics.median(engine_ms)
    parts = {c: statistics.median(s[c] for s in samples) * 1e3 for c in CATEGORIES}
    parts["engine"] += engine_median
    return Timings(statistics.median(runner_ms), engine_median, parts)


def _execute_seconds(runner, sched: SchedulerOutput, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    runner.execute(sched)
    sync()
    return time.perf_counter() - start


class ScopeTimer:
    """Exclusive wall time per category: time counts for the innermost open scope only."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.stack: list[str] = []
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.mark = 0.0

    def _advance(self) -> None:
        self.sync()  # on CUDA, so that a scope owns its kernels' time
        now = time.perf_counter()
        if self.stack:
            self.totals[self.stack[-1]] += now - self.mark
        self.mark = now

    def enter(self, category: str) -> None:
        self._advance()
        self.stack.append(category)

    def exit(self) -> None:
        self._advance()
        self.stack.pop()


def classify(name: str, module: nn.Module) -> str | None:
    """The category a module's own time belongs to; None: it inherits its parent's."""
    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    if leaf == "lm_head":
        return "logits_sampling"
    if "Linear" in kind or leaf.endswith("_proj"):
        return "projections"
    if "Attention" in kind or leaf in ("self_attn", "attn"):
        return "attention"
    if name == "" or "Norm" in kind or "Rotary" in kind or "Embedding" in kind:
        return "other"
    return None


class _TimedCall:
    """Wraps a callable (the sampler) in a scope, passing every other attribute through."""

    def __init__(self, target, timer: ScopeTimer, category: str) -> None:
        self.target, self.timer, self.category = target, timer, category

    def __call__(self, *args, **kwargs):
        self.timer.enter(self.category)
        try:
            return self.target(*args, **kwargs)
        finally:
            self.timer.exit()

    def __getattr__(self, name: str):
        return getattr(self.target, name)


def profile_execute(runner, sched: SchedulerOutput) -> dict[str, float]:
    """Seconds per category of one hooked execute; "engine" holds what execute spends outside
    every scope (input preparation)."""
    timer = ScopeTimer(_synchronizer(runner.device))
    handles = _attach_hooks(runner.model, timer)
    sampler = runner.sampler
    runner.sampler = _TimedCall(sampler, timer, "logits_sampling")
    # Plain greedy rows: the lm_head's argmax tokens instead of its forward (llama.py).
    runner.model.greedy_tokens = _TimedCall(runner.model.greedy_tokens, timer, "logits_sampling")
    compiled = torch.zeros(len(COMPILED_CATEGORIES), dtype=torch.float64)
    runner.model.compiled_seconds = compiled
    try:
        total = _execute_seconds(runner, sched, timer.sync)
    finally:
        runner.sampler = sampler
        del runner.model.greedy_tokens  # the method again
        runner.model.compiled_seconds = None
        for handle in handles:
            handle.remove()
    # The compiled layers (model/kernels/layer/decoder_layer.cpp) run inside the model's own scope
    # ("other") and time their parts themselves.
    for category, seconds in zip(COMPILED_CATEGORIES, compiled.tolist(), strict=True):
        timer.totals["other"] -= seconds
        timer.totals[category] += seconds
    timer.totals["engine"] = total - sum(timer.totals.values())
    return timer.totals


def _attach_hooks(model: nn.Module, timer: ScopeTimer) -> list:
    handles = []
    for name, module in model.named_modules():
        category = classify(name, module)
        if category is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, c=category: timer.enter(c)))
        handles.append(module.register_forward_hook(lambda m, a, o: timer.exit(), always_call=True))
    return handles


# ---- the floor ----------------------------------------------------------------------------


def measure_limits(engine) -> Limits:
    device = engine.device
    bandwidth = measure_bandwidth(device)
    ops = _compiled_ops() if device.type == "cpu" else None
    if ops is not None:
        roofs = {kind: measure_peak(ops, kind) for kind in ROOF_KINDS}
        return Limits(bandwidth, roofs, ops.isa())
    dtype = engine.model_config.dtype
    return Limits(bandwidth, {"matmul": measure_gemm(4096, 4096, 4096, dtype, device)}, device.type)


def _compiled_ops():
    from conveyor.model import kernels

    return kernels.load()


def measure_peak(ops, kind: str, tries: int = 5) -> float:
    """ops/s of one kind of arithmetic (kernels' peak_rate): the best of a few tries, since
    other work on the machine only ever slows it; 0 where the CPU lacks the instruction."""
    return max(ops.peak_rate(kind, ROOF_ITERS) for _ in range(tries))


def _best_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """The fastest of `repeats` timed calls: a limit is what the machine can do, and
    interference from other work only ever adds time."""
    fn()  # warm-up: first-touch page faults, allocator, kernel selection
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(device: torch.device, nbytes: int = BANDWIDTH_BYTES) -> float:
    """Read bandwidth in bytes/s: the sum of a tensor far larger than the caches."""
    data = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    return nbytes / _best_seconds(data.sum, _synchronizer(device), repeats=7)


def measure_gemm(num_tokens: int, k: int, n: int, dtype: torch.dtype, device) -> float:
    """FLOP/s of the better of x @ W^T and (W @ x^T)^T for x (num_tokens, k), W (n, k)."""
    x = torch.randn(num_tokens, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    sync = _synchronizer(torch.device(device))
    repeats = 7 if num_tokens < 256 else 3
    best = min(
        _best_seconds(lambda: x @ w.T, sync, repeats),
        _best_seconds(lambda: w @ x.T, sync, repeats),
    )
    return 2 * num_tokens * k * n / best


def weight_bytes(model: nn.Module, num_tokens: int) -> int:
    """Bytes of every weight a step reads in full (quantized buffers included, tied weights
    once); an embedding table not shared with another module is read only by its rows."""
    full: dict[int, int] = {}
    rows: dict[int, int] = {}
    for module in model.modules():
        for tensor in _weights_of(module):
            if isinstance(module, nn.Embedding):
                rows[tensor.data_ptr()] = min(tensor.nbytes, num_tokens * tensor[0].nbytes)
            else:
                full[tensor.data_ptr()] = tensor.nbytes
    return sum(full.values()) + sum(n for ptr, n in rows.items() if ptr not in full)


def _weights_of(module: nn.Module):
    """Parameters and persistent buffers (rotary tables and other derived caches are not)."""
    skip = module._non_persistent_buffers_set
    yield from (t for t in module._parameters.values() if t is not None)
    yield from (t for n, t in module._buffers.items() if t is not None and n not in skip)


def kv_bytes(kv_caches: list, block_size: int, sched: SchedulerOutput) -> int:
    """KV of every token a step attends to or writes, at the cache's own size per token (of
    all layers, K and V), whatever its layout or element type: a cache is (2, blocks, ...),
    with rows past the pool (the null block, CUDA graphs' scratch) that hold no token. A
    hybrid's delta nets (RecurrentState) instead read and write each scheduled sequence's
    state slot once."""
    blocks = [c for c in kv_caches if isinstance(c, torch.Tensor)]
    per_token = sum(c.nbytes // c.shape[1] for c in blocks) // block_size
    kv = per_token * sum(s.num_computed_tokens + len(s.token_ids) for s in sched.scheduled)
    states = [c for c in kv_caches if isinstance(c, RecurrentState)]
    per_slot = sum(t.nbytes // t.shape[0] for c in states for t in c)
    return kv + 2 * per_slot * len(sched.scheduled)


def projection_weights(cfg) -> int:
    """The projection weights one token multiplies, over all layers: attention's (or a delta
    net's), and the MLP's (a mixture's router, its top_k experts and its shared expert)."""
    parts, hidden = cfg.parts, cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    total = 0
    for layer in range(cfg.num_layers):
        if parts.is_linear(layer) and parts.linear_kind == "short_conv":
            total += 4 * hidden * hidden  # in_proj (B, C, x) and out_proj
        elif parts.is_linear(layer):
            (hk, hv), (dk, dv) = parts.linear_heads, parts.linear_dims
            total += hidden * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * hidden
        else:
            total += hidden * (2 * q + 2 * kv + q * parts.attn_gate)
        if parts.is_moe(layer):
            experts = parts.top_k * parts.moe_intermediate_size + parts.shared_expert_size
            total += hidden * (3 * experts + parts.num_experts + bool(parts.shared_expert_size))
        else:
            total += 3 * hidden * cfg.intermediate_size
    return total


def step_work(engine, sched: SchedulerOutput, limits: Limits) -> dict[str, tuple[float, str]]:
    """The step's operations by part, each with the kind of arithmetic (a roof) that does it."""
    cfg = engine.model_config
    tokens = sched.total_num_scheduled_tokens
    num_sampled = sum(1 for s in sched.scheduled if s.sampling is not None)
    pairs = 0  # (query, key) pairs under the causal mask
    for s in sched.scheduled:
        n = len(s.token_ids)
        pairs += n * s.num_computed_tokens + n * (n + 1) // 2
    linear = sum(cfg.parts.linear_layers)  # a hybrid's delta nets: no attention
    ops = {
        "projections": 2 * tokens * projection_weights(cfg),
        "logits": 2 * num_sampled * cfg.hidden_size * cfg.vocab_size,
        "attention": 4 * cfg.num_heads * cfg.head_dim * pairs * (cfg.num_layers - linear),
    }
    if (
        linear and cfg.parts.linear_kind == "gated_delta"
    ):  # per token and value head: decay, read, correct and read the state (7 x Dk Dv)
        (_, hv), (dk, dv) = cfg.parts.linear_heads, cfg.parts.linear_dims
        ops["delta rule"] = 7 * hv * dk * dv * tokens * linear
    if "matmul" in limits.roofs:
        return {part: (n, "matmul") for part, n in ops.items()}
    float_kind = "f64_fma" if cfg.dtype == torch.float64 else "f32_fma"
    if cfg.dtype in (torch.bfloat16, torch.float16) and limits.roofs.get("bf16_dot", 0) > 0:
        float_kind = "bf16_dot"
    quantized = any(  # int8 activations: every quantized projection but a float-input lm_head
        isinstance(m, QuantLinear) and not m.float_acts for m in engine.runner.model.modules()
    )
    kinds = {"projections": "int8_dot" if quantized else float_kind}
    work = {part: (n, kinds.get(part, float_kind)) for part, n in ops.items()}
    route = prompt_route.route_of(engine.runner.model)
    if route != "none":
        # prompt tokens' projections and attention on the AMX tiles, or their attention alone
        # on AVX512-BF16 (model/prompt_route.py); the rest on the blocks and float32 vectors
        attention_kind = "amx_bf16" if limits.roofs.get("amx_bf16", 0) > 0 else "bf16_dot"
        prompt = prompt_pairs = 0
        for s in sched.scheduled:
            if s.num_prompt_tokens is None:
                continue
            p = max(0, min(len(s.token_ids), s.num_prompt_tokens - s.num_computed_tokens))
            prompt += p
            prompt_pairs += p * s.num_computed_tokens + p * (p + 1) // 2
        if route == "tiles":
            share = prompt / max(1, sched.total_num_scheduled_tokens)
            total = ops["projections"]
            work["projections"] = (total * (1 - share), "int8_dot")
            work["prompt projections"] = (total * share, "amx_bf16")
        if envs.prompt_attention():
            share = prompt_pairs / max(1, pairs)
            work["attention"] = (ops["attention"] * (1 - share), float_kind)
            work["prompt attention"] = (ops["attention"] * share, attention_kind)
    return work


def step_floor(engine, sched: SchedulerOutput, limits: Limits) -> Floor:
    num_tokens = sched.total_num_scheduled_tokens
    weights = weight_bytes(engine.runner.model, num_tokens)
    kv = kv_bytes(engine.runner.kv_caches, engine.cache_config.block_size, sched)
    work = {
        part: {"ops": n, "roof": kind, "ms": n / limits.roofs[kind] * 1e3}
        for part, (n, kind) in step_work(engine, sched, limits).items()
    }
    flops = sum(w["ops"] for w in work.values())
    compute_ms = sum(w["ms"] for w in work.values())
    memory_ms = (weights + kv) / limits.bandwidth * 1e3
    bound = "memory" if memory_ms >= compute_ms else "compute"
    roof = flops / (compute_ms / 1e3) if compute_ms > 0 else 0.0
    return Floor(
        weights, kv, flops, work, roof, memory_ms, compute_ms, max(memory_ms, compute_ms), bound
    )


# ---- report -------------------------------------------------------------------------------


def build_report(args, engine, limits: Limits, results: list[dict], skipped: list[dict]):
    cfg = engine.model_config
    return {
        "model": str(cfg.path),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "quantization": getattr(cfg, "quantization", args.quantization),
        "kv_cache_dtype": str(getattr(engine.runner, "kv_dtype", cfg.dtype)).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "cpu_count": _cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "memory_bandwidth_gb_s": limits.bandwidth / 1e9,
        "isa": limits.isa,
        "roofs_gops": {kind: rate / 1e9 for kind, rate in limits.roofs.items()},
        "matmul_forms": _matmul_forms(engine),
        "kv_cache_blocks": engine.num_blocks,
        "block_size": engine.cache_config.block_size,
        "warmup": args.warmup,
        "repeats": num_repeats(args),
        "categories": list(CATEGORIES),
        "cases": results,
        "skipped": skipped,
    }


def _matmul_forms(engine) -> dict[str, str]:
    """The matmul form the engine's process chose per token count (model/layers.py)."""
    if engine.device.type != "cpu":
        return {}
    return {str(n): form for n, form in matmul_forms(engine.model_config.dtype).items()}


COLUMNS = (  # title, width, value of a case row
    ("case", 24, lambda r: r["case"]),
    ("tokens", 6, lambda r: f"{r['num_tokens']}"),
    ("ms/step", 8, lambda r: f"{r['step_ms']:.1f}"),
    ("tok/s", 8, lambda r: f"{r['tokens_per_s']:.0f}"),
    ("floor ms", 8, lambda r: f"{r['floor']['ms']:.1f}"),
    ("bound", 7, lambda r: r["floor"]["bound"]),
    ("% floor", 7, lambda r: f"{r['pct_of_floor']:.0f}%"),
    ("proj", 7, lambda r: f"{r['breakdown_ms']['projections']:.1f}"),
    ("attn", 7, lambda r: f"{r['breakdown_ms']['attention']:.1f}"),
    ("other", 7, lambda r: f"{r['breakdown_ms']['other']:.1f}"),
    ("logit+s", 7, lambda r: f"{r['breakdown_ms']['logits_sampling']:.1f}"),
    ("engine", 7, lambda r: f"{r['breakdown_ms']['engine']:.1f}"),
)


def _forms_text(forms: dict[str, str]) -> str:
    return ", ".join(f"{n} {form}" for n, form in forms.items())


def format_table(report: dict) -> str:
    header = "  ".join(
        f"{title:>{w}}" if i else f"{title:<{w}}" for i, (title, w, _) in enumerate(COLUMNS)
    )
    lines = [
        "",
        f"{report['model']}  {report['dtype']} on {report['device']}, "
        f"{report['num_threads']} threads; measured read bandwidth "
        f"{report['memory_bandwidth_gb_s']:.1f} GB/s; peak GOP/s ({report['isa']}): "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["roofs_gops"].items() if v > 0)
        + (
            f"; matmul form by rows: {_forms_text(report['matmul_forms'])}"
            if report["matmul_forms"]
            else ""
        ),
        "floor = max(bytes / bandwidth, each part's operations / the peak of its instructions); "
        "% floor = floor / ms per step; breakdown in ms per step",
        header,
        "-" * len(header),
    ]
    for row in report["cases"]:
        cells = [fn(row) for _, _, fn in COLUMNS]
        lines.append(
            "  ".join(
                f"{c:>{w}}" if i else f"{c:<{w}}"
                for i, (c, (_, w, _)) in enumerate(zip(cells, COLUMNS, strict=True))
            )
        )
    for skip in report["skipped"]:
        lines.append(f"skipped {skip['case']}: {skip['reason']}")
    faster = [row["case"] for row in report["cases"] if row["pct_of_floor"] > 100]
    if faster:
        lines.append(
            f"warning: {', '.join(faster)} ran faster than the floor: the limits were measured "
            "while other work loaded the machine; rerun on a quiet machine or with fewer threads"
        )
    return "\n".join(lines)


def save(report: dict, args: argparse.Namespace) -> list[Path]:
    paths = []
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        paths.append(path)
    if args.plot:
        from benchmarks.plots import plot_step

        paths.append(plot_step(report, Path(args.plot)))
    return paths


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
