"""Building blocks of the Llama family, written to match transformers' arithmetic exactly."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from conveyor import envs
from conveyor.paths import write_atomic


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it: normalized in float32 (also for float64 models), then
    scaled by w in the model dtype (Llama), or with offset by 1 + w in float32 before the cast
    (Gemma's norms, whose checkpoints store w - 1), or by w in float32 before it (Nemotron-H's)."""

    def __init__(
        self, hidden_size: int, eps: float, offset: bool = False, float32_scale: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        # w multiplied in float32 before the cast (Nemotron-H's norms), without the offset
        self.float32_scale = float32_scale or offset
        self._scale: tuple[int, torch.Tensor] | None = None  # (weight version, 1 + w)

    def scale_weight(self) -> torch.Tensor:
        """What the normalized rows are multiplied by: w, or 1 + w in float32, or w in float32
        (computed once per value of w)."""
        if not self.float32_scale:
            return self.weight
        version = self.weight._version
        if (
            self._scale is None
            or self._scale[0] != version
            or self._scale[1].device != self.weight.device
        ):
            weight = self.weight.detach().float()
            self._scale = (version, 1.0 + weight if self.offset else weight)
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            ops = _ops() if x.device.type == "cpu" else None
            if ops is not None:  # the compiled layers' row loop: one pass, no temporaries
                return ops.rms_norm(x, self.scale_weight(), self.eps)
            return torch.rms_norm(x, self.weight.shape, self.scale_weight(), self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float32_scale:
            return (h * self.scale_weight()).to(dtype)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_len, computed once as transformers computes them:
    float32 frequencies and angles, then cast to the model dtype."""

    def __init__(
        self, inv_freq: Sequence[float], scaling: float, max_len: int, dtype: torch.dtype
    ) -> None:
        """inv_freq, scaling: ModelConfig's rope_inv_freq and rope_scaling."""
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            inv_freq = torch.tensor(inv_freq, dtype=torch.float32)
            positions = torch.arange(max_len, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
            cos, sin = emb.cos() * scaling, emb.sin() * scaling
            if scaling != 1 and not inv_freq.all():
                # Dims RoPE does not turn (partial rotary: frequency 0, model/config.py
                # rotary_rows) are not scaled either: cos 1, sin 0.
                turned = torch.cat((inv_freq, inv_freq)) != 0
                cos, sin = torch.where(turned, cos, 1.0), torch.where(turned, sin, 0.0)
        self.cos = nn.Buffer(cos.to(dtype), persistent=False)
        self.sin = nn.Buffer(sin.to(dtype), persistent=False)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) of the step's positions: gathered once per step, used by every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, Hkv, D)
        cos: torch.Tensor,  # (T, D)
        sin: torch.Tensor,
        ops: ModuleType | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q, k; with the compiled ops (CPU) rotated in place, in one call for both."""
        if ops is not None and q.device.type == "cpu" and q.dtype == cos.dtype:
            ops.rotary_embedding(q, k, cos, sin)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, D)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), for modules not packed for the batch-invariant panel kernels
    (pack_panels; packed is the default on CPU). On CPU the decode steps' few token rows make
    this a stream of the weights from memory, and three ways of computing it differ a lot
    there, by machine and token count: MKL's x @ W.T, MKL's (W @ x.T).T (a transposed view,
    which every consumer here accepts), and the compiled small-row kernel
    (kernels/gemm/small_gemm.cpp). On a 2-core Zen 3,
    (W @ x.T).T made 4-request steps 211 -> 94 ms against x @ W.T; on a 2-core Sapphire Rapids
    Xeon x @ W.T is 2.3x faster than it at 2 tokens, and the kernel 1.6x faster than both at 8
    (SmolLM2-135M's projections, streamed from memory). So each process measures them once per
    power-of-two token count (`matmul_forms`) and uses the fastest."""
    if x.device.type != "cpu" or x.dim() != 2:
        return nn.functional.linear(x, weight, bias)
    form = matmul_form(x)
    if form == "linear" or not weight.is_contiguous():
        return nn.functional.linear(x, weight, bias)
    out = _ops().small_gemm(x, weight) if form == "kernel" else (weight @ x.T).T
    return out if bias is None else out + bias


def matmul_form(x: torch.Tensor) -> str:
    """The form `linear` computes x's rows with on the CPU: "linear", "transposed" or
    "kernel" (see matmul_forms); "linear" from 128 rows on."""
    return matmul_forms(x.dtype).get(_bucket(x.shape[0]), "linear")


def _bucket(num_tokens: int) -> int:
    return 1 << max(num_tokens - 1, 0).bit_length()


MATMUL_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # above 64 tokens x @ W.T is used: MKL's own ground
# The kernel is kept when it is at most this much slower than MKL in isolation: with it the
# model runs its layers as one compiled call, which saved ~28% of a one-row float32 step here
# (model/kernels/layer/decoder_layer.cpp), far more than a near tie between matmuls could cost.
KERNEL_MARGIN = 1.15


def matmul_forms(dtype: torch.dtype) -> dict[int, str]:
    """The fastest form here per power-of-two token count (1 to 64): "linear" (x @ W.T),
    "transposed" ((W @ x.T).T) or "kernel" (the compiled small-row kernel, when it builds).
    CONVEYOR_MATMUL=linear|transposed|kernel forces one form for every count (tests run the
    kernel through the model this way). The set-up's warm-up measures them on a quiet machine
    and keeps them in conveyor's cache (matmul_forms/, per machine, thread count and dtype;
    `keep_measured_forms`): later starts read them, so none pays ~1.5 s for a measurement or
    picks other forms from one disturbed by a neighbour. Without a kept file a process measures
    for itself, once (the runner calls this at load, so no request pays for it), and keeps it
    to itself: a measurement under load is not written for others to trust."""
    forced = envs.matmul()
    if forced and forced != "auto":
        if forced not in ("linear", "transposed", "kernel"):
            raise ValueError(f"CONVEYOR_MATMUL={forced!r}: expected linear, transposed or kernel")
        if forced == "kernel" and _kernel_ops(dtype) is None:
            forced = "linear"
        return dict.fromkeys(MATMUL_BUCKETS, forced)
    return _measured_forms(dtype)


def _kernel_ops(dtype: torch.dtype) -> ModuleType | None:
    """The compiled ops when the small-row kernel runs this dtype (float32, float64)."""
    return _ops() if dtype in (torch.float32, torch.float64) else None


@functools.cache
def _ops() -> ModuleType | None:
    from conveyor.model import kernels

    return kernels.load()


@functools.cache
def _measured_forms(dtype: torch.dtype) -> dict[int, str]:
    """The forms kept for this machine, else measured now (for this process only)."""
    ops = _kernel_ops(dtype)
    return _kept_forms(dtype, ops) or _measure_forms(dtype, ops)


def _kept_forms(dtype: torch.dtype, ops: ModuleType | None) -> dict[int, str] | None:
    """The forms kept for this machine, build and dtype; None when none are (or unreadable)."""
    allowed = {"linear", "transposed"} | ({"kernel"} if ops is not None else set())
    try:
        text = _forms_file(dtype, ops).read_text()
        kept = {int(k): v for k, v in json.loads(text).items()}
        if set(kept) == set(MATMUL_BUCKETS) and set(kept.values()) <= allowed:
            return kept
    except (OSError, ValueError, AttributeError):
        pass
    return None


def keep_measured_forms(dtype: torch.dtype, again: bool = True) -> dict[int, str]:
    """Measures the forms now and keeps them for later processes (the warm-up calls this at
    set-up, when nothing else runs; run `python -m conveyor.model.warm_up` to measure again).
    again=False measures only where none are kept: after the kernel sources, torch or the CPU
    changed (each is in the file's key), so that every later process does not measure for
    itself (the test session calls it so before its workers start)."""
    ops = _kernel_ops(dtype)
    kept = None if again else _kept_forms(dtype, ops)
    if kept is not None:
        return kept
    winners = _measure_forms(dtype, ops)
    # atomic: a process starting meanwhile reads the old forms or the new ones
    write_atomic(_forms_file(dtype, ops), json.dumps({str(k): v for k, v in winners.items()}))
    _measured_forms.cache_clear()
    return winners


def _forms_file(dtype: torch.dtype, ops: ModuleType | None) -> Path:
    """Where the forms of this machine (CPU model; build_key: its flags, torch, Python, kernel
    sources), thread count and dtype are kept."""
    from conveyor.model import kernels
    from conveyor.paths import cache_dir

    digest = hashlib.sha256()
    for part in (
        kernels.cpu_model(),
        kernels.build_key(),
        str(ops is not None),
        str(dtype),
        str(torch.get_num_threads()),
        repr(MATMUL_BUCKETS),
        repr(KERNEL_MARGIN),
    ):
        digest.update(part.encode())
    return cache_dir() / "matmul_forms" / f"{digest.hexdigest()[:16]}.json"


def _measure_forms(dtype: torch.dtype, ops: ModuleType | None) -> dict[int, str]:
    """Each form timed over weights of 3072 x 576, 170 MB of them (24 in float32: streamed
    from memory, as a step streams a model's weights, not from the caches), best of 3 passes;
    about 1.3 s in all (_best_times bounds a slow dtype's)."""
    weights = torch.full((96 // dtype.itemsize, 3072, 576), 0.5, dtype=dtype)
    winners = {}
    for bucket in MATMUL_BUCKETS:
        x = torch.full((bucket, 576), 0.25, dtype=dtype)
        forms = {"linear": lambda w, x=x: x @ w.T, "transposed": lambda w, x=x: w @ x.T}
        if ops is not None and bucket <= 32:
            forms["kernel"] = lambda w, x=x: ops.small_gemm(x, w)
        times = _best_times(weights, forms)
        fastest = min(times, key=times.__getitem__)
        if "kernel" in times and times["kernel"] <= KERNEL_MARGIN * times[fastest]:
            fastest = "kernel"  # it also runs the layers as one compiled call (llama.py)
        winners[bucket] = fastest
    return winners


def _best_times(weights: torch.Tensor, forms: dict, budget: float = 0.05) -> dict[str, float]:
    """Each form's best pass over the weights, per weight. The forms take turns pass by pass, so
    that a burst of load from elsewhere on the machine slows all of them, not the one it hits.
    A form slower than `budget` seconds a pass is compute-bound at this row count (memory would
    stream the pass in a few ms), so the counted passes take only the weights the warm-up round
    got through in that time: the per-weight time is the same, and a dtype without fast
    arithmetic here (bfloat16 on an AVX2 CPU: ~9 s a dtype over every weight) costs ~1 s."""
    best = dict.fromkeys(forms, float("inf"))
    count = len(weights)
    for attempt in range(4):  # the first round warms up and sizes the passes; not counted
        done = {}
        for name, form in forms.items():
            start = time.perf_counter()
            for i, weight in enumerate(weights[:count]):
                form(weight)
                if not attempt and i == 0:
                    first = time.perf_counter()  # a first call's set-up does not count
                elif not attempt and time.perf_counter() - first > budget:
                    break
            done[name] = i + 1
            if attempt:
                best[name] = min(best[name], (time.perf_counter() - start) / count)
        if not attempt:
            count = min(done.values())
    return best


def panel_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """x @ W^T (+ bias) through the batch-invariant panel kernels (kernels/gemm/panel_gemm.cpp:
    every output value one chain of FMAs over k, whatever the row count), when the module
    was packed (pack_panels) and x is a CPU matrix of the weight's dtype; else None."""
    panels = module.panels
    if panels is None or x.device.type != "cpu" or x.dim() != 2 or x.dtype != panels.dtype:
        return None
    out = _ops().dense_linear(x, panels, module.weight.shape[0])
    return out if module.bias is None else out.add_(module.bias)


def pack_panels(model: nn.Module) -> int:
    """Packs every dense projection (Linear, MergedLinear), block projection
    (quant.QuantLinear) and latent attention's per-head matrices (mla.LatentHeads) of a CPU
    model for the batch-invariant kernels; returns how many.
    Nothing without the compiled kernels (the modules then run their other routes)."""
    from conveyor.model.quant import QuantLinear

    ops = _ops()
    if ops is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, MergedLinear)):
            weight = module.weight.detach()
            if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64):
                module.panels = ops.pack_dense(weight)
                count += 1
        elif isinstance(module, QuantLinear):
            if module.qs.device.type == "cpu":
                module.pack_panels(ops)
                count += 1
        elif hasattr(module, "pack_panels"):  # latent attention's heads (mla.LatentHeads)
            count += module.pack_panels(ops)
    return count


class Linear(nn.Module):
    """A bias-free projection through `linear` (the parameter is named like nn.Linear's), or
    the batch-invariant panel kernel once packed (pack_panels)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = None
        self.panels: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = panel_linear(x, self)
        return linear(x, self.weight) if out is None else out


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input (q/k/v, gate/up); the loader
    copies each checkpoint matrix into its rows."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes))) if bias else None
        self.panels: torch.Tensor | None = None  # pack_panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = panel_linear(x, self)
        return linear(x, self.weight, self.bias) if out is None else out

    def load_shard(self, index: int, name: str, tensor: torch.Tensor) -> None:
        start = sum(self.out_sizes[:index])
        target = self.weight if name == "weight" else self.bias
        if target is None or tensor.shape[0] != self.out_sizes[index]:
            raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit")
        target.data[start : start + self.out_sizes[index]].copy_(tensor)
