"""The model's configuration, read from its checkpoint (config.json, or a GGUF file's metadata):
architecture, shapes, dtype, quantization, EOS ids and context length, resolved once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.config import (
    CHECKPOINT_METHODS,
    LOAD_FORMATS,
    PREQUANTIZED_METHODS,
    QUANTIZATION_CHOICES,
    QUANTIZATION_MODES,
    STATIC_ROPE_TYPES,
    check_prequantized,
    quantization_config,
    resolve_model_path,
)
from conveyor.model.families import (
    MLA_FAMILIES,
    Parts,
    architecture,
    num_decoder_layers,
    parts_of,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The names a dtype may be given by -> torch's name of it. Names, not torch dtypes: the server's
# front end resolves the ModelConfig without importing torch (engine/core_proc.py).
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float64": "float64",
    "double": "float64",
}


@dataclass(frozen=True)
class Classifier:
    """A classifier over the last prompt token's final hidden state (vLLM's pooling runner for
    /classify, /score and /rerank): a `*ForSequenceClassification` checkpoint's `score` head
    (token_ids empty), or a causal LM's logits of some tokens (vLLM's `classifier_from_token`
    hf_overrides; with `is_original_qwen3_reranker`, Qwen3-Reranker's one label: the second
    token's logit minus the first's, so that its sigmoid is P(yes) of the softmax over both)."""

    labels: tuple[str, ...]  # a name per label (id2label's, or the tokens')
    token_ids: tuple[int, ...] = ()
    difference: bool = False

    @property
    def num_labels(self) -> int:
        return 1 if self.difference else len(self.labels)


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str  # the family: model/families.py
    dtype_name: str  # torch's name of the dtype the model computes in: `dtype` is the dtype
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_model_len: int
    eos_token_ids: frozenset[int]
    # RoPE as the checkpoint's config gives it: the float32 inverse frequencies (head_dim / 2)
    # and the attention scaling that multiplies cos and sin (model/layers.py RotaryEmbedding).
    # Resolved here, with transformers, so that the processes that only build and run the model
    # (engine core, tensor-parallel ranks) never import a transformers config class.
    rope_inv_freq: tuple[float, ...] = field(repr=False)
    rope_scaling: float = 1.0
    quantization: str = "none"  # none | gguf | int8 (see QUANTIZATION_MODES)
    tokenizer: Path | None = None  # a tokenizer of its own; None: the checkpoint's
    # One reduction order per output value whatever the batch (model/kernels/gemm/panel_gemm.cpp):
    # a request's tokens and logprobs do not depend on its neighbours or on cache hits.
    batch_invariant: bool = True
    # What the family's layers add to Llama's (model/families.py).
    parts: Parts = field(default_factory=Parts)
    # The Hugging Face Hub id the model was named by (conveyor/hub.py: `path` is its download
    # in the cache); None for a local path.
    hub_id: str | None = None
    # A multimodal checkpoint served text-only (MULTIMODAL_TEXT_ONLY): its architecture; the
    # language model's weights are read under the text model's names, the rest is not read.
    text_of: str | None = None
    # A head's q and k rows in the order that makes the checkpoint's RoPE (partial, or GLM's
    # interleaved pairs) the default one (rotary_rows); None: the checkpoint's order.
    rotary_rows: tuple[int, ...] | None = None
    # A classifier head (Classifier): the model answers pooling "classify" requests (/classify,
    # /score, /rerank); None: it has none (/score and /rerank then compare embeddings).
    classifier: Classifier | None = None
    # The pooling of an embedding request that names none: the checkpoint's sentence-
    # transformers Pooling module's (cls | mean | last), else an encoder's first token, a
    # decoder's last.
    default_pooling: str = "last"
    # A BERT-family encoder (model/bert.py): bidirectional, each sequence whole in one step;
    # it embeds and classifies, it generates nothing.
    is_encoder: bool = False
    # The checkpoint's multi-token prediction layers loaded as a draft proposer (model/mtp.py:
    # speculative_config's "mtp"); 0: not read.
    mtp_layers: int = 0

    @property
    def is_sequence_classifier(self) -> bool:
        """A `*ForSequenceClassification` checkpoint: its head is no vocabulary's, it does
        not generate."""
        return self.classifier is not None and not self.classifier.token_ids

    @property
    def generates(self) -> bool:
        """Whether the model has a vocabulary head to generate with."""
        return not self.is_encoder and not self.is_sequence_classifier

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    def with_kernels_checked(self) -> ModelConfig:
        """This config once the block kernels are known to run here (their CPU and their
        build): a quantized GGUF whose kernels do not is served dequantized, as the float
        checkpoint it then is; int8 is refused. Called where the model runs: the front end
        that resolved the config imports no torch (engine/core_proc.py)."""
        if self.quantization == "none":
            return self
        from conveyor.model import quant

        if quant.kernels_available():
            return self
        if self.quantization == "int8":
            raise _no_int8_kernels("cpu")
        _warn_dequantized(self.path, self.dtype_name, "cpu")
        return dataclasses.replace(self, quantization="none")

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def tokenizer_path(self) -> Path:
        """The folder the tokenizer loads from."""
        return hf_folder(self.tokenizer or self.path)

    @classmethod
    def from_hf(
        cls,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        quantization: str = "auto",
        tokenizer: str | Path | None = None,
        batch_invariant: bool = True,
        *,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        load_format: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
        disable_sliding_window: bool = False,
    ) -> ModelConfig:
        """model: a checkpoint folder, a .gguf file, or a Hugging Face Hub id (downloaded into
        the cache at `revision`, conveyor/hub.py); None: the default model. tokenizer: a
        folder, .gguf file or Hub id whose tokenizer replaces the checkpoint's.
        disable_sliding_window: full attention on every layer, the context capped at the
        smallest window, within which a window hides nothing (vLLM's)."""
        path = checkpoint_path(model, revision, download_dir, load_format)
        facts = checkpoint_facts(path, hf_overrides)
        resolved_dtype = _resolve_dtype(dtype, facts["saved_dtype"], device)
        parts = Parts.from_dict(facts["parts"])
        limit, bound = facts["max_position_embeddings"], "the model's max_position_embeddings"
        rope_inv_freq, rope_scaling = facts["rope_inv_freq"], facts["rope_scaling"]
        rope_limit = facts.get("rope_position_limit")
        long_rope = facts.get("rope_long")
        past = isinstance(max_model_len, int) and rope_limit and max_model_len > rope_limit[0]
        if long_rope is not None and past:
            # A context past longrope's original length: its long factors at every position,
            # as vLLM and llama.cpp choose by the context (transformers chooses by each forward's
            # length, so a sequence within the original length turns by the short ones there).
            rope_inv_freq, rope_scaling = long_rope["inv_freq"], long_rope["scaling"]
            _warn_long_rope(path, rope_limit[0], max_model_len)
        elif rope_limit is not None and rope_limit[0] < limit:
            limit, bound = rope_limit
        if disable_sliding_window and any(parts.windows):
            window = min(w for w in parts.windows if w)
            if window < limit:
                limit, bound = window, "the sliding window, with --disable-sliding-window"
            parts = dataclasses.replace(parts, windows=())
        return cls(
            path=path,
            architecture=facts["architecture"],
            dtype_name=resolved_dtype,
            vocab_size=facts["vocab_size"],
            hidden_size=facts["hidden_size"],
            intermediate_size=facts["intermediate_size"],
            num_layers=facts["num_layers"],
            num_heads=facts["num_heads"],
            num_kv_heads=facts["num_kv_heads"],
            head_dim=facts["head_dim"],
            rms_norm_eps=facts["rms_norm_eps"],
            tie_word_embeddings=facts["tie_word_embeddings"],
            qkv_bias=facts["qkv_bias"],
            qk_norm=facts["qk_norm"],
            max_model_len=_resolve_max_len(limit, max_model_len, bound),
            eos_token_ids=frozenset(facts["eos_token_ids"]),
            rope_inv_freq=tuple(rope_inv_freq),
            rope_scaling=rope_scaling,
            quantization=_encoder_quantization(quantization)
            if facts.get("encoder")
            else _resolve_quantization(quantization, path, resolved_dtype, device),
            tokenizer=_resolve_tokenizer(tokenizer, tokenizer_revision, download_dir),
            batch_invariant=bool(batch_invariant),
            parts=parts,
            hub_id=None if model is None or _local(model) is not None else str(model),
            text_of=facts.get("text_of"),
            rotary_rows=tuple(facts["rotary_rows"]) if facts.get("rotary_rows") else None,
            classifier=_classifier(facts.get("classifier")),
            default_pooling=facts.get("pooling") or "last",
            is_encoder=bool(facts.get("encoder")),
        )


def checkpoint_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> Path:
    """The local checkpoint `model` names: its path, or for a Hugging Face Hub id that is no
    path on disk, its download in the cache (conveyor/hub.py). ValueError where there is none
    or it is not in `load_format`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model is not None and _local(model) is None:
        from conveyor import hub

        if hub.looks_like_repo(model):
            model = str(hub.download(model, revision, download_dir, load_format))
    path = resolve_model_path(model)
    if load_format == "gguf" and path.suffix != ".gguf":
        raise ValueError(f"load_format 'gguf': {str(path)!r} is not a .gguf file")
    if load_format == "safetensors" and not path.is_dir():
        raise ValueError(f"load_format 'safetensors': {str(path)!r} is not a checkpoint folder")
    return path


def _local(model: str | Path | None) -> Path | None:
    """`model` as a path on disk, if it is one."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return path if path.exists() else None


def checkpoint_facts(path: Path, hf_overrides: dict[str, Any] | None = None) -> dict:
    """What ModelConfig takes from the checkpoint's config.json and generation_config.json, as
    transformers reads them, with `hf_overrides`' fields in place of config.json's; kept by
    the files' contents and the overrides (model/resolve_cache.py), so that a later start
    imports no transformers config class (3-4 s on 2 cores)."""
    from conveyor.model.resolve_cache import cached

    folder = hf_folder(path)
    if path.is_dir():
        check_prequantized(folder, str(folder))
    kind = "model"
    if hf_overrides:
        text = json.dumps(hf_overrides, sort_keys=True)
        kind += "-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return cached(kind, folder, lambda: _read_facts(folder, hf_overrides))


def hf_config(folder: Path, hf_overrides: dict[str, Any] | None = None):
    """The checkpoint's transformers config, built from config.json with `hf_overrides`'
    fields in place of its own (a dict merged into a dict field: rope_scaling), as vLLM's
    --hf-overrides: the config class reads them as if the file said so."""
    from transformers import AutoConfig, PretrainedConfig

    if not hf_overrides:
        return AutoConfig.from_pretrained(folder)
    fields, _ = PretrainedConfig.get_config_dict(folder)
    for key, value in hf_overrides.items():
        current = fields.get(key)
        both = isinstance(value, dict) and isinstance(current, dict)
        fields[key] = {**current, **value} if both else value
    if "model_type" not in fields:
        raise ValueError(f"{folder / 'config.json'} has no model_type to override")
    try:
        return AutoConfig.for_model(**fields)
    except Exception as error:  # noqa: BLE001 - transformers' validators raise their own types
        reason = " ".join(str(error).split())[:500]
        raise ValueError(f"hf_overrides: the overridden config is not valid: {reason}") from None


# Multimodal checkpoints whose language model is a family conveyor computes: served text-only
# (their vision tower and projector are not read; a request with an image is refused, as any
# multimodal field is), as Gemma 3 (4B and up), Mistral Small 3.1 / 3.2, LLaVA, Qwen2-VL,
# Qwen2.5-VL, Qwen3-VL and Qwen3.5 ship. The Qwen VLs' multimodal RoPE gives a text token the same
# position on its three axes: on text it is the 1-D RoPE of their text model's family.
MULTIMODAL_TEXT_ONLY = (
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Gemma3nForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
# Families whose RoPE turns pairs of adjacent dims (2i, 2i + 1), GPT-J's way (rotary_rows).
INTERLEAVED_ROPE = ("glm", "glm4", "ernie4_5", "ernie4_5_moe")
# Text model types with no causal-LM class of their own -> the family's class they compute as.
_TEXT_MODEL_CLASSES = {
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
}


def _language_model(hf, stored: list[str]):
    """The text config of a MULTIMODAL_TEXT_ONLY checkpoint's config, as a causal LM's: its
    architecture the text model type's, its lm_head tied where the checkpoint stores none (as
    transformers ties it), its dtype the checkpoint's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = hf.get_text_config()
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type) or _TEXT_MODEL_CLASSES.get(
        text.model_type
    )
    if causal is None:
        raise ValueError(
            f"{hf.architectures}: its language model {text.model_type!r} is no causal LM"
        )
    text.architectures = [causal]
    if text.model_type == "qwen3_vl_moe_text":  # its router renormalises the top-k, always
        text.norm_topk_prob = True
    text.tie_word_embeddings = not any(name.endswith("lm_head.weight") for name in stored)
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf, "dtype", None)
    if getattr(hf, "eos_token_id", None) is not None:
        # the multimodal model's, as its generate stops (Gemma 4's [1, 106]: the end of a
        # turn too, where its text config names only 1)
        text.eos_token_id = hf.eos_token_id
    return text


def stored_tensor_names(folder: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint folder: its index's, or its files'."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return names


def _sequence_classifier(hf, folder: Path, stored: list[str]) -> dict | None:
    """The classifier facts of a config (Classifier's fields as JSON), the config's
    architectures turned to the causal LM's where it names a `*ForSequenceClassification`;
    None without one. vLLM's `classifier_from_token` (given by --hf-overrides) names tokens
    whose logits are the labels'."""
    names = list(getattr(hf, "architectures", None) or [])
    sequence = next((n for n in names if n.endswith("ForSequenceClassification")), None)
    tokens = getattr(hf, "classifier_from_token", None)
    if sequence is None and tokens is None:
        return None
    if sequence is not None:
        hf.architectures = [sequence.removesuffix("ForSequenceClassification") + "ForCausalLM"]
    difference = bool(getattr(hf, "is_original_qwen3_reranker", False))
    if tokens is None:
        if "score.weight" not in stored:
            raise ValueError(f"{sequence} checkpoint without a score.weight head")
        if any(name.endswith(".bias") and name.startswith("score.") for name in stored):
            raise ValueError(f"unsupported biased score head of {sequence}")
        labels = getattr(hf, "id2label", None) or {}
        count = int(getattr(hf, "num_labels", len(labels)) or len(labels))
        return {"labels": [str(labels.get(i, f"LABEL_{i}")) for i in range(count)]}
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    if difference and len(tokens) != 2:
        raise ValueError(
            f"is_original_qwen3_reranker takes two classifier_from_token tokens, got {tokens!r}"
        )
    return {"labels": tokens, "token_ids": _token_ids(folder, tokens), "difference": difference}


def _token_ids(folder: Path, tokens: list[str]) -> list[int]:
    """Each token's id in the checkpoint's tokenizer (tokenizer.json), as vLLM looks them up."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"classifier_from_token: no tokenizer.json in {folder} to find {tokens}")
    vocabulary = Tokenizer.from_file(str(path))
    ids = [vocabulary.token_to_id(token) for token in tokens]
    if None in ids:
        missing = [t for t, i in zip(tokens, ids, strict=True) if i is None]
        raise ValueError(f"classifier_from_token: {missing} not in the tokenizer's vocabulary")
    return ids


def _classifier(facts: dict | None) -> Classifier | None:
    if facts is None:
        return None
    return Classifier(
        labels=tuple(facts["labels"]),
        token_ids=tuple(facts.get("token_ids", ())),
        difference=bool(facts.get("difference", False)),
    )


def _read_facts(folder: Path, hf_overrides: dict[str, Any] | None = None) -> dict:
    hf = hf_config(folder, hf_overrides)
    stored = stored_tensor_names(folder)  # the checkpoint's tensors' names, read once
    if any(ENCODER_ARCHITECTURES.get(n) for n in hf.architectures or ()):
        return _encoder_facts(hf, folder, stored)
    wrapper = next((n for n in hf.architectures or () if n in MULTIMODAL_TEXT_ONLY), None)
    if wrapper is not None:
        hf = _language_model(hf, stored)
    if vars(hf).get("_heterogeneity_spec") is not None:
        # A config whose layers differ (Gemma 4's head dims): its global values are the
        # model's defaults; the family's builder reads each layer's (Parts.layer_heads), so
        # transformers' warning about reading them globally says nothing to a user.
        hf.allow_global_per_layer_attribute_access = True
        logging.getLogger("transformers.integrations.heterogeneity.configuration_utils").setLevel(
            logging.ERROR
        )
    classifier = _sequence_classifier(hf, folder, stored)
    if classifier is not None and "token_ids" not in classifier:
        # The head is the score's: an lm_head, stored or not, is never read (tied: none kept).
        hf.tie_word_embeddings = True
    arch = architecture(hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
    mla = arch in MLA_FAMILIES
    rope_dim = int(hf.qk_rope_head_dim) if mla else head_dim
    rope_inv_freq, rope_scaling = rope_frequencies(hf, rope_dim)
    rows = None if mla else rotary_rows(hf, int(head_dim), arch in INTERLEAVED_ROPE)
    num_layers = num_decoder_layers(hf, arch)
    parts = parts_of(hf, arch, num_layers, int(head_dim), _local_rope)
    if mla:
        # The cache holds one "kv head" per token: the normed latent and the rope key
        # (model/mla.py).
        head_dim, num_kv_heads = int(hf.kv_lora_rank) + rope_dim, 1
    if not parts.o_bias and any(n.endswith(".o_proj.bias") for n in stored):
        # attention_bias gives the o_proj a bias in some families (Llama, Granite, OLMo 2,
        # InternLM3), not in others (Qwen2, Mistral): the checkpoint says which.
        parts = dataclasses.replace(parts, o_bias=True)
    saved = getattr(hf, "dtype", None)
    return {
        "architecture": arch,
        "vocab_size": int(hf.vocab_size),
        "hidden_size": int(hf.hidden_size),
        "intermediate_size": _mlp_width(hf),
        "num_layers": num_layers,
        "num_heads": int(hf.num_attention_heads),
        "num_kv_heads": num_kv_heads,
        "head_dim": int(head_dim),
        "rms_norm_eps": _norm_eps(hf, arch),
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "qkv_bias": arch == "qwen2"
        or bool(getattr(hf, "qkv_bias", False))  # Qwen2-MoE's
        or bool(getattr(hf, "attention_bias", False)),
        "qk_norm": parts.qk_norm == "head",
        "max_position_embeddings": int(getattr(hf, "max_position_embeddings", None) or 2048),
        # the name of the dtype the checkpoint was saved in ("float32", ...), or None
        "saved_dtype": str(saved).removeprefix("torch.") if saved is not None else None,
        "eos_token_ids": sorted(_eos_ids(folder, hf)),
        "rope_inv_freq": list(rope_inv_freq),
        "rope_scaling": rope_scaling,
        "parts": parts.to_dict(),
        "text_of": wrapper,
        "rotary_rows": None if rows is None else list(rows),
        "rope_position_limit": rope_position_limit(hf),
        "rope_long": _long_rope(hf, int(head_dim)),
        "pooling": _decoder_pooling(folder),
        "classifier": classifier,
    }


def _norm_eps(hf, arch: str) -> float:
    if arch in ("lfm2", "lfm2_moe"):
        return float(hf.norm_eps)
    if arch == "nemotron_h":
        return float(hf.layer_norm_epsilon)
    return float(hf.rms_norm_eps)


def _mlp_width(hf) -> int:
    """The dense MLP's width: intermediate_size, or LFM2's adjusted from it as transformers
    adjusts it (2/3 of it, times block_ffn_dim_multiplier, rounded up to block_multiple_of);
    0 for Qwen3.5-MoE, which has no dense MLP nor a size for one; the widest of per-layer
    widths (Gemma 3n's list: Parts.mlp_sizes)."""
    width = getattr(hf, "intermediate_size", None) or 0
    width = max(width) if isinstance(width, list | tuple) else int(width)
    if getattr(hf, "model_type", None) == "granitemoehybrid":  # its MLP is the shared_mlp
        return int(hf.shared_intermediate_size)
    if getattr(hf, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if hf.block_ffn_dim_multiplier is not None:
            width = int(hf.block_ffn_dim_multiplier * width)
            multiple = hf.block_multiple_of
            width = multiple * ((width + multiple - 1) // multiple)
    return width


# The BERT family's encoders (model/bert.py): architecture -> family.
ENCODER_ARCHITECTURES = {
    f"{prefix}{suffix}": {"Bert": "bert", "ModernBert": "modernbert"}.get(prefix, "roberta")
    for prefix in ("Bert", "Roberta", "XLMRoberta", "ModernBert")
    for suffix in ("Model", "ForMaskedLM", "ForSequenceClassification")
}
_ENCODER_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# sentence-transformers' pooling modes (1_Pooling/config.json) -> conveyor's pooling
_SENTENCE_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


def _encoder_facts(hf, folder: Path, stored: list[str]) -> dict:
    """ModelConfig's facts of a BERT / RoBERTa / XLM-RoBERTa encoder (model/bert.py): an
    embedder, or with a *ForSequenceClassification head a cross-encoder (classifier)."""
    name = next(n for n in hf.architectures if n in ENCODER_ARCHITECTURES)
    family = ENCODER_ARCHITECTURES[name]
    if family == "modernbert":
        return _modernbert_facts(hf, folder, name)
    kind = getattr(hf, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"unsupported position_embedding_type {kind!r} of {name}")
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        raise ValueError(f"unsupported {name} as a decoder (is_decoder / add_cross_attention)")
    act = getattr(hf, "hidden_act", "gelu")
    if act not in _ENCODER_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} of {name}; supported: gelu, gelu_new")
    offset = int(hf.pad_token_id) + 1 if family == "roberta" else 0
    types = int(getattr(hf, "type_vocab_size", 0) or 0)
    sep = -1
    if types > 1:  # a pair's second text is type 1: after the tokenizer's first sep token
        sep = _sep_token_id(folder)
    parts = Parts(
        family=family,
        act=_ENCODER_ACTIVATIONS[act],
        position_offset=offset,
        type_vocab_size=types,
        sep_token_id=sep,
    )
    heads = int(hf.num_attention_heads)
    return _encoder_fact_dict(
        hf, folder, name, parts,
        head_dim=int(hf.hidden_size) // heads,
        eps=float(hf.layer_norm_eps),
        qkv_bias=True,
        max_len=int(hf.max_position_embeddings) - offset,
        rope_inv_freq=[],
    )  # fmt: skip


def _modernbert_facts(hf, folder: Path, name: str) -> dict:
    """ModelConfig's facts of a ModernBERT encoder (model/modernbert.py): its global and
    local layers' RoPE and window, biases, and its classifier's pooling and activation."""
    heads = int(hf.num_attention_heads)
    head_dim = int(hf.hidden_size) // heads
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    for setting in ("hidden_activation", "classifier_activation"):
        if getattr(hf, setting) not in acts:
            raise ValueError(f"unsupported {setting} {getattr(hf, setting)!r} of {name}")
    if hf.classifier_pooling not in ("cls", "mean"):
        raise ValueError(f"unsupported classifier_pooling {hf.classifier_pooling!r} of {name}")
    types = list(hf.layer_types)
    window = int(hf.local_attention) // 2  # |i - j| <= window on the local layers
    parts = Parts(
        family="modernbert",
        act=acts[hf.hidden_activation],
        windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        ropes=tuple(1 if t == "sliding_attention" else 0 for t in types),
        local_rope_inv_freq=rope_frequencies(hf, head_dim, "sliding_attention")[0],
        o_bias=bool(hf.attention_bias),
        norm_bias=bool(hf.norm_bias),
        mlp_bias=bool(hf.mlp_bias),
        head_bias=bool(hf.classifier_bias),
        classifier_pooling=hf.classifier_pooling,
        classifier_act=acts[hf.classifier_activation],
    )
    return _encoder_fact_dict(
        hf, folder, name, parts,
        head_dim=head_dim,
        eps=float(hf.norm_eps),
        qkv_bias=bool(hf.attention_bias),
        max_len=int(hf.max_position_embeddings),
        rope_inv_freq=list(rope_frequencies(hf, head_dim, "full_attention")[0]),
    )  # fmt: skip


def _encoder_fact_dict(
    hf, folder: Path, name: str, parts: Parts, *, head_dim: int, eps: float, qkv_bias: bool,
    max_len: int, rope_inv_freq: list[float],
) -> dict:  # fmt: skip
    """The facts every encoder states alike: sizes, no generation, the checkpoint's pooling,
    and with a *ForSequenceClassification head its labels."""
    classifier = None
    if name.endswith("ForSequenceClassification"):
        labels = getattr(hf, "id2label", None) or {}
        count = int(getattr(hf, "num_labels", len(labels)) or len(labels))
        classifier = {"labels": [str(labels.get(i, f"LABEL_{i}")) for i in range(count)]}
    saved = getattr(hf, "dtype", None)
    heads = int(hf.num_attention_heads)
    return {
        "architecture": parts.family,
        "vocab_size": int(hf.vocab_size),
        "hidden_size": int(hf.hidden_size),
        # (Qwen3.5-MoE's has no dense MLP, nor a size for one)
        "intermediate_size": int(getattr(hf, "intermediate_size", None) or 0),
        "num_layers": int(hf.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "tie_word_embeddings": False,
        "qkv_bias": qkv_bias,
        "qk_norm": False,
        "max_position_embeddings": max_len,
        "saved_dtype": str(saved).removeprefix("torch.") if saved is not None else None,
        "eos_token_ids": [],
        "rope_inv_freq": rope_inv_freq,
        "rope_scaling": 1.0,
        "parts": parts.to_dict(),
        "text_of": None,
        "rotary_rows": None,
        "rope_position_limit": None,
        "rope_long": None,
        "pooling": sentence_pooling(folder) or "cls",
        "classifier": classifier,
        "encoder": True,
    }


def _sep_token_id(folder: Path) -> int:
    """The tokenizer's separator token's id (BERT's [SEP]); -1 where it names none."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / file
        if path.is_file():
            token = json.loads(path.read_text()).get("sep_token")
            if isinstance(token, dict):  # an AddedToken's fields
                token = token.get("content")
            if isinstance(token, str):
                try:
                    return _token_ids(folder, [token])[0]
                except ValueError:
                    return -1
    return -1


def _decoder_pooling(folder: Path) -> str | None:
    """A decoder's sentence-transformers pooling (Qwen3-Embedding's last token, say); one that
    conveyor does not compute leaves the default (last) with a warning: the model still
    generates."""
    try:
        return sentence_pooling(folder)
    except ValueError as error:
        logger.warning("conveyor: %s; embeddings pool the last token", error)
        return None


def sentence_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint states (modules.json's Pooling module's
    config: cls, mean or last token); None where it states none. A module that changes the
    pooled vector other than by normalizing it (Dense, say) is refused: conveyor's
    embedding would not be the model's."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        pooling = None
        for module in modules:
            kind = str(module.get("type", "")).rpartition(".")[2]
            if kind == "Pooling":
                config = folder / module.get("path", "") / "config.json"
                modes = json.loads(config.read_text()) if config.is_file() else {}
                chosen = [mode for key, mode in _SENTENCE_POOLING.items() if modes.get(key)]
                others = [k for k, v in modes.items() if k.startswith("pooling_mode") and v]
                if len(chosen) != 1 or len(others) != 1:
                    raise ValueError(f"unsupported sentence-transformers pooling {others}")
                pooling = chosen[0]
            elif kind not in ("Transformer", "Normalize", "Pooling"):
                raise ValueError(f"unsupported sentence-transformers module {kind!r}")
    except (OSError, AttributeError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: unreadable sentence-transformers modules ({error})") from None
    return pooling


def _long_rope(hf, head_dim: int) -> dict | None:
    """longrope's long factors' frequencies and scaling; None for every other RoPE."""
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    inv_freq, scaling = rope_frequencies(hf, head_dim, long=True)
    return {"inv_freq": list(inv_freq), "scaling": scaling}


def _local_rope(hf, head_dim: int) -> tuple[float, ...]:
    return rope_frequencies(hf, head_dim, "sliding_attention")[0]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _resolve_tokenizer(
    tokenizer: str | Path | None, revision: str | None = None, download_dir: str | None = None
) -> Path | None:
    if tokenizer is None:
        return None
    path = _local(tokenizer)
    if path is None:
        from conveyor import hub

        if not hub.looks_like_repo(str(tokenizer)):
            raise ValueError(f"tokenizer {str(tokenizer)!r} does not exist")
        path = hub.download(str(tokenizer), revision, download_dir, weights=False)
    return path


def check_tokenizer(cfg: ModelConfig) -> None:
    """One clear error for a checkpoint without a tokenizer, before anything loads."""
    folder = cfg.tokenizer_path
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        where = "the tokenizer folder" if cfg.tokenizer else "the checkpoint"
        raise ValueError(
            f"{where} {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "pass tokenizer=PATH (--tokenizer PATH) with the folder of the model's tokenizer"
        )


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer AutoTokenizer gives for the checkpoint. AutoTokenizer picks the class by
    reading the model's config with its config class (3-4 s of imports on 2 cores); the class it
    picked is kept by the tokenizer files' contents (model/resolve_cache.py), and a later load
    calls that class's from_pretrained directly, which is the call AutoTokenizer ends in."""
    from conveyor.model.resolve_cache import cached

    check_tokenizer(cfg)
    folder = cfg.tokenizer_path
    loaded = []

    def resolve() -> dict:
        from transformers import AutoTokenizer

        loaded.append(AutoTokenizer.from_pretrained(folder))
        cls = type(loaded[0])
        return {"module": cls.__module__, "name": cls.__qualname__}

    chosen = cached("tokenizer", folder, resolve)
    if loaded:
        return _processor_chat_template(loaded[0], folder)
    cls = _tokenizer_class(chosen)
    if cls is None:
        from transformers import AutoTokenizer

        return _processor_chat_template(AutoTokenizer.from_pretrained(folder), folder)
    return _processor_chat_template(cls.from_pretrained(folder), folder)


def _processor_chat_template(tokenizer, folder: Path):
    """A multimodal checkpoint may keep its chat template in its processor's file
    (chat_template.json) and none in the tokenizer's: the tokenizer takes that one."""
    path = folder / "chat_template.json"
    if getattr(tokenizer, "chat_template", None) is None and path.is_file():
        try:
            template = json.loads(path.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            template = None
        if isinstance(template, str):
            tokenizer.chat_template = template
    return tokenizer


def _tokenizer_class(chosen: dict) -> type | None:
    """The kept class, if it is one of transformers' own (remote code is never kept)."""
    import importlib

    module = chosen.get("module", "")
    if not isinstance(module, str) or not module.startswith("transformers."):
        return None
    try:
        cls = getattr(importlib.import_module(module), chosen.get("name", ""), None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


def hf_folder(path: Path) -> Path:
    """Where config.json and the tokenizer live: the checkpoint itself, or for a GGUF file
    a folder converted once from its metadata."""
    if path.suffix == ".gguf":
        from conveyor.model.gguf_loader import gguf_hf_folder

        return gguf_hf_folder(path)
    return path


def rope_frequencies(
    hf, head_dim: int, layer_type: str = "full_attention", long: bool = False
) -> tuple[tuple[float, ...], float]:
    """RoPE's float32 inverse frequencies and attention scaling for a transformers config, as
    transformers computes them (its ROPE_INIT_FUNCTIONS for the scaled variants). A config
    with one RoPE per layer type (Gemma 3) gives `layer_type`'s. With partial rotary (GLM's
    half, say) transformers' rotary_dim / 2 frequencies come first and the other dims' are 0:
    their pairs turn by cos 0 = 1, sin 0 = 0, unchanged (model/rotary_rows). long: longrope's
    long factors' frequencies (what transformers turns by past the original length)."""
    params = getattr(hf, "rope_parameters", None) or {}
    by_type = isinstance(params.get(layer_type), dict)
    if by_type:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES and rope_type != "longrope":
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; "
            f"supported: {', '.join(sorted(STATIC_ROPE_TYPES | {'longrope'}))}"
        )
    import torch

    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = rotary_dim(hf, head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq, scaling = 1.0 / (base**exponents), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {"layer_type": layer_type} if by_type else {}
        if long:  # the frequencies transformers switches to past the original length
            extra["seq_len"] = int(params["original_max_position_embeddings"]) + 1
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **extra)
    freqs = inv_freq.float().tolist()
    return tuple(freqs + [0.0] * (head_dim // 2 - len(freqs))), float(scaling)


def rope_position_limit(hf) -> tuple[int, str] | None:
    """The positions below which conveyor computes the model as transformers does, where its
    RoPE (or its queries' scale) changes past a length, and why. longrope (Phi-3.5, Phi-4-mini)
    turns by its short factors while a sequence stays within original_max_position_embeddings
    and by its long ones past it, as transformers switches them; Ministral 3 scales its
    queries by 1 + beta * log(1 + floor(position / original_max_position_embeddings)), 1 below
    that. By default the context stops there; a longer max_model_len turns longrope's every
    position by its long factors (ModelConfig.from_hf) and is refused for Ministral 3. None:
    no limit."""
    params = getattr(hf, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") or getattr(
        hf, "original_max_position_embeddings", None
    )
    if params.get("rope_type") == "longrope":
        why = "longrope's short factors: from position {} on transformers turns by its long ones"
    elif params.get("llama_4_scaling_beta"):
        why = "the queries' scale is 1 below position {}, larger past it (llama_4_scaling_beta)"
    else:
        return None
    return int(original), why.format(int(original)) + ", which conveyor does not compute"


def rotary_dim(hf, head_dim: int) -> int:
    """The dims RoPE turns: head_dim times the config's partial_rotary_factor, as transformers
    takes it."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if factor is None else float(factor)))


def rotary_rows(hf, head_dim: int, interleaved: bool) -> tuple[int, ...] | None:
    """Where RoPE is not transformers' default (the first half of head_dim paired with the
    second), the order of a head's q and k rows that makes it so: new row j is old row
    order[j]. Partial rotary (the first rotary_dim dims turned, rotate-half within them) and
    GLM's interleaved pairs (2i, 2i + 1) become pairs (j, j + head_dim / 2), the unturned dims
    in the pairs whose frequency is 0. Scores are sums over the dims of q times k, the same in
    any order both share; the values' rows keep theirs. None: the default."""
    dim = rotary_dim(hf, head_dim)
    if dim == head_dim and not interleaved:
        return None
    if dim % 2 or not 0 < dim <= head_dim or head_dim % 2:
        raise ValueError(f"unsupported rotary dims {dim} of head_dim {head_dim}")
    half, turned = head_dim // 2, dim // 2
    if interleaved:
        first, second = list(range(0, dim, 2)), list(range(1, dim, 2))
    else:
        first, second = list(range(turned)), list(range(turned, dim))
    rest = list(range(dim, head_dim))
    order = first + rest[: half - turned] + second + rest[half - turned :]
    return tuple(order)


def _resolve_dtype(dtype: str | torch.dtype, saved_name: str | None, device: str) -> str:
    """torch's name of the dtype to compute in."""
    if not isinstance(dtype, str):  # a torch.dtype, named without importing torch
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return name
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    saved = DTYPES.get(saved_name) if saved_name else None
    if saved in ("float32", "float64"):
        return saved
    # Half precision is slow on most CPUs; on a GPU it is what the checkpoint was made for.
    return "float32" if device == "cpu" else (saved or "bfloat16")


def _encoder_quantization(requested: str) -> str:
    """An encoder runs in its float dtype (model/bert.py has no quantized route)."""
    if requested not in ("auto", "none"):
        raise ValueError(f"quantization {requested!r}: an encoder (BERT family) runs unquantized")
    return "none"


def _resolve_quantization(requested: str, path: Path, dtype: str, device: str) -> str:
    """The quantization the checkpoint is served with, as far as the settings and the file
    decide it; whether the block kernels build here is settled by the process that runs the
    model (ModelConfig.with_kernels_checked), which imports torch."""
    from conveyor.model.gguf_loader import is_quantized_gguf

    if requested in CHECKPOINT_METHODS:
        requested = _checkpoint_method(requested, path)
    if requested not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {requested!r}")
    if requested == "int8":
        if dtype == "float64":
            raise ValueError("quantization='int8' computes in float32; it cannot serve float64")
        if device != "cpu" or not _x86():
            raise _no_int8_kernels(device)
        return "int8"
    if requested == "none" or dtype == "float64":
        return "none"  # float64 is the oracle: a quantized checkpoint is dequantized for it
    if _is_prequantized(path):  # quantized already: kept small, as a quantized GGUF is
        return "int8" if device == "cpu" and _x86() else "none"
    if not is_quantized_gguf(path):
        return "none"
    if device != "cpu" or not _x86():
        _warn_dequantized(path, dtype, device)
        return "none"
    return "gguf"


def _checkpoint_method(requested: str, path: Path) -> str:
    """vLLM's name of the checkpoint's own quantization method -> "auto"; ValueError where
    the checkpoint was quantized otherwise, or not at all (a GGUF file is "gguf")."""
    if path.is_dir():
        quant = quantization_config(path)
        method = quant.get("quant_method") if quant else None
    else:
        method = "gguf" if path.suffix.lower() == ".gguf" else None
    if CHECKPOINT_METHODS[requested] != method:
        found = f"quantized with {method!r}" if method else "not quantized"
        raise ValueError(
            f"quantization={requested!r} names the method of a checkpoint quantized with "
            f"{CHECKPOINT_METHODS[requested]!r}, and this checkpoint is {found}: leave it "
            "'auto', or use 'int8' to quantize a float checkpoint"
        )
    return "auto"


def _is_prequantized(path: Path) -> bool:
    """A checkpoint folder quantized by another tool, of a method conveyor reads (fp8,
    compressed-tensors)."""
    quant = quantization_config(path) if path.is_dir() else None
    return quant is not None and quant.get("quant_method") in PREQUANTIZED_METHODS


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _no_int8_kernels(device: str) -> ValueError:
    return ValueError(
        "quantization='int8' needs the CPU kernels (x86-64 with AVX2/FMA/F16C), "
        f"not available on device {device!r}; use quantization='none'"
    )


def _warn_dequantized(path: Path, dtype: str, device: str) -> None:
    logger.warning(
        "conveyor: the quantized kernels run on x86-64 CPUs with AVX2 only; dequantizing "
        "%s to %s on %s",
        path.name,
        dtype,
        device,
    )


def _warn_long_rope(path: Path, original: int, max_model_len: int) -> None:
    logger.warning(
        "conveyor: max_model_len %d is past %s's original %d positions: its longrope long "
        "factors turn every position, as vLLM does; transformers turns a sequence that stays "
        "within %d positions by the short ones (a max_model_len of at most %d computes that)",
        max_model_len,
        path.name,
        original,
        original,
        original,
    )


def _resolve_max_len(
    limit: int, max_model_len: int | None, bound: str = "the model's max_position_embeddings"
) -> int:
    if max_model_len is None:
        return limit
    if not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValueError(
            f"max_model_len must be an integer in [1, {limit}] ({bound}), got {max_model_len!r}"
        )
    return max_model_len


def _eos_ids(folder: Path, hf) -> frozenset[int]:
    """EOS ids as transformers' generate sees them: generation_config.json, else the config."""
    ids: set[int] = set()
    gen_file = folder / "generation_config.json"
    if gen_file.exists():
        from transformers import GenerationConfig

        ids |= _as_set(GenerationConfig.from_pretrained(gen_file.parent).eos_token_id)
    return frozenset(ids or _as_set(getattr(hf, "eos_token_id", None)))


# The generation config's fields that are default sampling parameters, as vLLM reads them
# (its ModelConfig.get_diff_sampling_param): what the model's creators recommend, applied to
# the requests that leave the field out. max_new_tokens caps every request's max_tokens.
GENERATION_SAMPLING_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def sampling_defaults(
    path: Path, source: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The default sampling parameters of the model at `path`, as SamplingParams' keywords
    (max_new_tokens becomes max_tokens), as vLLM's --generation-config gives them: "auto" reads
    the checkpoint's generation_config.json (a GGUF file has none: {}), "vllm" none, a folder
    its own; then `override` (--override-generation-config) replaces fields. Values that are
    not valid sampling parameters are a ValueError naming where they came from."""
    from conveyor.sampling_params import SamplingParams

    found: dict[str, Any] = {}
    if source != "vllm":
        if source == "auto":
            folder = path if path.is_dir() else None
        else:
            folder = Path(source)
            if not folder.is_dir():
                raise ValueError(
                    f"generation_config must be 'auto', 'vllm' or a folder holding a "
                    f"generation_config.json, got {source!r}"
                )
        if folder is not None:
            from conveyor.model.resolve_cache import cached

            found = dict(cached("generation", folder, lambda: _generation_fields(folder)))
    sources = ["generation_config.json"] if found else []
    if override:
        found.update(override)
        sources.append("override_generation_config")
    fields = {k: found[k] for k in GENERATION_SAMPLING_FIELDS if found.get(k) is not None}
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"the default sampling parameters from {' and '.join(sources)} are not valid: {error} "
            f"(--generation-config vllm leaves the model's out)"
        ) from None
    return fields


def _generation_fields(folder: Path) -> dict[str, Any]:
    """The sampling fields a folder's generation_config.json sets, as transformers reads it."""
    if not (folder / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder / 'generation_config.json'}: {error}") from None
    return {k: diff[k] for k in GENERATION_SAMPLING_FIELDS if diff.get(k) is not None}


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}
