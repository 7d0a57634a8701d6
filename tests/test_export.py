"""The exported ONNX graphs: standard ops, dynamic shapes, onnxruntime == torch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kiln.compiler.export.onnx_export import export_graphs
from kiln.compiler.models.source import resolve_model
from kiln.compiler.verify import verify_model


@pytest.fixture(scope="module")
def tiny_graphs(checkpoint):
    source = resolve_model(checkpoint("qwen2"))
    return source, export_graphs(source.build_module())


def test_graphs_are_standard_onnx_with_dynamic_dims(tiny_graphs, tmp_path):
    import onnx

    source, graphs = tiny_graphs
    for name, model in graphs.items():
        path = tmp_path / f"{name}.onnx"
        ir.save(model, path)
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
        assert proto.ir_version <= 13
        assert {o.domain for o in proto.opset_import} <= {"", "ai.onnx"}
        ops = {n.op_type for n in proto.graph.node}
        assert {"Attention", "RotaryEmbedding", "RMSNormalization"} <= ops
        dims = {d.dim_param for i in proto.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
        assert dims == ({"batch", "seq"} if name == "prefill" else {"batch", "past"})
    # Both graphs name their weights like the checkpoint, so the artifact stores them once.
    assert set(graphs.prefill.graph.initializers) == set(graphs.decode.graph.initializers)
    assert "model.layers.0.self_attn.q_proj.weight" in graphs.prefill.graph.initializers


@pytest.mark.parametrize("variant", ["llama", "llama3", "qwen2", "mistral"])
def test_onnxruntime_matches_torch(checkpoint, variant):
    batch, seq = int(np.random.default_rng().integers(1, 4)), int(np.random.default_rng().integers(1, 12))
    reports = verify_model(checkpoint(variant), batch=batch, seq=seq)
    assert {(r.graph, r.backend) for r in reports} == {("prefill", "onnxruntime"), ("decode", "onnxruntime")}
    for r in reports:
        assert r.logits_error <= 1e-4 and r.kv_error <= 1e-5, r


def test_dump_dir_writes_each_phase(checkpoint, tmp_path):
    from kiln.compiler.passes.pipeline import run_passes

    source = resolve_model(checkpoint("llama"))
    run_passes(export_graphs(source.build_module()), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.onnx"))
    assert names == ["0-exported.decode.onnx", "0-exported.prefill.onnx", "1-paged-attention.decode.onnx",
                     "1-paged-attention.prefill.onnx", "2-select-logit-positions.decode.onnx",
                     "2-select-logit-positions.prefill.onnx"]
