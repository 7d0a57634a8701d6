"""Weight-only quantization: the scheme registry, the numpy quantizers (against plain-loop
references), the rewritten graph's structure, and onnxruntime as the numeric oracle."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from helpers import make_checkpoint
from kiln.compiler.export.onnx_export import export_graphs
from kiln.compiler.models.source import resolve_model
from kiln.compiler.passes.quantize_weights import (
    dequantize_int8_blocks,
    dequantize_uint4_blocks,
    quantize_int8_blocks,
    quantize_uint4_blocks,
    quantize_weights,
)
from kiln.runtime.quantization import SCHEMES, QuantConfig, QuantScheme, parse_quant, quant_from_record

QUANTIZED = [name for name, s in SCHEMES.items() if s.kind != "float"]
F32_EPS = np.finfo(np.float32).eps


# --------------------------------------------------------------------------------------
# plain-loop references


def _f16(x) -> np.float32:
    return np.float32(np.float16(np.float32(x)))


def ref_int8(w, g):
    rows, cols = w.shape
    q = np.zeros(w.shape, np.int8)
    scale = np.zeros((rows, math.ceil(cols / g)), np.float32)
    for r in range(rows):
        for b in range(scale.shape[1]):
            block = w[r, b * g:(b + 1) * g]
            s = _f16(np.float32(max(abs(float(x)) for x in block)) / np.float32(127))
            s = np.float32(1.0) if s == 0 else s
            scale[r, b] = s
            q[r, b * g:(b + 1) * g] = [min(127, max(-127, round(float(np.float32(x) / s)))) for x in block]
    return q, scale


def ref_uint4(w, g):
    rows, cols = w.shape
    q = np.zeros(w.shape, np.uint8)
    scale = np.zeros((rows, math.ceil(cols / g)), np.float32)
    minimum = np.zeros_like(scale)
    for r in range(rows):
        for b in range(scale.shape[1]):
            block = w[r, b * g:(b + 1) * g]
            m = _f16(min(block))
            if m > min(block):  # rounded down
                m = np.float32(np.nextafter(np.float16(m), np.float16(-np.inf)))
            s = _f16((np.float32(max(block)) - m) / np.float32(15))
            s = np.float32(1.0) if s == 0 else s
            scale[r, b], minimum[r, b] = s, m
            q[r, b * g:(b + 1) * g] = [min(15, max(0, round(float((np.float32(x) - m) / s)))) for x in block]
    return q, scale, minimum


def _expand(per_block, g, cols):
    return np.repeat(per_block, g, axis=1)[:, :cols]


def weight_scheme(scheme: QuantScheme, row_form: bool, quantized_kinds) -> QuantScheme:
    """The scheme a weight gets: tables (row form) and LM heads take ``scheme.table``."""
    return scheme.table if row_form or set(quantized_kinds) != {"linear"} else scheme


def ref_dequantized(w, scheme: QuantScheme):
    """W [R, C] -> what the quantized graph should compute with, [R, C] float32."""
    g = scheme.group_size
    if scheme.kind == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if scheme.kind == "int8":
        q, s = ref_int8(w, g)
        return q.astype(np.float32) * _expand(s, g, w.shape[1])
    # The refined quantizer (tested against ref_uint4 below): the graph must store what it computes.
    return dequantize_uint4_blocks(*quantize_uint4_blocks(w, g), g)


# --------------------------------------------------------------------------------------
# registry


def test_scheme_registry_and_parse():
    assert list(SCHEMES) == ["fp32", "fp16", "int8", "int4-g32", "int4-g64", "int4-g128"]
    assert [s.kind for s in SCHEMES.values()] == ["float", "fp16", "int8", "int4", "int4", "int4"]
    assert [s.group_size for s in SCHEMES.values()] == [None, None, 32, 32, 64, 128]
    assert [s.table.name for s in SCHEMES.values()] == ["fp32", "fp16", "int8", "int8", "int8", "int8"]
    config = parse_quant("int4-g64", lm_head=False)
    assert config == QuantConfig(SCHEMES["int4-g64"], embedding=True, lm_head=False)
    assert config.describe() == {"scheme": "int4-g64", "kind": "int4", "group_size": 64, "tables": "int8",
                                 "embedding": True, "lm_head": False, "activations": "float32"}
    w8a8 = parse_quant("w8a8")
    assert (w8a8.scheme, w8a8.activations, w8a8.name) == (SCHEMES["int8"], "int8", "w8a8")
    assert quant_from_record(w8a8.describe()) == w8a8
    with pytest.raises(ValueError, match="fp32, fp16, int8, int4-g32, int4-g64, int4-g128, w8a8"):
        parse_quant("int3")
    with pytest.raises(ValueError):
        QuantConfig(QuantScheme("int4-g16", "int4", 16))
    with pytest.raises(ValueError):
        QuantScheme("x", "int4")
    with pytest.raises(ValueError):
        QuantScheme("x", "int8")
    with pytest.raises(ValueError):
        QuantScheme("x", "fp16", 32)
    with pytest.raises(TypeError):
        QuantConfig(SCHEMES["int8"], embedding="no")


# --------------------------------------------------------------------------------------
# numpy quantizers


def _weights(rng, rows, cols, g):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    w[1] = 0.0  # an all-zero row
    w[2] = 1e-30  # a tiny row: its scales underflow float16
    w[3] = rng.uniform(0.5, 2.0)  # a constant row: every block's range is 0
    # Row 4 lies on a 4-bit grid: minimum + k * 0.25 per block, k in 0..15 with both ends.
    k = rng.integers(0, 16, cols)
    k[::g], k[1::g] = 0, 15
    w[4] = np.repeat(rng.integers(-8, 8, math.ceil(cols / g)) * 0.5, g)[:cols] + 0.25 * k
    return w


def _partial_cols(rng, g):
    return int(rng.integers(1, 3)) * g + int(rng.integers(2, g))  # a partial last block of >= 2


@pytest.mark.parametrize("group", [32, 64])
def test_int8_blocks_match_reference_and_bound_error(group):
    rng = np.random.default_rng()
    cols = _partial_cols(rng, group)
    w = _weights(rng, 9, cols, group)
    q, scale = quantize_int8_blocks(w, group)
    want_q, want_scale = ref_int8(w, group)
    nb = math.ceil(cols / group)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.dtype == np.float32 and scale.shape == (9, nb)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(scale.astype(np.float16).astype(np.float32), scale)  # fp16-exact
    assert q.min() >= -127
    s = _expand(scale, group, cols)
    back = dequantize_int8_blocks(q, scale, group)
    np.testing.assert_array_equal(back, q.astype(np.float32) * s)
    # Half a step, plus the float16 rounding of the scale at the block's peak (127 steps).
    bound = s / 2 + 127 * s * 2.0 ** -11 + 4 * F32_EPS * np.abs(w)
    assert (np.abs(w - back) <= bound).all()
    assert (scale[1] == 1.0).all() and not back[1].any()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_uint4_blocks_match_reference_and_bound_error(group):
    rng = np.random.default_rng()
    cols = _partial_cols(rng, group)
    w = _weights(rng, 7, cols, group)
    q, scale, minimum = quantize_uint4_blocks(w, group, refine_steps=0)
    nb = math.ceil(cols / group)
    assert q.dtype == np.uint8 and q.shape == w.shape and q.max() <= 15
    assert scale.shape == minimum.shape == (7, nb) and scale.dtype == minimum.dtype == np.float32
    want_q, want_scale, want_min = ref_uint4(w, group)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(minimum, want_min)
    np.testing.assert_array_equal(q, want_q)
    for x in (scale, minimum):
        np.testing.assert_array_equal(x.astype(np.float16).astype(np.float32), x)  # fp16-exact
    s, m = _expand(scale, group, cols), _expand(minimum, group, cols)
    back = dequantize_uint4_blocks(q, scale, minimum, group)
    np.testing.assert_array_equal(back, m + q.astype(np.float32) * s)
    # Half a step, plus the float16 roundings of the minimum (which can clip values just
    # above the true minimum) and of the scale (15 steps).
    bound = s / 2 + (np.abs(m) + 15 * s) * 2.0 ** -11 + 8 * F32_EPS * (np.abs(w) + np.abs(m))
    assert (np.abs(w - back) <= bound).all()
    np.testing.assert_array_equal(back[4], w[4])  # on a 4-bit grid: exact
    assert (scale > 0).all() and (m <= w).all()
    # Zero and tiny rows: scale 1.0, zeros back; a constant row back to float16 precision.
    assert (scale[1:3] == 1.0).all() and not q[1:3].any() and not back[1:3].any()
    np.testing.assert_allclose(back[3], w[3], rtol=2.0 ** -10, atol=0)

    # Refined: per block, never a larger squared error than the start, and smaller overall
    # on random weights; still exact on the grid row, fp16-exact, q in range.
    def block_errors(back):
        padded = np.zeros((7, nb * group), np.float32)
        padded[:, :cols] = np.square(w - back)
        return padded.reshape(7, nb, group).sum(axis=2)

    q2, scale2, minimum2 = quantize_uint4_blocks(w, group)
    back2 = dequantize_uint4_blocks(q2, scale2, minimum2, group)
    assert q2.dtype == np.uint8 and q2.max() <= 15 and (scale2 > 0).all()
    for x in (scale2, minimum2):
        np.testing.assert_array_equal(x.astype(np.float16).astype(np.float32), x)
    start, refined = block_errors(back), block_errors(back2)
    assert (refined <= start).all()
    assert refined.sum() < start.sum() * 0.99
    np.testing.assert_array_equal(back2[4], w[4])


def test_quantizers_reject_what_they_cannot_store():
    with pytest.raises(ValueError):
        quantize_int8_blocks(np.zeros(4, np.float32), 32)
    with pytest.raises(ValueError):
        quantize_uint4_blocks(np.array([[np.nan, 1.0]], np.float32), 32)
    with pytest.raises(ValueError):
        quantize_uint4_blocks(np.ones((2, 4), np.float32), 0)
    with pytest.raises(ValueError, match="float16"):
        quantize_int8_blocks(np.array([[1e9, 1.0]], np.float32), 32)


# --------------------------------------------------------------------------------------
# the rewrite on exported graphs


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    """{"untied" | "tied": (prefill proto, decode proto)}: each test rewrites fresh copies."""
    seed = int(np.random.default_rng().integers(1 << 30))
    tied = make_checkpoint(tmp_path_factory.mktemp("ckpt-tied"), "qwen2", seed=seed, tie_word_embeddings=True)
    out = {}
    for key, folder in (("untied", checkpoint("llama")), ("tied", tied)):
        graphs = export_graphs(resolve_model(folder).build_module())
        out[key] = (ir.to_proto(graphs.prefill), ir.to_proto(graphs.decode))
    return out


def _roles(graph: ir.Graph) -> dict[str, set[str]]:
    """Original weights by structure: name -> {"linear", "lm_head", "embedding"}."""
    roles: dict[str, set[str]] = {}
    for node in graph:
        ins = list(node.inputs)
        if node.op_type == "Transpose" and ins[0].is_initializer() and ins[0].dtype == ir.DataType.FLOAT:
            if any(u.op_type == "MatMul" for u, _ in node.outputs[0].uses()):
                roles.setdefault(ins[0].name, set()).add("linear")
        elif node.op_type == "Gemm" and ins[1].is_initializer():
            roles.setdefault(ins[1].name, set()).add("lm_head")
        elif node.op_type == "Gather" and ins[0].is_initializer():
            roles.setdefault(ins[0].name, set()).add("embedding")
    return roles


def _fresh(exported, key, graph="prefill") -> ir.Model:
    return ir.from_proto(exported[key][0 if graph == "prefill" else 1])


def _const(value: ir.Value) -> np.ndarray:
    assert value.const_value is not None, value.name
    return value.const_value.numpy()


def _follow(value: ir.Value, op_type: str) -> ir.Node:
    """The single consumer of ``value``, which must be an ``op_type`` node reading it first."""
    (user, idx), = value.uses()
    assert user.op_type == op_type and idx == 0, (user.op_type, idx)
    return user


def _dequantized(dq: ir.Node, scheme: QuantScheme, row_form: bool, name: str, rows: int, cols: int):
    """Checks one dequantizing chain's structure; returns (its float output value, the
    weight it computes in its form as float32)."""
    shape = (rows, cols) if row_form else (cols, rows)
    data = dq.inputs[0]
    if scheme.kind == "fp16":
        assert dq.op_type == "Cast" and data.name == f"{name}.fp16" and data.dtype == ir.DataType.FLOAT16
        assert tuple(data.shape) == shape and dq.attributes["to"].value == ir.DataType.FLOAT
        return dq.outputs[0], _const(data).astype(np.float32)
    g = scheme.group_size
    red = cols  # the reduction axis, blocked
    nb = math.ceil(red / g)
    assert dq.op_type == "DequantizeLinear" and len(dq.inputs) == 2  # no integer zero point
    scale = dq.inputs[1]
    assert data.name == f"{name}.qweight" and scale.name == f"{name}.scale" and scale.dtype == ir.DataType.FLOAT
    assert {k: a.value for k, a in dq.attributes.items()} == {"axis": 1 if row_form else 0, "block_size": g}
    s = _const(scale)
    if scheme.kind == "int8":
        assert data.dtype == ir.DataType.INT8 and tuple(data.shape) == shape
        assert tuple(scale.shape) == ((rows, nb) if row_form else (nb, rows))
        q = _const(data).astype(np.float32)
        expanded = _expand(s, g, red) if row_form else _expand(s.T, g, red).T
        return dq.outputs[0], q * expanded
    # int4: projections only, transposed, padded to whole blocks, then the minimum chain.
    assert not row_form and data.dtype == ir.DataType.UINT4
    kp = nb * g
    assert tuple(data.shape) == (kp, rows) and tuple(scale.shape) == (nb, rows)
    q = _const(data).astype(np.float32)
    assert not q[red:].any()  # zero padding
    blocks = _follow(dq.outputs[0], "Reshape")
    assert list(_const(blocks.inputs[1])) == [nb, g, rows]
    add = _follow(blocks.outputs[0], "Add")
    minimum = add.inputs[1]
    assert minimum.name == f"{name}.minimum" and minimum.dtype == ir.DataType.FLOAT
    assert tuple(minimum.shape) == (nb, 1, rows)
    flat = _follow(add.outputs[0], "Reshape")
    assert list(_const(flat.inputs[1])) == [kp, rows]
    out = flat.outputs[0]
    if kp != red:
        sliced = _follow(out, "Slice")
        assert [list(_const(v)) for v in sliced.inputs[1:4]] == [[0], [red], [0]]
        out = sliced.outputs[0]
    m = _const(minimum)[:, 0, :]
    stored = (q.reshape(nb, g, rows) * s[:, None, :] + m[:, None, :]).reshape(kp, rows)[:red]
    return out, stored


def _check_structure(before: ir.Model, after: ir.Model, config: QuantConfig) -> None:
    roles = _roles(before.graph)
    assert sum("linear" in r for r in roles.values()) == 14
    assert sum("lm_head" in r for r in roles.values()) == 1 and sum("embedding" in r for r in roles.values()) == 1
    wanted = {"linear": True, "lm_head": config.lm_head, "embedding": config.embedding}
    inits = after.graph.initializers
    dq_op = "Cast" if config.scheme.kind == "fp16" else "DequantizeLinear"
    dqs = [n for n in after.graph if n.op_type == dq_op]
    for name, kinds in roles.items():
        w = before.graph.initializers[name].const_value.numpy()
        rows, cols = w.shape
        quantized = {k for k in kinds if wanted[k]}
        floats = kinds - quantized
        if not quantized:
            assert name in inits and not any(f"{name}." in i for i in inits)
            continue
        # The float weight is gone unless a float consumer still reads it.
        assert (name in inits) == bool(floats)
        row_form = "embedding" in kinds
        scheme = weight_scheme(config.scheme, row_form, quantized)
        mine = [n for n in dqs if n.inputs[0].name.startswith(f"{name}.")]
        assert len(mine) == len(quantized)
        assert all(n.inputs[0] is mine[0].inputs[0] for n in mine)  # one stored copy
        want = ref_dequantized(w, scheme)
        # Each chain feeds exactly one consumer, of the form the lowering expects.
        seen = set()
        for dq in mine:
            out, stored = _dequantized(dq, scheme, row_form, name, rows, cols)
            np.testing.assert_array_equal(stored, want if row_form else want.T)
            assert tuple(out.shape) == ((rows, cols) if row_form else (cols, rows))
            assert len(out.uses()) == 1 and not out.is_graph_output()
            user, idx = out.uses()[0]
            if user.op_type == "Gather":
                assert row_form and idx == 0 and user.attributes["axis"].value == 0
                seen.add("embedding")
            elif user.op_type == "MatMul":
                assert not row_form and idx == 1
                seen.add("lm_head" if user.outputs[0].name == "logits" else "linear")
            else:
                assert user.op_type == "Transpose" and row_form
                assert tuple(user.attributes["perm"].value) == (1, 0)
                (mm, j), = user.outputs[0].uses()
                assert mm.op_type == "MatMul" and j == 1 and mm.outputs[0].name == "logits"
                seen.add("lm_head")
        assert seen == quantized
    # The LM head is a Gemm only while float.
    assert [n.op_type for n in after.graph if n.op_type == "Gemm"] == ([] if config.lm_head else ["Gemm"])
    assert after.graph.outputs[0].name == "logits"
    # Nothing else touched: every other initializer (norms, biases, RoPE tables) is as before.
    for name, value in before.graph.initializers.items():
        if name not in roles:
            np.testing.assert_array_equal(inits[name].const_value.numpy(), value.const_value.numpy())
    # No float copy of a weight was added (scales [nb, N] and int4 minima [nb, 1, N] are
    # the only new float tensors).
    assert not [v for v in inits.values() if v.dtype == ir.DataType.FLOAT and len(v.shape) >= 2
                and v.name not in before.graph.initializers and not v.name.endswith((".scale", ".minimum"))]
    assert after.opset_imports == {"": 23} and after.ir_version == 10
    onnx.checker.check_model(ir.to_proto(after), full_check=True)


@pytest.mark.parametrize("key", ["untied", "tied"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_rewrite_structure(exported, key, name):
    config = parse_quant(name)
    before = _fresh(exported, key)
    after = quantize_weights(config)(_fresh(exported, key))
    _check_structure(before, after, config)
    # prefill and decode store identical tensors under identical names.
    decode = quantize_weights(config)(_fresh(exported, key, "decode"))
    p, d = after.graph.initializers, decode.graph.initializers
    assert set(p) == set(d)
    for n in p:
        assert p[n].dtype == d[n].dtype and p[n].const_value.tobytes() == d[n].const_value.tobytes()


@pytest.mark.parametrize("key", ["untied", "tied"])
@pytest.mark.parametrize("embedding,lm_head", [(False, True), (True, False), (False, False)])
def test_rewrite_respects_embedding_and_lm_head_flags(exported, key, embedding, lm_head):
    config = parse_quant("int8", embedding=embedding, lm_head=lm_head)
    before = _fresh(exported, key)
    _check_structure(before, quantize_weights(config)(_fresh(exported, key)), config)


def test_float_scheme_is_the_identity(exported):
    model = _fresh(exported, "tied")
    assert quantize_weights(parse_quant("fp32"))(model) is model
    same = ir.to_proto(_fresh(exported, "tied")).SerializeToString()
    assert ir.to_proto(model).SerializeToString() == same


# --------------------------------------------------------------------------------------
# onnxruntime as the oracle


def _run(model_or_path, feeds):
    # Basic optimizations only: at EXTENDED and above onnxruntime fuses DequantizeLinear ->
    # MatMul (int8 and int4) into com.microsoft MatMulNBits, whose CPU kernel quantizes the
    # activations too (~0.04 off on these logits), so it would no longer be an exact oracle
    # of the graph's semantics.
    src = model_or_path if isinstance(model_or_path, str) else ir.to_proto(model_or_path).SerializeToString()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(src, options, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def _feeds(rng, batch, seq):
    return {"input_ids": rng.integers(0, 384, (batch, seq), dtype=np.int64),
            "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1))}


@pytest.mark.parametrize("key", ["untied", "tied"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_onnxruntime_runs_the_quantized_graph_as_dequantized_weights(exported, key, name, tmp_path):
    """ORT on the quantized graph == ORT on the original graph with each weight replaced by
    its reference-dequantized values; and the quantized logits stay close to float ones."""
    rng = np.random.default_rng()
    config = parse_quant(name)
    quantized = quantize_weights(config)(_fresh(exported, key))
    # Through the artifact's path: onnx_ir's writer, external data (INT4 packed on disk).
    ir.save(quantized, tmp_path / "q.onnx", external_data="q.onnx.data")
    assert onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).ir_version == 10

    reference = _fresh(exported, key)
    for weight, kinds in _roles(reference.graph).items():
        value = reference.graph.initializers[weight]
        scheme = weight_scheme(config.scheme, "embedding" in kinds, kinds)
        value.const_value = ir.tensor(ref_dequantized(value.const_value.numpy(), scheme), name=weight)
    floats = _fresh(exported, key)

    feeds = _feeds(rng, 3, int(rng.integers(2, 12)))
    got = _run(str(tmp_path / "q.onnx"), feeds)
    want = _run(reference, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)

    # Close to float: a small relative logit error, and top-1 agreement over many random
    # prompts for fp16 / int8. (Measured on these random tiny models: relative error
    # ~5e-4 fp16, ~0.015 int8, ~0.2-0.25 int4; int8 top-1 >= ~0.9 untied, whose logits are
    # nearly flat; int4 top-1 is too noisy on them to assert.)
    feeds = _feeds(rng, 128, 4)
    got, ref = _run(quantized, feeds), _run(floats, feeds)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < {"fp16": 3e-3, "int8": 0.05}.get(config.scheme.kind, 0.4), rel
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= {"fp16": 0.95, "int8": 0.75}.get(config.scheme.kind, 0.0), agree
