"""`python -m benchmarks peers`: server commands are built or refused (a missing peer says what to
install), no measured prompt repeats another run's or the warm-up's (a server's prompt cache
must not flatter it), ratios are the first system's to each other one, and the command runs
end to end against real servers on a tiny checkpoint, leaving none of them behind."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys

import pytest

from benchmarks import peers
from benchmarks.cli import main as lab_main


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_default_sitting_runs_the_issues_concurrencies_up_to_128_streams():
    # Where batching is widest is where the peers part (issue 60): 128 streams belong to every
    # sitting, not only to those that ask.
    args = parse()
    assert args.concurrency == [1, 8, 32, 64, 128]
    assert args.systems == ["conveyor", "vllm", "llama", "conveyor"]


def test_custom_systems_parse_and_bad_ones_are_refused():
    systems = peers.custom_systems(["f32=llama-server -m x.gguf --port {port} -t {threads}"])
    argv, env = peers.fill(systems["f32"], 8123, 2)
    assert argv == ["llama-server", "-m", "x.gguf", "--port", "8123", "-t", "2"] and env == {}
    bad = {
        "no-equals-sign": "not NAME=COMMAND",
        "=serve --port {port}": "not NAME=COMMAND",
        "x=serve --port 80": "no {port}",
        "vllm=serve --port {port}": "already a system",
    }
    for spec, message in bad.items():
        with pytest.raises(ValueError, match=message):
            peers.custom_systems([spec])
    with pytest.raises(ValueError, match="already a system"):
        peers.custom_systems(["a=x {port}", "a=y {port}"])


def test_a_missing_peer_says_how_to_install_it(tmp_path):
    args = parse("--vllm-dir", str(tmp_path / "none"), "--llama-server", str(tmp_path / "none"))
    for name in ("vllm", "llama"):
        with pytest.raises(ValueError, match='"The peers"'):
            peers.build_system(name, args, {})
    with pytest.raises(ValueError, match="none of conveyor, vllm, llama"):
        peers.build_system("sglang", args, {})


def test_built_in_commands(tmp_path):
    vllm_dir = tmp_path / "vllm"
    (vllm_dir / "venv" / "bin").mkdir(parents=True)
    (vllm_dir / "venv" / "bin" / "vllm").touch()
    (vllm_dir / "venv" / "lib").mkdir()
    (vllm_dir / "venv" / "lib" / "libiomp5.so").touch()
    (vllm_dir / "smollm2-bf16").mkdir()
    server = tmp_path / "llama-server"
    server.touch()
    args = parse(
        "--vllm-dir", str(vllm_dir), "--llama-server", str(server), "--llama-model", "m.gguf",
        "--concurrency", "1", "8", "64",
        "--conveyor-args", """--max-step-ms 100 --speculative-config '{"method": "ngram"}'""",
    )  # fmt: skip
    conveyor, env = peers.fill(peers.build_system("conveyor", args, {}), 9000, 2)
    assert conveyor[:4] == [sys.executable, "-m", "conveyor", "serve"] and env == {}
    assert "--no-enable-prefix-caching" in conveyor
    assert conveyor[-4:] == ["--max-step-ms", "100", "--speculative-config", '{"method": "ngram"}']
    assert conveyor[conveyor.index("--port") + 1] == "9000"
    assert conveyor[conveyor.index("--num-threads") + 1] == "2"
    vllm, env = peers.fill(peers.build_system("vllm", args, {}), 9001, 2)
    assert vllm[:3] == [str(vllm_dir / "venv/bin/vllm"), "serve", str(vllm_dir / "smollm2-bf16")]
    assert "--no-enable-prefix-caching" in vllm and "bfloat16" in vllm
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # the model on both cores
    assert env["LD_PRELOAD"].endswith(str(vllm_dir / "venv/lib/libiomp5.so"))
    llama, _ = peers.fill(peers.build_system("llama", args, {}), 9002, 2)
    assert llama[:3] == [str(server), "-m", "m.gguf"]
    assert llama[llama.index("-np") + 1] == "64"  # a slot per stream of the widest run
    assert llama[llama.index("-t") + 1] == llama[llama.index("-tb") + 1] == "2"


def test_no_measured_prompt_repeats_another_runs_or_the_warm_ups():
    from conveyor.bench.serve import load_tokenizer

    args = parse("--concurrency", "1", "2", "4", "--input-len", "20", "--output-len", "4")
    warmup, runs = peers.workloads(args, load_tokenizer(None))
    assert [len(r) for r in runs] == [4, 4, 8] and len(warmup) == peers.WARMUP[0]
    seen = {tuple(r.prompt_token_ids) for r in warmup}
    for run in runs:
        prompts = {tuple(r.prompt_token_ids) for r in run}
        assert not prompts & seen, "a prompt repeats: a prompt cache would serve it"
        seen |= prompts
    again = peers.workloads(args, load_tokenizer(None))[1]
    assert [[r.prompt_token_ids for r in run] for run in again] == [
        [r.prompt_token_ids for r in run] for run in runs
    ]


def test_ratios_are_the_first_systems_to_each_other_one():
    def run(system, c, tps, ttft, itl, failed=0):
        return {
            "system": system, "concurrency": c, "output_throughput": tps,
            "mean_ttft_ms": ttft, "p99_itl_ms": itl, "failed": failed,
        }  # fmt: skip

    runs = [
        run("conveyor", 8, 300, 400, 180),
        run("vllm", 8, 150, 500, 200),
        run("conveyor", 8, 200, 600, 220, failed=1),
        run("vllm", 32, 100, 900, None),
    ]
    summary = peers.summarize(runs, ["conveyor", "vllm", "conveyor"])
    mine = summary["table"]["conveyor"][8]
    assert (mine["output_throughput"], mine["mean_ttft_ms"], mine["runs"]) == (250, 500, 2)
    assert mine["failed"] == 1
    ratio = summary["ratios"]["vllm"][8]
    assert ratio["output_throughput"] == pytest.approx(250 / 150)
    assert ratio["mean_ttft_ms"] == pytest.approx(1.0) and ratio["p99_itl_ms"] == 1.0
    assert 32 not in summary["ratios"]["vllm"]  # conveyor did not run it
    text = peers.format_summary(summary, [8, 32])
    assert "250.0 (500; 200) 1 failed" in text and "1.67x" in text


def test_bench_peers_runs_each_server_alone_and_stops_it(tiny_checkpoint, tmp_path, capsys):
    model = str(tiny_checkpoint("llama"))
    other = (
        f"{shlex.quote(sys.executable)} -m conveyor serve {shlex.quote(model)} --dtype float32 "
        "--port {port} --num-threads {threads} --no-enable-prefix-caching --max-num-seqs 1"
    )
    argv = [
        "peers", model, "--dtype", "float32", "--systems", "conveyor", "one-seat",
        "--system", f"one-seat={other}", "--concurrency", "1", "2",
        "--input-len", "12", "--output-len", "5", "--range-ratio", "0",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "peers.json",
    ]  # fmt: skip
    assert lab_main(argv) == 0
    report = json.loads((tmp_path / "peers.json").read_text())
    assert [(r["system"], r["concurrency"]) for r in report["runs"]] == [
        ("conveyor", 1), ("conveyor", 2), ("one-seat", 1), ("one-seat", 2),
    ]  # fmt: skip
    for run in report["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0, run
        assert run["output_throughput"] > 0 and run["mean_ttft_ms"] > 0
    assert set(report["summary"]["ratios"]["one-seat"]) == {"1", "2"}  # JSON keys
    out = capsys.readouterr().out
    assert "conveyor against one-seat:" in out and "output tok/s" in out
    assert out.count("starting: ") == 2, "a server was started twice"
    logs = sorted(tmp_path.glob("*.log"))
    assert [p.name.split("-")[0] for p in logs].count("conveyor") == 1 and len(logs) == 2
    for log in logs:  # every server is gone: nothing listens on its port any more
        port = int(log.stem.rsplit("-", 1)[1])
        assert _listening(port) is False, f"{log.name}'s server outlived the sitting"


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_server_that_does_not_start_is_reported_and_the_sitting_goes_on(tmp_path, capsys):
    broken = f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(3)' {{port}}"
    argv = ["peers", "--systems", "broken", "--system", f"broken={broken}"]
    argv += ["--concurrency", "1", "--result-dir", str(tmp_path)]
    assert lab_main(argv) == 1
    captured = capsys.readouterr()
    assert "broken: did not start: the server exited (3)" in captured.out
    assert "did not start: broken" in captured.err
    assert "broken" in captured.out.split("the mean over a system's runs")[1]  # its row: "-"
