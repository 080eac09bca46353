"""What classification and scoring return (vLLM's /classify, /score, /rerank, LLM.classify and
LLM.score), from what the engine computes: a classifier's label logits at a prompt's last token
(SamplingParams.pooling "classify", ModelConfig.classifier), or embeddings. Torch-free: the
server's front end computes these.

- Label probabilities: the sigmoid of a one-label classifier's logit, else the softmax over the
  labels (vLLM's default activation).
- A pair's score: a classifier (a cross-encoder: the two texts in one prompt, as the tokenizer
  joins a text pair) of one label gives its sigmoid; without a classifier, the cosine
  similarity of the two texts' embeddings (vLLM's score for embedding models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def label_probs(logits: Sequence[float]) -> list[float]:
    """Each label's probability: the sigmoid of a lone logit, else the softmax over them."""
    if len(logits) == 1:
        return [_sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (embeddings come L2-normalized: their dot product,
    divided by the norms again so that rounding keeps it within [-1, 1])."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return max(-1.0, min(1.0, dot / norm)) if norm else 0.0


def pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against one or many (1:1, 1:N), or two lists of one length
    (N:N); ValueError else."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: a text or a non-empty list of texts")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2"
        )
    return list(zip(first, second, strict=True))


def one_label(num_labels: int) -> None:
    """A classifier scores pairs with one label (a relevance logit); ValueError else."""
    if num_labels != 1:
        raise ValueError(
            f"the model's classifier has {num_labels} labels: scoring takes one (a relevance "
            "logit); classify instead (/classify, LLM.classify)"
        )
