"""The kernel plan (model/plan.py): chosen once at load from the settings, the config and the
CPU; what it names is what runs (the C++ ops count their calls per instruction set); the
environment is read in conveyor/envs.py only, and never by compiled code."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import gguf_util
import pytest
import torch
from gguf_util import write_gguf

from conveyor import LLM, SamplingParams
from conveyor.model import kernels
from conveyor.model import plan as kernel_plan
from conveyor.model.plan import CpuFeatures, PlanSettings

ROOT = Path(__file__).resolve().parents[2]
AMX_CPU = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx=True)


def _config(quantization: str = "gguf", dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """The fields of a ModelConfig that a plan reads."""
    return SimpleNamespace(
        batch_invariant=True, quantization=quantization, dtype=dtype, head_dim=64
    )


# ---- choosing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("isa", "gemm", "bf16", "tiles"),
    [
        ("auto", "avx512", "amx", True),
        ("amx", "avx512", "amx", True),
        ("avx512", "avx512", "avx512_bf16", False),
        ("avx2", "avx2", "", False),
        ("scalar", "scalar", "", False),
    ],
)
def test_the_isa_setting_caps_every_kernel_of_the_plan(isa, gemm, bf16, tiles):
    plan = kernel_plan.build(PlanSettings(isa=isa), _config(), AMX_CPU)
    assert (plan.gemm_isa, plan.bf16_attention, plan.prompt_tiles) == (gemm, bf16, tiles)
    assert plan.prompt_attention == bool(bf16)
    assert plan.ops()["decode_projections"] == f"panel_blocks[{gemm}]"


def test_the_cpu_caps_the_setting_too():
    avx2_cpu = CpuFeatures(avx2=True)
    plan = kernel_plan.build(PlanSettings(isa="amx"), _config(), avx2_cpu)
    assert (plan.isa, plan.gemm_isa, plan.bf16_attention) == ("avx2", "avx2", "")
    assert plan.ops()["prompt_attention"] == plan.ops()["generated_attention"]


def test_a_model_that_is_not_served_quantized_keeps_prompt_rows_on_its_kernels():
    plan = kernel_plan.build(PlanSettings(), _config("none"), AMX_CPU)
    assert not plan.prompt_tiles and not plan.prompt_attention
    assert plan.ops()["prompt_projections"] == plan.ops()["decode_projections"]
    assert plan.ops()["decode_projections"] == "panel_dense[avx512]"


def test_a_mixture_of_experts_runs_compiled_with_the_dense_layers_kernels_when_invariant():
    """A batch-invariant MoE's layers are one compiled call like a dense model's, its experts
    named on the kernels of the row classes (the prompt tiles, the int8 tiles from the
    switch point); sinks too. Without batch invariance the MoE layers run as modules."""
    from conveyor.model.families import Parts

    cpu = AMX_CPU._replace(amx_int8=True)
    for parts in (Parts(moe_layers=(False, True)), Parts(moe_layers=(True,), attn_sinks=True)):
        config = SimpleNamespace(**vars(_config()), parts=parts)
        plan = kernel_plan.build(PlanSettings(), config, cpu)
        assert (plan.compiled_layers, plan.prompt_tiles, plan.prompt_attention) == (
            True, True, True,
        )  # fmt: skip
        ops = plan.ops()
        assert ops["experts"] == "moe[compiled]"
        assert ops["expert_prompt_projections"] == "amx_bf16_tiles[amx]"
        assert ops["expert_decode_projections"] == (
            "panel_blocks[avx512], amx_int8_tiles[amx] from 32 rows"
        )
    sinks = SimpleNamespace(**vars(_config()), parts=Parts(attn_sinks=True))
    assert "sink layers" in kernel_plan.build(PlanSettings(), sinks, cpu).ops()["prompt_attention"]
    varying = SimpleNamespace(**{**vars(_config()), "batch_invariant": False})
    varying.parts = Parts(moe_layers=(True,))
    plan = kernel_plan.build(PlanSettings(), varying, cpu)
    assert not plan.compiled_layers and plan.ops()["experts"] == "moe[modules]"
    dense = SimpleNamespace(**vars(_config()), parts=Parts())
    plan = kernel_plan.build(PlanSettings(), dense, AMX_CPU)
    assert plan.compiled_layers and "experts" not in plan.ops()


def test_switches_and_missing_kernels_name_the_fallbacks():
    off = PlanSettings(compiled_layers=False, attention="reference")
    plan = kernel_plan.build(off, _config(), AMX_CPU)
    assert (plan.compiled_layers, plan.prompt_tiles, plan.attention) == (False, False, "reference")
    assert plan.ops()["norms"] == "torch"
    bare = kernel_plan.build(PlanSettings(), _config(), CpuFeatures(), compiled=False)
    assert set(bare.ops().values()) <= {"torch", "torch_sdpa"}


def test_the_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ISA", "AVX2")
    monkeypatch.setenv("CONVEYOR_PROMPT_TILES", "0")
    monkeypatch.setenv("CONVEYOR_MATMUL", "kernel")
    assert PlanSettings.from_env() == PlanSettings(isa="avx2", matmul="kernel", prompt_tiles=False)
    monkeypatch.setenv("CONVEYOR_ISA", "sse2")
    with pytest.raises(ValueError, match="CONVEYOR_ISA"):
        PlanSettings.from_env()


def test_generated_rows_take_int8_tiles_from_the_switch_point(monkeypatch):
    """On a CPU with AMX-INT8, a batch-invariant quantized model's generated rows take the int8
    tiles from decode_tiles_from rows on (the lm_head's float activations never); 0, a
    narrower isa, a dense model or a CPU without AMX-INT8 name no tiles."""
    cpu = AMX_CPU._replace(amx_int8=True)
    plan = kernel_plan.build(PlanSettings(), _config(), cpu)
    assert plan.decode_tiles_from == 32
    ops = plan.ops()
    assert ops["decode_projections"] == "panel_blocks[avx512], amx_int8_tiles[amx] from 32 rows"
    assert ops["lm_head"] == "panel_blocks[avx512]"
    later = kernel_plan.build(PlanSettings(decode_tiles_from=64), _config(), cpu)
    assert later.decode_tiles_from == 64
    for settings, cfg, features in [
        (PlanSettings(decode_tiles_from=0), _config(), cpu),
        (PlanSettings(isa="avx512"), _config(), cpu),
        (PlanSettings(), _config("none"), cpu),
        (PlanSettings(), _config(), AMX_CPU),
    ]:
        assert kernel_plan.build(settings, cfg, features).decode_tiles_from == 0
    monkeypatch.setenv("CONVEYOR_DECODE_TILES_FROM", "64")
    assert PlanSettings.from_env().decode_tiles_from == 64
    monkeypatch.setenv("CONVEYOR_DECODE_TILES_FROM", "-1")
    with pytest.raises(ValueError, match="CONVEYOR_DECODE_TILES_FROM"):
        PlanSettings.from_env()


def test_the_summary_is_one_line_of_strings():
    plan = kernel_plan.build(PlanSettings(), _config(), AMX_CPU)
    summary = plan.summary()
    assert all(isinstance(v, str) for v in summary.values())
    assert summary["isa"] == "amx" and "\n" not in plan.log_line()


# ---- what runs is the plan ------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_gguf(tiny_checkpoint, tmp_path_factory):
    """A tiny llama in Q4_1 blocks (served quantized: the panels, the prompt route)."""
    import gguf

    out = tmp_path_factory.mktemp("plan-gguf") / "tiny-Q4_1.gguf"
    with pytest.MonkeyPatch.context() as patch:  # the writer lists F32 and Q8_0 only
        patch.setitem(gguf_util.QTYPES, "Q4_1", gguf.GGMLQuantizationType.Q4_1)
        patch.setitem(gguf_util.FILE_TYPES, "Q4_1", gguf.LlamaFileType.MOSTLY_Q4_1)
        return write_gguf(tiny_checkpoint("llama"), out, "Q4_1")


def _cpu() -> CpuFeatures:
    ops = kernels.load()
    if ops is None:
        pytest.skip("no compiled kernels here")
    return CpuFeatures.detect(ops)


@pytest.mark.parametrize("profile", ["amx", "avx512", "avx2"])
def test_the_plan_is_what_runs(profile, q4_gguf, monkeypatch):
    """Per CPU profile, forced through CONVEYOR_ISA where this CPU has a wider one: the engine's
    plan names it, and the kernels' own call counts show it ran and nothing wider did."""
    if kernel_plan.ISAS.index(_cpu().best()) > kernel_plan.ISAS.index(profile):
        pytest.skip(f"this CPU has no {profile}")
    monkeypatch.setenv("CONVEYOR_ISA", profile)
    ops = kernels.load()
    llm = LLM(str(q4_gguf), dtype="float32", num_blocks=32, max_num_seqs=2)
    plan = llm.engine.core.runner.plan
    assert plan.isa == profile and llm.engine.kernel_plan == plan.summary()
    before = ops.kernel_runs()
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate([list(range(5, 45))], params, use_tqdm=False)
    ran = {k: v - before[k] for k, v in ops.kernel_runs().items()}
    panel_isa = "avx512" if profile == "amx" else profile
    assert ran[f"panel/{panel_isa}"] > 0
    assert all(ran[f"panel/{isa}"] == 0 for isa in ("avx512", "avx2", "scalar") if isa != panel_isa)
    assert (ran["amx/bf16_linear"] > 0) == (plan.prompt_tiles and profile == "amx")
    assert (ran["attention/amx"] > 0) == (plan.bf16_attention == "amx" and plan.prompt_attention)
    bf16_dot = plan.bf16_attention == "avx512_bf16" and plan.prompt_attention
    assert (ran["attention/avx512_bf16"] > 0) == bf16_dot
    if profile == "avx2":
        assert plan.ops()["prompt_attention"] == plan.ops()["generated_attention"]


@pytest.mark.parametrize("tiles_from", [1, 0])
def test_generated_rows_run_the_int8_tiles_the_plan_names(tiles_from, q4_gguf, monkeypatch):
    """CONVEYOR_DECODE_TILES_FROM reaches block_linear through the plan: from 1 every generated
    row's projection ran the tiles, with 0 none did."""
    if not _cpu().amx_int8:
        pytest.skip("this CPU has no AMX-INT8")
    monkeypatch.setenv("CONVEYOR_DECODE_TILES_FROM", str(tiles_from))
    ops = kernels.load()
    llm = LLM(str(q4_gguf), dtype="float32", num_blocks=32, max_num_seqs=2)
    assert ("amx_int8_tiles" in llm.engine.kernel_plan["decode_projections"]) == bool(tiles_from)
    assert ops.amx_int8_from() == tiles_from
    before = ops.kernel_runs()
    llm.generate([list(range(5, 45))], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    ran = {k: v - before[k] for k, v in ops.kernel_runs().items()}
    assert (ran["amx/int8_blocks"] > 0) == bool(tiles_from)


def test_a_quantized_mixtures_experts_take_the_prompt_tiles_and_the_int8_tiles(
    tiny_checkpoint, monkeypatch
):
    """A Qwen3-MoE served quantized (int8) on AMX: every expert's projections have prompt
    tiles; a prompt step's projections all ran them (two per expert run, the router on the
    float panels), and a generated row's expert projections ran the int8 tiles from 1 row, as
    did its greedy argmax over the lm_head (one call)."""
    from conveyor import LLMEngine
    from conveyor.model import prompt_route
    from conveyor.model.moe import MoEMLP

    cpu = _cpu()
    if not (cpu.amx and cpu.amx_int8):
        pytest.skip("this CPU has no AMX-BF16 and AMX-INT8")
    monkeypatch.setenv("CONVEYOR_DECODE_TILES_FROM", "1")
    ops = kernels.load()
    engine = LLMEngine(
        str(tiny_checkpoint("qwen3_moe")), dtype="float32", quantization="int8",
        skip_tokenizer_init=True, num_blocks=32,
    )  # fmt: skip
    model = engine.core.runner.model
    assert prompt_route.route_of(model) == "tiles"
    assert engine.kernel_plan["experts"] == "moe[compiled]"
    assert engine.kernel_plan["expert_prompt_projections"] == "amx_bf16_tiles[amx]"
    layers = model.model.layers
    moe_layers = sum(isinstance(layer.mlp, MoEMLP) for layer in layers)
    assert 0 < moe_layers < len(layers)
    for layer in layers:
        if isinstance(layer.mlp, MoEMLP):
            assert all(e.gate_up_proj.prompt_tiles is not None for e in layer.mlp.experts)
    # dense layers: qkv, o, gate_up, down; MoE layers: qkv, o, then two per expert run
    fixed = 4 * (len(layers) - moe_layers) + 2 * moe_layers
    engine.add_request("a", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=3))
    for name in ("amx/bf16_linear", "amx/int8_blocks"):  # the prompt step, then a decode step
        before = ops.kernel_runs()
        engine.step()
        ran = {k: v - before[k] for k, v in ops.kernel_runs().items()}
        assert ran["moe/experts"] > 0
        argmax = int(name == "amx/int8_blocks")  # the decode step's greedy lm_head
        assert ran[name] == fixed + 2 * ran["moe/experts"] + argmax, name


# ---- the environment is read in one place ---------------------------------------------------


def test_no_kernel_source_reads_the_environment():
    sources = sorted((ROOT / "conveyor/model/kernels").glob("*.[ch]*"))
    assert sources
    readers = [p.name for p in sources if re.search(r"\b(std::)?getenv\s*\(", p.read_text())]
    assert readers == []


def test_only_envs_reads_conveyor_variables():
    pattern = re.compile(r"(os\.environ|os\.getenv|getenv)[^\n]{0,40}[\"']CONVEYOR_")
    files = [*(ROOT / "conveyor").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    readers = [
        str(p.relative_to(ROOT))
        for p in files
        if p.name != "envs.py" and pattern.search(p.read_text())
    ]
    assert readers == []


def test_prompt_attention_off_keeps_prompt_rows_on_the_float_kernel(q4_gguf, monkeypatch):
    """CONVEYOR_PROMPT_ATTENTION=0 reaches attention/paged_attention.cpp through the plan (its
    setter), not the environment: the tiles still run the prompt's projections, no bfloat16
    attention."""
    if not _cpu().amx:
        pytest.skip("this CPU has no AMX-BF16")
    monkeypatch.setenv("CONVEYOR_PROMPT_ATTENTION", "0")
    ops = kernels.load()
    llm = LLM(str(q4_gguf), dtype="float32", num_blocks=32, max_num_seqs=2)
    assert llm.engine.kernel_plan["prompt_attention"] == "paged_attention[float]"
    before = ops.kernel_runs()
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate([list(range(5, 45))], params, use_tqdm=False)
    ran = {k: v - before[k] for k, v in ops.kernel_runs().items()}
    assert ran["amx/bf16_linear"] > 0
    assert ran["attention/amx"] == ran["attention/avx512_bf16"] == 0


def test_the_engine_setting_caps_the_isa_over_the_environment(q4_gguf, monkeypatch):
    """--kernel-isa (EngineArgs.kernel_isa) is the user's setting; CONVEYOR_ISA its default."""
    from conveyor.engine_args import EngineArgs

    with pytest.raises(ValueError, match="kernel_isa"):
        EngineArgs(model=str(q4_gguf), kernel_isa="sse2")
    if not _cpu().avx2:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("CONVEYOR_ISA", "scalar")
    ops = kernels.load()
    llm = LLM(str(q4_gguf), dtype="float32", num_blocks=32, kernel_isa="avx2")
    assert llm.engine.kernel_plan["isa"] == "avx2" and ops.isa() == "avx2"


def test_without_batch_invariance_the_plan_names_the_row_count_kernels():
    cfg = SimpleNamespace(**{**vars(_config()), "batch_invariant": False})
    ops = kernel_plan.build(PlanSettings(), cfg, AMX_CPU).ops()
    assert (ops["decode_projections"], ops["prompt_projections"]) == (
        "quant_gemm[avx2]",
        "dequant_tiles[mkl]",
    )


def test_restore_gives_the_ops_back_every_kernel_the_cpu_runs():
    """conftest restores after each test: an engine's narrowed plan never leaks into the next."""
    cpu = _cpu()
    ops = kernels.load()
    kernel_plan.restore(None)
    kernel_plan.build(PlanSettings(isa="avx2"), _config(), cpu).apply(ops)
    assert ops.isa() != "avx512" and not ops.amx_available()
    kernel_plan.restore(None)
    assert ops.isa() == ("avx512" if cpu.avx512 else "avx2" if cpu.avx2 else "scalar")
    assert ops.amx_available() == cpu.amx


def test_the_int8_route_is_the_plans_and_only_without_batch_invariance(monkeypatch):
    """CONVEYOR_QUANT_INT8=1 reaches model/quant through the plan: int8 copies only where the
    panels do not serve every row count already."""
    monkeypatch.setenv("CONVEYOR_QUANT_INT8", "1")
    settings = PlanSettings.from_env()
    assert not kernel_plan.build(settings, _config(), AMX_CPU).int8_route
    cfg = SimpleNamespace(**{**vars(_config()), "batch_invariant": False})
    plan = kernel_plan.build(settings, cfg, AMX_CPU)
    assert plan.int8_route and plan.ops()["prompt_projections"] == "fbgemm_int8[vnni]"
    assert not plan.settled("none", int8=False).int8_route  # no VNNI: no copies were made
