"""The batched sampler against direct numpy references, on fresh random logits."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SampleState,
    SamplingParams,
    make_generators,
    process_logits,
    sample_rows,
    sampling_distribution,
)

V = 200


def _reference_distribution(x, temperature, top_k, top_p, min_p=0.0):
    """Written independently, with the HF / vLLM convention: top-k on the logits, softmax,
    min-p band, then the smallest most-likely prefix reaching top_p."""
    z = x.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if min_p:
        keep = p >= min_p * p.max()
        order, p = order[keep], p[keep] / p[keep].sum()
    n = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # first prefix with mass >= top_p
    q = np.zeros_like(z)
    q[order[:n]] = p[:n]
    return q / q.sum()


def _state(params, prompt=(), output=(), end_ids=frozenset()):
    state = SampleState(params, make_generators(params.seed, 1)[0], list(prompt), frozenset(end_ids))
    for t in output:
        state.record(t)
    return state


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.8, 10, 0.5, 0.0),
    (2.0, 1, 1.0, 0.0), (1.0, 0, 1e-6, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 50, 0.95, 0.05),
])
def test_distribution_matches_reference(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng()
    for _ in range(5):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        np.testing.assert_allclose(sampling_distribution(logits.astype(np.float64), params),
                                   _reference_distribution(logits, temperature, top_k, top_p, min_p), atol=1e-12)


def test_nucleus_wider_than_the_sorted_head():
    # A flat distribution: the 0.999 nucleus needs nearly every token (beyond a 1024 head).
    logits = np.random.default_rng().standard_normal(5000).astype(np.float32) * 0.01
    params = SamplingParams(temperature=1.0, top_p=0.999)
    np.testing.assert_allclose(sampling_distribution(logits.astype(np.float64), params),
                               _reference_distribution(logits, 1.0, 0, 0.999), atol=1e-12)


def test_penalties_bias_and_min_tokens_match_reference():
    rng = np.random.default_rng()
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    prompt = rng.integers(0, V, 15).tolist()
    output = rng.integers(0, V, 25).tolist()
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={7: 5.0, 9: -100.0}, min_tokens=30, max_tokens=40)
    got = process_logits(logits, _state(params, prompt, output, end_ids={3, 4}))
    ref = logits.astype(np.float64).copy()
    ref[7] += 5.0
    ref[9] -= 100.0
    for t in set(prompt) | set(output):  # HF repetition penalty
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    for t in set(output):  # OpenAI presence / frequency
        ref[t] -= 0.5 + 0.25 * output.count(t)
    ref[[3, 4]] = -np.inf  # 25 < min_tokens: no end token yet
    np.testing.assert_allclose(got, ref)


def test_greedy_batch_is_argmax_per_row():
    rng = np.random.default_rng()
    logits = rng.standard_normal((6, V)).astype(np.float32)
    tokens, _ = sample_rows(logits, [_state(SamplingParams()) for _ in range(6)])
    assert tokens == [int(np.argmax(r)) for r in logits]


def test_draws_follow_the_distribution():
    rng = np.random.default_rng()
    logits = rng.standard_normal(8).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=6, seed=int(rng.integers(2**31)))
    probs = sampling_distribution(logits.astype(np.float64), params)
    state = _state(params)
    n = 20000
    counts = np.bincount([sample_rows(logits[None], [state])[0][0] for _ in range(n)], minlength=8)
    assert counts[probs == 0].sum() == 0  # never outside top-k
    se = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(counts / n - probs) <= 5 * se + 1e-12)


def test_seeded_rows_do_not_depend_on_their_batch():
    rng = np.random.default_rng()
    steps = [rng.standard_normal((4, V)).astype(np.float32) for _ in range(20)]
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(), SamplingParams(temperature=1.2, top_p=0.8),
              SamplingParams(temperature=0.9, seed=5, top_k=20)]

    def run(rows):
        states = [_state(params[r]) for r in rows]
        return [sample_rows(step[rows], states)[0] for step in steps]

    together = np.array(run([0, 1, 2, 3]))
    alone = np.array(run([0]))
    assert (together[:, 0] == alone[:, 0]).all()
    assert (np.array(run([3, 1]))[:, 0] == together[:, 3]).all()


def test_logprobs_are_the_models():
    rng = np.random.default_rng()
    logits = rng.standard_normal((1, V)).astype(np.float32)
    (token,), (lp,) = sample_rows(logits, [_state(SamplingParams(temperature=0.5, seed=1, logprobs=5))])
    x = logits[0].astype(np.float64)
    ref = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    assert lp.token == token and lp.logprob == pytest.approx(ref[token])
    assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in lp.top] == pytest.approx(list(np.sort(ref)[::-1][:5]))


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("logit_bias", {"a": 1}), ("logit_bias", {1: 500}),
    ("min_tokens", 300), ("logprobs", 21), ("n", 0), ("n", 17), ("max_tokens", 0), ("seed", -2),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_stop_strings_are_capped_in_total_length():
    per_stop = MAX_STOP_CHARS // MAX_STOP_STRINGS
    at_cap = [chr(ord("a") + i) * per_stop for i in range(MAX_STOP_STRINGS)]
    assert sum(map(len, at_cap)) == MAX_STOP_CHARS
    assert SamplingParams(stop=at_cap).stop == tuple(at_cap)
    for over in (at_cap[:-1] + [at_cap[-1] + "z"], "x" * (MAX_STOP_CHARS + 1), ["x" * 250_000] * 16):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(stop=over)
        assert info.value.field == "stop"
        assert str(MAX_STOP_CHARS) in str(info.value)


def test_extreme_valid_values_never_make_nan_distributions():
    """temperature and repetition_penalty as small as a double goes (valid values): the
    draw tends to the argmax / to the boosted tokens, never to the NaN-driven last token."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((1, 50)).astype(np.float32) * 5
    best = int(np.argmax(logits[0]))
    params = SamplingParams(temperature=5e-324, max_tokens=4)
    state = SampleState(params, np.random.default_rng(), [best], frozenset())
    with np.errstate(all="raise"):  # no overflow or invalid operation reaches numpy
        assert sample_rows(logits, [state])[0] == [best]
    prompt = [best] + [int(t) for t in rng.choice(50, 4)]  # the best logit is > 0: boosted
    boosted = {t for t in prompt if logits[0, t] > 0}
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324, max_tokens=4)
    state = SampleState(params, np.random.default_rng(), prompt, frozenset())
    assert sample_rows(logits, [state])[0][0] in boosted  # a positive logit / 5e-324 is +inf
