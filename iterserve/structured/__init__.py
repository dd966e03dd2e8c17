"""Structured outputs (guided decoding): JSON schema, JSON object, regex, choice and EBNF
grammars, compiled once per spec and enforced by a token mask in the batched sampler."""

from iterserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
