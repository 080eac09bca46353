"""Every bad input raises a ValueError that names the field and the allowed range."""

from __future__ import annotations

import json
import shutil

import pytest

from conveyor import LLMEngine, SamplingParams
from conveyor.config import CacheConfig, SchedulerConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), r"temperature must be a finite number in \[0, 100\]"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=101.0), r"temperature must be a finite number in \[0, 100\]"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(min_p=float("nan")), "min_p must be a finite number"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty must be a finite number"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
        (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
        (dict(seed=-(2**63) - 1), "seed must be an integer in"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(n=True), "n must be an integer"),
        (dict(logit_bias={"a": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={3: 101.0}), r"logit_bias: the bias of token 3 must be in \[-100, 100\]"),
        (dict(logit_bias={3: float("nan")}), "logit_bias: the bias of token 3"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: token id -1 must be >= 0"),
        (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be 0 or -1"),
        (dict(top_k=1.5), "top_k must be 0 or -1"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(min_p=1.5), r"min_p must be a finite number in \[0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be .* in \[0.01, 2\]"),
        (dict(repetition_penalty=1e-300), "repetition_penalty must be a finite number in"),
        (dict(repetition_penalty=2.5), "repetition_penalty must be a finite number in"),
        (dict(presence_penalty=3.0), r"presence_penalty must be a finite number in \[-2, 2\]"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs must be an integer >= 0"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs must be an integer >= 0"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_zero_is_vllms_disabled():
    """vLLM reads top_k 0 (its default) and -1 alike as "every token"; clients send either."""
    assert SamplingParams(top_k=0).top_k == SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0) == SamplingParams()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(str(tiny_checkpoint("llama")), dtype="float64", max_model_len=64)


def test_prompt_plus_max_tokens_beyond_context_is_refused(engine):
    with pytest.raises(ValueError, match="beyond the model's context length 64"):
        engine.add_request("long", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="context length is 64"):
        engine.add_request("longer", [5] * 64, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty-text", "", SamplingParams())
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        engine.add_request("empty-ids", [], SamplingParams())


def test_logprobs_beyond_the_vocabulary_are_refused_and_within_it_served(engine):
    vocab = engine.model_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name}: more than the vocabulary's {vocab}"):
            engine.add_request(f"wide-{name}", [3, 4], SamplingParams(**{name: vocab + 1}))
    engine.add_request("wide", [3, 4], SamplingParams(max_tokens=1, logprobs=40))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    (position,) = next(o for o in outputs if o.request_id == "wide").outputs[0].logprobs
    assert len(position) >= 40


def test_out_of_vocabulary_token_id_is_refused(engine):
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, "):
        engine.add_request("oov", [3, 10**6], SamplingParams())


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("same", [3, 4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="duplicate request_id 'same'"):
        engine.add_request("same", [3, 4, 5], SamplingParams(max_tokens=2))
    engine.abort_request("same")
    assert not engine.has_unfinished_requests()


def test_bad_engine_settings_are_refused():
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="base_batched_tokens must be an integer in"):
        SchedulerConfig(max_num_batched_tokens=256, base_batched_tokens=512)
    with pytest.raises(ValueError, match="base_batched_tokens must be an integer in"):
        SchedulerConfig(base_batched_tokens=0)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="block_size must be an integer"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="kv_cache_memory: cannot parse"):
        CacheConfig(kv_cache_memory="lots")


def test_bad_model_settings_are_refused(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 512\]"):
        LLMEngine(path, max_model_len=100000)
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LLMEngine(path, dtype="int8")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        LLMEngine(path, device="tpu")


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model.*does not exist"):
        LLMEngine(str(missing))


def test_unknown_architecture_is_named(tiny_checkpoint, tmp_path):
    path = tmp_path / "gpt2ish"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*FalconForCausalLM"):
        LLMEngine(str(path))


def test_missing_weight_shard_is_named(tiny_checkpoint, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoint("mistral"), path)
    (path / "model-00002-of-00010.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00010.safetensors.*missing"):
        LLMEngine(str(path))
