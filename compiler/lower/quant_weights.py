"""How the compiled module stores weight-only quantized weights, and the TE expressions that
read them back.

The quantize pass leaves standard ONNX: ``DequantizeLinear`` (int8 per channel, int4 per
block) or ``Cast`` (fp16) of an initializer, feeding a MatMul (directly, or through a
Transpose) or a Gather. Kiln stores every such weight as ``[rows, cols]`` with the
reduction / block axis ``cols`` contiguous, whatever its ONNX orientation:

    int8  data int8    [rows, cols]            scale float32 [rows]       w = q * s[r]
    int4  data uint8   [rows, ceil32(cols)/2]  scale float16 [rows, nb]   w = (nibble - 8) * s[r, c // G]
    fp16  data float16 [rows, cols]                                       w = float(data)

int4 nibble layout: in each group of 32 columns, byte j holds column j in its low nibble
and column j + 16 in its high nibble. A vector of 16 (or 8) consecutive columns then reads
16 (8) consecutive bytes with one shift for all lanes, instead of a byte gather.
Scales are float16-exact already (the quantize pass rounds them), so storing them as
float16 loses nothing.

``transposed``: the ONNX value is ``[cols, rows]`` (a MatMul's B = W.T); the fused kernels
read the stored ``[rows, cols]`` as an "NT" matmul and never materialize a float copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from tvm import te, tirx

INT4_GROUP = 32  # columns per nibble-layout group (see above)


@dataclass(frozen=True)
class WeightStorage:
    """One quantized weight as stored: ``kind`` int8 | int4 | fp16; ``rows`` x ``cols``
    logical; ``group_size`` int4 scale block; ``data`` / ``scale`` initializer names."""

    kind: str
    rows: int
    cols: int
    data: str
    scale: str | None = None
    group_size: int | None = None
    transposed: bool = False


def _axis(node: ir.Node, rank: int) -> int:
    a = node.attributes.get("axis")
    axis = 1 if a is None else int(a.value)
    return axis + rank if axis < 0 else axis


def storage_of(node: ir.Node) -> WeightStorage | None:
    """The storage of the weight a DequantizeLinear / Cast node dequantizes, or None when
    the node is not a weight-only dequantization of a 2-D initializer."""
    data = node.inputs[0] if node.inputs else None
    if data is None or data.const_value is None or len(data.shape or ()) != 2:
        return None
    d0, d1 = (int(d) for d in data.shape)
    found = _kind_of(node, data)
    if found is None:
        return None
    kind, scale, group_size, transposed = found
    rows, cols = (d1, d0) if transposed else (d0, d1)
    return WeightStorage(kind, rows, cols, data.name, scale, group_size, transposed)


def _kind_of(node: ir.Node, data: ir.Value) -> tuple[str, str | None, int | None, bool] | None:
    """(kind, scale name, group size, transposed) of a weight-only dequantization, or None.
    ``transposed``: the ONNX value is [cols, rows], the reduction axis first."""
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
        if data.dtype != ir.DataType.FLOAT16:
            return None
        # The pass writes a MatMul's B as W.T [K, N]; Gather / Transpose consumers read rows.
        transposed = all(c.op_type == "MatMul" and c.inputs[1] is node.outputs[0]
                         for c, _ in node.outputs[0].uses())
        return "fp16", None, None, transposed
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    scale = node.inputs[1]
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if scale is None or scale.const_value is None or zero is not None or scale.dtype != ir.DataType.FLOAT:
        return None  # Kiln's schemes are symmetric with float32 scales
    axis = _axis(node, 2)
    block = node.attributes.get("block_size")
    block = int(block.value) if block is not None else 0
    if data.dtype == ir.DataType.INT8 and block == 0 and len(scale.shape) == 1:
        # Per-channel along ``axis``: the other axis is the reduction, stored contiguous.
        return "int8", scale.name, None, axis == 1
    if data.dtype == ir.DataType.INT4 and block > 0:
        # Blocks along ``axis``: that axis is the reduction, stored contiguous.
        return "int4", scale.name, block, axis == 0
    return None


def stored_specs(storage: WeightStorage) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each stored array, by initializer name (``stored_arrays`` makes them)."""
    r, c = storage.rows, storage.cols
    if storage.kind == "fp16":
        return {storage.data: ((r, c), "float16")}
    if storage.kind == "int8":
        return {storage.data: ((r, c), "int8"), storage.scale: ((r,), "float32")}
    blocks = -(-c // storage.group_size)
    return {storage.data: ((r, -(-c // INT4_GROUP) * INT4_GROUP // 2), "uint8"),
            storage.scale: ((r, blocks), "float16")}


def weight_storages(graphs) -> dict[str, WeightStorage]:
    """Every quantized weight of the graphs, by data initializer name. The same weight
    must be stored the same way wherever it is used."""
    found: dict[str, WeightStorage] = {}
    for _, model in graphs:
        for node in model.graph:
            storage = storage_of(node) if node.op_type in ("DequantizeLinear", "Cast") else None
            if storage is None:
                continue
            previous = found.setdefault(storage.data, storage)
            if previous != storage:
                raise ValueError(f"weight {storage.data!r} is dequantized in two ways ({previous} vs {storage})")
    return found


def stored_arrays(storage: WeightStorage, data: np.ndarray, scale: np.ndarray | None) -> dict[str, np.ndarray]:
    """ONNX initializer values -> the arrays the compiled module takes, by initializer name."""
    if storage.transposed:
        data = data.T
        if scale is not None and scale.ndim == 2:
            scale = scale.T
    if storage.kind == "fp16":
        return {storage.data: np.ascontiguousarray(data, dtype=np.float16)}
    if storage.kind == "int8":
        return {storage.data: np.ascontiguousarray(data, dtype=np.int8),
                storage.scale: np.ascontiguousarray(scale, dtype=np.float32)}
    return {storage.data: pack_int4(np.asarray(data).astype(np.int8)),
            storage.scale: np.ascontiguousarray(scale, dtype=np.float16)}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q int8 [rows, cols] in [-8, 7] -> uint8 [rows, ceil32(cols) / 2] in the nibble layout."""
    rows, cols = q.shape
    padded = -(-cols // INT4_GROUP) * INT4_GROUP
    v = np.full((rows, padded), 8, dtype=np.uint8)  # pad with zeros (nibble 8)
    v[:, :cols] = (q.astype(np.int16) + 8).astype(np.uint8)
    v = v.reshape(rows, padded // INT4_GROUP, 2, INT4_GROUP // 2)
    return np.ascontiguousarray((v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(rows, padded // 2))


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """The inverse of ``pack_int4`` (tests and tools)."""
    rows = packed.shape[0]
    b = packed.reshape(rows, -1, INT4_GROUP // 2)
    v = np.stack([b & 15, b >> 4], axis=2).reshape(rows, -1)[:, :cols]
    return v.astype(np.int8) - 8


def dequant_value(storage: WeightStorage, data: te.Tensor, scale: te.Tensor | None, r, c):
    """The float32 weight at stored position (r, c), as a TE expression."""
    if storage.kind == "fp16":
        return data[r, c].astype("float32")
    if storage.kind == "int8":
        return data[r, c].astype("float32") * scale[r]
    g = INT4_GROUP
    byte = data[r, (c // g) * (g // 2) + c % (g // 2)]
    # Shifting the uint8 then widening measured faster in the whole model than widening
    # to int32 first (fewer instructions in a hot-cache microbenchmark, though).
    nibble = tirx.bitwise_and(tirx.shift_right(byte, ((c // (g // 2)) % 2 * 4).astype("uint8")),
                              tirx.const(15, "uint8"))
    return (nibble.astype("int32") - 8).astype("float32") * scale[r, c // storage.group_size].astype("float32")


def dequant_te(storage: WeightStorage):
    """TE: stored weight -> float32 in the ONNX orientation ([cols, rows] when transposed).
    Only used where a quantized weight has no fused consumer."""

    def compute(data, scale=None):
        if storage.transposed:
            return te.compute((storage.cols, storage.rows),
                              lambda c, r: dequant_value(storage, data, scale, r, c), name="dequantize")
        return te.compute((storage.rows, storage.cols),
                          lambda r, c: dequant_value(storage, data, scale, r, c), name="dequantize")

    return compute


DEQUANTIZE_W = "dequantize_w"  # the matmul kernel's weight stage (schedules/cpu_matmul.py)


def matmul_nt_te(storage: WeightStorage, staged: bool = False):
    """TE: x [..., cols] @ W.T with W the stored [rows, cols] -> [..., rows], one kernel.

    Unstaged (decode: few rows of x), the weight is dequantized inside the reduction, in
    registers: each element is read once anyway. ``staged`` (prefill: many rows), the
    weight is a separate stage ``dequantize_w`` [rows, cols] that the CPU schedule computes
    one tile of rows at a time into a small buffer reused by every row of x. No float copy
    of the whole weight is allocated either way."""

    def compute(x, data, scale=None):
        if staged:
            w = te.compute((storage.rows, storage.cols),
                           lambda r, c: dequant_value(storage, data, scale, r, c), name=DEQUANTIZE_W)
            weight = lambda r, c: w[r, c]  # noqa: E731
        else:
            weight = lambda r, c: dequant_value(storage, data, scale, r, c)  # noqa: E731
        k = te.reduce_axis((0, storage.cols), name="k")
        lead = list(x.shape[:-1])

        def body(*idx):
            return te.sum(x[(*idx[:-1], k)] * weight(idx[-1], k), axis=k)

        return te.compute((*lead, storage.rows), body, name="matmul")

    return compute


def take_rows_te(storage: WeightStorage):
    """TE: rows ``ids`` of the stored [rows, cols] weight, dequantized -> [*ids.shape, cols]."""

    def compute(data, ids, scale=None):
        def body(*idx):
            return dequant_value(storage, data, scale, ids[idx[:-1]].astype("int32"), idx[-1])

        return te.compute((*ids.shape, storage.cols), body, name="take")

    return compute
