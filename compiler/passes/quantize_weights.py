"""Rewrite (weight-only quantization): float32 weight initializers -> a quantized (or fp16)
copy read back through standard ONNX ``DequantizeLinear`` / ``Cast``, so onnxruntime still
runs the graph (the oracle) and the lowering sees one recognizable form per consumer.

The exported graphs hold every large weight as a float32 2-D initializer, consumed as
    projection  MatMul(x, Transpose(W [N, K], perm=[1, 0]))      N out, K in features
    LM head     Gemm(x, W [V, H], transB=1)                       alpha = beta = 1, no C
    embedding   Gather(E [V, H], input_ids, axis=0)
and a tied embedding/LM head is ONE initializer used by both the Gather and the Gemm.

After (DQ = DequantizeLinear; blocks of G consecutive input features of each output row):
    projection: MatMul(x, B) on a transposed copy Wt = W.T [K, N], nb = ceil(K / G)
        int8   B = DQ(q INT8 [K, N], scale f32 [nb, N], axis=0, block_size=G)     symmetric
        int4   B = DQ(q UINT4 [Kp, N], scale [nb, N], axis=0, block_size=G)       asymmetric:
               -> Reshape [nb, G, N] -> Add(minimum f32 [nb, 1, N]) -> Reshape [Kp, N]
               (-> Slice [:K] when K % G, q zero-padded to Kp = nb * G rows)
        fp16   B = Cast(w16 [K, N], to=FLOAT)
    embedding (tied or not) and any LM head: the scheme's ``table`` (int8 for int4),
    a tied table in the ROW form of E [V, H], stored once
        int8   DQ(q INT8 [V, H], scale f32 [V, ceil(H/G)], axis=1, block_size=G)
        fp16   Cast(e16 [V, H], to=FLOAT)
      embedding  -> Gather(DQ_a, ids, axis=0)
      tied head  -> MatMul(x, Transpose(DQ_b, perm=[1, 0]))
In both forms the quantization groups run along the reduction axis (K, or H) of each
output row (N, or V), which is what the fused dequantizing kernels read contiguously.

Every consumer gets its own DQ / Cast chain (the lowering fuses each into its consumer).
New initializer names derive from the weight's name (``{w}.qweight``, ``{w}.scale``,
``{w}.minimum``, ``{w}.fp16``, small shape constants), so the prefill and decode graphs,
which share weight names, store the same tensors. Weights are matched by structure (producer / consumer / initializer-ness /
attributes), never by name; anything else (norm weights, biases, RoPE tables) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from kiln.runtime.quantization import QuantConfig, QuantScheme

INT8_MAX = 127
UINT4_MAX = 15


# --------------------------------------------------------------------------------------
# numpy quantizers (shared with tests and tools)


def _blocks(w: np.ndarray, group_size: int, who: str) -> np.ndarray:
    """w [R, C] -> [R, ceil(C / G), G], the last block padded with the row's last value
    (which never changes a block's extremes)."""
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"{who}: group_size must be a positive int, got {group_size!r}")
    rows, cols = w.shape
    blocks = -(-cols // group_size)
    padded = np.pad(w, ((0, 0), (0, blocks * group_size - cols)), mode="edge")
    return padded.reshape(rows, blocks, group_size)


def _float16_exact(x: np.ndarray, who: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        y = x.astype(np.float16).astype(np.float32)
    if not np.isfinite(y).all():
        raise ValueError(f"{who}: a block's scale or minimum overflows float16 (|w| > 65504)")
    return y


def _expand(per_block: np.ndarray, group_size: int, cols: int) -> np.ndarray:
    """[R, nb] -> [R, C]: each block's value on each of its columns."""
    return np.repeat(per_block.astype(np.float32), group_size, axis=1)[:, :cols]


def quantize_int8_blocks(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per block of ``group_size`` consecutive columns of each row (GGUF's
    Q8_0 when G = 32): w [R, C] -> (q int8 [R, C], scale f32 [R, ceil(C / G)]).

    scale = float16(max|block| / 127) (float16-exact, kept as float32; 1.0 for an all-zero
    block), q = clip(round(w / scale), -127, 127) with round half to even (as ONNX
    QuantizeLinear); w ~= q * scale with |w - q * scale| <= scale / 2 (the float16
    rounding of the scale may clip the peak by a hair more). C need not be a multiple of G:
    the last block is partial, as ONNX's blocked DequantizeLinear allows.
    """
    w = _float_matrix(w)
    grouped = _blocks(w, group_size, "quantize_int8_blocks")
    scale = _float16_exact(np.abs(grouped).max(axis=2) / np.float32(INT8_MAX), "quantize_int8_blocks")
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / _expand(scale, group_size, w.shape[1])), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


UINT4_REFINE_STEPS = 4


def quantize_uint4_blocks(w: np.ndarray, group_size: int,
                          refine_steps: int = UINT4_REFINE_STEPS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit per block of ``group_size`` consecutive columns of each row (GGUF's
    Q4_1 when G = 32): w [R, C] -> (q uint8 [R, C] in [0, 15], scale f32 [R, nb],
    minimum f32 [R, nb]) with nb = ceil(C / G) and w ~= minimum + q * scale.

    Start (round to nearest over the block's range): minimum = min(block) rounded down to
    float16, scale = float16((max(block) - minimum) / 15) (1.0 when 0), q = clip(round(
    (w - minimum) / scale), 0, 15); every element within scale / 2 of its value. Unlike a
    symmetric code, no level is wasted on the side of zero a block does not reach.
    Then ``refine_steps`` rounds of alternating least squares, as llama.cpp's k-quants do:
    the (minimum, scale) that best fit the current q (closed form), rounded to float16,
    then q re-rounded; a block keeps the new values only when its squared error drops, so
    the result is never worse than the start (RMS error -7% with G = 32, -5% with G = 128 on
    Gaussian weights; on the default model at G = 128, perplexity +61% instead of +76% of
    float32). A weight already on a 4-bit grid (a dequantized Q4_1 GGUF) fits exactly at
    the start and comes back as it was.
    """
    w = _float_matrix(w)
    rows, cols = w.shape
    grouped = _blocks(w, group_size, "quantize_uint4_blocks")  # [R, nb, G]
    valid = (np.arange(grouped.shape[1] * group_size) < cols).reshape(1, -1, group_size)
    low = grouped.min(axis=2)
    minimum = _float16_exact(low, "quantize_uint4_blocks")
    # Rounded down, not to nearest: every w - minimum >= 0, so the scale is never negative
    # (a constant block) and nothing clips at 0. A minimum already in float16 stays.
    above = minimum > low
    minimum[above] = np.nextafter(minimum[above].astype(np.float16), np.float16(-np.inf)).astype(np.float32)
    scale = _float16_exact((grouped.max(axis=2) - minimum) / np.float32(UINT4_MAX), "quantize_uint4_blocks")
    scale[scale == 0] = 1.0

    def codes(scale, minimum):
        return np.clip(np.rint((grouped - minimum[..., None]) / scale[..., None]), 0, UINT4_MAX)

    def error(q, scale, minimum):  # [R, nb]: squared error over the block's real columns
        return (np.square(grouped - minimum[..., None] - q * scale[..., None]) * valid).sum(axis=2)

    q = codes(scale, minimum)
    err = error(q, scale, minimum)
    n, sw = valid.sum(axis=2), (grouped * valid).sum(axis=2)
    for _ in range(refine_steps):
        # argmin over (m, s) of sum (w - m - q s)^2 for fixed q: a line fit per block.
        qv = q * valid
        sq, sqq, sqw = qv.sum(axis=2), (qv * q).sum(axis=2), (qv * grouped).sum(axis=2)
        det = n * sqq - sq * sq
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s_fit = (n * sqw - sq * sw) / det
            m_fit = (sw - s_fit * sq) / n
            s_new = s_fit.astype(np.float16).astype(np.float32)
            m_new = m_fit.astype(np.float16).astype(np.float32)
        ok = (det > 0) & np.isfinite(s_new) & np.isfinite(m_new) & (s_new > 0)
        s_new, m_new = np.where(ok, s_new, scale), np.where(ok, m_new, minimum)
        q_new = codes(s_new, m_new)
        err_new = error(q_new, s_new, m_new)
        better = ok & (err_new < err)
        if not better.any():
            break
        scale, minimum, err = np.where(better, s_new, scale), np.where(better, m_new, minimum), np.where(better, err_new, err)
        q = np.where(better[..., None], q_new, q)
    q = q.reshape(rows, -1)[:, :cols].astype(np.uint8)
    return q, scale.astype(np.float32), minimum.astype(np.float32)


def dequantize_int8_blocks(q: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """The inverse map of ``quantize_int8_blocks``: q [R, C], scale [R, nb] -> float32 [R, C]."""
    return q.astype(np.float32) * _expand(scale, group_size, q.shape[1])


def dequantize_uint4_blocks(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, group_size: int) -> np.ndarray:
    """The inverse map of ``quantize_uint4_blocks`` -> float32 [R, C]."""
    cols = q.shape[1]
    return _expand(minimum, group_size, cols) + q.astype(np.float32) * _expand(scale, group_size, cols)


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


def _scheme(weight: _Weight, config: QuantConfig) -> QuantScheme:
    """The embedding table and the LM head take the scheme's ``table`` (int8 for int4)."""
    if weight.row_form or any(u.kind != "linear" for u in weight.uses):
        return config.scheme.table
    return config.scheme


def _node(op: str, inputs, name: str, shape: list[int], dtype=ir.DataType.FLOAT, attrs=()) -> ir.Node:
    node = ir.Node("", op, inputs, attributes=list(attrs), num_outputs=1, name=name)
    node.outputs[0].name = name
    node.outputs[0].shape, node.outputs[0].type = ir.Shape(shape), ir.TensorType(dtype)
    return node


def _stored(graph: ir.Graph, weight: _Weight, scheme: QuantScheme) -> Callable[[str], list[ir.Node]]:
    """Writes the weight's quantized initializers (in its form) and returns a factory of
    dequantizing nodes, one chain per consumer, the last yielding float32 [rows, cols] of
    that form."""
    name = weight.value.name
    w = np.asarray(weight.value.const_value.numpy(), dtype=np.float32)
    row_form = weight.row_form
    shape = list(w.shape) if row_form else [w.shape[1], w.shape[0]]
    if scheme.kind == "fp16":
        data = w.astype(np.float16)
        data = _initializer(graph, f"{name}.fp16", ir.tensor(np.ascontiguousarray(data if row_form else data.T)))
        return lambda prefix: [_node("Cast", [data], f"{prefix}.cast", shape, attrs=[ir.AttrInt64("to", ir.DataType.FLOAT)])]

    group = scheme.group_size
    # Blocks run along each row of W [R, C] (the reduction axis); the transposed form
    # [C, R] (a MatMul's B) has them along axis 0.
    attrs = [ir.AttrInt64("axis", 1 if row_form else 0), ir.AttrInt64("block_size", group)]
    if scheme.kind == "int8":
        q, scale = quantize_int8_blocks(w, group)
        if not row_form:
            q, scale = q.T, scale.T  # [K, N], [nb, N]
        qweight = _initializer(graph, f"{name}.qweight", ir.tensor(np.ascontiguousarray(q), dtype=ir.DataType.INT8))
        scales = _initializer(graph, f"{name}.scale", ir.tensor(np.ascontiguousarray(scale)))
        return lambda prefix: [_node("DequantizeLinear", [qweight, scales], f"{prefix}.dequantize", shape, attrs=attrs)]
    if scheme.kind != "int4" or row_form:
        raise ValueError(f"quantize_weights: no rewrite for kind {scheme.kind!r} (row form: {row_form})")

    # w = minimum + q * scale: ONNX's DequantizeLinear takes only integer zero points, so
    # the float minimum is added per block after it:
    #   DQ(q UINT4 [Kp, N], scale [nb, N], axis 0, block G) -> Reshape [nb, G, N]
    #   -> Add(minimum [nb, 1, N]) -> Reshape [Kp, N] (-> Slice [:K] when K % G: q is
    #   zero-padded to Kp = nb * G rows, as the reshape needs whole blocks)
    q, scale, minimum = quantize_uint4_blocks(w, group)
    k, n = shape
    blocks = scale.shape[1]
    kp = blocks * group
    qt = np.zeros((kp, n), dtype=np.uint8)
    qt[:k] = q.T
    qweight = _initializer(graph, f"{name}.qweight", ir.tensor(qt, dtype=ir.DataType.UINT4))
    scales = _initializer(graph, f"{name}.scale", ir.tensor(np.ascontiguousarray(scale.T)))
    minima = _initializer(graph, f"{name}.minimum", ir.tensor(np.ascontiguousarray(minimum.T)[:, None, :]))
    blocked = _initializer(graph, f"{name}.blocked_shape", ir.tensor(np.array([blocks, group, n], np.int64)))
    flat = _initializer(graph, f"{name}.padded_shape", ir.tensor(np.array([kp, n], np.int64)))
    if kp != k:
        start, end, axes = (_initializer(graph, f"{name}.slice_{s}", ir.tensor(np.array([v], np.int64)))
                            for s, v in (("start", 0), ("end", k), ("axes", 0)))

    def make(prefix: str) -> list[ir.Node]:
        nodes = [_node("DequantizeLinear", [qweight, scales], f"{prefix}.dequantize", [kp, n], attrs=attrs)]
        nodes.append(_node("Reshape", [nodes[-1].outputs[0], blocked], f"{prefix}.blocks", [blocks, group, n]))
        nodes.append(_node("Add", [nodes[-1].outputs[0], minima], f"{prefix}.offset", [blocks, group, n]))
        nodes.append(_node("Reshape", [nodes[-1].outputs[0], flat], f"{prefix}.unblocked", [kp, n]))
        if kp != k:
            nodes.append(_node("Slice", [nodes[-1].outputs[0], start, end, axes], f"{prefix}.sliced", [k, n]))
        return nodes
    return make


def _rewrite(graph: ir.Graph, weight: _Weight, config: QuantConfig) -> None:
    name = weight.value.name
    rows, cols = (int(d) for d in weight.value.shape)  # W [out, in] / E [V, H]
    make = _stored(graph, weight, _scheme(weight, config))
    for i, use in enumerate(weight.uses):
        new = make(f"{name}.dequantized.{i}")
        b = new[-1].outputs[0]
        if use.kind != "embedding" and weight.row_form:
            # A MatMul reads B = W.T [in, out]; the row-form copy is [out, in].
            new.append(_node("Transpose", [b], f"{name}.dequantized_t.{i}", [cols, rows],
                             attrs=[ir.AttrInt64s("perm", [1, 0])]))
            b = new[-1].outputs[0]
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
