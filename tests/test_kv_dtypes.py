"""Artifacts whose KV cache holds float16 or int8 (tiny random llama): the cache stores
exactly torch's keys and values in that form, every cache path (ragged prefill, chunked
prefill, batched decode, fork, popn) reads the same stored rows, and the engine serves
with them (batched = alone, every page back after random requests with cancellations).

Why equality between paths can be asked of a quantized cache: the int8 scale is per token
and head, so a row's stored form does not depend on which chunk or batch wrote it; only
float32 summation order differs between paths (1e-4 as for the float32 cache)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from helpers import random_requests_free_every_page
from kiln.compiler.models.source import resolve_model
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.executor import CacheConfig, Chunk
from kiln.runtime.kv_layout import KVLayout

DTYPES = ["float16", "int8"]


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    return resolve_model(checkpoint("llama")).build_module()


def _cache(ex, batch=4, tokens=512):
    return ex.create_cache(CacheConfig(max_batch_size=batch, max_total_tokens=tokens, prefill_chunk_size=256,
                                       page_size=ex.page_size))


def _quantum(layout: KVLayout, x: np.ndarray) -> np.ndarray:
    """The stored form's step at each element of x [..., heads, head_dim]."""
    if layout.dtype == "float16":
        return np.abs(x) * 2.0 ** -10 + 2.0 ** -24
    return np.abs(x).max(axis=-1, keepdims=True) / 127


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_the_cache_stores_torchs_keys_and_values_in_its_form(checkpoint, compiled, torch_model, kv_dtype):
    ex = Engine.load(compiled("llama", "llvm", kv_dtype), background=False)._executor
    layout = ex.kv_layout
    assert layout.dtype == kv_dtype
    rng = np.random.default_rng()
    ids = rng.integers(0, torch_model.config.vocab_size, int(rng.integers(20, 60))).tolist()
    cache = _cache(ex)
    cache.add(0)
    ex.forward(cache, [Chunk(0, tuple(ids), 0)])
    k, v = cache.read_kv(0, len(ids), torch_model.config)  # [L, T, Hkv, D]
    with torch.no_grad():
        _, past = torch_model(torch.tensor([ids]), torch.arange(len(ids))[None])
    # Layer 0 only: later layers' keys already carry the rounding of earlier layers' cache.
    for got, want in ((k[0], past[0][0]), (v[0], past[0][1])):
        want = want.numpy()[0].transpose(1, 0, 2)  # [T, Hkv, D]
        step = _quantum(layout, want)
        # Rounded to the nearest stored value: within half a step (plus torch-vs-TVM float32
        # noise, ~1e-6, which can move a value across a rounding boundary: one step).
        assert (np.abs(got - want) <= step * 0.5 + 1e-5).mean() > 0.99
        assert np.all(np.abs(got - want) <= step + 1e-5)
        # A wrong scale (e.g. amax / 255, or none) fails the bounds above; a cache that
        # does not round at all fails this:
        assert not np.array_equal(got, want)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_every_cache_path_reads_the_same_stored_rows(compiled, torch_model, kv_dtype):
    """Chunked prefill, batched decode, fork (page-aligned and not) and popn give the logits
    of the whole sequence prefilled at once.

    Up to the stored form's rounding: two routes compute K and V with float32 noise of
    ~1e-7 (attention over cached pages vs within a chunk sums in another order), and a
    value that close to a rounding boundary of float16 / int8 is stored one step apart
    (README, "KV-cache precision"). So most rows must agree to 1e-4 (a wrong row, page,
    offset or scale breaks every later row), and every row within a tenth of what storing
    K and V in this form costs at all (the float32-KV artifact against this one)."""
    ex = Engine.load(compiled("llama", "llvm", kv_dtype), background=False)._executor
    ex32 = Engine.load(compiled("llama", "llvm", "float32"), background=False)._executor
    rng = np.random.default_rng()
    vocab = torch_model.config.vocab_size
    seq = rng.integers(0, vocab, 48).tolist()
    cache, cache32 = _cache(ex), _cache(ex32)

    def whole(ids, sid=9, executor=ex, kv=cache):
        kv.add(sid)
        out = executor.forward(kv, [Chunk(sid, tuple(ids[:-1]), 0, tuple(range(len(ids) - 1)))])
        kv.remove(sid)
        return out

    ref = whole(seq + [0])  # row t: logits after seq[:t + 1]
    effect = np.abs(ref - whole(seq + [0], executor=ex32, kv=cache32)).max()
    assert effect > 1e-4  # the stored form does round
    tight = []

    def check(got, want):
        got, want = np.atleast_2d(got), np.atleast_2d(want)
        error = np.abs(got - want).max(axis=-1)
        assert (error <= 0.1 * effect).all(), (error.max(), effect)
        tight.extend(error <= 1e-4)

    cache.add(0)
    cut = int(rng.integers(5, 30))
    a = ex.forward(cache, [Chunk(0, tuple(seq[:cut]), 0, tuple(range(cut)))])
    b = ex.forward(cache, [Chunk(0, tuple(seq[cut:40]), cut, tuple(range(40 - cut)))])  # paged prefill
    check(np.concatenate([a, b]), ref[:40])
    cache.fork(0, 1, 32)  # shares two pages
    cache.fork(0, 2, 21)  # copies a partial page
    for pos in range(40, 44):  # batched decode of 0 beside its forks' prefills
        out = ex.forward(cache, [Chunk(0, (seq[pos],), pos)])
        check(out[0], ref[pos])
    tails = {1: rng.integers(0, vocab, 7).tolist(), 2: rng.integers(0, vocab, 5).tolist()}
    out = ex.forward(cache, [Chunk(1, tuple(tails[1]), 32), Chunk(2, tuple(tails[2]), 21)])
    check(out[0], whole(seq[:32] + tails[1] + [0])[-1])
    check(out[1], whole(seq[:21] + tails[2] + [0])[-1])
    cache.popn(0, 10)  # back to 34 tokens, then a different continuation
    other = rng.integers(0, vocab, 6).tolist()
    out = ex.forward(cache, [Chunk(0, tuple(other), 34)])
    check(out[0], whole(seq[:34] + other + [0])[-1])
    assert np.mean(tight) >= 0.75, f"{np.mean(tight):.0%} of rows within 1e-4"
    for sid in (0, 1, 2):
        cache.remove(sid)
    assert cache.available_pages() == cache.total_pages


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_the_engine_serves_batched_as_alone_and_frees_every_page(compiled, kv_dtype):
    folder = compiled("llama", "llvm", kv_dtype)
    engine = Engine.load(folder, EngineConfig(max_num_seqs=4, max_batched_tokens=24))  # chunked prefill
    system = "You are a helpful assistant. Answer briefly. " * 2
    prompts = [system + t for t in ("Hi", "What is a kiln?", "Bye")] + ["The quick brown fox", "héllo " * 9]
    streams = [engine.submit(p, max_tokens=12, ignore_eos=True) for p in prompts]
    batched = [s.result(timeout=120).token_ids for s in streams]
    assert engine.stats().prefix_holders >= 1  # the shared system prompt was forked
    for p, got in zip(prompts, batched):
        assert engine.generate(p, max_tokens=12, ignore_eos=True).token_ids == got
    engine.close()

    rng = random.Random()
    engine = Engine.load(folder, EngineConfig(max_num_seqs=8, max_total_tokens=480, max_batched_tokens=48,
                                              watermark=0.02), background=False)
    random_requests_free_every_page(engine, rng, 300, max_tokens=8, n_choices=(1, 1, 2))
    assert engine.kv_capacity.dtype == kv_dtype
