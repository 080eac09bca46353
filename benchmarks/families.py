"""`python -m benchmarks families`: what each family costs against Llama of the same shape, and
what a sliding window saves in KV blocks.

1. Step time. For every supported family a random checkpoint of one shape (hidden, layers,
   heads, MLP width, vocabulary: --hidden etc.) is built with transformers, loaded as conveyor
   serves it (float32, batch-invariant, the compiled layers), and timed on the same steps:
   --batch decode rows at --context tokens of context, and one --chunk-token prompt chunk. The
   families' parameter counts differ a little (Gemma's four norms, biases), so the ratio is
   per parameter: (family ms / family parameters) / (Llama ms / Llama parameters). Families run
   in alternation, --rounds times, and each step's time is the best of its rounds.
2. KV memory. One long request (--long-prompt tokens, then --long-output): on a Mistral whose
   every layer slides (--window) against the same weights with full attention, and on a Gemma 3
   (a global layer to five sliding ones) and a Gemma 4 (its global layers' pages twice the
   sliding ones') with their KV groups (model/kv_groups.py) against
   --disable-hybrid-kv-cache-manager (one table for every layer): the most KV bytes the
   request held at once, and the ratio.
3. Serving in a cache too small for the load. --hybrid-requests requests (--hybrid-prompt
   tokens, then --hybrid-output) at once on the Gemma 3, in a cache of the bytes the one-table
   layout needs for two of them:
   with KV groups and with one table, alternated --kv-rounds times: wall time, output tokens
   per second, preemptions, the most requests running at once.
4. A hybrid's next turn. --turns-conversations chats of two turns on Qwen3.5 and LFM2 (their
   recurrent layers: model/recurrent.py): a --turn-prompt-token prompt, its --turn-output-token
   answer, then the next turn (the prompt, the answer and --turn-new more tokens), one request
   at a time: the next turn's time to first token with prefix caching (a state snapshot at the
   first prompt's end, core/state_snapshots.py) against without, alternated --kv-rounds times.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

# family -> (architecture, model_type, config fields beyond the shared shape)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama", {}),
    "mistral (window)": ("MistralForCausalLM", "mistral", {"sliding_window": 256}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", {
        "query_pre_attn_scalar": 64, "sliding_window": 256, "hidden_activation":
        "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", {
        "query_pre_attn_scalar": 64, "sliding_window": 256}),
    # Gemma 4's E2B-like layer: global heads twice as wide, no per-layer inputs or shared caches
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text", {
        "global_head_dim": 128, "sliding_window": 256, "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0}),
    "phi3": ("Phi3ForCausalLM", "phi3", {"original_max_position_embeddings": 4096}),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", {}),
    "granite": ("GraniteForCausalLM", "granite", {
        "attention_multiplier": 0.125, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", {"use_sliding_window": False}),
    # hybrids (model/recurrent.py): every fourth layer attention, the others recurrent
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text", {
        "linear_num_key_heads": 3, "linear_num_value_heads": 6, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64}),
    "lfm2": ("Lfm2ForCausalLM", "lfm2", {
        "full_attn_idxs": [3, 7], "block_auto_adjust_ff_dim": False}),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8, help="decode rows per step")
    parser.add_argument("--context", type=int, default=512, help="each decode row's context")
    parser.add_argument("--chunk", type=int, default=256, help="tokens of the prompt chunk")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--long-output", type=int, default=64)
    parser.add_argument("--hybrid-requests", type=int, default=8)
    parser.add_argument("--hybrid-prompt", type=int, default=1024)
    parser.add_argument("--hybrid-output", type=int, default=256)
    parser.add_argument("--kv-rounds", type=int, default=2)
    parser.add_argument("--turns-conversations", type=int, default=4)
    parser.add_argument("--turn-prompt", type=int, default=2048)
    parser.add_argument("--turn-output", type=int, default=64)
    parser.add_argument("--turn-new", type=int, default=64)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="conveyor-families-") as tmp:
        report = {"shape": _shape(args), "steps": _step_times(args, Path(tmp))}
        report["kv_memory"] = _kv_memory(args, Path(tmp))
        report["hybrid_serving"] = _hybrid_serving(args, Path(tmp))
        report["next_turn"] = _next_turn(args, Path(tmp))
    _print(report, args)
    if args.save_result:
        out = Path(args.result_dir or ".") / f"families-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2))
        print(f"written: {out}")
    return 0


def _shape(args: argparse.Namespace) -> dict:
    return dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, head_dim=args.hidden // args.heads, max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip


def _checkpoint(folder: Path, family: str, shape: dict, **overrides) -> tuple[str, int]:
    """A random float32 checkpoint of the family: its path and parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(
        model_type, architectures=[arch], **{**shape, **extra, **overrides}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = folder / f"{family.split()[0]}-{sum(1 for _ in folder.iterdir())}"
    model.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())


def _engine(path: str, **kwargs):
    from conveyor import LLMEngine

    # Ten engines side by side: each a small cache, not the default share of the memory.
    kwargs.setdefault("kv_cache_memory", "512MiB")
    return LLMEngine(path, dtype="float32", skip_tokenizer_init=True, **kwargs)


def _step_times(args: argparse.Namespace, folder: Path) -> dict:
    """family -> {params, decode_ms, chunk_ms}: the best of args.rounds, families alternated."""
    models = {f: _checkpoint(folder, f, _shape(args)) for f in args.families}
    engines = {f: _engine(path, max_num_batched_tokens=4096) for f, (path, _) in models.items()}
    best: dict[str, dict] = {f: {"params": models[f][1]} for f in models}
    for _ in range(args.rounds):
        for family, engine in engines.items():
            decode, chunk = _time_steps(engine, args)
            for key, ms in (("decode_ms", decode), ("chunk_ms", chunk)):
                best[family][key] = min(best[family].get(key, ms), ms)
    return best


def _time_steps(engine, args: argparse.Namespace) -> tuple[float, float]:
    """ms of one decode step of args.batch rows (the second), and of one args.chunk-token
    prompt chunk."""
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(args.batch):  # prompts of args.context tokens, then timed decode steps
        engine.add_request(f"d{i}-{time.monotonic_ns()}", _tokens(args.context, i, args), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in _running(engine)):
        engine.step()
    # One decode step untimed: the first one after the prompts writes new blocks, whose pages
    # are faulted in on that first write (once in a server's life, allocator.zeroed); the
    # timed one is a steady step.
    engine.step()
    start = time.perf_counter()
    engine.step()
    decode = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(f"c-{time.monotonic_ns()}", _tokens(args.chunk, 99, args), params)
    start = time.perf_counter()
    engine.step()
    chunk = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return decode, chunk


def _running(engine):
    return list(engine.core.scheduler.requests.values())


def _tokens(n: int, seed: int, args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 7919 + time.monotonic_ns() % 1000)
    return torch.randint(3, args.vocab, (n,), generator=generator).tolist()


def _peak_bytes(engine, request_id: str) -> int:
    """Steps the engine until idle: the most KV bytes `request_id` held at once."""
    core, peak = engine.core, 0
    per_block = core.runner.kv_bytes_per_block()
    while engine.has_unfinished_requests():
        engine.step()
        tables = core.kv_cache.req_to_blocks.get(request_id, [])
        held = sum(b is not core.kv_cache.null_block for table in tables for b in table)
        peak = max(peak, held * per_block)
    return peak


def _kv_memory(args: argparse.Namespace, folder: Path) -> dict:
    """The most KV bytes one long request held: windowed against full attention (Mistral), KV
    groups against one table (Gemma 3)."""
    from conveyor import SamplingParams

    shape = _shape(args)
    params = SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True)
    tokens = _tokens(args.long_prompt, 1, args)
    runs = {
        "window": ("mistral (window)", {"sliding_window": args.window}, {}),
        "full": ("mistral (window)", {"sliding_window": None}, {}),
        "groups": ("gemma3", {"sliding_window": args.window}, {}),
        "one table": ("gemma3", {"sliding_window": args.window}, _ONE_TABLE),
        "gemma4 groups": ("gemma4", {"sliding_window": args.window}, {}),
        "gemma4 one table": ("gemma4", {"sliding_window": args.window}, _ONE_TABLE),
    }
    result, paths = {}, {}
    for name, (family, overrides, settings) in runs.items():
        key = (family, str(overrides))
        if key not in paths:
            paths[key] = _checkpoint(folder, family, shape, **overrides)[0]
        engine = _engine(
            paths[key], max_num_batched_tokens=512, enable_prefix_caching=False, **settings
        )
        engine.add_request("long", tokens, params)
        result[name] = _peak_bytes(engine, "long")
    result["window ratio"] = result["window"] / result["full"]
    result["groups ratio"] = result["groups"] / result["one table"]
    result["gemma4 ratio"] = result["gemma4 groups"] / result["gemma4 one table"]
    return result


_ONE_TABLE = {"disable_hybrid_kv_cache_manager": True}


def _hybrid_serving(args: argparse.Namespace, folder: Path) -> dict:
    """args.hybrid_requests long requests at once on the Gemma 3 in a cache of what the
    one-table layout needs for two: KV groups against one table, alternated; each the better
    of its rounds (wall seconds, output tok/s, preemptions, most running at once)."""
    from conveyor import SamplingParams

    path, _ = _checkpoint(folder, "gemma3", _shape(args), sliding_window=args.window)
    params = SamplingParams(temperature=0, max_tokens=args.hybrid_output, ignore_eos=True)
    length = args.hybrid_prompt + args.hybrid_output
    probe = _engine(path, **_ONE_TABLE)
    memory = (
        2 * -(-length // probe.cache_config.block_size) * probe.core.runner.kv_bytes_per_block()
    )
    del probe
    best: dict[str, dict] = {}
    for _ in range(args.kv_rounds):
        for name, settings in (("groups", {}), ("one table", _ONE_TABLE)):
            engine = _engine(
                path, max_num_batched_tokens=512, **{**settings, "kv_cache_memory": memory}
            )
            for i in range(args.hybrid_requests):
                engine.add_request(f"r{i}", _tokens(args.hybrid_prompt, 10 + i, args), params)
            start, running = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                engine.step()
                running = max(running, engine.get_stats().scheduler.num_running)
            seconds = time.perf_counter() - start
            row = {
                "seconds": seconds,
                "output_tok_s": args.hybrid_requests * args.hybrid_output / seconds,
                "preemptions": engine.get_stats().scheduler.num_preemptions_total,
                "most_running": running,
                "num_blocks": engine.num_blocks,
            }
            if name not in best or seconds < best[name]["seconds"]:
                best[name] = row
    best["cache_bytes"] = memory
    best["speedup"] = best["one table"]["seconds"] / best["groups"]["seconds"]
    return best


def _next_turn(args: argparse.Namespace, folder: Path) -> dict:
    """family -> {cached, uncached}: the mean time to first token of a chat's next turn (ms),
    each the better of args.kv_rounds alternated rounds; and the prefix hits' tokens."""

    report = {}
    for family in ("qwen3_5", "lfm2"):
        path, _ = _checkpoint(folder, family, _shape(args))
        engines = {
            "cached": _engine(path, max_num_batched_tokens=512),
            "uncached": _engine(path, max_num_batched_tokens=512, enable_prefix_caching=False),
        }
        best: dict[str, float] = {}
        for round_ in range(args.kv_rounds):
            for name, engine in engines.items():
                times = []
                for c in range(args.turns_conversations):
                    first = _tokens(args.turn_prompt, 100 * round_ + c, args)
                    answer = _generate(engine, first, args.turn_output)[1]
                    turn = first + answer + _tokens(args.turn_new, 999 + c, args)
                    times.append(_generate(engine, turn, 1)[0])
                mean = sum(times) / len(times)
                best[name] = min(best.get(name, mean), mean)
        hits = engines["cached"].get_stats().scheduler.prefix_cache_hits
        report[family] = best | {"speedup": best["uncached"] / best["cached"], "hits": hits}
    return report


def _generate(engine, tokens: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One request alone: ms to its first token, and its greedy tokens."""
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request_id = f"t{time.monotonic_ns()}"
    start, first, out = time.perf_counter(), None, []
    engine.add_request(request_id, tokens, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
            if output.finished:
                out = output.outputs[0].token_ids
    return (first - start) * 1e3, list(out)


def _print(report: dict, args: argparse.Namespace) -> None:
    steps = report["steps"]
    llama = steps.get("llama")
    print(f"shape: {report['shape']}")
    print(
        f"{'family':<18}{'params':>12}{'decode ms':>11}{'chunk ms':>10}{'per param vs llama':>21}"
    )
    for family, row in steps.items():
        ratios = ""
        if llama:
            per = [
                (row[k] / row["params"]) / (llama[k] / llama["params"])
                for k in ("decode_ms", "chunk_ms")
            ]
            ratios = f"{per[0]:.2f}x / {per[1]:.2f}x"
        print(
            f"{family:<18}{row['params']:>12,}{row['decode_ms']:>11.1f}{row['chunk_ms']:>10.1f}"
            f"{ratios:>21}"
        )
    kv = report["kv_memory"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(
        f"one request of {args.long_prompt} + {args.long_output} tokens, window {args.window}, "
        f"the most KV it held: Mistral (every layer slides) {mib(kv['window'])} against "
        f"{mib(kv['full'])} with full attention ({kv['window ratio']:.3f}x); Gemma 3 with KV "
        f"groups {mib(kv['groups'])} against {mib(kv['one table'])} in one table "
        f"({kv['groups ratio']:.3f}x); Gemma 4 (global pages twice the local ones) "
        f"{mib(kv['gemma4 groups'])} against {mib(kv['gemma4 one table'])} "
        f"({kv['gemma4 ratio']:.3f}x)"
    )
    serving = report["hybrid_serving"]
    print(
        f"{args.hybrid_requests} requests of {args.hybrid_prompt} + {args.hybrid_output} tokens "
        f"at once on the Gemma 3, in a cache of "
        f"{mib(serving['cache_bytes'])} (two requests' in one table):"
    )
    for name in ("groups", "one table"):
        row = serving[name]
        print(
            f"  {name:<10} {row['seconds']:7.1f} s  {row['output_tok_s']:7.1f} output tok/s  "
            f"{row['preemptions']:3d} preemptions  {row['most_running']} running at most  "
            f"({row['num_blocks']} blocks)"
        )
    print(f"  KV groups: {serving['speedup']:.2f}x the one table's speed")
    print(
        f"a chat's next turn ({args.turn_prompt} + {args.turn_output} + {args.turn_new} tokens), "
        "time to first token, prefix caching on / off:"
    )
    for family, row in report["next_turn"].items():
        print(
            f"  {family:<8} {row['cached']:8.1f} / {row['uncached']:8.1f} ms "
            f"({row['speedup']:.2f}x; {row['hits']} tokens hit)"
        )
