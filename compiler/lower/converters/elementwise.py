"""Element-wise ONNX ops with numpy broadcasting."""

from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from ..context import attr, relax_dtype
from ..registry import converter
from . import quantized

import onnx_ir as ir

_BINARY = {"Add": R.add, "Sub": R.subtract, "Mul": R.multiply, "Div": R.divide, "Pow": R.power}
_UNARY = {"Sigmoid": R.sigmoid, "Neg": R.negative, "Exp": R.exp, "Sqrt": R.sqrt, "Tanh": R.tanh,
          "Reciprocal": lambda x: R.divide(relax.const(1.0, x.ty.dtype), x)}


@converter(*_BINARY)
def binary(ctx, node, inputs):
    return _BINARY[node.op_type](inputs[0], inputs[1])


@converter(*_UNARY)
def unary(ctx, node, inputs):
    return _UNARY[node.op_type](inputs[0])


@converter("Cast")
def cast(ctx, node, inputs):
    weight = quantized.record(ctx, node, inputs)  # Cast(float16 weight) is fp16 weight storage
    if weight is not None:
        return weight
    return R.astype(inputs[0], relax_dtype(ir.DataType(attr(node, "to"))))


@converter("Identity")
def identity(ctx, node, inputs):
    return inputs[0]
