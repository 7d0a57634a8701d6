"""The OpenAI-compatible server on loopback: a real HTTP client, the openai SDK, bad
requests, overload, disconnects, and a bounded load test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.server.app import create_app
from kiln.runtime.server.config import ServerConfig
from kiln.runtime.server.serve import uvicorn_config

MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(engine: Engine, config: ServerConfig | None = None):
    import uvicorn

    port = _free_port()
    config = config or ServerConfig()
    server = uvicorn.Server(uvicorn_config(create_app(engine, MODEL, config), "127.0.0.1", port, config,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _wait_idle(engine: Engine, timeout=60):
    assert engine.wait_idle(timeout), "engine did not become idle"  # a bound, not a measurement


def _only_prefix_holders_remain(engine: Engine) -> None:
    """No request holds a KV sequence any more; the cache agrees with the ledger."""
    def check():
        engine.core.check()
        holders = engine.scheduler.prefix.holders() if engine.scheduler.prefix else []
        assert set(engine.scheduler.ledger.sequences()) == set(holders)

    engine.run_in_core(check)
    assert engine.stats().kv_pages_requests == 0


@pytest.fixture(scope="module")
def engine(compiled):
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=8, max_batched_tokens=128, max_waiting=128))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine):
    with serve(engine) as base:
        yield base


def test_health_models_metrics(url):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.get(f"{url}/ready").json()["status"] == "ready"
    for path in ("/health", "/ready", "/v1/models", "/metrics"):
        r = httpx.head(f"{url}{path}")
        assert r.status_code == 200 and not r.content, path
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    text = httpx.get(f"{url}/metrics").text
    for name in ("kiln_time_to_first_token_seconds_bucket", "kiln_inter_token_latency_seconds_count",
                 "kiln_queue_depth", "kiln_running_requests", "kiln_kv_pages_used",
                 "kiln_generated_tokens_per_second", "kiln_generated_tokens_total"):
        assert name in text, name


def test_completion_matches_the_engine_and_streams_the_same_text(url, engine):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    expected = engine.generate("The quick brown fox", max_tokens=12, ignore_eos=True)
    assert data["choices"][0]["text"] == expected.text
    assert data["usage"] == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": 12,
                             "total_tokens": expected.prompt_tokens + 12}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_logprobs_and_n(url, engine):
    ids = engine.tokenizer.encode("Paris is")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 4, "logprobs": 3, "n": 2,
                                                  "temperature": 0.8, "seed": 3})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == 4 and len(lp["top_logprobs"][0]) == 3 and all(v <= 0 for v in lp["token_logprobs"])


def test_openai_sdk_completions_and_chat(url, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert out.choices[0].text == engine.generate("The quick brown fox", max_tokens=8).text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    expected = engine.generate(messages, max_tokens=8).text
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == expected
    streamed = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    reference = engine.generate("The quick brown fox", max_tokens=8)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == reference.completion_tokens
    assert chunks[-1].usage.prompt_tokens == reference.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 40}, 400, "n"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": [10**9], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    ({"prompt": "fox " * 400}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(url, body, status, param):
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_json_and_bad_chat(url):
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400


def test_disconnect_mid_stream_frees_pages(url, engine, monkeypatch):
    """A client that leaves mid-stream cancels its running request at once. The steps
    are slowed to 0.2 s, so run to the end the request would take 20 s: its first events
    must reach the client while it runs (not at its end), and the disconnect must find
    it running."""
    _wait_idle(engine)
    forward = engine._executor.forward

    def slow(cache, chunks):
        time.sleep(0.2)
        return forward(cache, chunks)

    monkeypatch.setattr(engine.core.executor, "forward", slow)
    aborted, finished = engine.metrics.aborted, engine.metrics.finished
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True,
                            "stream": True}) as resp:
        # Hold the line iterator: dropping it (a ``break`` out of the for loop) closes the
        # connection at once, and the server would rightly cancel before the check.
        lines = resp.iter_lines()
        events = []
        while len(events) < 2:
            line = next(lines)
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        assert all(e["choices"][0]["finish_reason"] is None for e in events), events
        assert engine.stats().requests == 1  # still running in the engine
    _wait_idle(engine)
    assert engine.metrics.aborted == aborted + 1 and engine.metrics.finished == finished
    _only_prefix_holders_remain(engine)


def test_overload_is_429(compiled):
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=1, max_batched_tokens=16, max_waiting=1))
    try:
        with serve(engine) as base:
            async def main():
                async with httpx.AsyncClient(timeout=120) as client:
                    body = {"prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True}
                    return await asyncio.gather(*(client.post(f"{base}/v1/completions", json=body) for _ in range(6)))

            responses = asyncio.run(main())
            codes = sorted(r.status_code for r in responses)
            assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
            rejected = next(r for r in responses if r.status_code == 429)
            assert rejected.json()["error"]["type"] == "rate_limit_exceeded"
            assert int(rejected.headers["retry-after"]) >= 0
            _wait_idle(engine)
            assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        engine.close()


def test_nothing_a_client_calls_waits_for_a_step(compiled):
    """A forward pass that does not return (held on an event): /health, /ready, /metrics
    answer, a new request is accepted and its stream opens, a disconnect cancels. /health
    turns 503 once the core has been stuck past stall_timeout_s, and 200 again after."""
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=4, max_batched_tokens=64,
                                                         stall_timeout_s=1.0))
    real, release, entered = engine._executor.forward, threading.Event(), threading.Event()

    def stuck(cache, chunks):
        entered.set()
        assert release.wait(60), "never released"  # bounds the test if it fails
        return real(cache, chunks)

    try:
        with serve(engine, ServerConfig(sse_ping_s=0.2)) as base, httpx.Client(timeout=10) as client:
            engine.core.executor.forward = stuck
            first = engine.submit("The quick brown fox", max_tokens=4)
            assert entered.wait(30)
            for path in ("/health", "/ready", "/metrics", "/v1/models"):
                assert client.get(f"{base}{path}").status_code == 200, path
            with client.stream("POST", f"{base}/v1/completions",
                               json={"prompt": "hi", "max_tokens": 3, "stream": True}) as resp:
                assert resp.status_code == 200  # accepted and streaming while the step is stuck
                lines = resp.iter_lines()
                while not next(lines).startswith(":"):
                    pass  # a keep-alive comment arrives while no token can
            deadline = time.time() + 30  # the core has published nothing for > 1 s: wedged
            while (r := client.get(f"{base}/health")).status_code == 200:
                assert time.time() < deadline
                time.sleep(0.1)
            assert r.status_code == 503 and "no progress" in r.json()["detail"] and "retry-after" in r.headers
            assert client.get(f"{base}/ready").status_code == 503
            release.set()
            assert first.result(timeout=60).completion_tokens == 4
            _wait_idle(engine)
            assert client.get(f"{base}/health").status_code == 200
            assert engine.metrics.aborted == 1  # the stream the client left
            _only_prefix_holders_remain(engine)
    finally:
        release.set()
        engine.close()


def test_odd_input_is_a_4xx_never_a_500(url):
    """Lone surrogates, a prompt one token over the window, stop strings past the cap,
    bodies over the size limit (announced or chunked): each a typed 4xx naming the problem."""
    def post(raw: bytes, path="/v1/completions", **headers):
        return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json", **headers})

    r = post(b'{"prompt": "a \\ud800 b", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "surrogate" in r.json()["error"]["message"]
    r = post(b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}', "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = post(b'{"prompt": "hi", "model": "\\ud800"}')  # echoed in the 404 message: still valid JSON
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 128, "max_tokens": 2})  # the whole window
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 127, "max_tokens": 2}).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": ["x" * 300] * 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    big = json.dumps({"prompt": "word " * 500_000}).encode()  # 2.5 MB
    r = post(big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/health").status_code == 200


def test_api_key_timeouts_and_slow_clients(compiled):
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=2, max_batched_tokens=32))
    config = ServerConfig(api_key="s3cret", header_timeout_s=0.5, body_timeout_s=0.5)
    body = {"prompt": "hi", "max_tokens": 2}
    try:
        with serve(engine, config) as base:
            r = httpx.post(f"{base}/v1/completions", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.post(f"{base}/v1/completions", json=body,
                              headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.post(f"{base}/v1/completions", json=body,
                              headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert httpx.get(f"{base}/health").status_code == 200  # probes stay open
            assert httpx.get(f"{base}/metrics").status_code == 200
            host, port = base.removeprefix("http://").split(":")
            # A client that never finishes its request head is disconnected.
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                assert s.recv(1024) == b""  # closed by the server, not by the 10 s client timeout
            # One that sends its head but not its body gets 408.
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
                assert s.recv(4096).startswith(b"HTTP/1.1 408")
        with serve(engine, ServerConfig(api_key="s3cret", api_key_all_routes=True)) as base:
            assert httpx.get(f"{base}/health").status_code == 401
            assert httpx.get(f"{base}/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        engine.close()
