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
from conveyor.entrypoints.openai.chat_content import message_dict, resolve_content_format
from conveyor.entrypoints.openai.protocol import ChatMessage
from conveyor.entrypoints.serve_line import (
    VLLM_REFUSED,
    check_serve_line,
    check_task,
    compilation_eager,
    load_chat_template,
    refused_flags,
    take_active_seqs,
    take_model_flag,
    take_spec_flags,
    uvicorn_settings,
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
        "trust-remote-code: true\nseed: 5\ntokenizer:\nmiddleware: [a.B, c.D]\n"
        "default-chat-template-kwargs: {enable_thinking: false}\n"
    )
    args = serve_args(["--config", str(config)])
    assert (args.model, args.port, args.max_num_seqs, args.seed) == ("/models/a", 8123, 7, 5)
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert args.served_model_name == ["a", "a2"] and args.tokenizer is None
    assert engine_args(args).hf_overrides == {"max_position_embeddings": 300}
    assert args.middleware == ["a.B", "c.D"]
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
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


def test_more_of_a_vllm_serve_line_parses_and_each_value_is_checked(tmp_path):
    """vLLM flags a recipe's serve line carries: the ones conveyor does take effect, the ones
    it has no part for are accepted with their values checked, and the rest are refused
    with why (not as unrecognized)."""
    log_config = tmp_path / "logging.json"
    log_config.write_text("{}")
    args = serve_args(
        [
            "/models/a", "--async-scheduling", "--limit-mm-per-prompt", '{"image": 0}',
            "--disable-frontend-multiprocessing", "--enable-tokenizer-info-endpoint",
            "--max-num-partial-prefills", "1", "--model-impl", "vllm", "-O3",
            "--cuda-graph-sizes", "1", "2", "4", "--prefix-caching-hash-algo", "sha256_cbor",
            "--num-gpu-blocks-override", "77", "--long-prefill-token-threshold", "256",
            "--kv-sharing-fast-prefill", "--logprobs-mode", "raw_logprobs",
            "--default-chat-template-kwargs", '{"enable_thinking": false}',
            "--uds", "/tmp/conveyor.sock", "--log-config-file", str(log_config),
            "--h11-max-incomplete-event-size", "65536", "--disable-sliding-window",
            "--enable-log-requests", "--enable-log-outputs", "--enable-server-load-tracking",
            "--middleware", "a.B", "--middleware", "c.d", "--hf-token",
        ]
    )  # fmt: skip
    assert check_serve_line(args) is None
    settings = engine_args(args)
    assert settings.num_blocks == 77 and settings.long_prefill_token_threshold == 256
    assert (
        settings.disable_sliding_window
        and settings.scheduler_config().long_prefill_token_threshold == 256
    )
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert args.middleware == ["a.B", "c.d"] and args.hf_token is True
    assert uvicorn_settings(args) == {
        "access_log": True,
        "uds": "/tmp/conveyor.sock",
        "log_config": str(log_config),
        "h11_max_incomplete_event_size": 65536,
    }
    assert engine_args(serve_args(["--kv-cache-memory-bytes", "64MiB"])).kv_cache_memory == "64MiB"
    for line, message in [
        (["--api-server-count", "4"], "one front-end process"),
        (["--enable-log-outputs"], "goes with --enable-log-requests"),
        (["--log-config-file", str(tmp_path / "absent.json")], "no such file"),
        (["--uds", "s", "--ssl-keyfile", "k", "--ssl-certfile", "c"], "plain HTTP"),
    ]:
        assert message in check_serve_line(serve_args(line)), line
    for line in (["--logprobs-mode", "processed_logits"], ["--model-impl", "x"]):
        with pytest.raises(SystemExit):
            serve_args(line)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0"):
        EngineArgs(long_prefill_token_threshold=-1)


def test_vllm_flags_conveyor_cannot_honour_are_refused_with_why(capsys):
    from conveyor.cli import main

    assert refused_flags(["--enable-sleep-mode"]).startswith(
        "vLLM's --enable-sleep-mode is not supported by conveyor: there is no sleep mode"
    )
    assert "--hf-overrides" in refused_flags(["x", "--rope-theta=1e6"])
    assert refused_flags(["--no-enable-eplb"]) is not None
    assert refused_flags(["--not-a-vllm-flag"]) is None
    for message in VLLM_REFUSED.values():
        assert message and not message.endswith(".")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/models/a", "--cpu-offload-gb", "4"])
    assert exit_info.value.code == 2
    assert "vLLM's --cpu-offload-gb is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_compilation_settings_ask_for_eager_steps_only_at_level_0_or_without_graphs():
    for value in ("0", ' {"level": 0}', '{"mode": 0}', '{"cudagraph_mode": "NONE"}',
                  ".cudagraph_mode=none", ".level=0"):  # fmt: skip
        assert compilation_eager(value), value
    for value in (None, "3", '{"level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}', ".level=3"):
        assert not compilation_eager(value), value
    for value in ("fast", "[0]", ".level"):
        with pytest.raises(ValueError):
            compilation_eager(value)


GEMMA3_LIKE = (  # loops over a message's parts, as Gemma 3's, Llama 4's templates do
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}"
)


def test_a_template_that_loops_over_parts_gets_parts_and_others_a_string():
    assert resolve_content_format("auto", GEMMA3_LIKE) == "openai"
    assert resolve_content_format("auto", "{% for p in message.content %}{% endfor %}") == (
        "openai"
    )
    assert resolve_content_format("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") == (
        "string"
    )
    assert resolve_content_format("string", GEMMA3_LIKE) == "string"
    assert resolve_content_format("auto", "{% for x in %}") == "string"  # rendering says why
    two = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = ChatMessage(role="user", content=two)
    assert message_dict(parts)["content"] == "a\nb"  # joined one to a line, as vLLM's
    assert message_dict(parts, fmt="openai")["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    one = ChatMessage(role="user", content="hi")
    assert message_dict(one, fmt="openai")["content"] == [{"type": "text", "text": "hi"}]
    tool = ChatMessage(role="tool", tool_call_id="c1", content=two)
    assert message_dict(tool, fmt="openai")["content"] == "a\nb"  # a tool's reply: a string
    empty = ChatMessage(role="assistant", content=None)
    assert (
        message_dict(empty)["content"] == "" and message_dict(empty, fmt="openai")["content"] == []
    )


def test_every_on_off_flag_has_vllms_no_form_and_shutdown_timeout_is_the_grace():
    """vLLM's boolean flags take --no-X (BooleanOptionalAction): each on/off flag here does
    too, the later of the two winning, without crowding --help; --shutdown-timeout is the
    grace open responses get after SIGTERM."""
    serve = _subparser(build_parser(), "serve")
    switches = [a for a in serve._actions if a.nargs == 0 and a.const is True]
    assert len(switches) > 20
    for action in switches:
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if flag.startswith("--no-"):
            continue
        on = serve.parse_args(["m", flag])
        off = serve.parse_args(["m", flag, "--no-" + flag[2:]])
        assert getattr(on, action.dest) is True and getattr(off, action.dest) is False, flag
    line = "m --enable-log-requests --no-disable-fastapi-docs --no-enable-request-id-headers"
    args = serve.parse_args(line.split())
    assert (args.enable_log_requests, args.disable_fastapi_docs) == (True, False)
    assert "--no-enable-log-requests" not in serve.format_help()
    assert serve.parse_args(["m", "--shutdown-timeout", "2.5"]).graceful_timeout == 2.5


def test_max_num_active_seqs_lowers_the_running_cap_within_max_num_seqs():
    """vLLM's --max-num-active-seqs: the most requests running, as --max-num-seqs here; above
    --max-num-seqs it is refused, naming both."""
    serve = _subparser(build_parser(), "serve")
    args = serve.parse_args(["m", "--max-num-seqs", "64", "--max-num-active-seqs", "16"])
    take_active_seqs(args)
    assert engine_args(args).max_num_seqs == 16
    args = serve.parse_args(["m", "--max-num-seqs", "8", "--max-num-active-seqs", "16"])
    with pytest.raises(ValueError, match="--max-num-active-seqs 16 must be <= --max-num-seqs 8"):
        take_active_seqs(args)
    untouched = serve.parse_args(["m", "--max-num-seqs", "8"])
    take_active_seqs(untouched)
    assert untouched.max_num_seqs == 8


def test_vllms_spec_flags_are_the_speculative_config_in_short():
    """vLLM's --spec-method / --spec-model / --spec-tokens: the speculative config they spell
    (an unknown method refused as the config's is); with --speculative-config too, refused."""
    serve = _subparser(build_parser(), "serve")
    args = serve.parse_args(["m", "--spec-method", "ngram", "--spec-tokens", "3"])
    take_spec_flags(args)
    spec = engine_args(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    args = serve.parse_args(["m", "--spec-model", "/drafts/tiny", "--spec-tokens", "2"])
    take_spec_flags(args)
    assert (args.speculative_config.method, args.speculative_config.model) == (
        "draft_model",
        "/drafts/tiny",
    )
    with pytest.raises(ValueError, match="method must be one of"):
        take_spec_flags(serve.parse_args(["m", "--spec-method", "eagle3", "--spec-tokens", "2"]))
    both = ["m", "--spec-tokens", "2", "--speculative-config"]
    both.append('{"method": "ngram", "num_speculative_tokens": 4}')
    with pytest.raises(ValueError, match="give one of them"):
        take_spec_flags(serve.parse_args(both))
    untouched = serve.parse_args(["m"])
    take_spec_flags(untouched)
    assert untouched.speculative_config is None


def test_vllms_task_flags_parse_and_a_classify_task_needs_a_classifier():
    for line in ("--task score", "--task embed", "--runner pooling --convert classify", ""):
        args = build_parser().parse_args(["serve", "/models/m", *line.split()])
        wants = "score" in line or "classify" in line
        assert check_task(args, lambda: True) is None
        problem = check_task(args, lambda: False)
        assert (problem is not None) == wants, line
        if wants:
            assert "the model has no classifier" in problem and "classifier_from_token" in problem
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/models/m", "--task", "reward"])


def test_flags_written_with_underscores_parse_as_vllm_takes_them():
    from conveyor.cli import _dashed

    line = ["serve", "/m", "--hf_overrides", '{"a_b": 1}', "--max_model_len=64", "--task=score"]
    args = build_parser().parse_args([_dashed(arg) for arg in line])
    assert args.hf_overrides == {"a_b": 1}  # the value keeps its underscore
    assert engine_args(args).max_model_len == 64 and args.task == "score"


def test_a_json_flag_a_key_at_a_time_as_vllms_dotted_form():
    """GLM-4.5's model card: `--speculative-config.method mtp --speculative-config.num_
    speculative_tokens 1` (underscores or dashes, `=` or a separate value, values as JSON where
    they are); keys nest by dots and join a plain JSON value of the same flag."""
    from conveyor.cli import _dashed
    from conveyor.entrypoints.serve_line import with_dotted_json

    line = (
        "/models/glm --speculative-config.method mtp --speculative_config.num_speculative_tokens "
        '1 --hf-overrides {"max_position_embeddings":300} --hf-overrides.rope_scaling.factor=2.0 '
        "--port 8123 --default-chat-template-kwargs.enable_thinking false"
    )
    argv = with_dotted_json([_dashed(arg) for arg in line.split()])
    args = serve_args(argv)
    settings = engine_args(args)
    assert (
        settings.speculative_config.method,
        settings.speculative_config.num_speculative_tokens,
    ) == ("mtp", 1)
    assert settings.hf_overrides == {
        "max_position_embeddings": 300,
        "rope_scaling": {"factor": 2.0},
    }
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert (args.model, args.port) == ("/models/glm", 8123)
    assert with_dotted_json(["--port", "1"]) == ["--port", "1"]
    with pytest.raises(ValueError, match="needs a value"):
        with_dotted_json(["--speculative-config.method"])
    with pytest.raises(ValueError, match="must be a JSON object"):
        with_dotted_json(["--hf-overrides", "[1]", "--hf-overrides.a", "1"])
