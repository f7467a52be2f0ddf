"""Structured-output fields of a request -> one `GuidedDecoding` (or None).

Accepted, on both /v1/completions and /v1/chat/completions:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: `{"json": schema, "regex": str, "choice": [str], "grammar": str}`
  with exactly one key set, and its older `guided_json`, `guided_regex`, `guided_choice` and
  `guided_grammar` fields.
At most one constraint per request. The constraint is compiled here without the tokenizer, so
a bad schema, regex or grammar is a 400 that names its field; the engine compiles it again
against the vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured_output import GuidedDecoding, validate
from server.errors import bad_request

_VLLM_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def guided_decoding(req: Any) -> GuidedDecoding | None:
    """The request's constraint; raises OpenAIError (400) for a malformed or conflicting one."""
    found: list[tuple[str, GuidedDecoding]] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        set_keys = [k for k, v in req.structured_outputs.items() if v is not None]
        if len(set_keys) != 1 or set_keys[0] not in _VLLM_FIELDS.values():
            raise bad_request("structured_outputs must set exactly one of json, regex, choice or grammar.",
                              param="structured_outputs")
        found.append(("structured_outputs", _spec(set_keys[0], req.structured_outputs[set_keys[0]],
                                                  "structured_outputs")))
    for field, kind in _VLLM_FIELDS.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _spec(kind, value, field)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one structured-output constraint may be given, got {names}.", param=found[1][0])
    param, spec = found[0]
    try:
        validate(spec)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
    return spec


def _from_response_format(fmt: dict) -> GuidedDecoding | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding.json_schema()
    if kind == "json_schema":
        body = fmt.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object.",
                              param="response_format")
        return GuidedDecoding.json_schema(schema)
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                      param="response_format")


def _spec(kind: str, value: Any, param: str) -> GuidedDecoding:
    """The constraint as given; what its value must be (a JSON object, a list of strings) is
    checked once, by `validate` (engine/structured_output.py), with the messages it gives."""
    if kind == "json" and isinstance(value, str):
        return GuidedDecoding(kind, value)  # a serialised schema: validate parses it
    if kind in ("json", "choice"):
        return GuidedDecoding(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"the {kind} must be a non-empty string.", param=param)
    return GuidedDecoding(kind, value)
