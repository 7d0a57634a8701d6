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
from kiln.compiler.passes.quantize_weights import quantize_int4_blocks, quantize_int8_rows, quantize_weights
from kiln.runtime.quantization import SCHEMES, QuantConfig, QuantScheme, parse_quant

QUANTIZED = [name for name, s in SCHEMES.items() if s.kind != "float"]
F32_EPS = np.finfo(np.float32).eps


# --------------------------------------------------------------------------------------
# plain-loop references


def ref_int8(w):
    q = np.zeros(w.shape, np.int8)
    scale = np.zeros(w.shape[0], np.float32)
    for r, row in enumerate(w):
        s = np.float32(max(abs(float(x)) for x in row)) / np.float32(127)
        s = np.float32(1.0) if s == 0 else s
        scale[r] = s
        q[r] = [min(127, max(-127, round(float(np.float32(x) / s)))) for x in row]
    return q, scale


def ref_int4(w, g):
    rows, cols = w.shape
    q = np.zeros(w.shape, np.int8)
    scale = np.zeros((rows, math.ceil(cols / g)), np.float32)
    for r in range(rows):
        for b in range(scale.shape[1]):
            block = w[r, b * g:(b + 1) * g]
            peak = block[int(np.argmax(np.abs(block)))]
            s = np.float32(np.float16(np.float32(peak) / np.float32(-8)))
            s = np.float32(1.0) if s == 0 else s
            scale[r, b] = s
            q[r, b * g:(b + 1) * g] = [min(7, max(-8, round(float(np.float32(x) / s)))) for x in block]
    return q, scale


def ref_dequantized(w, scheme: QuantScheme):
    """W [R, C] -> what the quantized graph should compute with, [R, C] float32."""
    if scheme.kind == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if scheme.kind == "int8":
        q, s = ref_int8(w)
        return q.astype(np.float32) * s[:, None]
    q, s = ref_int4(w, scheme.group_size)
    return q.astype(np.float32) * np.repeat(s, scheme.group_size, axis=1)[:, :w.shape[1]]


# --------------------------------------------------------------------------------------
# registry


def test_scheme_registry_and_parse():
    assert list(SCHEMES) == ["fp32", "fp16", "int8", "int4-g32", "int4-g64", "int4-g128"]
    assert [s.kind for s in SCHEMES.values()] == ["float", "fp16", "int8", "int4", "int4", "int4"]
    assert [s.group_size for s in SCHEMES.values()] == [None, None, None, 32, 64, 128]
    config = parse_quant("int4-g64", lm_head=False)
    assert config == QuantConfig(SCHEMES["int4-g64"], embedding=True, lm_head=False)
    assert config.describe() == {"scheme": "int4-g64", "kind": "int4", "group_size": 64,
                                 "embedding": True, "lm_head": False}
    with pytest.raises(ValueError, match="fp32, fp16, int8, int4-g32, int4-g64, int4-g128"):
        parse_quant("int3")
    with pytest.raises(ValueError):
        QuantConfig(QuantScheme("int4-g16", "int4", 16))
    with pytest.raises(ValueError):
        QuantScheme("x", "int4")
    with pytest.raises(TypeError):
        QuantConfig(SCHEMES["int8"], embedding="no")


# --------------------------------------------------------------------------------------
# numpy quantizers


def _weights(rng, rows, cols):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    w[1] = 0.0  # an all-zero row
    w[2] = 1e-30  # a tiny row: its int4 scale underflows float16
    # Row 3 is exactly representable at int4 with a 0.25 step: each block's peak is
    # +-8 steps (the sign drawn per row), the rest any of -7..8 steps (both signs).
    k = rng.integers(-7, 9, cols)
    k[::32] = 8
    w[3] = rng.choice([-1, 1]) * 0.25 * k
    return w


def test_int8_rows_match_reference_and_bound_error():
    rng = np.random.default_rng()
    w = _weights(rng, 9, int(rng.integers(20, 90)))
    q, scale = quantize_int8_rows(w)
    want_q, want_scale = ref_int8(w)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.dtype == np.float32 and scale.shape == (9,)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)
    assert q.min() >= -127
    back = q.astype(np.float32) * scale[:, None]
    assert np.isfinite(back).all()
    assert (np.abs(w - back) <= scale[:, None] / 2 + 4 * F32_EPS * np.abs(w)).all()
    assert scale[1] == 1.0 and not back[1].any()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_blocks_match_reference_and_bound_error(group):
    rng = np.random.default_rng()
    cols = int(rng.integers(1, 3)) * group + int(rng.integers(1, group))  # a partial last block
    w = _weights(rng, 7, cols)
    q, scale = quantize_int4_blocks(w, group)
    nb = math.ceil(cols / group)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.dtype == np.float32 and scale.shape == (7, nb)
    want_q, want_scale = ref_int4(w, group)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)
    assert q.min() >= -8 and q.max() <= 7
    np.testing.assert_array_equal(scale.astype(np.float16).astype(np.float32), scale)  # fp16-exact
    s = np.repeat(scale, group, axis=1)[:, :cols]
    back = q.astype(np.float32) * s
    assert np.isfinite(back).all()
    # The peak m of each block maps to -8: back = -8 * float16(m / -8), exact up to the
    # float16 rounding of the scale (and exact when m / -8 is float16-representable).
    for r in range(7):
        for b in range(nb):
            block = w[r, b * group:(b + 1) * group]
            i = b * group + int(np.argmax(np.abs(block)))
            if w[r, i] == 0 or abs(w[r, i]) < 1e-7:
                continue
            assert q[r, i] == -8
            assert abs(back[r, i] - w[r, i]) <= abs(w[r, i]) * 2.0 ** -11
    np.testing.assert_array_equal(back[3], w[3])  # peaks +-2.0: scale -+0.25, exact
    # Within half a step, except values of the peak's opposite sign beyond 7.5 steps, which
    # clip to 7 (the range is [-8, 7]): within one step there.
    ratio = w / s
    bound = np.where(ratio > 7.5, np.abs(s), np.abs(s) / 2) * (1 + 2.0 ** -10) + 4 * F32_EPS * np.abs(w)
    assert (np.abs(w - back) <= bound).all()
    # Zero and tiny rows: scale 1.0, q 0, finite zeros.
    assert (scale[1:3] == 1.0).all() and not q[1:3].any() and not back[1:3].any()


def test_quantizers_reject_what_they_cannot_store():
    with pytest.raises(ValueError):
        quantize_int8_rows(np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        quantize_int4_blocks(np.array([[np.nan, 1.0]], np.float32), 32)
    with pytest.raises(ValueError):
        quantize_int4_blocks(np.ones((2, 4), np.float32), 0)


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


def _check_structure(before: ir.Model, after: ir.Model, config: QuantConfig) -> None:
    scheme = config.scheme
    roles = _roles(before.graph)
    assert sum("linear" in r for r in roles.values()) == 14
    assert sum("lm_head" in r for r in roles.values()) == 1 and sum("embedding" in r for r in roles.values()) == 1
    wanted = {"linear": True, "lm_head": config.lm_head, "embedding": config.embedding}
    inits = after.graph.initializers
    dq_op = "Cast" if scheme.kind == "fp16" else "DequantizeLinear"
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
        shape = (rows, cols) if row_form else (cols, rows)
        mine = [n for n in dqs if n.inputs[0].name.startswith(f"{name}.")]
        assert len(mine) == len(quantized)
        data = mine[0].inputs[0]
        assert all(n.inputs[0] is data for n in mine)  # one stored copy
        if scheme.kind == "fp16":
            assert data.name == f"{name}.fp16" and data.dtype == ir.DataType.FLOAT16
            assert tuple(data.shape) == shape and mine[0].attributes["to"].value == ir.DataType.FLOAT
            stored = data.const_value.numpy().astype(np.float32)
        else:
            scale = mine[0].inputs[1]
            assert len(mine[0].inputs) == 2  # symmetric: no zero point
            assert data.name == f"{name}.qweight" and scale.name == f"{name}.scale"
            assert tuple(data.shape) == shape and scale.dtype == ir.DataType.FLOAT
            attrs = {k: a.value for k, a in mine[0].attributes.items()}
            q = data.const_value.numpy().astype(np.int8)
            s = scale.const_value.numpy()
            if scheme.kind == "int8":
                assert data.dtype == ir.DataType.INT8 and tuple(scale.shape) == (rows,)
                assert attrs == {"axis": 0 if row_form else 1}
                stored = (q * (s[:, None] if row_form else s[None, :])).astype(np.float32)
            else:
                g = scheme.group_size
                nb = math.ceil(cols / g)
                assert data.dtype == ir.DataType.INT4
                assert tuple(scale.shape) == ((rows, nb) if row_form else (nb, rows))
                assert attrs == {"axis": 1 if row_form else 0, "block_size": g}
                stored = q * (np.repeat(s, g, axis=1)[:, :cols] if row_form else np.repeat(s, g, axis=0)[:cols])
        want = ref_dequantized(w, scheme)
        np.testing.assert_array_equal(stored, want if row_form else want.T)
        # Each DQ feeds exactly one consumer, of the form the lowering expects.
        seen = set()
        for dq in mine:
            out = dq.outputs[0]
            assert tuple(out.shape) == shape and len(out.uses()) == 1 and not out.is_graph_output()
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
    # No float copy of a weight was added (int4 scales are the only new 2-D float tensors).
    assert not [v for v in inits.values() if v.dtype == ir.DataType.FLOAT and len(v.shape) == 2
                and v.name not in before.graph.initializers and not v.name.endswith(".scale")]
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
    for weight in _roles(reference.graph):
        value = reference.graph.initializers[weight]
        value.const_value = ir.tensor(ref_dequantized(value.const_value.numpy(), config.scheme), name=weight)
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
