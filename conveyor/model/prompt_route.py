"""The prompt route: a quantized model's prompt tokens through bfloat16 dot products.

A prompt chunk is hundreds of rows, so its projections are bound by arithmetic, where the
tile unit of a CPU with AMX-BF16 outruns the int8 VNNI block kernel (kernels/gemm/amx_gemm.cpp;
GGUF's per-block scales keep the int8 tiles from paying, see there). A decode row is bound by
reading the weights, where the 4-bit blocks are 3x fewer bytes than bfloat16. So on such a CPU
a model served quantized keeps both: its blocks, and a bfloat16 copy of each decoder
projection packed into tiles at load (2 bytes a parameter more). A prompt row's attention
takes the tiles too (kernels/attention/amx_attention.cpp: Q K^T and P V in bfloat16, float32
sums and softmax); CONVEYOR_PROMPT_ATTENTION=0 keeps it on the float32 kernel, to measure the
two apart.

Determinism. The two routes round differently, so which one a row takes must never depend on
the step around it. It is fixed by the row's token: a token of the request's prompt (position
< num_prompt_tokens) takes the tiles, a generated token the blocks — whether it is computed in
a prompt chunk, alone, beside other requests, in a verification step or again after
preemption. Each route keeps one reduction order per row, so a request's answer is the same
whatever else runs. The KV of a generated token therefore differs from the KV the same token
gets as a later request's prompt token: the prefix cache keys blocks that hold generated
tokens apart (core/kv_cache_manager.py: salt_generated), so a cache hit always serves KV
computed the way a miss would compute it.

On a CPU with AVX512-BF16 but no AMX (a Zen 4 or 5, a Cooper Lake Xeon), or where the tiles do
not apply, a prompt row's attention alone takes bfloat16 (the same kernel's vdpbf16ps engine:
twice float32's multiply-adds per instruction; a 512-token chunk's attention 2.4x faster on a
Zen 4, docs/benchmarks.md) and its projections stay on the blocks: the projections' int8 dot
products already run at four times float32's rate there, where bfloat16 would halve it. The
route is then the same rule, attention only: a prompt token's attention in bfloat16, a
generated token's in float32, and the prefix cache keys their blocks apart as above.

On by default where it applies (a CPU model served quantized, batch-invariant, AMX-BF16 usable,
and the tiles taking under a quarter of the memory available: a 7B model's would be 13 GiB;
attention alone: AVX512-BF16 usable). CONVEYOR_ISA=avx2 turns both off, CONVEYOR_ISA=avx512
the tiles (the attention then takes AVX512-BF16); CONVEYOR_PROMPT_TILES=0 turns off the tiles
and CONVEYOR_PROMPT_ATTENTION=0 the attention (both: no route at all).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import numpy as np
from torch import nn

from conveyor.model import plan as kernel_plan

logger = logging.getLogger(__name__)


def applies(model: nn.Module, ops: ModuleType | None) -> bool:
    """Whether the model's prompt tokens can take the tiles here: every decoder projection a
    block-quantized float32 module on the CPU, packed for the batch-invariant kernels, whose
    layers run compiled (kernels/layer/decoder_layer.cpp holds the route)."""
    if not kernel_plan.current(model.config).prompt_tiles or not _quantized_compiled(model, ops):
        return False
    if not ops.amx_available():
        return False
    projections = list(_projections(model))
    need = sum(2 * m.d.shape[0] * m.in_features for m in projections)
    if need > MEMORY_SHARE * available_memory():
        logger.info(
            "conveyor: no prompt tiles (%.0f MiB, over a quarter of the free memory)", need / 2**20
        )
        return False
    return True


MEMORY_SHARE = 0.25  # of the memory available, at most, for the tiles


def attention_applies(model: nn.Module, ops: ModuleType | None) -> bool:
    """Whether the model's prompt rows can take the bfloat16 attention alone here (the tiles'
    conditions, with AVX512-BF16 or AMX usable for the attention kernel)."""
    if not kernel_plan.current(model.config).prompt_attention:
        return False
    return _quantized_compiled(model, ops) and bool(ops.prompt_attention_isa())


def _quantized_compiled(model: nn.Module, ops: ModuleType | None) -> bool:
    from conveyor.model.quant import QuantLinear

    parts = model.config.parts
    if ops is None or not kernel_plan.current(model.config).compiled_layers:
        return False  # the route runs inside the compiled layers only
    if parts.recurrent or parts.attn_gate:  # a hybrid's layers run as the modules
        return False
    if model.config.head_dim % 16:  # the attention tiles' columns (attention/amx_attention.cpp)
        return False
    projections = list(_projections(model))
    return bool(projections) and all(
        isinstance(m, QuantLinear) and m.panels is not None and m.qs.device.type == "cpu"
        for m in projections
    )


def choose(model: nn.Module, ops: ModuleType | None) -> None:
    """Sets the model's prompt route where one applies (route_of says which it took)."""
    if applies(model, ops):
        pack_prompt_tiles(model, ops)
    elif attention_applies(model, ops):
        model.prompt_route = True
        logger.info(
            "conveyor: prompt rows' attention runs bfloat16 (%s)", ops.prompt_attention_isa()
        )


def route_of(model: nn.Module) -> str:
    """The model's prompt route: "tiles" (the projections' bfloat16 tiles and the attention's),
    "attention" (the attention alone), or "none" (prompt and generated tokens compute alike)."""
    if not getattr(model, "prompt_route", False):
        return "none"
    tiles = any(getattr(m, "prompt_tiles", None) is not None for m in model.modules())
    return "tiles" if tiles else "attention"


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable), or all of it where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pack_prompt_tiles(model: nn.Module, ops: ModuleType) -> int:
    """Gives every decoder projection its bfloat16 tiles (module.prompt_tiles) and sets
    model.prompt_route; returns the bytes added."""
    from conveyor.model.quant import dequantize

    added = 0
    for module in _projections(model):
        module.prompt_tiles = ops.pack_bf16(dequantize(module.weight_blocks))
        added += module.prompt_tiles.numel() * module.prompt_tiles.element_size()
    model.prompt_route = True
    logger.info("conveyor: prompt tokens run AMX bf16 tiles (%.0f MiB of tiles)", added / 2**20)
    return added


def row_ranges(query_lens: np.ndarray, prompt_tokens: np.ndarray) -> list[int]:
    """[begin, end) pairs, flat, of the step's rows that are prompt tokens: each request's
    first prompt_tokens[i] of its query_lens[i] rows (a prompt precedes what is generated)."""
    starts = np.cumsum(query_lens) - query_lens
    keep = prompt_tokens > 0
    pairs = np.stack([starts[keep], starts[keep] + prompt_tokens[keep]], axis=1)
    if len(pairs) > 1:  # adjacent ranges as one: fewer kernel calls
        joined = [pairs[0].tolist()]
        for begin, end in pairs[1:].tolist():
            if begin == joined[-1][1]:
                joined[-1][1] = end
            else:
                joined.append([begin, end])
        return [v for pair in joined for v in pair]
    return pairs.reshape(-1).tolist()


def prompt_tokens(
    query_lens: np.ndarray, context_lens: np.ndarray, num_prompt_tokens: np.ndarray
) -> np.ndarray:
    """Per request, how many of its leading rows in the step are prompt tokens."""
    return np.clip(num_prompt_tokens - context_lens, 0, query_lens)


def _projections(model: nn.Module):
    """The decoder projections that take the tiles: attention's, and the MLP's, a mixture of
    experts' being every expert's (and the shared expert's). Its router and the shared
    expert's gate stay float, on the panels, for prompt rows too: the experts a token picks
    are picked alike on either route."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from (attn.qkv_proj, attn.o_proj)
        experts = getattr(mlp, "experts", None)
        if experts is None:
            yield from (mlp.gate_up_proj, mlp.down_proj)
            continue
        shared = [mlp.shared_expert] if mlp.shared_expert is not None else []
        for expert in [*experts, *shared]:
            yield from (expert.gate_up_proj, expert.down_proj)
