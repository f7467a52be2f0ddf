"""Tool calling: the pieces of server/tools.py on their own (plan checks, the call schema, the
prompt block, the output parser, the streamed-call splitter), then /v1/chat/completions on the
shared real server with the `openai` client: tool_choice required / named / none / auto,
streaming, a multi-turn history with a call and its result, and the 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.core.guided_decoding import GuidedDecoding
from engine.loop.tokenizer import apply_chat_template
from engine.sample.structured_output import validate
from server.errors import OpenAIError
from server.input_processor import InputProcessor
from server.protocol import ChatCompletionRequest
from server.tools import (
    check_tool_schemas,
    CallStreamer,
    call_schema,
    may_be_call,
    parse_tool_call,
    partial_call,
    plan_tools,
    text_messages,
    tool_prompt_block,
)
from tests.server.support import assert_error, post, wait_pool_free

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = frozenset({"get_weather", "get_time"})


def plan(**body):
    return plan_tools(ChatCompletionRequest(model="m", messages=ASK, **body))


# ------------------------------------------------------------------------------ unit tests
def test_plan_defaults_and_modes():
    assert plan().mode == "none" and not plan().parses
    assert plan(tools=TOOLS).mode == "auto" and plan(tools=TOOLS).guided is None and plan(tools=TOOLS).parses
    assert plan(tools=TOOLS, tool_choice="none").parses is False
    required = plan(tools=TOOLS, tool_choice="required")
    assert required.guided.kind == "json" and json.loads(required.guided.value) == call_schema(
        [WEATHER["function"], TIME["function"]])
    assert required.finish_reason == "tool_calls"
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.named == "get_time" and named.finish_reason == "stop"
    assert json.loads(named.guided.value)["properties"]["name"] == {"const": "get_time"}


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools.0.function.parameters"),
], ids=["required-no-tools", "named-no-tools", "named-unknown", "duplicate", "empty-name", "non-object",
        "llguidance-rejects"])
def test_plan_errors_name_the_field(body, param):
    """Cheap checks fail in plan_tools (on the event loop); a schema the grammar compiler
    rejects fails in check_tool_schemas (on the input processor's worker thread)."""
    with pytest.raises(OpenAIError) as info:
        check_tool_schemas(plan(**body))
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_call_schema_is_a_valid_constraint_and_rebases_refs():
    one = call_schema([{"name": "f"}])
    assert one == {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
                   "required": ["name", "arguments"], "additionalProperties": False}
    with_refs = {"name": "g", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                                             "$defs": {"P": {"type": "integer"}}}}
    both = call_schema([{"name": "f"}, with_refs])
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["f", "g"]
    assert both["anyOf"][1]["properties"]["arguments"] == {"$ref": "#/$defs/tool1"}
    assert both["$defs"]["tool1"]["properties"]["p"] == {"$ref": "#/$defs/tool1/$defs/P"}
    validate(GuidedDecoding.json_schema(both))


@pytest.mark.parametrize("text,expected", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', ("get_weather", '{"city": "Paris"}')),
    ('  \n{"name":"get_time","arguments":{}}\n', ("get_time", "{}")),
    ('```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```', ("get_time", '{"zone": "UTC"}')),
    ('```\n{"name": "get_time", "arguments": {"zone": "UTC"}}```', ("get_time", '{"zone": "UTC"}')),
    ('{"arguments": {"zone": "UTC"}, "name": "get_time"}', ("get_time", '{"zone": "UTC"}')),
    ("It is sunny in Paris.", None),
    ('{"name": "launch_rockets", "arguments": {}}', None),
    ('{"name": "get_time", "arguments": "UTC"}', None),
    ('{"name": "get_time", "arguments": {}, "extra": 1}', None),
    ('Sure: {"name": "get_time", "arguments": {}}', None),
    ('{"name": "get_time", "arguments": {', None),
    ("", None),
], ids=["call", "compact", "fenced", "fence-no-lang", "key-order", "text", "unknown-name", "string-args",
        "extra-key", "prefixed", "truncated", "empty"])
def test_parse_tool_call(text, expected):
    assert parse_tool_call(text, NAMES) == expected


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_streamed_argument_fragments_join_into_the_call(step):
    text = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": {"deep": {}}}}'
    streamer = CallStreamer(NAMES)
    names, fragments = [], []
    for i in range(0, len(text), step):
        name, fragment = streamer.feed(text[i:i + step])
        names += [name] if name else []
        fragments.append(fragment)
    call, rest = streamer.finish()
    assert names == ["get_weather"] and call == parse_tool_call(text, NAMES)
    assert "".join(fragments) + rest == call[1]


def test_partial_call_is_what_a_stream_sent():
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    assert partial_call(text, NAMES) == ("get_weather", '{"city": "Par')
    assert partial_call('{"name": "get_wea', NAMES) is None and partial_call(text, {"other"}) is None
    streamer = CallStreamer(NAMES)
    sent = "".join(streamer.feed(text[i:i + 4])[1] for i in range(0, len(text), 4))
    call, rest = streamer.finish()
    assert call is None and sent + rest == partial_call(text, NAMES)[1]


def test_may_be_call():
    assert may_be_call("") and may_be_call("  {") and may_be_call("`") and may_be_call("```js")
    assert not may_be_call("Hello") and not may_be_call(" `x")


def test_prompt_block_and_text_messages():
    p = plan(tools=TOOLS, tool_choice="required")
    block = tool_prompt_block(p)
    assert "get_weather - The weather in a city." in block and '"maxLength": 12' in block
    assert '{"name": <tool name>, "arguments": {...}}' in block and "must call" in block
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]
    out = text_messages(history, p)
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + block}
    assert out[2] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}
    assert out[3] == {"role": "user", "content": "Tool result (call_1):\n18 C, sunny"}
    assert text_messages(history[1:2], p)[0] == {"role": "system", "content": block}
    assert "Do not call a tool" in tool_prompt_block(plan(tools=TOOLS, tool_choice="none"))


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loop.tokenizer import load_tokenizer
    from engine.worker.models.loader import resolve_model
    return load_tokenizer(resolve_model(None)[0])


def test_prompt_uses_the_templates_tools_or_the_block(tokenizer):
    p = plan(tools=TOOLS)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
               {"role": "tool", "content": "12:00", "tool_call_id": "c"}]
    smol = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=2048).render_chat(history, p)
    # (SmolLM2's template knows no tools)
    assert "You can call these tools" in smol and '{"name": "get_time", "arguments": {"zone": "UTC"}}' in smol
    assert "Tool result (c):\n12:00" in smol
    native = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
              "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>"
              "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}")
    text = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=2048,
                          chat_template=native).render_chat(history, p)
    assert text == ('[tool get_weather][tool get_time][user] hi|[assistant] <call get_time {"zone": "UTC"}>|'
                    "[tool] 12:00(c)|")
    plain = [{"role": "user", "content": "hi"}]
    plain_text = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=2048).render_chat(plain, plan())
    assert plain_text == apply_chat_template(tokenizer, plain)


# --------------------------------------------------------------------- the real server
def check_arguments(name: str, arguments: str) -> None:
    """The arguments parse and match the tool's schema (types, required keys, nothing else)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 12
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and set(args) == {"zone"} and isinstance(args["zone"], str)


def test_required_gives_a_tool_call(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in NAMES
    check_arguments(call.function.name, call.function.arguments)


def test_named_tool_choice_calls_that_function(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0.7, seed=3, n=2,
                                       max_tokens=30,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in r.choices:  # n > 1: each choice is its own call
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        check_arguments("get_time", call.function.arguments)
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


def test_streamed_required_call_equals_the_whole_one(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == whole.message.tool_calls[0].function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in calls[1:])
    assert "".join(d.function.arguments or "" for d in calls) == whole.message.tool_calls[0].function.arguments
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def streamed_answer(chunks) -> tuple[str | None, str | None, str | None]:
    """(content, tool name, arguments) joined from a stream's deltas."""
    deltas = [c.choices[0].delta for c in chunks]
    calls = [d for delta in deltas for d in (delta.tool_calls or [])]
    content = "".join(d.content or "" for d in deltas) or None
    if not calls:
        return content, None, None
    return content, calls[0].function.name, "".join(d.function.arguments or "" for d in calls)


@pytest.mark.parametrize("max_tokens", [3, 14])
def test_a_call_cut_short_is_length_and_streams_alike(client, model, max_tokens):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=max_tokens)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert whole.finish_reason == chunks[-1].choices[0].finish_reason == "length"
    if whole.message.tool_calls:  # the name was out: a call with the arguments so far
        call = whole.message.tool_calls[0].function
        assert whole.message.content is None and streamed_answer(chunks) == (None, call.name, call.arguments)
    else:
        assert streamed_answer(chunks) == (whole.message.content, None, None)


def test_history_with_a_call_and_its_result_is_answered(client, model):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_none_gives_content(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=6)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_auto_is_either_a_call_or_content_streamed_alike(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    if whole.message.tool_calls:
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        check_arguments(whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)
    else:
        assert whole.message.content is not None
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


BAD_TOOLS = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ({"tools": [TIME, TIME]}, "tools.1.function.name"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
]


@pytest.mark.parametrize("body,param", BAD_TOOLS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_bad_tool_requests_are_400(real_server, model, body, param):
    assert_error(post(real_server, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 2, **body}),
                 400, param)


def test_tool_choice_none_with_response_format_is_allowed(url, model):
    body = {"model": model, "messages": ASK, "max_tokens": 4, "tools": TOOLS, "tool_choice": "none",
            "response_format": {"type": "json_object"}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    wait_pool_free(url)
