"""`python -m benchmarks storm` against a real tiny-model server: a few streams opened at once, some
cut after their first chunk; the report has its fields, no errors, nothing left running."""

from __future__ import annotations

import json

import pytest
from server_util import ServerProcess

from benchmarks.cli import build_parser
from benchmarks.storm import main as storm_main


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("storm") / "server.log"
    proc = ServerProcess([str(tiny_checkpoint("llama")), "--dtype", "float32"], log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def test_storm_reports_errors_leftovers_and_health_latency(server, tmp_path, capsys):
    result_file = tmp_path / "storm.json"
    argv = ["storm", "--base-url", server.base_url, "--num-streams", "24"]
    argv += ["--cancel-fraction", "0.25", "--max-tokens", "4", "--probe-period", "0.01"]
    argv += ["--result-file", str(result_file)]
    assert storm_main(build_parser().parse_args(argv)) == 0
    printed = capsys.readouterr().out
    for field in ("errors: 0", "left running:", "/health (", "p50", "p99", "max"):
        assert field in printed, printed
    result = json.loads(result_file.read_text())
    assert (result["num_streams"], result["num_cut"], result["errors"]) == (24, 6, 0), result
    assert set(result["left_running"].values()) == {0.0}
    health = result["health_ms"]
    assert health["probes"] >= 1 and health["p50"] <= health["p99"] <= health["max"]
