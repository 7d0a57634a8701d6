"""Integer dot-product matmuls for CPUs with AVX-512 VNNI: int8 activations against int8
weights (W8A8), as llama.cpp's q8_0 x q8_0 and onnxruntime's MatMulNBits at accuracy
level 4 multiply.

Activations are quantized per row and block of ACT_BLOCK (16) inputs, symmetric:
``s = max(amax, TINY) / 127``, ``q = clip(round_half_even(x / s), -127, 127)``, the same
arithmetic as the graph's ``QuantizeActivations`` function (``passes/quantize_activations.py``),
which onnxruntime runs as the oracle. Blocks of 16 rather than llama.cpp's 32: on the
default model 32 cost 1.5-2 points of top-1 agreement with float32 (an outlier flattens
the other 31 inputs of its block), 16 about 0.5 (README, "Quantization"). With ``levels``
2 (the LM head, where the logits are read directly) the residual ``x - q * s`` is
quantized again and both rows go through the kernel, so the activation carries ~15 bits
for twice the integer work on the same weight bytes.

Weights are Q8_0 blocks of BLOCK (32) inputs (``w = q * s``, one float16 scale each).

``vpdpbusd`` multiplies 64 unsigned bytes by 64 signed bytes and adds each group of four
products into one of 16 int32 lanes. Here the 16 lanes are 16 output rows (no horizontal
sums, as in the float32 panels of ``schedules/cpu_matmul.py``): the weight operand is
[16 rows x 4 inputs] of one tile, the activation operand 4 inputs of one row broadcast to
every lane. The weights are the unsigned operand, stored ``q + 128``; the offset comes out
exactly as ``128 * sum(x_q)`` over the block, which the activation quantizer computes once
per row and block (``xc = -128 * sum``) and each block's int32 accumulators start from.
Per activation block and row: 4 ``vpdpbusd`` for 16 outputs x 16 inputs, then one
int -> float conversion and one FMA by ``s_w * s_x`` (float32 FMA would take 16).

CPUs with AVX2 but no VNNI (Zen 2/3, Haswell..Alder Lake's AVX2 mode) multiply the same
stored bytes with ``vpmaddubsw`` (unsigned x signed bytes, adjacent pairs summed into
int16, *saturating*) then ``vpmaddwd`` against ones (pairs of int16 into int32): 8 int32
lanes, so 8 output rows a vector and 4 vectors a tile. ``q + 128`` times an int8 level can
pair-sum past int16 (2 * 255 * 127), so there the weight is turned back into ``q`` (XOR
0x80, once per loaded vector) and the sign moves onto it, as llama.cpp's AVX2 q8_0 dot
does: ``|x| * (q * sign(x))`` with both factors within 127, pair sums within 32258. The
accumulators then start at 0, not at the offset term.

Weight layout (``WEIGHT_TILE`` = 32 output rows a task, the same bytes for every ISA):
data uint8 [N / 32, K * 32]: w[r, c] + 128 at
``[r // 32, ((c // 4) * 2 + (r % 32) // 16) * 64 + (r % 16) * 4 + c % 4]``, so a task
streams one contiguous region, 128 bytes (both vectors) per 4 inputs;
scale float16 [N / 16, K / 32 * 16]: s[r, b] at ``[r // 16, b * 16 + r % 16]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm.script import tirx as T

BLOCK = 32  # inputs per weight scale block
ACT_BLOCK = 16  # inputs per activation scale block
LANES = 16  # stored scales come in groups of 16 output rows (one zmm vector, two ymm)
VECTORS = 2  # storage: groups of 16 rows per tile
WEIGHT_TILE = LANES * VECTORS  # output rows per task and per stored tile
TINY = 1e-30  # an all-zero block's amax floor: its scale stays finite, its levels 0
Q_MAX = 127
VPDPBUSD = "llvm.x86.avx512.vpdpbusd.512"
PMADDUBSW = "llvm.x86.avx2.pmadd.ub.sw"  # u8 x s8 -> int16 pair sums (saturating)
PMADDWD = "llvm.x86.avx2.pmadd.wd"  # int16 x int16 -> int32 pair sums
PSIGNB = "llvm.x86.avx2.psign.b"  # a * sign(b) per byte (0 where b is 0)
SIGN_BITS = -0x7F7F7F80  # 0x80808080 as an int32 word: XOR turns q + 128 back into q


@dataclass(frozen=True)
class DotISA:
    """How a CPU multiplies bytes: its int32 lanes per vector, and the register tile
    (``rows`` activation rows x ``vectors`` vectors of output rows, two accumulators each)."""

    name: str
    lanes: int
    rows: int

    @property
    def vectors(self) -> int:
        return WEIGHT_TILE // self.lanes

    def vec(self, dtype: str) -> str:
        return f"{dtype}x{self.lanes}"


# AVX-512 VNNI: 32 zmm registers hold 4 x 2 int32 and float32 accumulators. AVX2: 16 ymm
# registers; 2 rows x 4 vectors of accumulators leave the rest for operands.
ISAS = {"avx512_vnni": DotISA("avx512_vnni", 16, 4), "avx2": DotISA("avx2", 8, 2)}
ROWS = ISAS["avx512_vnni"].rows


def supports(n: int, k: int) -> bool:
    """Shapes these kernels take: whole weight tiles and whole blocks."""
    return n % WEIGHT_TILE == 0 and k % BLOCK == 0 and n > 0 and k > 0


def dot_unsigned(isa: DotISA, acc, unsigned, signed):
    """acc[i] += sum_j unsigned[4i + j] * signed[4i + j] (int32 lanes; bytes as int32 words).
    On AVX2 every pair sum must stay within int16: unsigned * |signed| <= 16383."""
    bytes_ = isa.vec("int8").replace(f"x{isa.lanes}", f"x{4 * isa.lanes}")
    u, s = T.reinterpret(unsigned, dtype=bytes_), T.reinterpret(signed, dtype=bytes_)
    if isa.name == "avx512_vnni":
        return T.call_llvm_pure_intrin(isa.vec("int32"), T.llvm_lookup_intrinsic_id(VPDPBUSD), acc, u, s)
    pairs = T.call_llvm_pure_intrin(f"int16x{2 * isa.lanes}", T.llvm_lookup_intrinsic_id(PMADDUBSW), u, s)
    return acc + T.call_llvm_pure_intrin(isa.vec("int32"), T.llvm_lookup_intrinsic_id(PMADDWD), pairs,
                                         T.broadcast(T.int16(1), 2 * isa.lanes))


def dot_stored_int8(isa: DotISA, acc, stored, signed):
    """acc[i] += sum_j w[4i + j] * signed[4i + j] for a stored int8 weight (``q + 128``):
    on VNNI the offset is in the accumulator's start (``xc``); on AVX2 (module docstring)
    ``|x| * (q * sign(x))``, whose accumulators start at 0."""
    if isa.name == "avx512_vnni":
        return dot_unsigned(isa, acc, stored, signed)
    bytes_ = f"int8x{4 * isa.lanes}"
    q = T.reinterpret(stored ^ T.broadcast(T.int32(SIGN_BITS), isa.lanes), dtype=bytes_)
    x = T.reinterpret(signed, dtype=bytes_)
    sign = T.llvm_lookup_intrinsic_id(PSIGNB)
    pairs = T.call_llvm_pure_intrin(f"int16x{2 * isa.lanes}", T.llvm_lookup_intrinsic_id(PMADDUBSW),
                                    T.call_llvm_pure_intrin(bytes_, sign, x, x),
                                    T.call_llvm_pure_intrin(bytes_, sign, q, x))
    return acc + T.call_llvm_pure_intrin(isa.vec("int32"), T.llvm_lookup_intrinsic_id(PMADDWD), pairs,
                                         T.broadcast(T.int16(1), 2 * isa.lanes))


def zero_macro(lanes: int, vectors: int):
    """A macro: the first ``vectors`` accumulator vectors of ``lanes`` lanes = value."""

    @T.macro
    def zero(acc, value):
        for i in T.unroll(vectors):
            acc[T.ramp(i * lanes, 1, lanes)] = T.broadcast(value, lanes)

    return zero


def store_macro(spec: DotISA, rows: int):
    """A macro: a tile's float accumulators -> out rows first.., the columns of tile t."""
    lanes, nv = spec.lanes, spec.vectors

    @T.macro
    def store(out, facc, t, first):
        for mi in T.unroll(rows):
            for v in T.unroll(nv):
                out[first + mi, T.ramp((t * nv + v) * lanes, 1, lanes)] = facc[T.ramp((mi * nv + v) * lanes, 1, lanes)]

    return store


def quantize_rows(k: int, levels: int = 1):
    """x float32 [M, K] -> xq int8 [M * levels, K], xs float32 [M * levels, K / 16]
    (scales), xc int32 [M * levels, K / 16] (-128 * the block's sum of xq), one task per
    row of x. Level l of row i is row ``i * levels + l``: level 0 quantizes x, level 1
    (``levels`` 2) the residual x - q0 * s0."""
    nb = k // ACT_BLOCK

    @T.prim_func(s_tir=True)
    def quantize_activations_int8(x_h: T.handle, xq_h: T.handle, xs_h: T.handle, xc_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, k), "float32")
        xq = T.match_buffer(xq_h, (m * levels, k), "int8")
        xs = T.match_buffer(xs_h, (m * levels, nb), "float32")
        xc = T.match_buffer(xc_h, (m * levels, nb), "int32")
        for row in T.parallel(m):
            with T.sblock("row"):
                T.reads()
                T.writes()
                value = T.sblock_alloc_buffer((ACT_BLOCK,), "float32")
                level = T.sblock_alloc_buffer((ACT_BLOCK,), "float32")
                amax = T.sblock_alloc_buffer((1,), "float32")
                total = T.sblock_alloc_buffer((1,), "int32")
                for b in T.serial(nb):
                    for j in T.vectorized(ACT_BLOCK):
                        value[j] = x[row, b * ACT_BLOCK + j]
                    for lv in T.serial(levels):
                        out: T.let[T.int64] = row * levels + lv
                        amax[0] = T.float32(0)
                        for j in T.serial(ACT_BLOCK):
                            amax[0] = T.max(amax[0], T.fabs(value[j]))
                        scale: T.let[T.float32] = T.max(amax[0], T.float32(TINY)) / T.float32(Q_MAX)
                        for j in T.vectorized(ACT_BLOCK):
                            level[j] = T.max(T.min(T.nearbyint(value[j] / scale), T.float32(Q_MAX)),
                                             T.float32(-Q_MAX))
                        total[0] = 0
                        for j in T.serial(ACT_BLOCK):
                            xq[out, b * ACT_BLOCK + j] = T.Cast("int8", level[j])
                            total[0] = total[0] + T.Cast("int32", level[j])
                        xs[out, b] = scale
                        xc[out, b] = total[0] * -128
                        for j in T.vectorized(ACT_BLOCK):
                            value[j] = value[j] - level[j] * scale  # the residual, for the next level

    return quantize_activations_int8


def int8_matmul(n: int, k: int, isa: str = "avx512_vnni"):
    """out float32 [M, N] = (xq [M, K] . w [N, K]) with per-block scales (module docstring).
    Tasks: N / 32 tiles of output rows, over the cores; each takes the M rows isa.rows at a
    time, then the last M % rows one at a time (a decode step's single row does no
    padding work), keeping rows x vectors int32 and float32 accumulators in registers."""
    if not supports(n, k):
        raise ValueError(f"int8_matmul: N ({n}) must divide by {WEIGHT_TILE} and K ({k}) by {BLOCK}")
    spec = ISAS[isa]
    nb = k // BLOCK
    halves = BLOCK // ACT_BLOCK  # activation blocks per weight block
    steps = ACT_BLOCK // 4  # dot steps (4 inputs) per activation block
    tiles = n // WEIGHT_TILE
    nv, mt, lanes = spec.vectors, spec.rows, spec.lanes
    f32 = spec.vec("float32")
    offset = spec.name == "avx512_vnni"  # accumulators start at the q + 128 offset term

    def rows_macro(rows: int):
        zero, store = zero_macro(lanes, rows * nv), store_macro(spec, rows)

        @T.macro
        def tile_rows(xq4, xs, xc, w4, ws, out, facc, iacc, t, first):
            """Rows first..first + rows of output tile t."""
            zero(facc, T.float32(0))
            for b, h in T.grid(nb, halves):
                a: T.let[T.int32] = b * halves + h  # the activation block
                for mi in T.unroll(rows):
                    for v in T.unroll(nv):
                        iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)] = T.broadcast(
                            T.if_then_else(offset, xc[first + mi, a], 0), lanes)
                for s in T.unroll(steps):
                    for v in T.unroll(nv):
                        for mi in T.unroll(rows):
                            iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)] = dot_stored_int8(
                                spec, iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)],
                                w4[t, T.ramp(((a * steps + s) * nv + v) * lanes, 1, lanes)],
                                T.broadcast(xq4[first + mi, a * steps + s], lanes))
                for v in T.unroll(nv):
                    for mi in T.unroll(rows):
                        facc[T.ramp((mi * nv + v) * lanes, 1, lanes)] = (
                            facc[T.ramp((mi * nv + v) * lanes, 1, lanes)]
                            + T.Cast(f32, iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)])
                            * (T.Cast(f32, ws[t * VECTORS + v * lanes // LANES,
                                              T.ramp(b * LANES + v * lanes % LANES, 1, lanes)])
                               * T.broadcast(xs[first + mi, a], lanes)))
            store(out, facc, t, first)

        return tile_rows

    full, single = rows_macro(mt), rows_macro(1)

    @T.prim_func(s_tir=True)
    def int8_dot_matmul(xq_h: T.handle, xs_h: T.handle, xc_h: T.handle, w_h: T.handle, ws_h: T.handle,
                        out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        xq = T.match_buffer(xq_h, (m, k), "int8")
        xs = T.match_buffer(xs_h, (m, nb * halves), "float32")
        xc = T.match_buffer(xc_h, (m, nb * halves), "int32")
        w = T.match_buffer(w_h, (tiles, k * WEIGHT_TILE), "uint8")
        ws = T.match_buffer(ws_h, (n // LANES, nb * LANES), "float16")
        out = T.match_buffer(out_h, (m, n), "float32")
        xq4 = T.decl_buffer((m, k // 4), "int32", data=xq.data)  # 4 inputs as one word
        w4 = T.decl_buffer((tiles, k * WEIGHT_TILE // 4), "int32", data=w.data)
        for t in T.parallel(tiles):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                # Small constant-size block buffers become stack allocas LLVM keeps in registers.
                facc = T.sblock_alloc_buffer((mt * nv * lanes,), "float32")
                iacc = T.sblock_alloc_buffer((mt * nv * lanes,), "int32")
                for mo in T.serial(m // mt):
                    full(xq4, xs, xc, w4, ws, out, facc, iacc, t, mo * mt)
                for r in T.serial(m % mt):
                    single(xq4, xs, xc, w4, ws, out, facc, iacc, t, m // mt * mt + r)

    return int8_dot_matmul


# --------------------------------------------------------------------------------------
# numpy: the layout and the reference arithmetic (storage writer, tests)


def pack_weight(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] -> the stored uint8 [N / 32, K * 32] (module docstring)."""
    rows, cols = q.shape
    u = (q.astype(np.int16) + 128).astype(np.uint8)
    v = u.reshape(rows // WEIGHT_TILE, VECTORS, LANES, cols // 4, 4).transpose(0, 3, 1, 2, 4)
    return np.ascontiguousarray(v.reshape(rows // WEIGHT_TILE, cols * WEIGHT_TILE))


def pack_scales(scale: np.ndarray) -> np.ndarray:
    """scale [N, K / 32] -> float16 [N / 16, K / 32 * 16]."""
    rows, nb = scale.shape
    return np.ascontiguousarray(scale.astype(np.float16).reshape(rows // LANES, LANES, nb).transpose(0, 2, 1)
                                .reshape(rows // LANES, nb * LANES))


def quantize_rows_numpy(x: np.ndarray, levels: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (levels int8 [M * levels, K], scales float32 [M * levels, K / 16]):
    the activation quantizer's arithmetic, in float32 as the kernel and onnxruntime do it."""
    value = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1, ACT_BLOCK)
    qs, ss = [], []
    for _ in range(levels):
        scale = np.maximum(np.abs(value).max(-1), np.float32(TINY)) / np.float32(Q_MAX)
        q = np.clip(np.rint(value / scale[..., None]), -Q_MAX, Q_MAX).astype(np.float32)
        qs.append(q.astype(np.int8).reshape(x.shape))
        ss.append(scale.astype(np.float32))
        # The residual rounded once, as the kernel's fused multiply-add computes it
        # (onnxruntime's Mul then Sub may differ by an ulp, so by one level-1 step).
        value = (value.astype(np.float64) - q.astype(np.float64) * scale[..., None]).astype(np.float32)
    return np.stack(qs, 1).reshape(-1, x.shape[1]), np.stack(ss, 1).reshape(-1, ss[0].shape[-1])
