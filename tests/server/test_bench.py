"""`conveyor bench serve | throughput` on a tiny model against a real server, and the metric
arithmetic (percentiles, goodput) on known numbers."""

from __future__ import annotations

import json
import math
import time

import pytest
from server_util import ServerProcess

from conveyor.bench.datasets import arrival_times
from conveyor.bench.serve import (
    RequestResult,
    compute_metrics,
    count_good,
    format_result,
    parse_goodput,
    parse_percentiles,
    summarize,
)
from conveyor.bench.serve import main as serve_main
from conveyor.bench.throughput import main as throughput_main
from conveyor.cli import build_parser

GENERATED = "conveyor:generation_tokens_total"


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(
        [str(model_path), "--dtype", "float32"], tmp_path_factory.mktemp("bench") / "server.log"
    )
    yield proc
    proc.stop()


def run_serve(server, model_path, tmp_path, *flags: str) -> dict:
    argv = [
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--tokenizer",
        str(model_path),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "result.json",
        *flags,
    ]
    assert serve_main(build_parser().parse_args(argv)) == 0
    return json.loads((tmp_path / "result.json").read_text())


def generated_since(server, before: float, expected: int, timeout: float = 5.0) -> float:
    """The server's generation-token counter grown since `before`. The engine thread updates
    it just after handing a step's outputs to the streams, so it may trail the last chunk."""
    deadline = time.monotonic() + timeout
    while True:
        grown = server.metrics()[GENERATED] - before
        if grown >= expected or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)


def test_serve_counts_match_the_servers_usage_and_metrics(server, model_path, tmp_path, capsys):
    before = server.metrics()[GENERATED]
    result = run_serve(
        server,
        model_path,
        tmp_path,
        "--num-prompts",
        "8",
        "--random-input-len",
        "32",
        "--random-output-len",
        "12",
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
    )
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["output_lens"] == [12] * 8  # the server's usage, per request
    assert result["total_output_tokens"] == sum(result["output_lens"]) == 8 * 12
    assert result["total_input_tokens"] == 8 * 32  # token-id prompts: exact lengths
    assert generated_since(server, before, 8 * 12) == result["total_output_tokens"]
    assert all(0 < t <= e for t, e in zip(result["ttfts"], result["latencies"], strict=True))
    assert result["mean_tpot_ms"] > 0 and result["p99_e2el_ms"] >= result["p50_e2el_ms"]
    assert math.isclose(result["request_throughput"], 8 / result["duration"])
    assert math.isclose(result["output_throughput"], 96 / result["duration"])
    out = capsys.readouterr().out
    for label in (
        "============ Serving Benchmark Result ============",
        "Successful requests:",
        "Total generated tokens:",
        "Total Token throughput (tok/s):",
        "---------------Time to First Token----------------",
        "P50 TTFT (ms):",
        "-----Time per Output Token (excl. 1st token)------",
        "Median ITL (ms):",
        "----------------End-to-end Latency----------------",
        "P99 E2EL (ms):",
    ):
        assert label in out


def test_serve_with_64_concurrent_requests_has_no_failures(server, model_path, tmp_path):
    result = run_serve(
        server,
        model_path,
        tmp_path,
        "--num-prompts",
        "64",
        "--max-concurrency",
        "64",
        "--random-input-len",
        "16",
        "--random-output-len",
        "6",
        "--ignore-eos",
    )
    assert result["failed"] == 0 and result["completed"] == 64
    assert result["total_output_tokens"] == 64 * 6


def test_serve_chat_at_a_request_rate_sends_on_schedule(server, model_path, tmp_path):
    result = run_serve(
        server,
        model_path,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "5",
        "--random-input-len",
        "12",
        "--random-output-len",
        "5",
        "--ignore-eos",
        "--request-rate",
        "20",
        "--seed",
        "3",
    )
    assert result["completed"] == 5 and result["total_output_tokens"] == 25
    assert result["total_input_tokens"] > 0  # chat: the server's count of the templated prompt
    starts = result["start_times"]
    for start, arrival in zip(starts, arrival_times(5, 20.0, 1.0, seed=3), strict=True):
        assert start - starts[0] >= arrival - 0.01


def test_serve_counts_http_errors_as_failed_requests(server, model_path, tmp_path):
    result = run_serve(
        server,
        model_path,
        tmp_path,
        "--model",
        "no-such-model",
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
    )
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(e.startswith("HTTP 404") for e in result["errors"])


def test_throughput_generates_exact_token_counts(model_path, tmp_path, capsys):
    argv = [
        "bench",
        "throughput",
        str(model_path),
        "--dtype",
        "float32",
        "--disable-tqdm",
        "--dataset-name",
        "prefix-repetition",
        "--num-prompts",
        "6",
        "--prefix-repetition-prefix-len",
        "16",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "7",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "t.json",
    ]
    assert throughput_main(build_parser().parse_args(argv)) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["num_requests"] == 6
    assert result["total_input_tokens"] == 6 * 24 and result["total_output_tokens"] == 6 * 7
    assert math.isclose(result["output_tokens_per_second"], 42 / result["elapsed_time"])
    assert "Throughput: " in capsys.readouterr().out


def test_summary_uses_linearly_interpolated_percentiles_in_ms():
    s = summarize([0.001, 0.002, 0.003, 0.004], [25, 50, 99])
    assert math.isclose(s.mean_ms, 2.5) and math.isclose(s.median_ms, 2.5)
    assert math.isclose(s.std_ms, math.sqrt(1.25))
    got = dict(s.percentiles_ms)
    assert math.isclose(got[25], 1.75) and math.isclose(got[50], 2.5)
    assert math.isclose(got[99], 3.97)  # rank 0.99 * 3 = 2.97: 3 ms + 0.97 * 1 ms
    assert summarize([], [99]) == (0.0, 0.0, 0.0, [(99, 0.0)])


def _result(ttft: float, latency: float, tokens: int, success: bool = True) -> RequestResult:
    return RequestResult(
        prompt_len=10, success=success, output_tokens=tokens, ttft=ttft, latency=latency
    )


def test_goodput_counts_successful_requests_within_every_slo():
    results = [  # binary-exact times, so the SLO boundaries are exact
        _result(0.125, 1.125, 9),  # tpot 125 ms: meets both, exactly at the tpot SLO
        _result(0.375, 0.625, 3),  # ttft 375 ms: misses ttft
        _result(0.125, 2.125, 9),  # tpot 250 ms: misses tpot
        _result(0.25, 0.25, 1),  # one token: tpot counts as 0; ttft exactly at its SLO
        _result(0.0, 0.0, 0, success=False),  # failed: never good
    ]
    slos = parse_goodput(["ttft:250", "tpot:125"])
    assert slos == {"ttft": 250.0, "tpot": 125.0}
    assert count_good(results, slos) == 2
    assert count_good(results, {"e2el": 1000}) == 2  # latencies 0.625 and 0.25 s
    m = compute_metrics(results, duration=4.0, percentiles=[50], slos_ms=slos)
    assert (m.completed, m.failed, m.request_goodput) == (4, 1, 0.5)
    assert (m.total_input, m.total_output) == (40, 22)
    assert math.isclose(m.summaries["tpot"].mean_ms, (125 + 125 + 250) / 3)  # 1-token excluded
    assert compute_metrics(results, 4.0, [50], {}).request_goodput is None
    assert "Request goodput (req/s):                 0.50" in format_result(
        m, ["ttft"], None, math.inf
    )


@pytest.mark.parametrize("bad", [["ttft"], ["foo:10"], ["tpot:-1"], ["e2el:abc"]])
def test_bad_goodput_is_rejected_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(bad)


def test_bad_percentiles_are_rejected():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError, match="--metric-percentiles"):
        parse_percentiles("0,50")


def test_serve_takes_vllm_bench_serves_backend_and_request_flags(server, model_path, tmp_path):
    """vllm bench serve's --backend openai-chat (the chat endpoint), --served-model-name,
    --input-len / --output-len, the sampling flags, --extra-body and --header reach every
    request: min_tokens from --extra-body makes each reply exactly --output-len tokens;
    --num-warmups sends that many first (the server generates their tokens too), --label and
    --metadata are saved; a backend that contradicts --endpoint, or a header or metadata
    pair that is not KEY=VALUE, is refused."""
    name = server.client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    flags = ["--backend", "openai-chat", "--served-model-name", name, "--num-prompts", "4"]
    flags += ["--input-len", "12", "--output-len", "4", "--top-k", "1", "--top-p", "0.9"]
    flags += ["--extra-body", '{"min_tokens": 4}', "--header", "X-Bench=1"]
    flags += ["--num-warmups", "2", "--label", "run-a", "--metadata", "machine=tiny"]
    flags += ["--ready-check-timeout-sec", "5", "--trust-remote-code"]
    before = server.metrics()[GENERATED]
    result = run_serve(server, model_path, tmp_path, *flags)
    assert result["endpoint"] == "/v1/chat/completions" and result["model_id"] == name
    assert result["completed"] == 4 and result["total_output_tokens"] == 16
    assert (result["label"], result["machine"]) == ("run-a", "tiny")
    assert generated_since(server, before, 24) == 24  # the 2 warm-up requests' tokens too
    for bad in (
        ["--backend", "vllm", "--endpoint", "/v1/chat/completions"],
        ["--header", "x"],
        ["--metadata", "=x"],
    ):
        with pytest.raises(ValueError, match="--backend|--header|--metadata"):
            run_serve(server, model_path, tmp_path, "--num-prompts", "1", *bad)


def test_serve_measures_embeddings_as_vllms_openai_embeddings_backend(tmp_path):
    """--backend openai-embeddings (or --endpoint /v1/embeddings) sends each prompt's token
    ids to /v1/embeddings: exact input lengths from the server's usage, no output tokens, a
    request's latency its TTFT and E2EL; a chat backend with that endpoint is refused."""
    from server_util import InThreadServer
    from tiny import make_tiny_encoder

    path = make_tiny_encoder(tmp_path / "encoder", "bert")
    server = InThreadServer(path, "encoder")
    try:
        flags = ["--served-model-name", "encoder", "--num-prompts", "6", "--input-len", "20"]
        for how in (["--backend", "openai-embeddings"], ["--endpoint", "/v1/embeddings"]):
            result = run_serve(server, path, tmp_path, *flags, *how)
            assert result["endpoint"] == "/v1/embeddings"
            assert result["completed"] == 6 and result["failed"] == 0
            assert result["input_lens"] == [20] * 6 and result["total_output_tokens"] == 0
            assert result["ttfts"] == result["latencies"] and min(result["latencies"]) > 0
            assert math.isclose(result["total_token_throughput"], 120 / result["duration"])
        with pytest.raises(ValueError, match="--backend"):
            run_serve(server, path, tmp_path, *flags, "--backend", "openai-chat",
                      "--endpoint", "/v1/embeddings")  # fmt: skip
    finally:
        server.stop()
