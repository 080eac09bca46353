"""GGUF files of the families beyond Llama's four, written as llama.cpp writes them (its
architecture names, metadata keys and tensor names): an F32 or F16 file holds the same model as
the checkpoint it was converted from (same weights by name, same config, same greedy tokens in
float64), and a Q8_0 file is served quantized. What llama.cpp fixes in code rather than stores
is taken as llama.cpp takes it, on real models' sizes."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from conftest import DEVICE_KWARGS, random_prompts
from gguf_util import snap_to_float_gguf, write_bare_gguf, write_gguf
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.config import ModelConfig
from conveyor.model.gguf_config import hf_config_dict
from conveyor.model.gguf_loader import gguf_architecture, gguf_tensor_types, iter_gguf_weights
from conveyor.model.loader import (
    _ERNIE_MOE_NAMES,
    _GEMMA4_MOE_NAMES,
    _GLM4_MOE_NAMES,
    _GRANITE_HYBRID_MOE_NAMES,
    _GRANITE_HYBRID_NAMES,
    _GRANITE_MOE_NAMES,
    _LFM2_EXPERT_NAMES,
    _LFM2_NAMES,
    _UNGATED_MLP_NAMES,
    _flat_expert_bias,
    _gpt_oss_experts,
    _grouped_projections,
    _latent_heads,
    _nemotron_h_blocks,
    _stacked_experts,
)
from conveyor.model.quant import from_gguf_blocks

# The tiny checkpoint of each family (tests/tiny.py FAMILIES), with what llama.cpp's format does
# not store set to the value llama.cpp fixes in its code: Gemma's query scale is head_dim's,
# Gemma 2's head is its embeddings;
# Gemma 3 slides on all layers but every sixth, its local RoPE base is 10000 (the global one
# differs, so that each table counts); SmolLM3 drops RoPE on every fourth layer.
GGUF_FAMILIES = {
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(query_pre_attn_scalar=16, tie_word_embeddings=True),
    "gemma3": dict(num_hidden_layers=6, layer_types=None, rope_theta=1e6, rope_local_base_freq=1e4),
    "phi3": {},
    "phi3-partial": {},  # rope.dimension_count half of head_dim
    "phi4-mini": {},  # longrope (rope_factors_long / _short) on three quarters of each head
    "glm4": {},  # interleaved rotary on half of each head, q/k/v biases, fused ffn_up
    "olmo2": {},
    "granite": {},
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=None),
    # Mixtures of experts: llama.cpp makes every layer one (3-D ffn_*_exps tensors)
    "mixtral": {},
    "qwen2_moe": dict(mlp_only_layers=[]),
    "qwen3_moe": dict(decoder_sparse_step=1),
    "gpt_oss": dict(swiglu_limit=7.0),
    "lfm2": {},  # short convolutions (shortconv.*), KV heads per layer, the MLP's width adjusted
    # LFM2's layers, a dense MLP on layer 0 then 4 experts chosen by sigmoid scores plus a bias
    # (exp_probs_b); llama.cpp scales the renormalised weights by nothing, its head is tied
    "lfm2_moe": dict(routed_scaling_factor=1.0, tie_word_embeddings=True),
    # gated delta nets (ssm_*): value heads tiled (2 per key head), A_log as -exp(A_log), (1 + w)
    # norms stored as 1 + w, the attention's q_proj holding each head's gate rows
    "qwen3_5": {},
    "qwen3_5_moe": {},  # and a mixture of 4 experts with a shared one on every layer
    # Qwen3.5-MoE's layers, in_proj_qkvz split into attn_qkv / attn_gate, in_proj_ba kept
    # (ssm_ba), the value heads in transformers' order; llama.cpp makes every layer a mixture
    "qwen3_next": dict(decoder_sparse_step=1),
    "ernie4_5": {},  # interleaved rotary pairs, stored unpermuted
    "exaone4": {},  # output norms, q/k norms, a sliding layer (RoPE) then a global one (none)
    # OLMo 2's layer as llama.cpp's olmo2: a sliding layer (plain RoPE), a full one (yarn)
    "olmo3": {},
    "seed_oss": {},  # q/k/v and o_proj biases; its pre-MLP norm is llama.cpp's attn post norm
    "olmoe": dict(rms_norm_eps=1e-5, tie_word_embeddings=False),  # 6 experts, not renormalised
    "granitemoe": {},  # Granite's multipliers and permuted Q/K; input_linear split into gate, up
    # Granite 4.0 without Mamba2 layers, which llama.cpp writes as granite (its MLP's width the
    # feed_forward_length: the released configs' intermediate_size is the shared MLP's)
    "granitemoehybrid": dict(intermediate_size=48),
    "ministral3": {},  # yarn (one log multiplier), the query scale's beta, permuted Q/K
    # Granite 4.0-H as llama.cpp's granitehybrid: Mamba2 layers (ssm_*: A_log as -exp(A_log),
    # A, D and the gated norm reshaped, the convolution squeezed), attention without RoPE, its
    # experts and the shared MLP as the shared expert; an "arbitrary" 2^20 context
    "granite4-h": {},
    # Nemotron-H as llama.cpp's nemotron_h: its blocks as layers (per-block head_count_kv and
    # feed_forward_length), Mamba2 as Granite 4.0-H's, permuted Q/K without RoPE; Nemotron 3's
    # mixtures as nemotron_h_moe, which states its groups but not how many are chosen (all)
    "nemotron_h": {},
    # ERNIE 4.5 MoE: a dense layer, then mixtures with a shared expert and a choosing bias
    "ernie4_5_moe": {},
    # GLM-4.5: a dense layer, then mixtures routed by sigmoid scores with a bias (one group)
    "glm4_moe": dict(n_group=1, topk_group=1),
    "arcee": {},  # llama.cpp's ArceeModel: a LlamaModel (permuted Q/K, yarn keys), ffn_up alone
    "nemotron_h-moe": dict(topk_group=4),
    # DeepSeek-V2 (softmax router, yarn) and V3 (q_lora_rank, grouped sigmoid router) as
    # llama.cpp's deepseek2: one KV head of the latent and rope key, kv_b_proj split per head
    "deepseek_v2": {},
    "deepseek_v3": {},
    # Gemma 4 as llama.cpp's gemma4: per-kind head sizes (key_length, key_length_swa) and KV
    # heads, the full layers' proportional RoPE as rope_freqs (1e30 on unturned pairs), norms
    # stored as w (not 1 + w), two layers reading earlier caches (shared_kv_layers) with
    # double-wide MLPs (feed_forward_length per layer), per-layer inputs, layer_output_scale
    "gemma4": {},
    # and its experts beside the MLP: ffn_gate_up_exps (each expert's gate, then up rows), the
    # router's ffn_gate_inp.scale and ffn_down_exps.scale; the keys as values without attn_v;
    # a final soft-cap, which llama.cpp applies at 30 where a file states none
    "gemma4-moe": dict(final_logit_softcapping=30.0),
    # Gemma 3n as llama.cpp's gemma3n: AltUp's projections stacked (altup_proj,
    # altup_unembd_proj; four streams, as its converter asserts), correct_output_scale as
    # .weight, Laurel, per-layer inputs (their table padded with zero rows to the vocabulary:
    # the prompts' tokens past its 300 read row 0, as transformers'), the gates' sparsity as
    # float32 normal quantiles, norms stored as w, two layers reading earlier caches; its
    # sliding RoPE base is llama.cpp's 10000
    "gemma3n": dict(
        altup_num_inputs=4,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="default", rope_theta=100000.0),
        ),
    ),  # fmt: skip
}
LLAMA_CPP_NAMES = {"gemma3": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe"}
LLAMA_CPP_NAMES |= {"phi3-partial": "phi3", "phi4-mini": "phi3"}
LLAMA_CPP_NAMES |= {
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_moe": "qwen3moe",
    "lfm2_moe": "lfm2moe",
    "qwen3_next": "qwen3next",
    "olmo3": "olmo2",
    "granitemoehybrid": "granite",
    "granite4-h": "granitehybrid",
    "ernie4_5_moe": "ernie4_5-moe",
    "glm4_moe": "glm4moe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "nemotron_h-moe": "nemotron_h_moe",
    "ministral3": "mistral3",
    "gpt_oss": "gpt-oss",
    "gemma4-moe": "gemma4",
}  # HF gemma3_text is llama.cpp's gemma3, ...
# Mixtral's checkpoint names of its MoE modules, and the names every loader gives them.
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."))
MIXTRAL_NAMES += ((".w3.", ".up_proj."), (".w2.", ".down_proj."))
# Phi-3's checkpoint tensors that a GGUF loader splits into the HF tensors they fuse.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MAX_TOKENS = 8
# The config's floats pass through float32 metadata (rms_norm_eps, Granite's multipliers).
LOGPROB_TOLERANCE = 1e-5


class Converted(NamedTuple):
    family: str
    hf_dir: Path
    f32: Path
    f16: Path
    q8_0: Path


pytestmark = pytest.mark.usefixtures("quiet_transformers")
MXFP4 = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def converted(request, tmp_path_factory) -> Converted:
    family = request.param
    hf_dir = tmp_path_factory.mktemp(f"hf-{family}")
    make_tiny_checkpoint(hf_dir, family, **GGUF_FAMILIES[family])
    if family.startswith("gemma4"):
        scale_gemma4_scalars(hf_dir)
    snap_to_float_gguf(hf_dir)
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    files = [write_gguf(hf_dir, out / f"tiny-{family}-{q}.gguf", q) for q in ("F32", "F16", "Q8_0")]
    return Converted(family, hf_dir, *files)


def scale_gemma4_scalars(hf_dir: Path) -> None:
    """Gemma 4's layer scalars and router scales away from their initial 1: each one counts."""
    shard = hf_dir / "model.safetensors"
    state = load_file(shard)
    generator = torch.Generator().manual_seed(2)
    for name, tensor in state.items():
        if name.endswith(("layer_scalar", "router.scale", "router.per_expert_scale")):
            noise = torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype)
            state[name] = tensor * (0.5 + noise)
    save_file(state, shard, metadata={"format": "pt"})


def fused_like_checkpoint(ours: dict[str, torch.Tensor], names: set[str]) -> dict:
    """Our split tensors joined again where the checkpoint keeps them fused (Phi-3)."""
    joined = dict(ours)
    for name in names:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED:
            parts = [joined.pop(f"{parent}.{part}.{param}") for part in FUSED[leaf]]
            joined[name] = torch.cat(parts)
    return joined


def test_file_states_llama_cpp_architecture(converted: Converted):
    assert gguf_architecture(converted.f32) == LLAMA_CPP_NAMES.get(
        converted.family, converted.family
    )


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_float_gguf_weights_equal_checkpoint_by_name(converted: Converted, qtype: str):
    checkpoint = load_file(converted.hf_dir / "model.safetensors")
    if converted.family == "mixtral":
        checkpoint = {renamed(name): tensor for name, tensor in checkpoint.items()}
    if converted.family == "qwen3_5_moe":  # its stacked experts as each expert's, as loaded
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_stacked_experts(checkpoint.items(), cfg, lambda name: None))
    if converted.family == "granitemoehybrid":  # its shared_mlp as the fused gate_up_proj
        checkpoint = {renamed(n, _GRANITE_HYBRID_NAMES): t for n, t in checkpoint.items()}
    if converted.family.startswith("deepseek"):  # GLM-4.5's names; kv_b joined, as loaded
        checkpoint = {renamed(n, _GLM4_MOE_NAMES): t for n, t in checkpoint.items()}
    if converted.family == "gemma4-moe":  # its router and experts as the layer's `moe`
        checkpoint = {renamed(n, _GEMMA4_MOE_NAMES): t for n, t in checkpoint.items()}
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_stacked_experts(checkpoint.items(), cfg, lambda name: None))
    if converted.family == "glm4_moe":  # its shared expert, bias and experts as loaded
        checkpoint = {renamed(n, _GLM4_MOE_NAMES): t for n, t in checkpoint.items()}
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_stacked_experts(checkpoint.items(), cfg, lambda name: None))
    if converted.family == "ernie4_5_moe":  # its shared expert and bias as the model names them
        checkpoint = {renamed(n, _ERNIE_MOE_NAMES): t for n, t in checkpoint.items()}
        checkpoint = dict(_flat_expert_bias(checkpoint.items()))
    if converted.family == "arcee":  # its ungated up_proj as the one-part gate_up_proj's
        checkpoint = {renamed(n, _UNGATED_MLP_NAMES): t for n, t in checkpoint.items()}
    if converted.family.startswith("nemotron_h"):  # its blocks as the layers they pair into
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_nemotron_h_blocks(checkpoint.items(), cfg))
    if converted.family == "granite4-h":  # the shared expert's and experts' names, as loaded
        checkpoint = {renamed(n, _GRANITE_HYBRID_MOE_NAMES): t for n, t in checkpoint.items()}
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_stacked_experts(checkpoint.items(), cfg, lambda name: None))
    if converted.family == "lfm2":  # its names as the model reads them
        checkpoint = {renamed(name, _LFM2_NAMES): tensor for name, tensor in checkpoint.items()}
    if converted.family in ("lfm2_moe", "granitemoe"):  # and its stacked experts as each one's
        names = (*_LFM2_NAMES, *_LFM2_EXPERT_NAMES)
        names = _GRANITE_MOE_NAMES if converted.family == "granitemoe" else names
        checkpoint = {renamed(name, names): tensor for name, tensor in checkpoint.items()}
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_stacked_experts(checkpoint.items(), cfg, lambda name: None))
    if converted.family == "gpt_oss":  # its 3-D experts as each expert's, as loaded
        checkpoint = dict(_gpt_oss_experts(checkpoint.items(), lambda name: None))
    path = getattr(converted, qtype)
    ours = dict(iter_gguf_weights(path, torch.float64))
    assert len(ours) == len(list(iter_gguf_weights(path, torch.float64)))
    if converted.family == "qwen3_next":  # both as the model reads them: in_proj_qkv, _z, _b, _a
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        checkpoint = dict(_grouped_projections(checkpoint.items(), cfg))
        ours = dict(_grouped_projections(ours.items(), cfg))
    if converted.family == "ernie4_5_moe":  # its bias as the loader flattens it
        ours = dict(_flat_expert_bias(ours.items()))
    if converted.family.startswith("deepseek"):  # attn_k_b and attn_v_b: one kv_b_proj again
        cfg = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
        ours = dict(_latent_heads(ours.items(), cfg))
    ours = fused_like_checkpoint(ours, set(checkpoint))
    tied = {"lm_head.weight"} if "lm_head.weight" not in ours else set()
    assert set(ours) == set(checkpoint) - tied
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float64
        if name.endswith(".A_log"):  # stored as -exp(A_log): log(-(-exp(a))) within rounding
            torch.testing.assert_close(tensor, checkpoint[name], rtol=1e-6, atol=1e-7)
            continue
        assert torch.equal(tensor, checkpoint[name]), name


def renamed(name: str, names=MIXTRAL_NAMES) -> str:
    for old, new in names:
        name = name.replace(old, new)
    return name


def test_config_from_metadata_equals_checkpoint_config(converted: Converted):
    ours = ModelConfig.from_hf(str(converted.f32), dtype="float64")
    theirs = ModelConfig.from_hf(str(converted.hf_dir), dtype="float64")
    # llama.cpp writes Granite 4.0 without Mamba2 layers as Granite 3, the same layer
    renamed_as = {"granitemoehybrid": "granite"} if converted.family == "granitemoehybrid" else {}
    assert ours.architecture == renamed_as.get(*[theirs.architecture] * 2)
    fields = ("vocab_size", "hidden_size", "intermediate_size")
    if converted.family == "nemotron_h-moe":  # no dense MLP: its file states experts' widths
        fields = fields[:2]
    for field in fields:
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # llama.cpp's granitehybrid states an "arbitrary" 2^20 context: the released models' 128K
    unbounded = converted.family in ("granite4-h", "nemotron_h", "nemotron_h-moe")
    max_len = 131072 if unbounded else theirs.max_model_len
    assert (ours.qkv_bias, ours.qk_norm, ours.max_model_len) == (
        theirs.qkv_bias,
        theirs.qk_norm,
        max_len,
    )
    assert ours.rope_inv_freq == pytest.approx(theirs.rope_inv_freq, rel=1e-6)
    assert ours.rope_scaling == pytest.approx(theirs.rope_scaling, rel=1e-6)
    theirs_parts = theirs.parts.to_dict()
    if converted.family == "granitemoehybrid":  # the same layer, under Granite 3's name
        theirs_parts["family"] = "granite"
    assert_close_dicts(ours.parts.to_dict(), theirs_parts)


def test_a_phi3_files_longrope_factors_turn_as_its_checkpoints(tmp_path):
    """llama.cpp keeps Phi-3.5 / Phi-4-mini's longrope factors as two tensors: within the
    original length the file turns by the short ones, past it (a longer max_model_len) by
    the long ones, as the checkpoint does; and the tokens past the original length agree."""
    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", "phi4-mini"))
    path = write_gguf(hf_dir, tmp_path / "phi4-mini.gguf", "F32")
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= names
    short, long = [
        [ModelConfig.from_hf(str(source), max_model_len=n) for source in (hf_dir, path)]
        for n in (None, 512)
    ]
    assert short[1].max_model_len == short[0].max_model_len == 128
    for ours, theirs in (short[::-1], long[::-1]):
        assert ours.rope_inv_freq == pytest.approx(theirs.rope_inv_freq, rel=1e-6)
        assert ours.rope_scaling == pytest.approx(theirs.rope_scaling, rel=1e-6)
    assert long[1].rope_inv_freq != pytest.approx(short[1].rope_inv_freq, rel=1e-3)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (140, 151)]  # past 128
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", max_model_len=512, **DEVICE_KWARGS)
        runs.append([out.outputs[0].token_ids for out in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


def assert_close_dicts(ours: dict, theirs: dict) -> None:
    """Equal, floats to float32's precision (the metadata holds float32)."""
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, float):
            assert math.isclose(ours[key], value, rel_tol=1e-6), key
        elif key == "local_rope_inv_freq":
            assert ours[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_float_gguf_greedy_tokens_equal_checkpoint_in_float64(converted: Converted, qtype: str):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    prompts = random_prompts(6, 384, seed=5, max_len=40)  # longer than every window
    runs = []
    for path in (converted.hf_dir, getattr(converted, qtype)):
        llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
        runs.append([out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)])
    for ours, theirs in zip(*reversed(runs), strict=True):
        assert ours.token_ids == theirs.token_ids
        for got, want, token in zip(ours.logprobs, theirs.logprobs, ours.token_ids, strict=True):
            assert abs(got[token].logprob - want[token].logprob) < LOGPROB_TOLERANCE


def test_q8_0_gguf_is_served_quantized_and_generates(converted: Converted):
    config = ModelConfig.from_hf(str(converted.q8_0))
    assert (config.quantization, config.dtype) == ("gguf", torch.float32)
    llm = LLM(str(converted.q8_0), **DEVICE_KWARGS)
    model = llm.engine.core.runner.model
    if config.parts.moe_layers:  # every expert's projections served in their Q8_0 blocks
        layers = model.model.layers  # LFM2-MoE's leading dense layers have no experts
        moe = [layers[i].mlp for i, is_moe in enumerate(config.parts.moe_layers) if is_moe]
        experts = [e for mlp in moe for e in mlp.experts]
        projections = [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
        assert {type(p).__name__ for p in projections} == {"QuantLinear"}
        assert {p.format for p in projections} == {"q8"}
    if config.parts.moe_beside_mlp:  # Gemma 4's experts' gate and up rows in their Q8_0 blocks
        experts = [e for layer in model.model.layers for e in layer.moe.experts]
        projections = {(type(e.gate_up_proj).__name__, e.gate_up_proj.format) for e in experts}
        assert projections == {("QuantLinear", "q8")}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(random_prompts(3, 384, seed=6, max_len=40), params, use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [MAX_TOKENS] * 3


# llama.cpp's GPT-OSS files keep the experts in MXFP4 (e2m1 codes, a power of two per 32) and
# the rest in F16 or Q8_0. Doubled, e2m1's values are integers up to 12 and the scale a float16,
# so each block is an int8 block as it is: the experts are served with the file's own values.


def snap_experts_to_mxfp4(hf_dir: Path) -> None:
    """Rewrites GPT-OSS's expert weights (experts, in, out) as the values their MXFP4 blocks
    (along `in`, the GGUF rows) hold, so the checkpoint and the file hold the same model."""
    shard = hf_dir / "model.safetensors"
    state = load_file(shard)
    for name, tensor in state.items():
        if name.endswith(("gate_up_proj", "down_proj")) and tensor.dim() == 3:
            rows = tensor.transpose(1, 2).to(torch.float32).numpy()
            values = gguf.quants.dequantize(gguf.quants.quantize(rows, MXFP4), MXFP4)
            state[name] = torch.from_numpy(values).transpose(1, 2).to(tensor.dtype).contiguous()
    save_file(state, shard, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory) -> tuple[Path, Path]:
    hf_dir = tmp_path_factory.mktemp("hf-gpt-oss-mxfp4")
    make_tiny_checkpoint(hf_dir, "gpt_oss", seed=3, **GGUF_FAMILIES["gpt_oss"])
    snap_to_float_gguf(hf_dir)
    snap_experts_to_mxfp4(hf_dir)
    path = tmp_path_factory.mktemp("gguf-mxfp4") / "tiny-gpt-oss-mxfp4.gguf"
    return hf_dir, write_gguf(hf_dir, path, "F16", experts="MXFP4")


def test_mxfp4_blocks_are_int8_blocks_of_the_same_values():
    rng = np.random.default_rng(0)
    for scale in (0.02, 0.5, 40.0):  # scales from 2^-9 to 2^3
        values = (rng.standard_normal((5, 96)) * scale).astype(np.float32)
        values[1, 32:64] = 0  # an all-zero block: its scale byte is never read
        data = gguf.quants.quantize(values, MXFP4)
        weight = from_gguf_blocks("MXFP4", data, (5, 96))
        assert weight.format == "q8"
        want = torch.from_numpy(gguf.quants.dequantize(data, MXFP4))
        assert torch.equal(weight.dequantize(), want), scale


def test_mxfp4_experts_are_served_in_their_blocks_and_equal_the_checkpoint(mxfp4_gpt_oss):
    hf_dir, path = mxfp4_gpt_oss
    types = set(gguf_tensor_types(path).values())
    assert {"MXFP4", "F16"} <= types
    prompts = random_prompts(4, 384, seed=8, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Float64: the file's values are the checkpoint's, token for token.
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    # Served quantized: the experts in int8 blocks holding exactly the file's values.
    llm = LLM(str(path), **DEVICE_KWARGS)
    experts = [layer.mlp.experts for layer in llm.engine.core.runner.model.model.layers]
    projections = [p for group in experts for e in group for p in (e.gate_up_proj, e.down_proj)]
    assert {(type(p).__name__, p.format) for p in projections} == {("QuantLinear", "q8")}
    codes = torch.cat([p.weight_blocks.qs.flatten() for p in projections]).unique()
    assert set(codes.tolist()) <= {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * 4


def test_unsupported_architecture_is_refused_listing_every_family(tmp_path):
    path = write_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="'gpt2'") as error:
        gguf_architecture(path)
    for family in ("llama", "qwen3", *(LLAMA_CPP_NAMES.get(f, f) for f in GGUF_FAMILIES)):
        assert family in str(error.value)


def metadata_of(arch: str, num_layers: int, **keys) -> dict:
    """The metadata keys a converter writes for a model of `num_layers` layers, plus `keys`."""
    base = {
        "context_length": 8192,
        "embedding_length": 4608,
        "block_count": num_layers,
        "feed_forward_length": 36864,
        "attention.head_count": 32,
        "attention.head_count_kv": 16,
        "attention.key_length": 128,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.sliding_window": 4096,
    }
    return {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in (base | keys).items()}


SHAPES = {"token_embd.weight": (256000, 4608)}


def test_gemma_query_scale_is_llama_cpps_head_dim_or_hidden_per_head_for_27b():
    # Gemma 2 27B (46 layers): hidden / heads = 144, as its query_pre_attn_scalar; 9B: head_dim
    assert hf_config_dict(metadata_of("gemma2", 46), SHAPES)["query_pre_attn_scalar"] == 144
    assert hf_config_dict(metadata_of("gemma2", 42), SHAPES)["query_pre_attn_scalar"] == 128
    assert hf_config_dict(metadata_of("gemma3", 62), SHAPES)["query_pre_attn_scalar"] == 144


def test_sliding_layers_follow_llama_cpp_unless_the_file_states_a_pattern():
    gemma2 = hf_config_dict(metadata_of("gemma2", 4), SHAPES)["layer_types"]
    assert gemma2 == ["sliding_attention", "full_attention"] * 2
    gemma3 = hf_config_dict(metadata_of("gemma3", 12), SHAPES)
    assert [t[0] for t in gemma3["layer_types"]] == list("sssssfsssssf")
    assert gemma3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    stated = metadata_of("gemma3", 3, **{"attention.sliding_window_pattern": [True, False, True]})
    assert [t[0] for t in hf_config_dict(stated, SHAPES)["layer_types"]] == list("sfs")
    unwindowed = metadata_of("gemma3", 6, **{"attention.sliding_window": 0})
    assert set(hf_config_dict(unwindowed, SHAPES)["layer_types"]) == {"full_attention"}


@pytest.mark.parametrize(
    ("arch", "keys", "tensor", "message"),
    [
        ("smollm3", {}, "rope_factors_long.weight", "longrope"),
        ("granite", {"rope.scaling.type": "su"}, None, "rope.scaling.type 'su'"),
    ],
)
def test_rope_settings_conveyor_does_not_compute_are_refused_by_name(arch, keys, tensor, message):
    shapes = SHAPES | ({tensor: (64,)} if tensor else {})
    with pytest.raises(ValueError, match=message):
        hf_config_dict(metadata_of(arch, 2, **keys), shapes)


def test_an_lfm2moe_file_chooses_its_experts_as_llama_cpp_does():
    """LFM2-8B-A1B's metadata: dense MLPs on the leading blocks, sigmoid scores (gating func 2)
    that choose with exp_probs_b where the file has it, renormalised and unscaled (llama.cpp's
    build_moe_ffn for lfm2moe); another gating function is refused by name."""
    keys = {
        "attention.head_count_kv": [0, 0, 8, 0],
        "shortconv.l_cache": 3,
        "expert_count": 32,
        "expert_used_count": 4,
        "expert_feed_forward_length": 1792,
        "leading_dense_block_count": 2,
        "expert_gating_func": 2,
    }
    biased = SHAPES | {f"blk.{i}.exp_probs_b.bias": (32,) for i in (2, 3)}
    config = hf_config_dict(metadata_of("lfm2moe", 4, **keys), biased)
    assert (config["model_type"], config["architectures"]) == ("lfm2_moe", ["Lfm2MoeForCausalLM"])
    assert config["layer_types"] == ["conv", "conv", "full_attention", "conv"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (32, 4)
    assert (config["moe_intermediate_size"], config["intermediate_size"]) == (1792, 36864)
    assert (config["num_dense_layers"], config["use_expert_bias"]) == (2, True)
    assert (config["norm_topk_prob"], config["routed_scaling_factor"]) == (True, 1.0)
    assert hf_config_dict(metadata_of("lfm2moe", 4, **keys), SHAPES)["use_expert_bias"] is False
    for gating in (1, None):  # softmax, or not stated
        stated = metadata_of("lfm2moe", 4, **keys | {"expert_gating_func": gating})
        with pytest.raises(ValueError, match=f"expert_gating_func is {gating}"):
            hf_config_dict(stated, biased)


def test_an_exaone4_file_with_llama3_scaling_turns_as_its_checkpoint(tmp_path):
    """EXAONE 4.0 scales its RoPE as llama3 does, which llama.cpp stores as rope_freqs: read
    back into the config, the file's tokens are its checkpoint's in float64."""
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=16.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64)  # fmt: skip
    hf_dir = tmp_path / "hf"
    snap_to_float_gguf(make_tiny_checkpoint(hf_dir, "exaone4", rope_parameters=rope))
    path = write_gguf(hf_dir, tmp_path / "tiny-exaone4-llama3-F32.gguf", "F32")
    assert "rope_freqs.weight" in [t.name for t in gguf.GGUFReader(path).tensors]
    ours, theirs = (ModelConfig.from_hf(str(p), dtype="float64") for p in (path, hf_dir))
    assert ours.rope_inv_freq == pytest.approx(theirs.rope_inv_freq, rel=1e-7)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [{"prompt_token_ids": t} for t in random_prompts(3, 384, seed=7, max_len=40)]
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(p), dtype="float64", **DEVICE_KWARGS).generate(
            prompts, params)]
        for p in (hf_dir, path)
    ]  # fmt: skip
    assert outputs[0] == outputs[1]


def test_a_mistral3_file_without_yarn_is_a_mistral():
    """llama.cpp's mistral3 is Ministral 3 with its yarn (and query scale), else a Mistral."""
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
            "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_log_multiplier": 1.0,
            "attention.temperature_scale": 0.1}  # fmt: skip
    config = hf_config_dict(metadata_of("mistral3", 2, **yarn), SHAPES)
    params = config["rope_parameters"]
    assert (config["model_type"], params["rope_type"]) == ("ministral3", "yarn")
    assert (params["factor"], params["mscale"], params["mscale_all_dim"]) == (16, 1, 1)
    assert params["llama_4_scaling_beta"] == pytest.approx(0.1)
    plain = hf_config_dict(metadata_of("mistral3", 2), SHAPES)
    assert (plain["model_type"], plain["architectures"]) == ("mistral", ["MistralForCausalLM"])
    assert plain["rope_parameters"]["rope_type"] == "default" and plain["sliding_window"] is None


def test_an_exaone4_files_sliding_layers_are_llama_cpps():
    """EXAONE 4: the stated window and pattern; a 64-layer file (the 32B) that states none gets
    llama.cpp's 4096 window with every fourth layer global; any other, every layer global."""
    stated = metadata_of("exaone4", 4, **{"attention.sliding_window_pattern": [1, 1, 1, 0]})
    config = hf_config_dict(stated, SHAPES)
    assert (config["sliding_window"], [t[0] for t in config["layer_types"]]) == (4096, list("sssf"))
    for layers, window in ((64, 4096), (30, None)):
        keys = {"attention.sliding_window": None}
        config = hf_config_dict(metadata_of("exaone4", layers, **keys), SHAPES)
        assert config["sliding_window"] == window
        types = [t[0] for t in config["layer_types"]]
        assert types == (list("sssf") * 16 if window else ["f"] * layers)


@pytest.mark.parametrize(
    ("family", "arch", "fields"),
    [("qwen2", "qwen2vl", {}), ("qwen3", "qwen3vl", {}),
     ("qwen3_moe", "qwen3vlmoe", dict(decoder_sparse_step=1))],
)  # fmt: skip
def test_a_vl_file_is_its_language_model_served_as_its_text_family(tmp_path, family, arch, fields):
    """llama.cpp converts a Qwen2-VL / Qwen2.5-VL's language model under its own architecture
    name, `qwen2vl`, with Qwen2's tensors, and a Qwen3-VL's (-MoE's) as `qwen3vl`
    (`qwen3vlmoe`) with Qwen3's (Qwen3-MoE's): served as the text family, the same tokens as
    the checkpoint."""
    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", family, **fields))
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", "F32", arch=arch)
    assert gguf_architecture(path) == arch
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    prompts = random_prompts(4, 384, seed=7, max_len=30)
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        runs.append([out.outputs[0].token_ids for out in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


def test_transformers_reads_the_lfm2_file_as_its_checkpoint(tmp_path):
    """The writer's LFM2 (per-layer KV heads, shortconv tensors, the adjusted MLP width) is the
    format transformers' own GGUF reader takes from llama.cpp: it reads the file back as the
    checkpoint's tensors, bit for bit."""
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "hf"
    snap_to_float_gguf(make_tiny_checkpoint(hf_dir, "lfm2"))
    path = write_gguf(hf_dir, tmp_path / "tiny-lfm2-F32.gguf", "F32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    assert theirs.config.layer_types == ["conv", "conv", "full_attention", "conv"]
    checkpoint = load_file(hf_dir / "model.safetensors")
    state = theirs.state_dict()
    for name, tensor in checkpoint.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name


@pytest.mark.parametrize("family", ["qwen3_5", "glm4_moe"])
def test_a_files_multi_token_prediction_layers_are_not_read(tmp_path, family):
    """llama.cpp appends Qwen3.5's and GLM-4.5's MTP layers as blocks after the model's
    (block_count counts them, nextn_predict_layers says how many): the model is the first
    blocks, its tokens the same as from the file without them."""
    hf_dir = tmp_path / "hf"
    snap_to_float_gguf(make_tiny_checkpoint(hf_dir, family, **GGUF_FAMILIES[family]))
    plain = write_gguf(hf_dir, tmp_path / f"tiny-{family}-F32.gguf", "F32")
    mtp = write_gguf(hf_dir, tmp_path / f"tiny-{family}-mtp-F32.gguf", "F32", mtp_layers=1)
    layers = ModelConfig.from_hf(str(hf_dir), dtype="float64").num_layers
    last = gguf.GGUFReader(mtp).get_tensor(-1).name
    assert last == f"blk.{layers}.nextn.shared_head_norm.weight"
    assert ModelConfig.from_hf(str(mtp), dtype="float64").num_layers == layers
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = random_prompts(3, 384, seed=4, max_len=30)
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(p), dtype="float64", **DEVICE_KWARGS).generate(
            [{"prompt_token_ids": t} for t in prompts], params)]
        for p in (plain, mtp)
    ]  # fmt: skip
    assert outputs[0] == outputs[1]


def test_a_granitehybrid_file_with_rope_bambas_is_refused_by_name(tmp_path):
    """llama.cpp writes Bamba as granitehybrid with RoPE (rope.scaling.finetuned), its rotary
    half of each head permuted as a whole head's: not read as Granite 4.0-H, refused."""
    from conveyor.model.gguf_loader import _header

    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", "granite4-h"))
    path = write_gguf(hf_dir, tmp_path / "tiny-granite4-h.gguf", "F32")
    header = _header(path)
    shapes = {info.name: info.shape for info in header.tensors}
    assert hf_config_dict(header.metadata, shapes)["position_embedding_type"] == "nope"
    metadata = {**header.metadata, "granitehybrid.rope.scaling.finetuned": True}
    with pytest.raises(ValueError, match="Bamba"):
        hf_config_dict(metadata, shapes)


def test_a_deepseek2_file_from_before_absorbed_mla_gives_the_checkpoints_tokens(tmp_path):
    """llama.cpp's deepseek2 files written before its absorbed MLA (most DeepSeek-V2-Lite GGUFs
    of 2024): every head's key and value lengths, each head a KV head, attn_kv_b whole; read as
    the same model, float64 tokens equal the checkpoint's."""
    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", "deepseek_v3"))
    path = write_gguf(hf_dir, tmp_path / "legacy.gguf", "F32", legacy_mla=True)
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    ours, theirs = (ModelConfig.from_hf(str(p), dtype="float64") for p in (path, hf_dir))
    assert (ours.head_dim, ours.num_kv_heads, ours.parts.mla) == (
        theirs.head_dim, theirs.num_kv_heads, theirs.parts.mla,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = random_prompts(4, 384, seed=5, max_len=40)
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def gemma4_metadata(num_layers: int = 10, shared: int = 5, **keys) -> dict:
    """An E2B-like gemma4 file's keys: every fifth layer full (key_length 512), the others
    sliding (key_length_swa 256), the last `shared` layers reading earlier caches."""
    gemma4 = {
        "attention.key_length": 512,
        "attention.key_length_swa": 256,
        "attention.head_count_kv": 2,
        "attention.sliding_window_pattern": [(i + 1) % 5 != 0 for i in range(num_layers)],
        "attention.shared_kv_layers": shared,
        "rope.freq_base": 1e6,
        "rope.freq_base_swa": 1e4,
        "rope.dimension_count": 512,
        "rope.dimension_count_swa": 256,
        "embedding_length_per_layer_input": 0,
        "feed_forward_length": 6144,
    }
    return metadata_of("gemma4", num_layers, **(gemma4 | keys))


def gemma4_shapes(num_layers: int = 10, shared: int = 5, without_v: tuple = ()) -> dict:
    own = [i for i in range(num_layers - shared) if i not in without_v]
    return SHAPES | {f"blk.{i}.attn_v.weight": (1024, 4608) for i in own}


PROPORTIONAL = {"rope_freqs.weight": [1.0] * 64 + [1e30] * 192}  # a quarter of 512 turned


def test_a_gemma4_files_layers_are_llama_cpps():
    """Gemma 4's metadata as llama.cpp's converter writes it: which layers slide, each kind's
    head size, the shared layers, the full layers' proportional RoPE as rope_freqs (1 on the
    turned pairs, 1e30 on the others), and the soft-cap llama.cpp applies where none is
    stated; transformers' config of it shares the caches as llama.cpp does."""
    from transformers import AutoConfig

    config = hf_config_dict(gemma4_metadata(), gemma4_shapes(), PROPORTIONAL)
    assert (config["model_type"], config["architectures"]) == ("gemma4_text", ["Gemma4ForCausalLM"])
    assert [t[0] for t in config["layer_types"]] == list("ssssf") * 2
    assert (config["head_dim"], config["num_key_value_heads"]) == (256, 2)
    assert config["per_layer_config"] == {i: {"head_dim": 512, "num_key_value_heads": 2}
                                          for i in (4, 9)}  # fmt: skip
    full, local = (config["rope_parameters"][k] for k in ("full_attention", "sliding_attention"))
    assert (full["rope_type"], full["partial_rotary_factor"], full["rope_theta"]) == (
        "proportional", 0.25, 1e6,
    )  # fmt: skip
    assert (local["rope_type"], local["rope_theta"]) == ("default", 1e4)
    assert config["final_logit_softcapping"] == 30.0
    assert (config["attention_k_eq_v"], config["enable_moe_block"]) == (False, False)
    assert (config["intermediate_size"], config["use_double_wide_mlp"]) == (6144, False)
    hf = AutoConfig.for_model(**config)
    assert hf.kv_sharing_modes[5:] == ["reuse"] * 5 and hf.kv_sharing_modes[3:5] == ["store"] * 2
    wide = gemma4_metadata(**{"feed_forward_length": [6144] * 5 + [12288] * 5})
    assert hf_config_dict(wide, gemma4_shapes(), PROPORTIONAL)["use_double_wide_mlp"] is True


@pytest.mark.parametrize(
    ("keys", "shapes", "rope_freqs", "message"),
    [
        ({}, {}, [1.0] * 64 + [2.0] * 192, "rope_freqs"),  # divisors no proportional RoPE has
        ({}, {"without_v": (4, 1)}, None, "attn_v"),  # a sliding layer's values its keys
        ({"attention.shared_kv_layers": 3}, {"shared": 3}, None, "cache"),  # n - 1 slides
        ({"attention.sliding_window_pattern": 5}, {}, None, "sliding_window_pattern"),
        ({"rope.dimension_count_swa": 128}, {}, None, "dimension_count_swa"),
        ({"feed_forward_length": [6144] * 4 + [12288] * 6}, {}, None, "feed_forward_length"),
    ],
)
def test_what_a_gemma4_file_states_otherwise_than_gemma4_is_refused_by_name(
    keys, shapes, rope_freqs, message
):
    factors = {"rope_freqs.weight": rope_freqs} if rope_freqs else PROPORTIONAL
    with pytest.raises(ValueError, match=message):
        hf_config_dict(gemma4_metadata(**keys), gemma4_shapes(**shapes), factors)


def test_a_gemma4_files_keys_of_shared_layers_are_not_read(tmp_path):
    """A checkpoint may hold keys and values for the layers that read an earlier layer's
    cache, which the converter writes and neither llama.cpp nor transformers reads: the file
    is served as the one without them, the checkpoint's tokens in float64."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "gemma4")
    shard = hf_dir / "model.safetensors"
    state = load_file(shard)
    for name in ("k_proj", "v_proj", "k_norm"):  # layer 1's (full, like layer 3) again
        state[f"model.layers.3.self_attn.{name}.weight"] = state[
            f"model.layers.1.self_attn.{name}.weight"
        ].clone()
    save_file(state, shard, metadata={"format": "pt"})
    snap_to_float_gguf(hf_dir)
    path = write_gguf(hf_dir, tmp_path / "tiny-gemma4-F32.gguf", "F32")
    assert "blk.3.attn_k.weight" in {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    names = set(gguf_tensor_types(path))
    assert not any(name.startswith("model.layers.3.self_attn.k") for name in names)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = random_prompts(3, 384, seed=4, max_len=30)
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
