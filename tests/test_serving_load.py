"""``kiln serve`` as users run it: a real server subprocess on loopback, many real clients.

Behaviour, not timings: under 64 concurrent streams (a quarter of them leaving
mid-stream) while /metrics and /health are scraped, every stream that stays is complete,
well-formed and equal to the same request answered alone; every client that leaves finds
its request still running and cancels it (a request runs for hundreds of steps after the
client has read its first events, so one that *finished* instead means its events were
held back); no page stays with a request. A prompt near the context window, then the
eviction of its cached prefix while other streams run, takes nobody down. SIGTERM with
long streams in flight ends every stream cleanly and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import make_checkpoint

CONTEXT = 8192
WORDS = "the quick brown fox jumps over a lazy dog Paris is the capital of France Kiln compiles models".split()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The tiny random model with an 8,192-token window (as the default model's)."""
    from kiln.compiler.compile import CompileOptions, compile_model
    from kiln.compiler.targets import parse_target

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt-long"), "llama", max_position_embeddings=CONTEXT)
    return compile_model(ckpt, tmp_path_factory.mktemp("art-long") / "artifact",
                         CompileOptions(parse_target("llvm")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kiln_serve(artifact, *flags):
    """A ``kiln serve`` subprocess on a free loopback port: (url, process)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120  # bounds the start-up loop
        while True:
            assert proc.poll() is None, f"kiln serve exited: {proc.stderr.read()}"
            assert time.time() < deadline, "kiln serve did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _metrics(url) -> dict[str, float]:
    """Prometheus text parsed by prometheus_client's own parser (it rejects malformed text):
    sample name (with labels) -> value. Every family must carry HELP."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        assert family.documentation, f"{family.name} has no HELP"
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def _wait_idle(url, timeout=120):
    deadline = time.time() + timeout  # bounds the loop
    while True:
        m = _metrics(url)
        if m["kiln_running_requests"] == 0 and m["kiln_queue_depth"] == 0:
            return m
        assert time.time() < deadline, "server did not become idle"
        time.sleep(0.1)


async def _stream(client, url, body, leave_after: int | None = None) -> dict:
    """One streaming client: its events (parsed), whether it saw [DONE], and errors."""
    out = {"events": [], "done": False, "errors": [], "status": None, "left": False, "usage": None}
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        out["status"] = resp.status_code
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue  # blank separators, ": ping" keep-alive comments
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event)
                continue
            if not event["choices"]:  # the usage chunk (stream_options.include_usage)
                out["usage"] = event["usage"]
                continue
            out["events"].append(event)
            if leave_after is not None and len(out["events"]) >= leave_after:
                out["left"] = True
                break  # leaving the block closes the connection
    return out


def _check_events(events, max_tokens) -> tuple[str, str | None]:
    """Well-formed completion chunks: (joined text, last finish reason)."""
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and all(e["object"] == "text_completion" for e in events), events[:3]
    for e in events:
        (choice,) = e["choices"]
        assert choice["index"] == 0 and isinstance(choice["text"], str)
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert all(f is None for f in finishes[:-1]), finishes
    return "".join(e["choices"][0]["text"] for e in events), finishes[-1]


def test_64_streams_with_disconnects_and_scrapes(artifact):
    """The tiny model (steps well under a millisecond): each stream that stays must equal
    its request answered alone, token for token."""
    _load(artifact, compare_alone=True, leaver_tokens=2000)


def test_64_streams_on_the_default_model(smollm2_artifact):
    """The default model (steps of 10-100 ms, where today's stalls showed). Batched and
    alone runs use different kernels, so near-tied tokens may differ: the text is not
    compared, every other assertion holds. Leavers ask for 64 tokens (as the clients that
    found today's stalls): after reading at most 8 events, the request has 56 steps
    (half a second or more) to go, unless the server held its events back."""
    _load(smollm2_artifact, compare_alone=False, leaver_tokens=64)


def _load(artifact, compare_alone: bool, leaver_tokens: int) -> None:
    rng = random.Random()
    with kiln_serve(artifact) as (url, _):
        before = _metrics(url)
        bodies, leave = [], []
        for i in range(64):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
            leaves = i % 4 == 0  # a quarter leave after a few events
            bodies.append({"prompt": prompt, "temperature": 0, "ignore_eos": True,
                           "max_tokens": leaver_tokens if leaves else rng.randint(8, 48),
                           "stream_options": {"include_usage": True}})
            leave.append(rng.randint(1, 8) if leaves else None)

        async def main():
            scrapes, finished = [], asyncio.Event()

            async def scrape(client):
                while not finished.is_set():
                    for path in ("/metrics", "/health"):
                        r = await client.get(f"{url}{path}")
                        scrapes.append((path, r.status_code, r.text))
                    await asyncio.sleep(0.05)

            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                scraper = asyncio.create_task(scrape(client))
                results = await asyncio.wait_for(
                    asyncio.gather(*(_stream(client, url, b, k) for b, k in zip(bodies, leave))), timeout=600)
                finished.set()
                await scraper
            return results, scrapes

        results, scrapes = asyncio.run(main())
        assert scrapes and all(status == 200 for _, status, _ in scrapes), [s[:2] for s in scrapes if s[1] != 200]
        for _, _, text in (s for s in scrapes if s[0] == "/metrics"):
            list(text_string_to_metric_families(text))  # every scrape parses
        after = _wait_idle(url)
        stayed = [(b, r) for b, r, k in zip(bodies, results, leave) if k is None]
        left = [r for r, k in zip(results, leave) if k is not None]
        for r in results:
            assert r["status"] == 200 and not r["errors"], r
        for r in left:
            assert r["left"] and not r["done"] and r["events"][-1]["choices"][0]["finish_reason"] is None
        # Every departure reached a running request and cancelled it; the others finished.
        assert after["kiln_requests_aborted_total"] - before["kiln_requests_aborted_total"] == len(left)
        finished = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("kiln_requests_finished_total"))
        assert finished == len(stayed)
        assert after["kiln_requests_failed_total"] == before["kiln_requests_failed_total"]
        assert after["kiln_kv_pages_requests"] == 0
        for body, r in stayed:
            assert r["done"], r
            _, finish = _check_events(r["events"], body["max_tokens"])
            assert finish == "length" and r["usage"]["completion_tokens"] == body["max_tokens"]
        if compare_alone:  # each stream equals its request answered alone
            with httpx.Client(timeout=120) as client:
                for body, r in stayed:
                    text, _ = _check_events(r["events"], body["max_tokens"])
                    alone = client.post(f"{url}/v1/completions",
                                        json={k: v for k, v in body.items() if k != "stream_options"}).json()
                    assert text == alone["choices"][0]["text"]
                    assert alone["usage"]["completion_tokens"] == body["max_tokens"]


def test_a_prompt_near_the_context_then_eviction_takes_nobody_down(artifact):
    rng = random.Random()
    with kiln_serve(artifact, "--max-num-seqs", "8") as (url, _):
        with httpx.Client(timeout=120) as client:
            vocab = 384
            ids = [rng.randrange(3, vocab) for _ in range(CONTEXT)]
            r = client.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 4})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert str(CONTEXT - 1) in r.json()["error"]["message"]
            r = client.post(f"{url}/v1/completions", json={"prompt": ids[:CONTEXT - 1], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
            r = client.post(f"{url}/v1/completions", json={"prompt": ids[:8000], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        cached = _metrics(url)["kiln_kv_pages_prefix_cached"]
        assert cached >= 8000 // 16  # the long prompt's pages are kept as a cached prefix

        async def main():
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                bodies = [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(5, 40))), "max_tokens": 300,
                           "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(12)]
                return await asyncio.wait_for(asyncio.gather(*(_stream(client, url, b) for b in bodies)), 300)

        for r in asyncio.run(main()):
            assert r["status"] == 200 and r["done"] and not r["errors"], r
            _, finish = _check_events(r["events"], 300)
            assert finish == "length"
        after = _wait_idle(url)
        assert after["kiln_kv_pages_prefix_cached"] < cached  # the long prefix was evicted
        assert after["kiln_kv_pages_requests"] == 0 and after["kiln_requests_failed_total"] == 0
        assert after["kiln_failed_steps_total"] == 0


def test_sigterm_ends_long_streams_cleanly_and_exits(artifact):
    with kiln_serve(artifact, "--shutdown-timeout", "1") as (url, proc):

        async def main():
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                body = {"prompt": "Once upon a time", "max_tokens": CONTEXT, "ignore_eos": True}
                streams = [asyncio.create_task(_stream(client, url, body)) for _ in range(4)]
                whole = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
                while _metrics_running(await client.get(f"{url}/metrics")) < 5:
                    await asyncio.sleep(0.05)  # all five are running
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                late = await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                ready = await client.get(f"{url}/ready")
                return await asyncio.wait_for(asyncio.gather(*streams), 120), await whole, late, ready

        streams, whole, late, ready = asyncio.run(main())
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 0
        assert late.json()["error"]["type"] == "service_unavailable"
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        for r in streams:
            assert r["status"] == 200 and r["done"] and not r["errors"], r
            _, finish = _check_events(r["events"], CONTEXT)
            assert finish == "abort"  # ended by the shutdown, not run to the end
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=60) == 0, proc.stderr.read()


def _metrics_running(response) -> float:
    for family in text_string_to_metric_families(response.text):
        if family.name == "kiln_running_requests":
            return family.samples[0].value
    return 0.0
