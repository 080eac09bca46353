"""The kernel plan: which kernel and instruction set runs each op, chosen once at load.

Built from three things only: the settings (the CONVEYOR_* switches, conveyor/envs.py), the
model's config, and the CPU's features as the compiled kernels detect them (`cpu_features`).
`apply` hands its choices to the C++ ops, which never read the environment: the panel
kernels' instruction set (set_isa), whether the AMX tiles and AVX512-BF16 may run, whether
prompt rows take the bfloat16 attention. The code that picks a route at run time consults the
applied plan (`current`): llama.py's compiled layers, prompt_route's tiles and attention.

The instruction sets form one ladder, amx > avx512 > avx2 > scalar: CONVEYOR_ISA caps it, the
CPU caps it, and each kernel takes the widest rung it has (the panel GEMMs stop at avx512; the
prompt rows' attention runs AMX or AVX512-BF16, else none). Which rows take which kernel is
named per row class: a prompt token's row (`prompt`) and a generated token's (`decode`), the
split model/prompt_route.py keeps for determinism.

The C++ choices are process-wide (one CPU, one set of kernels), so the applied plan is too:
an explicit registry of one, replaced by the next `apply`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, Protocol

import torch

from conveyor import envs
from conveyor.envs import ISAS

logger = logging.getLogger(__name__)


class ModelFacts(Protocol):
    """What a plan reads of a ModelConfig (a Protocol: model/config.py imports model/quant,
    which consults the plan, so the plan does not import the config)."""

    batch_invariant: bool
    quantization: str
    dtype: torch.dtype
    head_dim: int


class CpuFeatures(NamedTuple):
    """What this CPU and the kernels' build run, whatever a plan allows."""

    avx2: bool = False
    avx512: bool = False  # AVX-512 F, BW and VNNI: the panel kernels' widest path
    avx512_bf16: bool = False  # bfloat16 dot products: the prompt attention without tiles
    amx: bool = False  # AMX-BF16 tiles, permitted to this process
    amx_int8: bool = False  # AMX-INT8 tiles too: generated rows' int8 blocks

    @classmethod
    def detect(cls, ops: ModuleType | None) -> CpuFeatures:
        """As the compiled kernels see them; none without the kernels."""
        return cls() if ops is None else cls(**ops.cpu_features())

    def best(self) -> str:
        """The widest rung of the ladder this CPU runs."""
        ladder = (self.amx, self.avx512, self.avx2, True)
        return ISAS[ladder.index(True)]


class PlanSettings(NamedTuple):
    """The settings a plan is built from (the defaults: every kernel the CPU allows)."""

    isa: str = "auto"
    matmul: str = "auto"
    compiled_layers: bool = True
    prompt_tiles: bool = True
    prompt_attention: bool = True
    attention: str = "auto"
    quant_int8: bool = False
    decode_tiles_from: int = 32

    @classmethod
    def from_env(cls, isa: str | None = None) -> PlanSettings:
        """The switches in the environment; isa: the engine's setting, over CONVEYOR_ISA."""
        return cls(
            isa or envs.isa(),
            envs.matmul(),
            envs.compiled_layers(),
            envs.prompt_tiles(),
            envs.prompt_attention(),
            envs.attention(),
            envs.quant_int8(),
            envs.decode_tiles_from(),
        )


def _cap(isa: str, ceiling: str) -> str:
    """The narrower of two rungs."""
    return max(isa, ceiling, key=ISAS.index)


@dataclass(frozen=True)
class KernelPlan:
    """Every choice of kernel, made once; the row classes' kernels are derived (`ops`)."""

    isa: str  # the widest rung any kernel runs: amx | avx512 | avx2 | scalar
    gemm_isa: str  # the panel GEMMs': avx512 | avx2 | scalar
    bf16_attention: str  # the prompt attention's engine where allowed: amx | avx512_bf16 | ""
    compiled: bool  # the C++ kernels are loaded and the model runs on the CPU
    compiled_layers: bool  # a step's layers as one compiled call (kernels/layer/decoder_layer.cpp)
    batch_invariant: bool  # projections on the panels: one reduction order at every row count
    quantized: bool  # block weights (GGUF / int8 formats) rather than dense ones
    attention: str  # compiled | reference
    matmul: str  # the non-invariant matmul forms: measured | linear | transposed | kernel
    prompt_tiles: bool  # prompt rows' projections may take AMX bfloat16 tiles
    prompt_attention: bool  # prompt rows' attention may take bfloat16
    int8_route: bool = False  # blocks without batch invariance: fbgemm int8 from 16 rows on
    # Generated rows' block projections on AMX-INT8 tiles from this many rows in a call (0:
    # never): the panel kernel's bits (kernels/gemm/amx_gemm.cpp), so the count is free to move.
    decode_tiles_from: int = 0
    # The layers whose attention the bfloat16 tiles cannot run (sliding window, soft-capped
    # scores: model/families.py); their prompt rows take the generated rows' kernel. "" none.
    special_attention: str = ""
    # A mixture of experts' MLP: "compiled" (kernels/layer/decoder_layer.cpp's MoE, each
    # expert's projections on the kernels named for its rows' class), "modules" (model/moe.py),
    # "" a dense model.
    experts: str = ""
    settings: PlanSettings = PlanSettings()

    def ops(self) -> dict[str, str]:
        """op -> kernel[isa], by row class: what the summary shows and the tests check."""
        decode = self._projection(prompt=False, int8_tiles=True)
        prompt = "amx_bf16_tiles[amx]" if self.prompt_tiles else self._projection(prompt=True)
        generated = "paged_attention[float]" if self.attention == "compiled" else "torch_sdpa"
        prompt_attn = f"amx_attention[{self.bf16_attention}]" if self.prompt_attention else ""
        if prompt_attn and self.special_attention:
            prompt_attn += f" ({self.special_attention} layers: {generated})"
        norms = "rms_norm[compiled]" if self.compiled_layers else "torch"
        ops = {
            "decode_projections": decode,
            "prompt_projections": prompt,
            "generated_attention": generated,
            "prompt_attention": prompt_attn or generated,
            "lm_head": self._projection(prompt=False),  # float activations: no int8 tiles
            "norms": norms,
        }
        if self.experts:  # the row counts that pick a kernel are each expert's own
            ops["experts"] = "moe[compiled]" if self.experts == "compiled" else "moe[modules]"
            ops["expert_decode_projections"] = decode
            ops["expert_prompt_projections"] = prompt
        return ops

    def _projection(self, prompt: bool, int8_tiles: bool = False) -> str:
        """Without batch invariance the kernel follows the row count (model/quant: the block
        kernel below DEQUANT_FROM_TOKENS rows, then MKL on dequantized tiles; layers: the
        measured forms up to 64 rows, then ATen); a prompt chunk is named by its many rows."""
        if not self.compiled:
            return "torch"
        if self.batch_invariant:
            weights = "blocks" if self.quantized else "dense"
            panel = f"panel_{weights}[{self.gemm_isa}]"
            if self.decode_tiles_from and int8_tiles:
                panel += f", amx_int8_tiles[amx] from {self.decode_tiles_from} rows"
            return panel
        if self.quantized and prompt:
            return "fbgemm_int8[vnni]" if self.int8_route else "dequant_tiles[mkl]"
        if self.quantized:
            return "quant_gemm[avx2]"
        return "aten_linear[mkl]" if prompt else f"matmul[{self.matmul}]"

    def summary(self) -> dict[str, str]:
        """The plan as a small dict of strings: logged at start, sent to the front end."""
        return {"isa": self.isa if self.compiled else "torch", **self.ops()}

    def log_line(self) -> str:
        return "kernel plan: " + ", ".join(f"{k}={v}" for k, v in self.summary().items())

    def settled(self, route: str, int8: bool = False) -> KernelPlan:
        """The plan once the model is loaded: prompt_route.choose may have declined the tiles
        (memory) or the route ("tiles" | "attention" | "none"), and the int8 copies need VNNI
        (int8: whether the modules got them); the plan then says so."""
        tiles = self.prompt_tiles and route == "tiles"
        attention = self.prompt_attention and route != "none"
        int8_route = self.int8_route and int8
        return dataclasses.replace(
            self, prompt_tiles=tiles, prompt_attention=attention, int8_route=int8_route
        )

    def with_attention(self, compiled: bool) -> KernelPlan:
        """The plan once the runner knows whether the attention kernels take its dtypes."""
        return dataclasses.replace(self, attention="compiled" if compiled else "reference")

    def apply(self, ops: ModuleType | None) -> KernelPlan:
        """Hands the choices to the C++ ops (process-wide) and makes this the current plan."""
        global _current
        if ops is not None:
            ops.set_isa(self.gemm_isa)
            ops.set_amx(self.isa == "amx")
            ops.set_amx_int8_from(self.decode_tiles_from)
            ops.set_bf16_dot(self.bf16_attention != "")
            # the switch, not this model's route: prompt rows reach the kernel only on a route
            ops.set_prompt_attention(self.settings.prompt_attention)
        _current = self
        return self


_current: KernelPlan | None = None


def build(
    settings: PlanSettings, cfg: ModelFacts, features: CpuFeatures, compiled: bool = True
) -> KernelPlan:
    """The plan for a model: compiled says whether the C++ kernels are loaded and the model
    runs on the CPU (else every op is PyTorch's)."""
    best = features.best()
    isa = best if settings.isa == "auto" else _cap(settings.isa, best)
    panel_best = "avx512" if features.avx512 else "avx2" if features.avx2 else "scalar"
    bf16 = "amx" if isa == "amx" else ""
    if isa == "avx512" and features.avx512_bf16:
        bf16 = "avx512_bf16"
    invariant = compiled and cfg.batch_invariant
    layers = compiled and settings.compiled_layers and not _modules_only(cfg, invariant)
    quantized = cfg.quantization != "none"
    # prompt_route.py's conditions that the config answers (the model's modules settle the rest)
    route = layers and invariant and quantized and cfg.dtype == torch.float32
    route = route and cfg.head_dim % 16 == 0
    decode_tiles = invariant and quantized and isa == "amx" and features.amx_int8
    return KernelPlan(
        isa=isa,
        gemm_isa=_cap(_cap(isa, "avx512"), panel_best),
        bf16_attention=bf16,
        compiled=compiled,
        compiled_layers=layers,
        batch_invariant=invariant,
        quantized=quantized,
        attention="compiled" if compiled and settings.attention != "reference" else "reference",
        matmul="measured" if settings.matmul == "auto" else settings.matmul,
        prompt_tiles=route and settings.prompt_tiles and isa == "amx",
        prompt_attention=route and settings.prompt_attention and bf16 != "",
        int8_route=quantized and not invariant and settings.quant_int8,
        decode_tiles_from=settings.decode_tiles_from if decode_tiles else 0,
        special_attention=_special_attention(cfg),
        experts=_experts(cfg, layers),
        settings=settings,
    )


def _modules_only(cfg: ModelFacts, invariant: bool) -> bool:
    """Layers the compiled decoder layer does not hold run as modules (around the compiled
    projections, attention and norms): a mixture of experts without batch invariance (the
    kernel of a projection would follow each expert's rows there, model/llama.py)."""
    parts = getattr(cfg, "parts", None)
    return parts is not None and any(parts.moe_layers) and not invariant


def _experts(cfg: ModelFacts, layers: bool) -> str:
    parts = getattr(cfg, "parts", None)
    if parts is None or not any(parts.moe_layers):
        return ""
    return "compiled" if layers else "modules"


def _special_attention(cfg: ModelFacts) -> str:
    parts = getattr(cfg, "parts", None)
    if parts is None:
        return ""
    kinds = ["sliding-window"] if any(parts.windows) else []
    kinds += ["soft-capped"] if parts.attn_softcap else []
    return "/".join(kinds + (["sink"] if parts.attn_sinks else []))


def applied() -> KernelPlan | None:
    """The plan the C++ ops follow now, if any was applied."""
    return _current


def restore(previous: KernelPlan | None) -> None:
    """Puts back a plan applied() returned earlier; None: no plan, the C++ ops' defaults (every
    kernel the CPU runs allowed). Tests use it so that one engine's plan never outlives them."""
    global _current
    if previous is _current:
        return
    from conveyor.model import kernels

    ops = kernels.load()
    if previous is not None:
        previous.apply(ops)
        return
    _current = None
    if ops is not None:
        ops.set_isa("auto")
        ops.set_amx(True)
        ops.set_amx_int8_from(PlanSettings().decode_tiles_from)
        ops.set_bf16_dot(True)
        ops.set_prompt_attention(True)


def current(cfg: ModelFacts) -> KernelPlan:
    """The applied plan; where none was (a model loaded without a runner), the one the
    environment and this CPU give for cfg, applied now."""
    if _current is not None:
        return _current
    from conveyor.model import kernels

    ops = kernels.load()
    return build(PlanSettings.from_env(), cfg, CpuFeatures.detect(ops), ops is not None).apply(ops)
