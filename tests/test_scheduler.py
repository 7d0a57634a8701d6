"""Scheduler scenarios through the real engine loop with a fake executor (no TVM). Every
step the scheduler's invariants are checked and its page ledger is compared with the fake
cache's own page count."""

from __future__ import annotations

import random

import pytest

from fakes import expected_greedy, fake_engine, run_to_idle
from kiln.runtime.engine import EngineOverloadedError
from kiln.runtime.stream import RequestCancelled


make_engine, run = fake_engine, run_to_idle


def check(engine):
    engine.core.check()  # the scheduler's invariants, and its page ledger = the cache's pages


def prompt(*ids):
    return " ".join(str(i) for i in ids)


def test_admission_and_chunking_table():
    engine, ex = make_engine(max_num_seqs=2, max_batched_tokens=8, prefix_reuse=False)
    r0 = engine.submit(prompt(*range(1, 11)), max_tokens=3, request_id="r0")
    r1 = engine.submit(prompt(1, 2, 3), max_tokens=2, request_id="r1")
    r2 = engine.submit(prompt(4, 5), max_tokens=2, request_id="r2")
    table = []
    forward = ex.forward

    def named_forward(cache, chunks):  # seq ids exist only between schedule and release
        names = {s.seq.seq_id: rid for rid, req in engine.core.requests.items() for s in req.samples}
        table.append([(names[c.seq_id], c.start, len(c.tokens)) for c in chunks])
        return forward(cache, chunks)

    ex.forward = named_forward
    run(engine)
    assert table == [
        [("r0", 0, 8)],                               # prefill chunked by the 8-token budget
        [("r0", 8, 2), ("r1", 0, 3)],                 # r0 finishes its prompt, r1 admitted
        [("r0", 10, 1), ("r1", 3, 1)],                # two decodes; r2 waits (max_num_seqs=2)
        [("r0", 11, 1), ("r2", 0, 2)],                # r1 finished; r2 takes its slot
        [("r2", 2, 1)],
    ]
    assert list(r0.result().token_ids) == expected_greedy(range(1, 11), 3)
    assert list(r1.result().token_ids) == expected_greedy([1, 2, 3], 2)
    assert list(r2.result().token_ids) == expected_greedy([4, 5], 2)
    assert engine.cache.used_pages() == 0


def test_preemption_by_recompute_loses_no_request():
    # 8 pages of 4 tokens; three requests that grow to 16 tokens (4 pages) each.
    engine, ex = make_engine(context=24, max_total_tokens=28, max_num_seqs=3, max_batched_tokens=16,
                             watermark=0.0, prefix_reuse=False)
    prompts = [[1 + i, 2, 3, 4, 5, 6] for i in range(3)]
    streams = [engine.submit(prompt(*p), max_tokens=10) for p in prompts]
    run(engine)
    assert engine.metrics.preemptions > 0
    for p, s in zip(prompts, streams):
        assert list(s.result().token_ids) == expected_greedy(p, 10)
    assert engine.cache.used_pages() == 0 and not engine.cache.seqs


def test_newest_is_preempted_first():
    engine, ex = make_engine(context=24, max_total_tokens=28, max_num_seqs=3, max_batched_tokens=16,
                             watermark=0.0, prefix_reuse=False)
    old = engine.submit(prompt(1, 2, 3, 4, 5, 6), max_tokens=12)
    engine.step()
    new = engine.submit(prompt(7, 8, 9, 10, 11, 12), max_tokens=12)
    preempted = []
    while engine.core.has_work():
        plan_before = engine.metrics.preemptions
        engine.step()
        check(engine)
        if engine.metrics.preemptions > plan_before:
            preempted.append(engine.core.requests.get(new.request_id) is not None and
                             engine.core.requests[new.request_id].samples[0].seq.preemptions > 0)
    assert preempted and all(preempted)  # only the newer request was ever preempted
    assert list(old.result().token_ids) == expected_greedy([1, 2, 3, 4, 5, 6], 12)
    assert list(new.result().token_ids) == expected_greedy([7, 8, 9, 10, 11, 12], 12)


def test_prefix_reuse_forks_full_pages_of_a_shared_prompt():
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=64)
    system = list(range(20, 30))  # 10 tokens: two full pages of 4, and 2 more
    first = engine.submit(prompt(*system, 1, 2), max_tokens=4)
    run(engine)
    assert len(engine.scheduler.prefix) == 1
    holder = engine.scheduler.prefix.holders()[0]
    ops_before = len(ex.cache.ops)
    second = engine.submit(prompt(*system, 3), max_tokens=4)
    run(engine)
    forks = [op for op in ex.cache.ops[ops_before:] if op[0] == "fork" and op[1] == holder]
    assert forks and forks[0][3] == 8  # forked at two full pages
    second_chunks = [f for f in ex.forwards if any(start == 8 and n == 3 for _, start, n in f)]
    assert second_chunks, "the second prompt recomputed only its last 3 tokens"
    assert list(first.result().token_ids) == expected_greedy(system + [1, 2], 4)
    assert list(second.result().token_ids) == expected_greedy(system + [3], 4)
    # Only the holder keeps pages: the first prompt's three full pages (the second prompt's
    # full pages were already covered, so it registered no holder of its own).
    assert len(engine.scheduler.prefix) == 1 and engine.cache.used_pages() == 3


def test_cancellation_frees_pages_at_once():
    engine, ex = make_engine(max_num_seqs=2, max_batched_tokens=16, prefix_reuse=False)
    stream = engine.submit(prompt(*range(1, 14)), max_tokens=40)
    for _ in range(4):
        engine.step()
    assert engine.cache.used_pages() > 0
    stream.cancel()
    with pytest.raises(RequestCancelled):  # the consumer sees the cancellation at once
        stream.result(timeout=0)
    engine.step()  # the core applies the abort before it schedules anything
    assert engine.cache.used_pages() == 0 and not engine.cache.seqs
    check(engine)
    with pytest.raises(RequestCancelled):
        stream.result()
    assert not engine.core.has_work()


def test_priority_policy_admits_higher_priority_first():
    engine, ex = make_engine(max_num_seqs=1, max_batched_tokens=16, policy="priority", prefix_reuse=False)
    low = engine.submit(prompt(1, 2), max_tokens=2, priority=0)
    high = engine.submit(prompt(3, 4), max_tokens=2, priority=5)
    engine.step()
    first = engine.core.requests[high.request_id].samples[0].seq
    assert first.seq_id is not None and engine.core.requests[low.request_id].samples[0].seq.seq_id is None
    run(engine)
    assert high.result().token_ids and low.result().token_ids


def test_fcfs_policy_ignores_priority():
    engine, ex = make_engine(max_num_seqs=1, max_batched_tokens=16, policy="fcfs", prefix_reuse=False)
    low = engine.submit(prompt(1, 2), max_tokens=2, priority=0)
    engine.submit(prompt(3, 4), max_tokens=2, priority=5)
    engine.step()
    assert engine.core.requests[low.request_id].samples[0].seq.seq_id is not None


def test_n_samples_fork_one_prompt():
    engine, ex = make_engine(max_num_seqs=4, max_batched_tokens=32, prefix_reuse=False)
    stream = engine.submit(prompt(*range(1, 7)), max_tokens=5, n=3, temperature=1.0, seed=11)
    run(engine)
    forks = [op for op in ex.cache.ops if op[0] == "fork"]
    assert len(forks) == 2 and all(op[3] == 6 for op in forks)  # two samples forked at the prompt end
    prompt_chunks = [c for f in ex.forwards for c in f if c[1] == 0]
    assert len(prompt_chunks) == 1  # the prompt was computed once
    out = stream.result()
    assert len(out.choices) == 3 and all(len(c.token_ids) == 5 for c in out.choices)
    assert len({c.token_ids for c in out.choices}) > 1
    # Same seed, alone and again: the same samples.
    again, _ = make_engine(max_num_seqs=4, max_batched_tokens=32, prefix_reuse=False)
    s2 = again.submit(prompt(*range(1, 7)), max_tokens=5, n=3, temperature=1.0, seed=11)
    run(again)
    assert [c.token_ids for c in s2.result().choices] == [c.token_ids for c in out.choices]


def test_queue_is_bounded():
    engine, _ = make_engine(max_num_seqs=1, max_batched_tokens=8, max_waiting=2)
    engine.submit(prompt(1), max_tokens=1)
    engine.submit(prompt(2), max_tokens=1)
    with pytest.raises(EngineOverloadedError):
        engine.submit(prompt(3), max_tokens=1)
    run(engine)
    engine.submit(prompt(3), max_tokens=1)  # room again


@pytest.mark.parametrize("prefix_reuse", [False, True])
def test_random_requests_and_cancellations_leave_no_page_behind(prefix_reuse):
    rng = random.Random()
    engine, ex = make_engine(context=40, max_total_tokens=120, max_num_seqs=6, max_batched_tokens=24,
                             watermark=0.05, prefix_reuse=prefix_reuse)
    shared = [rng.randrange(64) for _ in range(8)]
    live, done, expected = [], 0, {}
    for i in range(1000):
        head = shared if rng.random() < 0.5 else []
        p = head + [rng.randrange(64) for _ in range(rng.randint(1, 12))]
        n = rng.choice([1, 1, 1, 2])
        max_tokens = rng.randint(1, 8)
        stream = engine.submit(prompt(*p), max_tokens=max_tokens, n=n,
                               temperature=0.0 if n == 1 else 0.9, seed=i)
        live.append(stream)
        if n == 1:
            expected[stream.request_id] = expected_greedy(p, max_tokens)
        for _ in range(rng.randint(0, 3)):
            if engine.core.has_work():
                engine.step()
                check(engine)
        if rng.random() < 0.15 and live:
            rng.choice(live).cancel()
            check(engine)
        for s in [s for s in live if s.done]:
            live.remove(s)
            done += 1
            try:
                out = s.result()
            except RequestCancelled:
                continue
            if s.request_id in expected:
                assert list(out.token_ids) == expected[s.request_id]
    run(engine)
    holders = engine.scheduler.prefix.holders() if engine.scheduler.prefix else []
    assert set(engine.cache.seqs) == set(holders)
    for h in holders:
        engine.cache.remove(h)
    assert engine.cache.used_pages() == 0
