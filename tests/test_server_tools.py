"""Tool calling over HTTP with the openai SDK: forced calls (``required``, a named
function) always parse and follow the function's schema, streamed or not, through the
fallback a template without tools gets (the tiny model's ChatML, SmolLM2's) and through a
template that renders tools itself (Qwen2.5's, Hermes syntax); a call's result goes back
as a tool message; bad tools and messages are 400s naming the field. The default model
does a whole round trip."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.tokenizer import Tokenizer
from test_server import MODEL, serve
from test_tool_calls import LLAMA31, MISTRAL, QWEN25

openai = pytest.importorskip("openai")

WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _engine(compiled, template: str | None = None) -> Engine:
    engine = Engine.load(compiled("llama-2k"), EngineConfig(max_num_seqs=8, max_batched_tokens=128))
    if template is not None:  # the same weights behind another family's chat template
        tok = engine.tokenizer
        engine.tokenizer = Tokenizer(tok._tok, {**tok.config, "chat_template": template}, tok.eos_token_ids)
    return engine


TEMPLATES = {"fallback": None, "hermes": QWEN25, "llama3_json": LLAMA31, "mistral": MISTRAL}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, compiled):
    engine = _engine(compiled, TEMPLATES[request.param])
    with serve(engine) as base:
        yield request.param, engine, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), base
    engine.close()


def _check_calls(calls, only: str | None = None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(chunks):
    """(content, calls as {index: [id, name, arguments]}, finish reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, [None, None, ""])
            entry[0] = tc.id or entry[0]
            entry[1] = (tc.function.name if tc.function else None) or entry[1]
            entry[2] += (tc.function.arguments if tc.function else "") or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_parse_and_follow_the_schema(served, choice):
    kind, engine, client, _ = served
    only = choice["function"]["name"] if isinstance(choice, dict) else None
    seed = random.randrange(1 << 30)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                         temperature=1.0, seed=seed, n=2)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message
        _check_calls(c.message.tool_calls, only)
    if kind != "fallback":  # the model's own syntax, tools rendered by its template
        assert "get_weather" in engine.tokenizer.apply_chat_template(ASK, tools=TOOLS)
        assert out.choices[0].message.content is None
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                              max_tokens=200, temperature=1.0, seed=seed, stream=True)
    content, calls, finish = _streamed(streamed)
    first = out.choices[0].message.tool_calls
    assert finish == "tool_calls" and not content.strip()
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in first]


def test_a_tool_result_goes_back_and_the_answer_is_content(served):
    kind, engine, client, _ = served
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    rendered = engine.tokenizer.apply_chat_template(history, tools=TOOLS)
    assert "18 degrees and sunny" in rendered and call.function.name in rendered
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_bad_tools_and_messages_are_400_naming_the_field(served, extra, param):
    _, engine, _, url = served
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.stats().requests == 0


def test_python_api_returns_parsed_calls(served):
    _, engine, _, _ = served
    out = engine.generate(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                          max_tokens=200, temperature=1.0)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(choice.tool_calls[0].arguments), WEATHER_ARGS)
    assert engine.generate(ASK, max_tokens=4).choices[0].tool_calls == ()


def test_text_parts_and_the_developer_role(served):
    _, engine, client, _ = served
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                          {"type": "text", "text": "in Paris?"}]}]
    joined = [{"role": "system", "content": "Be brief."}, ASK[0]]
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == engine.generate(joined, max_tokens=6).text


def test_default_model_round_trip(smollm2_artifact):
    """SmolLM2 (no tools in its template): a forced call with the schema's arguments, the
    result fed back, a plain answer; the same call streamed."""
    engine = Engine.load(smollm2_artifact, EngineConfig(max_num_seqs=4))
    with serve(engine) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=60, temperature=0)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER_ARGS)
        assert "paris" in args["city"].lower()
        content, calls, finish = _streamed(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0,
            stream=True))
        assert finish == "tool_calls" and [(n, a) for _, n, a in calls.values()] == \
            [(call.function.name, call.function.arguments)]
        history = ASK + [out.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                               max_tokens=40, temperature=0)
        answer = final.choices[0].message.content
        assert final.choices[0].finish_reason == "stop" and answer and not final.choices[0].message.tool_calls
    engine.close()
