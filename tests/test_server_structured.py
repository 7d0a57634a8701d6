"""Structured output over HTTP, on a tiny random model whose free output is noise: the
openai SDK parses constrained answers into pydantic models (streaming and not), vLLM's
guided_* fields work, and a bad constraint is a 400 naming the field that leaves the
requests running beside it untouched."""

from __future__ import annotations

import json
import random
import threading
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kiln.runtime.engine import Engine, EngineConfig
from test_server import MODEL, serve

openai = pytest.importorskip("openai")


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["fox", "dog", "cat"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def url(compiled):
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=8, max_batched_tokens=128))
    with serve(engine) as base:
        yield base
    engine.close()


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_sdk_parses_into_a_pydantic_model(client):
    seed = random.randrange(1 << 30)
    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=80,
                                        temperature=1.0, seed=seed, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed)
    with pytest.raises(ValueError):
        Pet.model_validate_json(free.choices[0].message.content)


def test_metrics_count_constrained_requests_and_compiles(url, client):
    def value(text, name):
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    before = httpx.get(f"{url}/metrics").text
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": random.randrange(10, 10**6)}},
        "required": ["n"]}}}
    for _ in range(2):  # a new schema, then the same one from the cache
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=20)
    after = httpx.get(f"{url}/metrics").text
    assert value(after, 'kiln_constrained_requests_total{kind="json"}') - \
        value(before, 'kiln_constrained_requests_total{kind="json"}') == 2
    assert value(after, "kiln_grammar_compile_seconds_count") - value(before, "kiln_grammar_compile_seconds_count") == 1
    assert value(after, "kiln_grammar_cache_hits_total") - value(before, "kiln_grammar_cache_hits_total") == 1
    assert value(after, "kiln_grammar_mask_seconds_count") > value(before, "kiln_grammar_mask_seconds_count")


def test_streamed_structured_output_parses(client):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 2}},
              "required": ["id", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=60,
                                            temperature=1.0, stream=True)
    text, finish = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_completions_json_object_and_vllm_fields(client):
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=1.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    # At temperature 1 the model may wander inside a long string: a cut at max_tokens is honest (finish
    # "length" after exactly max_tokens tokens); a stop must be a whole object.
    first = out.choices[0]
    assert first.text.startswith("{")
    if first.finish_reason == "length":
        assert out.usage.completion_tokens == 60
    else:
        assert first.finish_reason == "stop" and isinstance(json.loads(first.text), dict)
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0,
                                            extra_body={"guided_choice": ["fox", "lazy dog"]})
    assert choice.choices[0].message.content in ("fox", "lazy dog")
    regex = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=1.0,
                                      extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    assert __import__("re").fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", regex.choices[0].text)
    grammar = client.completions.create(model=MODEL, prompt="Say:", max_tokens=20, temperature=1.0,
                                        extra_body={"guided_grammar": 'start: ("fox" | "dog") " " ("runs" | "jumps")'})
    assert grammar.choices[0].text.split() in ([a, b] for a in ("fox", "dog") for b in ("runs", "jumps"))


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[oops"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "if": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(a|b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400_and_leave_other_requests_alone(url, extra, param):
    results = {}

    def long_request():
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        results["long"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    runner = threading.Thread(target=long_request)
    runner.start()
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
                                                       **extra}, timeout=60)
    runner.join(60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    long = results["long"]
    assert long.status_code == 200 and long.json()["choices"][0]["finish_reason"] == "length"
