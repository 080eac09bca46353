"""What a model's weights take (model/memory.py): the engine's memory report counts a mixture
of experts' experts once each, with the same packed copies a dense projection has; and a model
whose weights (most of them experts) do not fit in memory says so at load, before any storage
is allocated."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLMEngine
from conveyor.model import kernels, memory
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.moe import MoEMLP


def engine(path, **settings) -> LLMEngine:
    return LLMEngine(
        str(path), dtype="float32", skip_tokenizer_init=True, num_blocks=16, **settings
    )


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.skipif(kernels.load() is None, reason="the compiled CPU kernels are unavailable")
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_memory_report_counts_every_expert_once_with_a_dense_projections_copies(
    tiny_checkpoint, quantization
):
    llm = engine(tiny_checkpoint("qwen2_moe"), quantization=quantization)
    model = llm.core.runner.model
    report = llm.core.info.memory
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoEMLP))
    dense = next(layer.mlp for layer in model.model.layers if not isinstance(layer.mlp, MoEMLP))

    # an expert's projection holds what a dense one holds: its weight (or blocks) and panels
    def copies(module) -> list[str]:
        return [n for n in memory.KERNEL_COPIES if getattr(module, n, None) is not None]

    for expert in [*moe.experts, moe.shared_expert]:
        for name in ("gate_up_proj", "down_proj"):
            assert copies(getattr(expert, name)) == copies(getattr(dense, name)) == ["panels"]
    experts = 0
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoEMLP):
            for expert in [*layer.mlp.experts, layer.mlp.shared_expert]:
                for module in (expert.gate_up_proj, expert.down_proj):
                    held = [*module.parameters(), *module.buffers()]
                    held += list(memory._kernel_copies(module))
                    experts += storage_bytes(held)
    assert report["experts"] == experts > 0
    tensors = [*model.parameters(), *model.buffers()]
    unique = {t.untyped_storage().data_ptr(): t for t in tensors}  # a tied lm_head once
    assert report["weights"] == storage_bytes(unique.values())
    assert report["kv_cache"] == 16 * llm.core.runner.kv_bytes_per_block()
    assert report["weights"] + report["kernel_copies"] > report["experts"]


def test_the_estimate_before_loading_is_the_loaded_models_weights(tiny_checkpoint):
    """The loader's check reads a model built on the meta device: its tensors as the loaded
    model holds them."""
    llm = engine(tiny_checkpoint("qwen3_moe"), batch_invariant=False)
    cfg = llm.core.model_config
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    need = memory.estimate(meta, (), "none", cfg.dtype, packed=False)
    report = llm.core.info.memory
    assert (need.weights, need.experts) == (report["weights"], report["experts"])
    assert need.kernel_copies == report["kernel_copies"] == 0


def test_a_model_whose_experts_do_not_fit_says_so_at_load(tiny_checkpoint, monkeypatch):
    from conveyor.model import prompt_route

    path = tiny_checkpoint("mixtral")
    monkeypatch.setattr(prompt_route, "available_memory", lambda: 64 * 2**10)
    with pytest.raises(ValueError, match=r"its weights need .* GiB of it the experts'.*quantized"):
        engine(path)
    monkeypatch.setattr(prompt_route, "available_memory", lambda: 64 * 2**30)
    engine(path)  # fits


def test_check_fits_names_the_experts_share():
    need = memory.WeightMemory(weights=3 * 2**30, kernel_copies=2**30, experts=3 * 2**30)
    memory.check_fits(need, 4 * 2**30, "m")
    with pytest.raises(ValueError, match=r"m: its weights need 4.00 GiB .* 3.00 GiB of it the "):
        memory.check_fits(need, 4 * 2**30 - 1, "m")
    dense = need._replace(experts=0)
    with pytest.raises(ValueError) as raised:
        memory.check_fits(dense, 2**30, "m")
    assert "experts" not in str(raised.value)
