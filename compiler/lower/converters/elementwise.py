"""Element-wise ONNX ops with numpy broadcasting."""

from __future__ import annotations

from tvm import relax, te, tirx, topi
from tvm.relax import op as R

from ..context import attr, relax_dtype
from ..registry import converter
from . import quantized

import onnx_ir as ir

_BINARY = {"Add": R.add, "Sub": R.subtract, "Mul": R.multiply, "Div": R.divide, "Pow": R.power}
_UNARY = {"Neg": R.negative, "Exp": R.exp, "Sqrt": R.sqrt, "Tanh": R.tanh,
          "Reciprocal": lambda x: R.divide(relax.const(1.0, x.ty.dtype), x)}


def _sigmoid_te(x):
    """1 / (1 + e^-x) with TVM's polynomial ``fast_exp`` (relative error ~3e-7): the
    ``exp`` intrinsic compiles to one scalar ``expf`` call per element on CPUs (no vector
    math library), which made SiLU cost as much as a projection in prefill."""
    e = topi.fast_exp(topi.negative(x))
    one = tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: one / (one + e(*i)), name="sigmoid")


@converter(*_BINARY)
def binary(ctx, node, inputs):
    return _BINARY[node.op_type](inputs[0], inputs[1])


@converter(*_UNARY)
def unary(ctx, node, inputs):
    return _UNARY[node.op_type](inputs[0])


@converter("Sigmoid")
def sigmoid(ctx, node, inputs):
    (x,) = inputs
    if x.ty.dtype != "float32":
        return R.sigmoid(x)
    # Element-wise, so FuseOps folds it into the producing matmul's epilogue (SiLU).
    return ctx.bb.emit_te(_sigmoid_te, x, primfunc_name_hint="sigmoid", primfunc_attrs={"op_pattern": 0})


@converter("Cast")
def cast(ctx, node, inputs):
    weight = quantized.record(ctx, node, inputs)  # Cast(float16 weight) is fp16 weight storage
    if weight is not None:
        return weight
    return R.astype(inputs[0], relax_dtype(ir.DataType(attr(node, "to"))))


@converter("Identity")
def identity(ctx, node, inputs):
    return inputs[0]
