"""StructuredOutputs: what a request constrains its output to, as plain picklable values.

Exactly one kind per request, as vLLM's `structured_outputs`:

    json         a JSON schema (dict, or its JSON text)
    json_object  True: any JSON object (OpenAI's response_format {"type": "json_object"})
    regex        the whole output matches it
    choice       the output is one of these strings
    grammar      a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)

Only the shape is checked here; whether the schema, regex or grammar compiles is checked by
the front end with the tokenizer (conveyor/structured/backend.py), before the core sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    json: dict | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # The cache key, computed once (a big schema's JSON text takes milliseconds to write) and
    # carried with the constraint to the engine core.
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)
    # Set once the front end has found it within the size and depth bounds (a big schema's
    # walk takes milliseconds, and a request is checked when parsed and again when admitted).
    _bounded: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)} (got {found})"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except ValueError as error:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {error}") from None
            elif not isinstance(self.json, (dict, bool)):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object or its JSON text), "
                    f"got {type(self.json).__name__}"
                )
        if self.json_object is not False and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or not all(isinstance(c, str) for c in choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputs | None:
        """A StructuredOutputs from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be a mapping of one of {', '.join(KINDS)}, "
                f"got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                f"expected one of {', '.join(KINDS)}"
            )
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if _is_set(getattr(self, name)))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, its text): the grammar cache's key. Dicts keep their key order, which is
        the order a schema's properties are generated in."""
        if self._key is not None:
            return self._key
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            value = json.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            value = ""
        object.__setattr__(self, "_key", (kind, value))
        return kind, value

    @property
    def param(self) -> str:
        """The request field an error about this constraint names."""
        return f"structured_outputs.{self.kind}"


def _is_set(value: Any) -> bool:
    return value is not None and value is not False
