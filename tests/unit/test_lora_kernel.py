"""The LoRA delta kernel (kernels/lora/lora_gemm.cpp, lora/slots.py: ProjectionSlots.apply):
close to its torch twin (ProjectionSlots.reference) on random shapes, slices, ranks and row
groups; a row's delta bitwise the same whatever else shares the step and on one or two
threads; rows of the base model untouched; bad input raises instead of crashing."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import torch_threads

from conveyor.lora.adapter import ProjectionShape, SliceLoRA
from conveyor.lora.slots import ProjectionSlots

# in_features: odd, one vector, the default model's; slices: o/down, gate/up, q/k/v (with
# outputs that are not a multiple of any vector width).
SHAPES = [
    ProjectionShape(37, (29,)),
    ProjectionShape(64, (48, 48)),
    ProjectionShape(576, (576, 192, 192)),
    ProjectionShape(100, (70, 13, 13)),
]
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-13}  # of max |delta|


def make_slots(shape, num_slots, rank, dtype, seed, ranks=None):
    """Slots filled with random adapters (some slices left out, some ranks below the max)."""
    gen = torch.Generator().manual_seed(seed)
    slots = ProjectionSlots(shape, num_slots, rank, dtype, "cpu")
    for slot in range(num_slots):
        slices = []
        for s, size in enumerate(shape.out_sizes):
            if (slot + s) % 4 == 3:  # a slice the adapter does not target
                slices.append(None)
                continue
            r = (ranks or {}).get(slot, rank)
            a = torch.randn(r, shape.in_features, generator=gen, dtype=dtype)
            b = torch.randn(size, r, generator=gen, dtype=dtype)
            slices.append(SliceLoRA(a, b, 0.5 + slot))
        slots.load(slot, slices)
    return slots


def random_groups(num_rows, num_slots, rng):
    """(slot, rows) for a random share of the rows, the rest left to the base model."""
    owners = [rng.choice([None, *range(num_slots)]) for _ in range(num_rows)]
    groups = []
    for slot in sorted({o for o in owners if o is not None}):
        rows = [i for i, o in enumerate(owners) if o == slot]
        groups.append((slot, torch.tensor(rows, dtype=torch.int64)))
    return groups, owners


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_rows", [1, 3, 9, 70])
def test_kernel_matches_the_torch_twin(ops, dtype, shape, num_rows):
    rng = random.Random(num_rows)
    slots = make_slots(shape, 4, 16, dtype, seed=num_rows, ranks={1: 5})
    x = torch.randn(num_rows, shape.in_features, dtype=dtype)
    base = torch.randn(num_rows, sum(shape.out_sizes), dtype=dtype)
    groups, owners = random_groups(num_rows, 4, rng)
    if not groups:
        groups, owners = [(2, torch.tensor([0]))], [2] + owners[1:]
    got, want = base.clone(), base.clone()
    slots.apply(x, got, groups)
    slots.reference(x, want, groups)
    delta = (want - base).abs().max()
    assert delta > 0
    assert (got - want).abs().max() <= TOLERANCE[dtype] * delta
    for i, owner in enumerate(owners):
        if owner is None:
            assert torch.equal(got[i], base[i]), "a base-model row was changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rows_delta_does_not_depend_on_the_batch_or_threads(ops, dtype):
    shape = SHAPES[2]
    slots = make_slots(shape, 3, 16, dtype, seed=7)
    x = torch.randn(23, shape.in_features, dtype=dtype)
    base = torch.randn(23, sum(shape.out_sizes), dtype=dtype)
    groups, owners = random_groups(23, 3, random.Random(3))
    full = base.clone()
    slots.apply(x, full, groups)
    with torch_threads(1):
        one_thread = base.clone()
        slots.apply(x, one_thread, groups)
    assert torch.equal(full, one_thread)
    for i, owner in enumerate(owners):
        if owner is None:
            continue
        alone = base[i : i + 1].clone()  # the row by itself, at row 0 of a one-row step
        slots.apply(x[i : i + 1], alone, [(owner, torch.tensor([0]))])
        assert torch.equal(alone[0], full[i]), f"row {i} changed with its neighbours"


def test_bad_input_raises(ops):
    shape = SHAPES[1]
    slots = make_slots(shape, 2, 8, torch.float32, seed=1)
    x = torch.randn(4, shape.in_features)
    y = torch.zeros(4, sum(shape.out_sizes))
    rows = [torch.tensor([0, 3])]
    cases = [
        ([torch.tensor([0, 4])], [0], slots.boundaries, 2, "row out of range"),
        ([torch.tensor([-1])], [0], slots.boundaries, 2, "row out of range"),
        (rows, [2], slots.boundaries, 2, "slot out of range"),
        (rows, [0], [0, 60, 48, 96], 2, "columns"),
        (rows, [0], [0, 48, 90], 2, "columns"),
        (rows, [0, 1], slots.boundaries, 2, "one row tensor per slot"),
        ([torch.tensor([0.0])], [0], slots.boundaries, 2, "int64"),
        (rows, [0], slots.boundaries, 3, "slots \\* W"),
    ]
    for groups, slot_ids, columns, num_slots, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.lora_add(y, x, slots.a, slots.b, groups, slot_ids, columns, num_slots)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_add(y.double(), x.double(), slots.a, slots.b, rows, [0], slots.boundaries, 2)
    assert torch.equal(y, torch.zeros_like(y)), "a refused call wrote its output"
