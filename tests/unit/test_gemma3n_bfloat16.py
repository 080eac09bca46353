"""Gemma 3n's own arithmetic (model/gemma3n.py) is transformers' bits in bfloat16, the dtype of
its releases: per-layer inputs whose scales are tensors of the model dtype there (rounded:
1/sqrt(2) is 0.70703125), not Python floats as Gemma 4's, a token past the per-layer table
reading its row 0; AltUp's predictions added in float32 as transformers' matmul adds them; the
gaussian top-k's mean, standard deviation and multiplier each rounded to bfloat16; the
streams' final mean added in float32."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from conveyor.model import gemma3n
from conveyor.model.config import ModelConfig
from conveyor.model.loader import load_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' text model, conveyor's, its ModelConfig), both bfloat16."""
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3n"), "gemma3n"))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).model
    cfg = ModelConfig.from_hf(path, dtype="bfloat16")
    return reference, load_model(cfg, torch.device("cpu")).model, cfg


def test_per_layer_inputs_are_transformers_bits(models):
    reference, model, cfg = models
    ids = torch.arange(cfg.vocab_size)  # past the per-layer table's 300 rows too
    with torch.no_grad():
        embeds = reference.embed_tokens(ids[None])
        want = reference.project_per_layer_inputs(embeds, reference.get_per_layer_inputs(ids[None]))
        got = gemma3n.per_layer_inputs(model, cfg, ids, embeds[0])
    assert torch.equal(got, want[0])


def test_altup_and_the_sparse_mlp_are_transformers_bits(models):
    reference, model, cfg = models
    streams = torch.randn(3, 61, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    streams = (4 * streams).to(torch.bfloat16)
    with torch.no_grad():
        for theirs, ours in zip(reference.layers[:2], model.layers[:2], strict=True):
            want = theirs.altup.predict(streams[:, None])[:, 0]
            assert torch.equal(ours.altup.predict(streams), want)
            assert torch.equal(ours.mlp(streams[0]), theirs.mlp(streams[0][None])[0])


def test_the_streams_final_mean_is_transformers_bits(models):
    reference, model, _ = models
    streams = torch.randn(3, 61, 64, generator=torch.Generator().manual_seed(1))
    streams = (4 * streams).to(torch.bfloat16)
    with torch.no_grad():  # transformers' lines (Gemma3nTextModel.forward, after its layers)
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        parts = [streams[0]]
        for i, projection in enumerate(reference.altup_unembed_projections, start=1):
            h = projection(streams[i])
            magnitude = torch.sqrt(torch.mean(h**2, dim=-1, keepdim=True).clamp(min=1e-5))
            parts.append(h * target / magnitude)
        want = torch.mean(torch.stack(parts), dim=0)
        assert torch.equal(gemma3n.merge(model, streams), want)
