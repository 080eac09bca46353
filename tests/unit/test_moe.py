"""The mixture-of-experts MLP (model/moe.py) against transformers' own modules: routers give
the same experts and weights (ties included: two experts with the same router row), the
experts' outputs are summed in ascending expert id whatever the batch, and a row's output is
the same bits alone as in a batch on the batch-invariant kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from conveyor.distributed.parallel import TPGroup
from conveyor.model import kernels
from conveyor.model.families import Parts
from conveyor.model.layers import pack_panels
from conveyor.model.moe import MoEMLP, expert_groups

HIDDEN, EXPERTS = 32, 6


def moe(parts: Parts, dtype=torch.float64, seed: int = 0) -> MoEMLP:
    cfg = SimpleNamespace(hidden_size=HIDDEN, parts=parts)
    module = MoEMLP(cfg, TPGroup()).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=dtype) * 0.3)
        module.gate.weight[2] = module.gate.weight[4]  # a tie between experts 2 and 4
    return module.requires_grad_(False)  # as served: the activations run in place


def softmax_topk(top_k: int, norm: bool, float32_weights: bool = False) -> Parts:
    return Parts(
        moe_layers=(True,), router="softmax_topk", num_experts=EXPERTS, top_k=top_k,
        norm_topk_prob=norm, float32_route_weights=float32_weights, moe_intermediate_size=16,
    )  # fmt: skip


def hf_config(model_type: str, top_k: int, **fields):
    return AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_experts_per_tok=top_k, **fields)


@pytest.mark.parametrize(
    ("parts", "reference"),
    [
        (softmax_topk(3, True), lambda: Qwen3MoeTopKRouter(
            hf_config("qwen3_moe", 3, num_experts=EXPERTS, norm_topk_prob=True))),
        (softmax_topk(2, False), lambda: Qwen3MoeTopKRouter(
            hf_config("qwen3_moe", 2, num_experts=EXPERTS, norm_topk_prob=False))),
        (softmax_topk(2, True, True), lambda: MixtralTopKRouter(
            hf_config("mixtral", 2, num_local_experts=EXPERTS))),
    ],
    ids=["qwen3-renormalised", "qwen2-unnormalised", "mixtral-float32-weights"],
)  # fmt: skip
def test_the_router_picks_and_weighs_as_transformers_ties_included(parts, reference):
    ours = moe(parts)
    theirs = reference().to(torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(ours.gate.weight)
    x = torch.randn(40, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[7] = 0.0  # every logit 0: a tie among all experts
    _, weights, ids = theirs(x)
    routes = ours.route(x)
    assert torch.equal(routes.expert_ids, ids)
    assert routes.weights.dtype == weights.dtype
    assert torch.equal(routes.weights, weights)


def test_gpt_oss_router_takes_top_k_of_the_biased_logits_then_softmax():
    parts = Parts(
        moe_layers=(True,), router="topk_softmax", num_experts=EXPERTS, top_k=2,
        moe_intermediate_size=16, expert_bias=True, act="swiglu_clamp", swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )  # fmt: skip
    ours = moe(parts)
    theirs = GptOssTopKRouter(hf_config("gpt_oss", 2, num_local_experts=EXPERTS)).double()
    with torch.no_grad():
        theirs.weight.copy_(ours.gate.weight)
        theirs.bias.copy_(ours.gate.bias)
    x = torch.randn(40, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _, weights, ids = theirs(x)
    routes = ours.route(x)
    assert torch.equal(routes.expert_ids, ids) and torch.equal(routes.weights, weights)


def test_groups_are_in_ascending_expert_id_with_each_experts_rows_in_order():
    ids = torch.tensor([[3, 0], [0, 5], [5, 3], [1, 0]])
    groups = expert_groups(ids, 6)
    assert [g.expert_id for g in groups] == [0, 1, 3, 5]  # experts 2 and 4 idle: not run
    zero = groups[0]
    assert zero.rows.tolist() == [0, 1, 3] and zero.slots.tolist() == [1, 0, 1]
    for g in groups:
        assert torch.equal(ids[g.rows, g.slots], torch.full_like(g.rows, g.expert_id))


@pytest.mark.skipif(kernels.load() is None, reason="the compiled CPU kernels are unavailable")
def test_a_rows_output_is_the_sum_of_its_experts_in_ascending_id():
    module = moe(softmax_topk(3, True))
    pack_panels(module)  # each expert's rows computed alike at any row count
    x = torch.randn(5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    routes = module.route(x)
    want = torch.zeros_like(x)
    for row in range(5):
        for slot in routes.expert_ids[row].argsort():  # ascending expert id
            expert = module.experts[int(routes.expert_ids[row, slot])]
            want[row] += expert(x[row : row + 1])[0] * routes.weights[row, slot]
    assert torch.equal(module(x), want)


@pytest.mark.skipif(kernels.load() is None, reason="the compiled CPU kernels are unavailable")
def test_a_rows_bits_are_the_same_alone_and_in_any_batch():
    module = moe(softmax_topk(2, True), torch.float32)
    module.shared_expert = None
    assert pack_panels(module) == 1 + 2 * EXPERTS  # router and every expert's projections
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, HIDDEN, generator=gen)
    full = module(x)
    for row in (0, 9, 63):
        assert torch.equal(module(x[row : row + 1]), full[row : row + 1]), row
    for first, last in ((0, 7), (5, 38), (30, 64)):
        assert torch.equal(module(x[first:last]), full[first:last]), (first, last)


# ---- the compiled MoE (kernels/layer/decoder_layer.cpp) against this module ----------------


def gpt_oss_parts() -> Parts:
    return Parts(
        moe_layers=(True,), router="topk_softmax", num_experts=EXPERTS, top_k=2,
        moe_intermediate_size=16, expert_bias=True, act="swiglu_clamp", swiglu_alpha=1.702,
        swiglu_limit=0.7,  # small: the tests' values reach the clamps
    )  # fmt: skip


def blocks_wide(parts: Parts, **fields) -> Parts:
    """Experts a whole number of int8 blocks (32 values) wide."""
    return Parts(**{**parts.to_dict(), "moe_intermediate_size": 32, **fields})


TWIN_PARTS = {
    "qwen3": lambda: blocks_wide(softmax_topk(3, True)),
    "qwen2-shared-expert": lambda: blocks_wide(softmax_topk(2, False), shared_expert_size=64),
    "mixtral-float32-weights": lambda: blocks_wide(softmax_topk(2, True, True)),
    "gpt-oss": lambda: blocks_wide(gpt_oss_parts()),
    # GLM-4.5's (and Nemotron 3's): sigmoid scores plus a bias, the best 2 of 3 groups, scaled;
    # an ungated shared expert
    "glm4.5-groups": lambda: blocks_wide(
        softmax_topk(2, True, True), router="sigmoid_group_topk", router_bias=True,
        router_groups=(3, 2), routed_scaling=2.5, shared_expert_size=64, shared_expert_gate=False,
    ),
    # ERNIE 4.5's: softmax plus a bias to choose, renormalised; an ungated shared expert
    "ernie4.5-biased-softmax": lambda: blocks_wide(
        softmax_topk(2, True), router="softmax_bias_topk", router_bias=True,
        router_norm_min=1e-12, shared_expert_size=64, shared_expert_gate=False,
    ),
}  # fmt: skip
BIASED = ("glm4.5-groups", "ernie4.5-biased-softmax")  # float32 logits: float64 runs modules


def quantized_experts(module: MoEMLP) -> MoEMLP:
    """Every expert's (and the shared expert's) projections as int8 blocks (QuantLinear), as
    `--quantization int8` serves them; the router stays float."""
    from conveyor.model.quant import QuantLinear, quantize_q8

    experts = list(module.experts) + ([module.shared_expert] if module.shared_expert else [])
    for expert in experts:
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(expert, name)
            sizes = getattr(old, "out_sizes", [old.weight.shape[0]])
            bias = None if old.bias is None else old.bias.detach().clone()
            setattr(expert, name, QuantLinear(quantize_q8(old.weight), sizes, bias))
    return module


@pytest.mark.skipif(kernels.load() is None, reason="the compiled CPU kernels are unavailable")
@pytest.mark.parametrize("weights", ["float32", "float64", "int8"])
@pytest.mark.parametrize("family", list(TWIN_PARTS))
def test_the_compiled_moe_computes_the_modules_bits(family, weights):
    """The compiled layer's MoE (router, top-k, grouping, each expert on the projection kernels,
    the sum by expert id, the shared expert's gate) gives the module's bits, at 1 row and in
    batches whose rows share and do not share experts; and a row's bits alone are its bits in
    the batch."""
    from conveyor.model.llama import _compiled_moe

    dtype = torch.float64 if weights == "float64" else torch.float32
    module = moe(TWIN_PARTS[family](), dtype)
    if weights == "int8":
        quantized_experts(module)
    pack_panels(module)
    compiled = _compiled_moe(module, kernels.load())
    if family in BIASED and weights == "float64":
        assert compiled is None  # its router's logits are float32 in the module
        return
    assert compiled is not None
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, HIDDEN, generator=gen, dtype=dtype)
    x[3] = 0.0  # a tie among all experts
    full = compiled.forward(x)
    assert torch.equal(full, module(x))
    for first, last in ((0, 1), (3, 4), (5, 13), (17, 70)):
        rows = x[first:last]
        assert torch.equal(compiled.forward(rows), module(rows)), (first, last)
        assert torch.equal(compiled.forward(rows), full[first:last]), (first, last)
