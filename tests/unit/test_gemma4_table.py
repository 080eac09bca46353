"""Gemma 4's per-layer embedding (model/loader.py: _per_layer_table), read from the
checkpoint's file as stored."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams


def test_gemma4_per_layer_table_is_read_from_the_checkpoint_file_as_stored(tmp_path):
    """Gemma 4's per-layer embedding (2.3 G parameters in gemma-4-E2B) is a read-only map of
    the checkpoint file's bytes in their stored dtype, not a converted copy; the answers are
    those of the table converted whole (the model dtype's rows, as transformers computes)."""
    path = make_tiny_checkpoint(tmp_path / "f64", "gemma4")
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).exists():
            (bf16 / name).write_bytes((path / name).read_bytes())
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    prompt = [[5, 17, 33, 101, 7]]
    answers = {}
    for mapped in (True, False):
        with LLM(str(bf16), dtype="float32") as llm:
            model = llm.engine.core.runner.model
            table = model.model.embed_tokens_per_layer.weight
            if mapped:
                assert table.dtype == torch.bfloat16
                start = table.data_ptr()
                maps = Path("/proc/self/maps").read_text().splitlines()
                backing = [
                    line.split()[-1]
                    for line in maps
                    if int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16)
                ]
                assert backing and backing[0].endswith(".safetensors"), backing
            else:  # the table converted whole to the model dtype
                model.model.embed_tokens_per_layer.weight = torch.nn.Parameter(
                    table.float(), requires_grad=False
                )
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            answers[mapped] = (
                out.token_ids,
                [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)],
            )
    assert answers[True] == answers[False]
