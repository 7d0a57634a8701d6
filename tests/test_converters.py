"""Kiln's ONNX -> Relax converters against onnxruntime, one op at a time, on small
graphs with fresh random data (the ONNX reference semantics are ORT's)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kiln.compiler.lower.importer import import_graphs
from kiln.compiler.lower.pipeline import relax_pipeline
from kiln.compiler.lower.registry import registered_ops
from kiln.compiler.targets import parse_target
from kiln.runtime.errors import UnsupportedModelError

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    import tvm
    from tvm import relax

    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    irm = ir.serde.deserialize_model(model)
    mod, params = import_graphs({"main": irm})
    target = parse_target("llvm").tvm_target()
    exe = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    weights = {n: v.const_value.numpy() for n, v in irm.graph.initializers.items()}
    args = [tvm.runtime.tensor(feeds[v.name]) for v in irm.graph.inputs]
    out = vm["main"](*args, [tvm.runtime.tensor(weights[p.name]) for p in params.specs])
    return expected, [o.numpy() for o in out]


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("three_d", [True, False])
def test_rotary_embedding(interleaved, three_d):
    rng = np.random.default_rng()
    b, s, h, d, max_pos = 2, 5, 3, 8, 16
    x_shape = [b, s, h * d] if three_d else [b, h, s, d]
    attrs = {"interleaved": interleaved}
    if three_d:
        attrs["num_heads"] = h
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], **attrs)
    model = _model([node], [_vi("x", F, x_shape), _vi("cos", F, [max_pos, d // 2]),
                            _vi("sin", F, [max_pos, d // 2]), _vi("pos", I64, [b, s])], [_vi("y", F, x_shape)])
    angles = rng.uniform(0, 6.3, (max_pos, d // 2))
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
             "pos": rng.integers(0, max_pos, (b, s)).astype(np.int64)}
    expected, got = _run_both(model, feeds)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("case", ["causal-prefill", "decode-with-past", "past-block-causal", "bool-mask"])
def test_attention(heads, kv_heads, case):
    rng = np.random.default_rng()
    b, d = 2, 8
    s, p = {"causal-prefill": (6, 0), "decode-with-past": (1, 5), "past-block-causal": (3, 4), "bool-mask": (4, 0)}[case]
    inputs = [_vi("q", F, [b, s, heads * d]), _vi("k", F, [b, s, kv_heads * d]), _vi("v", F, [b, s, kv_heads * d])]
    names = ["q", "k", "v"]
    feeds = {n: rng.standard_normal((b, s, (heads if n == "q" else kv_heads) * d)).astype(np.float32) for n in names}
    if case == "bool-mask":
        inputs.append(_vi("mask", TensorProto.BOOL, [s, s]))
        mask = rng.random((s, s)) > 0.3
        mask[:, 0] = True  # every query sees at least one key
        feeds["mask"] = mask
        names.append("mask")
    else:
        names.append("")
    if p:
        inputs += [_vi("pk", F, [b, kv_heads, p, d]), _vi("pv", F, [b, kv_heads, p, d])]
        names += ["pk", "pv"]
        feeds["pk"] = rng.standard_normal((b, kv_heads, p, d)).astype(np.float32)
        feeds["pv"] = rng.standard_normal((b, kv_heads, p, d)).astype(np.float32)
    causal = case in ("causal-prefill", "past-block-causal")
    node = helper.make_node("Attention", names, ["y", "present_k", "present_v"], is_causal=int(causal),
                            q_num_heads=heads, kv_num_heads=kv_heads)
    outputs = [_vi("y", F, [b, s, heads * d]), _vi("present_k", F, [b, kv_heads, p + s, d]),
               _vi("present_v", F, [b, kv_heads, p + s, d])]
    expected, got = _run_both(_model([node], inputs, outputs), feeds)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_rms_norm_linear_gemm_silu_chain():
    rng = np.random.default_rng()
    hidden, out = 16, 12
    w = rng.standard_normal((out, hidden)).astype(np.float32)
    e = rng.standard_normal((20, hidden)).astype(np.float32)
    nodes = [
        helper.make_node("RMSNormalization", ["x", "scale"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["n", "wt"], ["m"]),
        helper.make_node("Sigmoid", ["m"], ["sg"]),
        helper.make_node("Mul", ["m", "sg"], ["silu"]),
        helper.make_node("Gather", ["silu", "last"], ["lastrow"], axis=1),
        helper.make_node("Gemm", ["n2", "e"], ["logits"], transB=1),
        helper.make_node("RMSNormalization", ["lastrow", "scale2"], ["n2"], axis=-1, epsilon=1e-6),
    ]
    nodes = nodes[:6] + [nodes[7], nodes[6]]
    inits = [
        helper.make_tensor("scale", F, [hidden], rng.standard_normal(hidden).astype(np.float32)),
        helper.make_tensor("w", F, [out, hidden], w.flatten()),
        helper.make_tensor("e", F, [20, out], np.ascontiguousarray(e[:, :out]).flatten()),
        helper.make_tensor("scale2", F, [out], rng.standard_normal(out).astype(np.float32)),
        helper.make_tensor("last", I64, [], [-1]),
    ]
    model = _model(nodes, [_vi("x", F, [3, 7, hidden])], [_vi("logits", F, [3, 20])], inits)
    expected, got = _run_both(model, {"x": rng.standard_normal((3, 7, hidden)).astype(np.float32)})
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_unknown_op_names_the_op():
    node = helper.make_node("Hardmax", ["x"], ["y"])
    model = _model([node], [_vi("x", F, [2, 3])], [_vi("y", F, [2, 3])])
    with pytest.raises(UnsupportedModelError, match="Hardmax"):
        import_graphs({"main": ir.serde.deserialize_model(model)})


def test_registry_covers_the_exported_op_set():
    ops = {op for _, op in registered_ops()}
    assert {"Attention", "RotaryEmbedding", "RMSNormalization", "MatMul", "Gemm", "Gather", "Transpose"} <= ops


def test_sigmoid_and_silu_are_accurate_over_the_float_range():
    """Sigmoid runs a polynomial exp (no libm call per element). Reference: float64 numpy,
    to 1e-6 relative over the whole range, tails included (there onnxruntime's own
    approximation is the less accurate one: it is checked only where it is exact enough)."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((1, 37, 64)) * 12).astype(np.float32)
    x[0, 0, :8] = [-100.0, -88.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 100.0]
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["silu"])]
    model = _model(nodes, [_vi("x", F, [1, "n", 64])], [_vi("s", F, [1, "n", 64]), _vi("silu", F, [1, "n", 64])])
    expected, got = _run_both(model, {"x": x})
    sig = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(got[0], sig, rtol=1e-6, atol=1e-37)
    np.testing.assert_allclose(got[1], x * sig, rtol=1e-6, atol=1e-37)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
