"""Kiln's CPU attention kernels against a numpy float64 reference (and, for float32 caches,
TVM's own CPU kernel: same signatures, same log2 softmax-state convention), on fresh random
data, for every KV dtype: the cache rows are packed as the graph packs them
(``KVLayout.encode``), and the reference attends over the same rows decoded in float64, so a
wrong scale, a wrong row or a wrong word shows as an error far above the bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from kiln.compiler.lower.kernels import cpu_attention as ka
from kiln.runtime.kv_layout import KV_DTYPES, KVLayout

HKV, HQ, D, P = 2, 6, 32, 16
SCALE = D ** -0.5
LOG2E = math.log2(math.e)


def _build(func, name):
    target = tvm.target.Target({"kind": "llvm"})
    return tvm.tirx.build(func, target=target)[name]


def _softmax_ref(scores, values):
    """scores [n] (log2 units), values [n, d] -> output [d], lse (log2); float64."""
    m = scores.max()
    w = np.exp2(scores - m)
    return (w / w.sum()) @ values, m + np.log2(w.sum())


def _q_words(layout, q):
    """[T, HQ, D] queries -> [T, HQ * q_split, words]: the cache's query tensor."""
    padded = np.zeros((*q.shape[:2], layout.q_stride), np.float32)
    padded[..., :D] = q
    return padded.reshape(q.shape[0], layout.cache_q_heads, layout.words)


def _outputs(layout, out, lse):
    """The cache's output / lse tensors -> [T, HQ, D], [T, HQ] (every word row of a head
    must carry the head's lse)."""
    o = out.numpy().reshape(out.shape[0], HQ, layout.q_stride)[..., :D]
    l = lse.numpy().reshape(lse.shape[0], HQ, layout.q_split)
    assert (l == l[..., :1]).all()
    return o, l[..., 0]


def _paged(rng, layout, lengths, shared=0):
    """A page pool with the sequences' K/V; the last sequence's first ``shared`` pages are
    the first sequence's (a fork). Returns pool words, table, indptr, last lengths and
    kv(b) -> decoded float64 K, V [Hkv, n, D]."""
    pages_per = [-(-n // P) for n in lengths]
    total = sum(pages_per) + 3
    values = rng.standard_normal((total, 2, HKV, P, D)).astype(np.float32) * rng.uniform(0.2, 3.0, (total, 1, HKV, P, 1))
    pages = layout.encode(values)
    table = rng.permutation(total)[: sum(pages_per)].astype(np.int32)  # pages scattered in the pool
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    table[indptr[-2]:indptr[-2] + shared] = table[:shared]
    last = np.array([n - (k - 1) * P for n, k in zip(lengths, pages_per)], dtype=np.int32)
    decoded = layout.decode(pages).astype(np.float64)

    def kv(b):
        own = table[indptr[b]:indptr[b + 1]]
        k = np.concatenate([decoded[p, 0] for p in own], axis=1)[:, :lengths[b]]  # [Hkv, n, D]
        v = np.concatenate([decoded[p, 1] for p in own], axis=1)[:, :lengths[b]]
        return k, v

    return pages, table, indptr, last, kv


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode(kv_dtype):
    layout = KVLayout(kv_dtype, HQ, HKV, D)
    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(1, 90, 4)]
    lengths.append(lengths[0] + int(rng.integers(1, 20)))  # forked from the first sequence
    pages, table, indptr, last, kv = _paged(rng, layout, lengths, shared=lengths[0] // P)
    q = rng.standard_normal((5, HQ, D)).astype(np.float32)
    fn = _build(ka.decode_paged(layout), "kiln_batch_decode_paged_kv_cpu")
    out = tvm.runtime.tensor(np.zeros((5, layout.cache_q_heads, layout.words), np.float32))
    lse = tvm.runtime.tensor(np.zeros((5, layout.cache_q_heads), np.float32))
    zeros = np.zeros(5, np.int32)
    fn(*[tvm.runtime.tensor(x) for x in (_q_words(layout, q), pages, indptr, table, last, zeros, zeros)],
       out, lse, 0, 1.0, 1e4, SCALE)
    o, l = _outputs(layout, out, lse)
    for b in range(5):
        k, v = kv(b)
        for h in range(HQ):
            ref, s = _softmax_ref(k[h // 3] @ q[b, h] * SCALE * LOG2E, v[h // 3])
            np.testing.assert_allclose(o[b, h], ref, atol=1e-5, rtol=1e-5)
            assert l[b, h] == pytest.approx(s, abs=1e-4)


def test_decode_matches_tvm_float32():
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode_cpu

    layout = KVLayout("float32", HQ, HKV, D)
    rng = np.random.default_rng()
    pages, table, indptr, last, _ = _paged(rng, layout, [int(n) for n in rng.integers(1, 90, 5)])
    q = rng.standard_normal((5, HQ, D)).astype(np.float32)
    results = []
    for fn in (_build(ka.decode_paged(layout), "kiln_batch_decode_paged_kv_cpu"),
               _build(_attention_decode_cpu(HKV, HQ, D, "float32", False, {}), "batch_decode_paged_kv_cpu")):
        out, lse = tvm.runtime.tensor(np.zeros((5, HQ, D), np.float32)), tvm.runtime.tensor(np.zeros((5, HQ), np.float32))
        zeros = np.zeros(5, np.int32)
        fn(*[tvm.runtime.tensor(x) for x in (q, pages, indptr, table, last, zeros, zeros)], out, lse, 0, 1.0, 1e4, SCALE)
        results.append((out.numpy(), lse.numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], atol=2e-6, rtol=1e-5)  # rows scaled up to 3x
    np.testing.assert_allclose(results[0][1], results[1][1], atol=1e-4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("causal", [0, 1])
def test_prefill_over_pages(kv_dtype, causal):
    layout = KVLayout(kv_dtype, HQ, HKV, D)
    rng = np.random.default_rng()
    kv_lengths = [int(n) for n in rng.integers(20, 70, 3)]
    q_lengths = [int(rng.integers(1, n + 1)) for n in kv_lengths]
    pages, table, indptr, last, kv = _paged(rng, layout, kv_lengths)
    q_indptr = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    q = rng.standard_normal((q_indptr[-1], HQ, D)).astype(np.float32)
    fn = _build(ka.prefill_paged(layout), "kiln_batch_prefill_paged_kv_cpu")
    out = tvm.runtime.tensor(np.zeros((len(q), layout.cache_q_heads, layout.words), np.float32))
    lse = tvm.runtime.tensor(np.zeros((len(q), layout.cache_q_heads), np.float32))
    fn(*[tvm.runtime.tensor(x) for x in (_q_words(layout, q), q_indptr, pages, indptr, table, last,
                                         np.zeros(3, np.int32), np.zeros(len(q), np.int32))],
       out, lse, causal, 0, 1.0, 1e4, SCALE)
    o, l = _outputs(layout, out, lse)
    for b in range(3):
        k, v = kv(b)
        for r in range(q_lengths[b]):
            t = q_indptr[b] + r
            visible = kv_lengths[b] - q_lengths[b] + r + 1 if causal else kv_lengths[b]  # bottom-right causal
            for h in range(HQ):
                ref, s = _softmax_ref(k[h // 3, :visible] @ q[t, h] * SCALE * LOG2E, v[h // 3, :visible])
                np.testing.assert_allclose(o[t, h], ref, atol=1e-5, rtol=1e-5)
                assert l[t, h] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("causal", [1, 0])
def test_prefill_ragged(kv_dtype, causal):
    """Tiles of 16 queries: lengths below, at and past a tile, partial last tiles, and a
    sequence of one token; the new K / V in their stored form."""
    layout = KVLayout(kv_dtype, HQ, HKV, D)
    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(1, 60, 3)] + [16, 1]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(indptr[-1])
    q = rng.standard_normal((n, HQ, D)).astype(np.float32)
    k = layout.encode(rng.standard_normal((n, HKV, D)) * rng.uniform(0.2, 3.0, (n, HKV, 1)))
    v = layout.encode(rng.standard_normal((n, HKV, D)) * rng.uniform(0.2, 3.0, (n, HKV, 1)))
    k64, v64 = layout.decode(k).astype(np.float64), layout.decode(v).astype(np.float64)
    fn = _build(ka.prefill_ragged(layout), "kiln_batch_prefill_ragged_kv_cpu")
    out = tvm.runtime.tensor(np.zeros((n, layout.cache_q_heads, layout.words), np.float32))
    lse = tvm.runtime.tensor(np.zeros((n, layout.cache_q_heads), np.float32))
    fn(*[tvm.runtime.tensor(x) for x in (_q_words(layout, q), indptr, k, v, indptr, np.zeros(n, np.int32),
                                         np.zeros(len(lengths), np.int32))],
       out, lse, causal, 0, 1.0, 1e4, SCALE)
    o, l = _outputs(layout, out, lse)
    for b in range(len(lengths)):
        s0 = indptr[b]
        for r in range(lengths[b]):
            end = s0 + (r + 1 if causal else lengths[b])
            for h in range(HQ):
                ref, s = _softmax_ref(k64[s0:end, h // 3] @ q[s0 + r, h] * SCALE * LOG2E, v64[s0:end, h // 3])
                np.testing.assert_allclose(o[s0 + r, h], ref, atol=1e-5, rtol=1e-5)
                assert l[s0 + r, h] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_split_is_bitwise(kv_dtype):
    """The q / k / v split copies words bit for bit (int8 payloads include NaN patterns)."""
    layout = KVLayout(kv_dtype, HQ, HKV, D)
    rng = np.random.default_rng()
    n = int(rng.integers(1, 40))
    words = rng.integers(0, 2 ** 32, (n, layout.cache_q_heads + 2 * HKV, layout.words), dtype=np.uint32)
    qkv = words.view(np.float32)
    fn = _build(ka.split_qkv(layout), "kiln_split_qkv_words")
    q = tvm.runtime.tensor(np.zeros((n, layout.cache_q_heads, layout.words), np.float32))
    k, v = (tvm.runtime.tensor(np.zeros((n, HKV, layout.words), np.float32)) for _ in range(2))
    fn(tvm.runtime.tensor(qkv), tvm.runtime.tensor(np.zeros(n, np.int32)), q, k, v, 0)
    hq = layout.cache_q_heads
    assert (q.numpy().view(np.uint32) == words[:, :hq]).all()
    assert (k.numpy().view(np.uint32) == words[:, hq:hq + HKV]).all()
    assert (v.numpy().view(np.uint32) == words[:, hq + HKV:]).all()


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_stored_form_error_is_bounded(kv_dtype):
    """The packing itself: decoded rows within the format's rounding of the float rows (a
    scale off by any factor fails this)."""
    layout = KVLayout(kv_dtype, HQ, HKV, D)
    rng = np.random.default_rng()
    x = rng.standard_normal((64, HKV, D)) * rng.uniform(0.01, 10.0, (64, HKV, 1))
    err = np.abs(layout.decode(layout.encode(x)) - x)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    # float16: half a unit in the last place, whose spacing stops shrinking below the smallest
    # normal (2^-14): subnormals are spaced 2^-24, so their rounding is at most 2^-25.
    half_ulp16 = np.maximum(np.abs(x), 2.0 ** -14) * 2.0 ** -11
    bound = amax / 127 / 2 * 1.001 if kv_dtype == "int8" else half_ulp16 * 1.001
    assert (err <= bound + 1e-12).all()
    assert err.max() > 0  # it is a lossy format: the test sees the rounding
