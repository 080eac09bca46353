"""Building blocks of the Llama family, written to match transformers' arithmetic exactly."""

from __future__ import annotations

import functools
import time
from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below for float32
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As transformers: normalize in float32 (also for float64 models), scale in the model dtype.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_len, computed once as transformers computes them:
    float32 frequencies and angles, then cast to the model dtype."""

    def __init__(self, hf_config, head_dim: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            inv_freq, scaling = _inv_freq(hf_config, head_dim)
            positions = torch.arange(max_len, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
        self.cos = nn.Buffer((emb.cos() * scaling).to(dtype), persistent=False)
        self.sin = nn.Buffer((emb.sin() * scaling).to(dtype), persistent=False)

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


def _inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). On CPU, MKL runs either x @ W.T or (W @ x.T).T much faster than the
    other at the small token counts of decode steps, and which one depends on the CPU: on a
    2-core Zen 3, (W @ x.T).T made 4-request steps 211 -> 94 ms; on a 2-core Sapphire Rapids
    Xeon, x @ W.T is 2.3x faster at 2 tokens and 1.15x at 8 (SmolLM2-135M's projections, 30
    layers streamed from memory). So each process measures both once per power-of-two token
    count (`_transposed_is_faster`) and uses the winner. (W @ x.T).T is a transposed view,
    which every consumer here accepts."""
    if x.device.type != "cpu" or x.dim() != 2:
        return nn.functional.linear(x, weight, bias)
    if _bucket(x.shape[0]) in transposed_buckets(x.dtype):
        out = (weight @ x.T).T
        return out if bias is None else out + bias
    return nn.functional.linear(x, weight, bias)


def _bucket(num_tokens: int) -> int:
    return 1 << max(num_tokens - 1, 0).bit_length()


@functools.cache
def transposed_buckets(dtype: torch.dtype) -> frozenset[int]:
    """The power-of-two token counts (1 to 64) at which (W @ x.T).T beats x @ W.T here; above
    64 the two tie within noise and x @ W.T is used. Measured once per process and dtype over
    24 weights of 3072 x 576 (170 MB in float32: streamed from memory, as a step streams a
    model's weights, not from the caches), best of 3 passes; ~0.3 s. The runner calls it at
    load, so no request pays for it."""
    weights = torch.full((24, 3072, 576), 0.5, dtype=dtype)
    winners = set()
    for bucket in (1, 2, 4, 8, 16, 32, 64):
        x = torch.full((bucket, 576), 0.25, dtype=dtype)
        if _best_time(weights, lambda w, x=x: w @ x.T) < _best_time(
            weights, lambda w, x=x: x @ w.T
        ):
            winners.add(bucket)
    return frozenset(winners)


def _best_time(weights: torch.Tensor, form) -> float:
    times = []
    for _ in range(4):  # the first pass warms up and is not counted
        start = time.perf_counter()
        for weight in weights:
            form(weight)
        times.append(time.perf_counter() - start)
    return min(times[1:])


class Linear(nn.Module):
    """A bias-free projection through `linear` (the parameter is named like nn.Linear's)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input (q/k/v, gate/up); the loader
    copies each checkpoint matrix into its rows."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_shard(self, index: int, name: str, tensor: torch.Tensor) -> None:
        start = sum(self.out_sizes[:index])
        target = self.weight if name == "weight" else self.bias
        if target is None or tensor.shape[0] != self.out_sizes[index]:
            raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit")
        target.data[start : start + self.out_sizes[index]].copy_(tensor)
