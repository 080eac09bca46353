"""What transformers resolves from a checkpoint (its config's fields, the tokenizer's class), kept
by the files' contents (model/resolve_cache.py): read back, it is what transformers gives, a
changed or damaged file is resolved again, and a start that reads it back imports no
transformers config class."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from conveyor.model.config import ModelConfig, hf_folder, load_tokenizer

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
TEXTS = (
    "Hello world",
    "  two  spaces\tand a tab\n",
    "<|im_start|>user\nhi<|im_end|>",
    "日本語 ünï",
)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(folder))
    return folder / "resolved"


def entries(cache: Path, kind: str) -> list[Path]:
    return sorted(cache.glob(f"{kind}-*.json")) if cache.exists() else []


@pytest.mark.parametrize("arch", ARCHS)
def test_a_config_read_back_equals_the_one_transformers_resolved(arch, tiny_checkpoint, cache):
    path = tiny_checkpoint(arch)
    cold = ModelConfig.from_hf(str(path), dtype="float32")
    assert len(entries(cache, "model")) == 1
    warm = ModelConfig.from_hf(str(path), dtype="float32")
    assert warm == cold
    assert warm.rope_inv_freq == cold.rope_inv_freq  # not in the dataclass's repr, but compared
    hf = AutoConfig.from_pretrained(path)
    assert (warm.hidden_size, warm.num_layers, warm.num_kv_heads, warm.rms_norm_eps) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_key_value_heads,
        hf.rms_norm_eps,
    )
    # the request's own settings still apply to what is read back
    assert ModelConfig.from_hf(str(path), dtype="float64", max_model_len=7).max_model_len == 7


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_tokens == b.all_special_tokens
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids
        assert a.decode(a(text).input_ids) == b.decode(b(text).input_ids)
    messages = [{"role": "user", "content": "hi"}]
    if a.chat_template:
        assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(
            messages, tokenize=False
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tokenizer_loaded_by_its_kept_class_is_autotokenizers(arch, tiny_checkpoint, cache):
    cfg = ModelConfig.from_hf(str(tiny_checkpoint(arch)), dtype="float32")
    cold = load_tokenizer(cfg)
    assert len(entries(cache, "tokenizer")) == 1
    warm = load_tokenizer(cfg)
    assert warm is not cold
    _same_tokenizer(warm, cold)
    _same_tokenizer(warm, AutoTokenizer.from_pretrained(cfg.tokenizer_path))


def test_the_default_models_tokenizer_read_back_is_autotokenizers(tmp_path, monkeypatch):
    cfg = ModelConfig.from_hf(None)  # the GGUF's converted folder, in the usual cache
    cfg = dataclasses.replace(cfg, tokenizer=hf_folder(cfg.path))
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    cold, warm = load_tokenizer(cfg), load_tokenizer(cfg)
    _same_tokenizer(warm, cold)
    assert len(warm) > 49_000


def test_a_changed_config_is_resolved_again(tiny_checkpoint, tmp_path, cache):
    path = tmp_path / "copy"
    path.mkdir()
    for file in tiny_checkpoint("llama").iterdir():
        (path / file.name).symlink_to(file)
    (path / "config.json").unlink()
    config = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config))
    first = ModelConfig.from_hf(str(path), dtype="float32")
    config["rms_norm_eps"] = 0.125
    (path / "config.json").write_text(json.dumps(config))
    second = ModelConfig.from_hf(str(path), dtype="float32")
    assert (first.rms_norm_eps, second.rms_norm_eps) != (0.125, 0.125)
    assert second.rms_norm_eps == 0.125
    assert len(entries(cache, "model")) == 2


def test_a_damaged_entry_is_resolved_again(tiny_checkpoint, cache):
    path = str(tiny_checkpoint("llama"))
    cold = ModelConfig.from_hf(path, dtype="float32")
    load_tokenizer(cold)
    for entry in entries(cache, "model") + entries(cache, "tokenizer"):
        entry.write_text('{"architecture": "lla')  # cut off mid-write by another process
    assert ModelConfig.from_hf(path, dtype="float32") == cold
    assert type(load_tokenizer(cold)) is type(AutoTokenizer.from_pretrained(path))
    # a kept class that is not transformers' own (remote code) is never imported
    (entry,) = entries(cache, "tokenizer")
    entry.write_text(json.dumps({"module": "os", "name": "system"}))
    assert type(load_tokenizer(cold)) is type(AutoTokenizer.from_pretrained(path))


def test_an_unsupported_architecture_is_still_an_error_each_time(tiny_checkpoint, tmp_path, cache):
    path = tmp_path / "bert"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["X"]}))
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported architecture"):
            ModelConfig.from_hf(str(path))
    assert not entries(cache, "model")


def test_a_start_that_reads_them_back_imports_no_config_class(tiny_checkpoint, cache):
    """The front end of `conveyor serve` resolves the config the core waits for, and loads the
    tokenizer: with both kept, neither imports a transformers config class, and with it
    torch._dynamo (3-4 s of a start on 2 cores)."""
    path = str(tiny_checkpoint("llama"))
    load_tokenizer(ModelConfig.from_hf(path, dtype="float32"))
    code = (
        "import sys\n"
        "from conveyor.model.config import ModelConfig\n"
        "from conveyor.model.config import load_tokenizer\n"
        f"tok = load_tokenizer(ModelConfig.from_hf({path!r}, dtype='float32'))\n"
        "assert tok('hi').input_ids\n"
        "heavy = [m for m in sys.modules if m.startswith('transformers.models.')\n"
        "         and '.configuration_' in m or m == 'torch._dynamo']\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())


def test_an_entry_made_by_other_code_is_resolved_again(tiny_checkpoint, cache, monkeypatch):
    """The code that resolves a config counts in its key: an older conveyor's entry (or a
    working copy's before an edit to model/config.py) is not read back as this code's."""
    from conveyor.model import resolve_cache

    path = tiny_checkpoint("llama")
    ModelConfig.from_hf(str(path), dtype="float32")
    assert len(entries(cache, "model")) == 1
    resolve_cache._code_digest.cache_clear()
    monkeypatch.setattr(resolve_cache, "RESOLVING_MODULES", ("model/llama.py",))
    try:
        ModelConfig.from_hf(str(path), dtype="float32")
    finally:
        resolve_cache._code_digest.cache_clear()
    assert len(entries(cache, "model")) == 2
