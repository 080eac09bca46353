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


def test_a_gguf_per_layer_table_stays_in_its_blocks_and_reads_the_rows_of_the_whole(tmp_path):
    """A GGUF's per-layer embedding (Q6_K in llama.cpp's gemma-4-E2B files: 1.9 GB, 9.4 GB as
    float32) is kept in its blocks, mapped from the file: the rows a step reads are the rows
    of the tensor dequantized whole."""
    import gguf
    from gguf_util import write_gguf

    from conveyor.model.gemma4 import BlockRows

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "gemma4")
    path = write_gguf(hf_dir, tmp_path / "tiny-gemma4-Q8_0.gguf", "Q8_0")
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
    whole = gguf.quants.dequantize(stored.data, stored.tensor_type)
    with LLM(str(path)) as llm:
        table = llm.engine.core.runner.model.model.embed_tokens_per_layer
        assert isinstance(table, BlockRows), type(table)
        assert table.qtype == gguf.GGMLQuantizationType.Q8_0
        ids = torch.tensor([7, 3, 300, 7, 0])
        assert torch.equal(table(ids), torch.from_numpy(whole[ids.numpy()]).float())
        out = llm.generate([[5, 17, 33]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
