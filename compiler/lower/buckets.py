"""Static-shape buckets: copies of a dynamic function with some dims fixed.

MetaSchedule tunes only static shapes, and a kernel whose every extent is known compiles
without the loop tails of a dynamic one. ``decode_b1`` is ``decode`` at batch 1, the
latency-bound case of one user; the runtime calls it for one-sequence decode steps
(the manifest's ``dispatch.static_decode``) and ``decode`` for the rest. ``prefill_t<T>``
is ``prefill`` of exactly T tokens: with the row count known, its GEMMs tile rows as well
as columns (``schedules/cpu_matmul.py``); the runtime runs a long prefill as pieces of T
tokens and the remainder through ``prefill`` (``dispatch.static_prefill``).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.runtime.artifact import decode_bucket_name, prefill_bucket_name

from ..targets import TargetSpec

BATCH_DIM = "batch"  # the ONNX dim_param of input_ids' first axis (export/onnx_export.py)
TOKENS_DIM = "seq"  # ... and of its second axis in ``prefill``


def static_decode_batches(target: TargetSpec) -> tuple[int, ...]:
    # CUDA kernels are scheduled for dynamic batches by dlight's GPU rules; buckets there
    # wait for a GPU to tune and measure them on.
    return (1,) if target.kind == "llvm" else ()


PREFILL_BUCKETS = (128,)


def static_prefill_tokens(target: TargetSpec, context_length: int) -> tuple[int, ...]:
    # Buckets no longer than the context (a prompt of T tokens must fit).
    return tuple(t for t in PREFILL_BUCKETS if t <= context_length) if target.kind == "llvm" else ()


def with_buckets(graphs: dict[str, ir.Model], target: TargetSpec, context_length: int):
    """(graphs with every bucket added, {bucket name: {dim: size}})."""
    out, static = dict(graphs), {}
    for batch in static_decode_batches(target):
        name = decode_bucket_name(batch)
        out[name] = graphs["decode"]
        static[name] = {BATCH_DIM: batch}
    for tokens in static_prefill_tokens(target, context_length):
        name = prefill_bucket_name(tokens)
        out[name] = graphs["prefill"]
        static[name] = {BATCH_DIM: 1, TOKENS_DIM: tokens}
    return out, static
