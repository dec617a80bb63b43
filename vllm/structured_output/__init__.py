"""Structured outputs (JSON schema, regex, choice, EBNF/Lark grammar) on top of xgrammar.

`StructuredOutputManager` validates and compiles specs and fills bitmasks, `RequestGrammar`
is one request's grammar state, `apply_bitmask` masks logits rows, and
`structured_outputs_from_request` turns request fields into `StructuredOutputsParams`.
"""

from vllm.structured_output.bitmask import apply_bitmask
from vllm.structured_output.grammar import RequestGrammar
from vllm.structured_output.manager import StructuredOutputManager
from vllm.structured_output.request import structured_outputs_from_request

__all__ = ["RequestGrammar", "StructuredOutputManager", "apply_bitmask", "structured_outputs_from_request"]
