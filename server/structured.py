"""Structured-output fields of a request -> one `GuidedDecoding` (or None).

Accepted, on both /v1/completions and /v1/chat/completions:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: `{"json": schema, "regex": str, "choice": [str], "grammar": str}`
  with exactly one key set, and its older `guided_json`, `guided_regex`, `guided_choice` and
  `guided_grammar` fields.
At most one constraint per request. The constraint is compiled here without the tokenizer, so
a bad schema, regex or grammar is a 400 that names its field; the engine compiles it again
against the vocabulary. Before that, its size is checked (--max-structured-output-bytes,
--max-guided-choices): compiling takes time that grows faster than the constraint.
"""

from __future__ import annotations

import json
from typing import Any

from engine.core.guided_decoding import GuidedDecoding
from server.errors import bad_request
from server.protocol import JsonTooDeep, JsonValueError, check_json_value
from server.settings import ServerSettings

_VLLM_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def guided_decoding(req: Any, settings: ServerSettings) -> GuidedDecoding | None:
    """The request's constraint; raises OpenAIError (400) for a malformed, oversized or
    conflicting one."""
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
                                                  "structured_outputs", settings)))
    for field, kind in _VLLM_FIELDS.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _spec(kind, value, field, settings)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one structured-output constraint may be given, got {names}.", param=found[1][0])
    param, spec = found[0]
    _check_bytes(spec.value, param, settings)
    # NOTE: compiling the grammar (which finds a bad schema, regex or grammar) costs time that
    # grows with it: server/input_processor.py does it on a worker thread (`with_grammars`).
    return spec


def constraint_param(req: Any) -> str | None:
    """The field that carries the request's structured-output constraint (for a 400's param)."""
    if req.response_format is not None and req.response_format.get("type") != "text":
        return "response_format"
    for field in ("structured_outputs", *_VLLM_FIELDS):
        if getattr(req, field, None) is not None:
            return field
    return None


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


def _spec(kind: str, value: Any, param: str, settings: ServerSettings) -> GuidedDecoding:
    """The constraint as given; what its value must be (a JSON object, a list of strings) is
    checked once, by `validate` (engine/sample/structured_output.py), with the messages it gives."""
    if kind == "json" and isinstance(value, str):
        _check_schema_text(value, param, settings)
        return GuidedDecoding(kind, value)  # a serialised schema: validate parses it
    if kind == "choice" and isinstance(value, list) and len(value) > settings.max_guided_choices:
        raise bad_request(f"the choices may be at most {settings.max_guided_choices}, got {len(value)} "
                          "(--max-guided-choices).", param=param)
    if kind in ("json", "choice"):
        return GuidedDecoding(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"the {kind} must be a non-empty string.", param=param)
    return GuidedDecoding(kind, value)


def _check_schema_text(text: str, param: str, settings: ServerSettings) -> None:
    """A schema given as a JSON string gets the checks the request body got (the engine's
    parser would hit the recursion limit on a deeply nested one); bad JSON is validate's 400."""
    _check_bytes(text, param, settings)
    try:
        schema = json.loads(text)
    except RecursionError:
        raise bad_request(f"the JSON schema nests arrays and objects more than {settings.max_json_depth} "
                          "levels deep (--max-json-depth).", param=param) from None
    except ValueError:
        return
    try:
        check_json_value(schema, settings.max_json_depth)
    except JsonTooDeep as exc:
        raise bad_request(f"the JSON schema is not valid: {exc} (--max-json-depth).", param=param) from None
    except JsonValueError as exc:
        raise bad_request(f"the JSON schema is not valid: {exc}.", param=param) from None


def _check_bytes(text: str, param: str, settings: ServerSettings) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > settings.max_structured_output_bytes:
        raise bad_request(f"the structured-output constraint is too large: {size} bytes exceeds the limit of "
                          f"{settings.max_structured_output_bytes} bytes (--max-structured-output-bytes).",
                          param=param)
