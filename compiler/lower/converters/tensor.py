"""Data movement: Gather, Transpose, Reshape, Concat, Constant, Unsqueeze, Squeeze."""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax import op as R

from ..context import attr, shape
from ..registry import converter
from . import quantized


@converter("Gather")
def gather(ctx, node, inputs):
    data, indices = inputs
    axis = attr(node, "axis", 0)
    fused = quantized.fused_take(ctx, node, inputs, axis)
    if fused is not None:
        return fused
    # ONNX allows negative indices; "wrap" maps -1 to the last element along axis.
    known = ctx.constant(node.inputs[1])
    mode = "wrap" if known is None or np.any(known < 0) else "fast"
    return R.take(data, indices, axis=axis, mode=mode)


@converter("Transpose")
def transpose(ctx, node, inputs):
    perm = attr(node, "perm")
    quantized.flip(ctx, node)
    return R.permute_dims(inputs[0], None if perm is None else list(perm))


@converter("Constant")
def constant(ctx, node, inputs):
    value = attr(node, "value")
    if value is None:
        raise ValueError(f"Constant node {node.name!r}: only the 'value' attribute is supported")
    array = value.numpy()
    ctx.constants[node.outputs[0].name] = array
    return relax.const(array)


@converter("Concat")
def concat(ctx, node, inputs):
    return R.concat([x for x in inputs if x is not None], axis=attr(node, "axis"))


@converter("Reshape")
def reshape(ctx, node, inputs):
    target = ctx.constant(node.inputs[1])
    if target is None:
        raise ValueError(f"Reshape {node.name!r}: target shape must be a compile-time constant")
    src = shape(inputs[0])
    dims = []
    for i, d in enumerate(target.tolist()):
        dims.append(src[i] if d == 0 and not attr(node, "allowzero", 0) else d)
    return R.reshape(inputs[0], dims)


@converter("Unsqueeze")
def unsqueeze(ctx, node, inputs):
    axes = ctx.constant(node.inputs[1])
    return R.expand_dims(inputs[0], [int(a) for a in axes.tolist()])


@converter("Squeeze")
def squeeze(ctx, node, inputs):
    axes = ctx.constant(node.inputs[1]) if len(node.inputs) > 1 else None
    return R.squeeze(inputs[0], None if axes is None else [int(a) for a in axes.tolist()])
