"""Random PEFT LoRA adapters for tiny checkpoints, and their transformers + peft references."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# Adapter settings (peft.LoraConfig keywords): attention only; the MLP with rsLoRA; every
# projection ("all-linear"), with a rank and an alpha of their own for some modules.
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "all": dict(
        r=2,
        lora_alpha=4,
        target_modules="all-linear",
        rank_pattern={"down_proj": 6},
        alpha_pattern={"o_proj": 3},
    ),
}


def make_adapter(
    base: Path, out: Path, seed: int = 0, gguf_file: str | None = None, config=None, **lora_config
) -> Path:
    """A PEFT adapter with random A and B (init_lora_weights=False: the delta is not zero),
    saved by save_pretrained into `out`."""
    from peft import LoraConfig, get_peft_model

    model = _base_model(base, gguf_file, config)
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **lora_config)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None, gguf_file: str | None = None, config=None):
    """transformers' float64 model of `base` (with `config` where given: a GGUF file's, see
    gguf_util.transformers_config) with the adapter applied by peft (None: bare)."""
    from peft import PeftModel

    model = _base_model(base, gguf_file, config)
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter)).eval()


def _base_model(base: Path, gguf_file: str | None, config=None):
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if config is not None:
        kwargs["config"] = config
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **kwargs)
