"""Multi-token prediction: the layer Qwen3.5 and Qwen3-Next checkpoints carry beside the model
(`mtp.*`), and GLM-4.5, GLM-4.7-Flash and DeepSeek-V3 ones after the model's layers
(`model.layers.{num_hidden_layers}.*`: eh_proj, enorm, hnorm, shared_head.norm and a decoder
layer, read under the first's names: model/loader.py), which proposes the token after next
(speculative_config {"method": "mtp"}, vLLM's qwen3_next_mtp, glm4_moe_mtp and deepseek_mtp).

Row i of the predictor reads the token at position i + 1 and the model's final (normed) hidden
state at position i:

    x = fc(concat(pre_fc_norm_embedding(embed(t[i + 1])), pre_fc_norm_hidden(h[i])))
    y = norm(layer(x))  # one decoder layer of the model's attention kind, its own KV
    draft = argmax(lm_head(y))  # the token at position i + 2 (embed and lm_head: the model's)

and writes its layer's KV at position i. A draft needs an argmax, not exact logits: on the
CPU a float32 model's drafts take it from a Q8_0 copy of the lm_head (`draft_head`, a quarter
of its bytes, made at load), as each draft's pass over the vocabulary is the layer's largest
cost (Qwen3.5-0.8B's lm_head is a third of its weights).

Every step the runner (worker/model_runner.py _propose) runs it over the step's rows, each
row's token the one after it (a prompt chunk's last row: the next prompt token; the last
accepted row of a sampling request: the token just sampled), also in steps that sample
nothing, so its cache holds every position the model has computed; the row of the sampled
token gives draft 1. Draft j + 1 feeds draft j with y of the row before at the next position
(as vLLM chains them), written into blocks the request already holds: a chain that reaches
the end of its last block stops there (fewer drafts that step; the next step's rows write
those positions again with the model's own hidden states).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from conveyor.model.config import ModelConfig
from conveyor.model.layers import Linear, RMSNorm

# The families whose checkpoints carry such a layer: under `mtp.` (model/loader.py _NOT_READ
# skips it otherwise), or as the layers after the model's (LlamaForCausalLM.load_weights skips
# those otherwise).
MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LAYER_MTP_FAMILIES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3")


def described_layer(cfg: ModelConfig) -> int:
    """The model layer whose description the predictor's layer takes: the last (GLM-4.5's and
    DeepSeek-V3's, a mixture of experts, as transformers' MtpModel builds it), or where that is
    recurrent the first that attends (Qwen3.5's, full attention)."""
    last = cfg.num_layers - 1
    if not cfg.parts.is_linear(last):
        return last
    return next(i for i in range(cfg.num_layers) if not cfg.parts.is_linear(i))


class MultiTokenPredictor(nn.Module):
    """`mtp.`: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0 and norm, read by those
    names (LlamaForCausalLM.mtp)."""

    def __init__(self, cfg: ModelConfig, tp, decoder_layer) -> None:
        """decoder_layer: the model's layer class (model/llama.py LlamaDecoderLayer)."""
        super().__init__()
        parts = cfg.parts
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = lambda: RMSNorm(  # noqa: E731
            size, eps, offset=parts.norm_offset, float32_scale=parts.norm_float32_scale
        )
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(), norm()
        self.fc = Linear(2 * size, size)
        one = dataclasses.replace(cfg, parts=parts.one_layer(described_layer(cfg)), num_layers=1)
        self.layers = nn.ModuleList([decoder_layer(one, tp, 0)])
        self.norm = norm()
        self.draft_head: nn.Module | None = None  # (make_draft_head)

    def forward(self, embedded, hidden, ropes, rotaries, kv_cache, meta) -> torch.Tensor:
        """y (T, hidden) of rows whose next tokens' embeddings are `embedded` and whose model
        hidden states (or, chained, the predictor's y) are `hidden`."""
        x = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.layers[0](self.fc(x), ropes, rotaries, kv_cache, meta)
        return self.norm(x)

    def make_draft_head(self, lm_head: nn.Module) -> None:
        """The Q8_0 copy of a float32 CPU lm_head that drafts are taken from (none for
        another)."""
        self.draft_head = _draft_head(lm_head)

    def draft_tokens(self, y: torch.Tensor, exact) -> torch.Tensor:
        """The drafts of rows y: argmax of draft_head's values, else `exact(y)` (the
        model's argmax_tokens)."""
        if self.draft_head is None:
            return exact(y)
        return self.draft_head(y.to(torch.float32)).argmax(-1)


def _draft_head(lm_head: nn.Module) -> nn.Module | None:
    """A QuantLinear of Q8_0 blocks of a float32 CPU lm_head's weight, or None (another dtype
    or device, an lm_head already in blocks, no block kernels here)."""
    weight = getattr(lm_head, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or weight.shape[1] % 32
    ):
        return None
    from conveyor.model import quant

    if not quant.kernels_available():
        return None
    return quant.QuantLinear(quant.quantize_q8(weight), [weight.shape[0]])


def stored_mtp_layers(cfg: ModelConfig) -> int:
    """How many multi-token prediction layers the checkpoint stores (`mtp.layers.N.` beside
    its `mtp.fc`, or `model.layers.N.` with an eh_proj from num_hidden_layers on); 0: none
    (or not a safetensors checkpoint)."""
    import json

    from safetensors import safe_open

    if cfg.is_gguf:
        return 0
    index = cfg.path / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        names = set()
        for file in sorted(cfg.path.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                names.update(f.keys())
    if cfg.parts.family in LAYER_MTP_FAMILIES:
        prefix = "model.language_model.layers." if cfg.text_of else "model.layers."
        count = 0
        while f"{prefix}{cfg.num_layers + count}.eh_proj.weight" in names:
            count += 1
        return count
    if "mtp.fc.weight" not in names:
        return 0
    return len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})


def with_mtp(cfg: ModelConfig, model: str | None) -> ModelConfig:
    """The model config that reads the checkpoint's multi-token prediction layer
    (speculative_config {"method": "mtp"}); ValueError where it has none conveyor reads.
    `model`: the speculative config's, which must be the target's own."""
    where = "speculative_config: method 'mtp'"
    if model is not None and model not in (str(cfg.path), cfg.hub_id):
        raise ValueError(f"{where} proposes with the model's own layer: 'model' must be it")
    if cfg.parts.family not in MTP_FAMILIES + LAYER_MTP_FAMILIES:
        raise ValueError(
            f"{where}: {cfg.architecture} has no multi-token prediction layer conveyor reads "
            "(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, GLM-4.5, GLM-4.7-Flash and DeepSeek-V3 "
            "checkpoints carry one)"
        )
    layers = stored_mtp_layers(cfg)
    if layers == 0:
        raise ValueError(
            f"{where}: the checkpoint stores no multi-token prediction layer (mtp.fc and "
            "mtp.layers.0, or an eh_proj after the model's layers: a GGUF file or a checkpoint "
            "without them)"
        )
    return dataclasses.replace(cfg, mtp_layers=1)  # chained drafts reuse the first, as vLLM
