"""W4A8: int4 weights against int8 activations with VNNI dot products (the int8 kernel's
form, ``cpu_int8_matmul.py``; same activation quantizer, same tiles of 32 output rows).

The weights are GGUF Q4_1-style blocks of G inputs (``w = m + d * q``, q in [0, 15], a
float16 scale d and minimum m per block, G a multiple of 16). For an activation block of
16 inputs (scale s, levels x_q):

    sum_k w_k x_k = s * (d * sum_k q_k x_qk + m * sum_k x_qk)

The nibbles are already unsigned, so they are ``vpdpbusd``'s unsigned operand as they
are (no offset, the accumulators start at 0); ``sum x_q`` is the quantizer's offset term
(``xc = -128 * sum``), so the minimum costs one more FMA per block and row.

Layout: data uint8 [N / 32, K * 16]: for tile t, group of 8 inputs g, vector v (16 rows)
and row r, the 4 bytes at ``((g * 2 + v) * 16 + r) * 4 + j`` hold input ``8g + j`` in their
low nibble and ``8g + 4 + j`` in their high one, so one 64-byte load is two dot-product
operands (an AND, and a shift and an AND); scale and minimum float16 [N / 16, K / G * 16]
as the int8 scales.
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from .cpu_int8_matmul import ACT_BLOCK, LANES, ROWS, VECTORS, WEIGHT_TILE, _dot, pack_scales, store_rows, zero

GROUP = 8  # inputs per byte group: 4 bytes of two nibbles


def supports(n: int, k: int, group: int) -> bool:
    return n % WEIGHT_TILE == 0 and k % 32 == 0 and group % ACT_BLOCK == 0 and k % group == 0 and n > 0


def int4_matmul(n: int, k: int, group: int):
    """out float32 [M, N] from the int8 activation quantizer's (xq, xs, xc) and the stored
    int4 weight (data, scale, minimum); tasks and tails as ``int8_matmul``."""
    if not supports(n, k, group):
        raise ValueError(f"int4_matmul: N ({n}) must divide by {WEIGHT_TILE}, K ({k}) by 32 and by the block "
                         f"({group}), the block by {ACT_BLOCK}")
    nb = k // group
    na = k // ACT_BLOCK
    per_block = group // ACT_BLOCK  # activation blocks per weight block
    groups = ACT_BLOCK // GROUP  # byte groups per activation block
    tiles = n // WEIGHT_TILE
    nv, mt = VECTORS, ROWS
    low = 0x0F0F0F0F

    @T.prim_func(s_tir=True)
    def int4_dot_matmul(xq_h: T.handle, xs_h: T.handle, xc_h: T.handle, w_h: T.handle, wd_h: T.handle,
                        wm_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        xq = T.match_buffer(xq_h, (m, k), "int8")
        xs = T.match_buffer(xs_h, (m, na), "float32")
        xc = T.match_buffer(xc_h, (m, na), "int32")
        w = T.match_buffer(w_h, (tiles, k * LANES), "uint8")
        wd = T.match_buffer(wd_h, (n // LANES, nb * LANES), "float16")
        wm = T.match_buffer(wm_h, (n // LANES, nb * LANES), "float16")
        out = T.match_buffer(out_h, (m, n), "float32")
        xq4 = T.decl_buffer((m, k // 4), "int32", data=xq.data)
        w4 = T.decl_buffer((tiles, k * 4), "int32", data=w.data)
        for t in T.parallel(tiles):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                facc = T.sblock_alloc_buffer((mt * nv * LANES,), "float32")
                iacc = T.sblock_alloc_buffer((mt * nv * LANES,), "int32")
                for mo in T.serial((m + mt - 1) // mt):
                    zero(facc, T.float32(0))
                    for a in T.serial(na):
                        b: T.let[T.int32] = a // per_block  # the weight block
                        zero(iacc, 0)
                        for g in T.unroll(groups):
                            for v in T.unroll(nv):
                                packed: T.let[T.int32x16] = w4[t, T.ramp(((a * groups + g) * nv + v) * LANES, 1,
                                                                         LANES)]
                                for mi in T.unroll(mt):
                                    row: T.let[T.int64] = T.min(mo * mt + mi, m - 1)
                                    word: T.let[T.int32] = (a * groups + g) * 2  # inputs 8g.. as words of 4
                                    iacc[T.ramp((mi * nv + v) * LANES, 1, LANES)] = _dot(_dot(
                                        iacc[T.ramp((mi * nv + v) * LANES, 1, LANES)],
                                        packed & T.broadcast(low, LANES), T.broadcast(xq4[row, word], LANES)),
                                        T.shift_right(packed, T.broadcast(4, LANES)) & T.broadcast(low, LANES),
                                        T.broadcast(xq4[row, word + 1], LANES))
                        for v in T.unroll(nv):
                            for mi in T.unroll(mt):
                                row: T.let[T.int64] = T.min(mo * mt + mi, m - 1)
                                # s * sum(x_q) = s * xc / -128
                                total: T.let[T.float32] = xs[row, a] * T.Cast("float32", xc[row, a]) * T.float32(
                                    -1 / 128)
                                facc[T.ramp((mi * nv + v) * LANES, 1, LANES)] = (
                                    facc[T.ramp((mi * nv + v) * LANES, 1, LANES)]
                                    + T.Cast("float32x16", iacc[T.ramp((mi * nv + v) * LANES, 1, LANES)])
                                    * (T.Cast("float32x16", wd[t * nv + v, T.ramp(b * LANES, 1, LANES)])
                                       * T.broadcast(xs[row, a], LANES))
                                    + T.Cast("float32x16", wm[t * nv + v, T.ramp(b * LANES, 1, LANES)])
                                    * T.broadcast(total, LANES))
                    store_rows(out, facc, m, mo, t)

    return int4_dot_matmul


def pack_weight(q: np.ndarray) -> np.ndarray:
    """q uint8 [N, K] in [0, 15] -> the stored uint8 [N / 32, K * 16] (module docstring)."""
    rows, cols = q.shape
    v = q.astype(np.uint8).reshape(rows // WEIGHT_TILE, VECTORS, LANES, cols // GROUP, 2, 4)
    packed = v[..., 0, :] | (v[..., 1, :] << 4)  # [tiles, v, r, g, 4]
    return np.ascontiguousarray(packed.transpose(0, 3, 1, 2, 4).reshape(rows // WEIGHT_TILE, cols * LANES))


__all__ = ["int4_matmul", "pack_weight", "pack_scales", "supports"]
