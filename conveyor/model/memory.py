"""What a model's weights take in memory: the engine's memory report (logged at start,
CoreInfo.memory), and the check at load that they fit.

Counted once per storage (a tied lm_head is the embeddings' tensor; the compiled layers hold
references to the modules' tensors, never copies): the checkpoint's tensors as served
(`weights`: float, or the blocks of a model served quantized) and the copies the kernels are
packed into at load (`kernel_copies`: the batch-invariant panels, the prompt route's bfloat16
tiles, the lm_head's argmax panels). `experts` is the mixture-of-experts layers' share of both
(every expert's projections and the shared expert's, their packed copies included): an MoE's
experts are most of its bytes, however few of them a token reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn

# Module attributes that hold a kernel's packed copy of the module's weight (layers.pack_panels,
# quant.QuantLinear.pack_panels, prompt_route.pack_prompt_tiles).
KERNEL_COPIES = ("panels", "prompt_tiles", "argmax_panels")


class WeightMemory(NamedTuple):
    weights: int  # bytes of the checkpoint's tensors as served
    kernel_copies: int  # bytes of their packed copies
    experts: int  # of both, the experts' bytes

    def as_dict(self) -> dict[str, int]:
        return self._asdict()

    def log_line(self) -> str:
        mib = {k: v / 2**20 for k, v in self._asdict().items()}
        return (
            f"weights {mib['weights']:.1f} MiB + kernel copies {mib['kernel_copies']:.1f} MiB"
            f" (experts {mib['experts']:.1f} MiB of them)"
        )


def weight_memory(model: nn.Module) -> WeightMemory:
    """The report of a loaded model (each storage counted once)."""
    seen: set = set()
    expert_modules = set(_expert_modules(model))
    weights = copies = experts = 0
    for module in model.modules():
        own = _count(module.parameters(recurse=False), seen) + _count(
            module.buffers(recurse=False), seen
        )
        packed = _count(_kernel_copies(module), seen)
        weights, copies = weights + own, copies + packed
        if module in expert_modules:
            experts += own + packed
    return WeightMemory(weights, copies, experts)


def _expert_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module inside an MoE MLP's experts (and its shared expert)."""
    from conveyor.model.moe import MoEMLP

    for module in model.modules():
        if isinstance(module, MoEMLP):
            yield from module.experts.modules()
            if module.shared_expert is not None:
                yield from module.shared_expert.modules()


def _kernel_copies(module: nn.Module) -> Iterator[torch.Tensor]:
    for name in KERNEL_COPIES:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (t for t in value if isinstance(t, torch.Tensor))


def _count(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the tensors whose storage is not in `seen` yet (then added to it); a meta
    tensor (a model not yet loaded) is its own storage."""
    total = 0
    for t in tensors:
        key = id(t) if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes() if t.device.type != "meta" else _nbytes(t)
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- before loading: will the weights fit? ---------------------------------------------------

# Bytes per parameter of a projection served quantized: q8 blocks (32 int8 values and a float16
# scale), and the least of the GGUF formats served as they are (q4: 16 bytes of nibbles, two
# float16s), so the estimate of a GGUF never exceeds what it takes.
Q8_BYTES, Q4_BYTES = 34 / 32, 20 / 32


def estimate(
    model: nn.Module,
    quantized: Iterable[str],
    mode: str,
    dtype: torch.dtype,
    packed: bool,
    mapped: Iterable[str] = (),
) -> WeightMemory:
    """What a model built on the meta device will take once loaded: its tensors in `dtype`
    (quantized: the modules named in `quantized`, in blocks, `mode` "int8" or "gguf"), and with
    `packed` (batch-invariant on the CPU) a copy of every projection in the panels; the
    modules named in `mapped` read from the checkpoint's file mapping (the page cache's
    memory, given back under pressure) count nothing."""
    mapped = set(mapped)
    quantized = set(quantized)
    per_param = Q8_BYTES if mode == "int8" else Q4_BYTES
    expert_modules = set(_expert_modules(model))
    weights = copies = experts = 0
    seen: set[int] = set()  # a tied lm_head is the embeddings' tensor
    for name, module in model.named_modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors = [t for t in tensors if id(t) not in seen]
        seen.update(map(id, tensors))
        if name in mapped:
            continue
        if name in quantized:
            own = int(module.weight.numel() * per_param) if tensors else 0
        else:
            own = sum(
                t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                for t in tensors
            )
        projection = hasattr(module, "panels") or name in quantized
        copy = own if packed and projection and "embed_tokens" not in name else 0
        weights, copies = weights + own, copies + copy
        if module in expert_modules:
            experts += own + copy
    return WeightMemory(weights, copies, experts)


def check_fits(need: WeightMemory, available: int, what: str) -> None:
    """A ValueError that says what the weights need, the experts' share, and what is
    available, when they need more than that."""
    total = need.weights + need.kernel_copies
    if total <= available:
        return
    gib = 2**30
    experts = f", {need.experts / gib:.2f} GiB of it the experts'" if need.experts else ""
    raise ValueError(
        f"{what}: its weights need {total / gib:.2f} GiB (the checkpoint's tensors as served "
        f"{need.weights / gib:.2f} GiB and the kernels' packed copies "
        f"{need.kernel_copies / gib:.2f} GiB{experts}); {available / gib:.2f} GiB of memory "
        f"is available. Serve it quantized (--quantization int8, or a quantized GGUF), or on a "
        f"machine with more memory"
    )
