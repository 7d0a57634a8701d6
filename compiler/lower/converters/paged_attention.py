"""kiln::PagedAttention -> TVM's paged KV cache (append this step's K/V, attend over the
sequence's cached K/V), through ``vm.builtin.attention_kv_cache_attention_with_fused_qkv``.

q [B, S, Hq*D], k / v [B, S, Hkv*D] (RoPE already applied) are packed as
qkv [B*S, Hq + 2*Hkv, D], the layout the cache takes; the output [B*S, Hq, D] becomes
[B, S, Hq*D] again. Which sequence each of the B*S tokens belongs to, and its position,
is the cache's state for this step (set by the runtime's begin_forward).

The cache takes float32 words in ``KVLayout``'s geometry (``kiln.runtime.kv_layout``): a
query head goes as ``q_split`` word rows (zero-padded), keys and values are packed into
their stored form here (float16 pairs, or int8 quads plus the row's float32 scale), so the
cache appends them as they are; the output comes back as word rows and is unpadded.
"""

from __future__ import annotations

import functools

from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.runtime.kv_layout import INT8_MAX, KVLayout

from ..context import attr, dtype, shape
from ..registry import converter


def _word(layout: KVLayout, x, bi, si, base, i, scale):
    """Word i of the stored row of x[bi, si, base : base + D] (``scale``: the row's int8
    scale, else None)."""
    f32 = lambda value: tirx.reinterpret("float32", value)  # noqa: E731
    if layout.dtype == "float32":
        return x[bi, si, base + i]
    if layout.dtype == "float16":
        half = lambda j: tirx.Cast("uint32", tirx.reinterpret("uint16", tirx.Cast("float16", x[bi, si, base + j])))  # noqa: E731
        return f32(half(2 * i) | (half(2 * i + 1) << tirx.const(16, "uint32")))
    inv = tirx.if_then_else(scale > tirx.const(0, "float32"), tirx.const(1, "float32") / scale,
                            tirx.const(0, "float32"))

    def byte(j):
        level = tirx.nearbyint(x[bi, si, base + 4 * i + j] * inv)  # round half to even, as numpy's rint
        level = tirx.max(tirx.min(level, tirx.const(INT8_MAX, "float32")), tirx.const(-INT8_MAX, "float32"))
        return (tirx.Cast("uint32", tirx.Cast("int32", level)) & tirx.const(0xFF, "uint32")) << tirx.const(8 * j, "uint32")

    packed = f32(byte(0) | byte(1) | byte(2) | byte(3))
    return tirx.if_then_else(i == layout.words - 1, scale, packed)


def _pack_qkv(q, k, v, *, layout: KVLayout):
    """q [B, S, Hq*D], k / v [B, S, Hkv*D] -> qkv [B*S, Hq*q_split + 2*Hkv, words] float32
    words: query heads split in zero-padded word rows, K / V rows in their stored form."""
    b, s, _ = q.shape
    hq, hkv, d, w, split = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.words, layout.q_split
    hq_c = layout.cache_q_heads
    scales = {}
    if layout.dtype == "int8":
        for name, x in (("k", k), ("v", v)):
            r = te.reduce_axis((0, d), name="r")
            amax = te.compute((b, s, hkv), lambda bi, si, h: te.max(tirx.abs(x[bi, si, h * d + r]), axis=r),
                              name=f"{name}_amax")
            scales[name] = te.compute((b, s, hkv), lambda bi, si, h: amax[bi, si, h] / tirx.const(INT8_MAX, "float32"),
                                      name=f"{name}_scale")

    def compute(t, h, i):
        bi, si = tirx.floordiv(t, s), tirx.floormod(t, s)
        e = tirx.floormod(h, split) * w + i  # the query element this word holds
        query = tirx.if_then_else(e < d, q[bi, si, tirx.floordiv(h, split) * d + tirx.min(e, d - 1)],
                                  tirx.const(0, "float32"))
        hk, hv = h - hq_c, h - hq_c - hkv
        key = _word(layout, k, bi, si, hk * d, i, scales["k"][bi, si, hk] if scales else None)
        value = _word(layout, v, bi, si, hv * d, i, scales["v"][bi, si, hv] if scales else None)
        return tirx.if_then_else(h < hq_c, query, tirx.if_then_else(h < hq_c + hkv, key, value))

    return te.compute((b * s, hq_c + 2 * hkv, w), compute, name="pack_qkv")


def _unpack_output(out, *, layout: KVLayout, b, s):
    """out [B*S, Hq*q_split, words] -> [B, S, Hq*D] (drops each head's padding)."""
    d, w, stride = layout.head_dim, layout.words, layout.q_stride

    def compute(bi, si, j):
        flat = tirx.floordiv(j, d) * stride + tirx.floormod(j, d)
        return out[bi * s + si, tirx.floordiv(flat, w), tirx.floormod(flat, w)]

    return te.compute((b, s, layout.num_heads * d), compute, name="unpack_attention")


@converter("PagedAttention", domain="kiln")
def paged_attention(ctx, node, inputs):
    if ctx.kv_cache is None:
        raise ValueError("PagedAttention needs the function's kv_cache parameter")
    q, k, v = inputs
    hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
    b, s, q_hidden = shape(q)
    d = int(q_hidden) // hq
    if dtype(q) != "float32":
        raise ValueError(f"PagedAttention: Kiln's KV layouts take float32 q / k / v, got {dtype(q)}")
    layout = KVLayout(ctx.kv_dtype, hq, hkv, d)
    tokens = b * s
    # One kernel rather than three reshapes and a concat: FuseOps folds the RoPE kernels
    # producing q and k into it (no intermediate tensors or views); int8 adds the rows' max.
    qkv = ctx.bb.emit_te(functools.partial(_pack_qkv, layout=layout), q, k, v, primfunc_name_hint="pack_qkv")
    out = ctx.emit(relax.call_dps_packed(
        "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
        [ctx.kv_cache, relax.prim_value(attr(node, "layer_id")), relax.prim_value(float(attr(node, "scale"))), qkv],
        out_ty=relax.TensorType([tokens, layout.cache_q_heads, layout.words], "float32"),
    ))
    if layout.q_stride == d:  # no padding: the word rows are the heads' rows
        return R.reshape(out, [b, s, hq * d])
    return ctx.bb.emit_te(
        functools.partial(_unpack_output, layout=layout), out, b=b, s=s, primfunc_name_hint="unpack_attention"
    )
