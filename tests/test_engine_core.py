"""The engine core's failure handling, capacity and snapshots, as scenario scripts with the
fake executor (no TVM): failures stay with the request that caused them, the page ledger
always matches the cache, a prompt the context allows is served, a long prompt's prefix
is evicted without recursion, and output processing is a plain function of tokens."""

from __future__ import annotations

import random

import pytest

from fakes import FakeTokenizer, expected_greedy, fake_engine, run_to_idle
from kiln.runtime.core import FinishAll
from kiln.runtime.errors import KilnError, PromptTooLongError
from kiln.runtime.output_processor import OutputState, process_token
from kiln.runtime.prefix_index import PrefixIndex


make_engine, run = fake_engine, run_to_idle


def text(ids):
    return " ".join(str(i) for i in ids)


def random_prompts(rng, count, low=1, high=20):
    return [[rng.randrange(1, 64) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_a_transient_step_failure_loses_no_request():
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=16, prefix_reuse=False)
    rng = random.Random()
    prompts = random_prompts(rng, 6)
    fail_at = rng.randint(2, 6)
    real, calls = ex.forward, {"n": 0}

    def flaky(cache, chunks):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("transient")
        return real(cache, chunks)

    ex.forward = flaky
    streams = [engine.submit(text(p), max_tokens=6) for p in prompts]
    run(engine)
    for p, s in zip(prompts, streams):
        assert list(s.result().token_ids) == expected_greedy(p, 6)
    assert engine.metrics.failed == 0 and engine.metrics.value("kiln_failed_steps_total") == 1
    assert engine.cache.used_pages() == 0


def test_a_request_that_breaks_every_forward_fails_alone():
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=16, prefix_reuse=False)
    rng = random.Random()
    prompts = random_prompts(rng, 5)
    poison = [0, 0, 0]  # token 0 never appears in random_prompts; the fake model may generate it
    real = ex.forward

    def poisoned(cache, chunks):
        if any(c.start == 0 and tuple(c.tokens[:3]) == tuple(poison) for c in chunks):
            raise RuntimeError("kernel fault")
        return real(cache, chunks)

    ex.forward = poisoned
    streams = [engine.submit(text(p), max_tokens=5) for p in prompts[:2]]
    bad = engine.submit(text(poison + [5, 6]), max_tokens=5)
    streams += [engine.submit(text(p), max_tokens=5) for p in prompts[2:]]
    run(engine)
    with pytest.raises(KilnError, match="kernel fault"):
        bad.result()
    for p, s in zip(prompts, streams):
        assert list(s.result().token_ids) == expected_greedy(p, 5)
    assert engine.metrics.failed == 1 and engine.metrics.finished == len(prompts)
    assert engine.cache.used_pages() == 0


def test_a_failing_callback_fails_only_its_request():
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=32, prefix_reuse=False)
    prompts = random_prompts(random.Random(), 3)

    def broken(delta):
        if delta.token_id is not None:
            raise ValueError("client callback bug")

    good = [engine.submit(text(p), max_tokens=5) for p in prompts]
    bad = engine.submit(text(prompts[0]), max_tokens=5, on_token=broken)
    run(engine)
    with pytest.raises(KilnError, match="client callback bug"):
        bad.result()
    for p, s in zip(prompts, good):
        assert list(s.result().token_ids) == expected_greedy(p, 5)
    assert engine.cache.used_pages() == 0


def test_a_cache_that_disagrees_with_the_ledger_is_recreated():
    """A failure that leaves the cache in a state the ledger does not describe (here: a
    sequence the scheduler never made): the cache is recreated and everyone recomputes."""
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=16, prefix_reuse=False)
    prompts = random_prompts(random.Random(), 4)
    real, calls, created = ex.forward, {"n": 0}, []
    create = ex.create_cache

    def counting_create(config):
        created.append(config)
        return create(config)

    def corrupting(cache, chunks):
        calls["n"] += 1
        if calls["n"] == 3:
            cache.add(10_000)
            cache.append(10_000, 0, [1] * 9)  # three stray pages
            raise RuntimeError("device lost")
        return real(cache, chunks)

    ex.create_cache, ex.forward = counting_create, corrupting
    streams = [engine.submit(text(p), max_tokens=6) for p in prompts]
    run(engine)
    assert len(created) == 1  # recreated once
    for p, s in zip(prompts, streams):
        assert list(s.result().token_ids) == expected_greedy(p, 6)
    assert engine.cache.used_pages() == 0


def test_every_prompt_the_context_allows_is_served():
    """However the cache is sized by the user, the longest prompt (context - 1 tokens)
    fits; a prompt of the whole context gets PromptTooLongError naming the limit."""
    for config in ({}, {"max_total_tokens": 8, "watermark": 0.3}, {"max_total_tokens": 96, "watermark": 0.1}):
        engine, ex = make_engine(context=96, max_num_seqs=2, max_batched_tokens=32, **config)
        longest = [1 + i % 60 for i in range(95)]
        assert engine.max_prompt_tokens == 95
        stream = engine.submit(text(longest), max_tokens=4)
        run(engine)
        out = stream.result()
        assert list(out.token_ids) == expected_greedy(longest, 1) and out.finish_reason == "length"
        with pytest.raises(PromptTooLongError, match="at most 95 prompt tokens"):
            engine.submit(text(longest + [1]), max_tokens=4)


def test_a_huge_text_prompt_is_refused_before_tokenizing():
    engine, _ = make_engine(context=96)

    class Counting(FakeTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=True):
            Counting.calls += 1
            return super().encode(text)

    engine.tokenizer = Counting()
    with pytest.raises(PromptTooLongError, match="characters"):
        engine.submit("1 " * 10_000, max_tokens=1)
    assert Counting.calls == 0


def test_a_prompt_near_the_context_then_eviction_keeps_serving():
    """A prompt of ~4,000 tokens (1,000 pages of 4: a trie 1,000 nodes deep) becomes a
    prefix holder; later requests need its pages, so it is evicted while they run."""
    context = 4096
    engine, ex = make_engine(context=context, max_num_seqs=4, max_batched_tokens=512, max_total_tokens=context)
    rng = random.Random()
    long_prompt = [rng.randrange(1, 64) for _ in range(context - 100)]
    first = engine.submit(text(long_prompt), max_tokens=3)
    run(engine)
    assert list(first.result().token_ids) == expected_greedy(long_prompt, 3)
    assert engine.stats().prefix_holders == 1 and engine.stats().kv_pages_prefix_cached > 900
    others = random_prompts(rng, 6, 200, 600)
    streams = [engine.submit(text(p), max_tokens=8) for p in others]
    run(engine)
    for p, s in zip(others, streams):
        assert list(s.result().token_ids) == expected_greedy(p, 8)
    assert engine.scheduler.prefix.covered(long_prompt) < 400  # the long prompt's holder was evicted
    assert engine.stats().kv_pages_requests == 0


def test_prefix_index_removes_a_deep_holder_without_recursion():
    index = PrefixIndex(page_size=2)
    deep = list(range(40_000))  # 20,000 pages
    index.insert(1, deep)
    index.insert(2, deep[:10])
    assert index.longest_match(deep, len(deep))[1] == len(deep)
    index.remove(1)
    assert index.longest_match(deep, len(deep)) == (2, 10)
    index.remove(2)
    assert index.longest_match(deep, len(deep)) is None and not index._root.children


def test_stats_snapshot_tells_request_pages_from_cached_prefix_pages():
    engine, ex = make_engine(max_num_seqs=2, max_batched_tokens=64)
    shared = list(range(1, 13))  # three full pages of 4
    engine.submit(text(shared + [20]), max_tokens=2)
    run(engine)
    stats = engine.stats()
    assert stats.prefix_holders == 1 and stats.kv_pages_prefix_cached == 3 and stats.kv_pages_requests == 0
    assert stats.kv_pages_used == ex.cache.used_pages()
    stream = engine.submit(text(shared + [21, 22]), max_tokens=20)
    engine.step()
    stats = engine.stats()
    # The running request shares the holder's three pages and adds one: 4 held by
    # requests, none held by the holder alone.
    assert stats.running == 1 and stats.kv_pages_requests == 4 and stats.kv_pages_prefix_cached == 0
    stream.cancel()
    run(engine)


def test_finishing_everything_at_shutdown_ends_each_stream_cleanly():
    engine, ex = make_engine(max_num_seqs=2, max_batched_tokens=16, prefix_reuse=False)
    streams = [engine.submit(text(p), max_tokens=50, n=n)
               for p, n in zip(random_prompts(random.Random(), 3), (1, 2, 1))]
    for _ in range(4):
        engine.step()
    engine.core.inbox.put(FinishAll("abort"))
    engine.step()
    for s in streams:
        out = s.result(timeout=0)
        assert all(c.finish_reason == "abort" for c in out.choices)
    assert engine.cache.used_pages() == 0 and not engine.core.requests
    assert engine.metrics.value("kiln_requests_finished_total", {"reason": "abort"}) == 3


def test_output_processing_is_a_function_of_tokens():
    """Stops, end tokens and budgets, on the fake tokenizer's text (" 3 14 15")."""
    tok = FakeTokenizer()

    def run_tokens(tokens, stop=(), end=frozenset(), budget=100):
        state = OutputState.create(tok, [1, 2], stop, end, budget)
        pieces = []
        for t in tokens:
            out = process_token(state, t)
            pieces.append(out.text)
            if out.finish_reason:
                return "".join(pieces), out.finish_reason
        return "".join(pieces), None

    assert run_tokens([3, 14, 15], budget=3) == (" 3 14 15", "length")
    assert run_tokens([3, 14, 15, 9], stop=("4 1",)) == (" 3 1", "stop")  # across two tokens
    assert run_tokens([3, 7, 8], end=frozenset({7})) == (" 3", "stop")  # the end token's text is not emitted
    assert run_tokens([3, 14], stop=("14 9",), budget=2) == (" 3 14", "length")  # a held prefix is released
    state = OutputState.create(tok, [], (), frozenset(), 1)
    process_token(state, 3)
    with pytest.raises(ValueError):
        process_token(state, 4)


def test_inter_token_latency_is_per_sample():
    """n = 3 samples of 5 tokens: 3 x 4 gaps, one time to first token (counted per request
    and per sample, interleaved samples would give 14 gaps, some near zero)."""
    engine, _ = make_engine(max_num_seqs=4, max_batched_tokens=32, prefix_reuse=False)
    engine.submit(text([1, 2, 3, 4, 5, 6]), max_tokens=5, n=3, temperature=1.0, seed=3)
    run(engine)
    assert engine.metrics.value("kiln_inter_token_latency_seconds_count") == 12
    assert engine.metrics.value("kiln_time_to_first_token_seconds_count") == 1
    assert engine.metrics.value("kiln_generated_tokens_total") == 15
