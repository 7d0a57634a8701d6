"""Sampling parameters (validated once, at the boundary) and the numpy sampler.

Every random draw comes from the request's own ``numpy.random.Generator`` seeded from
``seed``, so a seeded request produces the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature == 0`` is greedy (argmax)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidRequestError("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **overrides) -> "SamplingParams":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidRequestError(unknown[0], f"unknown sampling option (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **overrides)


def _check_int(field: str, value, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(field, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(field, f"must be <= {high}, got {value}")


def _check_float(field: str, value, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    if not np.isfinite(value):
        raise InvalidRequestError(field, f"must be finite, got {value}")
    if (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(field, f"must be in {bracket}{low}, {high}], got {value}")


def make_generator(seed: int | None) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from ``logits`` [V] (float32)."""
    if params.greedy:
        return int(np.argmax(logits))
    return int(_draw(sampling_distribution(logits, params), rng))


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities [V] (float64) that a non-greedy draw uses: softmax of
    logits / temperature, restricted to the top-k, then to the smallest nucleus whose
    mass reaches top_p, renormalized."""
    x = logits.astype(np.float64) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    x -= x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs  # mass strictly above each token
        keep = before < params.top_p
        keep[0] = True
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return min(int(np.searchsorted(cdf, u, side="right")), probs.shape[0] - 1)
