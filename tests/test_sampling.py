"""The sampler against a direct numpy reference, on fresh random logits."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.sampling import SamplingParams, make_generator, sample_token, sampling_distribution


def _reference(logits, temperature, top_k, top_p):
    """Written independently, with the HF / vLLM convention: keep the top-k logits,
    softmax them, then keep the smallest most-likely prefix whose mass reaches top_p."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # first prefix with mass >= top_p
    q = np.zeros_like(z)
    q[order[:n]] = p[:n]
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 10, 0.5), (2.0, 1, 1.0), (1.0, 0, 1e-6),
])
def test_distribution_matches_reference(temperature, top_k, top_p):
    rng = np.random.default_rng()
    for _ in range(5):
        logits = (rng.standard_normal(200) * 3).astype(np.float32)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        np.testing.assert_allclose(sampling_distribution(logits, params),
                                   _reference(logits, temperature, top_k, top_p), atol=1e-12)


def test_greedy_is_argmax():
    logits = np.random.default_rng().standard_normal(1000).astype(np.float32)
    assert sample_token(logits, SamplingParams(), make_generator(None)) == int(np.argmax(logits))


def test_draws_follow_the_distribution():
    rng = np.random.default_rng()
    logits = rng.standard_normal(8).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=6)
    probs = sampling_distribution(logits, params)
    gen = make_generator(int(rng.integers(2**31)))
    n = 20000
    counts = np.bincount([sample_token(logits, params, gen) for _ in range(n)], minlength=8)
    assert counts[probs == 0].sum() == 0  # never outside top-k
    # Every frequency within 5 standard errors of its probability.
    se = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(counts / n - probs) <= 5 * se + 1e-12)


def test_seed_reproduces_and_differs():
    logits = np.random.default_rng().standard_normal(500).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(seed):
        gen = make_generator(seed)
        return [sample_token(logits, params, gen) for _ in range(50)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)
