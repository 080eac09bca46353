"""An adapter folder is untrusted input (issue 56): every malformed adapter_config.json is a
ValueError naming its field, pattern keys cost no backtracking, and a scaling that overflows the
model's dtype is refused at load; pattern keys still pick the ranks and alphas PEFT picks."""

from __future__ import annotations

import json
import time

import pytest
import torch
from lora_util import ADAPTERS, make_adapter
from safetensors.torch import save_file

from conveyor.lora import LoRARequest
from conveyor.lora.adapter import LoRAShapes, load_adapter
from conveyor.model.config import ModelConfig

PREFIX = "base_model.model.model.layers.{layer}.self_attn.{leaf}"
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def shapes(base):
    return LoRAShapes.of(ModelConfig.from_hf(str(base), dtype="float32"))


def _tensors(shapes: LoRAShapes, rank: int = 2, b_value: float = 0.01) -> dict:
    """q_proj and v_proj of both layers at `rank`: A of ones / in_features, B of b_value."""
    qkv = shapes.projections["self_attn.qkv_proj"]
    tensors = {}
    for layer in range(shapes.num_layers):
        for leaf, out in (("q_proj", qkv.out_sizes[0]), ("v_proj", qkv.out_sizes[2])):
            name = PREFIX.format(layer=layer, leaf=leaf)
            tensors[f"{name}.lora_A.weight"] = torch.ones(rank, qkv.in_features) / qkv.in_features
            tensors[f"{name}.lora_B.weight"] = torch.full((out, rank), b_value)
    return tensors


def _folder(tmp_path, shapes, config, tensors=None, raw_config: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = raw_config if raw_config is not None else json.dumps(config)
    (tmp_path / "adapter_config.json").write_text(text)
    save_file(
        tensors if tensors is not None else _tensors(shapes), tmp_path / "adapter_model.safetensors"
    )
    return tmp_path


def _load(folder, shapes, max_lora_rank: int = 8):
    return load_adapter(LoRARequest("hostile", 1, str(folder)), shapes, max_lora_rank)


def _without(key):
    return {k: v for k, v in CONFIG.items() if k != key}


MALFORMED = {
    "r-missing": (_without("r"), "r is missing"),
    "r-string": (CONFIG | {"r": "2"}, "r must be an integer"),
    "r-bool": (CONFIG | {"r": True}, "r must be an integer"),
    "alpha-string": (CONFIG | {"lora_alpha": "4"}, "lora_alpha must be a finite number"),
    "alpha-null": (CONFIG | {"lora_alpha": None}, "lora_alpha must be a finite number"),
    "rslora-string": (CONFIG | {"use_rslora": "yes"}, "use_rslora"),
    "targets-number": (CONFIG | {"target_modules": 5}, "target_modules"),
    "targets-of-numbers": (CONFIG | {"target_modules": [1, 2]}, "target_modules"),
    "rank-pattern-list": (CONFIG | {"rank_pattern": [["q_proj", 2]]}, "rank_pattern"),
    "rank-pattern-string": (CONFIG | {"rank_pattern": {"q_proj": "2"}}, "rank_pattern"),
    "rank-pattern-fraction": (CONFIG | {"rank_pattern": {"q_proj": 2.5}}, "rank_pattern"),
    "rank-pattern-empty-key": (CONFIG | {"rank_pattern": {"": 2}}, "rank_pattern"),
    "alpha-pattern-string": (CONFIG | {"alpha_pattern": {"q_proj": "4"}}, "alpha_pattern"),
    "alpha-pattern-list": (CONFIG | {"alpha_pattern": [4]}, "alpha_pattern"),
    "peft-type-list": (CONFIG | {"peft_type": ["LORA"]}, "peft_type"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_config_is_a_value_error_naming_its_field(case, shapes, tmp_path):
    config, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        _load(_folder(tmp_path, shapes, config), shapes)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000, "nests deeper than"),
        ('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper than"),
        ("{not json", "not valid JSON"),
        (b"\xff\xfe{}".decode("latin-1"), "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps(CONFIG | {"padding": "x" * (2 << 20)}), "bytes"),
    ],
    ids=["open-brackets", "deep-value", "not-json", "not-utf8", "a-list", "too-large"],
)
def test_a_config_that_is_not_a_small_shallow_json_object_is_refused(
    text, message, shapes, tmp_path
):
    with pytest.raises(ValueError, match=message):
        _load(_folder(tmp_path, shapes, None, raw_config=text), shapes)


@pytest.mark.parametrize("key", ["rank_pattern", "alpha_pattern"])
def test_a_backtracking_pattern_key_is_refused_at_once(key, shapes, tmp_path):
    """As a regex, `(.|.){0,22}Z` backtracks ~2^22 ways per module name before failing (0.4 s
    a module here); `(.|.)*Z` doubles its time per character of the name: minutes a module for
    `model.layers.0.self_attn.q_proj`. Keys are module names, not regexes."""
    config = CONFIG | {key: {"(.|.){0,22}Z": 2}}
    folder = _folder(tmp_path, shapes, config)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{key} key"):
        _load(folder, shapes)
    assert time.monotonic() - start < 1.0


def test_a_missing_lora_alpha_is_peft_s_default_of_8(shapes, tmp_path):
    adapter = _load(_folder(tmp_path, shapes, _without("lora_alpha")), shapes)
    explicit = _load(_folder(tmp_path / "eight", shapes, CONFIG | {"lora_alpha": 8}), shapes)
    for key, slices in adapter.modules.items():
        for got, want in zip(slices, explicit.modules[key], strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got.b * got.scaling, want.b * want.scaling)


@pytest.mark.parametrize(
    "config, b_value, field",
    [
        (CONFIG | {"lora_alpha": 1e30}, 0.01, "lora_alpha"),  # folds finite, runs to NaN
        (CONFIG | {"lora_alpha": 1e39}, 1.0, "lora_alpha"),  # B * alpha / r is inf in float32
        (CONFIG | {"alpha_pattern": {"v_proj": 1e30}}, 0.01, "alpha_pattern"),
        (CONFIG, 1e30, "lora_B"),  # finite weights whose product overflows
    ],
    ids=["alpha-1e30", "alpha-1e39", "alpha-pattern-1e30", "large-b"],
)
def test_a_scaling_that_overflows_the_model_dtype_is_refused(
    config, b_value, field, shapes, tmp_path
):
    folder = _folder(tmp_path, shapes, config, _tensors(shapes, b_value=b_value))
    with pytest.raises(ValueError, match=f"{field}.*float32"):
        _load(folder, shapes)


def test_a_large_but_representable_scaling_is_kept(shapes, tmp_path):
    adapter = _load(_folder(tmp_path, shapes, CONFIG | {"lora_alpha": 2e4}), shapes)
    assert all(
        torch.isfinite(s.b * s.scaling).all() for ss in adapter.modules.values() for s in ss if s
    )


# Every form of key PEFT matches (a leaf, a dotted suffix, the whole name) and some it does not
# (part of a component), where two keys match one module and the first wins. PEFT saves the
# patterns with their keys sorted and matches them in the file's order: written here sorted, so
# that the weights it makes (in this order) are the ones it reads back.
TRICKY = dict(
    r=2,
    lora_alpha=4,
    target_modules="all-linear",
    rank_pattern={"1.mlp.down_proj": 5, "down_proj": 6, "model.layers.0.self_attn.q_proj": 4,
                  "proj": 3},
    alpha_pattern={"1.self_attn.k_proj": 7, "_proj": 1, "layers.0.mlp.up_proj": 9, "o_proj": 5,
                   "self_attn.k_proj": 3},
)  # fmt: skip


@pytest.mark.parametrize("name", [*ADAPTERS, "tricky"])
def test_pattern_keys_give_the_ranks_and_scalings_peft_gives(name, base, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    settings = TRICKY if name == "tricky" else ADAPTERS[name]
    folder = make_adapter(base, tmp_path / name, **settings)
    shapes64 = LoRAShapes.of(ModelConfig.from_hf(str(base), dtype="float64"))
    adapter = _load(folder, shapes64, max_lora_rank=8)
    peft = PeftModel.from_pretrained(_hf_model(base), str(folder))
    from conveyor.lora.adapter import SLICES

    checked = 0
    for module_name, module in peft.base_model.model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        layer, leaf = int(module_name.split(".")[2]), module_name.rpartition(".")[2]
        projection, index = SLICES[leaf]
        got = adapter.modules[(layer, projection)][index]
        want_b = module.lora_B["default"].weight.detach() * module.scaling["default"]
        assert got.a.shape[0] == module.r["default"], module_name
        torch.testing.assert_close(got.b * got.scaling, want_b, rtol=1e-12, atol=0)
        checked += 1
    assert checked == sum(s is not None for ss in adapter.modules.values() for s in ss) > 0


def _hf_model(base):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
