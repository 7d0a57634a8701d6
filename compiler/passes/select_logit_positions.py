"""Rewrite (ragged prefill): logits for chosen token positions instead of the last one.

A paged prefill runs several sequences' new tokens as one row [1, T]; the engine needs the
logits of each sequence's last token (and, for scoring, of others). The exported graph
selects the last position before the LM head:
    h_last = Gather(h, -1, axis=1)           h [B, S, hidden] -> [B, hidden]
This pass makes the positions a graph input and keeps the rest of the graph 2-D (so the
LM head stays a valid Gemm):
    h_sel = Reshape(Gather(h, logit_positions, axis=1), [-1, hidden])   -> [B*N, hidden]
so the logits become [B*N, V] (the ragged prefill has B = 1: one row per position).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

INPUT = "logit_positions"


def _last_position_gathers(graph: ir.Graph) -> list[ir.Node]:
    found = []
    for node in graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        axis = node.attributes.get("axis")
        index = node.inputs[1]
        const = index.const_value if index.const_value is not None else (
            index.producer().attributes["value"].value if index.producer() is not None
            and index.producer().op_type == "Constant" else None)
        if axis is not None and axis.value == 1 and const is not None:
            array = np.asarray(const.numpy())
            if array.shape == () and int(array) == -1:
                found.append(node)
    return found


def select_logit_positions(model: ir.Model) -> ir.Model:
    graph = model.graph
    gathers = _last_position_gathers(graph)
    if len(gathers) != 1:
        raise ValueError(f"select_logit_positions: expected one last-position Gather, found {len(gathers)}")
    gather = gathers[0]
    positions = ir.Value(name=INPUT, shape=ir.Shape([ir.SymbolicDim("logits")]),
                         type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(positions)
    gather.replace_input_with(1, positions)
    selected = gather.outputs[0]  # now [B, N, hidden]
    consumers = list(selected.uses())
    data_shape = gather.inputs[0].shape
    hidden = data_shape[-1] if data_shape is not None else None
    if not isinstance(hidden, int):
        raise ValueError("select_logit_positions: the hidden size must be static")
    shape = ir.Value(name=f"{INPUT}_flat_shape", const_value=ir.tensor(np.asarray([-1, hidden], dtype=np.int64)),
                     shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.INT64))
    graph.register_initializer(shape)
    flat = ir.Node("", "Reshape", [selected, shape], num_outputs=1, name=f"{INPUT}_flatten")
    flat.outputs[0].name = f"{selected.name}_rows"
    flat.outputs[0].shape = ir.Shape([ir.SymbolicDim("logits"), hidden])
    flat.outputs[0].type = selected.type
    graph.insert_after(gather, flat)
    for user, idx in consumers:
        user.replace_input_with(idx, flat.outputs[0])
    selected.shape = ir.Shape([data_shape[0], ir.SymbolicDim("logits"), hidden])
    for value in graph.outputs:
        if value.name == "logits" and value.shape is not None and len(value.shape) == 2:
            value.shape = ir.Shape([ir.SymbolicDim("logits"), value.shape[1]])
    return model
