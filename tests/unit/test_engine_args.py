"""EngineArgs (engine_args.py): the engine's settings in one frozen, torch-free dataclass,
checked where it is made, the source of the command line's engine flags, and what crosses to
the engine-core process."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import subprocess
import sys
import time

import pytest
import torch

from conveyor import LLM
from conveyor.config import SpeculativeConfig
from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.args import add_engine_args, engine_args


def test_a_name_that_is_no_setting_is_a_type_error_before_any_process_starts(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    start = time.perf_counter()
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(path, max_num_seq=4, engine_process=True)  # a typo of max_num_seqs
    assert time.perf_counter() - start < 5  # no core process was spawned and waited for


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(num_threads=0), "num_threads must be an int >= 1"),
        (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
        (dict(block_size=0), r"block_size must be an integer in \[1, 1024\]"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory: cannot parse 'lots'"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
        (dict(quantization="int4"), "quantization must be one of"),
        (dict(dtype="int8"), "dtype must be 'auto' or one of"),
        (dict(device="tpu"), "device must be 'cpu' or 'cuda'"),
        (dict(device="cpu:1"), "device must be 'cpu' or 'cuda'"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
        (dict(grammar_compile_timeout=0), "grammar_compile_timeout must be > 0"),
        (dict(grammar_compile_timeout=float("inf")), "grammar_compile_timeout must be > 0"),
        (dict(speculative_config={"method": "ngram"}), "needs 'num_speculative_tokens'"),
        (dict(tensor_parallel_size=2, quantization="int8"), "splits float weights only"),
    ],
)
def test_a_bad_setting_fails_where_it_is_made_before_the_model_is_read(setting, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**setting)
    # The model path does not exist: the setting's error comes first, from LLM(...) too.
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/model", engine_process=True, **setting)


def test_settings_are_frozen_normalized_and_survive_pickling():
    args = EngineArgs(
        model="m",
        dtype=torch.float64,
        max_num_seqs=4,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    assert args.dtype == "float64"  # a torch dtype, kept by name: no torch on the other side
    assert args.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_num_seqs = 8
    assert pickle.loads(pickle.dumps(args)) == args
    assert EngineArgs.of(args) is args
    replaced = EngineArgs.of(args, max_num_seqs=8)
    assert (replaced.max_num_seqs, replaced.model, args.max_num_seqs) == (8, "m", 4)
    assert EngineArgs.of("m", max_num_seqs=4) == EngineArgs(model="m", max_num_seqs=4)
    cpu = args.scheduler_config()  # the CPU's default budget: 512, growing with the decodes
    assert (cpu.base_batched_tokens, cpu.max_num_batched_tokens) == (512, 2048)
    cuda = EngineArgs(device="cuda:1").scheduler_config()
    assert (cuda.base_batched_tokens, cuda.max_num_batched_tokens) == (None, 2048)
    # KV blocks of 32 tokens on CPU, 16 on CUDA, unless given
    assert args.cache_config().block_size == 32
    assert EngineArgs(device="cuda:1").cache_config().block_size == 16
    assert EngineArgs(block_size=16).cache_config().block_size == 16


def test_importing_engine_args_imports_no_torch():
    code = "import sys, conveyor.engine_args\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_command_line_setting_has_its_flag_and_no_flags_means_the_defaults():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    on_cli = {name for name, f in fields.items() if f.metadata.get("cli", True)}
    dests = {a.dest for a in parser()._actions} - {"help"}
    assert dests == on_cli
    assert {"skip_tokenizer_init", "record_trace"} == set(fields) - on_cli
    assert engine_args(parser().parse_args([])) == EngineArgs()
    for action in parser()._actions:
        if action.dest in fields:
            assert action.help, f"--{action.dest} has no help"


def test_flags_parse_into_the_same_settings_as_keywords():
    argv = [
        "some/model",
        "--dtype", "float64",
        "--tokenizer", "tok/dir",
        "--max-model-len", "64",
        "--max-num-seqs", "7",
        "--kv-cache-memory", "64MiB",
        "--no-enable-prefix-caching",
        "-tp", "2",
        "-q", "none",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--grammar-compile-timeout", "2.5",
    ]  # fmt: skip
    assert engine_args(parser().parse_args(argv)) == EngineArgs(
        model="some/model",
        dtype="float64",
        tokenizer="tok/dir",
        max_model_len=64,
        max_num_seqs=7,
        kv_cache_memory="64MiB",
        enable_prefix_caching=False,
        tensor_parallel_size=2,
        quantization="none",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        grammar_compile_timeout=2.5,
    )


def test_a_bad_flag_value_is_a_usage_error_before_any_model_loads():
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "/nonexistent/model", "--num-threads", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "num_threads must be an int >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr
