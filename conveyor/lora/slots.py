"""The resident adapters and the batched LoRA deltas of a step.

At most max_loras adapters are resident, one per slot. For every layer and projection the
slots are stacked (ProjectionSlots):

    a        (slots, S * R, in)   the A of each of the projection's S slices (q, k, v; gate,
                                  up; or one), slice s in rows [s * R, s * R + r_s)
    b[s]     (slots, out_s, R)    the B of slice s, its first r_s columns used
    scaling  [slot][s]            PEFT's alpha / r (alpha / sqrt(r) with rsLoRA)

R is max_lora_rank and r_s an adapter's own rank there; rows and columns past r_s stay zero.
An adapter a step names but that is not resident takes a free slot or the least recently used
one that the step does not name (the scheduler admits at most max_loras adapters into the
running batch, so one always exists), copied in from host memory (registry.py).

A step's rows are grouped by slot once (RowGroup: a request's rows are contiguous, so one
adapter's requests side by side are a slice, otherwise an index). Each targeted projection then
adds, per group, `(x[rows] @ A^T) @ B_s^T * scaling_s` to its output's rows and slice-s columns:
one shrink matmul for all slices and one expand per slice, per adapter in the step, whatever
the number of requests. This is PEFT's `base(x) + lora_B(lora_A(x)) * scaling`, in the model's
dtype, on top of whatever the projection's own kernel computed (so a quantized base stays
quantized). A step without adapter rows does nothing here: the hooks return at once, and the
model keeps its compiled decoder layers (model/llama.py), which steps with adapter rows leave
for the modules, where the deltas are added between the projections.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from conveyor.lora.adapter import PROJECTIONS, LoRAAdapter, ProjectionShape, SliceLoRA
from conveyor.lora.registry import LoRARegistry


class RowGroup(NamedTuple):
    slot: int
    rows: slice | torch.Tensor  # the step's rows of this slot's requests


class ProjectionSlots:
    """One projection of one layer: every slot's A and B (see the module docstring)."""

    def __init__(
        self, shape: ProjectionShape, num_slots: int, rank: int, dtype: torch.dtype, device
    ) -> None:
        num_slices = len(shape.out_sizes)
        self.rank = rank
        self.a = torch.zeros(num_slots, num_slices * rank, shape.in_features, dtype=dtype,
                             device=device)  # fmt: skip
        self.b = [torch.zeros(num_slots, out, rank, dtype=dtype, device=device)
                  for out in shape.out_sizes]  # fmt: skip
        starts = np.cumsum((0, *shape.out_sizes))
        self.columns = [(int(s), int(n)) for s, n in zip(starts, shape.out_sizes, strict=False)]
        # Per slot and slice: the adapter's rank there (0: not targeted) and its scaling.
        self.ranks = [[0] * num_slices for _ in range(num_slots)]
        self.scaling = [[0.0] * num_slices for _ in range(num_slots)]

    def load(self, slot: int, slices: list[SliceLoRA | None] | None) -> None:
        self.a[slot].zero_()
        for s, one in enumerate(slices or [None] * len(self.b)):
            self.b[s][slot].zero_()
            self.ranks[slot][s] = 0 if one is None else one.a.shape[0]
            self.scaling[slot][s] = 0.0 if one is None else one.scaling
            if one is not None:
                r = one.a.shape[0]
                self.a[slot, s * self.rank : s * self.rank + r].copy_(one.a)
                self.b[s][slot, :, :r].copy_(one.b)

    def apply(self, x: torch.Tensor, out: torch.Tensor, groups: list[RowGroup]) -> None:
        """out (T, sum of out_s) += each group's delta, in place."""
        for slot, rows in groups:
            ranks = self.ranks[slot]
            if not any(ranks):
                continue
            x_rows = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            shrunk = x_rows @ self.a[slot].T  # (n, S * R): every slice's x @ A^T at once
            for s, (start, size) in enumerate(self.columns):
                r = ranks[s]
                if not r:
                    continue
                first = s * self.rank
                delta = (shrunk[:, first : first + r] @ self.b[s][slot, :, :r].T).mul_(
                    self.scaling[slot][s]
                )  # (n, out_s)
                if isinstance(rows, slice):
                    out[rows, start : start + size] += delta
                else:
                    out[:, start : start + size].index_add_(0, rows, delta)


class LoRASlots:
    """The model's resident adapters and the current step's row groups; it hooks the
    targeted projections of the model it is given (and sets `model.lora` to itself)."""

    def __init__(self, model: nn.Module, registry: LoRARegistry) -> None:
        config, shapes = registry.config, registry.shapes
        self.registry = registry
        self.num_slots = config.max_loras
        device = next(model.parameters()).device
        self.device = device
        self.layers: list[dict[str, ProjectionSlots]] = []
        for layer in model.model.layers:
            own = {}
            for name in PROJECTIONS:
                own[name] = ProjectionSlots(
                    shapes.projections[name], self.num_slots, config.max_lora_rank,
                    shapes.dtype, device,
                )  # fmt: skip
                layer.get_submodule(name).register_forward_hook(partial(self._hook, own[name]))
            self.layers.append(own)
        self._resident: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, LRU first
        self.num_loads = 0  # adapters copied into a slot so far (tests, metrics)
        self.groups: list[RowGroup] | None = None  # the running step's; None: no adapter rows
        model.lora = self

    @property
    def active(self) -> bool:
        return self.groups is not None

    @contextlib.contextmanager
    def rows(self, lora_ids: list[int], query_lens: np.ndarray) -> Iterator[None]:
        """The step's adapter rows, for the forward run inside: lora_ids[i] (0: the base model)
        names the adapter of the i-th request, whose query_lens[i] rows follow the previous
        request's."""
        self.groups = self._groups(lora_ids, query_lens) if any(lora_ids) else None
        try:
            yield
        finally:
            self.groups = None

    def _groups(self, lora_ids: list[int], query_lens: np.ndarray) -> list[RowGroup]:
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        members: dict[int, list[int]] = {}
        for i, lora_id in enumerate(lora_ids):
            if lora_id:
                members.setdefault(lora_id, []).append(i)
        slots = self._activate(list(members))
        groups = []
        for lora_id, indices in members.items():
            if indices[-1] - indices[0] == len(indices) - 1:  # side by side: one slice
                rows = slice(int(starts[indices[0]]), int(ends[indices[-1]]))
            else:
                spans = [np.arange(starts[i], ends[i]) for i in indices]
                rows = torch.from_numpy(np.concatenate(spans)).to(self.device)
            groups.append(RowGroup(slots[lora_id], rows))
        return groups

    def _activate(self, lora_ids: list[int]) -> dict[int, int]:
        """A slot for each adapter, loading those not resident into free or least recently
        used slots that this step does not need."""
        adapters = {i: self.registry.get(i) for i in lora_ids}
        if len(adapters) > self.num_slots:
            raise RuntimeError(f"a step names {len(adapters)} adapters; max_loras is "
                               f"{self.num_slots}")  # fmt: skip
        needed = {a.digest for a in adapters.values()}
        slots = {}
        for lora_id, adapter in adapters.items():
            slot = self._resident.get(adapter.digest)
            if slot is None:
                slot = self._free_slot(needed)
                self._load(slot, adapter)
            self._resident.move_to_end(adapter.digest)
            slots[lora_id] = slot
        return slots

    def _free_slot(self, needed: set[bytes]) -> int:
        taken = set(self._resident.values())
        for slot in range(self.num_slots):
            if slot not in taken:
                return slot
        victim = next(d for d in self._resident if d not in needed)  # least recently used
        return self._resident.pop(victim)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for index, own in enumerate(self.layers):
            for name, slots in own.items():
                slots.load(slot, adapter.modules.get((index, name)))
        self._resident[adapter.digest] = slot
        self.num_loads += 1

    def resident_ids(self) -> list[int]:
        """The lora_int_ids of the resident adapters, least recently used first."""
        by_digest = {}
        for lora_id in self.registry.ids():
            with contextlib.suppress(KeyError):
                by_digest[self.registry.get(lora_id).digest] = lora_id
        return [by_digest[d] for d in self._resident if d in by_digest]

    def _hook(self, slots: ProjectionSlots, module: nn.Module, args: tuple, out: torch.Tensor):
        if self.groups is None:
            return None
        slots.apply(args[0], out, self.groups)
        return out
