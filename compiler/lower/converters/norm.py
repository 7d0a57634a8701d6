"""RMSNormalization (opset 23)."""

from __future__ import annotations

from tvm.relax import op as R

from ..context import attr, shape
from ..registry import converter


@converter("RMSNormalization")
def rms_normalization(ctx, node, inputs):
    x, scale = inputs[0], inputs[1]
    rank = len(shape(x))
    axis = attr(node, "axis", -1) % rank
    # ONNX normalizes over axes [axis, rank); Relax takes them explicitly.
    return R.nn.rms_norm(x, scale, axes=list(range(axis, rank)), epsilon=attr(node, "epsilon", 1e-5))
