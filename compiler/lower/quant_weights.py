"""How the compiled module stores weight-only quantized weights, and the TE expressions that
read them back.

The quantize pass (``passes/quantize_weights.py``) leaves standard ONNX: a blocked
``DequantizeLinear`` (int8; uint4 followed by the per-block minimum's
Reshape -> Add -> Reshape [-> Slice] chain) or a ``Cast`` (fp16) of an initializer,
feeding a MatMul (directly, or through a Transpose) or a Gather. Kiln stores every such
weight as ``[rows, cols]`` with the reduction / block axis ``cols`` contiguous, whatever
its ONNX orientation (nb = ceil(cols / G) blocks per row; ``data`` as it is before the
row interleaving below):

    int8  data int8    [rows, cols]            scale f16 [rows, nb]   w = q * s[r, c // G]
    int4  data uint8   [rows, ceil32(cols)/2]  scale f16 [rows, nb]   w = m[r, c // G] + nibble * s[r, c // G]
                                               minimum f16 [rows, nb] (m = 0 without one)
    fp16  data float16 [rows, cols]                                    w = float(data)

int4 nibble layout: in each group of 32 columns, byte j holds column j in its low nibble
and column j + 16 in its high nibble. A vector of 16 (or 8) consecutive columns then reads
16 (8) consecutive bytes with one shift for all lanes, instead of a byte gather.
Scales and minima are float16-exact already (the quantize pass rounds them), so storing
them as float16 loses nothing and halves their bytes.

Row interleaving: a weight whose rows split into tiles of ROW_TILE (4, the decode GEMV's
tile of output rows, ``schedules/cpu_matmul.py``) stores each tile's rows interleaved in
chunks of CHUNK (16) storage units (elements; int4: bytes): [rows / 4, 4 * units], chunk
j of row r at ``[r // 4, j * 64 + (r % 4) * 16 : ... + 16]``. The GEMV reads its four rows
16 units at a time, and interleaved those reads are one sequential stream instead of four
short ones (a 576-wide int8 row is 9 cache lines, too short for the hardware prefetcher):
a cold int8 GEMV measured 11 GB/s plain and 24-30 GB/s interleaved. Scales and minima stay
[rows, nb]. Weights whose rows or row length do not divide are stored plain.

Dot-product layouts (``int8_dot``: a weight whose MatMuls take int8 activations, on CPUs
with VNNI): int8 data uint8 [rows / 32, cols * 32] (q + 128, tiles of 32 rows by 4
columns), ``kernels/cpu_int8_matmul.py``; int4 data uint8 [rows / 32, cols * 16] (tiles of
32 rows by 8 columns, two nibbles a byte), ``kernels/cpu_int4_matmul.py``; scales (and
minima) float16 [rows / 16, nb * 16]. Other readers of the same weight (a tied
embedding's Gather) dequantize from it.

Float32 panels (CPU targets): a float32 projection weight W [N, K] (an initializer read
only as MatMul(x, Transpose(W))) is stored as panels of PANEL output rows, K-major:
``[N / PANEL, K, PANEL]``, W[n, k] at ``[n // PANEL, k, n % PANEL]``. The CPU matmuls
broadcast x[m, k] against row k of a panel, so a panel is one sequential stream for
decode GEMVs and prefill GEMMs alike (``schedules/cpu_matmul.py``: BLAS libraries pack
their B operand this way at run time; Kiln does it once, at compile time).

``transposed``: the ONNX value is ``[cols, rows]`` (a MatMul's B = W.T); the fused kernels
read the stored ``[rows, cols]`` as an "NT" matmul and never materialize a float copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import onnx_ir as ir
from tvm import te, tirx

from .kernels import cpu_int4_matmul as int4_kernels
from .kernels import cpu_int8_matmul as int8_kernels

INT4_GROUP = 32  # columns per nibble-layout group (see above)
ROW_TILE = 4  # rows interleaved in storage (see above)
CHUNK = 16  # storage units of one row per interleaved step
PANEL = 32  # output rows per float32 panel (see above): two AVX-512 vectors


@dataclass(frozen=True)
class WeightStorage:
    """One quantized weight as stored: ``kind`` int8 | int4 | fp16 | fp32 (panels); ``rows`` x ``cols``
    logical; ``group_size`` the scale block; ``data`` / ``scale`` / ``minimum``
    initializer names; ``output`` the ONNX value that is the float weight (the
    dequantizing node's, or the end of the int4 minimum chain)."""

    kind: str
    rows: int
    cols: int
    data: str
    scale: str | None = None
    group_size: int | None = None
    transposed: bool = False
    minimum: str | None = None
    # Which node's value it is, not how it is stored: two consumers of one weight differ here.
    output: str = field(default="", compare=False)
    int8_dot: bool = False  # stored for the dot-product kernels (above)

    @property
    def units(self) -> int:
        """Storage units (elements; int4: packed bytes) of one row of ``data``."""
        return -(-self.cols // INT4_GROUP) * INT4_GROUP // 2 if self.kind == "int4" else self.cols

    @property
    def tile(self) -> int:
        """Rows interleaved per tile of ``data``: ROW_TILE (fp32: PANEL), or 1 (plain) when
        they do not divide."""
        if self.kind == "fp32":
            return PANEL if self.rows % PANEL == 0 else 1
        return ROW_TILE if self.rows % ROW_TILE == 0 and self.units % CHUNK == 0 else 1

    @property
    def stored(self) -> tuple[str, ...]:
        """The initializers the kernels read, in their argument order."""
        return tuple(n for n in (self.data, self.scale, self.minimum) if n is not None)


def _axis(node: ir.Node, rank: int) -> int:
    a = node.attributes.get("axis")
    axis = 1 if a is None else int(a.value)
    return axis + rank if axis < 0 else axis


def _const(value: ir.Value | None) -> np.ndarray | None:
    return None if value is None or value.const_value is None else value.const_value.numpy()


def _only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    """The single consumer of ``value`` when it is an ``op_type`` node reading it first."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node, idx = uses[0]
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") and idx == 0 else None


def storage_of(node: ir.Node) -> WeightStorage | None:
    """The storage of the weight a DequantizeLinear / Cast node dequantizes, or None when
    the node is not a weight-only dequantization of a 2-D initializer."""
    data = node.inputs[0] if node.inputs else None
    if data is None or data.const_value is None or len(data.shape or ()) != 2:
        return None
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
        if data.dtype != ir.DataType.FLOAT16:
            return None
        # The pass writes a MatMul's B as W.T [K, N]; Gather / Transpose consumers read rows.
        transposed = all(c.op_type == "MatMul" and c.inputs[1] is node.outputs[0]
                         for c, _ in node.outputs[0].uses())
        d0, d1 = (int(d) for d in data.shape)
        rows, cols = (d1, d0) if transposed else (d0, d1)
        return WeightStorage("fp16", rows, cols, data.name, transposed=transposed, output=node.outputs[0].name)
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    scale = node.inputs[1]
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if scale is None or scale.const_value is None or zero is not None or scale.dtype != ir.DataType.FLOAT:
        return None  # no integer zero point: a minimum comes as the chain below
    block = node.attributes.get("block_size")
    block = int(block.value) if block is not None else 0
    if block <= 0 or len(scale.shape) != 2:
        return None
    # Blocks along ``axis``: that axis is the reduction, stored contiguous.
    transposed = _axis(node, 2) == 0
    d0, d1 = (int(d) for d in data.shape)
    rows, cols = (d1, d0) if transposed else (d0, d1)
    if data.dtype == ir.DataType.INT8:
        return WeightStorage("int8", rows, cols, data.name, scale.name, block, transposed,
                             output=node.outputs[0].name)
    if data.dtype != ir.DataType.UINT4:
        return None
    storage = WeightStorage("int4", rows, cols, data.name, scale.name, block, transposed,
                            output=node.outputs[0].name)
    return _with_minimum(node, storage) or storage


def _with_minimum(node: ir.Node, storage: WeightStorage) -> WeightStorage | None:
    """The int4 storage with its per-block minimum when the DequantizeLinear output goes
    through the pass's chain (transposed form [Kp, N], Kp = nb * G):
    Reshape [nb, G, N] -> Add(minimum [nb, 1, N]) -> Reshape [Kp, N] [-> Slice [0:K] on
    axis 0]; the stored cols are then K. None when it does not."""
    if not storage.transposed:
        return None
    kp, n, g = storage.cols, storage.rows, storage.group_size
    nb = kp // g
    blocks = _only_use(node.outputs[0], "Reshape")
    if blocks is None or kp % g or list(_const(blocks.inputs[1]) if blocks.inputs[1] else []) != [nb, g, n]:
        return None
    add = _only_use(blocks.outputs[0], "Add")
    minimum = add.inputs[1] if add is not None else None
    m = _const(minimum)
    if m is None or minimum.dtype != ir.DataType.FLOAT or m.shape != (nb, 1, n):
        return None
    flat = _only_use(add.outputs[0], "Reshape")
    if flat is None or list(_const(flat.inputs[1]) if flat.inputs[1] else []) != [kp, n]:
        return None
    end, cols = flat.outputs[0], kp
    sliced = _only_use(end, "Slice")
    if sliced is not None:
        starts, ends, axes = (_const(v) for v in (list(sliced.inputs[1:4]) + [None] * 3)[:3])
        steps = _const(sliced.inputs[4]) if len(sliced.inputs) > 4 else None
        if (starts is None or ends is None or list(starts) != [0] or len(ends) != 1
                or (axes is not None and list(axes) not in ([0], [-2])) or (steps is not None and list(steps) != [1])
                or not kp - g < int(ends[0]) < kp):
            return None
        end, cols = sliced.outputs[0], int(ends[0])
    return WeightStorage("int4", n, cols, storage.data, storage.scale, g, True, minimum.name, end.name)


def chain_nodes(node: ir.Node, storage: WeightStorage) -> list[ir.Node]:
    """The nodes after the dequantizing ``node`` up to the one yielding ``storage.output``:
    the int4 minimum chain ``_with_minimum`` matched, or none."""
    nodes, value = [], node.outputs[0]
    while value.name != storage.output:
        (user, _), = value.uses()
        nodes.append(user)
        value = user.outputs[0]
    return nodes


def stored_specs(storage: WeightStorage) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each stored array, by initializer name (``stored_arrays`` makes them)."""
    r, c = storage.rows, storage.cols
    t = storage.tile
    if storage.int8_dot:
        nb, lanes, tile = c // storage.group_size, int8_kernels.LANES, int8_kernels.WEIGHT_TILE
        per_row = c * (lanes if storage.kind == "int4" else tile)
        specs = {storage.data: ((r // tile, per_row), "uint8"), storage.scale: ((r // lanes, nb * lanes), "float16")}
        if storage.minimum is not None:
            specs[storage.minimum] = ((r // lanes, nb * lanes), "float16")
        return specs
    if storage.kind == "fp32":
        return {storage.data: ((r // t, c, t) if t > 1 else (r, c), "float32")}
    if storage.kind == "fp16":
        return {storage.data: ((r // t, c * t), "float16")}
    blocks = (r, -(-c // storage.group_size))
    specs = {storage.data: ((r // t, storage.units * t), "int8" if storage.kind == "int8" else "uint8")}
    specs[storage.scale] = (blocks, "float16")
    if storage.minimum is not None:
        specs[storage.minimum] = (blocks, "float16")
    return specs


def _reads_rows(node: ir.Node, idx: int) -> bool:
    """``node`` reads its input ``idx``, a 2-D W [N, K], in a way the panel kernels serve:
    MatMul(x, Transpose(W)) (a projection), Gemm(x, W, transB=1) with no scaling and no C
    (an LM head), Gather(W, ids, axis=0) (an embedding, tied or not)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    a = {k: v.value for k, v in node.attributes.items()}
    if node.op_type == "Transpose":
        return (idx == 0 and list(a.get("perm", [])) == [1, 0] and not node.outputs[0].is_graph_output()
                and all(u.op_type == "MatMul" and u.domain in ("", "ai.onnx") and j == 1
                        for u, j in node.outputs[0].uses()))
    if node.op_type == "Gemm":
        return (idx == 1 and a.get("transB", 0) == 1 and a.get("transA", 0) == 0 and a.get("alpha", 1.0) == 1.0
                and (len(node.inputs) < 3 or node.inputs[2] is None))
    return node.op_type == "Gather" and idx == 0 and a.get("axis", 0) == 0


def float_panel_storage(value: ir.Value) -> WeightStorage | None:
    """The panel storage of a float32 2-D initializer W [N, K] whose every reader
    ``_reads_rows`` serves, or None."""
    if (value.const_value is None or value.is_graph_input() or value.is_graph_output()
            or value.dtype != ir.DataType.FLOAT or value.shape is None or len(value.shape) != 2):
        return None
    uses = list(value.uses())
    if not all(_reads_rows(node, idx) for node, idx in uses):
        return None
    rows, cols = (int(d) for d in value.shape)
    storage = WeightStorage("fp32", rows, cols, value.name, output=value.name)
    return storage if uses and storage.tile > 1 else None


def _value(node: ir.Node, storage: WeightStorage) -> ir.Value:
    """The value the weight's readers read: the end of the int4 minimum chain, or the node's."""
    chain = chain_nodes(node, storage)
    return chain[-1].outputs[0] if chain else node.outputs[0]


def int8_dot_weights(graphs) -> frozenset[str]:
    """Data names of the int8 weights (blocks of 32, whole kernel tiles) that a MatMul
    multiplies by int8 activations (its A is a ``QuantizeActivations`` output,
    ``passes/quantize_activations.py``): stored for the dot-product kernels."""
    from ..passes.quantize_activations import FUNCTION_DOMAIN, FUNCTIONS

    found = set()
    for _, model in graphs:
        for node in model.graph:
            if node.op_type != "DequantizeLinear":
                continue
            storage = storage_of(node)
            if storage is None or not (
                    (storage.kind == "int8" and storage.group_size == int8_kernels.BLOCK
                     and int8_kernels.supports(storage.rows, storage.cols))
                    or (storage.kind == "int4" and storage.minimum is not None
                        and int4_kernels.supports(storage.rows, storage.cols, storage.group_size))):
                continue
            out = _value(node, storage)
            readers = [(u, i) for t, _ in out.uses() if t.op_type == "Transpose" for u, i in t.outputs[0].uses()]
            readers += list(out.uses())
            for user, idx in readers:
                a = user.inputs[0].producer() if user.op_type == "MatMul" and idx == 1 else None
                if a is not None and a.domain == FUNCTION_DOMAIN and a.op_type in FUNCTIONS:
                    found.add(storage.data)
    return frozenset(found)


def weight_storages(graphs, float_panels: bool = False, int8_dot: frozenset[str] = frozenset()) -> dict[str, WeightStorage]:
    """Every quantized weight of the graphs (and, with ``float_panels``, every float32
    projection weight stored as panels), by data initializer name; those named in
    ``int8_dot`` in the dot-product layout. The same weight must be stored the same way
    wherever it is used."""
    found: dict[str, WeightStorage] = {}
    for _, model in graphs:
        if float_panels:
            for value in model.graph.initializers.values():
                storage = float_panel_storage(value)
                if storage is not None and found.setdefault(storage.data, storage) != storage:
                    raise ValueError(f"weight {storage.data!r} is read in two ways")
        for node in model.graph:
            storage = storage_of(node) if node.op_type in ("DequantizeLinear", "Cast") else None
            if storage is None:
                continue
            if storage.data in int8_dot:
                storage = replace(storage, int8_dot=True)
            previous = found.setdefault(storage.data, storage)
            if previous != storage:
                raise ValueError(f"weight {storage.data!r} is dequantized in two ways ({previous} vs {storage})")
    return found


def stored_arrays(storage: WeightStorage, data: np.ndarray, scale: np.ndarray | None = None,
                  minimum: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ONNX initializer values -> the arrays the compiled module takes, by initializer name.
    ``minimum`` as the chain's [nb, 1, N]."""
    if storage.transposed:
        data = data.T
        scale = None if scale is None else scale.T
        minimum = None if minimum is None else minimum.reshape(minimum.shape[0], -1).T
    data = np.asarray(data)[:, :storage.cols]  # the chain's zero padding to whole blocks
    if storage.int8_dot and storage.kind == "int4":
        return {storage.data: int4_kernels.pack_weight(data.astype(np.uint8)),
                storage.scale: int8_kernels.pack_scales(scale), storage.minimum: int8_kernels.pack_scales(minimum)}
    if storage.int8_dot:
        return {storage.data: int8_kernels.pack_weight(data.astype(np.int8)),
                storage.scale: int8_kernels.pack_scales(scale)}
    if storage.kind == "fp32":
        return {storage.data: float_panels(data.astype(np.float32), storage.tile)}
    if storage.kind == "fp16":
        return {storage.data: interleave_rows(data.astype(np.float16), storage.tile)}
    rows = data.astype(np.int8) if storage.kind == "int8" else pack_int4(data.astype(np.uint8))
    out = {storage.data: interleave_rows(rows, storage.tile),
           storage.scale: np.ascontiguousarray(scale, dtype=np.float16)}
    if storage.minimum is not None:
        out[storage.minimum] = np.ascontiguousarray(minimum, dtype=np.float16)
    return out


def interleave_rows(a: np.ndarray, tile: int) -> np.ndarray:
    """[rows, units] -> the interleaved [rows / tile, units * tile] (see above); tile 1: as is."""
    rows, units = a.shape
    if tile == 1:
        return np.ascontiguousarray(a)
    v = a.reshape(rows // tile, tile, units // CHUNK, CHUNK).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(v.reshape(rows // tile, units * tile))


def float_panels(w: np.ndarray, panel: int) -> np.ndarray:
    """W [rows, cols] -> [rows / panel, cols, panel] (see above); panel 1: as is."""
    if panel == 1:
        return np.ascontiguousarray(w)
    rows, cols = w.shape
    return np.ascontiguousarray(w.reshape(rows // panel, panel, cols).transpose(0, 2, 1))


def deinterleave_rows(a: np.ndarray, tile: int) -> np.ndarray:
    """The inverse of ``interleave_rows`` (tests and tools)."""
    if tile == 1:
        return a
    groups, wide = a.shape
    units = wide // tile
    return a.reshape(groups, units // CHUNK, tile, CHUNK).transpose(0, 2, 1, 3).reshape(groups * tile, units)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q uint8 [rows, cols] in [0, 15] -> uint8 [rows, ceil32(cols) / 2] in the nibble layout
    (padding columns hold 0)."""
    rows, cols = q.shape
    padded = -(-cols // INT4_GROUP) * INT4_GROUP
    if q.size and int(q.max()) > 15:
        raise ValueError("pack_int4: values must lie in [0, 15]")
    v = np.zeros((rows, padded), dtype=np.uint8)
    v[:, :cols] = q
    v = v.reshape(rows, padded // INT4_GROUP, 2, INT4_GROUP // 2)
    return np.ascontiguousarray((v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(rows, padded // 2))


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """The inverse of ``pack_int4`` (tests and tools): uint8 [rows, cols] in [0, 15]."""
    rows = packed.shape[0]
    b = packed.reshape(rows, -1, INT4_GROUP // 2)
    return np.stack([b & 15, b >> 4], axis=2).reshape(rows, -1)[:, :cols]


def dequant_value(storage: WeightStorage, stored, r, c):
    """The float32 weight at stored position (r, c), as a TE expression; ``stored`` the
    tensors of ``storage.stored`` (data [, scale [, minimum]])."""
    data, *rest = stored
    t = storage.tile
    if storage.int8_dot:
        tile, lanes = int8_kernels.WEIGHT_TILE, int8_kernels.LANES
        at = (c // storage.group_size) * lanes + r % lanes
        scale = rest[0][r // lanes, at].astype("float32")
        if storage.kind == "int4":
            byte = data[r // tile, ((c // 8) * 2 + (r % tile) // lanes) * 64 + (r % lanes) * 4 + c % 4]
            nibble = tirx.bitwise_and(tirx.shift_right(byte, ((c // 4) % 2 * 4).astype("uint8")),
                                      tirx.const(15, "uint8"))
            return rest[1][r // lanes, at].astype("float32") + nibble.astype("float32") * scale
        byte = data[r // tile, ((c // 4) * 2 + (r % tile) // lanes) * 64 + (r % lanes) * 4 + c % 4]
        return (byte.astype("int32") - 128).astype("float32") * scale
    if storage.kind == "fp32":
        return data[r // t, c, r % t] if t > 1 else data[r, c]

    def at(j):  # unit j of row r
        if t == 1:
            return data[r, j]
        return data[r // t, (j // CHUNK) * (CHUNK * t) + (r % t) * CHUNK + j % CHUNK]

    if storage.kind == "fp16":
        return at(c).astype("float32")
    block = c // storage.group_size
    scale = rest[0][r, block].astype("float32")
    if storage.kind == "int8":
        return at(c).astype("float32") * scale
    g = INT4_GROUP
    byte = at((c // g) * (g // 2) + c % (g // 2))
    # Shifting the uint8 then widening measured faster in the whole model than widening
    # to int32 first (fewer instructions in a hot-cache microbenchmark, though).
    nibble = tirx.bitwise_and(tirx.shift_right(byte, ((c // (g // 2)) % 2 * 4).astype("uint8")),
                              tirx.const(15, "uint8"))
    w = nibble.astype("float32") * scale
    return w + rest[1][r, block].astype("float32") if storage.minimum is not None else w


def dequant_te(storage: WeightStorage):
    """TE: stored weight -> float32 in the ONNX orientation ([cols, rows] when transposed).
    Only used where a quantized weight has no fused consumer."""

    def compute(*stored):
        if storage.transposed:
            return te.compute((storage.cols, storage.rows),
                              lambda c, r: dequant_value(storage, stored, r, c), name="dequantize")
        return te.compute((storage.rows, storage.cols),
                          lambda r, c: dequant_value(storage, stored, r, c), name="dequantize")

    return compute


DEQUANTIZE_W = "dequantize_w"  # the matmul kernel's weight stage (schedules/cpu_matmul.py)
ROW_TILES = "matmul_row_tiles"  # a panel matmul's padded row tiles (below)


def matmul_nt_te(storage: WeightStorage, staged: bool = False, row_tiles: bool = False):
    """TE: x [..., cols] @ W.T with W the stored [rows, cols] -> [..., rows], one kernel.

    Unstaged (decode: few rows of x), the weight is dequantized inside the reduction, in
    registers: each element is read once anyway. ``staged`` (prefill: many rows), the
    weight is a separate stage ``dequantize_w`` [rows, cols] that the CPU schedule computes
    one tile of rows at a time into a small buffer reused by every row of x. No float copy
    of the whole weight is allocated either way.

    With ``row_tiles`` (CPU targets: GPU rules schedule the plain form), float32 panels
    with a dynamic row count M (a decode batch, a prefill remainder), and unstaged
    quantized weights with one (a decode batch), are computed in row tiles of T
    (8 staged, else 4): ``matmul_row_tiles`` [ceil(M / T), T, rows], the rows past M
    repeating row M - 1, then copied out. The CPU schedule keeps a tile's outputs in
    registers with no row predicate in the K loop (TVM cannot split a dynamic loop without
    one; one row at a time leaves float FMAs latency-bound and dequantizes a quantized
    weight once per row)."""

    def compute(x, *stored):
        lead = list(x.shape[:-1])
        if row_tiles and any(not isinstance(d, (int, tirx.IntImm)) for d in lead):
            if storage.kind == "fp32" and storage.tile > 1:
                return _row_tiles(storage, x, stored, lead, 8 if staged else 4)
            if not staged and storage.kind != "fp32":
                # A decode batch: each dequantized weight vector feeds a tile of rows.
                return _row_tiles(storage, x, stored, lead, 4)
        if staged and storage.kind != "fp32":  # panels are read as they are stored
            w = te.compute((storage.rows, storage.cols),
                           lambda r, c: dequant_value(storage, stored, r, c), name=DEQUANTIZE_W)
            weight = lambda r, c: w[r, c]  # noqa: E731
        else:
            weight = lambda r, c: dequant_value(storage, stored, r, c)  # noqa: E731
        k = te.reduce_axis((0, storage.cols), name="k")

        def body(*idx):
            return te.sum(x[(*idx[:-1], k)] * weight(idx[-1], k), axis=k)

        return te.compute((*lead, storage.rows), body, name="matmul")

    return compute


def _row_tiles(storage: WeightStorage, x, stored, lead: list, t: int):
    """``matmul_nt_te``'s row-tiled form: x's lead dims flattened to M rows (row-major)."""
    m = 1
    for d in lead:
        m = m * d
    k = te.reduce_axis((0, storage.cols), name="k")

    def unflatten(r):
        idx = []
        for d in reversed(lead[1:]):
            idx.append(r % d)
            r = r // d
        return [r, *reversed(idx)]

    def flat(idx):
        r = idx[0]
        for i, d in zip(idx[1:], lead[1:]):
            r = r * d + i
        return r

    # ceil(M / T) written (M - 1) // T + 1: the form TVM's region analysis matches against
    # the copy's reads of row // T (with (M + T - 1) // T it cannot prove them covered and
    # refuses compute-at in the kernel).
    tiles = te.compute(((m - 1) // t + 1, t, storage.rows),
                       lambda i, j, n: te.sum(x[(*unflatten(tirx.min(i * t + j, m - 1)), k)]
                                              * dequant_value(storage, stored, n, k), axis=k),
                       name=ROW_TILES)
    return te.compute((*lead, storage.rows), lambda *idx: tiles[flat(idx[:-1]) // t, flat(idx[:-1]) % t, idx[-1]],
                      name="matmul")


def take_rows_te(storage: WeightStorage):
    """TE: rows ``ids`` of the stored [rows, cols] weight, dequantized -> [*ids.shape, cols]."""

    def compute(ids, *stored):
        def body(*idx):
            return dequant_value(storage, stored, ids[idx[:-1]].astype("int32"), idx[-1])

        return te.compute((*ids.shape, storage.cols), body, name="take")

    return compute
