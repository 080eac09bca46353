"""Multimodal checkpoints served text-only (model/config.py MULTIMODAL_TEXT_ONLY: Gemma 3 from
4B up, Gemma 4, Mistral Small 3.1 / 3.2, LLaVA, Qwen2.5-VL, Qwen3-VL): the language model inside is
read under the text model's names and computed as its family (tests/equivalence/
test_families.py: equal to transformers' multimodal model on text in float64), the vision
tower and projector are never read, the processor's chat template (chat_template.json) is the
tokenizer's when it has none, and a request with an image is refused as for any model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import load_file, save_file
from tiny import auto_class, make_tiny_checkpoint
from transformers import AutoConfig

from conveyor import LLM, SamplingParams

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "arch",
    ["gemma3-vlm", "gemma4-vlm", "mistral3-vlm", "llava", "qwen2_5-vl", "qwen3-vl", "qwen3-vl-moe"],
)
def test_the_vision_tower_is_not_read_and_the_processors_template_is_taken(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    reference = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    prompts = [[5, 17, 42, 9, 100, 33], [7, 8, 9, 10]]
    expected = [tokens for tokens, _ in hf_greedy(reference, prompts, 6)]
    stored = load_file(path / "model.safetensors")
    others = [n for n in stored if any(t in n for t in ("vision_tower", "projector", "visual"))]
    assert others
    for name in others:  # never read: not a number in any of them changes a token
        stored[name] = torch.full_like(stored[name], float("nan"))
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))

    llm = LLM(str(path), dtype="float64")
    assert llm.engine.model_config.text_of == reference.config.architectures[0]
    names = [n for n, _ in llm.engine.runner.model.named_parameters()]
    assert not any("vision" in n or "projector" in n for n in names)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in got] == expected
    assert llm.get_tokenizer().chat_template == TEMPLATE
    (reply,) = llm.chat([{"role": "user", "content": "Paris"}], params, use_tqdm=False)
    text = "<|im_start|>user\nParis<|im_end|>\n<|im_start|>assistant\n"
    assert reply.prompt_token_ids == llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    # Served quantized on the CPU (int8 blocks under the text model's names) as well.
    small = LLM(str(path), dtype="float32", quantization="int8")
    assert len(small.generate(["Paris"], params, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_stacked_experts_read_in_either_form(tmp_path):
    """Qwen3-VL-MoE's Hub checkpoints keep each layer's experts as two 3-D tensors in x @ W
    form (E, hidden, 2 x inner), transformers 5 saves them in nn.Linear's (E, 2 x inner,
    hidden): either gives the same tokens, equal to transformers'."""
    path = make_tiny_checkpoint(tmp_path / "linear", "qwen3-vl-moe")
    reference = auto_class(AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    prompts = [[5, 17, 42, 9, 100, 33], [7, 8, 9, 10]]
    expected = [tokens for tokens, _ in hf_greedy(reference, prompts, 6)]
    stored = load_file(path / "model.safetensors")
    stacked = [n for n in stored if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked and all(stored[n].dim() == 3 for n in stacked)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for form in ("linear", "x @ W"):
        if form == "x @ W":
            for name in stacked:
                stored[name] = stored[name].transpose(1, 2).contiguous()
            save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
        llm = LLM(str(path), dtype="float64")
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([out.outputs[0].token_ids for out in got])
    assert runs == [expected, expected]


def test_a_multimodal_configs_end_of_sequence_ids_are_those_its_generate_stops_at(tmp_path):
    """Gemma 4's releases name [1, 106] (the end of a turn too) in the multimodal config and 1
    alone in its text config: transformers' generate of the multimodal model stops at both."""
    path = make_tiny_checkpoint(tmp_path / "gemma4-vlm", "gemma4-vlm")
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [2, 106]
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    assert AutoConfig.from_pretrained(path).get_text_config().eos_token_id == 2
    with LLM(str(path), dtype="float32") as llm:
        assert set(llm.engine.model_config.eos_token_ids) == {2, 106}
