"""Kiln's CPU attention kernels against a numpy reference and against TVM's own CPU
kernels (same signatures, same log2 softmax-state convention), on fresh random data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from kiln.compiler.lower.kernels import cpu_attention as ka

HKV, HQ, D, P = 2, 6, 32, 16
SCALE = D ** -0.5
LOG2E = math.log2(math.e)


def _build(func, name):
    target = tvm.target.Target({"kind": "llvm"})
    return tvm.tirx.build(func, target=target)[name]


def _softmax_ref(scores, values):
    """scores [n] (log2 units), values [n, d] -> output [d], lse (log2)."""
    m = scores.max()
    w = np.exp2(scores - m)
    return (w / w.sum()) @ values, m + np.log2(w.sum())


def _paged(rng, lengths):
    pages_per = [-(-n // P) for n in lengths]
    total = sum(pages_per) + 3
    pages = rng.standard_normal((total, 2, HKV, P, D)).astype(np.float32)
    table = rng.permutation(total)[: sum(pages_per)].astype(np.int32)  # pages scattered in the pool
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    last = np.array([n - (k - 1) * P for n, k in zip(lengths, pages_per)], dtype=np.int32)

    def kv(b):
        own = table[indptr[b]:indptr[b + 1]]
        k = np.concatenate([pages[p, 0] for p in own], axis=1)[:, :lengths[b]]  # [Hkv, n, D]
        v = np.concatenate([pages[p, 1] for p in own], axis=1)[:, :lengths[b]]
        return k, v

    return pages, table, indptr, last, kv


@pytest.mark.parametrize("kernel", ["kiln", "tvm"])
def test_decode(kernel):
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode_cpu

    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(1, 90, 5)]
    pages, table, indptr, last, kv = _paged(rng, lengths)
    q = rng.standard_normal((5, HQ, D)).astype(np.float32)
    fn = (_build(ka.decode_paged(HKV, HQ, D, "float32"), "kiln_batch_decode_paged_kv_cpu") if kernel == "kiln"
          else _build(_attention_decode_cpu(HKV, HQ, D, "float32", False, {}), "batch_decode_paged_kv_cpu"))
    out, lse = tvm.runtime.tensor(np.zeros((5, HQ, D), np.float32)), tvm.runtime.tensor(np.zeros((5, HQ), np.float32))
    zeros = np.zeros(5, np.int32)
    fn(*[tvm.runtime.tensor(x) for x in (q, pages, indptr, table, last, zeros, zeros)], out, lse, 0, 1.0, 1e4, SCALE)
    for b in range(5):
        k, v = kv(b)
        for h in range(HQ):
            o, s = _softmax_ref(k[h // 3] @ q[b, h] * SCALE * LOG2E, v[h // 3])
            np.testing.assert_allclose(out.numpy()[b, h], o, atol=2e-6)
            assert lse.numpy()[b, h] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("causal", [0, 1])
def test_prefill_over_pages(causal):
    rng = np.random.default_rng()
    kv_lengths = [int(n) for n in rng.integers(20, 70, 3)]
    q_lengths = [int(rng.integers(1, n + 1)) for n in kv_lengths]
    pages, table, indptr, last, kv = _paged(rng, kv_lengths)
    q_indptr = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    q = rng.standard_normal((q_indptr[-1], HQ, D)).astype(np.float32)
    fn = _build(ka.prefill_paged(HKV, HQ, D, "float32"), "kiln_batch_prefill_paged_kv_cpu")
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float32))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    fn(*[tvm.runtime.tensor(x) for x in (q, q_indptr, pages, indptr, table, last, np.zeros(3, np.int32),
                                         np.zeros(len(q), np.int32))], out, lse, causal, 0, 1.0, 1e4, SCALE)
    for b in range(3):
        k, v = kv(b)
        for r in range(q_lengths[b]):
            t = q_indptr[b] + r
            visible = kv_lengths[b] - q_lengths[b] + r + 1 if causal else kv_lengths[b]  # bottom-right causal
            for h in range(HQ):
                o, s = _softmax_ref(k[h // 3, :visible] @ q[t, h] * SCALE * LOG2E, v[h // 3, :visible])
                np.testing.assert_allclose(out.numpy()[t, h], o, atol=2e-6)
                assert lse.numpy()[t, h] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("causal", [1, 0])
def test_prefill_ragged(causal):
    """Tiles of 16 queries: lengths below, at and past a tile, partial last tiles, and a
    sequence of one token."""
    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(1, 60, 3)] + [16, 1]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(indptr[-1])
    q = rng.standard_normal((n, HQ, D)).astype(np.float32)
    k = rng.standard_normal((n, HKV, D)).astype(np.float32)
    v = rng.standard_normal((n, HKV, D)).astype(np.float32)
    fn = _build(ka.prefill_ragged(HKV, HQ, D, D, "float32"), "kiln_batch_prefill_ragged_kv_cpu")
    out, lse = tvm.runtime.tensor(np.zeros(q.shape, np.float32)), tvm.runtime.tensor(np.zeros((n, HQ), np.float32))
    fn(*[tvm.runtime.tensor(x) for x in (q, indptr, k, v, indptr, np.zeros(n, np.int32),
                                         np.zeros(len(lengths), np.int32))],
       out, lse, causal, 0, 1.0, 1e4, SCALE)
    for b in range(len(lengths)):
        s0 = indptr[b]
        for r in range(lengths[b]):
            end = s0 + (r + 1 if causal else lengths[b])
            for h in range(HQ):
                o, s = _softmax_ref(k[s0:end, h // 3] @ q[s0 + r, h] * SCALE * LOG2E, v[s0:end, h // 3])
                np.testing.assert_allclose(out.numpy()[s0 + r, h], o, atol=2e-6)
                assert lse.numpy()[s0 + r, h] == pytest.approx(s, abs=1e-4)
