"""The model's default sampling parameters, as vLLM's --generation-config reads them: the
fields of generation_config.json a request leaves out (model/config.py: sampling_defaults),
the flags that choose them, and LLM's get_default_sampling_params on a real tiny checkpoint."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.llm import LLM
from conveyor.model.config import sampling_defaults
from conveyor.sampling_params import SamplingParams

RECOMMENDED = {
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "max_new_tokens": 7,
    "eos_token_id": [1, 2],
}


def folder_with(tmp_path: Path, fields: dict, name: str = "gen") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def test_the_generation_configs_sampling_fields_are_the_defaults(tmp_path):
    folder = folder_with(tmp_path, RECOMMENDED)
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}
    assert sampling_defaults(folder) == expected
    assert sampling_defaults(folder, "vllm") == {}
    other = folder_with(tmp_path, {"min_p": 0.1, "repetition_penalty": 1.1}, "other")
    assert sampling_defaults(folder, str(other)) == {"repetition_penalty": 1.1, "min_p": 0.1}
    override = {"temperature": 0.2, "max_new_tokens": 3, "seed": 5}  # seed is no such field
    assert sampling_defaults(folder, "auto", override) == expected | {
        "temperature": 0.2,
        "max_tokens": 3,
    }
    assert sampling_defaults(folder, "vllm", {"top_k": 2}) == {"top_k": 2}


def test_without_a_generation_config_the_defaults_are_neutral(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert sampling_defaults(bare) == {}
    gguf = tmp_path / "model.gguf"  # a GGUF file carries no generation config
    gguf.write_bytes(b"GGUF")
    assert sampling_defaults(gguf) == {}


def test_values_that_cannot_sample_are_refused_at_start_naming_their_source(tmp_path):
    bad = folder_with(tmp_path, {"top_p": 2.0})
    with pytest.raises(
        ValueError, match=r"generation_config\.json .*top_p.*generation-config vllm"
    ):
        sampling_defaults(bad)
    folder = folder_with(tmp_path, RECOMMENDED, "good")
    with pytest.raises(ValueError, match="override_generation_config .*temperature"):
        sampling_defaults(folder, "auto", {"temperature": -1})
    with pytest.raises(ValueError, match="'auto', 'vllm' or a folder"):
        sampling_defaults(folder, str(tmp_path / "missing"))


def test_the_flags_and_their_checks():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = ["--generation-config", "vllm", "--override-generation-config", '{"top_k": 3}']
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"top_k": 3})
    assert EngineArgs().generation_config == "auto"
    assert EngineArgs(override_generation_config='{"min_p": 0.1}').override_generation_config == {
        "min_p": 0.1
    }
    for bad in ("[1]", "{not json", {1: 2}):
        with pytest.raises(ValueError, match="override_generation_config must be a JSON object"):
            EngineArgs(override_generation_config=bad)
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineArgs(generation_config="")
    with pytest.raises(SystemExit):
        parser.parse_args(["--override-generation-config", "[1]"])


@pytest.fixture(scope="module")
def recommending(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny llama whose generation config recommends top_k 1 (so sampling at the
    recommended temperature picks the argmax) and 4 new tokens."""
    folder = tmp_path_factory.mktemp("recommending") / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    path = folder / "generation_config.json"
    fields = json.loads(path.read_text())
    fields.update(do_sample=True, temperature=0.7, top_k=1, max_new_tokens=4)
    path.write_text(json.dumps(fields))
    return folder


def test_llm_samples_with_the_models_defaults_unless_told_otherwise(recommending):
    prompts = ["The quick brown fox", "Paris is"]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with LLM(str(recommending), dtype="float32") as llm:
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.7, top_k=1, max_tokens=4
        )
        by_default = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
        argmax = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert by_default == argmax and all(len(ids) == 4 for ids in by_default)
        chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)[0].outputs[0]
        assert len(chat.token_ids) == 4
    with LLM(str(recommending), dtype="float32", generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        outputs = llm.generate(prompts, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)  # SamplingParams' 16
