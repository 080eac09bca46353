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
    # levels of nesting in a schema, tool parameters or tool-call arguments (conveyor/nesting.py)
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
