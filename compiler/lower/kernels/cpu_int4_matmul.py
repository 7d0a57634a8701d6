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

On AVX2 (``vpmaddubsw``, see the int8 kernel) a nibble times a level pair-sums to at most
2 * 15 * 127 = 3810, so the four products of an activation block add up in int16 (at most
15240) and go through ``vpmaddwd`` once per block.
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from .cpu_int8_matmul import (ACT_BLOCK, ISAS, LANES, PMADDUBSW, PMADDWD, VECTORS, WEIGHT_TILE, dot_unsigned,
                              pack_scales, store_macro, zero_macro)

GROUP = 8  # inputs per byte group: 4 bytes of two nibbles
LOW = 0x0F0F0F0F  # the low nibble of every byte of a word


def supports(n: int, k: int, group: int) -> bool:
    return n % WEIGHT_TILE == 0 and k % 32 == 0 and group % ACT_BLOCK == 0 and k % group == 0 and n > 0


def _block_dots(spec, rows: int):
    """A macro: iacc (int32 accumulators of the tile) = the nibble . level dot products of
    activation block ``a`` for rows first.., as the ISA best adds them."""
    nv, lanes = spec.vectors, spec.lanes
    groups = ACT_BLOCK // GROUP  # byte groups per activation block
    zero = zero_macro(lanes, rows * nv)
    zero16 = zero_macro(2 * lanes, rows * nv)
    i16 = f"int16x{2 * lanes}"
    b8 = f"int8x{4 * lanes}"

    @T.macro
    def vnni(iacc, pacc, w4, xq4, t, a, first):
        zero(iacc, 0)
        for g in T.unroll(groups):
            for v in T.unroll(nv):
                packed = w4[t, T.ramp(((a * groups + g) * nv + v) * lanes, 1, lanes)]
                for mi in T.unroll(rows):
                    word = (a * groups + g) * 2  # inputs 8g.. as words of 4
                    iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)] = dot_unsigned(spec, dot_unsigned(
                        spec, iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)],
                        packed & T.broadcast(LOW, lanes), T.broadcast(xq4[first + mi, word], lanes)),
                        T.shift_right(packed, T.broadcast(4, lanes)) & T.broadcast(LOW, lanes),
                        T.broadcast(xq4[first + mi, word + 1], lanes))

    @T.macro
    def avx2(iacc, pacc, w4, xq4, t, a, first):
        zero16(pacc, T.int16(0))
        for g in T.unroll(groups):
            for v in T.unroll(nv):
                packed = w4[t, T.ramp(((a * groups + g) * nv + v) * lanes, 1, lanes)]
                for mi in T.unroll(rows):
                    word = (a * groups + g) * 2
                    pacc[T.ramp((mi * nv + v) * 2 * lanes, 1, 2 * lanes)] = (
                        pacc[T.ramp((mi * nv + v) * 2 * lanes, 1, 2 * lanes)]
                        + T.call_llvm_pure_intrin(i16, T.llvm_lookup_intrinsic_id(PMADDUBSW),
                                                  T.reinterpret(packed & T.broadcast(LOW, lanes), dtype=b8),
                                                  T.reinterpret(T.broadcast(xq4[first + mi, word], lanes), dtype=b8))
                        + T.call_llvm_pure_intrin(i16, T.llvm_lookup_intrinsic_id(PMADDUBSW),
                                                  T.reinterpret(T.shift_right(packed, T.broadcast(4, lanes))
                                                                & T.broadcast(LOW, lanes), dtype=b8),
                                                  T.reinterpret(T.broadcast(xq4[first + mi, word + 1], lanes),
                                                                dtype=b8)))
        for i in T.unroll(rows * nv):
            iacc[T.ramp(i * lanes, 1, lanes)] = T.call_llvm_pure_intrin(
                spec.vec("int32"), T.llvm_lookup_intrinsic_id(PMADDWD), pacc[T.ramp(i * 2 * lanes, 1, 2 * lanes)],
                T.broadcast(T.int16(1), 2 * lanes))

    return vnni if spec.name == "avx512_vnni" else avx2


def int4_matmul(n: int, k: int, group: int, isa: str = "avx512_vnni"):
    """out float32 [M, N] from the int8 activation quantizer's (xq, xs, xc) and the stored
    int4 weight (data, scale, minimum); tasks and row tiles as ``int8_matmul``."""
    if not supports(n, k, group):
        raise ValueError(f"int4_matmul: N ({n}) must divide by {WEIGHT_TILE}, K ({k}) by 32 and by the block "
                         f"({group}), the block by {ACT_BLOCK}")
    spec = ISAS[isa]
    nb = k // group
    na = k // ACT_BLOCK
    per_block = group // ACT_BLOCK  # activation blocks per weight block
    tiles = n // WEIGHT_TILE
    nv, mt, lanes = spec.vectors, spec.rows, spec.lanes
    f32 = spec.vec("float32")

    def rows_macro(rows: int):
        zero, store = zero_macro(lanes, rows * nv), store_macro(spec, rows)
        block_dots = _block_dots(spec, rows)

        @T.macro
        def tile_rows(xq4, xs, xc, w4, wd, wm, out, facc, iacc, pacc, t, first):
            """Rows first..first + rows of output tile t."""
            zero(facc, T.float32(0))
            for a in T.serial(na):
                b: T.let[T.int32] = a // per_block  # the weight block
                block_dots(iacc, pacc, w4, xq4, t, a, first)
                for v in T.unroll(nv):
                    for mi in T.unroll(rows):
                        # s * sum(x_q) = s * xc / -128
                        total: T.let[T.float32] = xs[first + mi, a] * T.Cast("float32", xc[first + mi, a]) * T.float32(
                            -1 / 128)
                        facc[T.ramp((mi * nv + v) * lanes, 1, lanes)] = (
                            facc[T.ramp((mi * nv + v) * lanes, 1, lanes)]
                            + T.Cast(f32, iacc[T.ramp((mi * nv + v) * lanes, 1, lanes)])
                            * (T.Cast(f32, wd[t * VECTORS + v * lanes // LANES,
                                              T.ramp(b * LANES + v * lanes % LANES, 1, lanes)])
                               * T.broadcast(xs[first + mi, a], lanes))
                            + T.Cast(f32, wm[t * VECTORS + v * lanes // LANES,
                                             T.ramp(b * LANES + v * lanes % LANES, 1, lanes)])
                            * T.broadcast(total, lanes))
            store(out, facc, t, first)

        return tile_rows

    full, single = rows_macro(mt), rows_macro(1)

    @T.prim_func(s_tir=True)
    def int4_dot_matmul(xq_h: T.handle, xs_h: T.handle, xc_h: T.handle, w_h: T.handle, wd_h: T.handle,
                        wm_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        xq = T.match_buffer(xq_h, (m, k), "int8")
        xs = T.match_buffer(xs_h, (m, na), "float32")
        xc = T.match_buffer(xc_h, (m, na), "int32")
        w = T.match_buffer(w_h, (tiles, k * WEIGHT_TILE // 2), "uint8")
        wd = T.match_buffer(wd_h, (n // LANES, nb * LANES), "float16")
        wm = T.match_buffer(wm_h, (n // LANES, nb * LANES), "float16")
        out = T.match_buffer(out_h, (m, n), "float32")
        xq4 = T.decl_buffer((m, k // 4), "int32", data=xq.data)
        w4 = T.decl_buffer((tiles, k * 4), "int32", data=w.data)
        for t in T.parallel(tiles):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                facc = T.sblock_alloc_buffer((mt * nv * lanes,), "float32")
                iacc = T.sblock_alloc_buffer((mt * nv * lanes,), "int32")
                pacc = T.sblock_alloc_buffer((mt * nv * 2 * lanes,), "int16")  # AVX2's int16 sums
                for mo in T.serial(m // mt):
                    full(xq4, xs, xc, w4, wd, wm, out, facc, iacc, pacc, t, mo * mt)
                for r in T.serial(m % mt):
                    single(xq4, xs, xc, w4, wd, wm, out, facc, iacc, pacc, t, m // mt * mt + r)

    return int4_dot_matmul


def pack_weight(q: np.ndarray) -> np.ndarray:
    """q uint8 [N, K] in [0, 15] -> the stored uint8 [N / 32, K * 16] (module docstring)."""
    rows, cols = q.shape
    v = q.astype(np.uint8).reshape(rows // WEIGHT_TILE, VECTORS, LANES, cols // GROUP, 2, 4)
    packed = v[..., 0, :] | (v[..., 1, :] << 4)  # [tiles, v, r, g, 4]
    return np.ascontiguousarray(packed.transpose(0, 3, 1, 2, 4).reshape(rows // WEIGHT_TILE, cols * LANES))


__all__ = ["int4_matmul", "pack_weight", "pack_scales", "supports"]
