"""`python -m benchmarks moe`: what a mixture-of-experts step costs against a dense model with
the same active parameters, and the weight bytes a one-row decode step reads.

1. Step time. A random Qwen3-MoE checkpoint (--experts experts of --expert-width, --top-k per
   token) and a dense Qwen3 of the same shape whose MLP is --top-k experts wide (the same
   active parameters per token), both loaded as conveyor serves them (float32,
   batch-invariant), timed on decode steps of 1, 8 and 64 rows (--rows) at --context tokens of
   context, in alternation, --rounds times, best of the rounds. The ratio MoE / dense is the
   overhead of routing and grouping (goal: within 1.3x).
2. Bytes read. At one row, the experts a step runs (the compiled MoE's count) against the
   active experts' bytes (top_k experts per MoE layer): the weights of the experts outside a
   row's top-k are never read.
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="conveyor-moe-") as tmp:
        paths = {name: _checkpoint(Path(tmp), name, args) for name in ("moe", "dense")}
        engines = {name: _engine(path) for name, path in paths.items()}
        report = {"shape": vars(args) | {"func": None}, "steps": _step_times(engines, args)}
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


def _engine(path: str):
    from conveyor import LLMEngine

    return LLMEngine(
        path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory="1GiB",
        max_num_batched_tokens=4096, max_num_seqs=256,
    )  # fmt: skip


def _step_times(engines: dict, args: argparse.Namespace) -> dict:
    """rows -> {moe_ms, dense_ms, ratio}: each the best of args.rounds, models alternated."""
    best: dict[int, dict] = {rows: {} for rows in args.rows}
    for _ in range(args.rounds):
        for rows in args.rows:
            for name, engine in engines.items():
                ms = _decode_ms(engine, rows, args)
                best[rows][f"{name}_ms"] = min(best[rows].get(f"{name}_ms", ms), ms)
    for row in best.values():
        row["ratio"] = row["moe_ms"] / row["dense_ms"]
    return best


def _decode_ms(engine, rows: int, args: argparse.Namespace) -> float:
    """ms of one decode step of `rows` rows at args.context tokens of context."""
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{i}-{time.monotonic_ns()}", _tokens(args.context, i, args), params)
    requests = engine.core.scheduler.requests.values
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests()):
        engine.step()
    start = time.perf_counter()
    engine.step()
    ms = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def _tokens(n: int, seed: int, args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 7919 + time.monotonic_ns() % 1000)
    return torch.randint(3, args.vocab, (n,), generator=generator).tolist()


def _bytes_read(engine, args: argparse.Namespace) -> dict:
    """Expert weight bytes one one-row decode step runs (the compiled MoE layers' count of
    experts run, kernels/layer/decoder_layer.cpp), against its active experts' bytes."""
    from conveyor import SamplingParams
    from conveyor.model import kernels, moe

    model = engine.core.runner.model
    layers = [m for m in model.modules() if isinstance(m, moe.MoEMLP)]
    expert_bytes = sum(p.numel() * p.element_size() for p in layers[0].experts[0].parameters())
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
    print(f"{'rows':>6}{'moe ms':>10}{'dense ms':>10}{'moe/dense':>11}")
    for rows, row in report["steps"].items():
        print(f"{rows:>6}{row['moe_ms']:>10.1f}{row['dense_ms']:>10.1f}{row['ratio']:>10.2f}x")
    b = report["bytes"]
    print(
        f"one-row decode step: expert weights run {b['expert_bytes_run'] / 2**20:.1f} MiB, "
        f"active experts {b['active_expert_bytes'] / 2**20:.1f} MiB, all experts "
        f"{b['all_expert_bytes'] / 2**20:.1f} MiB"
    )
