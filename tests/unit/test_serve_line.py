"""vLLM's serve line on `conveyor serve`: the flags that are not engine settings parse as a
vLLM user writes them, and each is checked (serve_line.py); --gpu-memory-utilization's KV
budget on a GPU (engine/core.py: cuda_kv_budget). The server half is
tests/server/test_serve_line_server.py."""

from __future__ import annotations

import pytest

from conveyor.cli import _subparser, build_parser
from conveyor.engine.core import cuda_kv_budget
from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.args import engine_args
from conveyor.entrypoints.serve_line import (
    check_serve_line,
    load_chat_template,
    take_model_flag,
    with_config_file,
)

GiB = 2**30


def test_a_typical_vllm_serve_line_parses_into_settings(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    line = (
        f"serve {tmp_path} --trust-remote-code --gpu-memory-utilization 0.85 --max-model-len 4096 "
        "--disable-log-requests --disable-log-stats --uvicorn-log-level warning "
        f"--served-model-name qwen qwen-alias --chat-template {template} --swap-space 4 "
        "--tokenizer-mode auto "
        "--enable-prefix-caching --pipeline-parallel-size 1 --tensor-parallel-size 1 "
        "--enable-prompt-tokens-details --response-role bot "
        '--generation-config vllm --allowed-origins ["*"]'
    )
    args = build_parser().parse_args(line.split())
    assert (args.log_level, args.response_role, args.allowed_origins) == ("warning", "bot", ["*"])
    settings = engine_args(args)
    assert settings.gpu_memory_utilization == 0.85 and settings.max_model_len == 4096
    assert check_serve_line(args) is None
    assert load_chat_template(args.chat_template) == "{{ messages[0]['content'] }}"
    assert args.served_model_name == ["qwen", "qwen-alias"]
    args.tokenizer_mode = "mistral"
    assert "only auto and hf" in check_serve_line(args)
    args.tokenizer_mode, args.pipeline_parallel_size = "hf", 2
    assert "pipeline parallelism is not supported" in check_serve_line(args)
    args.pipeline_parallel_size, args.ssl_keyfile = 1, "key.pem"
    assert "HTTPS needs both" in check_serve_line(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "*"])  # not JSON


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}\\n{% endfor %}") == (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="looks like a file, but it could not be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a Jinja template"):
        load_chat_template("{% for m in messages %}unclosed")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0] }")
    with pytest.raises(ValueError, match="not a Jinja template"):
        load_chat_template(str(bad))


def test_gpu_memory_utilization_bounds_the_gpus_memory_in_use():
    # 60 of 80 GiB free once the model is loaded
    assert cuda_kv_budget(60 * GiB, 80 * GiB) == int(60 * GiB * 0.9)  # conveyor's default
    assert cuda_kv_budget(60 * GiB, 80 * GiB, 0.5) == 20 * GiB  # 40 GiB in use at most
    assert cuda_kv_budget(60 * GiB, 80 * GiB, 0.2) == 0  # the model alone is over the share
    assert EngineArgs(gpu_memory_utilization=1).gpu_memory_utilization == 1
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineArgs(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(gpu_memory_utilization=0.5, kv_cache_memory="1GiB")


def serve_args(argv: list[str]):
    """`conveyor serve ARGV` parsed as the command line parses it (--config read in)."""
    parser = build_parser()
    args = parser.parse_args(["serve", *with_config_file(argv, _subparser(parser, "serve"))])
    take_model_flag(args)
    return args


def test_a_config_file_gives_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/a\nport: 8123\nmax_num_seqs: 7\nenable-prefix-caching: false\n"
        "served-model-name: [a, a2]\nhf-overrides: {max_position_embeddings: 300}\n"
        "trust-remote-code: true\nseed: 5\ntokenizer:\n"
    )
    args = serve_args(["--config", str(config)])
    assert (args.model, args.port, args.max_num_seqs, args.seed) == ("/models/a", 8123, 7, 5)
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert args.served_model_name == ["a", "a2"] and args.tokenizer is None
    assert engine_args(args).hf_overrides == {"max_position_embeddings": 300}
    mine = serve_args(["/models/b", "--port", "9000", f"--config={config}", "-tp", "1"])
    assert (mine.model, mine.port, mine.max_num_seqs) == ("/models/b", 9000, 7)
    assert serve_args(["--config", str(config), "--enable-prefix-caching"]).enable_prefix_caching


def test_model_as_a_flag_and_what_a_config_file_cannot_say(tmp_path):
    assert serve_args(["--model", "/models/a"]).model == "/models/a"
    with pytest.raises(ValueError, match="given twice"):
        serve_args(["/models/a", "--model", "/models/b"])
    config = tmp_path / "serve.yaml"
    for text, message in [
        ("not_a_flag: 1\n", "'not_a_flag' is not a flag of conveyor serve"),
        ("- port\n", "not a YAML mapping"),
        ("port: [8000\n", "--config"),
    ]:
        config.write_text(text)
        with pytest.raises(ValueError, match=message):
            serve_args(["--config", str(config)])
    with pytest.raises(ValueError, match="--config"):
        serve_args(["--config", str(tmp_path / "absent.yaml")])
