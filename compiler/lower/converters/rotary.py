"""RotaryEmbedding (opset 23) as one element-wise TE kernel, no reshapes.

x is [B, S, H*D] (3-D, ``num_heads`` given) or [B, H, S, D]; cos/sin are
[max_position, R/2] gathered by position_ids [B, S] (or [B, S, R/2] without them), where
R = rotary_embedding_dim (default D). Dims past R pass through unchanged.
"""

from __future__ import annotations

from tvm import te, tirx

from ..context import attr, shape
from ..registry import converter


def _rotary_te(x, cos, sin, pos, *, head_dim, rot_dim, interleaved, three_d):
    half = rot_dim // 2

    def angle_index(b, s):
        return (pos[b, s],) if pos is not None else (b, s)

    def compute(*idx):
        if three_d:
            b, s, j = idx
            d = j % head_dim
            at = lambda dd: x[b, s, j - d + dd]  # noqa: E731  same head, dim dd
        else:
            b, h, s, d = idx
            at = lambda dd: x[b, h, s, dd]  # noqa: E731
        p = angle_index(b, s)
        if interleaved:
            i = d // 2
            even = d % 2 == 0
            c, sn = cos[(*p, i)], sin[(*p, i)]
            rotated = tirx.if_then_else(even, at(d) * c - at(d + 1) * sn, at(d) * c + at(d - 1) * sn)
        else:
            lo = d < half
            i = tirx.if_then_else(lo, d, d - half)
            c, sn = cos[(*p, i)], sin[(*p, i)]
            rotated = tirx.if_then_else(lo, at(d) * c - at(d + half) * sn, at(d) * c + at(d - half) * sn)
        if rot_dim == head_dim:
            return rotated
        return tirx.if_then_else(d < rot_dim, rotated, at(d))

    return te.compute(x.shape, compute, name="rotary_embedding")


@converter("RotaryEmbedding")
def rotary_embedding(ctx, node, inputs):
    x, cos, sin = inputs[0], inputs[1], inputs[2]
    pos = inputs[3] if len(inputs) > 3 else None
    dims = shape(x)
    three_d = len(dims) == 3
    if three_d:
        heads = attr(node, "num_heads", 0)
        if not heads:
            raise ValueError(f"RotaryEmbedding {node.name!r}: 3-D input needs num_heads")
        head_dim = int(dims[2]) // heads
    else:
        head_dim = int(dims[3])
    rot_dim = attr(node, "rotary_embedding_dim", 0) or head_dim
    return ctx.bb.emit_te(
        _rotary_te, x, cos, sin, pos,
        head_dim=head_dim, rot_dim=rot_dim, interleaved=bool(attr(node, "interleaved", 0)),
        three_d=three_d, primfunc_name_hint="rotary_embedding",
        # Element-wise apart from the position gather, which AnnotateTIROpPattern reads as
        # opaque: injective lets FuseOps fold it into its consumer (the paged-attention
        # q/k/v packing) instead of leaving a kernel and an intermediate tensor per call.
        primfunc_attrs={"op_pattern": 2},  # kInjective
    )
