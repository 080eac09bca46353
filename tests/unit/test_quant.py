"""Quantized weights served quantized: kernels vs their PyTorch reference, GGUF blocks vs the
gguf package, tiny quantized GGUF files served quantized, refusals, and bench quality."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import gguf_util
import numpy as np
import pytest
import torch
from conftest import assert_matches_reference, hf_greedy, random_prompts
from gguf_util import write_gguf
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams
from conveyor.model import quant
from conveyor.model.config import ModelConfig
from conveyor.model.plan import CpuFeatures
from conveyor.model.quant import BlockWeight, QuantEmbedding, QuantLinear

pytestmark = pytest.mark.skipif(
    not quant.kernels_available(), reason="quantized CPU kernels unavailable here"
)

QUANTIZERS = {"q4": quant.quantize_q4, "q8": quant.quantize_q8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def random_blocks(fmt: str, num_rows: int, k: int, seed: int = 0) -> BlockWeight:
    gen = torch.Generator().manual_seed(seed)
    return QUANTIZERS[fmt](torch.randn(num_rows, k, generator=gen) * 0.05)


# ---- kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (130, 96), (960, 576), (33, 1536)])
def test_block_kernel_equals_reference_below_the_dequant_threshold(fmt, shape):
    weight = random_blocks(fmt, *shape)
    gen = torch.Generator().manual_seed(shape[0])
    for num_tokens in (1, 2, 3, 4, 5, 9, quant.DEQUANT_FROM_TOKENS - 1):
        x = torch.randn(num_tokens, shape[1], generator=gen) * 3
        out = quant.block_linear(x, weight)
        ref = quant.reference_linear(x, weight)
        # Same integer dot products; only float summation order differs.
        assert out.shape == (num_tokens, shape[0])
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_block_kernel_rows_taken_over_between_threads_are_each_computed_once(fmt):
    """The block kernel splits its rows through isa/balance.h as small_gemm does: with more threads
    than cores, shares change hands mid-call, and every row must still come out once and the
    same as on one thread."""
    weight = random_blocks(fmt, 2051, 64, seed=3)  # 128 pieces of 16 rows and a short one
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 64, generator=gen) for n in (1, 2, 5)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [quant.block_linear(x, weight) for x in xs]
        torch.set_num_threads(5)
        for _ in range(40):
            for x, want in zip(xs, expected, strict=True):
                assert torch.equal(quant.block_linear(x, weight), want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("num_tokens", [quant.DEQUANT_FROM_TOKENS, 70])
def test_float_tile_path_equals_dequantized_matmul(fmt, num_tokens):
    weight = random_blocks(fmt, 300, 128)
    x = torch.randn(num_tokens, 128)
    out = quant.block_linear(x, weight)
    torch.testing.assert_close(out, x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 7, 16, 17])
def test_float_activation_path_equals_dequantized_matmul(fmt, num_tokens):
    """The lm_head's route (dequant_from=1): up to 16 rows the block kernel with float
    activations, then the tiles; both the float product with the dequantized weight."""
    weight = random_blocks(fmt, 300, 160, seed=num_tokens)
    x = torch.randn(num_tokens, 160) * 3
    out = quant.block_linear(x, weight, dequant_from=1)
    ref = x.double() @ weight.dequantize().double().T
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5 * ref.abs().max())


def test_float_tile_path_runs_in_inference_mode_on_several_threads():
    """The runner's forward is in inference mode, which OpenMP workers do not inherit."""
    weight = random_blocks("q4", 512, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = torch.randn(40, 64)
            out = quant.block_linear(x, weight, dequant_from=1)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_compiled_dequantize_equals_reference(fmt):
    weight = random_blocks(fmt, 50, 160)
    assert torch.equal(quant.dequantize(weight), weight.dequantize())


@pytest.mark.parametrize("fmt, tolerance", [("q8", 0.02), ("q4", 0.15)])
def test_quantized_linear_is_close_to_the_float_linear(fmt, tolerance):
    """Weight plus activation rounding: relative error of the output below `tolerance`."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 512, generator=gen)
    bias = torch.randn(256, generator=gen)
    module = QuantLinear(QUANTIZERS[fmt](weight), [200, 56], bias)
    for num_tokens in (1, 8, 40):
        x = torch.randn(num_tokens, 512, generator=gen)
        out = module(x)
        ref = torch.nn.functional.linear(x, weight, bias)
        assert (out - ref).norm() / ref.norm() < tolerance


def test_quantized_linear_keeps_the_input_dtype_and_its_blocks_survive_to():
    module = QuantLinear(random_blocks("q4", 64, 64), [64])
    module.to(torch.bfloat16)  # the int16 scale bits must not be cast
    assert module.d.dtype == torch.int16 and module.qs.dtype == torch.uint8
    assert module(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_quantized_embedding_dequantizes_the_looked_up_rows():
    weight = random_blocks("q8", 40, 64)
    ids = torch.tensor([[3, 0], [39, 3]])
    out = QuantEmbedding(weight, torch.float32)(ids)
    torch.testing.assert_close(out, weight.dequantize()[ids])


# ---- GGUF blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_exactly_as_the_gguf_package(qtype):
    values = np.random.default_rng(0).normal(size=(24, 256)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    weight = quant.from_gguf_blocks(qtype, data, values.shape)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))


def test_gguf_types_without_a_kernel_are_requantized_to_int8_blocks():
    values = np.random.default_rng(0).normal(size=(8, 128)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_1)
    weight = quant.from_gguf_blocks("Q5_1", data, values.shape)
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q5_1))
    assert weight.format == "q8"
    assert (weight.dequantize() - expected).abs().max() <= expected.abs().max() / 127


def test_q4_k_super_blocks_repack_into_q4_blocks():
    """Random Q4_K bytes (gguf cannot quantize to Q4_K) with sane fp16 d and dmin."""
    rng = np.random.default_rng(0)
    num_rows, k = 6, 512
    blocks = rng.integers(0, 256, size=(num_rows * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(0.01 * rng.random(len(blocks))).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.float16(0.02 * rng.random(len(blocks))).view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(num_rows, -1)
    weight = quant.from_gguf_blocks("Q4_K", data, (num_rows, k))
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K))
    assert weight.format == "q4"
    # d * sc and dmin * m are rounded to fp16 (11 bits) in the q4 blocks.
    torch.testing.assert_close(weight.dequantize(), expected, rtol=2e-3, atol=2e-3)


# ---- tiny quantized GGUF models ------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_gguf(tiny_checkpoint, tmp_path_factory):
    """Factory: GGUF type -> a tiny llama GGUF (Q/K rows permuted by the writer) in it."""
    cache: dict[str, Path] = {}
    extra = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}

    def get(qtype: str) -> Path:
        if qtype not in cache:
            out = tmp_path_factory.mktemp(f"gguf-{qtype}") / f"tiny-{qtype}.gguf"
            with pytest.MonkeyPatch.context() as patch:  # the writer lists F32 and Q8_0 only
                patch.setitem(gguf_util.QTYPES, qtype, gguf.GGMLQuantizationType[qtype])
                if qtype in extra:
                    patch.setitem(gguf_util.FILE_TYPES, qtype, extra[qtype])
                cache[qtype] = write_gguf(tiny_checkpoint("llama"), out, qtype)
        return cache[qtype]

    return get


def test_quantized_gguf_loads_into_quantized_modules_only(quantized_gguf):
    llm = LLM(str(quantized_gguf("Q4_1")), dtype="float32", num_blocks=16)
    model = llm.engine.runner.model
    assert llm.engine.model_config.quantization == "gguf"
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert layer.self_attn.qkv_proj.format == "q4"
    assert layer.self_attn.qkv_proj.out_sizes == [128, 64, 64]
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    assert isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    # Only norms stay float parameters: no float copy of any projection was kept.
    assert all("norm" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_served_quantized_is_close_to_its_dequantized_model(qtype, quantized_gguf):
    from benchmarks.quality import evaluate

    report = evaluate(str(quantized_gguf(qtype)), _text(), 64, None, ["auto"], progress=False)
    dequantized, served = report["variants"]
    assert served["resolved"] == "gguf" and dequantized["resolved"] == "none"
    assert served["weight_mib"] < dequantized["weight_mib"] / 2.5
    # Only the activations' int8 rounding separates them; a broken kernel or row order gives
    # KL of order 1 (measured here: ~1e-3).
    assert served["mean_kl"] < 1e-2
    assert served["top1_agreement"] > 0.9


def test_quantized_gguf_generates_what_its_dequantized_model_generates(quantized_gguf):
    path = str(quantized_gguf("Q8_0"))
    prompts = random_prompts(4, 384, seed=3, max_len=12)
    served = LLM(path, dtype="float32", num_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    plain = LLM(path, dtype="float32", quantization="none", num_blocks=32)
    expected = plain.generate(prompts, GREEDY, use_tqdm=False)
    pairs = zip(served, expected, strict=True)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in pairs)
    assert same >= 3  # of 4: a near tie may flip one token under int8 activations


def test_plain_greedy_steps_take_the_lm_heads_argmax_and_generate_the_same(
    quantized_gguf, monkeypatch
):
    """Steps whose rows are all plain greedy ask the lm_head for argmax tokens
    (QuantLinear.argmax, kernels/gemm/panel_gemm.cpp: block_argmax) instead of every logit. Their
    tokens equal those of the same requests with logprobs, which need the logits; with n-gram
    speculation too, where each request's rows verify its drafts."""
    taken = []
    argmax = QuantLinear.argmax

    def counted(self, x):
        out = argmax(self, x)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(QuantLinear, "argmax", counted)
    path = str(quantized_gguf("Q8_0"))
    prompts = [p * 3 for p in random_prompts(6, 384, seed=5, max_len=12)]  # repeats to draft from
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
    for speculative_config in (None, ngram):
        llm = LLM(path, dtype="float32", num_blocks=96, speculative_config=speculative_config)
        fast = llm.generate(prompts, plain, use_tqdm=False)
        assert taken and all(taken), "a plain greedy step computed its logits"
        num_taken = len(taken)
        full = llm.generate(prompts, with_logprobs, use_tqdm=False)
        assert len(taken) == num_taken, "a step with logprobs asked for argmax tokens"
        assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
        taken.clear()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_compiled_layers_generate_what_the_modules_generate(qtype, quantized_gguf, monkeypatch):
    """Decode steps of a quantized model run its layers as one compiled call (block kernel
    projections, kernels/layer/decoder_layer.cpp); CONVEYOR_COMPILED_LAYERS=0 runs the modules. The
    prompt route (model/prompt_route.py: AMX tiles, or the attention alone in bfloat16) runs in
    the compiled layers only, so it is off for both here."""
    path = str(quantized_gguf(qtype))
    monkeypatch.setenv("CONVEYOR_PROMPT_TILES", "0")
    monkeypatch.setenv("CONVEYOR_PROMPT_ATTENTION", "0")
    prompts = random_prompts(4, 384, seed=4, max_len=12)
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=0) for _ in prompts]
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("CONVEYOR_COMPILED_LAYERS", flag)
        llm = LLM(path, dtype="float32", num_blocks=32, max_num_seqs=2)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        assert bool(llm.engine.runner.model._compiled) == (flag == "1")
    for compiled, modules in zip(*runs, strict=True):
        assert compiled.outputs[0].token_ids == modules.outputs[0].token_ids
        for a, b in zip(compiled.outputs[0].logprobs, modules.outputs[0].logprobs, strict=True):
            (token, lp_a), lp_b = next(iter(a.items())), next(iter(b.values()))
            assert abs(lp_a.logprob - lp_b.logprob) < 1e-4, token


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"CONVEYOR_PROMPT_TILES": "0"},
        {"CONVEYOR_PROMPT_ATTENTION": "0"},
        {"CONVEYOR_ISA": "avx2"},
    ],
    ids=["default", "no-tiles", "no-attention", "avx2"],
)
def test_the_prompt_route_follows_the_cpu_and_its_switches(switches, quantized_gguf, monkeypatch):
    """model/prompt_route.py: the AMX tiles where the CPU has AMX-BF16, else the attention alone
    in bfloat16 where it has AVX512-BF16, else none; each switch turns its part off, and
    CONVEYOR_ISA=avx2 both. The route is set at load and decides the prefix cache's keys."""
    from conveyor.model import kernels

    ops = kernels.load()
    cpu = CpuFeatures.detect(ops)  # what the CPU runs; the plan narrows it (model/plan.py)
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    wide = switches.get("CONVEYOR_ISA") != "avx2"
    amx = cpu.amx and wide and "CONVEYOR_PROMPT_TILES" not in switches
    bf16 = cpu.amx or cpu.avx512_bf16
    attention = bf16 and wide and "CONVEYOR_PROMPT_ATTENTION" not in switches
    want = "tiles" if amx else "attention" if attention else ""
    llm = LLM(str(quantized_gguf("Q4_1")), dtype="float32", num_blocks=32, max_num_seqs=2)
    model = llm.engine.runner.model
    tiles = any(getattr(m, "prompt_tiles", None) is not None for m in model.modules())
    got = "tiles" if tiles else "attention" if model.prompt_route else ""
    assert got == want, (switches, ops.prompt_attention_isa())
    assert llm.engine.kv_cache.salt_generated == bool(want)
    (out,) = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 4


def test_quantization_none_of_a_q4_1_gguf_matches_transformers(quantized_gguf, tiny_checkpoint):
    path = quantized_gguf("Q4_1")
    config = gguf_util.transformers_config(path, tiny_checkpoint("llama"))  # its llama3 RoPE too
    ref_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float64
    )
    prompts = random_prompts(4, ref_model.config.vocab_size, seed=5, max_len=20)
    reference = hf_greedy(ref_model, prompts, 6)
    for kwargs in (dict(quantization="none"), dict()):  # float64: auto dequantizes too
        llm = LLM(str(path), dtype="float64", num_blocks=64, **kwargs)
        assert llm.engine.model_config.quantization == "none"
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_matches_reference(outputs, [(t[:6], lp[:6]) for t, lp in reference])


def test_int8_quantizes_a_float_checkpoint(tiny_checkpoint):
    from benchmarks.quality import evaluate

    report = evaluate(str(tiny_checkpoint("qwen2")), _text(), 64, 2, ["int8", "auto"], False)
    by_mode = {v["quantization"]: v for v in report["variants"]}
    assert by_mode["auto"]["resolved"] == "none"  # a float checkpoint runs float
    assert by_mode["auto"]["mean_kl"] == 0.0
    assert by_mode["int8"]["resolved"] == "int8"
    # Weights and activations rounded to int8 blocks (measured here: KL ~2.5e-3, top-1 92%).
    assert by_mode["int8"]["mean_kl"] < 1e-2 and by_mode["int8"]["top1_agreement"] > 0.85
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", quantization="int8", num_blocks=8)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.format == "q8" and qkv.bias is not None


# Checkpoints whose projections are stored fused (Phi-3's qkv_proj and gate_up_proj, Granite
# 4.0's shared_mlp.input_linear, beside experts in the -H one) or as one matrix where a delta
# net's has four parts (LFM2's and Mamba2's in_proj).
FUSED_OR_SINGLE = {
    "phi3": "model.layers.0.mlp.gate_up_proj",
    "granitemoehybrid": "model.layers.0.shared_mlp.input_linear",
    "lfm2": "model.layers.0.conv.in_proj",
    "granite4-h": "model.layers.0.mamba.in_proj",
    # latent attention: q_a_proj and kv_a_proj_with_mqa in one qkv_proj, q_b_proj its own
    "glm4_moe_lite": "model.layers.0.self_attn.q_b_proj",
}


@pytest.mark.parametrize("family", list(FUSED_OR_SINGLE))
def test_int8_quantizes_every_projection_of_fused_and_recurrent_families(family, tmp_path):
    """Every projection in int8 blocks, each block within half a step of the checkpoint's
    rows (these refused to load: 'checkpoint has a tensor this model does not use')."""
    from safetensors.torch import load_file
    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / family, family)
    llm = LLM(str(path), dtype="float32", quantization="int8", num_blocks=16)
    model = llm.engine.runner.model
    leaves = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj", "out_proj", "q_b_proj")
    projections = {n: m for n, m in model.named_modules() if n.endswith(leaves)}
    whole_blocks = [m for m in projections.values() if _in_features(m) % 32 == 0]
    assert whole_blocks and {type(m).__name__ for m in whole_blocks} == {"QuantLinear"}
    stored = FUSED_OR_SINGLE[family]
    want = load_file(path / "model.safetensors")[f"{stored}.weight"].float()
    got = projections[stored.replace("shared_mlp.input_linear", "mlp.gate_up_proj")]
    blocks = want.reshape(want.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127  # each block's int8 step
    error = (got.weight_blocks.dequantize().reshape(blocks.shape) - blocks).abs()
    assert (error <= step * 0.5 + 1e-3 * step + 1e-6).all()
    outputs = llm.generate(random_prompts(2, 384, seed=4, max_len=20), GREEDY, use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [GREEDY.max_tokens] * 2


def _in_features(module) -> int:
    return module.in_features if isinstance(module, QuantLinear) else module.weight.shape[1]


def test_tied_lm_head_shares_the_embedding_blocks(tmp_path):
    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model = LLM(str(path), dtype="float32", quantization="int8", num_blocks=8).engine.runner.model
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.lm_head.qs.data_ptr() == model.model.embed_tokens.qs.data_ptr()


# ---- refusals ------------------------------------------------------------------------------


def test_int8_refuses_float64(tiny_checkpoint):
    with pytest.raises(ValueError, match="int8.*float64"):
        ModelConfig.from_hf(str(tiny_checkpoint("llama")), "float64", "cpu", None, "int8")


def test_int8_refuses_a_device_without_the_kernels(tiny_checkpoint):
    with pytest.raises(ValueError, match="int8.*cuda"):
        ModelConfig.from_hf(str(tiny_checkpoint("llama")), "float32", "cuda", None, "int8")


def test_unknown_quantization_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig.from_hf(str(tiny_checkpoint("llama")), "float32", "cpu", None, "int4")


def test_auto_on_cuda_dequantizes_with_one_log_line(quantized_gguf, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = ModelConfig.from_hf(str(quantized_gguf("Q8_0")), "float32", "cuda", None, "auto")
    assert cfg.quantization == "none"
    assert sum("dequantizing" in r.getMessage() for r in caplog.records) == 1


# ---- bench quality -------------------------------------------------------------------------


def test_bench_quality_command_writes_json(quantized_gguf, tmp_path, capsys):
    import json

    from benchmarks.cli import main

    out = tmp_path / "quality.json"
    argv = ["quality", str(quantized_gguf("Q4_0")), "--context", "32", "--max-chunks"]
    argv += ["2", "--output", str(out), "--disable-tqdm", "--variants", "bfloat16,int8,auto"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["num_chunks"] == 2 and report["num_scored_tokens"] == 2 * 15
    variants = ["float32", "bfloat16", "int8", "auto"]  # every variant: test_bench_quality.py
    assert [v["variant"] for v in report["variants"]] == variants
    assert all(v["perplexity"] > 1 for v in report["variants"])
    assert "mean KL" in capsys.readouterr().out


def _text() -> Path:
    from benchmarks.quality import DEFAULT_TEXT

    return DEFAULT_TEXT


# ---- fbgemm int8 route ---------------------------------------------------------------------

needs_int8 = pytest.mark.skipif(
    not (quant.int8_gemm_available() and quant.has_vnni()),
    reason="no x86 quantized engine, or no VNNI (fbgemm's 8-bit activations saturate there)",
)


@needs_int8
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", [(7, 64), (130, 96), (960, 576), (33, 1536)])
def test_int8_route_equals_the_float_reference(fmt, shape):
    weight = random_blocks(fmt, *shape)
    x = torch.randn(24, shape[1])
    x[:, 5] *= 30  # an outlier channel: it must take the float columns, not spoil the rounding
    out = quant.int8_linear(x, quant.pack_int8(weight), weight, quant.OUTLIER_RATIO)
    ref = x.double() @ weight.dequantize().double().T
    # int8 weights per channel and 8-bit activations per token: ~1% of the largest output.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1.5e-2 * ref.abs().max())


@needs_int8
def test_int8_route_takes_outlier_columns_from_the_blocks_exactly():
    weight = random_blocks("q4", 40, 128)
    cols = torch.tensor([0, 15, 16, 31, 32, 127])
    assert torch.equal(quant.weight_columns(weight, cols), weight.dequantize()[:, cols])


@needs_int8
def test_quantized_linear_switches_to_int8_from_the_threshold():
    weight = random_blocks("q4", 64, 96)
    module = QuantLinear(weight, [64])
    module.pack_int8()
    for num_tokens in (1, quant.INT8_FROM_TOKENS - 1, quant.INT8_FROM_TOKENS, 40):
        x = torch.randn(num_tokens, 96)
        out = module(x)
        if num_tokens >= quant.INT8_FROM_TOKENS:
            expected = quant.int8_linear(x, module.int8_weight, weight, module.outlier_ratio)
        else:
            expected = quant.block_linear(x, weight)
        assert torch.equal(out, expected), num_tokens
