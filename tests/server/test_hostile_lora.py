"""Hostile LoRA adapters loaded at run time (issue 56) into a real server started with
--enable-lora --allow-runtime-lora-updating: every malformed adapter_config.json, pattern keys
that backtrack as regexes, a lora_alpha that overflows the model's dtype, deep JSON, shapes of
another model, non-finite weights and a missing weights file get a 400 whose message names the
field; /health answers at once while they load; nothing answers 5xx and the server serves on."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from server_util import HTTP, post, start_tiny

MODEL = "tiny"
HEALTH_SECONDS = 0.5
PREFIX = "base_model.model.model.layers.{layer}.self_attn.q_proj"
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    flags = ["--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating"]
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("hostile-lora"), *flags)
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def sizes(tiny_checkpoint) -> tuple[int, int]:
    """(hidden size, q_proj's output size) of the served model."""
    model = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    return hidden, (model.get("head_dim") or hidden // heads) * heads


def _tensors(sizes, rank: int = 2, value: float = 0.01, extra_in: int = 0) -> dict:
    hidden, q_size = sizes
    return {
        f"{PREFIX.format(layer=0)}.lora_A.weight": torch.full((rank, hidden + extra_in), value),
        f"{PREFIX.format(layer=0)}.lora_B.weight": torch.full((q_size, rank), value),
    }


def _write(folder, config=None, tensors=None, text: str | None = None):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(text if text is not None else json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _without(key: str) -> dict:
    return {k: v for k, v in CONFIG.items() if k != key}


def _hostile(root, sizes) -> dict:
    """name -> (folder, a word the 400's message must hold)."""
    good = _tensors(sizes)
    nan = {k: v.clone().fill_(float("inf")) for k, v in good.items()}
    head = {"base_model.model.lm_head.lora_A.weight": torch.ones(2, sizes[0]),
            "base_model.model.lm_head.lora_B.weight": torch.ones(8, 2)}  # fmt: skip
    cases = {
        "alpha-1e30": (dict(config=CONFIG | {"lora_alpha": 1e30}), "lora_alpha"),
        "alpha-pattern-1e30": (
            dict(config=CONFIG | {"alpha_pattern": {"q_proj": 1e30}}),
            "alpha_pattern",
        ),  # fmt: skip
        "deep-json": (dict(text="[" * 100_000), "nests deeper"),
        "bad-json": (dict(text="{not json"), "not valid JSON"),
        "r-missing": (dict(config=_without("r")), "r is missing"),
        "r-string": (dict(config=CONFIG | {"r": "2"}), "r must be an integer"),
        "alpha-string": (dict(config=CONFIG | {"lora_alpha": "4"}), "lora_alpha"),
        "targets-number": (dict(config=CONFIG | {"target_modules": 7}), "target_modules"),
        "rank-pattern-list": (dict(config=CONFIG | {"rank_pattern": [2]}), "rank_pattern"),
        "wrong-shape": (dict(config=CONFIG, tensors=_tensors(sizes, extra_in=3)), "do not fit"),
        "inf-weights": (dict(config=CONFIG, tensors=nan), "infinite"),
        "lm-head": (dict(config=CONFIG, tensors=head), "not supported"),
        "no-weights": (dict(config=CONFIG, tensors=None), "adapter_model.safetensors is missing"),
        # As regexes (PEFT's), these backtracked 2^len per module name, holding the GIL: last,
        # so that an older server fails the cases before it first.
        "regex-rank-key": (dict(config=CONFIG | {"rank_pattern": {"(.|.)*Z": 2}}), "rank_pattern"),
        "regex-alpha-key": (
            dict(config=CONFIG | {"alpha_pattern": {"(.|.)*Z": 2}}),
            "alpha_pattern",
        ),  # fmt: skip
    }
    out = {}
    for name, (parts, word) in cases.items():
        parts.setdefault("tensors", good)
        out[name] = (_write(root / name, **parts), word)
    return out


def load(server, name: str, folder) -> object:
    body = {"lora_name": name, "lora_path": str(folder)}
    return post(server.base_url, "/v1/load_lora_adapter", body, timeout=120)


def assert_serves(server) -> None:
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    chat = post(server.base_url, "/v1/chat/completions", body)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_each_hostile_adapter_is_a_400_naming_its_field(server, sizes, tmp_path):
    for name, (folder, word) in _hostile(tmp_path, sizes).items():
        response = load(server, name, folder)
        assert response.status_code == 400, (name, response.status_code, response.text[:500])
        error = response.json()["error"]
        assert word in error["message"], (name, error)
        assert error["param"] == "lora_path" and "Traceback" not in error["message"], error
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "r-missing", target_is_directory=True)
    error = load(server, "link", link).json()["error"]
    assert f"'{link}'" in error["message"] and "r-missing" not in error["message"], error
    models = HTTP.get(f"{server.base_url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert_serves(server)


def test_health_answers_at_once_while_hostile_adapters_load(server, sizes, tmp_path):
    """The slowest legal adapter too: a config of 30,000 pattern keys (~800 KB)."""
    folders = _hostile(tmp_path, sizes)
    many = {f"layers.{i}.nothing": 2 for i in range(30_000)}
    folders["many-keys"] = (_write(tmp_path / "many", CONFIG | {"rank_pattern": many},
                                   _tensors(sizes)), "")  # fmt: skip
    statuses: dict[str, int] = {}

    def load_all() -> None:
        for name, (folder, _) in folders.items():
            statuses[name] = load(server, f"h-{name}", folder).status_code

    loader = threading.Thread(target=load_all)
    loader.start()
    slowest = 0.0
    while loader.is_alive():
        start = time.monotonic()
        assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.01)
    loader.join()
    assert slowest < HEALTH_SECONDS, f"/health took {slowest:.2f} s while adapters loaded"
    assert statuses.pop("many-keys") == 200
    assert set(statuses.values()) == {400}, statuses
    assert_serves(server)


def test_a_config_without_lora_alpha_has_peft_s_default_of_8(server, sizes, tmp_path):
    default = _write(tmp_path / "default", _without("lora_alpha"), _tensors(sizes, value=0.3))
    eight = _write(tmp_path / "eight", CONFIG | {"lora_alpha": 8}, _tensors(sizes, value=0.3))
    for name, folder in (("alpha-default", default), ("alpha-8", eight)):
        response = load(server, name, folder)
        assert response.status_code == 200, response.text

    def tokens(model: str) -> list[int]:
        body = {"model": model, "prompt": [5, 9, 13, 40, 77], "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        response = post(server.base_url, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    assert tokens("alpha-default") == tokens("alpha-8")
    assert_serves(server)
