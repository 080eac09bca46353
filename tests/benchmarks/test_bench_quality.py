"""`python -m benchmarks quality`: its half-precision and quantized variants scored against
float32 on tiny checkpoints, and the command's JSON and flag checks."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.cli import main
from benchmarks.quality import DEFAULT_TEXT, _runner, evaluate, format_table
from conveyor.model import quant


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


needs_kernels = pytest.mark.skipif(
    not quant.kernels_available(), reason="quantized CPU kernels unavailable here"
)


def test_bench_quality_scores_bfloat16_and_float16_against_float32(model_path):
    report = evaluate(str(model_path), DEFAULT_TEXT, 64, 2, ["bfloat16", "float16"], False)
    reference, bf16, fp16 = report["variants"]
    assert reference["variant"] == "float32" and reference["mean_kl"] == 0.0
    assert [(v["dtype"], v["resolved"]) for v in (bf16, fp16)] == [
        ("bfloat16", "none"),
        ("float16", "none"),
    ]
    assert (
        bf16["weight_mib"] == fp16["weight_mib"] == pytest.approx(reference["weight_mib"] / 2, 0.02)
    )
    # A cast that never happened scores 0; a broken one KL of order 1 (measured: bf16 ~5e-4,
    # fp16 ~1e-5, fp16's 10 mantissa bits against bf16's 7).
    assert 0 < fp16["mean_kl"] < bf16["mean_kl"] < 1e-2
    assert bf16["top1_agreement"] > 0.9 and fp16["top1_agreement"] > 0.95
    assert "bfloat16" in format_table(report) and "->" not in format_table(report)


@needs_kernels
def test_bench_quality_scores_the_batch_invariant_kernels_that_serving_runs(tmp_path, model_path):
    from gguf_util import write_gguf

    from conveyor.config import CacheConfig
    from conveyor.model.config import ModelConfig

    gguf_path = write_gguf(model_path, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    cfg = ModelConfig.from_hf(str(gguf_path), "float32", "cpu", None, "auto")
    runner = _runner(cfg, 64)
    assert runner.kv_dtype == torch.float16  # a model served quantized: a float16 cache
    assert CacheConfig(kv_cache_dtype="float32").kv_cache_dtype == "float32"  # the old one
    assert _runner(cfg, 64, "float32").kv_dtype == torch.float32
    float_model = ModelConfig.from_hf(str(model_path), "float32", "cpu", None, "auto")
    assert _runner(float_model, 64).kv_dtype == torch.float32  # its own dtype: exact
    model = runner.model
    blocks = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    assert blocks and all(m.panels is not None for m in blocks)
    assert [m.float_acts for m in blocks].count(True) == 1  # the lm_head only
    report = evaluate(str(gguf_path), DEFAULT_TEXT, 64, 2, ["auto", "auto+generated"], False)
    served, generated = report["variants"][1:]
    assert (served["variant"], served["resolved"]) == ("auto", "gguf")
    # int8 activations per block of 32 (measured here ~1e-3); 0 would mean float weights ran.
    assert 0 < generated["mean_kl"] < 1e-2 and generated["top1_agreement"] > 0.9
    assert 0 < served["mean_kl"] < 1e-2 and served["top1_agreement"] > 0.9
    # The chunk scored as a prompt: on a CPU with AMX-BF16 the bfloat16 tiles (closer to
    # float32 than int8 activations); with AVX512-BF16 alone the blocks with the attention in
    # bfloat16 (another rounding, as small); elsewhere the blocks, as a generated token's.
    tiles = any(getattr(m, "prompt_tiles", None) is not None for m in model.modules())
    route = "tiles" if tiles else "attention" if model.prompt_route else "none"
    assert (served["prompt_route"], generated["prompt_route"]) == (route, "none")
    if tiles:
        assert served["mean_kl"] < generated["mean_kl"]
    elif model.prompt_route:
        assert served["mean_kl"] != generated["mean_kl"]
        assert served["mean_kl"] < 2 * generated["mean_kl"]
    else:
        assert served["mean_kl"] == generated["mean_kl"]


@needs_kernels
def test_bench_quality_command_reports_bf16_and_every_quantized_route(model_path, tmp_path, capsys):
    out = tmp_path / "quality.json"
    argv = ["quality", str(model_path), "--context", "32", "--max-chunks", "1"]
    assert main([*argv, "--output", str(out), "--disable-tqdm"]) == 0
    report = json.loads(out.read_text())
    names = [v["variant"] for v in report["variants"]]
    assert names == [
        "float32", "bfloat16", "float16", "int8", "auto", "auto+kv-float32", "kv-float16",
        "auto+generated",
    ]  # fmt: skip
    caches = {v["variant"]: v["kv_cache_dtype"] for v in report["variants"]}
    assert caches["kv-float16"] == "float16" and caches["auto+kv-float32"] == "float32"
    cache_alone = report["variants"][-2]  # float32 weights, float16 cache: small, not zero
    assert 0 < cache_alone["mean_kl"] < 1e-3 and cache_alone["top1_agreement"] > 0.95
    assert main([*argv, "--variants", "bfloat16,fp8"]) != 0
    assert "--variants: unknown 'fp8'" in capsys.readouterr().err
