"""`GuidedDecoding`: what a request's output must match (a JSON schema, a regex, a list of
choices or a grammar), the small frozen value `SamplingParams` carries. Compiling and enforcing
it is engine/sample/structured_output.py.

NOTE: apart from structured_output.py so that the sampling settings, which every layer reads,
do not import the grammar compiler and its torch masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must match. `kind` is one of:
    - "json": `value` is a JSON schema, serialised (`{"type": "object"}` means any object);
    - "regex": `value` is a regular expression the whole output must match (Rust syntax);
    - "choice": `value` is a JSON list of strings, the output is exactly one of them;
    - "grammar": `value` is a Lark or GBNF (llama.cpp) grammar.
    """

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(KINDS)}, got {self.kind!r}.")
        if not isinstance(self.value, str):
            raise ValueError(f"guided decoding value must be a string, got {type(self.value).__name__}.")

    @classmethod
    def json_schema(cls, schema: dict | str | None = None) -> "GuidedDecoding":
        """Any JSON object when `schema` is None."""
        if schema is None:
            schema = {"type": "object"}
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> "GuidedDecoding":
        return cls("choice", json.dumps(list(choices)))
