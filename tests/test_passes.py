"""Each ONNX pass alone, on a small before-graph built here."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kiln.compiler.passes.paged_attention import rewrite_paged_attention
from kiln.compiler.passes.select_logit_positions import select_logit_positions

F, I64 = TensorProto.FLOAT, TensorProto.INT64
HQ, HKV, D = 4, 2, 8


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m


def _attention_graph(with_past: bool, mask: bool = False, causal: bool | None = None):
    """Two layers: y_i, present_i = Attention(q_i, k_i, v_i[, mask], past_i) on graph inputs."""
    causal = (not with_past) if causal is None else causal
    nodes, inputs, outputs = [], [], []
    for i in range(2):
        names = [f"q{i}", f"k{i}", f"v{i}"]
        inputs += [_vi(f"q{i}", F, ["b", "s", HQ * D]), _vi(f"k{i}", F, ["b", "s", HKV * D]),
                   _vi(f"v{i}", F, ["b", "s", HKV * D])]
        if mask:
            names.append("mask")
        elif with_past:
            names.append("")
        if with_past:
            names += [f"past{i}.key", f"past{i}.value"]
            inputs += [_vi(f"past{i}.key", F, ["b", HKV, "p", D]), _vi(f"past{i}.value", F, ["b", HKV, "p", D])]
        nodes.append(helper.make_node("Attention", names, [f"y{i}", f"present{i}.key", f"present{i}.value"],
                                      is_causal=int(causal), q_num_heads=HQ, kv_num_heads=HKV))
        outputs += [_vi(f"y{i}", F, ["b", "s", HQ * D]), _vi(f"present{i}.key", F, ["b", HKV, "t", D]),
                    _vi(f"present{i}.value", F, ["b", HKV, "t", D])]
    if mask:
        inputs.append(_vi("mask", TensorProto.BOOL, ["s", "s"]))
    return _model(nodes, inputs, outputs)


def test_paged_attention_rewrites_each_layer_and_drops_kv_io():
    model = rewrite_paged_attention(ir.serde.deserialize_model(_attention_graph(with_past=True)))
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ops == [("kiln", "PagedAttention")] * 2
    assert [v.name for v in model.graph.inputs] == ["q0", "k0", "v0", "q1", "k1", "v1"]
    assert [v.name for v in model.graph.outputs] == ["y0", "y1"]
    for i, node in enumerate(model.graph):
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["layer_id"] == i and attrs["q_num_heads"] == HQ and attrs["kv_num_heads"] == HKV
        assert attrs["scale"] == pytest.approx(D ** -0.5)
        assert [v.name for v in node.inputs] == [f"q{i}", f"k{i}", f"v{i}"]
    assert model.opset_imports["kiln"] == 1


def test_paged_attention_rejects_what_the_cache_cannot_compute():
    with pytest.raises(ValueError, match="mask"):
        rewrite_paged_attention(ir.serde.deserialize_model(_attention_graph(with_past=False, mask=True)))


@pytest.mark.parametrize("kv_dtype,kernels", [("float32", "tvm"), ("float32", "kiln"), ("float16", "kiln"),
                                              ("int8", "kiln")])
def test_paged_attention_computes_what_onnxruntime_computes(kv_dtype, kernels):
    """Lowered onto TVM's paged KV cache: a causal prefill of P past tokens, then S new
    tokens attending over past + new, equals onnxruntime's explicit Attention given the
    same past keys and values. With a float16 / int8 cache, onnxruntime gets every key and
    value as the cache stores it (rounded by ``KVLayout``'s numpy reference): the graph's
    packing must round exactly so."""
    import tvm
    from tvm import relax

    from kiln.compiler.lower.importer import import_graphs
    from kiln.compiler.lower.kv_cache import add_kv_cache_factory, use_kiln_cpu_attention
    from kiln.runtime.kv_layout import KVLayout
    from kiln.compiler.lower.pipeline import relax_pipeline
    from kiln.compiler.targets import parse_target
    from kiln.runtime.model_config import ModelConfig

    rng = np.random.default_rng()
    b, p, s = 2, int(rng.integers(1, 20)), int(rng.integers(1, 6))
    graph = rewrite_paged_attention(ir.serde.deserialize_model(_attention_graph(with_past=False)))
    mod, params = import_graphs({"main": graph}, kv_dtype=kv_dtype)
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=HQ * D, intermediate_size=8, num_layers=2,
                         num_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-5, rope_theta=1e4,
                         context_length=64)
    target = parse_target("llvm").tvm_target()
    bb = relax.BlockBuilder(mod)
    layout = KVLayout.of(config, kv_dtype)
    add_kv_cache_factory(bb, config, target, layout)
    mod = bb.get() if kernels == "tvm" else use_kiln_cpu_attention(bb.get(), layout)
    exe = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    kv = vm["create_kv_cache"](tvm.runtime.ShapeTuple([b, 256, 64, 16, 0]))
    g = tvm.get_global_func
    begin, end, add = (g("vm.builtin.kv_state_begin_forward"), g("vm.builtin.kv_state_end_forward"),
                       g("vm.builtin.kv_state_add_sequence"))
    for i in range(b):
        add(kv, i)

    def qkv(n):
        return {f"{x}{i}": rng.standard_normal((b, n, (HQ if x == "q" else HKV) * D)).astype(np.float32)
                for i in range(2) for x in "qkv"}

    def run(feeds, n):
        outs = []
        for i in range(b):  # one sequence per call ([1, n] tokens each), like the ragged prefill
            begin(kv, tvm.runtime.ShapeTuple([i]), tvm.runtime.ShapeTuple([n]))
            args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[v.name][i:i + 1])) for v in graph.graph.inputs]
            outs.append([o.numpy() for o in vm["main"](*args, kv, [])])
            end(kv)
        return [np.concatenate([o[j] for o in outs]) for j in range(2)]

    past = qkv(p)
    run(past, p)
    new = qkv(s)
    got = run(new, s)
    # Causal over the new block, full over the past: bottom-right aligned, as ONNX defines it.
    explicit = _attention_graph(with_past=True, causal=True)

    def stored(x):  # [b, n, Hkv*D] as the cache holds it
        return layout.decode(layout.encode(x.reshape(*x.shape[:2], HKV, D))).reshape(x.shape)

    feeds = {name: (x if name[0] == "q" else stored(x)) for name, x in new.items()}
    for i in range(2):
        for x, name in (("k", "key"), ("v", "value")):
            feeds[f"past{i}.{name}"] = stored(past[f"{x}{i}"]).reshape(b, p, HKV, D).transpose(0, 2, 1, 3).copy()
    want = ort.InferenceSession(explicit.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1], want[3], atol=1e-5)


def _lm_head_graph():
    """h [B, S, H] -> last position -> RMSNorm -> tied LM head (Gemm transB) -> [B, V]."""
    rng = np.random.default_rng()
    hidden, vocab = 16, 24
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    scale = rng.standard_normal(hidden).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["last"], value=helper.make_tensor("v", I64, [], [-1])),
        helper.make_node("Gather", ["h", "last"], ["sel"], axis=1),
        helper.make_node("RMSNormalization", ["sel", "scale"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Gemm", ["n", "emb"], ["logits"], transB=1),
    ]
    inits = [helper.make_tensor("emb", F, emb.shape, emb.flatten()), helper.make_tensor("scale", F, [hidden], scale)]
    return _model(nodes, [_vi("h", F, ["batch", "seq", hidden])], [_vi("logits", F, ["batch", vocab])], inits), emb, scale


def test_select_logit_positions_is_standard_onnx_that_selects_rows():
    before, emb, scale = _lm_head_graph()
    model = select_logit_positions(ir.serde.deserialize_model(before))
    assert [v.name for v in model.graph.inputs] == ["h", "logit_positions"]
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    rng = np.random.default_rng()
    h = rng.standard_normal((1, 11, 16)).astype(np.float32)
    positions = np.array([3, 10, 0, 3], dtype=np.int64)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"h": h, "logit_positions": positions})[0]
    rows = h[0, positions]
    normed = rows / np.sqrt((rows ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(got, normed @ emb.T, rtol=1e-4, atol=1e-4)


def test_select_logit_positions_needs_the_last_position_gather():
    before, _, _ = _lm_head_graph()
    del before.graph.node[0:2]
    before.graph.node[0].input[0] = "h"
    with pytest.raises(ValueError, match="last-position Gather"):
        select_logit_positions(ir.serde.deserialize_model(before))
