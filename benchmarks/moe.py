"""`python -m benchmarks moe`: what a mixture-of-experts step costs against a dense model with
the same active parameters, and the weight bytes a one-row decode step reads.

1. Step time. A random Qwen3-MoE checkpoint (--experts experts of --expert-width, --top-k per
   token) and a dense Qwen3 of the same shape whose MLP is --top-k experts wide (the same
   active parameters per token), both loaded as conveyor serves them (float32,
   batch-invariant; --quantization int8 serves both with int8 weights), timed on decode
   steps of 1, 8 and 64 rows (--rows) at --context tokens of context (the mean of a few steps),
   in alternation, --rounds times, best of the rounds. The ratio MoE / dense is the overhead
   of routing and grouping (goal: within 1.3x).
2. The floor of each step: max(weight bytes read / the measured read bandwidth, its
   arithmetic / the measured peak of its instructions), as `python -m benchmarks step` counts
   it. The MoE step reads the experts it runs (the compiled MoE's count over the timed steps):
   at one row its top-k per layer, at 8 rows nearly all of them. Where both steps are bound by
   reading weights, the MoE's floor over the dense one's is what no kernel can beat; each
   step's time over its floor says how near the kernels run to it.
3. Bytes read. At one row, the experts a step runs against the active experts' bytes (top_k
   experts per MoE layer): the weights of the experts outside a row's top-k are never read.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument(
        "--quantization", choices=("none", "int8"), default="none",
        help="serve both models float32 (none) or with int8 weights, as a GGUF is served",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="conveyor-moe-") as tmp:
        paths = {name: _checkpoint(Path(tmp), name, args) for name in ("moe", "dense")}
        engines = {name: _engine(path, args.quantization) for name, path in paths.items()}
        report = {"shape": vars(args) | {"func": None}, "steps": _step_times(engines, args)}
        report["limits"] = _floors(report["steps"], engines, args)
        report["bytes"] = _bytes_read(engines["moe"], args)
    _print(report, args)
    if args.save_result:
        out = Path(args.result_dir or ".") / f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2, default=str))
        print(f"written: {out}")
    return 0


def _checkpoint(folder: Path, name: str, args: argparse.Namespace) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        vocab_size=args.vocab, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        use_sliding_window=False,
    )  # fmt: skip
    if name == "moe":
        config = AutoConfig.for_model(
            "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=args.experts,
            num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
            intermediate_size=args.expert_width * args.top_k, norm_topk_prob=True, **shape,
        )  # fmt: skip
    else:
        config = AutoConfig.for_model(
            "qwen3", architectures=["Qwen3ForCausalLM"],
            intermediate_size=args.expert_width * args.top_k, **shape,
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = folder / name
    model.save_pretrained(path)
    return str(path)


def _engine(path: str, quantization: str):
    from conveyor import LLMEngine

    return LLMEngine(
        path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory="1GiB",
        max_num_batched_tokens=4096, max_num_seqs=256, quantization=quantization,
    )  # fmt: skip


def _step_times(engines: dict, args: argparse.Namespace) -> dict:
    """rows -> {moe_ms, dense_ms, ratio, experts_run}: each time the best of args.rounds,
    models alternated; experts_run, the most the MoE's timed steps ran per step (all its
    layers)."""
    best: dict[int, dict] = {rows: {"experts_run": 0} for rows in args.rows}
    for _ in range(args.rounds):
        for rows in args.rows:
            for name, engine in engines.items():
                ms, ran = _decode_ms(engine, rows, args)
                best[rows][f"{name}_ms"] = min(best[rows].get(f"{name}_ms", ms), ms)
                best[rows]["experts_run"] = max(best[rows]["experts_run"], ran)
    for row in best.values():
        row["ratio"] = row["moe_ms"] / row["dense_ms"]
    return best


def _floors(steps: dict, engines: dict, args: argparse.Namespace) -> dict:
    """Each step's floor (benchmarks/step.py's measure: bytes over the read bandwidth, flops
    over the peak of the instructions the projections run on: float32 FMA, or the int8 dot
    product where the experts are served quantized), per rows: {moe_floor_ms, dense_floor_ms,
    floor_ratio}."""
    from benchmarks import step

    limits = step.measure_limits(engines["dense"].core)
    kind = "int8_dot" if args.quantization == "int8" else "f32_fma"
    peak = limits.roofs.get(kind) or limits.roofs["matmul"]
    moe_model, dense_model = (engines[n].core.runner.model for n in ("moe", "dense"))
    expert = _expert_bytes(moe_model)
    shared = step.weight_bytes(moe_model, 1) - _all_experts_bytes(moe_model)
    active = _active_parameters(engines["dense"].core.model_config)
    out = {"bandwidth_gb_s": limits.bandwidth / 1e9, "peak_gop_s": peak / 1e9, "roof": kind}
    for rows, row in steps.items():
        flops = 2 * rows * active
        moe_bytes = shared + row["experts_run"] * expert
        dense_bytes = step.weight_bytes(dense_model, rows)
        for name, nbytes in (("moe", moe_bytes), ("dense", dense_bytes)):
            floor = max(nbytes / limits.bandwidth, flops / peak) * 1e3
            row[f"{name}_floor_ms"] = floor
            row[f"{name}_bytes"] = nbytes
        row["floor_ratio"] = row["moe_floor_ms"] / row["dense_floor_ms"]
    return out


def _moe_layers(model) -> list:
    from conveyor.model import moe

    return [m for m in model.modules() if isinstance(m, moe.MoEMLP)]


def _expert_bytes(model) -> int:
    """One expert's weights as served: float parameters, or quantized buffers and scales."""
    from benchmarks import step

    expert = _moe_layers(model)[0].experts[0]
    return sum(t.nbytes for m in expert.modules() for t in step._weights_of(m))


def _all_experts_bytes(model) -> int:
    return sum(_expert_bytes(model) * len(layer.experts) for layer in _moe_layers(model))


def _active_parameters(config) -> int:
    """A token's multiply-adds in the dense model's projections and LM head (the MoE's are as
    many by construction; its router's are a rounding error)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = config.hidden_size * (2 * q + 2 * kv + 3 * config.intermediate_size)
    return config.num_layers * per_layer + config.hidden_size * config.vocab_size


TIMED_STEPS = 4  # decode steps timed per measure, after one untimed


def _decode_ms(engine, rows: int, args: argparse.Namespace) -> tuple[float, float]:
    """ms of a decode step of `rows` rows at args.context tokens of context (the mean of
    TIMED_STEPS after a first one), and how many experts a step ran (0 for a dense model)."""
    from conveyor import SamplingParams
    from conveyor.model import kernels

    params = SamplingParams(temperature=0, max_tokens=2 + TIMED_STEPS, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{i}-{time.monotonic_ns()}", _tokens(args.context, i, args), params)
    requests = engine.core.scheduler.requests.values
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests()):
        engine.step()
    engine.step()
    runs = kernels.load().kernel_runs
    before = runs().get("moe/experts", 0)
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    ms = (time.perf_counter() - start) * 1e3 / TIMED_STEPS
    ran = (runs().get("moe/experts", 0) - before) / TIMED_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return ms, ran


def _tokens(n: int, seed: int, args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 7919 + time.monotonic_ns() % 1000)
    return torch.randint(3, args.vocab, (n,), generator=generator).tolist()


def _bytes_read(engine, args: argparse.Namespace) -> dict:
    """Expert weight bytes one one-row decode step runs (the compiled MoE layers' count of
    experts run, kernels/layer/decoder_layer.cpp), against its active experts' bytes."""
    from conveyor import SamplingParams
    from conveyor.model import kernels

    model = engine.core.runner.model
    layers = _moe_layers(model)
    expert_bytes = _expert_bytes(model)
    ops = kernels.load()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(f"one-{time.monotonic_ns()}", _tokens(args.context, 5, args), params)
    engine.step()  # the prompt
    before, steps = ops.kernel_runs()["moe/experts"], 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    ran = ops.kernel_runs()["moe/experts"] - before
    return {
        "expert_bytes_run": ran * expert_bytes // max(steps, 1),
        "active_expert_bytes": args.top_k * len(layers) * expert_bytes,
        "all_expert_bytes": args.experts * len(layers) * expert_bytes,
    }


def _print(report: dict, args: argparse.Namespace) -> None:
    print(
        f"Qwen3-MoE {args.experts} experts x {args.expert_width}, top-{args.top_k}, vs dense "
        f"Qwen3 of MLP width {args.top_k * args.expert_width}; hidden {args.hidden}, "
        f"{args.layers} layers, context {args.context}"
    )
    lim = report["limits"]
    print(
        f"floors: weight bytes / {lim['bandwidth_gb_s']:.1f} GB/s read, operations / "
        f"{lim['peak_gop_s']:.0f} GOP/s {lim['roof']} (both measured now)"
    )
    head = ("rows", "moe ms", "dense ms", "moe/dense", "experts", "moe floor", "dense floor")
    print(f"{head[0]:>6}" + "".join(f"{h:>12}" for h in head[1:]) + f"{'floor ratio':>13}")
    for rows, row in report["steps"].items():
        print(
            f"{rows:>6}{row['moe_ms']:>12.1f}{row['dense_ms']:>12.1f}{row['ratio']:>11.2f}x"
            f"{row['experts_run']:>12.1f}{row['moe_floor_ms']:>12.1f}{row['dense_floor_ms']:>12.1f}"
            f"{row['floor_ratio']:>12.2f}x"
        )
    b = report["bytes"]
    print(
        f"one-row decode step: expert weights run {b['expert_bytes_run'] / 2**20:.1f} MiB, "
        f"active experts {b['active_expert_bytes'] / 2**20:.1f} MiB, all experts "
        f"{b['all_expert_bytes'] / 2**20:.1f} MiB"
    )
