"""The batch-1 decode roofline: a decode step must stream every weight it uses (and the
sequence's KV) from memory once, so tokens/s <= bandwidth / bytes read per token.

Bandwidth is measured, not taken from a data sheet: the best of several passes of
threads summing disjoint slices of an array far larger than the caches (a read stream,
like a GEMV's weights).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from kiln.runtime.artifact import Manifest

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_POSITION_TABLES = ("rope_cos", "rope_sin")  # [context, head_dim / 2], see compiler/models/llama.py


def read_bandwidth(mib: int = 512, passes: int = 5) -> float:
    """Sustained read bandwidth in bytes/s over ``mib`` MiB, best over thread counts."""
    data = np.ones(mib * 2**20 // 4, dtype=np.float32)
    cpus = len(os.sched_getaffinity(0))
    best = 0.0
    for threads in sorted({1, cpus, 2 * cpus}):
        parts = np.array_split(data, threads)
        for _ in range(passes):
            workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]  # np.sum drops the GIL
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, data.nbytes / (time.perf_counter() - start))
    return best


def bytes_per_token(manifest: Manifest, context: int) -> int:
    """Bytes one batch-1 decode step must read: every parameter once, except tables a
    step gathers one row of (the RoPE cos / sin tables by position, and an embedding
    table that is not also the LM head), plus the K and V of ``context`` earlier tokens
    in every layer."""
    m = manifest.model
    weights = 0
    for p in manifest.params:
        nbytes = p.nbytes
        if p.name in _POSITION_TABLES:
            nbytes //= p.shape[0]  # one row of each table
        elif p.name.startswith("model.embed_tokens.") and not m.tie_word_embeddings:
            # One row of the table (or of its scales), however it is laid out: float32
            # panels [V / 32, H, 32] hold V rows too.
            nbytes //= m.vocab_size
        weights += nbytes
    kv_dtype = manifest.kv_cache.get("dtype", "float32")
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * context * _DTYPE_BYTES.get(kv_dtype, 4)
    return weights + kv
