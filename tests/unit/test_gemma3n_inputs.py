"""Gemma 3n's per-layer inputs (model/gemma3n.py) are transformers' bits in bfloat16, the model
dtype of its releases: its scales are tensors of the model dtype there (rounded: 1/sqrt(2) is
0.70703125 in bfloat16), not Python floats as Gemma 4's, and a token past the per-layer table
reads its row 0."""

from __future__ import annotations

import torch
from tiny import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from conveyor.model import gemma3n
from conveyor.model.config import ModelConfig
from conveyor.model.loader import load_model


def test_per_layer_inputs_are_transformers_bits_in_bfloat16(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, "gemma3n"))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).model
    cfg = ModelConfig.from_hf(path, dtype="bfloat16")
    model = load_model(cfg, torch.device("cpu")).model
    ids = torch.arange(cfg.vocab_size)  # past the per-layer table's 300 rows too
    with torch.no_grad():
        embeds = reference.embed_tokens(ids[None])
        want = reference.project_per_layer_inputs(embeds, reference.get_per_layer_inputs(ids[None]))
        got = gemma3n.per_layer_inputs(model, cfg, ids, embeds[0])
    assert torch.equal(got, want[0])
