"""What one HTTP request may ask for. Apart from config.py because `conveyor serve` builds its
flags from these defaults before it starts the engine core, and importing torch there (~2 s)
would delay the core's start by as much."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds on what one HTTP request may ask for, so that no single request can stall
    the engine for everyone else. Each is a `conveyor serve` flag; a request beyond one gets a
    400 that names the field."""

    max_n: int = 16
    max_logprobs: int = 20
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_stop: int = 16  # stop strings
    max_stop_length: int = 512  # characters of one stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # entries of logit_bias
    max_body_bytes: int = 32 * 2**20
    # A request's priority (--scheduling-policy priority; lower runs first) is clamped into
    # [min_priority, max_priority], not refused: the operator decides how far ahead of the
    # default 0 a client may put itself (min_priority 0: not at all). Default: 32-bit ints.
    min_priority: int = -(2**31)
    max_priority: int = 2**31 - 1
    # levels of nesting in a schema, tool parameters or tool-call arguments (conveyor/nesting.py)
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1 and not name.endswith("_priority"):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.min_priority > self.max_priority:
            raise ValueError(
                f"min_priority ({self.min_priority}) must be <= max_priority ({self.max_priority})"
            )

    def clamp_priority(self, priority: int) -> int:
        return min(max(priority, self.min_priority), self.max_priority)
