"""`python -m benchmarks spec` and its workloads: spec-edit prompts hold the code their answer
repeats, spec-control prompts hold nothing to repeat, both deterministic per seed; the grid's
flags are checked; and one tiny grid runs end to end against real servers, with speculation."""

from __future__ import annotations

import copy
import json
import re

import pytest

from benchmarks import spec
from benchmarks.cli import build_parser as lab_parser
from benchmarks.cli import main as lab_main
from conveyor.bench.datasets import sample_requests, spec_control_requests, spec_edit_requests
from conveyor.bench.serve import load_tokenizer
from conveyor.cli import build_parser

CODE = re.compile(r"```python\n(.*)\n```", re.DOTALL)
RENAME = re.compile(r"renaming the variable (\w+) to (\w+)\.")


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, model_path):
    """The tiny test tokenizer (384 tokens) and the default model's (SmolLM2's, 49152)."""
    return load_tokenizer(str(model_path) if request.param == "tiny" else None)


@pytest.mark.parametrize("build", [spec_edit_requests, spec_control_requests])
def test_workloads_are_deterministic_per_seed(tokenizer, build):
    first = build(tokenizer, 6, 120, 32, seed=3)
    again = build(tokenizer, 6, 120, 32, seed=3)
    other = build(tokenizer, 6, 120, 32, seed=4)
    assert [(r.prompt_token_ids, r.prompt_text) for r in first] == [
        (r.prompt_token_ids, r.prompt_text) for r in again
    ]
    assert [r.prompt_text for r in first] != [r.prompt_text for r in other]
    assert len({r.prompt_text for r in first}) == 6  # no request repeated
    assert all(r.output_len == 32 for r in first)


def test_spec_edit_prompts_hold_the_code_the_answer_repeats(tokenizer):
    input_len, output_len = 300, 128  # the defaults
    requests = spec_edit_requests(tokenizer, 8, input_len, output_len, seed=0)
    for r in requests:
        code = CODE.search(r.prompt_text).group(1)
        old, new = RENAME.search(r.prompt_text).groups()
        assert re.search(rf"(?<![.\w]){old}\b", code) and new not in code
        # the templated prompt carries the code verbatim, and enough of it to copy for the
        # whole output
        assert code in tokenizer.decode(r.prompt_token_ids)
        assert len(tokenizer(code, add_special_tokens=False).input_ids) >= output_len
        assert 0.8 * input_len <= r.prompt_len <= 1.3 * input_len


def test_spec_control_prompts_differ_and_hold_no_code(tokenizer):
    input_len = 300
    control = spec_control_requests(tokenizer, 8, input_len, 128, seed=0)
    edit = spec_edit_requests(tokenizer, 8, input_len, 128, seed=0)
    for r in control:
        assert "```" not in r.prompt_text and "short story" in r.prompt_text
        assert input_len <= r.prompt_len <= 1.3 * input_len
    assert not {r.prompt_text for r in control} & {r.prompt_text for r in edit}


def test_without_a_chat_template_the_prompt_is_the_plain_text(model_path):
    tokenizer = copy.deepcopy(load_tokenizer(str(model_path)))
    tokenizer.chat_template = None
    for r in spec_edit_requests(tokenizer, 3, 80, 16) + spec_control_requests(tokenizer, 3, 80, 16):
        assert r.prompt_token_ids == tokenizer(r.prompt_text).input_ids
        assert "<|im_start|>" not in tokenizer.decode(r.prompt_token_ids)


@pytest.mark.parametrize("name", ["spec-edit", "spec-control"])
def test_bench_serve_samples_the_spec_workloads(model_path, name):
    argv = ["bench", "serve", "--dataset-name", name, "--num-prompts", "3"]
    args = build_parser().parse_args(argv + ["--spec-input-len", "90", "--spec-output-len", "16"])
    requests = sample_requests(args, load_tokenizer(str(model_path)))
    assert len(requests) == 3 and all(r.output_len == 16 for r in requests)
    args.spec_output_len = 0
    with pytest.raises(ValueError, match="--spec-output-len must be >= 1"):
        sample_requests(args, load_tokenizer(str(model_path)))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-speculative-tokens", "2,0"], "every k must be >= 1"),
        (["--num-speculative-tokens", "2,x"], "not a comma-separated list"),
        (["--concurrency", "0"], "--concurrency: give values >= 1"),
        (["--concurrency", ""], "--concurrency: give values >= 1"),
        (["--prompt-lookup-min", "4", "--prompt-lookup-max", "3"], r"must be <= --prompt-lookup"),
        (["--prompt-lookup-min", "0", "--prompt-lookup-max", "0"], "--prompt-lookup-min must be"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--spec-input-len", "0"], "--spec-input-len must be >= 1"),
    ],
)
def test_bad_grid_flags_raise_before_any_server_starts(flags, message, capsys):
    args = lab_parser().parse_args(["spec", "/no/such/model", *flags])
    with pytest.raises(ValueError, match=message):
        spec.main(args)
    assert lab_main(["spec", "/no/such/model", *flags]) == 2
    assert "starting" not in capsys.readouterr().out


def test_no_speculation_grid_is_valid():
    args = lab_parser().parse_args(["spec", "--num-speculative-tokens", ""])
    assert spec.check_args(args) == ([], [1, 8, 32])


def test_acceptance_from_the_counters():
    assert spec.acceptance(4, 8, 6) == {"acceptance_rate": 0.75, "mean_accepted_length": 2.5}
    assert spec.acceptance(3, 6, 0) == {"acceptance_rate": 0.0, "mean_accepted_length": 1.0}
    nothing = {"acceptance_rate": None, "mean_accepted_length": None}
    assert spec.acceptance(0, 0, 0) == nothing  # nothing proposed
    assert spec.acceptance(None, None, None) == nothing  # a server without the counters


def test_bench_spec_runs_the_whole_grid(model_path, tmp_path, capsys):
    argv = [
        "spec",
        str(model_path),
        "--dtype",
        "float32",
        "--num-speculative-tokens",
        "2",
        "--concurrency",
        "2",  # one concurrency: the grid's other axes start a server each (the test's cost)
        "--num-prompts",
        "2",
        "--spec-input-len",
        "64",
        "--spec-output-len",
        "8",
        "--disable-tqdm",
        "--fixed",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "spec.json",
    ]
    assert lab_main(argv) == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    assert (tmp_path / "spec.png").stat().st_size > 0
    rows = {(r["workload"], r["k"], r["policy"], r["concurrency"]): r for r in report["rows"]}
    configs = [(None, None), (2, "adaptive"), (2, "fixed")]
    assert sorted(rows, key=str) == sorted(
        [(w, k, p, 2) for w in ("spec-edit", "spec-control") for k, p in configs],
        key=str,
    )
    for (_, k, _, _), row in rows.items():
        assert row["completed"] == 2 and row["failed"] == 0
        assert row["total_output_tokens"] == 2 * 8  # exact lengths, speculation or not
        assert row["output_throughput"] > 0 and row["speedup"] > 0
        assert row["median_tpot_ms"] > 0 and row["p99_itl_ms"] >= row["median_itl_ms"]
        assert row["median_ttft_ms"] > 0
        for key in ("acceptance_rate", "mean_accepted_length", *spec.SPEC_COUNTERS):
            assert key in row
        drafts, proposed, accepted = (row[key] for key in spec.SPEC_COUNTERS)
        if k is None:
            assert row["speedup"] == 1.0 and not proposed and row["acceptance_rate"] is None
        else:
            assert drafts >= 0 and 0 <= accepted <= proposed <= k * drafts
            if proposed:
                assert row["acceptance_rate"] == accepted / proposed
                assert row["mean_accepted_length"] == 1 + accepted / drafts
    out = capsys.readouterr().out
    assert out.count("ngram k=2, spec-") == 2 and out.count("ngram k=2 fixed, spec-") == 2
    assert "[6/6]" in out
    header = next(line for line in out.splitlines() if line.startswith("| workload"))
    assert "| TTFT p50 ms |" in header
    assert "| workload | k | concurrency | acceptance | mean accepted len |" in out
