"""MatMul and Gemm. A weight stored ``[N, K]`` and transposed in the graph stays ``[N, K]``:
FuseOps folds the ``permute_dims`` into the matmul kernel (an "NT" matmul whose reduction
axis is contiguous in memory), so no transposed copy is ever materialized."""

from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from ..context import attr
from ..registry import converter
from . import quantized


@converter("MatMul")
def matmul(ctx, node, inputs):
    fused = quantized.fused_matmul(ctx, node, inputs)
    if fused is not None:
        return fused
    return R.matmul(inputs[0], inputs[1])


@converter("Gemm")
def gemm(ctx, node, inputs):
    a, b = inputs[0], inputs[1]
    plain = attr(node, "alpha", 1.0) == 1.0 and (len(inputs) < 3 or inputs[2] is None)
    if plain and attr(node, "transB", 0) and not attr(node, "transA", 0):
        fused = quantized.fused_matmul(ctx, node, inputs, transpose_b=True)  # an LM head's stored weight
        if fused is not None:
            return fused
    if attr(node, "transA", 0):
        a = R.permute_dims(a)
    if attr(node, "transB", 0):
        b = R.permute_dims(b)
    out = R.matmul(a, b)
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    if alpha != 1.0:
        out = R.multiply(out, relax.const(alpha, "float32"))
    if len(inputs) > 2 and inputs[2] is not None:
        c = inputs[2] if beta == 1.0 else R.multiply(inputs[2], relax.const(beta, "float32"))
        out = R.add(out, c)
    return out
