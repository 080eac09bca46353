"""`python -m benchmarks quant-kernels`: ms per call of each quantized-matmul candidate for
SmolLM2-135M's projection shapes, the measurement behind the kernel choice described at the top
of conveyor/model/quant/ (its table was printed with the defaults: one thread, 30 weights).

Candidates: float32 matmul, fbgemm's dynamic int8 linear, torch's int8 / int4 packed matmuls,
and conveyor's block kernels (q4_block, q8_block, q4_tiles; the batch-invariant panels' int8
route on VNNI vectors, q4_panels / q8_panels, and on AMX-INT8 tiles, q4_amx8 / q8_amx8). Each
cycles through --copies random weights, as a step's layers do, so that they stream from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch

from conveyor.model.quant import QK, kernels, quantize_q4, quantize_q8

SHAPES = {
    "qkv": (960, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "o": (576, 576),
    "logits": (49152, 576),
}
NUM_TOKENS = (1, 8, 32, 64, 512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--copies",
        type=int,
        default=30,
        help="random weights per shape each candidate cycles through (default 30; 2 for logits)",
    )
    parser.add_argument(
        "--layer-routes",
        action="store_true",
        help="only a decoder layer's four Q4_1 projections through the panels' int8 route, on "
        "VNNI vectors against AMX-INT8 tiles (the same bits), alternated, best of --rounds",
    )
    parser.add_argument("--rounds", type=int, default=15, help="--layer-routes rounds")


def main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", category=UserWarning)  # quantize_per_channel deprecation
    torch.set_num_threads(args.num_threads)
    if args.layer_routes:
        return _layer_routes(args.rounds)
    print("shape      T  " + "".join(f"{name:>10}" for name in _candidates(torch.ones(16, 32), 1)))
    for label, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) * 0.02 for _ in range(args.copies if n < 10000 else 2)]
        for num_tokens in NUM_TOKENS:
            if label == "logits" and num_tokens == 512:
                continue  # logits are computed for the sampled rows only
            row = _time_row(weights, num_tokens, k)
            print(f"{label:<8}{num_tokens:>5}  " + "".join(f"{ms:>10.3f}" for ms in row))
    return 0


def _time_row(weights: list[torch.Tensor], num_tokens: int, k: int) -> list[float]:
    """Median ms per call of each candidate (nan where skipped), over 5 passes of the weights."""
    x = torch.randn(num_tokens, k)
    calls = [_candidates(w, num_tokens) for w in weights]
    row = []
    for name in calls[0]:
        fns = [c[name](x) for c in calls]
        if fns[0] is None:
            row.append(float("nan"))
            continue
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for fn in fns:
                fn()
            times.append((time.perf_counter() - start) / len(fns))
        row.append(statistics.median(times) * 1e3)
    return row


def _candidates(w: torch.Tensor, num_tokens: int) -> dict[str, Any]:
    """name -> (x -> zero-argument call, or None where too slow to bother)."""
    n, k = w.shape
    scale = w.abs().amax(1) / 127
    zero = torch.zeros(n, dtype=torch.long)
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8), None
    )
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1
    )
    scales_zeros = torch.randn(k // QK, n, 2)
    q4, q8 = quantize_q4(w), quantize_q8(w)
    slow = num_tokens > 8  # the int8/int4 pack ops are far behind already at 8 tokens
    return {
        "f32": lambda x: lambda: (w @ x.T).T,
        "fbgemm_i8": lambda x: lambda: torch.ops.quantized.linear_dynamic(x, packed),
        "i8pack_mm": lambda x: None if slow else lambda: torch._weight_int8pack_mm(x, w8, scale),
        "i4pack_mm": lambda x: (
            None if slow else lambda: torch._weight_int4pack_mm_for_cpu(x, w4, QK, scales_zeros)
        ),
        "q4_block": lambda x: lambda: kernels().q4_linear(x, q4.qs, q4.d, q4.m),
        "q8_block": lambda x: lambda: kernels().q8_linear(x, q8.qs, q8.d),
        "q4_tiles": lambda x: lambda: kernels().q4_linear_dequant(x, q4.qs, q4.d, q4.m),
        "q4_panels": lambda x: _panels(x, q4, n, tiles=False),
        "q4_amx8": lambda x: _panels(x, q4, n, tiles=True),
        "q8_panels": lambda x: _panels(x, q8, n, tiles=False),
        "q8_amx8": lambda x: _panels(x, q8, n, tiles=True),
    }


def _layer_routes(rounds: int) -> int:
    """ms per layer (qkv, o, gate_up, down) of block_linear's int8 route per row count: VNNI
    panels (set_amx_int8_from(0)) and AMX-INT8 tiles (1), alternated round by round, the best
    round of each shape (a shared machine's quiet moments)."""
    ops = kernels()
    if not ops.cpu_features()["amx_int8"]:
        print("no AMX-INT8 on this CPU: nothing to compare")
        return 0
    shapes = {k: v for k, v in SHAPES.items() if k != "logits"}
    panels = {}
    for label, (n, k) in shapes.items():
        w = quantize_q4(torch.randn(n, k) * 0.05)
        panels[label] = ops.pack_blocks(w.qs, w.d, w.m, False)
    print("rows   vnni ms   amx8 ms   speed-up")
    for num_tokens in (8, 16, 32, 64, 128):
        xs = {label: torch.randn(num_tokens, k) for label, (_, k) in shapes.items()}
        best = {0: dict.fromkeys(shapes, float("inf")), 1: dict.fromkeys(shapes, float("inf"))}
        for _ in range(rounds):
            for tiles in (0, 1):
                ops.set_amx_int8_from(tiles)
                for label, (n, _) in shapes.items():
                    start = time.perf_counter()
                    for _ in range(5):
                        ops.block_linear(xs[label], *panels[label], n, False)
                    ms = (time.perf_counter() - start) / 5 * 1e3
                    best[tiles][label] = min(best[tiles][label], ms)
        vnni, amx8 = sum(best[0].values()), sum(best[1].values())
        print(f"{num_tokens:>4}  {vnni:>8.3f}  {amx8:>8.3f}   {vnni / amx8:.2f}x")
    return 0


def _panels(x: torch.Tensor, weight, n: int, tiles: bool) -> Any:
    """The batch-invariant panel kernel's int8 route (what generated rows run), on its VNNI
    vectors or (tiles) on AMX-INT8 tiles with the same bits; None without AMX-INT8."""
    ops = kernels()
    if tiles and not ops.cpu_features()["amx_int8"]:
        return None
    panels = ops.pack_blocks(weight.qs, weight.d, weight.m, False)

    def call() -> torch.Tensor:
        ops.set_amx_int8_from(1 if tiles else 0)
        return ops.block_linear(x, *panels, n, False)

    return call
