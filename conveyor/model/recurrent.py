"""Recurrent layers of hybrid models, which keep a fixed-size state per sequence instead of KV
blocks: gated delta nets (Qwen3.5's linear attention), and short convolutions (LFM2's, their
state the convolution's last inputs alone).

A layer mixes tokens through two recurrences that run along each sequence:
  - a causal depthwise convolution (kernel K) over the q/k/v projections: its state is the
    sequence's last K - 1 inputs;
  - the gated delta rule: per value head a (key_dim, value_dim) matrix S that each token
    decays by exp(g), corrects toward its value (S += k (beta (v - S^T k))^T) and reads with
    its query (o = S^T q).
A short convolution is the first alone, of B * x, times C. The states live in slots
(RecurrentState, allocated by worker/model_runner.py; core/scheduler.py gives each running
sequence one, ScheduledRequest.state_slot); a sequence's chunk continues its slot's state, its
first chunk starts from zeros. The rule runs token by token in the state dtype (float32, float64
for a float64 model; transformers' runs float32) in compiled ops on the CPU
(kernels/layer/deltanet.cpp: the convolution over a step's rows, then the rule with each
sequence and head on its own thread, its sums in one order) or their PyTorch twins
(causal_conv_reference, delta_rule_reference: CUDA), so a token's values are the same bits
however its prompt was chunked and whatever else the step holds.

Mamba2 (Granite 4.0-H's `mamba` layers, Mamba2Mixer) takes the same two recurrences' shape: the
convolution (with a bias) over x, B and C, then per head a (head_dim, state) matrix S that each
token decays by exp(dt A) and adds (dt x) B^T to, read as S C + D x; the heads' outputs gated by
silu(z) and RMS-normed per group (kernels/layer/mamba.cpp, its twin mamba2_reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.layers import Linear, MergedLinear


class RecurrentState(NamedTuple):
    """One layer's states, by slot."""

    conv: torch.Tensor  # (slots, conv_dim, kernel - 1): each sequence's last conv inputs
    ssm: torch.Tensor  # (slots, value_heads, key_dim, value_dim): the delta rule's matrices


class Wave(NamedTuple):
    """Row j of every verifying sequence that has one (speculative decoding on a hybrid): run
    as one batch of one-row sequences, then the states after the rows that keep theirs copied
    aside (the scheduler takes the one at the accepted drafts' end back)."""

    rows: torch.Tensor  # (B,) the step's rows
    slots: torch.Tensor  # (B,) their sequences' slots
    starts: list[int]  # [0, 1, ..., B]
    keep_from: torch.Tensor  # slots whose state after this wave is kept
    keep_to: torch.Tensor  # in these slots

    def keep(self, state: torch.Tensor) -> None:
        if self.keep_to.numel():
            state.index_copy_(0, self.keep_to, state.index_select(0, self.keep_from))


@dataclass(slots=True)
class RecurrentRows:
    """The step's sequences as the recurrent layers read them (built once per step). A
    sequence some of whose rows keep their states (`saves`: drafts being verified) runs in
    `waves`, one row at a time; the others are the `plain` ones."""

    starts: list[int]  # (S + 1,) rows of sequence s are [starts[s], starts[s + 1])
    fresh_slots: list[int]  # the slots of the chunks at position 0: their states start at zeros
    all_slots: torch.Tensor  # (S,) each sequence's state slot
    single: torch.Tensor  # the plain sequences of one row (decodes): their rows, one batch
    single_slots: torch.Tensor  # and their slots
    chunks: list[int]  # the other plain sequences, run one at a time
    waves: list[Wave]  # empty: every sequence is plain
    plain: torch.Tensor | None = None  # with waves: the plain sequences' rows
    plain_slots: torch.Tensor | None = None  # and their slots
    plain_starts: list[int] | None = None  # and where each begins among those rows

    def run(self, state: torch.Tensor, call) -> torch.Tensor:
        """Runs `call(slots, starts, rows)` (an op over sequences given by their slots and
        the starts of their rows among `rows`, a slice or an index, updating `state`) over
        every sequence, the plain ones at once and then the waves in order, keeping the
        states the waves keep; its outputs by the step's row."""
        if not self.waves:
            return call(self.all_slots, self.starts, slice(None))
        parts = []
        if self.plain.numel():
            parts.append((self.plain, call(self.plain_slots, self.plain_starts, self.plain)))
        for wave in self.waves:
            parts.append((wave.rows, call(wave.slots, wave.starts, wave.rows)))
            wave.keep(state)
        first = parts[0][1]
        out = first.new_empty((self.starts[-1], *first.shape[1:]))
        for rows, part in parts:
            out[rows] = part
        return out


def recurrent_rows(
    query_lens: list[int],
    context_lens: list[int],
    slots: list[int],
    device,
    saves: list[int] | None = None,
):
    """RecurrentRows of a step: query_lens, context_lens and slots per sequence; saves: per
    row, the slot its state is kept in after it (-1: none), or None."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    verifying = set()
    if saves is not None:
        verifying = {
            s for s in range(len(query_lens)) if max(saves[starts[s] : starts[s + 1]]) >= 0
        }
    plain = [s for s in range(len(query_lens)) if s not in verifying]
    single = [s for s in plain if query_lens[s] == 1]
    tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    rows = RecurrentRows(
        starts=starts,
        fresh_slots=[slot for slot, c in zip(slots, context_lens, strict=True) if c == 0],
        all_slots=tensor(slots),
        single=tensor([starts[s] for s in single]),
        single_slots=tensor([slots[s] for s in single]),
        chunks=[s for s in plain if query_lens[s] > 1],
        waves=[],
    )
    if not verifying:
        return rows
    plain_rows, plain_starts = [], [0]
    for s in plain:
        plain_rows.extend(range(starts[s], starts[s + 1]))
        plain_starts.append(len(plain_rows))
    rows.plain, rows.plain_slots = tensor(plain_rows), tensor([slots[s] for s in plain])
    rows.plain_starts = plain_starts
    ordered = sorted(verifying)
    for j in range(max(query_lens[s] for s in ordered)):
        members = [s for s in ordered if query_lens[s] > j]
        kept = [s for s in members if saves[starts[s] + j] >= 0]
        rows.waves.append(
            Wave(
                rows=tensor([starts[s] + j for s in members]),
                slots=tensor([slots[s] for s in members]),
                starts=list(range(len(members) + 1)),
                keep_from=tensor([slots[s] for s in kept]),
                keep_to=tensor([saves[starts[s] + j] for s in kept]),
            )
        )
    return rows


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence's dtype: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_shapes(cfg, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (conv, ssm) shapes of one layer's RecurrentState for a ModelConfig: a short
    convolution keeps its last inputs alone (an empty ssm)."""
    parts = cfg.parts
    if parts.linear_kind == "short_conv":
        return (num_slots, cfg.hidden_size, parts.linear_conv - 1), (num_slots, 0)
    if parts.linear_kind == "mamba2":
        heads, head_dim, groups, size = parts.mamba_shape
        conv_dim = heads * head_dim + 2 * groups * size
        return (num_slots, conv_dim, parts.linear_conv - 1), (num_slots, heads, head_dim, size)
    (key_heads, value_heads), (key_dim, value_dim) = parts.linear_heads, parts.linear_dims
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    conv = (num_slots, conv_dim, parts.linear_conv - 1)
    return conv, (num_slots, value_heads, key_dim, value_dim)


def recurrent_mixer(cfg, index: int) -> tuple[str, nn.Module]:
    """A hybrid's recurrent layer in place of attention, and its checkpoint name."""
    if cfg.parts.linear_kind == "short_conv":
        return "conv", ShortConv(cfg)
    if cfg.parts.linear_kind == "mamba2":
        return "mamba", Mamba2Mixer(cfg)
    return "linear_attn", GatedDeltaNet(cfg, index)


def _start_fresh(state: RecurrentState, rows: RecurrentRows) -> None:
    """Zeroes the states of the sequences whose chunk starts at position 0."""
    for slot in rows.fresh_slots:
        state.conv[slot].zero_()
        state.ssm[slot].zero_()


class ShortConv(nn.Module):
    """LFM2's `conv` layer: in_proj to B, C and x; the causal depthwise convolution (kernel
    conv_L_cache) of B * x, its state the last kernel - 1 of those; out_proj of C times it."""

    def __init__(self, cfg) -> None:
        super().__init__()
        hidden, kernel = cfg.hidden_size, cfg.parts.linear_conv
        self.in_proj = Linear(hidden, 3 * hidden)
        self.conv = nn.Module()  # holds the checkpoint's conv.weight (hidden, 1, K)
        self.conv.weight = nn.Parameter(torch.empty(hidden, 1, kernel))
        self.out_proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, state: RecurrentState, rows: RecurrentRows, ops=None):
        sdt = state.conv.dtype
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        _start_fresh(state, rows)
        conv_op = causal_conv_reference if ops is None else ops.causal_conv
        weight = self.conv.weight[:, 0, :].to(sdt)
        bx = (b * h).to(sdt).contiguous()  # (a projection may give column-major rows)
        conv = rows.run(
            state.conv, lambda slots, starts, r: conv_op(state.conv, slots, starts, bx[r], weight)
        )
        return self.out_proj(c * conv.to(x.dtype))


class GatedRMSNorm(nn.Module):
    """The weight of the RMSNorm each head's output takes before its gate (silu(z)); the
    rule computes it (gated_delta_rule)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class GatedDeltaNet(nn.Module):
    """Qwen3.5's `linear_attn` (transformers' names: in_proj_qkv / _z / _b / _a merged into one
    projection, conv1d, dt_bias, A_log, norm, out_proj)."""

    def __init__(self, cfg, index: int) -> None:
        super().__init__()
        parts = cfg.parts
        (self.key_heads, self.value_heads), (self.key_dim, self.value_dim) = (
            parts.linear_heads,
            parts.linear_dims,
        )
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * keys + values
        self.sizes = [self.conv_dim, values, self.value_heads, self.value_heads]
        self.in_proj = MergedLinear(cfg.hidden_size, self.sizes, bias=False)
        self.conv1d = nn.Module()  # holds the checkpoint's conv1d.weight (conv_dim, 1, K)
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, parts.linear_conv))
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(values, cfg.hidden_size)

    def forward(self, x: torch.Tensor, state: RecurrentState, rows: RecurrentRows, ops=None):
        """ops: the compiled ops (causal_conv, gated_delta_rule) on the CPU; None: their
        reference twins."""
        num_tokens, dtype = x.shape[0], x.dtype
        sdt = state.ssm.dtype
        mixed, z, b, a = (t.to(sdt) for t in self.in_proj(x).split(self.sizes, dim=-1))
        conv_op = causal_conv_reference if ops is None else ops.causal_conv
        rule = delta_rule_reference if ops is None else ops.gated_delta_rule
        heads, dim = self.value_heads, self.value_dim
        fixed = (
            self.A_log.to(sdt), self.dt_bias.to(sdt), self.norm.weight.to(sdt), self.norm.eps,
            self.key_heads,
        )  # fmt: skip
        _start_fresh(state, rows)
        weight = self.conv1d.weight[:, 0, :].to(sdt)  # (conv_dim, K)
        # (T, conv_dim); the ops read unit-stride rows, a projection may give column-major ones
        mixed = mixed.contiguous()
        conv = rows.run(
            state.conv,
            lambda slots, starts, r: conv_op(state.conv, slots, starts, mixed[r], weight),
        )
        z = z.reshape(num_tokens, heads, dim)
        if rows.single.numel() == num_tokens:  # every row a sequence's one: no gathers
            args = (conv[None], a[None], b[None], z[None])
            out = rule(state.ssm, rows.single_slots, *args, *fixed)[0]
            return self.out_proj(out.to(dtype).reshape(num_tokens, -1))
        out = torch.empty(num_tokens, heads, dim, dtype=sdt, device=x.device)
        if rows.single.numel():  # one row per sequence: all of them at once
            r = rows.single
            args = (conv[r][None], a[r][None], b[r][None], z[r][None])
            out[r] = rule(state.ssm, rows.single_slots, *args, *fixed)[0]
        for s in rows.chunks:
            begin, end = rows.starts[s], rows.starts[s + 1]
            slot = rows.all_slots[s : s + 1]
            args = (conv[begin:end, None], a[begin:end, None], b[begin:end, None])
            out[begin:end] = rule(state.ssm, slot, *args, z[begin:end, None], *fixed)[:, 0]
        for wave in rows.waves:  # verifying sequences, a row of each at a time
            r = wave.rows
            args = (conv[r][None], a[r][None], b[r][None], z[r][None])
            out[r] = rule(state.ssm, wave.slots, *args, *fixed)[0]
            wave.keep(state.ssm)
        return self.out_proj(out.to(dtype).reshape(num_tokens, -1))


class Mamba2Mixer(nn.Module):
    """Granite 4.0-H's `mamba` layer (transformers' names: in_proj to z, x B C and dt; conv1d
    with its bias; dt_bias, A_log, D; norm, the gated RMSNorm per group; out_proj)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        parts = cfg.parts
        self.heads, self.head_dim, self.groups, self.state_size = parts.mamba_shape
        inner = self.heads * self.head_dim
        self.conv_dim = inner + 2 * self.groups * self.state_size
        self.sizes = [inner, self.conv_dim, self.heads]
        self.in_proj = Linear(cfg.hidden_size, sum(self.sizes))
        self.conv1d = nn.Module()  # holds the checkpoint's conv1d.weight (conv_dim, 1, K), bias
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, parts.linear_conv))
        if parts.mamba_conv_bias:
            self.conv1d.bias = nn.Parameter(torch.zeros(self.conv_dim))
        else:  # zeros the checkpoint does not hold: x + 0 is x
            self.conv1d.register_buffer("bias", torch.zeros(self.conv_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(inner, cfg.rms_norm_eps)
        self.out_proj = Linear(inner, cfg.hidden_size)
        self.dt_limit = parts.mamba_dt_limit

    def forward(self, x: torch.Tensor, state: RecurrentState, rows: RecurrentRows, ops=None):
        """ops: the compiled ops (causal_conv, mamba2_mix) on the CPU; None: their twins."""
        sdt = state.ssm.dtype
        # (a projection may give its rows column-major: the ops read unit-stride rows)
        z, xbc, dt = (t.to(sdt).contiguous() for t in self.in_proj(x).split(self.sizes, dim=-1))
        conv_op = causal_conv_reference if ops is None else ops.causal_conv
        mix = mamba2_reference if ops is None else ops.mamba2_mix
        _start_fresh(state, rows)
        weight = self.conv1d.weight[:, 0, :].to(sdt)  # (conv_dim, K)
        conv = rows.run(  # (T, conv_dim)
            state.conv, lambda slots, starts, r: conv_op(state.conv, slots, starts, xbc[r], weight)
        )
        fixed = (self.A_log, self.dt_bias, self.D, self.norm.weight)
        bias, fixed = self.conv1d.bias.to(sdt), [t.to(sdt) for t in fixed]
        out = rows.run(
            state.ssm,
            lambda slots, starts, r: mix(
                state.ssm, slots, starts, conv[r], bias, dt[r], z[r], *fixed, self.norm.eps,
                self.groups, *self.dt_limit,
            ),
        )  # fmt: skip
        return self.out_proj(out.to(x.dtype))


def mamba2_reference(
    state: torch.Tensor,  # (slots, H, P, N): updated in place
    slots: torch.Tensor,  # (S,)
    starts: list[int],  # (S + 1,) the sequences' rows
    conv: torch.Tensor,  # (T, H P + 2 G N): x, B, C after the convolution, before its bias
    conv_bias: torch.Tensor,
    dt: torch.Tensor,  # (T, H) before dt_bias and softplus
    z: torch.Tensor,  # (T, H P): the output gate's
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    groups: int,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """kernels/layer/mamba.cpp's mamba2_mix in PyTorch (the CUDA path, and the twin its test
    compares with): (T, H P) outputs, gated and normed."""
    heads, head_dim, size = state.shape[1:]
    inner = heads * head_dim
    act = F.silu(conv + conv_bias)
    x = act[:, :inner].reshape(-1, heads, head_dim)
    per_group = heads // groups  # each group's B and C serve `per_group` consecutive heads
    B = act[:, inner : inner + groups * size].reshape(-1, groups, size)
    C = act[:, inner + groups * size :].reshape(-1, groups, size)
    B, C = B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1)
    dt = F.softplus(dt + dt_bias).clamp(dt_min, dt_max)  # (T, H)
    decay = torch.exp(dt * -torch.exp(A_log))
    y = torch.empty(conv.shape[0], heads, head_dim, dtype=state.dtype, device=state.device)
    for s, slot in enumerate(slots.tolist()):
        S = state[slot]  # (H, P, N), a view: updated in place
        for t in range(starts[s], starts[s + 1]):
            S.mul_(decay[t][:, None, None]).add_((x[t] * dt[t][:, None])[..., None] * B[t][:, None])
            y[t] = (S * C[t][:, None]).sum(-1) + D[:, None] * x[t]
    gated = (y.reshape(-1, inner) * F.silu(z)).reshape(-1, groups, inner // groups)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    return normed.reshape(-1, inner) * norm_weight


def causal_conv_reference(
    state: torch.Tensor,  # (slots, C, K - 1): each sequence's kept inputs, updated in place
    slots: torch.Tensor,  # (S,)
    starts: list[int],  # (S + 1,) the sequences' rows in x
    x: torch.Tensor,  # (T, C)
    weight: torch.Tensor,  # (C, K)
) -> torch.Tensor:
    """kernels/layer/deltanet.cpp's causal_conv in PyTorch: (T, C) outputs before the silu."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for s, slot in enumerate(slots.tolist()):
        begin, end = starts[s], starts[s + 1]
        window = torch.cat([state[slot], x[begin:end].T], dim=-1)
        state[slot] = window[:, window.shape[1] - state.shape[-1] :]
        out[begin:end] = _conv(window, weight, end - begin).T
    return out


def delta_rule_reference(
    state: torch.Tensor,  # (slots, Hv, Dk, Dv): updated in place
    slots: torch.Tensor,  # (N,) the sequences' slots
    mixed: torch.Tensor,  # (L, N, 2 Hk Dk + Hv Dv): q, k, v before their silu
    a: torch.Tensor,  # (L, N, Hv): the decay's input
    b: torch.Tensor,  # (L, N, Hv): beta's
    z: torch.Tensor,  # (L, N, Hv, Dv): the output gate's
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    key_heads: int,
) -> torch.Tensor:
    """The gated delta rule of kernels/layer/deltanet.cpp in PyTorch (the CUDA path, and the
    twin its test compares with): (L, N, Hv, Dv) normed, gated outputs."""
    steps, n = mixed.shape[:2]
    heads, key_dim, value_dim = state.shape[1:]
    keys = key_heads * key_dim
    mixed = F.silu(mixed)
    q = _l2norm(mixed[..., :keys].reshape(steps, n, key_heads, key_dim)) * key_dim**-0.5
    k = _l2norm(mixed[..., keys : 2 * keys].reshape(steps, n, key_heads, key_dim))
    v = mixed[..., 2 * keys :].reshape(steps, n, heads, value_dim)
    groups = heads // key_heads
    if groups > 1:  # each key head serves `groups` consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    decay = (-A_log.exp() * F.softplus(a + dt_bias)).exp()
    beta = b.sigmoid()
    ssm = state[slots]
    out = torch.empty(steps, n, heads, value_dim, dtype=state.dtype, device=state.device)
    for t in range(steps):
        ssm.mul_(decay[t][..., None, None])
        k_t = k[t].unsqueeze(-1)  # (N, Hv, Dk, 1)
        delta = (v[t] - (ssm * k_t).sum(dim=-2)) * beta[t][..., None]
        ssm.add_(k_t * delta.unsqueeze(-2))
        out[t] = (ssm * q[t].unsqueeze(-1)).sum(dim=-2)
    state[slots] = ssm
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return normed * norm_weight * F.silu(z)


def _conv(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """The causal depthwise convolution's last `length` outputs over `window` (..., C,
    K - 1 + length): the K products of each output added in one order (the same bits for
    any length and any number of sequences)."""
    kernel = weight.shape[-1]
    acc = window[..., 0:length] * weight[:, 0:1]
    for j in range(1, kernel):
        acc = acc + window[..., j : j + length] * weight[:, j : j + 1]
    return acc


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
