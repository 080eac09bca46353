"""`python -m benchmarks structured` and the json-schema workload: the share of constrained requests
is exact and spread evenly, only constrained requests carry response_format, validity is
judged by jsonschema, the mask timing runs on real grammars, and both `bench serve
--dataset json-schema` and the side-by-side command run end to end against real servers.

The tiny random model writes random characters inside its JSON strings (several byte tokens
each), so a record takes it up to ~300 tokens: the servers here load a copy of the tiny
checkpoint whose context is 1024 tokens instead of 512."""

from __future__ import annotations

import json
import shutil

import pytest
from server_util import ServerProcess

from benchmarks import structured
from benchmarks.cli import build_parser as lab_parser
from benchmarks.cli import main as lab_main
from conveyor.bench.datasets import (
    JSON_TASKS,
    SampleRequest,
    constrained_indices,
    json_schema_requests,
)
from conveyor.bench.serve import (
    RequestResult,
    Target,
    Validity,
    build_payload,
    check_outputs,
    is_valid,
    load_tokenizer,
    sample_requests,
)
from conveyor.bench.serve import main as serve_main
from conveyor.cli import build_parser

OUTPUT_LEN = "400"  # above the ~300 tokens the tiny model's records take


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint, tmp_path_factory):
    """The tiny llama checkpoint with a 1024-token context (its prompts here are ~300)."""
    path = tmp_path_factory.mktemp("tiny-long") / "llama"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(str(model_path))


# ---- the workload -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num", "ratio", "count"),
    [
        (64, 0.0, 0),
        (64, 0.5, 32),
        (64, 1.0, 64),
        (5, 0.5, 3),  # 2.5: halves round up (Python's round would give 2)
        (10, 0.25, 3),
        (7, 0.3, 2),
        (7, 0.9, 6),
        (1, 0.5, 1),
        (1, 0.4, 0),
        (3, 1.0, 3),
    ],
)
def test_the_constrained_share_is_exact_and_evenly_spread(num, ratio, count):
    indices = constrained_indices(num, ratio)
    assert len(indices) == count
    assert indices == sorted(set(indices)) and all(0 <= i < num for i in indices)
    if indices:  # the gaps between them, wrapping around, differ by one at most
        gaps = [b - a for a, b in zip(indices, indices[1:] + [indices[0] + num], strict=True)]
        assert max(gaps) - min(gaps) <= 1
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        constrained_indices(num, 1.5)


def test_json_schema_requests_split_the_same_prompts(tokenizer):
    requests = json_schema_requests(tokenizer, 20, 64, 0.5, seed=3)
    constrained = [r for r in requests if r.schema is not None]
    free = [r for r in requests if r.schema is None]
    assert len(constrained) == len(free) == 10
    assert [r.schema is not None for r in requests] == [i % 2 == 0 for i in range(20)]
    # each part asks for every kind of record, with the same requests' wording
    for part in (constrained, free):
        prompts = [r.prompt_text.split(",")[0].split(" a ")[0] for r in part]
        assert len(set(prompts)) == len(JSON_TASKS)
    for r in constrained:
        task = next(t for t in JSON_TASKS if t.schema is r.schema)
        assert all(name in r.prompt_text for name in task.schema["properties"])
    assert all(r.output_len == 64 for r in requests)
    assert len({r.prompt_text for r in requests}) == 20  # made-up names: no prompt repeats
    # chat prompts, rendered with the template, deterministic per seed
    assert all(r.prompt_token_ids == _chat_ids(tokenizer, r.prompt_text) for r in requests)
    again = json_schema_requests(tokenizer, 20, 64, 0.5, seed=3)
    assert [(a.prompt_text, a.schema) for a in again] == [
        (r.prompt_text, r.schema) for r in requests
    ]
    other = json_schema_requests(tokenizer, 20, 64, 0.5, seed=4)
    assert [r.prompt_text for r in other] != [r.prompt_text for r in requests]


def _chat_ids(tokenizer, text: str) -> list[int]:
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(templated, add_special_tokens=False).input_ids


def test_bench_serve_samples_the_json_schema_dataset(tokenizer):
    flags = ["--dataset", "json-schema", "--num-prompts", "8", "--structured-ratio", "0.25"]
    args = build_parser().parse_args(["bench", "serve", *flags])
    requests = sample_requests(args, tokenizer)
    assert args.dataset_name == "json-schema" and args.structured_output_len == 256
    assert [r.schema is not None for r in requests] == [i in (0, 4) for i in range(8)]
    args.structured_ratio = 1.5
    with pytest.raises(ValueError, match="--structured-ratio must be in"):
        sample_requests(args, tokenizer)
    vllm = build_parser().parse_args(["bench", "serve", "--structured-output-ratio", "0.5"])
    assert vllm.structured_ratio == 0.5


def test_examples_fit_their_schemas():
    for task in JSON_TASKS:
        assert is_valid(json.dumps(task.example), task.schema)
        for name in task.schema["required"]:  # and a missing required field does not
            missing = {k: v for k, v in task.example.items() if k != name}
            assert not is_valid(json.dumps(missing), task.schema)


# ---- payloads and validity ----------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_only_constrained_requests_carry_response_format(tokenizer, chat):
    requests = json_schema_requests(tokenizer, 4, 32, 0.5)
    target = Target("http://x/v1/completions", "m", chat, {}, True, 0.0)
    for r in requests:
        payload = build_payload(target, r, tokenizer)
        if r.schema is None:
            assert "response_format" not in payload
            assert payload["ignore_eos"] is True  # as the command line asks
        else:
            assert payload["response_format"] == {
                "type": "json_schema",
                "json_schema": {"name": r.schema["title"], "schema": r.schema, "strict": True},
            }
            assert payload["ignore_eos"] is False  # a constrained answer ends with its JSON
        if chat:
            assert payload["messages"] == [{"role": "user", "content": r.prompt_text}]
            assert payload["max_completion_tokens"] == 32
        else:
            assert payload["prompt"] == r.prompt_token_ids and payload["max_tokens"] == 32


def test_validity_parses_and_checks_the_schema():
    schema = JSON_TASKS[0].schema  # product
    good = {"name": "Lamp", "price": 12.5, "currency": "EUR", "tags": [], "in_stock": True}
    assert is_valid(json.dumps(good), schema)
    assert is_valid(json.dumps(good | {"sku": "ABC-1234"}), schema)
    bad = [
        json.dumps(good)[:-5],  # cut short by max_tokens
        "```json\n" + json.dumps(good) + "\n```",  # fenced, as a free model writes it
        json.dumps(good | {"price": 20000}),  # above maximum
        json.dumps(good | {"currency": "CHF"}),  # not in the enum
        json.dumps(good | {"sku": "abc-12"}),  # off the pattern
        json.dumps(good | {"tags": ["a", "b", "c", "d", "e"]}),  # over maxItems
        json.dumps(good | {"name": "x" * 41}),  # over maxLength
        json.dumps(good | {"colour": "red"}),  # no other keys
    ]
    assert not any(is_valid(text, schema) for text in bad)

    requests = [SampleRequest([1], 8, "x", schema if i < 3 else None) for i in range(4)]
    results = [RequestResult(1, success=True, generated_text=json.dumps(good)) for _ in range(4)]
    results[1].generated_text = bad[0]
    results[2].success = False  # a failed request's output is not valid, whatever it holds
    assert check_outputs(requests, results) == [True, False, False, None]
    assert str(Validity(1, 3)) == "1/3 (33.3%)" and Validity(0, 0).rate is None
    assert str(Validity(0, 0)) == "0/0"


# ---- the command's parts ------------------------------------------------------------------


def test_ratios_run_side_by_side_in_alternating_order():
    assert structured.run_order([0, 0.5, 1], 3) == [
        (0, 0),
        (0, 0.5),
        (0, 1),
        (1, 1),
        (1, 0.5),
        (1, 0),
        (2, 0),
        (2, 0.5),
        (2, 1),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--structured-ratios", "0,1.5"], "distinct values in"),
        (["--structured-ratios", "0,0"], "distinct values in"),
        (["--structured-ratios", "a"], "not a comma-separated list"),
        (["--mask-rows", "0"], "--mask-rows: give values >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--concurrency", "0"], "--concurrency must be >= 1"),
        (["--endpoint", "/v1/embeddings"], "--endpoint must be"),
    ],
)
def test_bad_flags_raise_before_any_server_starts(flags, message, capsys):
    args = lab_parser().parse_args(["structured", "/no/such/model", *flags])
    with pytest.raises(ValueError, match=message):
        structured.main(args)
    assert lab_main(["structured", "/no/such/model", *flags]) == 2
    assert "starting" not in capsys.readouterr().out


def _run(ratio: float, round_index: int, tok_s: float, valid: int, structured_count: int):
    return {
        "round": round_index,
        "structured_ratio": ratio,
        "output_throughput": tok_s,
        "tpots": [0.01, 0.02],
        "completed": 4,
        "failed": 0,
        "total_output_tokens": 400,
        "num_structured": structured_count,
        "num_valid": valid,
        "mean_output_tokens_structured": 80.0 if structured_count else None,
    }


def test_summary_and_verdict_on_known_numbers():
    runs = [_run(0, 0, 100, 0, 0), _run(1, 0, 90, 4, 4), _run(1, 1, 96, 4, 4)]
    runs.append(_run(0, 1, 110, 0, 0))
    summary = structured.summarize_ratios(runs, [0, 1])
    free, full = summary
    assert free["output_throughput"] == 105 and free["output_throughput_rounds"] == [100, 110]
    assert full["output_throughput"] == 93 and full["vs_unconstrained"] == pytest.approx(93 / 105)
    assert free["validity_rate"] is None and full["validity_rate"] == 1.0
    assert full["median_tpot_ms"] == pytest.approx(15.0) and full["mean_output_tokens"] == 100
    assert structured.verdict(summary) == {
        "met": False,  # 0.886x < 0.9x
        "speed": pytest.approx(93 / 105),
        "speed_matched": None,
        "validity_rate": 1.0,
    }
    runs[1]["output_throughput"] = 100  # 98 tok/s: 0.93x
    assert structured.verdict(structured.summarize_ratios(runs, [0, 1]))["met"] is True
    runs[1]["num_valid"] = 3  # one invalid output misses the target
    assert structured.verdict(structured.summarize_ratios(runs, [0, 1]))["met"] is False
    assert structured.verdict(structured.summarize_ratios(runs, [1]))["met"] is None


def test_the_matched_control_judges_the_target_when_it_ran():
    runs = [_run(0, 0, 100, 0, 0), _run(1, 0, 80, 4, 4), _run(structured.MATCHED, 0, 85, 0, 0)]
    summary = structured.summarize_ratios(runs, [0, 1])
    assert [s["structured_ratio"] for s in summary] == [0, 1, structured.MATCHED]
    assert summary[1]["vs_matched"] == pytest.approx(80 / 85)
    verdict = structured.verdict(summary)
    assert verdict["met"] is True and verdict["speed"] == pytest.approx(0.8)  # 0.94x of control
    runs[2]["output_throughput"] = 100
    assert structured.verdict(structured.summarize_ratios(runs, [0, 1]))["met"] is False


def test_the_control_has_the_same_lengths_and_no_cached_prefix(tokenizer):
    requests = json_schema_requests(tokenizer, 4, 50, 1.0, seed=1)
    control = structured.matched_control(requests, [7, 1, 30, 0])
    assert [r.output_len for r in control] == [7, 1, 30, 1]
    for request, twin in zip(requests, control, strict=True):
        assert twin.schema is None and request.schema is not None
        assert len(twin.prompt_token_ids) == len(request.prompt_token_ids)
        assert twin.prompt_token_ids[0] != request.prompt_token_ids[0]
        assert twin.prompt_token_ids[1:] == request.prompt_token_ids[1:]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_mask_timing_runs_on_grammars_midway_through_a_record(tokenizer, which):
    tok = tokenizer if which == "tiny" else load_tokenizer(None)
    vocab = len(tok)
    grammars = structured.midway_grammars(tok, vocab, [tok.eos_token_id], 7)
    assert all(g.error is None and not g.is_accepting for g in grammars)  # none complete
    rows = structured.measure_mask(tok, vocab, [tok.eos_token_id], [1, 3], repeats=3)
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        assert 0 < r["fill_ms"] and 0 < r["apply_ms"]
        assert r["step_ms"] >= max(r["fill_ms"], r["apply_ms"])


# ---- end to end ---------------------------------------------------------------------------


def test_bench_serve_reports_validity(model_path, tmp_path, capsys):
    server = ServerProcess([str(model_path), "--dtype", "float32"], tmp_path / "server.log")
    try:
        argv = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(model_path)]
        argv += ["--endpoint", "/v1/chat/completions", "--dataset", "json-schema"]
        argv += ["--num-prompts", "4", "--structured-ratio", "0.5", "--max-concurrency", "4"]
        argv += ["--structured-output-len", OUTPUT_LEN, "--disable-tqdm", "--save-result"]
        argv += ["--result-dir", str(tmp_path), "--result-filename", "result.json"]
        assert serve_main(build_parser().parse_args(argv)) == 0
    finally:
        server.stop()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["valid"] == [True, None, True, None]
    assert result["num_structured"] == 2 and result["validity_rate"] == 1.0
    for i in (0, 2):
        json.loads(result["generated_texts"][i])  # the whole JSON came through the stream
    mean = sum(result["output_lens"]) / 4
    assert result["mean_output_tokens"] == pytest.approx(mean)
    out = capsys.readouterr().out
    assert "Valid structured outputs:                2/2 (100.0%)" in out
    assert f"Mean output tokens:                      {mean:.2f}" in out


def test_bench_structured_runs_every_ratio(model_path, tmp_path, capsys):
    argv = ["structured", str(model_path), "--dtype", "float32", "--concurrency", "2"]
    argv += ["--num-prompts", "4", "--rounds", "1", "--structured-output-len", OUTPUT_LEN]
    argv += ["--mask-rows", "1,4", "--mask-repeats", "5", "--disable-tqdm", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "structured.json"]
    assert lab_main(argv) == 0
    report = json.loads((tmp_path / "structured.json").read_text())
    assert (tmp_path / "structured.png").stat().st_size > 0
    assert [(r["round"], r["structured_ratio"]) for r in report["runs"]] == [
        (0, 0.0),
        (0, 0.5),
        (0, 1.0),
        (0, structured.MATCHED),  # the 100% run's control
    ]
    full, control = report["runs"][2], report["runs"][3]
    assert control["output_lens"] == [max(1, n) for n in full["output_lens"]]  # equal work
    assert control["num_structured"] == 0
    by_ratio = {s["structured_ratio"]: s for s in report["ratios"]}
    assert list(by_ratio) == [0.0, 0.5, 1.0, structured.MATCHED]
    for ratio, s in by_ratio.items():
        assert s["completed"] == 4 and s["failed"] == 0
        share = 0 if ratio == structured.MATCHED else ratio
        assert s["num_structured"] == round(4 * share)
        assert s["validity_rate"] == (None if share == 0 else 1.0)
        assert s["output_throughput"] > 0 and s["p99_tpot_ms"] >= s["median_tpot_ms"] > 0
    assert by_ratio[0.0]["vs_unconstrained"] == 1.0
    assert by_ratio[1.0]["mean_output_tokens_structured"] < int(OUTPUT_LEN)  # JSON complete
    assert by_ratio[1.0]["vs_matched"] == pytest.approx(
        by_ratio[1.0]["output_throughput"] / by_ratio[structured.MATCHED]["output_throughput"]
    )
    assert [m["rows"] for m in report["mask"]] == [1, 4]
    assert all(m["step_ms"] > 0 for m in report["mask"])
    assert report["verdict"]["validity_rate"] == 1.0 and report["verdict"]["met"] in (True, False)
    assert report["verdict"]["speed"] == pytest.approx(by_ratio[1.0]["vs_unconstrained"])
    assert report["verdict"]["speed_matched"] == pytest.approx(by_ratio[1.0]["vs_matched"])
    out = capsys.readouterr().out
    assert "[3/3] 100% constrained, round 1:" in out
    assert "| constrained | output tok/s | per round | vs 0% | vs control | TPOT p50 ms |" in out
    assert "| 100% |" in out and "4/4 (100.0%)" in out
    assert "target: 100% constrained >= 0.9x the unconstrained output tok/s" in out
