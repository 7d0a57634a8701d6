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

from tvm import relax, te, tirx
from tvm.relax import op as R

from ...passes.quantize_activations import FUNCTION, FUNCTION_DOMAIN, FUNCTIONS, RESIDUAL_FUNCTION
from ..context import shape
from ..kernels import cpu_int4_matmul as int4_kernels
from ..kernels import cpu_int8_matmul as int8_kernels
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
    if storage.data in ctx.int8_dot:
        storage = replace(storage, int8_dot=True)
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
    activation = ctx.int8_activations.get(node.inputs[0].name)
    if ref.storage.int8_dot and activation is not None:
        return _int8_dot_matmul(ctx, activation, ref)
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


# --------------------------------------------------------------------------------------
# int8 activations (W8A8, W4A8): passes/quantize_activations.py, kernels/cpu_int{8,4}_matmul.py


@converter(FUNCTION, RESIDUAL_FUNCTION, domain=FUNCTION_DOMAIN)
def quantize_activations(ctx, node, inputs):
    """Records x for the int8 matmuls that read this node (they quantize it once, into
    int8 levels, and multiply with integer dot products) and returns the quantized value
    in float, as onnxruntime computes it, for any other reader (dead code when none)."""
    levels = FUNCTIONS[node.op_type]
    ctx.int8_activations[node.outputs[0].name] = [inputs[0], None, levels]
    y = ctx.bb.emit_te(_fake_quantize_te, inputs[0], primfunc_name_hint="quantize_activations_float")
    if levels == 2:
        residual = ctx.bb.emit_te(lambda a, b: te.compute(a.shape, lambda *i: a[i] - b[i], name="residual"),
                                  inputs[0], y, primfunc_name_hint="quantize_activations_residual")
        y = R.add(y, ctx.bb.emit_te(_fake_quantize_te, residual, primfunc_name_hint="quantize_activations_float"))
    return y


def _fake_quantize_te(x):
    *lead, k = x.shape
    block = int8_kernels.ACT_BLOCK
    r = te.reduce_axis((0, block), name="r")
    amax = te.compute((*lead, k // block), lambda *i: te.max(tirx.abs(x[(*i[:-1], i[-1] * block + r)]), axis=r),
                      name="amax")

    def value(*i):
        scale = tirx.max(amax[(*i[:-1], i[-1] // block)], tirx.const(int8_kernels.TINY, "float32")) / tirx.const(
            int8_kernels.Q_MAX, "float32")
        level = tirx.nearbyint(x[i] / scale)  # round half to even, as ONNX Round
        q_max = tirx.const(int8_kernels.Q_MAX, "float32")
        return tirx.max(tirx.min(level, q_max), -q_max) * scale

    return te.compute(x.shape, value, name="quantized")


def _kernel(ctx, name: str, make):
    """The module's GlobalVar for the prim func ``make()`` builds, added once per name."""
    mod = ctx.bb.get()
    for gv in mod.get_global_vars():
        if gv.name_hint == name:
            return gv
    return ctx.bb.add_func(make().with_attr("global_symbol", name), name)


def _int8_dot_matmul(ctx, activation: list, ref: QuantizedRef) -> relax.Expr:
    """x [..., K] @ W.T as int8 dot products: x quantized once per activation (the levels,
    scales and offsets kept for its other matmuls), then one dot-product kernel per weight
    (int8 or int4) for the target's ISA. With two levels each row of x is two rows of levels, whose outputs are summed."""
    x, _, levels = activation
    *lead, k = shape(x)
    n, k = ref.storage.rows, int(k)
    rows = 1
    for d in lead:
        rows = rows * d
    nb = k // int8_kernels.ACT_BLOCK
    if activation[1] is None:
        gv = _kernel(ctx, f"quantize_activations_int8_k{k}_l{levels}", lambda: int8_kernels.quantize_rows(k, levels))
        flat = ctx.bb.emit(R.reshape(x, [rows, k]))
        out = ctx.bb.emit(relax.call_tir(gv, [flat], out_ty=[
            relax.TensorType([rows * levels, k], "int8"), relax.TensorType([rows * levels, nb], "float32"),
            relax.TensorType([rows * levels, nb], "int32")]))
        activation[1] = tuple(ctx.bb.emit(relax.TupleGetItem(out, i)) for i in range(3))
    isa = ctx.dot_isa
    if isa is None:
        raise ValueError(f"{ref.storage.data}: int8 activations need a target with integer dot products "
                         "(AVX-512 VNNI or AVX2)")
    if ref.storage.kind == "int4":
        g = ref.storage.group_size
        gv = _kernel(ctx, f"int4_dot_matmul_n{n}_k{k}_g{g}", lambda: int4_kernels.int4_matmul(n, k, g, isa))
    else:
        gv = _kernel(ctx, f"int8_dot_matmul_n{n}_k{k}", lambda: int8_kernels.int8_matmul(n, k, isa))
    y = ctx.bb.emit(relax.call_tir(gv, [*activation[1], *ref.args],
                                   out_ty=relax.TensorType([rows * levels, n], "float32")))
    if levels > 1:
        y = ctx.bb.emit(R.sum(R.reshape(y, [rows, levels, n]), axis=1))
    return R.reshape(y, [*lead, n])
