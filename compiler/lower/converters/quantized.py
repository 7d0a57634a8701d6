"""Weight-only quantized weights: ``DequantizeLinear`` (and ``Cast`` from float16) of an
initializer, and the MatMul / Gather that read them.

The dequantizing node records the weight in ``ctx.quantized`` (by ONNX value name; a
Transpose of it records the flipped orientation) and returns a materialized float copy
for any other consumer. A MatMul or Gather whose input is a recorded weight instead emits
one fused kernel that reads the int8 / int4 / fp16 storage directly
(``lower/quant_weights.py``), so the copy is dead code and DeadCodeElimination drops it:
no float weight is ever built, at load or at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import relax

from ..quant_weights import WeightStorage, chain_nodes, dequant_te, matmul_nt_te, storage_of, take_rows_te
from ..registry import converter


OUT_EWISE_FUSABLE = 4  # tvm relax OpPatternKind::kOutEWiseFusable


@dataclass(frozen=True)
class QuantizedRef:
    storage: WeightStorage
    args: tuple[relax.Expr, ...]  # storage.stored's params (data [, scale [, minimum]]), as the module stores them


def record(ctx, node, inputs) -> relax.Expr | None:
    """If ``node`` dequantizes a weight: record it and return its materialized float
    value (dropped later if no consumer needs it); else None.

    An int4 weight's per-block minimum is added by a chain of ONNX nodes after the
    DequantizeLinear (``quant_weights._with_minimum``): the chain is recorded at its end,
    its nodes are folded (they pass this node's value through: the materialized value
    already includes the minimum), and the kernels read the minimum directly."""
    storage = storage_of(node)
    if storage is None:
        return None
    args = [inputs[0]] + ([inputs[1]] if storage.scale is not None else [])
    if storage.minimum is not None:
        args.append(ctx.values[storage.minimum])
    ctx.folded.update(n.outputs[0].name for n in chain_nodes(node, storage))
    ctx.quantized[storage.output] = QuantizedRef(storage, tuple(args))
    return ctx.bb.emit_te(dequant_te(storage), *args, primfunc_name_hint=f"dequantize_{storage.kind}")


def record_panels(ctx, storage: WeightStorage, param: relax.Expr) -> relax.Expr:
    """A float32 weight stored as panels (``quant_weights.float_panel_storage``): recorded
    like a dequantized one (its MatMuls read the panels), and its value in the ONNX [N, K]
    form for the Transpose that reads it (dead code once the MatMuls are fused)."""
    ctx.quantized[storage.output] = QuantizedRef(storage, (param,))
    return ctx.bb.emit_te(dequant_te(storage), param, primfunc_name_hint="unpack_panels")


def flip(ctx, node) -> None:
    """A 2-D Transpose of a recorded weight is the same storage, read the other way."""
    ref = ctx.quantized.get(node.inputs[0].name)
    perm = node.attributes.get("perm")
    if ref is not None and (perm is None or list(perm.value) == [1, 0]):
        storage = replace(ref.storage, transposed=not ref.storage.transposed)
        ctx.quantized[node.outputs[0].name] = QuantizedRef(storage, ref.args)


def fused_matmul(ctx, node, inputs, transpose_b: bool = False) -> relax.Expr | None:
    """MatMul(x [..., K], W.T) with W a recorded [N, K] weight -> one dequantizing kernel.
    ``transpose_b``: the node transposes its B itself (Gemm transB=1), so B is W as is."""
    ref = ctx.quantized.get(node.inputs[1].name)
    if ref is None or ref.storage.transposed == transpose_b:
        return None
    # Pattern "out-element-wise fusable", as TVM gives its own matmuls: element-wise
    # consumers (bias, residual, SiLU * up) fuse after it, producers stay separate kernels,
    # so the kernel keeps the one-activation-read shape the CPU NT schedule expects.
    return ctx.bb.emit_te(matmul_nt_te(ref.storage, staged=ctx.many_tokens, row_tiles=ctx.row_tiles),
                          inputs[0], *ref.args,
                          primfunc_name_hint=f"{ref.storage.kind}_matmul",
                          primfunc_attrs={"op_pattern": OUT_EWISE_FUSABLE})


def fused_take(ctx, node, inputs, axis: int) -> relax.Expr | None:
    """Gather(W, ids, axis=0) with W a recorded row-form weight -> dequantized rows only."""
    ref = ctx.quantized.get(node.inputs[0].name)
    if ref is None or ref.storage.transposed or axis != 0:
        return None
    return ctx.bb.emit_te(take_rows_te(ref.storage), inputs[1], *ref.args,
                          primfunc_name_hint=f"{ref.storage.kind}_take")


@converter("DequantizeLinear")
def dequantize_linear(ctx, node, inputs):
    out = record(ctx, node, inputs)
    if out is None:
        raise ValueError("only weight-only, blocked DequantizeLinear of a 2-D initializer (int8 or uint4, "
                         "float32 scales, no zero point) is supported")
    return out
