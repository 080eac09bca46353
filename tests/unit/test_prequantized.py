"""Checkpoints quantized by another tool: block-scaled float8 ("fp8", Qwen's and DeepSeek's
-FP8 releases), compressed-tensors' integer weights (llm-compressor's W4A16 / W8A16, packed or
not, symmetric or with zero points), GPTQ's and AWQ's grouped integers with zero points (the
-GPTQ-Int4 / -AWQ releases) are read, dequantized at load as transformers (and GPTQModel,
which it runs GPTQ and AWQ with) dequantizes them, so the greedy tokens equal transformers' in
float64 (fp8: a dense model's and a mixture of experts', its scales in a shard of their own);
served on int8 blocks by default on the CPU; every other method or scheme (bitsandbytes,
quantized activations, fp8 with static activation scales, 3-bit GPTQ, AWQ's GEMV layout) is
refused with its name, before a Hub download fetches any weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE_KWARGS, hf_greedy
from hub_util import hub_cache
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams
from conveyor.hub import download
from conveyor.model.loader import iter_safetensors
from conveyor.model.quant.modules import QuantLinear
from conveyor.model.quant.prequantized import dequantize_fp8

BLOCK = 16  # the tests' fp8 blocks: several per tiny matrix (real checkpoints: 128 x 128)
EAGER = {"experts_implementation": "eager"}  # transformers' MoE experts in float64 on a CPU
PROMPTS = [[5, 17, 42, 9, 100, 33], [7, 8, 9, 10]]


def fp8_checkpoint(source: Path, target: Path, block: int = BLOCK) -> Path:
    """`source`'s projections as float8 e4m3 blocks with float32 `weight_scale_inv`s, as
    Qwen's -FP8 checkpoints store them: the weights in one shard, the scales in another."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, target / file.name)
    weights, scales = {}, {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not name.endswith("_proj.weight") or name.endswith("mlp.gate.weight"):
                weights[name] = tensor
                continue
            rows, cols = tensor.shape
            blocks = tensor.float().reshape(rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
            weights[name] = quantized.reshape(rows, cols)
            scales[name + "_scale_inv"] = scale
    files = {
        "model-00001-of-00002.safetensors": weights,
        "model-00002-of-00002.safetensors": scales,
    }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, target / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (target / "config.json").write_text(json.dumps(config))
    return target


def dequantized_reference(base: Path, path: Path) -> torch.nn.Module:
    """transformers' float64 model of `base` with each fp8 weight of `path` dequantized by
    transformers' own FP8 dequantization (its fp8 experts run no float64 on a CPU)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **EAGER)
    stored = {}
    for file in path.glob("*.safetensors"):
        stored.update(load_file(file))
    dequantize = Fp8Dequantize(None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name + "_scale_inv" in stored:
                scale = stored[name + "_scale_inv"]
                param.copy_(dequantize._dequantize_one(stored[name], scale, torch.float64))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_fp8_checkpoint_gives_transformers_tokens(tmp_path, arch):
    base = make_tiny_checkpoint(tmp_path / "base", arch)
    path = fp8_checkpoint(base, tmp_path / "fp8")
    prompts = [[5, 17, 42, 9, 100, 33], [7, 8, 9, 10]]
    reference = dequantized_reference(base, path)
    expected = [tokens for tokens, _ in hf_greedy(reference, prompts, 10)]
    if arch == "llama":  # transformers' own loading of the checkpoint: the same model
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        assert [tokens for tokens, _ in hf_greedy(loaded, prompts, 10)] == expected
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **EAGER)
    assert [tokens for tokens, _ in hf_greedy(plain, prompts, 10)] != expected  # fp8 counts
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [out.outputs[0].token_ids for out in got] == expected


def test_an_fp8_checkpoint_is_served_on_int8_blocks_by_default_on_the_cpu(tmp_path):
    """Quantized already, it stays small, as a quantized GGUF does: --quantization auto takes
    int8 blocks on the CPU (float32); none, or float64 (the oracle), dequantizes it."""
    path = fp8_checkpoint(make_tiny_checkpoint(tmp_path / "base", "llama"), tmp_path / "fp8")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    small = LLM(str(path), dtype="float32")
    assert small.engine.model_config.quantization == "int8"
    assert len(small.generate(["Hello there"], params)[0].outputs[0].token_ids) == 6
    assert LLM(
        str(path), dtype="float32", quantization="none"
    ).engine.model_config.quantization == ("none")
    assert LLM(str(path), dtype="float64").engine.model_config.quantization == "none"


def compressed_checkpoint(base: Path, target: Path, bits: int, symmetric: bool, group) -> Path:
    """`base` quantized by compressed-tensors itself (the library llm-compressor saves with):
    integer weights with scales from each group's (or row's) range, packed as it packs them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "group" if group else "channel"
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.data.float()
            grouped = weight.reshape(weight.shape[0], -1, group or weight.shape[1])
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    fmt = "pack-quantized" if bits == 4 else "int-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, target / name)
    return target


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(4, 16, True), (4, 32, True), (8, None, True), (4, 16, False), (8, None, False)],
    ids=["w4a16-g16", "w4a16-g32", "w8a16", "w4a16-g16-asym", "w8a16-asym"],
)
def test_a_compressed_tensors_checkpoint_gives_transformers_weights_and_tokens(
    tmp_path, bits, group, symmetric
):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    path = compressed_checkpoint(base, tmp_path / "ct", bits, symmetric, group)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    ours = dict(iter_safetensors(path, torch.float64))
    quantized = [name for name in ours if name.endswith("_proj.weight")]
    assert len(quantized) == 7 * 2
    if bits == 4 and not symmetric:
        # transformers 5.23 does not load compressed-tensors 0.20's packed zero points (its
        # parameter is rows x groups, the file's rows / 8 x groups): the library decompresses
        # them, and transformers' float64 model runs those weights.
        theirs = library_decompressed(path, config)
        reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
        with torch.no_grad():
            for name in quantized:
                reference.get_parameter(name).copy_(theirs[name])
    else:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    expected = [tokens for tokens, _ in hf_greedy(reference, PROMPTS, 10)]
    if bits == 8 or symmetric:
        # transformers decompressed its weights for that forward: conveyor reads the same bits.
        theirs = dict(reference.named_parameters())
    assert all(torch.equal(ours[n], theirs[n]) for n in quantized)
    plain = dict(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).named_parameters())
    assert not any(torch.equal(ours[n], plain[n]) for n in quantized)  # quantized, all of them
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [out.outputs[0].token_ids for out in got] == expected
    assert LLM(str(path), dtype="float32").engine.model_config.quantization == "int8"


def library_decompressed(path: Path, config: dict) -> dict[str, torch.Tensor]:
    """Each packed weight of a pack-quantized checkpoint as compressed-tensors decompresses
    it, its scales in float64 (so that (q - zero) * scale is exact)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    stored = load_file(path / "model.safetensors")
    weights = {}
    for name in stored:
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            parts = {
                k.removeprefix(f"{module}."): v
                for k, v in stored.items()
                if k.startswith(f"{module}.")
            }
            parts["weight_scale"] = parts["weight_scale"].double()
            weights[f"{module}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)[
                "weight"
            ]
    return weights


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `values` (2-D) packed 32 / bits to an int32 word along dim, the first in the
    lowest bits: GPTQ's qweight (dim 0) and qzeros (dim 1), AutoGPTQ's pack loops."""
    per_word = 32 // bits
    values = values.to(torch.int64) if dim == 0 else values.to(torch.int64).T
    words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64)
    for i in range(per_word):
        words |= values[i::per_word] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 0 else words.T.contiguous()


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """4-bit `values` (rows, N) packed along N as AutoAWQ's GEMM layout: the word's value i
    is column (0, 2, 4, 6, 1, 3, 5, 7)[i] of its eight."""
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    rows, cols = values.shape
    interleaved = values.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)
    return _pack(interleaved, 4, 1)


def grouped_checkpoint(
    base: Path, target: Path, method: str, bits: int, group: int = 16, **options
) -> tuple[Path, dict[str, torch.Tensor]]:
    """`base`'s projections quantized round-to-nearest in groups of `group` input columns, with a
    zero point and a float16 scale per group and output (symmetric: zero 2^(bits-1)), packed
    as GPTQ (options: v1 zero points stored minus one, act_order's permuted g_idx) or AWQ
    packs them. Returns the folder and each projection's exact values (float64, (N, K))."""
    target.mkdir(parents=True)
    for file in base.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, target / file.name)
    top = 2**bits - 1
    tensors, values = {}, {}
    for file in sorted(base.glob("*.safetensors")):
        for name, weight in load_file(file).items():
            if not name.endswith("_proj.weight"):
                tensors[name] = weight
                continue
            module = name.removesuffix(".weight")
            w = weight.double().T  # (K, N), the layout both tools pack
            k, n = w.shape
            g_idx = torch.arange(k) // group
            if options.get("act_order"):  # columns quantized in another order: groups permuted
                g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k + n))]
            low = torch.stack([w[g_idx == g].amin(0) for g in range(k // group)]).clamp(max=0)
            high = torch.stack([w[g_idx == g].amax(0) for g in range(k // group)]).clamp(min=0)
            if options.get("sym"):
                scale = (torch.maximum(-low, high) / (top // 2)).half().clamp(min=1e-3)
                zero = torch.full(scale.shape, 2 ** (bits - 1), dtype=torch.int64)
            else:
                scale = ((high - low) / top).half().clamp(min=1e-3)
                zero = (-low / scale.double()).round().clamp(0, top).long()
            q = (w / scale.double()[g_idx] + zero[g_idx]).round().clamp(0, top).long()
            values[module] = ((q - zero[g_idx]) * scale.double()[g_idx]).T
            tensors[f"{module}.scales"] = scale
            if method == "awq":
                tensors[f"{module}.qweight"] = _awq_pack(q)
                tensors[f"{module}.qzeros"] = _awq_pack(zero)
                continue
            stored_zero = zero - 1 if options.get("format", "gptq") == "gptq" else zero
            tensors[f"{module}.qweight"] = _pack(q, bits, 0)
            tensors[f"{module}.qzeros"] = _pack(stored_zero & top, bits, 1)
            tensors[f"{module}.g_idx"] = g_idx.int()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    quant = {"quant_method": method, "bits": bits, "group_size": group}
    if method == "gptq":
        quant |= {
            "desc_act": bool(options.get("act_order")),
            "sym": bool(options.get("sym")),
            "checkpoint_format": options.get("format", "gptq"),
        }
    else:
        quant |= {"zero_point": True, "version": "gemm"}
    (target / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    return target, values


@pytest.mark.parametrize(
    ("method", "bits", "options"),
    [
        ("gptq", 4, {"sym": True, "act_order": True}),
        ("gptq", 4, {"format": "gptq_v2"}),
        ("gptq", 8, {}),
        ("gptq", 2, {"format": "gptq_v2", "act_order": True}),
        ("awq", 4, {}),
    ],
    ids=["gptq-w4-sym-act-order", "gptq-w4-v2", "gptq-w8-v1", "gptq-w2-v2", "awq-w4"],
)
def test_gptq_and_awq_checkpoints_give_their_exact_weights_and_transformers_tokens(
    tmp_path, method, bits, options
):
    """value = (q - zero) * scale, each projection's bits equal to the exact values the
    quantizer made; transformers' float64 model of those values gives conveyor's tokens."""
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    path, exact = grouped_checkpoint(base, tmp_path / method, method, bits, **options)
    ours = dict(iter_safetensors(path, torch.float64))
    assert len(exact) == 7 * 2 and all(
        torch.equal(ours[f"{m}.weight"], v) for m, v in exact.items()
    )
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx")) for name in ours)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    plain = [tokens for tokens, _ in hf_greedy(reference, PROMPTS, 10)]
    with torch.no_grad():
        for module, value in exact.items():
            reference.get_parameter(f"{module}.weight").copy_(value)
    expected = [tokens for tokens, _ in hf_greedy(reference, PROMPTS, 10)]
    if bits <= 4:
        assert expected != plain  # the quantization counts
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [out.outputs[0].token_ids for out in got] == expected
    assert LLM(str(path), dtype="float32").engine.model_config.quantization == "int8"


def test_vllms_quantization_names_take_the_checkpoints_own_method_and_refuse_another(tmp_path):
    """vLLM serve lines name the method (--quantization awq, gptq_marlin, fp8, gguf): the
    checkpoint's own is served as auto; another is refused, naming both, as vLLM refuses it."""
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    path, _ = grouped_checkpoint(base, tmp_path / "q", "gptq", 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    auto = LLM(str(path), dtype="float32").generate(["Hello"], params)[0].outputs[0].token_ids
    for name in ("gptq", "gptq_marlin"):
        llm = LLM(str(path), dtype="float32", quantization=name)
        assert llm.engine.model_config.quantization == "int8"
        assert llm.generate(["Hello"], params)[0].outputs[0].token_ids == auto
    for name, found in (("awq_marlin", "quantized with 'gptq'"), ("fp8", "quantized with 'gptq'")):
        with pytest.raises(ValueError, match=f"quantization='{name}'.*this checkpoint is {found}"):
            LLM(str(path), dtype="float32", quantization=name)
    with pytest.raises(ValueError, match="quantization='awq'.*this checkpoint is not quantized"):
        LLM(str(base), dtype="float32", quantization="awq")


@pytest.mark.parametrize(
    ("method", "options", "served"),
    [("gptq", {}, "q4"), ("awq", {}, "q4"), ("gptq", {"act_order": True}, "q8")],
    ids=["gptq", "awq", "gptq-act-order"],
)
def test_4bit_groups_of_whole_blocks_are_served_as_q4_blocks(tmp_path, method, options, served):
    """On the CPU a 4-bit GPTQ or AWQ checkpoint whose groups are runs of 32-input blocks is
    served on q4 blocks (half the bytes of int8 ones): d is the group's scale bit for bit, m
    its -zero * scale in float16, so each value is within 2^-11 of that of the stored one;
    activation order (groups not in runs) takes int8 blocks."""
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    path, exact = grouped_checkpoint(base, tmp_path / "q", method, 4, group=32, **options)
    llm = LLM(str(path), dtype="float32")
    layer = llm.engine.runner.model.model.layers[1]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, QuantLinear) and module.format == served
    blocks = layer.mlp.down_proj.weight_blocks
    stored = exact["model.layers.1.mlp.down_proj"]
    error = (blocks.dequantize().double() - stored).abs().max()
    assert (
        0 < error <= (stored.abs().max() * 2**-10 if served == "q4" else stored.abs().max() / 127)
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["Hello there"], params)[0].outputs[0].token_ids) == 6


def test_a_broken_gptq_module_is_named(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    path, _ = grouped_checkpoint(base, tmp_path / "q", "gptq", 4)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.g_idx"
    tensors[name] = tensors[name] + 100  # groups past the scales'
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj: a group index outside"):
        LLM(str(path), dtype="float32")


def test_fp8_blocks_dequantize_by_their_scale_grid():
    weight = torch.tensor([[1.0, 2.0, -3.0, 4.0], [0.5, -0.5, 1.5, 2.0]]).to(torch.float8_e4m3fn)
    scales = torch.tensor([[2.0, 10.0]])  # one row of blocks, 2 x 2 each
    expected = torch.tensor([[2.0, 4.0, -30.0, 40.0], [1.0, -1.0, 15.0, 20.0]])
    assert torch.equal(dequantize_fp8(weight, scales), expected)
    with pytest.raises(ValueError, match="not divisible by its scale grid"):
        dequantize_fp8(weight, torch.ones(1, 3))


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "'awq'.*version 'gemv'",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "'gptq'.*3-bit"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "'gptq'.*format 'marlin'",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "'compressed-tensors'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            "'compressed-tensors'.*quantized activations",
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "'fp8'"),
    ],
)
def test_other_quantized_checkpoints_are_refused_by_name(
    tiny_checkpoint, tmp_path, quantization, named
):
    path = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(ValueError, match=f"quantized with {named}.*not supported"):
        LLM(str(path), dtype="float32")
    # A Hub id: refused from its config, before a weight is fetched (none is in this cache).
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "org/quantized", path)
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match=f"'org/quantized': .*quantized with {named}"):
        download("org/quantized", download_dir=cache)
