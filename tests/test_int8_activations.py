"""int8 activations (W8A8, W4A8): the activation quantizer and the dot-product matmuls (every ISA
this host has: AVX-512 VNNI, AVX2) against
numpy's integer arithmetic, the ONNX function against numpy in onnxruntime, the graph
rewrite's structure, and the refusals. Whole artifacts are held to onnxruntime in
test_quant_lowering.py, the default model's quality in test_quant_quality.py."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from kiln.compiler.lower.kernels import cpu_int4_matmul as K4
from kiln.compiler.lower.kernels import cpu_int8_matmul as K
from kiln.compiler.targets import parse_target

HOST_ISAS = parse_target("llvm").dot_isas()
needs_dot = pytest.mark.skipif(not HOST_ISAS, reason="this CPU has neither AVX-512 VNNI nor AVX2")
# Each kernel ISA, skipped where this host lacks it.
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in HOST_ISAS, reason=f"this CPU lacks {isa}"))
        for isa in K.ISAS]


def _build(*funcs):
    target = parse_target("llvm").tvm_target()
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs})
    return tvm.compile(mod, target=target)


def _activations(rng, m, k):
    """Rows of very different magnitudes, one all-zero block, one block with an outlier."""
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10.0, (m, 1))).astype(np.float32)
    x[0, :K.ACT_BLOCK] = 0
    x[-1, 3] *= 50
    return x


def _quantize(lib, x, levels):
    m, k = x.shape
    rows, nb = m * levels, k // K.ACT_BLOCK
    out = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in (((rows, k), np.int8), ((rows, nb), np.float32),
                                                           ((rows, nb), np.int32))]
    lib["q"](tvm.runtime.tensor(x), *out)
    return [a.numpy() for a in out]


@needs_dot
@pytest.mark.parametrize("levels", [1, 2])
def test_activation_quantizer_matches_numpy(levels):
    rng = np.random.default_rng()
    k = 96
    lib = _build(("q", K.quantize_rows(k, levels)))
    for m in (1, 5):
        x = _activations(rng, m, k)
        xq, xs, xc = _quantize(lib, x, levels)
        levels_ref, scales_ref = K.quantize_rows_numpy(x, levels)
        assert (xq == levels_ref).all() and (xs == scales_ref).all()
        assert (xc == -128 * xq.reshape(m * levels, -1, K.ACT_BLOCK).astype(np.int32).sum(-1)).all()
        assert (np.abs(xq) <= 127).all() and (xq[0, :K.ACT_BLOCK] == 0).all()
        # Dequantized, the levels reproduce x within half a step of each level's scale.
        back = (xq.reshape(m, levels, -1, K.ACT_BLOCK).astype(np.float64)
                * xs.reshape(m, levels, -1, 1)).sum(1).reshape(m, k)
        step = xs.reshape(m, levels, -1)[:, -1].repeat(K.ACT_BLOCK, axis=1)
        assert (np.abs(back - x) <= step / 2 * 1.001 + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (64, 576)])
def test_int8_dot_matmul_matches_integer_arithmetic(levels, n, k, isa):
    """Every row count around the kernel's row tiles (tails repeat the last row and are not
    written): numpy's exact integer block dots, scaled in float64. Weights span the full
    int8 range and activation blocks hit ±127, where AVX2's saturating pair sums would show."""
    rng = np.random.default_rng()
    lib = _build(("q", K.quantize_rows(k, levels)), ("mm", K.int8_matmul(n, k, isa)))
    wq = rng.integers(-127, 128, (n, k)).astype(np.int8)
    ws = rng.uniform(0.001, 0.02, (n, k // K.BLOCK)).astype(np.float16).astype(np.float32)
    w, s = tvm.runtime.tensor(K.pack_weight(wq)), tvm.runtime.tensor(K.pack_scales(ws))
    for m in (1, 3, 4, 5, 9):
        x = _activations(rng, m, k)
        xq, xs, xc = _quantize(lib, x, levels)
        out = tvm.runtime.tensor(np.full((m * levels, n), np.nan, np.float32))
        lib["mm"](*(tvm.runtime.tensor(a) for a in (xq, xs, xc)), w, s, out)
        rows = m * levels
        dots = np.einsum("mbg,nbg->mnb", xq.reshape(rows, -1, K.ACT_BLOCK).astype(np.int64),
                         wq.reshape(n, -1, K.ACT_BLOCK).astype(np.int64))
        w_scale = np.repeat(ws, K.BLOCK // K.ACT_BLOCK, axis=1).astype(np.float64)
        ref = (dots * xs[:, None, :].astype(np.float64) * w_scale[None]).sum(-1)
        got = out.numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        # Against the float product: one level is int8-accurate, two ~15 bits.
        exact = x.astype(np.float64) @ (wq * np.repeat(ws, K.BLOCK, axis=1)).T.astype(np.float64)
        err = np.abs(got.reshape(m, levels, n).sum(1) - exact).max() / np.abs(exact).max()
        assert err < (0.03 if levels == 1 else 2e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k,group", [(32, 32, 32), (96, 64, 32), (64, 128, 64), (32, 256, 128)])
def test_int4_dot_matmul_matches_numpy(n, k, group, isa):
    """W4A8: nibbles q in [0, 15] with a scale and minimum per block of ``group``, against
    the dequantized activations times the dequantized weight in float64."""
    rng = np.random.default_rng()
    lib = _build(("q", K.quantize_rows(k, 1)), ("mm", K4.int4_matmul(n, k, group, isa)))
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float16).astype(np.float32)
    low = rng.uniform(-0.2, 0.05, (n, k // group)).astype(np.float16).astype(np.float32)
    w = np.repeat(low, group, axis=1) + q * np.repeat(d, group, axis=1)
    params = [tvm.runtime.tensor(a) for a in (K4.pack_weight(q), K4.pack_scales(d), K4.pack_scales(low))]
    for m in (1, 4, 5, 9):
        x = _activations(rng, m, k)
        xq, xs, xc = _quantize(lib, x, 1)
        out = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["mm"](*(tvm.runtime.tensor(a) for a in (xq, xs, xc)), *params, out)
        levels = (xq.reshape(m, -1, K.ACT_BLOCK).astype(np.float64) * xs[..., None]).reshape(m, k)
        ref = levels @ w.T.astype(np.float64)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_dot_layout_round_trips_through_the_dequantizing_reader(kind):
    """A weight stored for the dot kernels is still read element by element (a tied
    embedding's Gather): ``dequant_value`` at every (row, column) gives the weight back."""
    from tvm import te

    from kiln.compiler.lower.quant_weights import WeightStorage, stored_arrays, stored_specs, take_rows_te

    rng = np.random.default_rng()
    rows, cols = 64, 96
    s = rng.uniform(0.001, 0.02, (rows, cols // 32)).astype(np.float16).astype(np.float32)
    if kind == "int8":
        q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
        storage = WeightStorage("int8", rows, cols, "w", "s", 32, False, int8_dot=True)
        arrays, weight = stored_arrays(storage, q, s), q * np.repeat(s, 32, axis=1)
    else:
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        low = rng.uniform(-0.2, 0.05, (rows, cols // 32)).astype(np.float16).astype(np.float32)
        storage = WeightStorage("int4", rows, cols, "w", "s", 32, False, "m", int8_dot=True)
        arrays = stored_arrays(storage, q, s, low)
        weight = np.repeat(low, 32, axis=1) + q * np.repeat(s, 32, axis=1)
    specs = stored_specs(storage)
    assert {name: (a.shape, str(a.dtype)) for name, a in arrays.items()} == {
        name: (tuple(shape), dtype) for name, (shape, dtype) in specs.items()}
    ids = te.placeholder((rows,), "int64", "ids")
    params = [te.placeholder(shape, dtype, name) for name, (shape, dtype) in specs.items()]
    out = take_rows_te(storage)(ids, *params)
    target = parse_target("llvm").tvm_target()
    fn = tvm.compile(te.create_prim_func([ids, *params, out]), target=target)
    got = tvm.runtime.tensor(np.zeros((rows, cols), np.float32))
    fn(tvm.runtime.tensor(np.arange(rows, dtype=np.int64)), *(tvm.runtime.tensor(arrays[n]) for n in specs), got)
    np.testing.assert_allclose(got.numpy(), weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("function,levels", [("QuantizeActivations", 1), ("QuantizeActivationsResidual", 2)])
def test_onnx_function_matches_numpy_in_onnxruntime(function, levels):
    """The graph's function (what onnxruntime runs as the oracle) is the kernels' arithmetic."""
    import onnx_ir as ir
    import onnxruntime as ort

    from kiln.compiler.passes.quantize_activations import FUNCTION_DOMAIN, quantize_function

    rng = np.random.default_rng()
    x_value = ir.Value(name="x", shape=ir.Shape([2, 3, 64]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node(FUNCTION_DOMAIN, function, [x_value], num_outputs=1, name="q")
    node.outputs[0].name = "y"
    node.outputs[0].shape, node.outputs[0].type = ir.Shape([2, 3, 64]), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x_value], [node.outputs[0]], nodes=[node], opset_imports={"": 23, FUNCTION_DOMAIN: 1})
    fn = quantize_function(function)
    model = ir.Model(graph, ir_version=10, functions=[fn])
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = _activations(rng, 6, 64).reshape(2, 3, 64)
    got = sess.run(None, {"x": x})[0]
    q, s = K.quantize_rows_numpy(x.reshape(6, 64), levels)
    ref = (q.reshape(6, levels, -1, K.ACT_BLOCK).astype(np.float64) * s.reshape(6, levels, -1, 1)).sum(1)
    # Two levels: onnxruntime rounds x - q0 * s0 twice (Mul, Sub), numpy once, which may
    # move a residual level by one step (its scale); one level is exact up to float32.
    last = np.repeat(s.reshape(6, levels, -1)[:, -1], K.ACT_BLOCK, axis=1).reshape(2, 3, 64)
    tolerance = (last * 1.001 if levels == 2 else 0) + 1e-6 * np.abs(x)
    assert (np.abs(got - ref.reshape(2, 3, 64)) <= tolerance).all()
    assert not np.array_equal(got, x)


def test_rewrite_quantizes_each_int8_matmul_input_once(checkpoint):
    """One function node per distinct activation (q/k/v share one, gate/up one), the LM
    head's with two levels; the rewritten graph runs in onnxruntime and differs from the
    weight-only graph by the activations' rounding only."""
    import onnx_ir as ir
    import onnxruntime as ort

    from kiln.compiler.export.onnx_export import export_graphs
    from kiln.compiler.models.source import resolve_model
    from kiln.compiler.passes.quantize_activations import FUNCTION, RESIDUAL_FUNCTION, quantize_activations
    from kiln.compiler.passes.quantize_weights import quantize_weights
    from kiln.runtime.quantization import parse_quant

    source = resolve_model(checkpoint("llama"))
    weight_only = quantize_weights(parse_quant("int8"))(export_graphs(source.build_module()).prefill)
    proto = ir.to_proto(weight_only)
    rewritten = quantize_activations(ir.from_proto(proto))
    ops = [n.op_type for n in rewritten.graph]
    layers = source.config.num_layers
    # Per layer: attention input, o_proj input, MLP input, down_proj input.
    assert ops.count(FUNCTION) == 4 * layers
    assert ops.count(RESIDUAL_FUNCTION) == 1
    for node in rewritten.graph:
        if node.op_type == "MatMul" and node.inputs[1].producer() is not None and \
                "dequantize" in (node.inputs[1].producer().name or "") + (node.inputs[1].name or ""):
            assert node.inputs[0].producer().op_type in (FUNCTION, RESIDUAL_FUNCTION), node.name

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    rng = np.random.default_rng()
    ids = rng.integers(0, source.config.vocab_size, (1, 9), dtype=np.int64)
    feeds = {"input_ids": ids, "position_ids": np.arange(9, dtype=np.int64)[None]}
    a, b = (ort.InferenceSession(ir.to_proto(m).SerializeToString(), options).run(["logits"], feeds)[0]
            for m in (ir.from_proto(proto), rewritten))
    assert 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_int8_activations_are_refused_where_they_cannot_run():
    from kiln.compiler.compile import CompileOptions, default_activations
    from kiln.runtime.quantization import parse_quant

    with pytest.raises(ValueError, match="avx512_vnni or avx2"):
        CompileOptions(parse_target("llvm:x86-64-v2"), quant=parse_quant("w8a8"))
    with pytest.raises(ValueError, match="avx512_vnni or avx2"):
        CompileOptions(parse_target("cuda"), quant=parse_quant("int8", activations="int8"))
    # x86-64-v3 (AVX2) builds the AVX2 kernels; Zen 4 the VNNI ones.
    assert parse_target("llvm:x86-64-v3").dot_isa == "avx2" and parse_target("llvm:znver4").dot_isa == "avx512_vnni"
    CompileOptions(parse_target("llvm:x86-64-v3"), quant=parse_quant("w8a8"))
    with pytest.raises(ValueError, match="int8 or int4 weights"):
        parse_quant("fp16", activations="int8")
    assert parse_quant("w4a8").scheme.name == "int4-g32" and parse_quant("int4-g64", activations="int8").name == "int4-g64"
    assert parse_quant("w8a8", activations="float32").activations == "float32"
    assert parse_quant("w8a8").name == "w8a8" and parse_quant("int8", activations="int8").name == "w8a8"
    # kiln compile's default: int8 activations for int8 and int4 weights where the CPU has
    # integer dot products (VNNI or AVX2).
    host = parse_target("llvm")
    assert default_activations("int8", host) == ("int8" if host.int8_dot else None)
    assert default_activations("int8", parse_target("llvm:x86-64-v3")) == "int8"
    assert default_activations("int8", parse_target("llvm:x86-64-v2")) is None
    assert default_activations("int4-g32", host) == ("int8" if host.int8_dot else None)
    assert default_activations("fp32", host) is None and default_activations("fp16", host) is None
