"""kiln::PagedAttention -> TVM's paged KV cache (append this step's K/V, attend over the
sequence's cached K/V), through ``vm.builtin.attention_kv_cache_attention_with_fused_qkv``.

q [B, S, Hq*D], k / v [B, S, Hkv*D] (RoPE already applied) are packed as
qkv [B*S, Hq + 2*Hkv, D], the layout the cache takes; the output [B*S, Hq, D] becomes
[B, S, Hq*D] again. Which sequence each of the B*S tokens belongs to, and its position,
is the cache's state for this step (set by the runtime's begin_forward).
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax import op as R

from ..context import attr, dtype, shape
from ..registry import converter


def _pack_qkv(q, k, v, *, hq, hkv, d):
    """q [B, S, Hq*D], k / v [B, S, Hkv*D] -> qkv [B*S, Hq + 2*Hkv, D]."""
    b, s, _ = q.shape

    def compute(t, h, i):
        bi, si = tirx.floordiv(t, s), tirx.floormod(t, s)
        return tirx.if_then_else(
            h < hq, q[bi, si, h * d + i],
            tirx.if_then_else(h < hq + hkv, k[bi, si, (h - hq) * d + i], v[bi, si, (h - hq - hkv) * d + i]))

    return te.compute((b * s, hq + 2 * hkv, d), compute, name="pack_qkv")


@converter("PagedAttention", domain="kiln")
def paged_attention(ctx, node, inputs):
    if ctx.kv_cache is None:
        raise ValueError("PagedAttention needs the function's kv_cache parameter")
    q, k, v = inputs
    hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
    b, s, q_hidden = shape(q)
    d = int(q_hidden) // hq
    tokens = b * s
    # One injective kernel rather than three reshapes and a concat: FuseOps folds the RoPE
    # kernels producing q and k into it (one kernel, no intermediate tensors or views).
    qkv = ctx.bb.emit_te(_pack_qkv, q, k, v, hq=hq, hkv=hkv, d=d, primfunc_name_hint="pack_qkv")
    out = ctx.emit(relax.call_dps_packed(
        "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
        [ctx.kv_cache, relax.prim_value(attr(node, "layer_id")), relax.prim_value(float(attr(node, "scale"))), qkv],
        out_ty=relax.TensorType([tokens, hq, d], dtype(q)),
    ))
    return R.reshape(out, [b, s, hq * d])
