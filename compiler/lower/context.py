"""What a converter sees while one ONNX graph becomes one Relax function."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from tvm import relax, tirx


def relax_dtype(dtype: ir.DataType) -> str:
    """onnx-ir element type -> TVM dtype string."""
    special = {ir.DataType.BFLOAT16: "bfloat16", ir.DataType.INT4: "int4", ir.DataType.UINT4: "uint4",
               ir.DataType.BOOL: "bool"}
    if dtype in special:
        return special[dtype]
    return str(np.dtype(dtype.numpy()))


@dataclass
class ConvertContext:
    bb: relax.BlockBuilder
    # Symbolic dims of this function, by ONNX dim_param name ("batch", "seq", "past"); a
    # static bucket maps some to constants.
    dims: dict[str, tirx.Var | tirx.IntImm] = field(default_factory=dict)
    # Values known at compile time (Constant nodes, small initializers), by value name.
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    # The paged KV cache object this function takes, when it has paged attention.
    kv_cache: relax.Var | None = None
    # How that cache stores K / V (``kiln.runtime.kv_layout.KV_DTYPES``).
    kv_dtype: str = "float32"
    # Every converted value so far, by ONNX value name.
    values: dict[str, relax.Expr] = field(default_factory=dict)
    # Weight-only quantized weights by ONNX value name (converters/quantized.py).
    quantized: dict = field(default_factory=dict)
    # Output names of nodes an earlier converter folded: each passes its first input's
    # value through (the int4 minimum chain, converters/quantized.py).
    folded: set[str] = field(default_factory=set)
    # The function reads many tokens per sequence (prefill): each weight is reused by many
    # activation rows, so quantized matmuls dequantize weight tiles once, not per row.
    many_tokens: bool = False
    # Matmuls over a dynamic row count run in padded row tiles (CPU targets;
    # ``quant_weights.matmul_nt_te``).
    row_tiles: bool = False
    # Data names of int8 weights stored for the dot-product kernels (``ParamTable.int8_dot``).
    int8_dot: frozenset = frozenset()
    # The ISA the dot-product kernels build for (``kernels/cpu_int8_matmul.ISAS``): the
    # target's best (``TargetSpec.dot_isa``); None where the target has none.
    dot_isa: str | None = None
    # Activations quantized by a QuantizeActivations node, by its output name: [x, (xq, xs, xc) once emitted].
    int8_activations: dict = field(default_factory=dict)

    def dim(self, name: str) -> tirx.Var | tirx.IntImm:
        if name not in self.dims:
            self.dims[name] = tirx.Var(name, "int64")
        return self.dims[name]

    def shape_of(self, value: ir.Value) -> list:
        """A graph value's declared shape with symbolic dims mapped to this function's vars."""
        if value.shape is None:
            raise ValueError(f"value {value.name!r} has no declared shape")
        out = []
        for d in value.shape:
            if isinstance(d, int):
                out.append(d)
            elif d.value is None:
                raise ValueError(f"value {value.name!r} has an anonymous dynamic dim")
            else:
                out.append(self.dim(str(d.value)))
        return out

    def constant(self, value: ir.Value | None) -> np.ndarray | None:
        """The compile-time value of an input, or None when it is only known at run time."""
        if value is None:
            return None
        if value.name in self.constants:
            return self.constants[value.name]
        if value.const_value is not None:
            return value.const_value.numpy()
        return None

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.bb.emit(expr)


def attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def shape(expr: relax.Expr) -> list:
    """The shape of an emitted Relax tensor as a list of PrimExprs."""
    return list(expr.ty.shape.values)


def dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)
