"""`python -m benchmarks step` on a tiny random checkpoint: a real run over the real engine and
ModelRunner, with a grid small enough to take a few seconds."""

from __future__ import annotations

import json

import pytest
from conftest import run_lab
from torch import nn

from benchmarks import step
from benchmarks.cli import build_parser, main

BATCHES, CONTEXTS, CHUNK = (1, 4), (16, 200), 24
KV_MEMORY = 2**20  # 32 blocks of the tiny llama in float64: batch 4 at context 200 does not fit
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """One `python -m benchmarks step` run: (printed table, saved JSON, plot path, config)."""
    out = tmp_path_factory.mktemp("step")
    path = tiny_checkpoint("llama")
    argv = ["step", str(path), "--batches", ",".join(map(str, BATCHES))]
    argv += ["--contexts", ",".join(map(str, CONTEXTS)), "--prefill-chunks", str(CHUNK)]
    argv += ["--repeats", "5", "--warmup", "2", "--kv-cache-memory", str(KV_MEMORY)]
    argv += ["--output", str(out / "step.json"), "--plot", str(out / "step.png")]
    # One thread: two OpenMP threads on a shared 2-core machine stall each other's barriers.
    argv += ["--num-threads", "1", "--disable-tqdm"]
    stdout = run_lab(argv)
    config = json.loads((path / "config.json").read_text())
    return stdout, json.loads((out / "step.json").read_text()), out / "step.png", config


def test_every_case_that_fits_is_measured_and_the_rest_skipped_with_a_reason(run):
    table, report, _, _ = run
    names = {case["case"] for case in report["cases"]}
    expected = {f"decode b={b} ctx={c}" for b in BATCHES for c in CONTEXTS} | {f"prefill {CHUNK}"}
    assert names == expected - {"decode b=4 ctx=200"}
    assert [s["case"] for s in report["skipped"]] == ["decode b=4 ctx=200"]
    assert "KV blocks" in report["skipped"][0]["reason"]
    for name in names:
        assert name in table
    assert "skipped decode b=4 ctx=200" in table


def test_steps_have_the_asked_shape_and_positive_times(run):
    _, report, _, _ = run
    for case in report["cases"]:
        decode = case["kind"] == "decode"
        assert case["num_tokens"] == (case["batch"] if decode else case["length"])
        # the last timed decode step attends to exactly `length` tokens: the whole batch
        # prefills in one step here, so no request decodes ahead of the others
        assert case["mean_context"] == case["length"]
        assert case["step_ms"] > case["runner_ms"] > 0
        assert case["engine_ms"] > 0
        assert case["tokens_per_s"] == pytest.approx(case["num_tokens"] / case["step_ms"] * 1e3)


@pytest.mark.serial  # a ratio of wall-clock times: run alone, after the parallel phase
def test_breakdown_parts_add_up_to_about_the_step(run):
    """Also where the decode steps run the compiled layers (kernels/layer/decoder_layer.cpp),
    which time their own projections and attention."""
    table, report, _, _ = run
    assert set(report["matmul_forms"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert "matmul form by rows: 1 " in table
    for case in report["cases"]:
        parts = case["breakdown_ms"]
        assert set(parts) == set(step.CATEGORIES)
        for name in ("projections", "attention", "other", "logits_sampling", "engine"):
            assert parts[name] > 0, (case["case"], name)
        # hooks add a little, and a shared CPU is noisy: a factor of 2 either way is a bug
        ratio = sum(parts.values()) / case["step_ms"]
        assert 0.5 < ratio < 2.0, (case["case"], parts, case["step_ms"])


def test_floor_counts_the_tiny_models_bytes_and_is_the_larger_bound(run):
    _, report, _, cfg = run
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    per_layer = hidden * (2 * q + 2 * kv + 3 * inter) + 2 * hidden  # projections + 2 norms
    matrices = layers * per_layer + hidden + cfg["vocab_size"] * hidden  # final norm, lm_head
    kv_per_token = 2 * layers * kv * 8  # K and V of every layer, float64
    for case in report["cases"]:
        floor = case["floor"]
        rows = case["num_tokens"] * hidden  # the untied embedding is read only by its rows
        assert floor["weight_bytes"] == (matrices + rows) * 8
        assert floor["kv_bytes"] == kv_per_token * case["batch"] * case["mean_context"]
        assert floor["flops"] > 2 * case["num_tokens"] * layers * per_layer
        assert floor["ms"] == max(floor["memory_ms"], floor["compute_ms"]) > 0
        work = floor["work"]
        assert {part: w["roof"] for part, w in work.items()} == dict.fromkeys(
            ("projections", "logits", "attention"), "f64_fma"
        )
        projection_weights = layers * (per_layer - 2 * hidden)
        assert work["projections"]["ops"] == 2 * case["num_tokens"] * projection_weights
        assert sum(w["ops"] for w in work.values()) == floor["flops"]
        assert floor["compute_ms"] == pytest.approx(sum(w["ms"] for w in work.values()))
        for w in work.values():  # each part at the measured peak of its instructions
            assert w["ms"] == pytest.approx(w["ops"] / (report["roofs_gops"][w["roof"]] * 1e6))
        assert floor["bound"] == (
            "memory" if floor["memory_ms"] >= floor["compute_ms"] else "compute"
        )
        assert case["pct_of_floor"] == pytest.approx(floor["ms"] / case["step_ms"] * 100)
    assert report["memory_bandwidth_gb_s"] > 0.1
    assert report["num_threads"] == 1
    roofs = report["roofs_gops"]  # the kernels' instructions, measured in the same run
    assert report["isa"] in ("avx512", "avx2", "scalar")
    # Each roof is measured, not looked up; their order is the hardware's and a loaded machine
    # (CI runs two test workers on two cores) can swap two close ones, so only their presence.
    assert min(roofs["f32_fma"], roofs["f64_fma"], roofs["int8_dot"]) > 0
    # AMX tiles where the prompt route can run (model/prompt_route.py), 0 elsewhere
    from conveyor.model import kernels

    assert (roofs["amx_bf16"] > roofs["f32_fma"]) == kernels.load().amx_available()


def test_plot_is_a_png(run):
    _, _, plot, _ = run
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert plot.stat().st_size > 10_000


def test_classification_is_by_module_so_quantized_and_compiled_ops_keep_their_category():
    class QuantLinear(nn.Module):  # a stand-in for a quantized projection
        pass

    class FancyAttention(nn.Module):
        pass

    assert step.classify("model.layers.0.mlp.down_proj", QuantLinear()) == "projections"
    assert step.classify("model.layers.0.self_attn.qkv_proj", nn.Module()) == "projections"
    assert step.classify("model.layers.0.self_attn", FancyAttention()) == "attention"
    assert step.classify("model.layers.0.input_layernorm", nn.LayerNorm(4)) == "other"
    assert step.classify("lm_head", nn.Linear(2, 2)) == "logits_sampling"
    assert step.classify("model.layers.0.mlp", nn.Module()) is None  # inherits its parent's
    assert step.classify("", nn.Module()) == "other"


def test_bad_arguments_are_refused_with_the_flag_named(capsys):
    assert main(["step", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["step", "--batches", "1,x"])


def test_a_step_faster_than_its_floor_is_flagged_as_measured_under_interference(run):
    _, report, _, _ = run
    assert "warning" not in step.format_table(report | {"cases": report["cases"][:1]}) or (
        report["cases"][0]["pct_of_floor"] > 100
    )
    fast = dict(report["cases"][0], pct_of_floor=150.0)
    table = step.format_table(report | {"cases": [fast]})
    assert f"warning: {fast['case']} ran faster than the floor" in table


def test_a_hybrids_batch_past_its_state_slots_is_skipped_with_the_reason(tmp_path):
    """A hybrid seats as many sequences as its state slots: a decode case past them is skipped
    with the reason (it used to wait for a pure decode step that never formed, then raise)."""
    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "hybrid", "granite4-h")
    out = tmp_path / "step.json"
    argv = ["step", str(path), "--batches", "1,6", "--contexts", "16", "--prefill-chunks", "8"]
    argv += ["--repeats", "2", "--warmup", "1", "--kv-cache-memory", "256KiB"]
    argv += ["--output", str(out), "--num-threads", "1", "--disable-tqdm"]
    table = run_lab(argv)
    report = json.loads(out.read_text())
    assert [s["case"] for s in report["skipped"]] == ["decode b=6 ctx=16"]
    assert "recurrent state slots" in report["skipped"][0]["reason"]
    assert {case["case"] for case in report["cases"]} == {"decode b=1 ctx=16", "prefill 8"}
    assert "skipped decode b=6 ctx=16" in table
