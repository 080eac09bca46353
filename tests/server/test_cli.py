"""The first minutes of a new user: `python -m conveyor` is the `conveyor` command (same help,
same usage errors); `conveyor serve --help` groups its flags and explains each; a checkpoint
without a tokenizer gets one clear error, runs with tokenizer=PATH / --tokenizer, or with
skip_tokenizer_init=True on token ids alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_python_m_conveyor_is_the_conveyor_command():
    module = run(sys.executable, "-m", "conveyor", "--help")
    assert module.returncode == 0, module.stderr
    for command in ("serve", "generate", "bench"):
        assert command in module.stdout
    script = Path(sys.executable).with_name("conveyor")
    if script.exists():  # installed as a console script next to this interpreter
        assert run(str(script), "--help").stdout == module.stdout


def test_python_m_conveyor_reports_usage_errors_like_the_command():
    result = run(sys.executable, "-m", "conveyor", "serve", "--max-num-seqs", "many")
    assert result.returncode == 2
    assert "conveyor serve: error: argument --max-num-seqs" in result.stderr


def test_vllms_parser_flags_are_accepted_as_a_model_card_writes_them():
    from conveyor.cli import build_parser

    line = "serve m --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes"
    args = build_parser().parse_args(line.split())
    assert (args.reasoning_parser, args.tool_call_parser) == ("qwen3", "hermes")
    assert args.enable_auto_tool_choice


@pytest.mark.parametrize("flag", ["--reasoning-parser", "--tool-call-parser"])
def test_an_unknown_parser_name_is_a_usage_error_listing_the_valid_ones(flag):
    result = run(sys.executable, "-m", "conveyor", "serve", "m", flag, "qwen9")
    assert result.returncode == 2
    assert f"argument {flag}: invalid choice: 'qwen9'" in result.stderr
    for name in ("deepseek_r1", "qwen3") if flag == "--reasoning-parser" else ("hermes", "mistral"):
        assert name in result.stderr


def test_serve_starts_its_engine_core_before_importing_torch():
    """`conveyor serve` spawns the core right after parsing its flags, so the core's imports and
    model load run while the server imports torch: the parsing must not import torch itself."""
    code = (
        "import sys\n"
        "from conveyor.cli import build_parser\n"
        "from conveyor.entrypoints.args import engine_args\n"
        "from conveyor.engine.core_proc import CoreProcess\n"
        "args = build_parser().parse_args(['serve', 'some/model', '--max-n', '4'])\n"
        "assert args.max_n == 4 and engine_args(args).model == 'some/model'\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_serve_help_groups_its_flags_and_explains_each():
    import argparse

    from conveyor.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = commands.choices["serve"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in serve._action_groups}
    for title, member in [
        ("model", "tokenizer"),
        ("engine", "max_num_batched_tokens"),
        ("scale-out", "tensor_parallel_size"),
        ("speculative decoding", "speculative_config"),
        ("structured output", "grammar_compile_timeout"),
        ("server", "port"),
        ("replicas (scale-out)", "data_parallel_size"),
    ]:
        assert member in groups.get(title, []), (title, groups)
    unexplained = [a.dest for a in serve._actions if not a.help]
    assert unexplained == []
    text = run(sys.executable, "-m", "conveyor", "serve", "--help").stdout
    assert "\nstructured output:\n" in text and "\nspeculative decoding:\n" in text


def test_a_checkpoint_without_a_tokenizer_needs_one_given(tmp_path, capsys):
    """tokenizer=PATH / --tokenizer for a checkpoint that ships without one; without it, one
    clear error that says what to pass."""
    import shutil

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tiny import make_tiny_checkpoint

    from conveyor import LLM, SamplingParams

    model = make_tiny_checkpoint(tmp_path / "model")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for file in model.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.move(file, tokenizer / file.name)
    try:
        LLM(str(model), dtype="float64")
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("a checkpoint without a tokenizer was accepted")
    assert "has no tokenizer" in message and "--tokenizer PATH" in message
    # The CLI in this process (`python -m conveyor` itself is run above).
    from conveyor.cli import main as cli_main

    assert cli_main(["generate", str(model), "--max-tokens", "2"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    llm = LLM(str(model), dtype="float64", tokenizer=str(tokenizer))
    assert llm.get_tokenizer().name_or_path == str(tokenizer)
    (out,) = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_token_ids
    argv = ["generate", str(model), "--tokenizer", str(tokenizer), "--dtype", "float64"]
    assert cli_main([*argv, "--prompt", "hello", "--max-tokens", "3"]) == 0
    assert cli_main(["generate", str(model), "--tokenizer", "/nonexistent"]) == 2
    assert "does not exist" in capsys.readouterr().err

    # skip_tokenizer_init: token ids in, token ids out; the same greedy tokens, no text.
    greedy = SamplingParams(max_tokens=5, temperature=0, logprobs=1)
    (expected,) = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
    bare = LLM(str(model), dtype="float64", skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    (out,) = bare.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.outputs[0].text == ""
    assert all(lp.decoded_token is None for pos in out.outputs[0].logprobs for lp in pos.values())
    for prompt, params, refusal in [
        ("text", greedy, "give the prompt as a list of token ids"),
        ([5, 6], SamplingParams(stop=["x"]), "stop strings need a tokenizer"),
    ]:
        with pytest.raises(ValueError, match=refusal):
            bare.generate([prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer"):
        bare.chat([{"role": "user", "content": "hi"}])
