"""Rewrite: attention over explicit past/present KV -> one ``kiln::PagedAttention`` per
layer, whose KV state is the runtime's paged KV cache object instead of graph I/O.

Before (per layer, opset 23):
    y, present.{i}.key, present.{i}.value = Attention(q, k, v, [mask], past.{i}.key, past.{i}.value)
After:
    y = kiln::PagedAttention(q, k, v) {layer_id, q_num_heads, kv_num_heads, scale}

q [B, S, Hq*D] and k [B, S, Hkv*D] arrive with RoPE applied (by the graph's own
RotaryEmbedding, from explicit position ids), so the cache applies none. The past KV graph
inputs and present KV graph outputs disappear. layer_id follows the order of the Attention
nodes in the graph (which is the layer order). Only causal self-attention without a mask
is accepted: that is what the cache computes.
"""

from __future__ import annotations

import math

import onnx_ir as ir

DOMAIN = "kiln"
OP = "PagedAttention"


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def rewrite_paged_attention(model: ir.Model) -> ir.Model:
    graph = model.graph
    attention = [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not attention:
        raise ValueError("paged_attention: the graph has no Attention node")
    dropped_inputs: set[ir.Value] = set()
    dropped_outputs: set[ir.Value] = set()
    for layer_id, node in enumerate(attention):
        inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
        q, k, v, mask, past_k, past_v = inputs[:6]
        if mask is not None:
            raise ValueError(f"paged_attention: Attention {node.name!r} has an attention mask")
        if past_k is None and not _attr(node, "is_causal", 0):
            raise ValueError(f"paged_attention: Attention {node.name!r} is neither causal nor over a past")
        if _attr(node, "softcap", 0.0):
            raise ValueError(f"paged_attention: Attention {node.name!r} uses softcap")
        hq, hkv = _attr(node, "q_num_heads", 0), _attr(node, "kv_num_heads", 0)
        if not hq or not hkv or q.shape is None or len(q.shape) != 3:
            raise ValueError(f"paged_attention: Attention {node.name!r} must take 3-D q/k/v with head counts")
        head_dim = int(q.shape[2]) // hq
        scale = _attr(node, "scale", None) or 1.0 / math.sqrt(head_dim)
        paged = ir.Node(
            DOMAIN, OP, [q, k, v],
            attributes=[ir.AttrInt64("layer_id", layer_id), ir.AttrInt64("q_num_heads", hq),
                        ir.AttrInt64("kv_num_heads", hkv), ir.AttrFloat32("scale", scale)],
            num_outputs=1, name=f"paged_attention_{layer_id}",
        )
        y = node.outputs[0]
        paged.outputs[0].name = y.name
        paged.outputs[0].shape, paged.outputs[0].type = y.shape, y.type
        graph.insert_before(node, paged)
        y.replace_all_uses_with(paged.outputs[0], replace_graph_outputs=True)
        for present in node.outputs[1:]:
            if present.is_graph_output():
                dropped_outputs.add(present)
        for past in (past_k, past_v):
            if past is not None and past.is_graph_input():
                dropped_inputs.add(past)
        # Detach the old node's inputs so the past graph inputs become unused.
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)
    graph.outputs[:] = [o for o in graph.outputs if o not in dropped_outputs]
    for node in attention:
        graph.remove(node, safe=False)
    graph.inputs[:] = [i for i in graph.inputs if i not in dropped_inputs]
    graph.opset_imports[DOMAIN] = 1
    model.opset_imports[DOMAIN] = 1
    return model
