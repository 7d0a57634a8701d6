"""Teacher-forced quality of an artifact on a fixed text: perplexity, and top-1 agreement
with a reference (the float32 build of the same model). Used by the quantization quality
gate (tests) and ``kiln bench``.

    logits = teacher_forced_logits(engine, ids)     # [T - 1, V]: row t predicts ids[t + 1]
    ppl = perplexity(logits, ids)
    agree = top1_agreement(logits, reference_logits)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .executor import CacheConfig, Chunk


def teacher_forced_logits(engine, ids: Sequence[int], chunk: int | None = None) -> np.ndarray:
    """Prefill of ``ids`` with logits at every position but the last: [T - 1, V]. In one
    piece, or in ``chunk``-token pieces: each then attends over the earlier pieces as the
    cache stores them (its paged path), as a served request's later steps do."""
    ids = tuple(int(t) for t in ids)
    if len(ids) < 2:
        raise ValueError("need at least two tokens")
    n = len(ids) - 1
    chunk = chunk or n
    ex = engine._executor  # noqa: SLF001  (the engine's own cache is not involved)
    cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=len(ids) + ex.page_size,
                                        prefill_chunk_size=chunk, page_size=ex.page_size))
    cache.add(0)
    try:
        return np.concatenate([ex.forward(cache, [Chunk(0, ids[i:min(i + chunk, n)], i,
                                                        tuple(range(min(chunk, n - i))))])
                               for i in range(0, n, chunk)])
    finally:
        cache.remove(0)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood of ids[1:]) given logits [T - 1, V]."""
    targets = np.asarray(ids[1:len(logits) + 1])
    nll = -_log_softmax(logits)[np.arange(len(targets)), targets]
    return float(np.exp(nll.mean()))


def top1_agreement(logits: np.ndarray, reference: np.ndarray) -> float:
    """Fraction of positions where both predict the same next token."""
    return float((logits.argmax(axis=-1) == reference.argmax(axis=-1)).mean())
