"""kiln bench: the roofline's byte count against the checkpoint's own tensors, the sweep end
to end on a tiny artifact (every system in its own worker), and bad settings."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from kiln.bench.roofline import bytes_per_token, read_bandwidth
from kiln.bench.sweep import BenchConfig, format_report, run_sweep, write_outputs
from kiln.cli.bench_cmds import cli
from kiln.runtime.artifact import load_manifest


def test_bytes_per_token_counts_every_weight_once_and_the_kv(compiled, checkpoint):
    manifest = load_manifest(compiled("llama"))
    tensors = load_file(checkpoint("llama") / "model.safetensors")
    m = manifest.model
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # float32 K and V per token of context
    table = tensors["model.embed_tokens.weight"]
    assert not m.tie_word_embeddings and "lm_head.weight" in tensors
    rope_rows = 2 * (m.head_dim // 2) * 4  # one row of the cos and of the sin table
    untied = sum(t.nbytes for t in tensors.values()) - table.nbytes + table.nbytes // table.shape[0]
    assert bytes_per_token(manifest, 50) == untied + rope_rows + 50 * kv
    # Tied: the table is the LM head, read whole; there is no separate lm_head tensor.
    tied = dataclasses.replace(manifest, model=dataclasses.replace(m, tie_word_embeddings=True),
                               params=tuple(p for p in manifest.params if not p.name.startswith("lm_head.")))
    expected = sum(t.nbytes for name, t in tensors.items() if not name.startswith("lm_head."))
    assert bytes_per_token(tied, 0) == expected + rope_rows


def test_read_bandwidth_is_plausible():
    bw = read_bandwidth(mib=64, passes=2)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s


def test_sweep_measures_every_system_and_batch(compiled, tmp_path):
    artifact = compiled("llama")
    config = BenchConfig(batches=(1, 2), prompt_len=8, steps=2, repeats=1)
    report = run_sweep([artifact], config, progress=lambda m: None)
    got = {(r.system, r.batch) for r in report.rows}
    assert got == {(s, b) for s in ("kiln", "onnxruntime", "torch eager") for b in (1, 2)}
    for r in report.rows:
        assert r.prefill_tok_s > 0 and r.decode_tok_s > 0 and r.step_ms > 0, r
        assert r.rss_peak_mb > r.model_mb > 0, r
        assert math.isclose(r.decode_tok_s * r.step_ms / 1000, r.batch, rel_tol=1e-9), r
    kiln = {r.batch: r for r in report.rows if r.system == "kiln"}
    params_mb = (artifact / "params.bin").stat().st_size / 2**20
    assert kiln[1].size_mb == pytest.approx(params_mb)
    [roof] = report.rooflines
    assert roof.tok_s == pytest.approx(report.bandwidth_gb_s * 1e9 / roof.bytes_per_token)
    text = format_report(report)
    for system in ("kiln", "onnxruntime", "torch eager"):
        assert system in text
    paths = write_outputs(report, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == 6 and data["config"]["batches"] == [1, 2]
    assert all(p.exists() for p in paths)


@pytest.mark.parametrize("kwargs,field", [
    ({"batches": (0,)}, "batch"), ({"batches": ()}, "batch"), ({"prompt_len": 0}, "prompt_len"),
    ({"steps": -1}, "steps"), ({"systems": ("vllm",)}, "vllm")])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BenchConfig(**kwargs)


def test_cli_rejects_bad_batches_and_missing_artifacts(tmp_path):
    result = CliRunner().invoke(cli, ["bench", str(tmp_path), "--batch", "1,x"])
    assert result.exit_code == 2 and "comma-separated integers" in result.output
    result = CliRunner().invoke(cli, ["bench", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_ort_fast_int4_form_keeps_codes_and_scales_with_integer_zero_points(checkpoint):
    """The benchmark's onnxruntime int4 variant: each minimum chain becomes one
    DequantizeLinear with zero point round(-minimum / scale) feeding the MatMul (the form
    onnxruntime fuses); it runs, and stays close to the exact graph."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from kiln.bench.ort_zero_point import integer_zero_points
    from kiln.compiler.export.onnx_export import export_graphs
    from kiln.compiler.models.source import resolve_model
    from kiln.compiler.passes.quantize_weights import quantize_weights
    from kiln.runtime.quantization import parse_quant

    quant = parse_quant("int4-g32", embedding=False, lm_head=False)
    exact = quantize_weights(quant)(export_graphs(resolve_model(checkpoint("llama")).build_module()).prefill)
    exact_bytes = ir.to_proto(exact).SerializeToString()
    codes = {n.inputs[0].name: n.inputs[0].const_value.numpy() for n in exact.graph if n.op_type == "DequantizeLinear"}
    fast = integer_zero_points(ir.from_proto(ir.to_proto(exact)))
    dqs = [n for n in fast.graph if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 14 and not [n for n in fast.graph if n.op_type == "Add" and "minimum" in n.inputs[1].name]
    assert not [n for n in fast.graph.initializers if n.endswith((".minimum", "_shape"))]
    for dq in dqs:
        (user, idx), = dq.outputs[0].uses()
        assert user.op_type == "MatMul" and idx == 1
        q, scale, zp = (v.const_value.numpy() for v in dq.inputs)
        assert dq.inputs[2].dtype == ir.DataType.UINT4
        minimum = exact.graph.initializers[dq.inputs[0].name.replace(".qweight", ".minimum")].const_value.numpy()
        np.testing.assert_array_equal(zp, np.clip(np.rint(-minimum[:, 0, :] / scale), 0, 15))
        np.testing.assert_array_equal(q, codes[dq.inputs[0].name])

    def run(model, level):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        src = model if isinstance(model, bytes) else ir.to_proto(model).SerializeToString()
        sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 300, (2, 7), dtype=np.int64)
        return sess.run(["logits"], {"input_ids": ids, "position_ids": np.tile(np.arange(7), (2, 1))})[0]

    want = run(exact_bytes, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    got = run(fast, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.3
