"""Fuzz the server through its published OpenAPI schema: schemathesis generates thousands
of requests for every operation, valid (positive) and schema-violating (negative), in its
examples, coverage (boundary values, wrong types, missing fields, odd content types) and
fuzzing phases; no response may be a 5xx, and no stream may end in a server error. Then
the server still serves and no request holds KV pages.

Generation stays cheap: ``max_tokens`` / ``max_completion_tokens`` are clamped to <= 4 and
``n`` to <= 2 when they are integers; nothing else is touched, so every other field
reaches validation as generated.

Only ``not_a_server_error`` is checked of schemathesis' built-in checks. The others do not
fit this API as FastAPI documents it: the schema lists 200 and 422 while the server answers
400 (validation), 404 (model) and 405, so ``status_code_conformance`` fails by design;
success bodies have no response model, so ``response_schema_conformance`` and
``response_headers_conformance`` check nothing; streams are text/event-stream, undocumented,
so ``content_type_conformance`` fails on them; ``positive_data_acceptance`` fails on what the
schema cannot say (an empty prompt, several prompts, best_of != n, min_tokens > max_tokens);
``negative_data_rejection`` fails on pydantic's lax coercions (``0`` for false, ``false``
for 0.0) and on the clamps; ``max_response_time`` would make a loaded CI box flaky.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")  # the `test` extra pins it

from hypothesis import HealthCheck, settings  # noqa: E402 (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from kiln.runtime.server.app import create_app  # noqa: E402
from test_server import MODEL, engine, url  # noqa: E402,F401  (the served engine's fixtures)

# Per operation and phase. The POST operations use all of it (~1,800 requests each, ~65 s
# in all on 2 cores); the GET routes take no input, so they run out of distinct
# requests after a few.
MAX_EXAMPLES = 1500
MIN_REQUESTS = 3000  # what a full run sends (~3,600); fewer means generation broke
TIMEOUT_S = 30  # per request; a request to the tiny model takes milliseconds
CLAMPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}

SENT: Counter = Counter()  # (operation, generation mode, status class) -> requests


def published_schema() -> dict:
    """What the server publishes at /openapi.json: the schema depends on the routes and
    models alone, so it is built without an engine (the handlers are never called)."""
    return create_app(None, MODEL).openapi()


# Loaded at import, since pytest collects one test per operation from it;
# test_the_fuzzed_schema_is_the_published_one compares it with the live /openapi.json.
# (schemathesis.pytest.from_fixture would load it from the live server, but on pytest 9.2
# schemathesis 4.32.5 fails there: it sets Function._nodeid, which pytest 9.2 removed.)
PUBLISHED = published_schema()
PUBLISHED_OPERATIONS = {f"{method.upper()} {path}" for path, item in PUBLISHED["paths"].items() for method in item}
schema = schemathesis.openapi.from_dict(PUBLISHED)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=MAX_EXAMPLES)
schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
# Reproducers print the body as sent: sanitization would mask max_tokens, min_tokens and
# stop_token_ids ("token" reads as a secret).
schema.config.output.sanitization.update(enabled=False)


def test_the_fuzzed_schema_is_the_published_one(url):
    r = httpx.get(f"{url}/openapi.json", timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json() == PUBLISHED


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def clamp(body):
    """Bound generation cost; leave every other generated value alone."""
    if isinstance(body, dict):
        for key, limit in CLAMPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = limit
    return body


def assert_no_stream_server_error(response) -> None:
    """A stream that started with 200 carries a later failure as an error event: a 500 in
    disguise."""
    content_type = response.headers.get("content-type", [""])[0]  # lowercase keys, list values
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            error = json.loads(line[6:]).get("error")
            assert error is None or error.get("type") != "server_error", f"stream ended with {error}"


@schema.parametrize()
# derandomize: the same requests every run (a failure reproduces; CI is not flaky).
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
def test_no_server_errors(case, url, session):
    clamp(case.body)
    response = case.call(base_url=url, session=session, timeout=TIMEOUT_S)
    mode = case.meta.generation.mode.value if case.meta else "explicit"  # meta: None for explicit examples
    SENT[case.operation.label, mode, f"{response.status_code // 100}xx"] += 1
    case.validate_response(response, checks=[not_a_server_error])
    assert_no_stream_server_error(response)


def test_server_still_serves_after_fuzzing(url, engine):
    total = sum(SENT.values())
    print(f"\nfuzzed {total} requests (operation, mode, status):")
    for key, count in sorted(SENT.items()):
        print(f"  {count:6d}  {' '.join(key)}")
    if len({op for op, _, _ in SENT}) == len(PUBLISHED_OPERATIONS):  # the whole fuzz ran (not a -k subset)
        assert total >= MIN_REQUESTS, SENT
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["text"], str)
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
    assert engine.wait_idle(30), "engine did not become idle"  # a bound on the wait, not a measurement
    assert engine.stats().kv_pages_requests == 0
