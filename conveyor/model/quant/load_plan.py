"""Which checkpoint tensors load quantized into which modules (QuantPlan), decided from the
config and the model before the weights stream in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.model.families import PROJECTION_SHARDS as _SHARDS
from conveyor.model.gguf_loader import GGUF_FLOAT_TYPES
from conveyor.model.quant.formats import QK, BlockWeight, quantize_q8
from conveyor.model.quant.gguf_blocks import from_gguf_blocks
from conveyor.model.quant.modules import QuantEmbedding, QuantLinear, merged_linear
from conveyor.model.quant.ops import int8_route_enabled
from conveyor.model.quant.prequantized import GroupedInts

# --------------------------------------------------------------------------- loading

_EMBED, _LM_HEAD = "model.embed_tokens", "lm_head"


def pack_int8_modules(model: nn.Module) -> int:
    """Gives every QuantLinear but the lm_head its int8 copy where the route is on; returns
    how many got one."""
    if not int8_route_enabled(model.config):
        return 0
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name != _LM_HEAD:
            module.pack_int8()
            count += 1
    return count


class _Pending(nn.Module):
    """Stands in for a module to be quantized while the float model gets its storage."""


@dataclass
class _Spec:
    checkpoint_names: list[str]  # weight tensors feeding the shards, in shard order
    has_bias: bool
    embedding: bool = False
    shards: dict[int, BlockWeight] | None = None
    biases: dict[int, torch.Tensor] | None = None


class QuantPlan:
    """Which modules of a model are served quantized, and their weights as they stream in.

    Use: `strip(model)` on the meta-device model (the float storage is then never allocated
    for them), `take(weights)` around the checkpoint iterator (quantized tensors are kept here,
    the rest passes to model.load_weights), then `install(model)`."""

    def __init__(self, mode: str, dtype: torch.dtype, specs: dict[str, _Spec]) -> None:
        self.mode = mode  # "gguf" | "int8"
        self.dtype = dtype
        self.specs = specs
        self._routes: dict[str, list[tuple[str, int]]] = {}
        for module, spec in specs.items():
            for shard, name in enumerate(spec.checkpoint_names):
                self._routes.setdefault(name, []).append((module, shard))

    def keep_raw(self, hf_name: str) -> bool:
        """For the GGUF reader: leave this tensor in its blocks."""
        return self.mode == "gguf" and hf_name in self._routes

    def keep_grouped(self, hf_name: str) -> bool:
        """For the safetensors reader: a GPTQ or AWQ weight of this name comes as it is stored
        (its 4-bit groups become q4 blocks where they map onto them)."""
        return hf_name in self._routes

    def strip(self, model: nn.Module) -> None:
        for name in self.specs:
            model.set_submodule(name, _Pending())

    def take(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name in self._routes:
                weight = self._to_blocks(tensor)
                for module, shard in self._routes[name]:
                    self.specs[module].shards[shard] = weight
            elif name.endswith(".bias") and self._bias_route(name) is not None:
                module, shard = self._bias_route(name)
                self.specs[module].biases[shard] = tensor.to(self.dtype)
            else:
                yield name, tensor

    def install(self, model: nn.Module) -> None:
        for name, spec in self.specs.items():
            missing = [n for i, n in enumerate(spec.checkpoint_names) if i not in spec.shards]
            if missing:
                raise ValueError(f"checkpoint lacks tensors: {', '.join(missing[:5])}")
            shards = [spec.shards[i] for i in range(len(spec.checkpoint_names))]
            if len({shard.format for shard in shards}) > 1:  # a merged matrix has one format
                shards = [s if s.format == "q8" else quantize_q8(s.dequantize()) for s in shards]
            if spec.embedding:
                model.set_submodule(name, QuantEmbedding(shards[0], self.dtype))
                continue
            biases = None
            if spec.has_bias:
                biases = [spec.biases[i] for i in range(len(shards))]
            module = merged_linear(shards, biases)
            if name == _LM_HEAD:
                # Logits decide the sampled token: near ties (0.1 nat apart happen in greedy
                # chat answers) must not flip on the activations' int8 rounding, so the head
                # always takes the float-tile path (float32 arithmetic on the stored blocks).
                module.dequant_from = 1  # and so float_acts
            model.set_submodule(name, module)
        pack_int8_modules(model)

    def _to_blocks(self, tensor) -> BlockWeight:
        if isinstance(tensor, torch.Tensor):  # a float checkpoint (or a dequantized GGUF)
            return quantize_q8(tensor)
        if isinstance(tensor, GroupedInts):  # GPTQ's or AWQ's integers
            return tensor.q4_blocks() or quantize_q8(tensor.dequantize())
        weight = from_gguf_blocks(tensor.qtype.name, tensor.data, tuple(tensor.shape))
        return weight if tensor.row_order is None else weight.rows(tensor.row_order)

    def _bias_route(self, name: str) -> tuple[str, int] | None:
        route = self._routes.get(name.removesuffix(".bias") + ".weight")
        return route[0] if route else None


def plan_quantization(cfg, model: nn.Module) -> QuantPlan | None:
    """The QuantPlan for `cfg.quantization` on the (meta-device) float model; None for 'none'."""
    if cfg.quantization == "none":
        return None
    types = None
    if cfg.quantization == "gguf":
        from conveyor.model.gguf_loader import gguf_tensor_types

        types = gguf_tensor_types(cfg.path)

    def quantized(names: list[str]) -> bool:  # a GGUF keeps float weights float
        return types is None or all(types.get(n, "F32") not in GGUF_FLOAT_TYPES for n in names)

    specs: dict[str, _Spec] = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in {merged for merged, _ in _SHARDS.values()} or module.weight.shape[1] % QK:
            continue
        parent = name.rpartition(".")[0]
        names = [f"{parent}.{p}.weight" for p, (m, _) in _SHARDS.items() if m == leaf]
        names = names[: len(getattr(module, "out_sizes", names))]  # qkv_proj: a gate or none
        if getattr(module, "part_names", None):  # a latent attention's: its own two parts
            names = [f"{parent}.{part}.weight" for part in module.part_names]
        if not hasattr(module, "out_sizes"):  # one matrix under its own name (LFM2's and
            names = [f"{name}.weight"]  # Mamba2's in_proj, where a delta net's has four parts)
        if quantized(names):
            specs[name] = _Spec(names, getattr(module, "bias", None) is not None)
    _plan_embeddings(cfg, model, specs, quantized)
    for spec in specs.values():
        spec.shards, spec.biases = {}, {}
    return QuantPlan(cfg.quantization, cfg.dtype, specs)


def _plan_embeddings(cfg, model: nn.Module, specs: dict[str, _Spec], quantized) -> None:
    """lm_head is a projection like the others. A tied one shares its blocks with the token
    embeddings; an untied GGUF embedding that is stored quantized stays so (rows are
    dequantized per lookup)."""
    hidden = model.get_submodule(_EMBED).weight.shape[1]
    if hidden % QK:
        return
    embed_name = f"{_EMBED}.weight"
    head_source = embed_name if cfg.tie_word_embeddings else "lm_head.weight"
    if quantized([head_source]):
        specs[_LM_HEAD] = _Spec([head_source], has_bias=False)
    if (cfg.tie_word_embeddings and _LM_HEAD in specs) or (
        cfg.quantization == "gguf" and quantized([embed_name])
    ):
        specs[_EMBED] = _Spec([embed_name], has_bias=False, embedding=True)
