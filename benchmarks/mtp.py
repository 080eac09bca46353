"""`python -m benchmarks mtp`: a Qwen3.5 model's multi-token prediction layer proposing drafts
(speculative_config {"method": "mtp"}, model/mtp.py) against no speculation, side by side.

A random float32 Qwen3.5 checkpoint of one shape (--hidden, --layers, --vocab; every fourth
layer attention, the others gated delta nets) gets a prediction layer (`mtp.*`) of two kinds:

  - "right": the model made a bigram model (every layer's output projections zero, so its
    next token depends on the current one alone) and the layer made to compute the same map
    one token further (fc passes the token's embedding on, its attention and MLP add nothing,
    its final norm the model's): its drafts are the model's tokens, every one accepted;
  - "random": random weights, as unrelated to the model as drafts get: nearly none accepted.

A trained checkpoint's acceptance lies between (the hub, and so a real Qwen3.5's layer, is not
reachable here); the two bound what the layer can buy and what it costs. Each configuration
(none, the layer with k = 1..--k drafts, fixed: every draft verified every step; and --k with
the default adaptive policy, speculative/policy.py) generates --tokens tokens per request,
greedy, EOS ignored, at each --concurrency, for --rounds rounds alternated; output tok/s, the
better round of each, its ratio to none, and the acceptance counted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--k", type=int, default=3, help="the most drafts per step")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--prompt", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)


def main(args: argparse.Namespace) -> int:
    concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="conveyor-mtp-") as tmp:
        right = _checkpoint(Path(tmp) / "right", args, right=True)
        random = _checkpoint(Path(tmp) / "random", args, right=False)
        configs = {"none": (right, None)}
        for k in range(1, args.k + 1):
            spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
            configs[f"right, k={k}"] = (right, spec)
            configs[f"random, k={k}"] = (random, spec)
        spec = {"method": "mtp", "num_speculative_tokens": args.k}  # the default policy
        configs[f"right, k={args.k}, adaptive"] = (right, spec)
        configs[f"random, k={args.k}, adaptive"] = (random, spec)
        engines = {name: _engine(path, spec) for name, (path, spec) in configs.items()}
        rows = {name: {} for name in configs}
        for _ in range(args.rounds):
            for c in concurrency:
                for name, engine in engines.items():
                    tok_s, accepted = _generate(engine, c, args)
                    best = rows[name].get(c)
                    if best is None or tok_s > best[0]:
                        rows[name][c] = (tok_s, accepted)
    report = {
        "shape": vars(args),
        "rows": {n: {str(c): v for c, v in r.items()} for n, r in rows.items()},
    }
    _print(rows, concurrency, args)
    if args.save_result:
        out = Path(args.result_dir or ".") / f"mtp-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2))
        print(f"written: {out}")
    return 0


def _checkpoint(path: Path, args: argparse.Namespace, right: bool) -> str:
    """A random Qwen3.5 checkpoint with a prediction layer: made right (a bigram model and the
    layer that computes its map), or random."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.intermediate, vocab_size=args.vocab,
        linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads,
        linear_key_head_dim=args.hidden // args.heads,
        linear_value_head_dim=args.hidden // args.heads, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full = config.layer_types.index("full_attention")
    state = model.state_dict()
    layer = {
        k.split(f"layers.{full}.", 1)[1]: v for k, v in state.items() if f"layers.{full}." in k
    }
    hidden = args.hidden
    mtp = {f"mtp.layers.0.{k}": v.clone() for k, v in layer.items()}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    if right:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    param.zero_()
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name].zero_()
        mtp["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        mtp["mtp.norm.weight"] = model.model.norm.weight.detach().clone()
    else:
        for name, tensor in mtp.items():
            if name.startswith("mtp.layers.") and tensor.dim() == 2:
                tensor.normal_(std=0.02)
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors") | {k: v.contiguous() for k, v in mtp.items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _engine(path: str, spec: dict | None):
    from conveyor import LLMEngine

    return LLMEngine(
        path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory="1GiB",
        speculative_config=spec, enable_prefix_caching=False,
    )  # fmt: skip


def _generate(engine, concurrency: int, args: argparse.Namespace) -> tuple[float, float | None]:
    """Output tok/s of `concurrency` requests at once (their prompts first, untimed), and the
    share of drafts accepted meanwhile."""
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    generator = torch.Generator().manual_seed(time.monotonic_ns() % 10_000)
    for i in range(concurrency):
        prompt = torch.randint(3, args.vocab, (args.prompt,), generator=generator).tolist()
        engine.add_request(f"{i}-{time.monotonic_ns()}", prompt, params)
    scheduler = engine.core.scheduler
    while any(r.num_output_tokens == 0 for r in scheduler.running) or scheduler.waiting:
        engine.step()
    before = engine.get_stats().spec
    produced = sum(r.num_output_tokens for r in scheduler.running)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    after = engine.get_stats().spec
    if after is None:  # no speculation
        return (concurrency * args.tokens - produced) / seconds, None
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tokens = concurrency * args.tokens - produced
    return tokens / seconds, accepted / drafted if drafted else None


def _print(rows: dict, concurrency: list[int], args: argparse.Namespace) -> None:
    print(
        f"\nQwen3.5 shape: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; "
        f"{args.prompt}-token prompts, {args.tokens} output tokens; output tok/s (acceptance), "
        "the better of the rounds, and the ratio to none\n"
    )
    header = "| | " + " | ".join(f"{c} stream{'s' * (c > 1)}" for c in concurrency) + " |"
    print(header)
    print("|---" * (len(concurrency) + 1) + "|")
    for name, row in rows.items():
        cells = []
        for c in concurrency:
            tok_s, accepted = row[c]
            ratio = tok_s / rows["none"][c][0]
            share = "" if accepted is None else f" ({accepted:.0%})"
            cells.append(f"{tok_s:.1f}{share}, {ratio:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
