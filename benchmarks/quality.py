"""`python -m benchmarks quality`: what serving weights quantized, or in half precision, costs in
model quality.

The measure of llama.cpp's `llama-perplexity --kl-divergence`: the text is cut into chunks of
`--context` tokens, each chunk is run in one forward pass, and the second half of each chunk is
scored (so every scored token sees at least context/2 tokens). For every scored position the
next-token distribution of each variant is compared with the float32 model's (quantization
"none": the checkpoint's own weights, for a GGUF its dequantized blocks):

    mean / p99 / max KL(float32 || variant), top-1 agreement (same argmax), and perplexity.

Variants: `bfloat16` and `float16` (the float32 model's weights cast, as `--dtype` serves them:
ATen's ops, logits cast to float64 for scoring), `int8` (projections requantized to int8
blocks) and `auto` (a quantized GGUF's own blocks with the default cache, float16 on the CPU;
a float checkpoint runs float32 there); `auto+kv-float32` the blocks with a float32 cache, and
`kv-float16` the float32 model with a float16 cache (what the cache alone costs).
A chunk is scored as a prompt, so `auto` runs the prompt route where the CPU has one (column
`route`, model/prompt_route.py: `tiles`, the projections' and the attention's bfloat16 on AMX;
`attention`, the attention alone in bfloat16 on AVX512-BF16); `auto+generated` scores the same
model with every token counted as generated: the route of decode rows (the blocks and float32
attention), which is all `auto` runs elsewhere.
Every model is loaded as `conveyor serve` loads it by default, so the float32 and quantized
scores are those of the batch-invariant kernels (model/kernels/gemm/panel_gemm.cpp): every row count
of a block projection runs one kernel with activations rounded to int8 per block of 32, and the
lm_head (the tied Q8_0 embedding of the default model) one with float activations; a prefill
chunk and a decode step compute each row alike. `--no-batch-invariant`'s routes are not scored
(their decode rows round activations the same way, in another summation order). The default text is
a few KB of public-domain prose shipped in benchmarks/data/.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

GENERATED = {"auto+generated"}  # variants whose tokens count as generated, not prompt
DEFAULT_TEXT = Path(__file__).parent / "data" / "public_domain.txt"
REFERENCE = "float32"
# variant -> (dtype, quantization) as ModelConfig.from_hf takes them, and the KV cache's dtype
# (ModelRunner's kv_cache_dtype: "auto" is the model's).
VARIANTS = {
    "bfloat16": ("bfloat16", "none", "auto"),
    "float16": ("float16", "none", "auto"),
    "int8": ("float32", "int8", "auto"),
    "auto": ("float32", "auto", "auto"),  # a quantized model's cache: float16 on the CPU
    "auto+kv-float32": ("float32", "auto", "float32"),
    "kv-float16": ("float32", "none", "float16"),
    "auto+generated": ("float32", "auto", "auto"),
}


@dataclass
class VariantStats:
    variant: str  # REFERENCE or a VARIANTS key
    dtype: str
    quantization: str  # as requested
    resolved: str  # ModelConfig.quantization: none | gguf | int8
    weight_bytes: int
    kv_cache_dtype: str  # "auto": the model's dtype
    tile_bytes: int = 0  # the prompt route's bfloat16 tiles (model/prompt_route.py), if any
    route: str = "none"  # what the scored rows ran: tiles | attention | none (prompt_route.py)
    kl: list[float] = field(default_factory=list, repr=False)
    top1_same: int = 0
    nll_sum: float = 0.0

    def summary(self, num_scored: int) -> dict:
        kl = torch.tensor(self.kl, dtype=torch.float64)
        return dict(
            variant=self.variant,
            dtype=self.dtype,
            quantization=self.quantization,
            resolved=self.resolved,
            weight_mib=round(self.weight_bytes / 2**20, 1),
            prompt_tiles_mib=round(self.tile_bytes / 2**20, 1),
            prompt_route=self.route,
            kv_cache_dtype=self.kv_cache_dtype,
            mean_kl=kl.mean().item() if len(kl) else 0.0,
            p99_kl=kl.quantile(0.99).item() if len(kl) else 0.0,
            max_kl=kl.max().item() if len(kl) else 0.0,
            top1_agreement=self.top1_same / max(num_scored, 1),
            perplexity=math.exp(self.nll_sum / max(num_scored, 1)),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file to score")
    parser.add_argument("--context", type=int, default=512, help="tokens per forward pass")
    parser.add_argument("--max-chunks", type=int, default=None, help="score at most N chunks")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated variants compared with float32 ({', '.join(VARIANTS)})",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    report = evaluate(
        args.model,
        Path(args.text),
        args.context,
        args.max_chunks,
        _variants(args.variants),
        not args.disable_tqdm,
    )
    print(format_table(report))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def evaluate(
    model: str | None,
    text: Path,
    context: int,
    max_chunks: int | None,
    variants: list[str],
    progress: bool = True,
) -> dict:
    """Runs float32 and each variant over the chunks; returns the JSON-ready report."""
    from conveyor.model.config import ModelConfig, load_tokenizer

    specs = {REFERENCE: ("float32", "none", "auto")} | {name: VARIANTS[name] for name in variants}
    runners = {
        name: _runner(ModelConfig.from_hf(model, dtype, "cpu", None, mode), context, kv)
        for name, (dtype, mode, kv) in specs.items()
    }
    base = runners[REFERENCE]
    chunks = _chunks(load_tokenizer(base.cfg), text, context, max_chunks)
    stats = {name: _stats(name, runner) for name, runner in runners.items()}
    num_scored = 0
    for chunk in tqdm(chunks, desc="bench quality", unit="chunk", disable=not progress):
        targets = torch.tensor(chunk[len(chunk) // 2 + 1 :])  # next tokens of scored rows
        reference = _logprobs(base, chunk)
        for name, runner in runners.items():
            prompt = name not in GENERATED
            logprobs = reference if name == REFERENCE else _logprobs(runner, chunk, prompt)
            _score(stats[name], reference, logprobs, targets)
        num_scored += len(targets)
    return dict(
        model=str(base.cfg.path),
        text=str(text),
        context=context,
        num_chunks=len(chunks),
        num_scored_tokens=num_scored,
        variants=[s.summary(num_scored) for s in stats.values()],
    )


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"--variants: unknown {name!r}; use {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def _runner(cfg, context: int, kv_cache_dtype: str = "auto"):
    """The model as `conveyor serve` loads it (batch-invariant panels packed at load on CPU)."""
    from conveyor.worker.model_runner import ModelRunner

    if context > cfg.max_model_len:
        raise ValueError(f"--context {context} exceeds the model's {cfg.max_model_len} tokens")
    runner = ModelRunner(cfg, torch.device("cpu"), block_size=16, seed=0,
                         kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    runner.allocate_kv_cache(-(-context // 16) * len(runner.kv_groups.layers))
    return runner


def _stats(name: str, runner) -> VariantStats:
    # state_dict: weights and quantized blocks, not derived buffers (rotary tables); a tied
    # head appears twice there, under one storage. The prompt route's tiles apart.
    tensors = {t.data_ptr(): t for t in runner.model.state_dict().values()}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tiles = [getattr(m, "prompt_tiles", None) for m in runner.model.modules()]
    tile_bytes = sum(t.numel() * t.element_size() for t in tiles if t is not None)
    dtype, mode, kv = VARIANTS.get(name, ("float32", "none", "auto"))
    from conveyor.model.prompt_route import route_of

    route = "none" if name in GENERATED else route_of(runner.model)
    stats = VariantStats(name, dtype, mode, runner.cfg.quantization, weight_bytes, kv, tile_bytes)
    stats.route = route
    return stats


def _chunks(tokenizer, text: Path, context: int, max_chunks: int | None) -> list[list[int]]:
    if context < 4:
        raise ValueError(f"--context must be >= 4, got {context}")
    ids = tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    chunks = [ids[i : i + context] for i in range(0, len(ids) - context + 1, context)]
    if not chunks:
        raise ValueError(f"{text} has {len(ids)} tokens, fewer than --context {context}")
    return chunks[:max_chunks] if max_chunks else chunks


@torch.inference_mode()
def _logprobs(runner, chunk: list[int], prompt: bool = True) -> torch.Tensor:
    """float64 log-probabilities of the next token at the scored positions (second half);
    prompt: the chunk's tokens count as a prompt's, else as generated ones."""
    from conveyor.outputs import ScheduledRequest

    n = -(-len(chunk) // runner.block_size)  # blocks of each KV group's own (model/kv_groups.py)
    blocks = [list(range(g * n, (g + 1) * n)) for g in range(len(runner.kv_groups.layers))]
    num_prompt = len(chunk) if prompt else 0
    request = ScheduledRequest("quality", chunk, 0, blocks, None, num_prompt_tokens=num_prompt)
    input_ids, positions, meta, _ = runner.tensors(runner.step_inputs([request]))
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    scored = hidden[len(chunk) // 2 : len(chunk) - 1]
    return torch.log_softmax(runner.model.compute_logits(scored).double(), dim=-1)


def _score(stats: VariantStats, reference, logprobs, targets) -> None:
    kl = (reference.exp() * (reference - logprobs)).sum(-1)
    stats.kl.extend(kl.clamp_min(0).tolist())
    stats.top1_same += int((reference.argmax(-1) == logprobs.argmax(-1)).sum())
    stats.nll_sum -= float(logprobs.gather(-1, targets[:, None]).sum())


def format_table(report: dict) -> str:
    lines = [
        f"{report['model']}: {report['num_scored_tokens']} tokens scored in "
        f"{report['num_chunks']} chunks of {report['context']}",
        f"{'variant':<22}{'route':>10}{'weights MiB':>12}{'tiles MiB':>10}{'mean KL':>10}"
        f"{'p99 KL':>10}{'max KL':>10}{'top-1 %':>9}{'ppl':>9}",
    ]
    for v in report["variants"]:
        name = v["variant"]
        if v["quantization"] not in ("none", v["resolved"]):
            name += f"->{v['resolved']}"  # auto->gguf, auto->none
        lines.append(
            f"{name:<22}{v['prompt_route']:>10}{v['weight_mib']:>12.1f}{v['prompt_tiles_mib']:>10.1f}{v['mean_kl']:>10.5f}{v['p99_kl']:>10.5f}"
            f"{v['max_kl']:>10.5f}{100 * v['top1_agreement']:>9.2f}{v['perplexity']:>9.3f}"
        )
    return "\n".join(lines)
