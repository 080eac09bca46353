"""Structured output: decoding constrained by a JSON schema, a regex, a choice or a grammar."""

from conveyor.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
