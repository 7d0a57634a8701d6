"""Attention (opset 23) over explicit past/present KV, grouped-query aware.

Q [B, S, Hq*D] or [B, Hq, S, D]; K, V likewise with Hkv heads; past_key/past_value
[B, Hkv, P, D]. present = concat(past, new) along the sequence axis: [B, Hkv, T, D],
T = P + S. Query heads are grouped per KV head (G = Hq / Hkv) so each KV head is read
once: scores [B, Hkv, G*S, T]. The causal mask is bottom-right aligned (query i of this
block sees key j iff j <= i + P), as the ONNX reference defines it.
"""

from __future__ import annotations

import math

from tvm import relax, te, tirx
from tvm.relax import op as R

from ..context import attr, dtype, shape
from ..registry import converter


def _to_heads(ctx, x, heads):
    """[B, S, H*D] -> [B, H, S, D]; 4-D inputs pass through."""
    dims = shape(x)
    if len(dims) == 4:
        return x
    b, s, hidden = dims
    x = ctx.emit(R.reshape(x, [b, s, heads, hidden // heads]))
    return ctx.emit(R.permute_dims(x, [0, 2, 1, 3]))


def _causal_te(scores, seq, offset):
    neg = tirx.min_value(scores.dtype)
    return te.compute(
        scores.shape,
        lambda b, h, r, c: tirx.if_then_else(c <= r % seq + offset, scores[b, h, r, c], neg),
        name="causal_mask",
    )


@converter("Attention")
def attention(ctx, node, inputs):
    inputs = list(inputs) + [None] * (6 - len(inputs))
    q, k, v, mask, past_k, past_v = inputs[:6]
    if len(node.inputs) > 6 and node.inputs[6] is not None:
        raise ValueError(f"Attention {node.name!r}: nonpad_kv_seqlen is not supported")
    if attr(node, "softcap", 0.0):
        raise ValueError(f"Attention {node.name!r}: softcap is not supported")
    three_d = len(shape(q)) == 3
    hq = attr(node, "q_num_heads", 0) or int(shape(q)[1])
    hkv = attr(node, "kv_num_heads", 0) or int(shape(k)[1])
    q, k, v = _to_heads(ctx, q, hq), _to_heads(ctx, k, hkv), _to_heads(ctx, v, hkv)
    b, _, s, d = shape(q)
    if past_k is not None:
        k = ctx.emit(R.concat([past_k, k], axis=2))
        v = ctx.emit(R.concat([past_v, v], axis=2))
    present_k, present_v = k, v
    t = shape(k)[2]
    dv = shape(v)[3]
    group = hq // hkv

    scale = attr(node, "scale", None) or 1.0 / math.sqrt(int(d))
    qg = ctx.emit(R.reshape(q, [b, hkv, group * s, d]))  # [B, Hkv, G*S, D]
    scores = ctx.emit(R.matmul(qg, R.permute_dims(k, [0, 1, 3, 2])))  # [B, Hkv, G*S, T]
    scores = ctx.emit(R.multiply(scores, relax.const(scale, dtype(scores))))
    if mask is not None:
        mask = ctx.emit(R.broadcast_to(mask, [b, hq, s, t]))
        mask = ctx.emit(R.reshape(mask, [b, hkv, group * s, t]))
        if dtype(mask) == "bool":
            neg = relax.const(float("-inf"), dtype(scores))
            scores = ctx.emit(R.where(mask, scores, neg))
        else:
            scores = ctx.emit(R.add(scores, R.astype(mask, dtype(scores))))
    if attr(node, "is_causal", 0):
        offset = t - s if past_k is not None else 0
        scores = ctx.bb.emit_te(_causal_te, scores, s, offset, primfunc_name_hint="causal_mask")
    probs = ctx.emit(R.nn.softmax(scores, axis=-1))
    y = ctx.emit(R.matmul(probs, v))  # [B, Hkv, G*S, Dv]
    y = ctx.emit(R.reshape(y, [b, hq, s, dv]))
    if three_d:
        y = ctx.emit(R.reshape(R.permute_dims(y, [0, 2, 1, 3]), [b, s, hq * dv]))
    return [y, present_k, present_v, None]
