"""Static prefill buckets (``prefill_t<T>``): the plan that cuts a prefill into pieces, the
cut itself, and the compiled bucket against the dynamic ``prefill`` on fresh tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.artifact import Dispatch
from kiln.runtime.executor import CacheConfig, Chunk, _cut


@pytest.mark.parametrize("tokens", [1, 31, 32, 127, 128, 129, 300, 512])
def test_prefill_plan_covers_every_token_largest_buckets_first(tokens):
    plan = Dispatch(static_prefill=(32, 128)).prefill_plan(tokens)
    assert sum(n for _, n in plan) == tokens
    sizes = [n for fn, n in plan if fn != "prefill"]
    assert sizes == sorted(sizes, reverse=True)
    assert all(fn == f"prefill_t{n}" for fn, n in plan if fn != "prefill")
    rest = [n for fn, n in plan if fn == "prefill"]
    assert rest == ([tokens % 32] if tokens % 32 else [])  # the remainder fits no bucket
    assert len(sizes) == tokens // 128 + (tokens % 128) // 32


def test_no_buckets_means_one_dynamic_call():
    assert Dispatch().prefill_plan(300) == [("prefill", 300)]


def test_cut_keeps_order_positions_and_logit_rows():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 90, size=5)
    chunks = []
    for s, n in enumerate(lengths):
        start = int(rng.integers(0, 50))
        at = tuple(sorted(rng.choice(int(n), size=min(int(n), 3), replace=False).tolist())) if s % 2 else None
        chunks.append(Chunk(s, tuple(rng.integers(0, 1000, int(n)).tolist()), start, at))
    total = int(lengths.sum())
    plan = Dispatch(static_prefill=(16, 64)).prefill_plan(total)
    pieces = _cut(chunks, [n for _, n in plan])
    assert [sum(len(c.tokens) for c in p) for p in pieces] == [n for _, n in plan]
    # Every token once, in order, at its position in its sequence.
    flat = [(c.seq_id, c.start + i, t) for p in pieces for c in p for i, t in enumerate(c.tokens)]
    assert flat == [(c.seq_id, c.start + i, t) for c in chunks for i, t in enumerate(c.tokens)]
    # The logit rows, in order: (sequence, position) of each.
    rows = [(c.seq_id, c.start + o) for p in pieces for c in p for o in c.logit_offsets()]
    assert rows == [(c.seq_id, c.start + o) for c in chunks for o in c.logit_offsets()]


def _prefill_then_decode(ex, prompts, logits_at, via, seed):
    """Logits of one prefill of ``prompts`` (one chunk each) and then one decode step."""
    rng = np.random.default_rng(seed)
    vocab = ex.manifest.model.vocab_size
    cache = ex.create_cache(CacheConfig(max_batch_size=len(prompts), max_total_tokens=512, prefill_chunk_size=512,
                                        page_size=ex.page_size))
    chunks = []
    for s, (n, at) in enumerate(zip(prompts, logits_at)):
        cache.add(s)
        chunks.append(Chunk(s, tuple(rng.integers(0, vocab, n).tolist()), 0, at))
    first = ex.forward(cache, chunks, via=via)
    step = [Chunk(s, (int(rng.integers(0, vocab)),), n) for s, n in enumerate(prompts)]
    return first, ex.forward(cache, step), cache


@pytest.mark.parametrize("prompts,logits_at", [
    ((120, 8), (None, None)),  # exactly one bucket
    ((100, 60), ((0, 50, 99), None)),  # a bucket, the second prompt cut, the rest dynamic
    ((40, 30, 90), (None, (), (10, 89))),  # a prompt that wants no logits
])
def test_bucketed_prefill_matches_the_dynamic_function(compiled, prompts, logits_at):
    from kiln.runtime.engine import Engine

    ex = Engine.load(compiled("llama"), background=False)._executor
    assert ex.manifest.dispatch.static_prefill == (128,)
    assert "prefill_t128" in ex.manifest.functions
    seed = int(np.random.default_rng().integers(1 << 30))
    got, got_step, cache = _prefill_then_decode(ex, prompts, logits_at, None, seed)
    want, want_step, _ = _prefill_then_decode(ex, prompts, logits_at, "prefill", seed)
    assert got.shape == want.shape == (sum(len(a) if a is not None else 1 for a in logits_at), ex.manifest.model.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The cache holds the same keys and values: the next step agrees too.
    np.testing.assert_allclose(got_step, want_step, rtol=1e-4, atol=1e-4)
    pages = cache.available_pages()
    for s in range(len(prompts)):
        cache.remove(s)
    assert cache.available_pages() > pages


def test_forcing_a_prefill_bucket_checks_its_size(compiled):
    from kiln.runtime.engine import Engine

    ex = Engine.load(compiled("llama"), background=False)._executor
    cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=256, prefill_chunk_size=256,
                                        page_size=ex.page_size))
    cache.add(0)
    with pytest.raises(ValueError, match="prefill_t128 runs exactly 128 tokens, got 5"):
        ex.forward(cache, [Chunk(0, (1, 2, 3, 4, 5), 0)], via="prefill_t128")
    # Nothing was appended: the sequence still takes a whole bucket from position 0.
    out = ex.forward(cache, [Chunk(0, tuple(range(128)), 0)], via="prefill_t128")
    assert out.shape == (1, ex.manifest.model.vocab_size) and np.isfinite(out).all()
