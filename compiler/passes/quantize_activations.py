"""Rewrite (int8 activations, W8A8 / W4A8): the input of every MatMul that reads an int8
or int4 weight
goes through a quantizing ONNX function first: a model-local function (domain
FUNCTION_DOMAIN) whose body is standard ops, so onnxruntime runs the quantized graph as
the oracle and the lowering sees one node to turn into integer kernels
(``lower/converters/quantized.py``, ``lower/kernels/cpu_int8_matmul.py``).

Before (after ``quantize_weights``):   MatMul(x, DQ(q int8, scale, block 32) [-> Transpose])
After:                                  MatMul(QuantizeActivations(x), ...)

QuantizeActivations(x [..., K]), K a multiple of 32, per block of BLOCK (16) consecutive
inputs:  s = max(max |x|, 1e-30) / 127;  y = clip(round(x / s), -127, 127) * s
(round half to even: ONNX Round). The LM head (the MatMul whose output is the graph's
logits) takes QuantizeActivationsResidual instead,
y = q(x) + q(x - q(x)): two int8 levels, ~15 bits, so the logits lose nothing measurable
(one level cost 0.5 points of top-1 agreement on the default model). One node per
distinct activation: q/k/v read one, and gate/up one. int8 weights in blocks of 32 and
int4 weights in blocks of a multiple of 16 take it (W8A8, W4A8).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

FUNCTION_DOMAIN = "kiln.functions"
FUNCTION = "QuantizeActivations"
RESIDUAL_FUNCTION = "QuantizeActivationsResidual"
FUNCTIONS = {FUNCTION: 1, RESIDUAL_FUNCTION: 2}  # name -> int8 levels
BLOCK = 16  # inputs per activation scale
WEIGHT_BLOCK = 32
Q_MAX = 127.0
TINY = 1e-30


def _is_onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _integer_weight(value: ir.Value) -> bool:
    """``value`` (a MatMul's B) is a dequantized initializer the dot-product kernels take:
    int8 in blocks of 32 (possibly transposed), or uint4 in blocks of a multiple of 16
    through the int4 minimum chain (Reshape, Add, Reshape [, Slice])."""
    node = value.producer()
    while node is not None and any(_is_onnx(node, op) for op in ("Transpose", "Reshape", "Add", "Slice")):
        node = node.inputs[0].producer()
    if not _is_onnx(node, "DequantizeLinear") or node.inputs[0].const_value is None:
        return False
    block = node.attributes.get("block_size")
    block = int(block.value) if block is not None else 0
    if node.inputs[0].dtype == ir.DataType.INT8:
        return block == WEIGHT_BLOCK
    return node.inputs[0].dtype == ir.DataType.UINT4 and block > 0 and block % BLOCK == 0


def _const(name: str, array: np.ndarray) -> ir.Node:
    node = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(array, name=name))],
                   num_outputs=1, name=name)
    node.outputs[0].name = name
    return node


def quantize_function(name: str = FUNCTION) -> ir.Function:
    """The function's body: standard opset-23 ops (module docstring)."""
    x = ir.Value(name="x")
    nodes = [
        _const("blocks_shape", np.array([-1, BLOCK], np.int64)),
        _const("tiny", np.array(TINY, np.float32)),
        _const("q_max", np.array(Q_MAX, np.float32)),
        _const("q_min", np.array(-Q_MAX, np.float32)),
    ]
    blocks_shape, tiny, q_max, q_min = (n.outputs[0] for n in nodes)

    def add(op: str, inputs, name: str, attrs=()):
        node = ir.Node("", op, inputs, attributes=list(attrs), num_outputs=1, name=name)
        node.outputs[0].name = name
        nodes.append(node)
        return node.outputs[0]

    axes = _axes(nodes)

    def level(blocks, tag: str):
        amax = add("ReduceMax", [add("Abs", [blocks], f"magnitude{tag}"), axes], f"amax{tag}",
                   [ir.AttrInt64("keepdims", 1)])
        scale = add("Div", [add("Max", [amax, tiny], f"amax_floor{tag}"), q_max], f"scale{tag}")
        levels = add("Clip", [add("Round", [add("Div", [blocks, scale], f"scaled{tag}")], f"rounded{tag}"), q_min,
                              q_max], f"levels{tag}")
        return add("Mul", [levels, scale], f"dequantized{tag}")

    shape = add("Shape", [x], "shape")
    blocks = add("Reshape", [x, blocks_shape], "blocks")  # [rows * K / 16, 16]
    y = level(blocks, "")
    if FUNCTIONS[name] == 2:
        y = add("Add", [y, level(add("Sub", [blocks, y], "residual"), "_residual")], "both_levels")
    y = add("Reshape", [y, shape], "y")
    graph = ir.Graph([x], [y], nodes=nodes, opset_imports={"": 23}, name=name)
    return ir.Function(FUNCTION_DOMAIN, name, graph=graph, attributes={})


def _axes(nodes: list[ir.Node]) -> ir.Value:
    node = _const("last_axis", np.array([-1], np.int64))
    nodes.append(node)
    return node.outputs[0]


def quantize_activations(model: ir.Model) -> ir.Model:
    """Rewrites ``model`` in place (module docstring) and returns it."""
    graph = model.graph
    quantized: dict[tuple[str, str], ir.Value] = {}  # (activation, function) -> the function's output
    for node in list(graph):
        if not _is_onnx(node, "MatMul") or not _integer_weight(node.inputs[1]):
            continue
        # The LM head: its output is the graph's logits.
        kind = "head" if node.outputs[0].is_graph_output() else "projection"
        x = node.inputs[0]
        k = x.shape[-1] if x.shape is not None and len(x.shape) else None
        if not isinstance(k, int) or k % WEIGHT_BLOCK:
            continue
        name = RESIDUAL_FUNCTION if kind == "head" else FUNCTION
        if (x.name, name) not in quantized:
            out = f"{x.name}.{'quantized_residual' if kind == 'head' else 'quantized'}"
            q = ir.Node(FUNCTION_DOMAIN, name, [x], num_outputs=1, name=out)
            q.outputs[0].name = out
            q.outputs[0].shape, q.outputs[0].type = x.shape, x.type
            graph.insert_before(node, q)
            quantized[(x.name, name)] = q.outputs[0]
        node.replace_input_with(0, quantized[(x.name, name)])
    for name in sorted({name for _, name in quantized}):
        function = quantize_function(name)
        model.functions[function.identifier()] = function
    if quantized:
        graph.opset_imports[FUNCTION_DOMAIN] = 1
        model.opset_imports[FUNCTION_DOMAIN] = 1
    return model
