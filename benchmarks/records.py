"""What one `python -m benchmarks compare` run records: requests, steps and the run's summary.

Its own module so that compare.py (which fills them) and plots.py (which draws them) both
import it instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestRecord:
    """One request's life; times in seconds from the start of its run."""

    request_id: str
    prompt_len: int
    output_len: int  # requested
    num_output_tokens: int  # delivered
    arrival: float
    first_token: float
    finish: float
    # 99th percentile of the gaps between its consecutive output tokens (s); set after the run
    tbt_p99: float = 0.0
    # The request-level batch it ran in, numbered from 0 (conveyor-static, hf-generate); -1:
    # none (continuous batching has no batches, only steps)
    batch: int = -1

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def normalized_latency(self) -> float:
        return self.e2e / self.num_output_tokens


@dataclass(slots=True)
class StepSpan:
    """When one model step ran (seconds from the start of its run), who ran in it (request_id
    -> tokens computed) and who left after it: what the plots need of conveyor's StepRecords,
    and what the baselines without an engine (transformers' generate) record of theirs."""

    start: float
    end: float
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]


@dataclass(slots=True)
class RunResult:
    system: str
    request_rate: float
    requests: list[RequestRecord]
    steps: list[StepSpan]
    summary: dict[str, float]
