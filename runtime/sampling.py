"""Sampling parameters (validated once, at the boundary) and the batched numpy sampler.

Per row, in order: logit bias; repetition penalty (prompt and output tokens, HF rule:
divide positive logits, multiply negative ones); presence / frequency penalties (output
tokens, OpenAI rule: subtract presence * [count > 0] + frequency * count); end tokens
masked until ``min_tokens``; then temperature 0 takes the argmax, otherwise softmax of
logits / temperature, restricted to the top-k, to the min-p band (p >= min_p * p_max) and
to the smallest nucleus reaching top_p, renormalized, and one draw.

Every draw comes from the sample's own ``numpy.random.Generator`` (seeded from ``seed``
and the sample index), so a seeded request produces the same tokens whatever else is in
the batch. Log-probabilities are those of the model (log-softmax of the raw logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import InvalidRequestError
from .guided import Guide

MAX_STOP_STRINGS = 16
# Total characters over all stop strings. Matching costs O(number of stops) per generated
# character whatever their length (stop.py), but each stop's failure table is built per
# request and the longest stop sets how much text may be held back from the stream, so
# the total is bounded too. Real stop strings are short (end markers, "\n\nUser:"); 4096
# still allows all 16 at 256 characters, and keeps a request's tables under ~200 KB.
MAX_STOP_CHARS = 4096
MAX_LOGPROBS = 20
MAX_N = 16
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
EXP_FLOOR = -700.0  # exp(-700) ~ 1e-304 is still a normal float64


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature == 0`` is greedy (argmax)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    min_p: float = 0.0  # 0.0: no min-p cut
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: the chosen token's and the top-k
    n: int = 1
    guide: Guide | None = None  # constrain the output to a JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        total = sum(len(s) for s in stop)
        if total > MAX_STOP_CHARS:
            raise InvalidRequestError(
                "stop", f"stop strings may total at most {MAX_STOP_CHARS} characters, got {total}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidRequestError("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple((t, b) for t, b in bias)
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", "must map token ids to numbers") from None
        for t, b in bias:
            _check_int("logit_bias", t, low=0)
            _check_float("logit_bias", b, low=-100.0, high=100.0)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be true or false")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise InvalidRequestError("guide", "must be a kiln.runtime.guided.Guide")
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos", "cannot be combined with a constrained output (it ends "
                                                        "where its grammar completes, with end-of-sequence)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **overrides) -> "SamplingParams":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidRequestError(unknown[0], f"unknown sampling option (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **overrides)

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequestError("stop_token_ids", f"{t} is outside the vocabulary ({vocab_size})")
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise InvalidRequestError("logit_bias", f"token {t} is outside the vocabulary ({vocab_size})")


def _check_int(field_name: str, value, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise InvalidRequestError(field_name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(field_name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(field_name, f"must be <= {high}, got {value}")


def _check_float(field_name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
        raise InvalidRequestError(field_name, f"must be a number, got {value!r}")
    if not np.isfinite(value):
        raise InvalidRequestError(field_name, f"must be finite, got {value}")
    if (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(field_name, f"must be in {bracket}{low}, {high}], got {value}")


def make_generators(seed: int | None, n: int) -> list[np.random.Generator]:
    """One generator per sample; a seed fixes all of them."""
    children = np.random.SeedSequence(seed).spawn(n)
    return [np.random.Generator(np.random.PCG64(c)) for c in children]


@dataclass
class SampleState:
    """What the sampler needs to know of one sample between steps."""

    params: SamplingParams
    rng: np.random.Generator
    prompt: Sequence[int]
    end_ids: frozenset[int]
    output_counts: dict[int, int] = field(default_factory=dict)
    num_output: int = 0
    grammar: object | None = None  # the sample's llguidance matcher, if its output is constrained

    def record(self, token: int) -> None:
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        self.num_output += 1


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def process_logits(logits: np.ndarray, state: SampleState, allowed: np.ndarray | None = None) -> np.ndarray:
    """Bias, penalties, the min_tokens end-token mask and the grammar's mask ``allowed``
    (bool [V], or None), on a float64 copy of one row."""
    p = state.params
    x = logits.astype(np.float64)
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        np.add.at(x, np.asarray(ids), np.asarray(bias))
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(state.prompt, dtype=np.int64),
                                         np.fromiter(state.output_counts, dtype=np.int64)]))
        vals = x[seen]
        with np.errstate(over="ignore"):
            x[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_counts:
        ids = np.fromiter(state.output_counts, dtype=np.int64)
        counts = np.fromiter(state.output_counts.values(), dtype=np.float64)
        x[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if state.num_output < p.min_tokens and state.end_ids:
        ends = np.fromiter(state.end_ids, dtype=np.int64)
        # A complete grammar that allows only an end token wins over min_tokens.
        if allowed is None or allowed.sum() > allowed[ends[ends < allowed.shape[0]]].sum():
            x[ends] = -np.inf
    if allowed is not None:
        np.copyto(x, -np.inf, where=~allowed)  # no index arrays (x[~allowed] builds one)
    # A tiny repetition_penalty overflows a logit to +inf: keep it the largest finite
    # value (those tokens share the mass) rather than let inf - inf poison the row.
    return np.nan_to_num(x, nan=-np.inf, posinf=np.finfo(np.float64).max, neginf=-np.inf)


def sampling_distribution(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities [V] (float64) a non-greedy draw uses, from processed logits."""
    # Shift before dividing: logits / a tiny temperature (5e-324 is valid) would overflow
    # to inf and the softmax to NaN; shifted, they go to -inf and the draw to the argmax.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        x = (x - x.max()) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max()
    # exp takes ~6x longer on arguments whose result underflows, -inf included (masked
    # tokens, a low temperature's tail): exponentiate a floored copy, then zero what was
    # below the floor (a probability under 1e-304).
    probs = np.exp(np.maximum(x, EXP_FLOOR))
    probs *= x > EXP_FLOOR
    probs /= probs.sum()
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    # Sort only the head: the nucleus rarely needs more than a few hundred tokens.
    vocab = probs.shape[0]
    k = min(vocab, 1024)
    while True:
        head = np.argpartition(-probs, k - 1)[:k] if k < vocab else np.arange(vocab)
        order = head[np.argsort(-probs[head], kind="stable")]
        sorted_probs = probs[order]
        if sorted_probs.sum() >= top_p or k == vocab:
            break
        k = min(vocab, k * 8)
    before = np.cumsum(sorted_probs) - sorted_probs  # mass strictly above each token
    keep = order[before < top_p]
    if keep.size == 0:
        keep = order[:1]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def sample_rows(logits: np.ndarray, states: Sequence[SampleState],
                allowed: Sequence[np.ndarray | None] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` [N, V] (float32), row i sampled with states[i] and
    restricted to the tokens ``allowed[i]`` (bool [V]; None: any). Log-probabilities are
    the model's, before any mask."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for i, (row, state) in enumerate(zip(logits, states)):
        p = state.params
        mask = None if allowed is None else allowed[i]
        plain = not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                     or state.num_output < p.min_tokens)
        if plain and p.greedy:
            # The argmax of the allowed logits, branch-free in float32: subtracting the
            # largest float32 from the rest takes 0.03 ms a row at a 49k vocabulary, where
            # np.where on a mask takes 0.2 ms and process_logits' float64 copy 0.6 ms.
            x = row if mask is None else row - _FLOAT32_MAX * ~mask
        else:
            x = process_logits(row, state, mask)
        if p.greedy:
            token = int(np.argmax(x))
        else:
            token = _draw(sampling_distribution(x, p), state.rng)
        tokens.append(token)
        logprobs.append(_logprobs(row, token, p.logprobs) if p.logprobs is not None else None)
        state.record(token)
    return tokens, logprobs


def _logprobs(row: np.ndarray, token: int, top: int) -> TokenLogprobs:
    x = row.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best = np.argpartition(-x, top)[:top] if top else np.zeros(0, dtype=np.int64)
    best = best[np.argsort(-x[best], kind="stable")]
    return TokenLogprobs(token, float(x[token] - lse), tuple((int(t), float(x[t] - lse)) for t in best))


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return min(int(np.searchsorted(cdf, u, side="right")), probs.shape[0] - 1)
