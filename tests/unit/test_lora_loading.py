"""Hostile LoRA adapter folders and settings are refused with a ValueError that names the
problem, at add_request, and the engine goes on serving; good folders load once and by id."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_util import make_adapter
from safetensors.torch import load_file, save_file

from conveyor import LLM, EngineArgs, SamplingParams
from conveyor.lora import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=3)
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    return make_adapter(base, folder, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def llm(base):
    return LLM(str(base), dtype="float64", enable_lora=True, max_loras=2, max_lora_rank=8)


def _copy(good, tmp_path, tensors=None, config=None):
    """The good adapter copied, with its tensors and config changed by the given functions."""
    folder = tmp_path / "adapter"
    shutil.copytree(good, folder)
    if tensors is not None:
        weights = load_file(folder / WEIGHTS)
        tensors(weights)
        save_file(weights, folder / WEIGHTS)
    if config is not None:
        settings = json.loads((folder / CONFIG).read_text())
        config(settings)
        (folder / CONFIG).write_text(json.dumps(settings))
    return folder


def _nan(w):
    w[Q_B] = w[Q_B].clone()
    w[Q_B][0, 0] = float("nan")


def _wrong_shape(w):
    w[Q_A] = torch.zeros(4, 65, dtype=w[Q_A].dtype)


def _beyond_layers(w):
    for name in (Q_A, Q_B):
        w[name.replace("layers.0", "layers.7")] = w.pop(name)


def _lm_head(w):
    w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.float64)
    w["base_model.model.lm_head.lora_B.weight"] = torch.zeros(384, 4, dtype=torch.float64)


def _unpaired(w):
    del w[Q_B]


def _set(**changes):
    return lambda settings: settings.update(changes)


HOSTILE = {
    "nan": (dict(tensors=_nan), "NaN"),
    "wrong-shape": (dict(tensors=_wrong_shape), "another base model"),
    "beyond-layers": (dict(tensors=_beyond_layers), "beyond this model's 2 layers"),
    "lm-head": (dict(tensors=_lm_head), "'lm_head'.*not supported"),
    "unpaired": (dict(tensors=_unpaired), "without its pair"),
    "rank-over-max": (dict(config=_set(r=16)), "rank 4.*config says 16"),
    "target-embed": (dict(config=_set(target_modules=["q_proj", "embed_tokens"])), "embed_tokens"),
    "dora": (dict(config=_set(use_dora=True)), "DoRA"),
    "saved-modules": (dict(config=_set(modules_to_save=["lm_head"])), "modules_to_save"),
    "bias": (dict(config=_set(bias="all")), "bias='all'"),
    "not-lora": (dict(config=_set(peft_type="IA3")), "not LORA"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_adapter_is_refused_and_the_engine_goes_on(case, good, llm, tmp_path):
    changes, message = HOSTILE[case]
    folder = _copy(good, tmp_path, **changes)
    lora = LoRARequest(case, 100 + list(HOSTILE).index(case), str(folder))
    with pytest.raises(ValueError, match=message):
        llm.generate([5, 6, 7], GREEDY, use_tqdm=False, lora_request=lora)
    _serves(llm, good)


def _serves(llm, good) -> None:
    """A base request and one under the good adapter still run, and differently."""
    lora = LoRARequest("good", 1, str(good))
    base, adapted = llm.generate([[5, 6, 7]] * 2, GREEDY, use_tqdm=False, lora_request=[None, lora])
    assert len(base.outputs[0].token_ids) == len(adapted.outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_rank_over_max_lora_rank_is_refused(base, llm, tmp_path):
    folder = make_adapter(base, tmp_path / "big", r=16, lora_alpha=16, target_modules=["o_proj"])
    with pytest.raises(ValueError, match="rank 16.*over max_lora_rank=8"):
        llm.generate(
            [5, 6], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 50, str(folder))
        )


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no-folder", "no such folder"),
        ("no-config", "adapter_config.json is missing"),
        ("no-weights", "adapter_model.safetensors is missing"),
        ("bad-json", "not valid JSON"),
        ("bad-weights", "not a readable safetensors file"),
    ],
)
def test_missing_or_broken_files_are_refused(breakage, message, good, llm, tmp_path):
    folder = _copy(good, tmp_path)
    if breakage == "no-folder":
        shutil.rmtree(folder)
    elif breakage == "no-config":
        (folder / CONFIG).unlink()
    elif breakage == "no-weights":
        (folder / WEIGHTS).unlink()
    elif breakage == "bad-json":
        (folder / CONFIG).write_text("{not json")
    else:
        (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:50])
    lora = LoRARequest(breakage, 60, str(folder))
    with pytest.raises(ValueError, match=message):
        llm.generate([5, 6], GREEDY, use_tqdm=False, lora_request=lora)
    _serves(llm, good)


def test_an_id_names_one_adapter(good, llm, tmp_path):
    other = _copy(good, tmp_path)
    llm.engine.add_lora(LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'good'"):
        llm.generate([5], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(other)))
    assert 1 in llm.engine.list_loras()


def test_lora_requests_and_settings_are_checked(base, good):
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, str(good))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineArgs(model=str(base), enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        EngineArgs(model=str(base), enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="need enable_lora"):
        EngineArgs(model=str(base), lora_modules=[f"a={good}"])
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        EngineArgs(model=str(base), enable_lora=True, lora_modules=["nopath"])


def test_lora_request_without_enable_lora_is_refused(base, good):
    plain = LLM(str(base), dtype="float64", num_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([5], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(good)))
    assert plain.engine.runner.lora is None  # no hooks, no slots: the no-LoRA path as before


def test_lora_modules_load_at_start_and_a_bad_one_fails_it(base, good, tmp_path):
    llm = LLM(str(base), dtype="float64", enable_lora=True, lora_modules=[f"good={good}"])
    assert llm.engine.list_loras() == {1}
    with pytest.raises(ValueError, match="no such folder"):
        LLM(str(base), dtype="float64", enable_lora=True, lora_modules=[f"bad={tmp_path}/none"])


def test_chat_runs_with_an_adapter_as_generate_does(llm, good):
    """LLM.chat(..., lora_request=) (vLLM's): the conversation's prompt generated with the
    adapter, the same tokens as generate's with it, not the base model's."""
    adapter = LoRARequest("good", 1, str(good))
    messages = [{"role": "user", "content": "Hello there"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (chat,) = llm.chat(messages, params, use_tqdm=False, lora_request=adapter)
    prompt = llm.apply_chat_template(messages)
    (plain,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)
    (base,) = llm.generate([prompt], params, use_tqdm=False)
    assert chat.prompt_token_ids == prompt
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids != base.outputs[0].token_ids
