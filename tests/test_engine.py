"""The engine on a real (tiny) artifact: continuous batching with TVM's paged KV cache
gives each request exactly what it gets alone, and every page comes back."""

from __future__ import annotations

import asyncio
import random

import pytest

from helpers import random_requests_free_every_page, torch_greedy
from kiln.compiler.models.source import resolve_model
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.errors import KilnError
from kiln.runtime.stream import RequestCancelled

PROMPTS = ["The quick brown fox", "Paris is the capital of France. " * 3, "def f(x):\n    return", "héllo",
           "numbers 0123456789 and symbols !@#$%^&*() " * 2, "Kiln compiles language models"]


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    return resolve_model(checkpoint("llama")).build_module()


def _engine(compiled, **config):
    return Engine.load(compiled("llama"), EngineConfig(**config))


def test_batched_greedy_equals_alone_and_torch(compiled, torch_model):
    engine = _engine(compiled, max_num_seqs=4, max_batched_tokens=24)  # forces chunked prefill
    streams = [engine.submit(p, max_tokens=16, ignore_eos=True) for p in PROMPTS]
    batched = [s.result(timeout=120).token_ids for s in streams]
    for p, got in zip(PROMPTS, batched):
        assert list(got) == torch_greedy(torch_model, engine.tokenizer.encode(p), 16)
        assert engine.generate(p, max_tokens=16, ignore_eos=True).token_ids == got  # alone
    engine.close()


def test_seeded_sampling_is_the_same_in_any_batch(compiled):
    engine = _engine(compiled, max_num_seqs=6, max_batched_tokens=64)
    params = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate(PROMPTS[0], **params).token_ids
    others = [engine.submit(p, max_tokens=12, temperature=1.0, ignore_eos=True) for p in PROMPTS[1:]]
    mixed = engine.submit(PROMPTS[0], **params)
    assert mixed.result(timeout=120).token_ids == alone
    for s in others:
        s.result(timeout=120)
    assert engine.generate(PROMPTS[0], **{**params, "seed": 4321}).token_ids != alone
    engine.close()


def test_prefix_reuse_on_tvm_forks_and_matches_torch(compiled, torch_model):
    engine = _engine(compiled, max_num_seqs=4, max_batched_tokens=128)
    system = "You are a helpful assistant. Answer briefly and clearly. " * 2
    first = engine.generate(system + "Hi", max_tokens=8, ignore_eos=True)
    assert engine.stats().prefix_holders >= 1
    for tail in ("Bye", "What is Kiln?"):
        out = engine.generate(system + tail, max_tokens=8, ignore_eos=True)
        assert list(out.token_ids) == torch_greedy(torch_model, engine.tokenizer.encode(system + tail), 8)
    assert list(first.token_ids) == torch_greedy(torch_model, engine.tokenizer.encode(system + "Hi"), 8)
    engine.close()


def test_n_greedy_samples_are_identical_and_correct(compiled, torch_model):
    engine = _engine(compiled, max_num_seqs=4, max_batched_tokens=64)
    out = engine.generate(PROMPTS[2], max_tokens=10, n=3, ignore_eos=True)
    expected = tuple(torch_greedy(torch_model, engine.tokenizer.encode(PROMPTS[2]), 10))
    assert [c.token_ids for c in out.choices] == [expected] * 3
    engine.close()


def test_thousand_random_requests_with_cancellations_free_every_page(compiled):
    rng = random.Random()
    engine = Engine.load(compiled("llama"), EngineConfig(max_num_seqs=8, max_total_tokens=640, max_batched_tokens=48,
                                                         watermark=0.02), background=False)
    random_requests_free_every_page(engine, rng, 1000, max_tokens=6, n_choices=(1, 1, 1, 2))
    assert engine.metrics.requests == 1000


def test_async_stream_callback_and_cancellation(compiled):
    engine = _engine(compiled, max_num_seqs=4, max_batched_tokens=64)
    seen = []
    out = engine.generate(PROMPTS[0], max_tokens=6, ignore_eos=True, on_token=lambda d: seen.append(d))
    assert [d.token_id for d in seen] == list(out.token_ids) and seen[-1].finish_reason == "length"

    async def consume():
        deltas = []
        async for d in engine.astream(PROMPTS[1], max_tokens=5, ignore_eos=True):
            deltas.append(d)
        return deltas

    deltas = asyncio.run(consume())
    assert len(deltas) == 5 and deltas[-1].finish_reason == "length"

    stream = engine.submit(PROMPTS[3], max_tokens=100, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break  # leaving the loop cancels the request
    assert engine.wait_idle(10)
    assert engine.stats().running == 0
    with pytest.raises(RequestCancelled):
        stream.result()
    engine.close()


def test_a_failing_step_is_retried_and_a_poisoned_request_fails_alone(compiled, torch_model):
    """On TVM's real cache: a step that fails once is recovered (its sequences recompute,
    their outputs are still exact); a request whose tokens make every forward fail is
    failed alone, and the others finish."""
    engine = _engine(compiled, max_num_seqs=4, max_batched_tokens=64)
    real = engine._executor.forward
    calls = {"n": 0}
    bad_ids = tuple(engine.tokenizer.encode("zzz " + PROMPTS[3]))

    def flaky(cache, chunks):  # the third forward fails, and every one computing bad_ids
        calls["n"] += 1
        if calls["n"] == 3 or any(c.start == 0 and c.tokens[:len(bad_ids)] == bad_ids for c in chunks):
            raise RuntimeError("simulated device failure")
        return real(cache, chunks)

    engine._executor.forward = flaky
    good = [engine.submit(p, max_tokens=8, ignore_eos=True) for p in PROMPTS[:3]]
    bad = engine.submit(list(bad_ids), max_tokens=8, ignore_eos=True)
    with pytest.raises(KilnError, match="simulated device failure"):
        bad.result(timeout=60)
    for p, s in zip(PROMPTS, good):
        assert list(s.result(timeout=60).token_ids) == torch_greedy(torch_model, engine.tokenizer.encode(p), 8)
    assert engine.metrics.failed == 1 and engine.metrics.value("kiln_failed_steps_total") >= 2
    engine.run_in_core(engine.core.check)
    engine._executor.forward = real
    engine.close()


def test_stop_strings_and_min_tokens(compiled):
    engine = _engine(compiled)
    free = engine.generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    cut = engine.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)] and stop not in cut.text
    eos = next(iter(engine.tokenizer.eos_token_ids))
    biased = engine.generate(PROMPTS[0], max_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)
    assert biased.completion_tokens == 5 and biased.token_ids[-1] == eos and eos not in biased.token_ids[:4]
    engine.close()
