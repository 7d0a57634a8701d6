"""onnxruntime's fast form of an int4 graph, for the benchmark only.

Kiln's int4 is asymmetric with a float16 minimum per block (GGUF's Q4_1):
``DequantizeLinear(q, scale) -> Reshape -> Add(minimum) -> Reshape [-> Slice] -> MatMul``
(``compiler/passes/quantize_weights.py``). onnxruntime runs that graph as written,
materializing every float32 weight each step, because only a bare ``DequantizeLinear ->
MatMul`` becomes its fused 4-bit kernel (MatMulNBits), and ONNX's zero point is an
integer. To time onnxruntime at its best on the same bits, this rewrite turns each chain
into ``DequantizeLinear(q, scale, zero_point) [-> Slice] -> MatMul`` with zero_point =
round(-minimum / scale) clipped to [0, 15]: the same 4-bit codes and scales, the minimum
rounded to a whole step (the numbers differ by up to half a step per block; a speed
comparison only).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.compiler.lower.quant_weights import chain_nodes, storage_of


def integer_zero_points(model: ir.Model) -> ir.Model:
    """Rewrites ``model`` in place and returns it."""
    graph = model.graph
    zero_points: dict[str, ir.Value] = {}
    for node in list(graph):
        storage = storage_of(node) if node.op_type == "DequantizeLinear" else None
        if storage is None or storage.minimum is None:
            continue
        chain = [node, *chain_nodes(node, storage)]
        value = chain[-1].outputs[0]
        q, scale = node.inputs[0], node.inputs[1]
        if q.name not in zero_points:
            minimum = graph.initializers[storage.minimum].const_value.numpy()[:, 0, :]  # [nb, N]
            zp = np.clip(np.rint(-minimum / scale.const_value.numpy()), 0, 15).astype(np.uint8)
            zero_points[q.name] = ir.Value(name=f"{q.name}.zero_point", shape=ir.Shape(list(zp.shape)),
                                           type=ir.TensorType(ir.DataType.UINT4),
                                           const_value=ir.tensor(zp, dtype=ir.DataType.UINT4))
            graph.register_initializer(zero_points[q.name])
        dq = ir.Node("", "DequantizeLinear", [q, scale, zero_points[q.name]],
                     attributes=list(node.attributes.values()), num_outputs=1, name=f"{node.name}.zp")
        dq.outputs[0].shape, dq.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        new = [dq]
        if chain[-1].op_type == "Slice":
            sliced = ir.Node("", "Slice", [dq.outputs[0], *chain[-1].inputs[1:]], num_outputs=1,
                             name=f"{chain[-1].name}.zp")
            sliced.outputs[0].shape, sliced.outputs[0].type = value.shape, value.type
            new.append(sliced)
        graph.insert_before(chain[0], new)
        value.replace_all_uses_with(new[-1].outputs[0])
        for old in reversed(chain):
            graph.remove(old, safe=True)
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_input()]:
        graph.initializers.pop(name)
    return model
