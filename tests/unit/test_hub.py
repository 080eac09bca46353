"""Models named by their Hugging Face Hub id (conveyor/hub.py), resolved by huggingface_hub
from a cache laid out as it lays one out: the tests never download (conftest.py sets
HF_HUB_OFFLINE), so each builds the cache a download would have left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hub_util import COMMIT_A, COMMIT_B, hub_cache
from transformers import AutoTokenizer

from conveyor import LLM, SamplingParams
from conveyor.config import default_model_path
from conveyor.hub import _weight_files, download, looks_like_repo
from conveyor.model.config import ModelConfig


@pytest.mark.parametrize(
    ("name", "is_repo"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", True),
        ("meta-llama/Llama-3.2-1B-Instruct", True),
        ("./models/qwen", False),
        ("/models/qwen", False),
        ("~/qwen", False),
        ("models/qwen/v2", False),
        ("qwen.gguf", False),
        ("bad name", False),
        ("org/", False),
    ],
)
def test_which_names_are_hub_repository_ids(name, is_repo):
    assert looks_like_repo(name) is is_repo


def test_a_hub_id_serves_the_cached_checkpoint_as_its_folder_does(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("llama")
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "tiny-org/tiny-llama", folder)
    assert download("tiny-org/tiny-llama", download_dir=cache) == snapshot
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there", "The capital of"]
    local = LLM(str(folder), dtype="float32").generate(prompts, params)
    hub = LLM("tiny-org/tiny-llama", download_dir=str(cache), dtype="float32")
    assert hub.engine.model_config.path == snapshot
    got = hub.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in local]


def test_a_draft_model_named_by_its_hub_id_comes_from_the_same_download_dir(
    tiny_checkpoint, tmp_path
):
    cache = tmp_path / "hub"
    hub_cache(cache, "tiny-org/tiny-llama", tiny_checkpoint("llama"))
    spec = {"method": "draft_model", "model": "tiny-org/tiny-llama", "num_speculative_tokens": 2}
    settings = dict(dtype="float32", speculative_config=spec, download_dir=str(cache))
    llm = LLM("tiny-org/tiny-llama", **settings)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(tiny_checkpoint("llama")), dtype="float32").generate(["Hello"], params)
    assert llm.generate(["Hello"], params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.get_stats().spec.num_draft_tokens > 0


def test_revision_takes_a_branch_or_a_commit(tiny_checkpoint, tmp_path):
    cache = tmp_path / "hub"
    first = hub_cache(cache, "org/m", tiny_checkpoint("llama"), COMMIT_A, "main")
    second = hub_cache(cache, "org/m", tiny_checkpoint("qwen3"), COMMIT_B, "v2")
    assert download("org/m", download_dir=cache) == first
    assert download("org/m", revision="v2", download_dir=cache) == second
    assert download("org/m", revision=COMMIT_B, download_dir=cache) == second
    config = ModelConfig.from_hf("org/m", revision="v2", download_dir=str(cache))
    assert (config.architecture, config.path) == ("qwen3", second)
    with pytest.raises(ValueError, match="org/m"):
        download("org/m", revision="v3", download_dir=cache)


def test_a_model_neither_on_disk_nor_cached_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a local path nor in the Hugging Face cache"):
        download("nobody/nothing", download_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_hf("./nothing/here")
    with pytest.raises(ValueError, match="not a local path nor in the Hugging Face cache"):
        LLM("nobody/nothing", download_dir=str(tmp_path))


def test_a_gguf_repository_is_named_with_its_quantization(tmp_path):
    cache = tmp_path / "hub"
    gguf = Path(default_model_path())
    hub_cache(cache, "org/smol-GGUF", gguf)
    config = ModelConfig.from_hf("org/smol-GGUF:Q4_1", download_dir=str(cache))
    assert (config.path.name, config.quantization in ("gguf", "none")) == (gguf.name, True)
    with pytest.raises(ValueError, match="no .gguf file of Q8_0"):
        download("org/smol-GGUF:Q8_0", download_dir=cache)
    with pytest.raises(ValueError, match="org/smol-GGUF:Q4_K_M"):
        download("org/smol-GGUF", download_dir=cache, load_format="gguf")


def test_only_the_weights_the_index_names_are_fetched(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    shards = {"a.weight": "model-00001-of-00002.safetensors"}
    shards["b.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": shards}))
    assert _weight_files(tmp_path) == sorted(set(shards.values()))
    index.write_text(json.dumps({"weight_map": {"a.weight": "../../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="outside its folder"):
        _weight_files(tmp_path)
    index.unlink()
    assert _weight_files(tmp_path) == ["*.safetensors"]


def test_a_cached_repository_without_safetensors_is_refused(tiny_checkpoint, tmp_path):
    bins = tmp_path / "bins"
    bins.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint("llama") / name, bins / name)
    cache = tmp_path / "hub"
    hub_cache(cache, "org/bins", bins)
    with pytest.raises(ValueError, match="no safetensors weights"):
        download("org/bins", download_dir=cache)


def test_bench_serve_counts_with_the_tokenizer_of_a_served_hub_model(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """A server answers to the Hub id it serves, so `conveyor bench serve` takes that model's
    tokenizer from the cache (its config and tokenizer files only); a plain served name keeps
    the default model's."""
    import argparse

    import huggingface_hub

    from conveyor.bench.serve import _tokenizer_source, load_tokenizer

    folder = tiny_checkpoint("qwen3")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    hub_cache(tmp_path, "org/tiny-qwen", folder)
    args = argparse.Namespace(tokenizer=None, model=None)
    assert _tokenizer_source(args, "org/tiny-qwen") == "org/tiny-qwen"
    assert _tokenizer_source(args, "SmolLM2-135M-Instruct.Q4_1") is None
    text = "The capital of France is Paris."
    local = AutoTokenizer.from_pretrained(folder)
    assert load_tokenizer("org/tiny-qwen")(text).input_ids == local(text).input_ids


def test_a_tokenizer_named_by_its_hub_id_comes_without_weights(tiny_checkpoint, tmp_path):
    """--tokenizer org/name --tokenizer-revision REV: its config and tokenizer files only."""
    cache = tmp_path / "hub"
    source = tiny_checkpoint("llama")
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    for file in source.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, tokenizer_only / file.name)
    snapshot = hub_cache(cache, "org/tok", tokenizer_only, COMMIT_B, "v2")
    config = ModelConfig.from_hf(
        str(source), tokenizer="org/tok", tokenizer_revision="v2", download_dir=str(cache)
    )
    assert config.tokenizer == snapshot and config.tokenizer_path == snapshot
    with pytest.raises(ValueError, match="org/tok"):
        ModelConfig.from_hf(str(source), tokenizer="org/tok", download_dir=str(cache))


def test_lora_modules_named_by_hub_ids_become_their_cached_folders(tiny_checkpoint, tmp_path):
    """--lora-modules sql=org/sql-lora: the adapter's two files from the cache; a folder on
    disk stays; a repository without an adapter's files is refused."""
    from lora_util import ADAPTERS, make_adapter

    from conveyor.config import LoRAConfig
    from conveyor.lora.request import local_lora_modules

    adapter = make_adapter(tiny_checkpoint("llama"), tmp_path / "sql", seed=1, **ADAPTERS["attn"])
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "org/sql-lora", adapter)
    entries = local_lora_modules(["sql=org/sql-lora", f"same={adapter}"], cache)
    assert LoRAConfig.parse_modules(entries) == (("sql", str(snapshot)), ("same", str(adapter)))
    hub_cache(cache, "org/not-lora", tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="adapter_config.json"):
        local_lora_modules(["x=org/not-lora"], cache)
