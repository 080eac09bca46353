"""vLLM's PoolingParams, as far as conveyor's embeddings (LLM.embed) and classifications
(LLM.classify, LLM.score) take them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: the embedding's length, which must be the model's hidden size (a causal
    LM's hidden states were not trained to be shortened, as Matryoshka embeddings are; vLLM
    refuses it for such a model too). use_activation (normalize, its older name): for a
    classification, False gives the raw label logits instead of probabilities (a reward
    model's score); conveyor's embeddings are L2-normalized, so None or True there."""

    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        for name in ("use_activation", "normalize"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")

    @property
    def activation(self) -> bool:
        """Whether a classification's label logits become probabilities (vLLM's default)."""
        return self.use_activation is not False and self.normalize is not False

    def check(self, hidden_size: int) -> None:
        """ValueError where these parameters ask for what this model's embeddings are not."""
        for name in ("use_activation", "normalize"):
            if getattr(self, name) is False:
                raise ValueError(
                    f"{name}=False: conveyor's embeddings are L2-normalized; unnormalized ones "
                    "are not served"
                )
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(
                f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot "
                f"be shortened (it was not trained for that), got {self.dimensions}"
            )
