"""The resident adapters and the batched LoRA deltas of a step.

At most max_loras adapters are resident, one per slot. For every layer and projection the
slots are stacked (ProjectionSlots):

    a   (in, slots * S * R)    A^T of each of the projection's S slices (q, k, v; gate, up; or
                               one): slice s of slot k in columns k * S * R + s * R .. + r_s
    b   (slots * S * R, out)   rows numbered as a's columns: slice s's B^T times its scaling
                               (PEFT's alpha / r, alpha / sqrt(r) with rsLoRA) in slice s's
                               columns, zero elsewhere

R is max_lora_rank and r_s an adapter's own rank there; rows and columns past r_s stay zero.
An adapter a step names but that is not resident takes a free slot or the least recently used
one that the step does not name (the scheduler admits at most max_loras adapters into the
running batch, so one always exists), copied in from host memory (registry.py).

A step's rows are grouped by slot once (the rows of each adapter in the step). Each targeted
projection then adds, to each adapter row, its slot's delta: the shrink `x A^T` against that
slot's S * R columns of a, then the expand of each slice over that slice's own columns of b.
This is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` (the scaling folded into B), in the
model's dtype, on top of whatever the projection's own kernel computed (so a quantized base
stays quantized). On the CPU in float32/float64 one compiled kernel does it for the whole step
(kernels/lora/lora_gemm.cpp: one parallel pass over tiles of one slot's rows, one order per value
whatever the batch), called by the compiled decoder layers after each projection
(layer/decoder_layer.cpp: add_lora) and by the modules' forward hooks when the modules run;
elsewhere its torch twin (ProjectionSlots.reference). A step without adapter rows does nothing
here.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial

import numpy as np
import torch
from torch import nn

from conveyor.lora.adapter import PROJECTIONS, LoRAAdapter, ProjectionShape, SliceLoRA
from conveyor.lora.registry import LoRARegistry
from conveyor.model import kernels


class ProjectionSlots:
    """One projection of one layer: every slot's A and B (see the module docstring)."""

    def __init__(
        self, shape: ProjectionShape, num_slots: int, rank: int, dtype: torch.dtype, device
    ) -> None:
        self.rank = rank
        self.width = len(shape.out_sizes) * rank  # S * R: a slot's columns of a, rows of b
        starts = np.cumsum((0, *shape.out_sizes))
        self.columns = [(int(s), int(n)) for s, n in zip(starts, shape.out_sizes, strict=False)]
        self.boundaries = [int(s) for s in starts]  # the slices' columns, from 0 to out
        # A^T (in, slots * S * R): slice s of slot k in columns k * S * R + s * R ..; B dense
        # (slots * S * R, out): rows numbered as a's columns, slice s's B^T times its scaling in
        # its own columns, zero elsewhere. (A^T: the kernel's shrink then runs down a's rows
        # with vectors across a slot's columns, and needs no sums across a vector's lanes.)
        self.a = torch.zeros(shape.in_features, num_slots * self.width, dtype=dtype,
                             device=device)  # fmt: skip
        self.b = torch.zeros(num_slots * self.width, int(starts[-1]), dtype=dtype,
                             device=device)  # fmt: skip

    def load(self, slot: int, slices: list[SliceLoRA | None] | None) -> None:
        own = slice(slot * self.width, (slot + 1) * self.width)
        self.a[:, own].zero_()
        self.b[own].zero_()
        for s, one in enumerate(slices or []):
            if one is None:
                continue
            first, r = slot * self.width + s * self.rank, one.a.shape[0]
            start, size = self.columns[s]
            self.a[:, first : first + r].copy_(one.a.T)
            self.b[first : first + r, start : start + size].copy_(one.b.T).mul_(one.scaling)

    def apply(self, x: torch.Tensor, out: torch.Tensor, slot_rows) -> None:
        """out (T, sum of out_s) += each slot's rows' (x A_k^T) B_k, in place: the compiled
        kernel on the CPU in float32/float64 (kernels/lora/lora_gemm.cpp, as the compiled decoder
        layers do), else the reference."""
        ops = kernels.load() if x.device.type == "cpu" and out.dtype in _KERNEL_DTYPES else None
        if ops is None or not x.is_contiguous() or not out.is_contiguous():
            self.reference(x, out, slot_rows)
            return
        ops.lora_add(out, x, self.a, self.b, [rows for _, rows in slot_rows],
                     [slot for slot, _ in slot_rows], self.boundaries,
                     self.a.shape[1] // self.width)  # fmt: skip

    def reference(self, x: torch.Tensor, out: torch.Tensor, slot_rows) -> None:
        """apply's twin in torch ops: one shrink of every row against every slot, then a
        gather, an expand and a scatter per slot (the same terms, another order)."""
        shrunk = x @ self.a  # (T, slots * S * R): every slot at once
        for slot, rows in slot_rows:
            own = slice(slot * self.width, (slot + 1) * self.width)
            out.index_add_(0, rows, shrunk.index_select(0, rows)[:, own] @ self.b[own])


_KERNEL_DTYPES = (torch.float32, torch.float64)


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
        # The running step's rows of each slot in use (slot, int64 indices; empty: no adapter
        # rows), and the weights the compiled decoder layers take with them
        # (kernels/layer/decoder_layer.cpp: LoRA).
        self.slot_rows: list[tuple[int, torch.Tensor]] = []
        self._weights = [t for own in self.layers for name in PROJECTIONS
                         for t in (own[name].a, own[name].b)]  # fmt: skip
        model.lora = self

    @property
    def active(self) -> bool:
        return bool(self.slot_rows)

    @contextlib.contextmanager
    def rows(self, lora_ids: list[int], query_lens: np.ndarray) -> Iterator[None]:
        """The step's adapter rows, for the forward run inside: lora_ids[i] (0: the base model)
        names the adapter of the i-th request, whose query_lens[i] rows follow the previous
        request's."""
        self.slot_rows = self._slot_rows(lora_ids, query_lens) if any(lora_ids) else []
        try:
            yield
        finally:
            self.slot_rows = []

    def compiled_arguments(self) -> dict:
        """The running step's LoRA for the compiled decoder layers (decoder_layers' lora,
        lora_slots and lora_num_slots): each slot's rows, then A and B of each layer's qkv, o,
        gate_up and down."""
        return {
            "lora": [rows for _, rows in self.slot_rows] + self._weights,
            "lora_slots": [slot for slot, _ in self.slot_rows],
            "lora_num_slots": self.num_slots,
        }

    def _slot_rows(
        self, lora_ids: list[int], query_lens: np.ndarray
    ) -> list[tuple[int, torch.Tensor]]:
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        members: dict[int, list[int]] = {}
        for i, lora_id in enumerate(lora_ids):
            if lora_id:
                members.setdefault(lora_id, []).append(i)
        slots = self._activate(list(members))
        return [
            (slots[lora_id], torch.from_numpy(
                np.concatenate([np.arange(starts[i], ends[i], dtype=np.int64) for i in indices])
            ).to(self.device))
            for lora_id, indices in members.items()
        ]  # fmt: skip

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
        if not self.slot_rows:
            return None
        slots.apply(args[0], out, self.slot_rows)
        return out
