"""One timed model step at a time, through a chosen compiled function: what ``python -m
kiln.bench.dispatch`` and ``kiln tune``'s step gate (``compiler/tune/step_timer.py``)
measure. Runtime only (numpy and ``kiln.runtime``), so the gate's process can block the
compiler, torch and onnx while it times.

Each driver owns its KV cache and sequences; ``step(via)`` runs one forward through the
function ``via`` (None: the route the manifest picks) and returns its seconds, timing
the forward only, not making its tokens or resetting the cache.
"""

from __future__ import annotations

import time

from kiln.runtime.executor import CacheConfig, Chunk, PagedExecutor


def _timed(ex: PagedExecutor, cache, chunks, via: str | None) -> float:
    start = time.perf_counter()
    ex.forward(cache, chunks, via=via)
    return time.perf_counter() - start


class DecodeSequences:
    """``batch`` sequences each holding ~``context`` random tokens; every step decodes one
    more token for each of them (the cache grows by one token per step, as in serving).
    ``steps``: how many steps will be taken (sizes the cache)."""

    def __init__(self, ex: PagedExecutor, batch: int, context: int, steps: int, rng):
        self.ex, self.batch, self.rng = ex, batch, rng
        self.vocab = ex.manifest.model.vocab_size
        # The positions must stay inside the model's context (its RoPE tables end there).
        self.position = max(1, min(context, ex.manifest.model.context_length - steps - 1))
        self.cache = ex.create_cache(CacheConfig(
            max_batch_size=batch, max_total_tokens=batch * (self.position + steps + ex.page_size),
            prefill_chunk_size=self.position, page_size=ex.page_size))
        for s in range(batch):
            self.cache.add(s)
            ex.forward(self.cache, [Chunk(s, tuple(rng.integers(0, self.vocab, self.position).tolist()), 0)])

    def step(self, via: str | None) -> float:
        chunks = [Chunk(s, (int(self.rng.integers(0, self.vocab)),), self.position) for s in range(self.batch)]
        elapsed = _timed(self.ex, self.cache, chunks, via)
        self.position += 1
        return elapsed


class PrefillPrompt:
    """The prefill of a fresh ``tokens``-token random prompt (one sequence; its tokens are
    popped after each step, so every step starts from an empty sequence)."""

    def __init__(self, ex: PagedExecutor, tokens: int, rng):
        self.ex, self.tokens, self.rng = ex, tokens, rng
        self.vocab = ex.manifest.model.vocab_size
        self.cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=tokens + ex.page_size,
                                                 prefill_chunk_size=tokens, page_size=ex.page_size))
        self.cache.add(0)

    def step(self, via: str | None) -> float:
        chunk = Chunk(0, tuple(self.rng.integers(0, self.vocab, self.tokens).tolist()), 0)
        elapsed = _timed(self.ex, self.cache, [chunk], via)
        self.cache.popn(0, self.tokens)
        return elapsed
