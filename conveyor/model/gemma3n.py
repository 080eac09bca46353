"""Gemma 3n's layer (Gemma3nForCausalLM; the language model of
Gemma3nForConditionalGeneration), as transformers 5 computes it, from the parts model/llama.py's
layers are made of.

The model carries altup_num_inputs streams of the hidden state (AltUp), (S, T, hidden), where
other models carry one:

- At the embedding, stream 0 is the scaled embedding and each other stream i a projection of
  it (altup_projections), rescaled to its row's root mean square; at the end each other
  stream is projected back (altup_unembed_projections), rescaled to stream 0's, and the
  streams' mean is normed.
- Each layer predicts every stream from all of them (per token, S x S coefficients from a
  router over the active stream, altup_active_idx), computes on the active one's prediction,
  then corrects every stream by the innovation (its output minus that prediction) times
  per-token coefficients, and adds the per-layer input's term to every stream but the first.
  transformers clips the coefficients' weights only when training: not here.
- The layer itself: Gemma 4's attention (model/gemma4.py: q, k and weightless v norms,
  unscaled scores; the last num_kv_shared_layers read the last earlier cache of their kind)
  with Laurel's low-rank residual beside it, both added and divided by sqrt(2); Gemma 3's
  sandwich of norms (w, multiplied in float32); an MLP whose gate, on the first layers
  (activation_sparsity_pattern), keeps only what lies above its row's mean plus a multiple of
  its standard deviation (a gaussian top-k).

The layers run as modules (no compiled layer): their projections take the panel kernels, and
every row reduction and transcendental function here runs row by row, so a row's bits do not
depend on the batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from conveyor.distributed.parallel import TPGroup
from conveyor.model import gemma4
from conveyor.model.config import ModelConfig
from conveyor.model.families import SANDWICH_NORMS
from conveyor.model.gemma4 import Gemma4Attention, StepState, whole_vectors
from conveyor.model.layers import Linear, MergedLinear, RMSNorm


def _norm(size: int, eps: float) -> RMSNorm:
    """Gemma 3n's RMSNorm: normalised in float32, times w in float32, then the cast."""
    return RMSNorm(size, eps, float32_scale=True)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """(..., 1): each row's mean, its values added pairwise by elementwise adds (one order
    whatever the rows: ATen's reduction over the last dim may split a row by the tensor's
    size); the row zero-padded to a power of two. A 16-bit row is added in float32 (as ATen
    accumulates it), the mean rounded to its dtype."""
    dtype = x.dtype
    if dtype in (torch.bfloat16, torch.float16):
        return row_mean(x.float()).to(dtype)
    width = x.shape[-1]
    size = 1 << (width - 1).bit_length()
    if size != width:
        x = nn.functional.pad(x, (0, size - width))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x / width


def _accumulated(dtype: torch.dtype) -> torch.dtype:
    """Where sums of a 16-bit model's values are added (as ATen's matmuls and reductions add
    them, rounding once): float32; another dtype's own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _rms(x: torch.Tensor) -> torch.Tensor:
    """(..., 1): each row's root mean square, at least sqrt(1e-5) (AltUp's magnitudes)."""
    return torch.sqrt(row_mean(x * x).clamp(min=1e-5))


class Gemma3nMLP(nn.Module):
    """down(act(gate) * up), the gate first cut to its gaussian top-k where the layer's
    activation_sparsity is above 0: relu(gate - (mean + std * icdf(sparsity))) per row."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        width = parts.mlp_sizes[index] if parts.mlp_sizes else cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [width, width], bias=False)
        self.down_proj = Linear(width, cfg.hidden_size)
        self.act = parts.act
        sparsity = parts.activation_sparsity[index] if parts.activation_sparsity else 0.0
        # transformers' multiplier: the normal's quantile in float32, then the model dtype
        self.std_multiplier = _normal_quantile(sparsity) if sparsity > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.out_sizes, dim=-1)
        if self.std_multiplier is not None:
            gate = torch.relu(gate - self._cutoff(gate))
        return self.down_proj(gemma4.activation(self.act, gate) * up)

    def _cutoff(self, gate: torch.Tensor) -> torch.Tensor:
        """(T, 1): each row's mean plus its (population) standard deviation times the
        multiplier, each computed wide and rounded to the model dtype, as transformers'."""
        wide = gate.to(_accumulated(gate.dtype))
        mean = row_mean(wide)
        std = torch.sqrt(row_mean((wide - mean).square()))
        multiplier = torch.tensor(self.std_multiplier, dtype=gate.dtype, device=gate.device)
        return mean.to(gate.dtype) + std.to(gate.dtype) * multiplier


def _normal_quantile(p: float) -> float:
    with torch.device("cpu"):  # real numbers where the model is built on "meta"
        normal = torch.distributions.normal.Normal(0, 1)
        return float(normal.icdf(torch.tensor(p, dtype=torch.float32)))


class Laurel(nn.Module):
    """Learned augmented residual: x + norm(linear_right(linear_left(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rank = cfg.parts.laurel_rank
        self.linear_left = Linear(cfg.hidden_size, rank)
        self.linear_right = Linear(rank, cfg.hidden_size)
        self.post_laurel_norm = _norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class AltUp(nn.Module):
    """AltUp's predict and correct over the streams (S, T, hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_streams, self.active = cfg.parts.altup
        streams = self.num_streams
        self.correct_output_scale = nn.Parameter(torch.empty(hidden))
        self.correction_coefs = Linear(streams, streams)
        self.prediction_coefs = Linear(streams, streams * streams)
        self.modality_router = Linear(hidden, streams)
        self.router_norm = _norm(hidden, cfg.rms_norm_eps)
        self.router_scale = hidden**-1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """(T, S): tanh of the router's output, in float32 (as transformers', for any dtype)."""
        routed = self.modality_router(self.router_norm(x) * self.router_scale)
        return whole_vectors(torch.tanh, routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Stream j: sum over i of coefficient (j, i) times stream i (added wide, as
        transformers' matmul adds them), plus stream j."""
        num_tokens, count = streams.shape[1], self.num_streams
        coefs = self.prediction_coefs(self.modalities(streams[self.active]))
        wide = _accumulated(streams.dtype)
        coefs = coefs.reshape(num_tokens, count, count).to(wide)  # (T, j, i)
        terms = streams.to(wide)
        out = []
        for j in range(count):
            total = terms[0] * coefs[:, j, :1]
            for i in range(1, count):
                total = total + terms[i] * coefs[:, j, i : i + 1]
            out.append(total.to(streams.dtype) + streams[j])
        return torch.stack(out)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Stream j: the innovation (activated minus the active prediction) times (1 + its
        coefficient), plus prediction j."""
        innovation = activated - predictions[self.active]
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # (T, S)
        return torch.stack(
            [innovation * coefs[:, j : j + 1] + predictions[j] for j in range(self.num_streams)]
        )


class Gemma3nDecoderLayer(nn.Module):
    """predict -> on the active stream: input_layernorm -> (attention -> post_attention_layernorm
    -> + x, + Laurel) / sqrt(2) -> pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm
    -> + -> correct; the per-layer input's term added to streams 1 on."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index = index
        for name in (*(n for _, n in SANDWICH_NORMS), "post_per_layer_input_norm"):
            self.add_module(name, _norm(hidden, eps))
        self.self_attn = Gemma4Attention(cfg, tp, index)
        self.mlp = Gemma3nMLP(cfg, index)
        self.altup = AltUp(cfg)
        self.laurel = Laurel(cfg)
        width = cfg.parts.per_layer_input[0]
        self.per_layer_input_gate = Linear(hidden, width)
        self.per_layer_projection = Linear(width, hidden)
        self.act = cfg.parts.act
        self.correct_scale = cfg.parts.altup_correct_scale

    def compiled(self, ops):
        return None  # no compiled form: the model runs its modules

    def forward(self, streams, ropes, rotaries, kv_cache, meta, state: StepState) -> torch.Tensor:
        predictions = self.altup.predict(streams)  # (S, T, hidden)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        h = self.self_attn(normed, ropes, rotaries, kv_cache, meta, state)
        x = active + self.post_attention_layernorm(h)
        x = (x + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        gate = gemma4.activation(self.act, self.per_layer_input_gate(first))
        h = self.per_layer_projection(gate * state.per_layer[:, self.index])
        corrected[1:] += self.post_per_layer_input_norm(h)
        return corrected


def add_altup_projections(model: nn.Module, cfg: ModelConfig) -> None:
    """The text model's projections into and out of the other streams, under its names."""
    hidden, count = cfg.hidden_size, cfg.parts.altup[0]
    for name in ("altup_projections", "altup_unembed_projections"):
        projections = nn.ModuleList(Linear(hidden, hidden) for _ in range(1, count))
        model.add_module(name, projections)


def per_layer_inputs(model: nn.Module, cfg: ModelConfig, input_ids, embeds) -> torch.Tensor:
    """Gemma 4's (model/gemma4.py), a token past the per-layer table (an image's or audio's)
    reading its row 0, as transformers' get_per_layer_inputs, the scales rounded to the model
    dtype (its buffers')."""
    vocab = cfg.parts.per_layer_input[1]
    ids = torch.where(input_ids < vocab, input_ids, torch.zeros_like(input_ids))
    return gemma4.per_layer_inputs(model, cfg, ids, embeds, rounded_scales=True)


def spread(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(S, T, hidden): the scaled embedding, then each projection of it at its magnitude."""
    target = torch.sqrt(row_mean(x * x))
    streams = [x]
    for projection in model.altup_projections:
        h = projection(x)
        streams.append(h * target / _rms(h))
    return torch.stack(streams)


def merge(model: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """(T, hidden): stream 0 and each other one projected back at stream 0's magnitude, their
    mean (before the final norm)."""
    target = torch.sqrt(row_mean(streams[0] * streams[0]))
    wide = _accumulated(streams.dtype)  # as ATen's mean adds them
    total = streams[0].to(wide)
    for i, projection in enumerate(model.altup_unembed_projections, start=1):
        h = projection(streams[i])
        total = total + (h * target / _rms(h)).to(wide)
    return (total / streams.shape[0]).to(streams.dtype)
