"""Rewrite (weight-only quantization): float32 weight initializers -> a quantized (or fp16)
copy read back through standard ONNX ``DequantizeLinear`` / ``Cast``, so onnxruntime still
runs the graph (the oracle) and the lowering sees one recognizable form per consumer.

The exported graphs hold every large weight as a float32 2-D initializer, consumed as
    projection  MatMul(x, Transpose(W [N, K], perm=[1, 0]))      N out, K in features
    LM head     Gemm(x, W [V, H], transB=1)                       alpha = beta = 1, no C
    embedding   Gather(E [V, H], input_ids, axis=0)
and a tied embedding/LM head is ONE initializer used by both the Gather and the Gemm.

After (DQ = DequantizeLinear, no zero point: every scheme is symmetric):
    projection / untied LM head: MatMul(x, DQ(Wt)) on a transposed copy Wt = W.T [K, N]
        int8   DQ(q int8 [K, N], scale f32 [N], axis=1)                   per output channel
        int4   DQ(q INT4 [K, N], scale f32 [ceil(K/G), N], axis=0, block_size=G)
        fp16   Cast(w16 [K, N], to=FLOAT)
    embedding (tied or not) and a tied LM head: the ROW form of E [V, H], stored once
        int8   DQ(q int8 [V, H], scale f32 [V], axis=0)
        int4   DQ(q INT4 [V, H], scale f32 [V, ceil(H/G)], axis=1, block_size=G)
        fp16   Cast(e16 [V, H], to=FLOAT)
      embedding  -> Gather(DQ_a, ids, axis=0)
      tied head  -> MatMul(x, Transpose(DQ_b, perm=[1, 0]))
In both forms the quantization groups run along the reduction axis (K, or H) of each
output row (N, or V), which is what the fused dequantizing kernels read contiguously.

Every consumer gets its own DQ / Cast node (the lowering fuses each into its consumer).
New initializer names derive from the weight's name (``{w}.qweight``, ``{w}.scale``,
``{w}.fp16``), so the prefill and decode graphs, which share weight names, store the same
tensors. Weights are matched by structure (producer / consumer / initializer-ness /
attributes), never by name; anything else (norm weights, biases, RoPE tables) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from kiln.runtime.quantization import QuantConfig

INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7


# --------------------------------------------------------------------------------------
# numpy quantizers (shared with tests and tools)


def quantize_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8, one scale per row: w [R, C] float -> (q int8 [R, C], scale f32 [R]).

    scale[r] = max|w[r, :]| / 127 (1.0 for an all-zero row), q = clip(round(w / scale),
    -127, 127) with round half to even (as ONNX QuantizeLinear), all in float32;
    w ~= q * scale[:, None], with |w - q * scale| <= scale / 2.
    """
    w = _float_matrix(w)
    scale = (np.abs(w).max(axis=1) / np.float32(INT8_MAX)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def quantize_int4_blocks(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per block of ``group_size`` consecutive columns of each row:
    w [R, C] float -> (q int8 [R, C] with values in [-8, 7], scale f32 [R, ceil(C / G)]).

    For each block, m is its element of largest magnitude, signed (the first one on a tie);
    scale = float16(m / -8) (rounded to a float16-representable value, kept as float32;
    1.0 when that is 0: an all-zero or tiny block), q = clip(round(w / scale), -8, 7).
    So m maps to -8 (reconstructing m up to the float16 rounding of the scale) and the
    other elements to within scale / 2, except those of sign opposite to m and magnitude
    above 7.5 |scale|, which clip to 7 (error up to |scale|). C need not be a multiple of
    G: the last block is partial (as ONNX's blocked DequantizeLinear allows). The values
    are returned as int8; ``ir.tensor(q, dtype=ir.DataType.INT4)`` packs them.
    """
    w = _float_matrix(w)
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"quantize_int4_blocks: group_size must be a positive int, got {group_size!r}")
    rows, cols = w.shape
    blocks = -(-cols // group_size)
    padded = np.zeros((rows, blocks * group_size), dtype=np.float32)  # zeros never win the max
    padded[:, :cols] = w
    grouped = padded.reshape(rows, blocks, group_size)
    peak = np.take_along_axis(grouped, np.abs(grouped).argmax(axis=2)[..., None], axis=2)[..., 0]
    with np.errstate(over="ignore"):
        scale = (peak / np.float32(INT4_MIN)).astype(np.float16).astype(np.float32)
    if not np.isfinite(scale).all():
        raise ValueError("quantize_int4_blocks: a block's scale overflows float16 (|w| > 524256)")
    scale[scale == 0] = 1.0
    expanded = np.repeat(scale, group_size, axis=1)[:, :cols]
    q = np.clip(np.rint(w / expanded), INT4_MIN, INT4_MAX).astype(np.int8)
    return q, scale


def dequantize_int8_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The inverse map of ``quantize_int8_rows``: q [R, C], scale [R] -> float32 [R, C]."""
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


def dequantize_int4_blocks(q: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """The inverse map of ``quantize_int4_blocks``: q [R, C], scale [R, ceil(C/G)] -> f32 [R, C]."""
    expanded = np.repeat(scale.astype(np.float32), group_size, axis=1)[:, :q.shape[1]]
    return q.astype(np.float32) * expanded


def _float_matrix(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize a weight with non-finite values")
    return w


# --------------------------------------------------------------------------------------
# the graph rewrite


@dataclass(frozen=True)
class _Use:
    """One quantizable consumer of a weight initializer.

    kind: "linear" (MatMul(x, Transpose(W)): ``node`` is the MatMul, ``via`` the Transpose),
    "lm_head" (Gemm(x, W, transB=1)) or "embedding" (Gather(W, ids, axis=0))."""

    kind: str
    node: ir.Node
    via: ir.Node | None = None


@dataclass(frozen=True)
class _Weight:
    """A weight initializer to quantize, the consumers to rewrite, and its stored form:
    ``row_form`` [rows, cols] = W as is, else W.T (a MatMul's B)."""

    value: ir.Value
    uses: tuple[_Use, ...]
    row_form: bool


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _is_onnx(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _classify(value: ir.Value) -> list[_Use]:
    """The consumers of ``value`` this pass knows how to rewrite (others are left alone)."""
    found = []
    for node, idx in list(value.uses()):
        if _is_onnx(node, "Transpose") and idx == 0 and tuple(_attr(node, "perm", ()) or ()) == (1, 0):
            for user, j in list(node.outputs[0].uses()):
                if _is_onnx(user, "MatMul") and j == 1:
                    found.append(_Use("linear", user, via=node))
        elif (_is_onnx(node, "Gemm") and idx == 1 and _attr(node, "transB", 0) == 1 and _attr(node, "transA", 0) == 0
              and _attr(node, "alpha", 1.0) == 1.0 and _attr(node, "beta", 1.0) == 1.0
              and (len(node.inputs) < 3 or node.inputs[2] is None)):
            found.append(_Use("lm_head", node))
        elif _is_onnx(node, "Gather") and idx == 0 and _attr(node, "axis", 0) == 0:
            found.append(_Use("embedding", node))
    return found


def _weights(graph: ir.Graph, config: QuantConfig) -> list[_Weight]:
    wanted = {"linear": True, "lm_head": config.lm_head, "embedding": config.embedding}
    weights = []
    for value in list(graph.initializers.values()):
        if (value.const_value is None or value.is_graph_input() or value.dtype != ir.DataType.FLOAT
                or value.shape is None or len(value.shape) != 2):
            continue
        uses = _classify(value)
        chosen = tuple(u for u in uses if wanted[u.kind])
        if chosen:
            # A table a Gather reads (the embedding, maybe tied to the LM head) is stored as
            # rows [V, H] so the Gather picks rows; decided from ALL its consumers, so a tied
            # table whose embedding stays float still stores its quantized LM head as rows.
            weights.append(_Weight(value, chosen, row_form=any(u.kind == "embedding" for u in uses)))
    return weights


def _initializer(graph: ir.Graph, name: str, tensor: ir.Tensor) -> ir.Value:
    value = ir.Value(name=name, const_value=tensor, shape=ir.Shape(list(tensor.shape)),
                     type=ir.TensorType(tensor.dtype))
    if name in graph.initializers:
        raise ValueError(f"quantize_weights: initializer {name!r} already exists")
    graph.register_initializer(value)
    return value


def _stored(graph: ir.Graph, weight: _Weight, config: QuantConfig) -> Callable[[str], ir.Node]:
    """Writes the weight's quantized initializers (in its form) and returns a factory of
    dequantizing nodes, one per consumer, each yielding float32 [rows, cols] of that form."""
    name = weight.value.name
    w = np.asarray(weight.value.const_value.numpy(), dtype=np.float32)
    row_form = weight.row_form
    scheme = config.scheme
    if scheme.kind == "fp16":
        data = w.astype(np.float16)
        data = _initializer(graph, f"{name}.fp16", ir.tensor(np.ascontiguousarray(data if row_form else data.T)))

        def make(node_name: str) -> ir.Node:
            return ir.Node("", "Cast", [data], attributes=[ir.AttrInt64("to", ir.DataType.FLOAT)],
                           num_outputs=1, name=node_name)
        return make

    if scheme.kind == "int8":
        q, scale = quantize_int8_rows(w)  # q [R, C], scale [R]: per row of W = per output channel
        q = q if row_form else q.T  # [K, N]: the channel is axis 1
        attrs = [ir.AttrInt64("axis", 0 if row_form else 1)]
        dtype = ir.DataType.INT8
    elif scheme.kind == "int4":
        q, scale = quantize_int4_blocks(w, scheme.group_size)  # blocks along each row's C
        if not row_form:
            q, scale = q.T, scale.T  # [K, N], [ceil(K/G), N]: blocks along axis 0
        attrs = [ir.AttrInt64("axis", 1 if row_form else 0), ir.AttrInt64("block_size", scheme.group_size)]
        dtype = ir.DataType.INT4
    else:
        raise ValueError(f"quantize_weights: no rewrite for kind {scheme.kind!r}")
    qweight = _initializer(graph, f"{name}.qweight", ir.tensor(np.ascontiguousarray(q), dtype=dtype))
    scales = _initializer(graph, f"{name}.scale", ir.tensor(np.ascontiguousarray(scale, dtype=np.float32)))

    def make(node_name: str) -> ir.Node:
        return ir.Node("", "DequantizeLinear", [qweight, scales], attributes=attrs, num_outputs=1, name=node_name)
    return make


def _rewrite(graph: ir.Graph, weight: _Weight, config: QuantConfig) -> None:
    name = weight.value.name
    rows, cols = (int(d) for d in weight.value.shape)  # W [out, in] / E [V, H]
    make = _stored(graph, weight, config)
    shape = [rows, cols] if weight.row_form else [cols, rows]
    for i, use in enumerate(weight.uses):
        dq = make(f"{name}.dequantize.{i}")
        dq.outputs[0].name = f"{name}.dequantized.{i}"
        dq.outputs[0].shape, dq.outputs[0].type = ir.Shape(shape), ir.TensorType(ir.DataType.FLOAT)
        new = [dq]
        b = dq.outputs[0]
        if use.kind != "embedding" and weight.row_form:
            # A MatMul reads B = W.T [in, out]; the row-form copy is [out, in].
            t = ir.Node("", "Transpose", [b], attributes=[ir.AttrInt64s("perm", [1, 0])], num_outputs=1,
                        name=f"{name}.transpose.{i}")
            t.outputs[0].name = f"{name}.dequantized_t.{i}"
            t.outputs[0].shape, t.outputs[0].type = ir.Shape([cols, rows]), ir.TensorType(ir.DataType.FLOAT)
            new.append(t)
            b = t.outputs[0]
        graph.insert_before(use.node, new)
        if use.kind == "linear":
            use.node.replace_input_with(1, b)
        elif use.kind == "embedding":
            use.node.replace_input_with(0, b)
        else:  # lm_head: Gemm(x, W, transB=1) == MatMul(x, W.T)
            gemm = use.node
            y = gemm.outputs[0]
            matmul = ir.Node("", "MatMul", [gemm.inputs[0], b], num_outputs=1, name=gemm.name)
            out = matmul.outputs[0]
            out.shape, out.type = y.shape, y.type
            graph.insert_before(gemm, matmul)
            y.replace_all_uses_with(out, replace_graph_outputs=True)
            graph.remove(gemm, safe=True)
            out.name, y.name = y.name, None
    # Drop what nothing reads any more: the projections' Transposes, then the float weight.
    for use in weight.uses:
        if use.via is not None and use.via.graph is graph and not use.via.outputs[0].uses() \
                and not use.via.outputs[0].is_graph_output():
            graph.remove(use.via, safe=True)
    if not weight.value.uses():
        graph.initializers.pop(name)


def quantize_weights(config: QuantConfig) -> Callable[[ir.Model], ir.Model]:
    """The pass for ``config``: rewrites an onnx-ir model in place and returns it (the
    "float" scheme returns it unchanged)."""

    def unchanged(model: ir.Model) -> ir.Model:
        return model

    if config.scheme.kind == "float":
        return unchanged

    def rewrite(model: ir.Model) -> ir.Model:
        graph = model.graph
        for weight in _weights(graph, config):
            _rewrite(graph, weight, config)
        return model

    rewrite.__name__ = f"quantize_weights_{config.scheme.name.replace('-', '_')}"
    return rewrite
