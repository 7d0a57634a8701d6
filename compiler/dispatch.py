"""The manifest's ``Dispatch``: which compiled function the runtime runs for a step,
chosen from how the kernels were built."""

from __future__ import annotations

from kiln.runtime.artifact import Dispatch
from kiln.runtime.quantization import QuantConfig

from .lower.buckets import static_decode_batches, static_prefill_tokens
from .targets import TargetSpec

# The largest decode batch ``decode`` still runs, by weight storage, on CPU. Its GEMVs
# dequantize each weight vector once per tile of four sequences (padded row tiles,
# lower/quant_weights.py); ``prefill``'s GEMMs dequantize one tile of weight rows once for
# all of them. Measured with ``python -m kiln.bench.dispatch ARTIFACT --batch 2,4,8,16``
# (SmolLM2-135M, 2-core Zen 4, 128-token contexts, decode vs prefill tok/s):
#   int8  B=4 279 vs 163, B=8 286 vs 225, B=16 315 vs 299   (blocks of 32)
#   int4  B=4 310 vs 197, B=8 318 vs 274, B=16 333 vs 339   (asymmetric blocks of 32)
#   fp16  B=8 168 vs 165, B=16 208 vs 221 (one row at a time, before the row tiles)
# float32 weights have nothing to dequantize, and both routes read them as panels in the
# same padded row tiles (4 rows in decode, 8 in prefill): B=4 221 vs 200, B=16 333-372 vs
# 248-273; ``decode`` keeps them all.
_CPU_DECODE_MAX_BATCH = {"float": None, "fp16": 8, "int8": 16, "int4": 8}
# With int8 activations both routes run the same dot-product kernels (nothing is
# dequantized per row); decode skips the ragged bookkeeping: W4A8 B=16 606 vs 585 tok/s.
_CPU_INT8_ACTIVATIONS_DECODE_MAX_BATCH = 16


def choose_dispatch(target: TargetSpec, quant: QuantConfig, context_length: int) -> Dispatch:
    static = {"static_decode": static_decode_batches(target), "static_prefill": static_prefill_tokens(target, context_length)}
    if target.kind != "llvm":
        # dlight's GPU GEMV rules schedule small batches themselves; not measured on a GPU.
        return Dispatch(**static)
    limit = (_CPU_INT8_ACTIVATIONS_DECODE_MAX_BATCH if quant.activations == "int8"
             else _CPU_DECODE_MAX_BATCH[quant.scheme.kind])
    return Dispatch(decode_max_batch=limit, **static)
