"""Counts of speculative decoding, kept by the scheduler and shown by get_stats() and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.config import SpeculativeConfig


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0  # verifications: steps x requests that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: verifications whose draft i (0-based) was accepted
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, config: SpeculativeConfig | None) -> SpecDecodingStats | None:
        if config is None:
            return None
        return cls(accepted_per_position=[0] * config.num_speculative_tokens)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification: the accepted drafts plus the model's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )
