"""kiln::PagedAttention -> TVM's paged KV cache (append this step's K/V, attend over the
sequence's cached K/V), through ``vm.builtin.attention_kv_cache_attention_with_fused_qkv``.

q [B, S, Hq*D], k / v [B, S, Hkv*D] (RoPE already applied) are packed as
qkv [B*S, Hq + 2*Hkv, D], the layout the cache takes; the output [B*S, Hq, D] becomes
[B, S, Hq*D] again. Which sequence each of the B*S tokens belongs to, and its position,
is the cache's state for this step (set by the runtime's begin_forward).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from ..context import attr, dtype, shape
from ..registry import converter


@converter("PagedAttention", domain="kiln")
def paged_attention(ctx, node, inputs):
    if ctx.kv_cache is None:
        raise ValueError("PagedAttention needs the function's kv_cache parameter")
    q, k, v = inputs
    hq, hkv = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
    b, s, q_hidden = shape(q)
    d = int(q_hidden) // hq
    tokens = b * s
    qkv = ctx.emit(R.concat([
        R.reshape(q, [tokens, hq, d]), R.reshape(k, [tokens, hkv, d]), R.reshape(v, [tokens, hkv, d]),
    ], axis=1))
    out = ctx.emit(relax.call_dps_packed(
        "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
        [ctx.kv_cache, relax.prim_value(attr(node, "layer_id")), relax.prim_value(float(attr(node, "scale"))), qkv],
        out_ty=relax.TensorType([tokens, hq, d], dtype(q)),
    ))
    return R.reshape(out, [b, s, hq * d])
