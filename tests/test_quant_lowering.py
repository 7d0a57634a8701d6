"""Weight-only quantized weights in the compiled module: storage layouts (numpy), the fused
dequantizing kernels (against numpy), and whole quantized artifacts (against onnxruntime
running the same quantized ONNX graph, the oracle)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, te

from kiln.compiler.lower.quant_weights import (
    DEQUANTIZE_W,
    WeightStorage,
    deinterleave_rows,
    matmul_nt_te,
    pack_int4,
    stored_arrays,
    stored_specs,
    take_rows_te,
    unpack_int4,
)
from kiln.compiler.lower.pipeline import relax_pipeline
from kiln.compiler.lower.schedules import CPUMatmulNT
from kiln.compiler.targets import parse_target


def _random_weight(rng, kind: str, rows: int, cols: int, group: int | None, minimum: bool = True):
    """(ONNX arrays for ``stored_arrays`` in the transposed form, float reference [rows, cols]).
    Scales and minima are float16-exact, as the quantize pass makes them."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "fp16":
        ref = w.astype(np.float16)
        return (ref.T,), ref.astype(np.float32)
    blocks = -(-cols // group)

    def per_block(low, high):
        v = rng.uniform(low, high, (rows, blocks)).astype(np.float16).astype(np.float32)
        return v, np.repeat(v, group, axis=1)[:, :cols]

    s, s_full = per_block(0.001, 0.02)
    if kind == "int8":
        q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
        return (q.T, s.T), q * s_full
    q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
    if not minimum:
        return (q.T, s.T), q * s_full
    m, m_full = per_block(-0.2, 0.05)
    return (q.T, s.T, m.T[:, None, :]), m_full + q * s_full


def _storage(kind, rows, cols, group, transposed, minimum=True):
    if kind == "fp16":
        return WeightStorage(kind, rows, cols, "w", transposed=transposed)
    return WeightStorage(kind, rows, cols, "w", "s", group, transposed, "m" if kind == "int4" and minimum else None)


@pytest.mark.parametrize("cols", [32, 64, 100, 576])
def test_int4_nibble_layout_round_trips(cols):
    rng = np.random.default_rng()
    q = rng.integers(0, 16, (5, cols)).astype(np.uint8)
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (5, -(-cols // 32) * 16)
    np.testing.assert_array_equal(unpack_int4(packed, cols), q)
    # Column j + 16 of each 32-group sits in the high nibble of byte j.
    byte = int(packed[0, 0])
    assert (byte >> 4) == q[0, 16] and (byte & 15) == q[0, 0]
    with pytest.raises(ValueError):
        pack_int4(q + 16)


def _run(func_te, inputs, params, target):
    """Build a one-kernel Relax function through Kiln's pipeline and run it."""
    bb = relax.BlockBuilder()
    vars_ = [relax.Var(f"a{i}", relax.TensorType(list(a.shape), str(a.dtype))) for i, a in enumerate(inputs)]
    pvars = [relax.Var(f"p{i}", relax.TensorType(list(a.shape), str(a.dtype))) for i, a in enumerate(params)]
    with bb.function("main", vars_ + pvars):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(func_te, *vars_, *pvars))
        bb.emit_func_output(out)
    ex = tvm.compile(bb.get(), target=target, relax_pipeline=relax_pipeline(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in (*inputs, *params)]).numpy()


KINDS = [("int8", 32), ("int8", 128), ("int4", 32), ("int4", 128), ("fp16", None)]


@pytest.mark.parametrize("kind,group,minimum,rows", [(k, g, True, 48) for k, g in KINDS]
                         + [("int4", 32, False, 48), ("int8", 32, True, 46), ("int4", 32, True, 46)])
def test_fused_dequantizing_matmul_matches_numpy(kind, group, minimum, rows):
    """48 rows: stored row-interleaved; 46 (not a multiple of 4): plain."""
    rng = np.random.default_rng()
    cols = 160  # 160 = 5 int4 groups of 32; a partial 128-block
    onnx_arrays, ref = _random_weight(rng, kind, rows, cols, group, minimum)
    storage = _storage(kind, rows, cols, group, True, minimum)
    arrays = stored_arrays(storage, *onnx_arrays)
    specs = stored_specs(storage)
    assert {k: (a.shape, str(a.dtype)) for k, a in arrays.items()} == specs
    assert storage.tile == (4 if rows % 4 == 0 else 1)
    # The data is the plain [rows, units] layout, interleaved: row r's chunk j of 16 units
    # at [r // 4, j * 64 + r % 4 * 16].
    plain = deinterleave_rows(arrays["w"], storage.tile)
    want = {"fp16": lambda: onnx_arrays[0].T, "int8": lambda: onnx_arrays[0].T,
            "int4": lambda: pack_int4(onnx_arrays[0].T)}[kind]()
    np.testing.assert_array_equal(plain, want)
    if storage.tile == 4:
        np.testing.assert_array_equal(arrays["w"][1, 2 * 64 + 3 * 16:2 * 64 + 4 * 16], want[7, 32:48])
    target = parse_target("llvm").tvm_target()
    # [m, K]: the decode GEMV shape; [1, m, K]: a prefill GEMM (weight tiles staged;
    # 16 rows: the packed GEMM of a static bucket).
    for shape, staged in (((1, cols), False), ((3, cols), False), ((1, 5, cols), True), ((2, cols), True),
                          ((1, 16, cols), True)):
        x = rng.standard_normal(shape).astype(np.float32)
        out = _run(matmul_nt_te(storage, staged), [x], [arrays[k] for k in specs], target)
        np.testing.assert_allclose(out, x @ ref.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_gemm_stages_the_panel_in_column_chunks(kind):
    """A static-row quantized GEMM (a prefill bucket) dequantizes each core's panel of
    weight rows STAGE_K columns at a time into an L1-sized buffer, copied transposed into
    the [K, cols] panel; numpy's x @ W.T."""
    from kiln.compiler.lower.schedules.cpu_matmul import STAGE_K

    rng = np.random.default_rng()
    rows, cols = 64, 3 * STAGE_K
    onnx_arrays, ref = _random_weight(rng, kind, rows, cols, 32, True)
    storage = _storage(kind, rows, cols, 32, True, True)
    arrays = stored_arrays(storage, *onnx_arrays)
    specs = stored_specs(storage)
    target = parse_target("llvm").tvm_target()
    x = rng.standard_normal((1, 24, cols)).astype(np.float32)
    out = _run(matmul_nt_te(storage, True), [x], [arrays[k] for k in specs], target)
    np.testing.assert_allclose(out, x @ ref.T, rtol=1e-4, atol=1e-4)
    params = [te.placeholder(shape, dtype, name) for name, (shape, dtype) in specs.items()]
    xp = te.placeholder(x.shape, "float32", "x")
    sch = CPUMatmulNT().apply(te.create_prim_func([xp, *params, matmul_nt_te(storage, True)(xp, *params)]),
                              target, False)
    passes = tvm.s_tir.transform
    lowered = passes.CompactBufferAllocation()(passes.ConvertBlocksToOpaque()(
        passes.PlanAndUpdateBufferAllocationLocation()(passes.LowerInitBlock()(sch.mod)))).script()
    assert re.search(rf"{DEQUANTIZE_W} = T.sblock_alloc_buffer\(\(\d+, {STAGE_K}\)", lowered), lowered


@pytest.mark.parametrize("kind,group", [("int8", 32), ("int4", 32)])
def test_cpu_matmul_rule_schedules_the_dequantizing_kernel(kind, group):
    """The NT schedule (vector accumulators along K, rows across cores) applies to the
    dequantizing kernel, not only to float matmuls."""
    storage = _storage(kind, 64, 128, group, True)
    specs = stored_specs(storage)
    m = tvm.tirx.Var("m", "int64")
    for shape, staged in (((m, 128), False), ((1, m, 128), True)):
        x = te.placeholder(shape, "float32", "x")
        params = [te.placeholder(shape, dtype, name) for name, (shape, dtype) in specs.items()]
        func = te.create_prim_func([x, *params, matmul_nt_te(storage, staged)(x, *params)])
        sch = CPUMatmulNT().apply(func, parse_target("llvm").tvm_target(), False)
        assert sch is not None
        # Decode: dequantized inside the K loop (no weight buffer at all). Prefill: one
        # [nt, K] tile staged inside each parallel tile of rows, never the whole weight.
        assert (DEQUANTIZE_W in sch.mod.script()) == staged
        # Decode: K advances two vectors a step, unrolled, so a block's scale is read once.
        assert ("T.unroll(2)" in sch.mod.script()) == (not staged)
        if staged:
            loops = sch.get_loops(sch.get_sblock(DEQUANTIZE_W))
            assert sch.get(loops[0]).kind == tvm.tirx.ForKind.PARALLEL
            # After TVM's allocation planning the buffer lives inside the parallel loop (one
            # per core) and holds one tile of rows.
            passes = tvm.s_tir.transform
            lowered = passes.CompactBufferAllocation()(passes.ConvertBlocksToOpaque()(
                passes.PlanAndUpdateBufferAllocationLocation()(passes.LowerInitBlock()(sch.mod)))).script()
            alloc = re.search(rf"{DEQUANTIZE_W} = T.sblock_alloc_buffer\(\((\d+), (\d+)\)", lowered)
            assert alloc and int(alloc[1]) < storage.rows and int(alloc[2]) == storage.cols
            assert lowered.index("T.parallel") < alloc.start()


@pytest.mark.parametrize("kind,group", KINDS)
def test_fused_take_rows_matches_numpy(kind, group):
    rng = np.random.default_rng()
    rows, cols = 40, 64
    onnx_arrays, ref = _random_weight(rng, kind, rows, cols, group)
    storage = _storage(kind, rows, cols, group, False)
    # Row form: the ONNX values are [rows, cols] and [rows, nb] already.
    arrays = stored_arrays(storage, *(a.reshape(-1, a.shape[-1]).T for a in onnx_arrays))
    ids = rng.integers(0, rows, (2, 5)).astype(np.int64)
    out = _run(take_rows_te(storage), [ids], [arrays[k] for k in stored_specs(storage)],
               parse_target("llvm").tvm_target())
    np.testing.assert_allclose(out, ref[ids], rtol=1e-6, atol=1e-6)


def _quantized_onnx(checkpoint_dir, quant):
    """The exported prefill graph after the quantize pass (what onnxruntime runs)."""
    from kiln.compiler.export.onnx_export import export_graphs
    from kiln.compiler.models.source import resolve_model
    from kiln.compiler.passes.quantize_activations import quantize_activations
    from kiln.compiler.passes.quantize_weights import quantize_weights

    graphs = export_graphs(resolve_model(checkpoint_dir).build_module())
    graph = quantize_weights(quant)(graphs.prefill)
    return quantize_activations(graph) if quant.activations == "int8" else graph


@pytest.mark.parametrize("variant,scheme", [("llama", "int8"), ("llama", "int4-g32"), ("qwen2", "int4-g128"),
                                            ("qwen2", "fp16"),
                                            *(pytest.param(v, s, marks=pytest.mark.skipif(
                                                not parse_target("llvm").int8_dot, reason="no AVX-512 VNNI or AVX2"))
                                              for v, s in (("qwen2", "w8a8"), ("llama", "w4a8")))])
def test_quantized_artifact_matches_onnxruntime_on_the_quantized_graph(tmp_path, checkpoint, variant, scheme):
    """The compiled int8 / int4 / fp16 / w8a8 / w4a8 artifact computes what onnxruntime computes on
    the same quantized ONNX; its params keep their storage dtypes (never a float copy)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from kiln.compiler.compile import CompileOptions, compile_model
    from kiln.runtime.quantization import parse_quant
    from kiln.runtime.engine import Engine
    from kiln.runtime.executor import CacheConfig, Chunk

    quant = parse_quant(scheme)
    # A float32 KV cache, as onnxruntime's: float16 KV rounds keys and values by ~1e-3, which
    # int8 activations turn into whole-level flips.
    folder = compile_model(checkpoint(variant), tmp_path / "artifact",
                           CompileOptions(parse_target("llvm"), quant=quant, kv_dtype="float32"))
    engine = Engine.load(folder, background=False)
    m = engine.manifest
    assert m.quantization == quant.scheme.name and m.extra["quantization"]["scheme"] == quant.scheme.name
    assert m.activation_dtype == quant.activations
    stored = {p.name: p for p in m.params}
    kind = quant.scheme.kind
    quantized = [p for p in m.params if p.name.endswith(".qweight" if kind != "fp16" else ".fp16")]
    # Every projection (7 per layer), the embedding and (untied) the LM head.
    assert len(quantized) >= 7 * m.model.num_layers + 1
    # int8 weights multiplied by int8 activations are stored q + 128 for the dot-product kernels.
    dtypes = {"int8": "uint8" if quant.activations == "int8" else "int8", "int4": "uint8", "fp16": "float16"}
    for p in quantized:
        # The embedding table and the LM head take the scheme's table kind (int8 for int4).
        table = "embed_tokens" in p.name or "lm_head" in p.name
        if table and quant.activations == "int8":
            # An untied embedding is only gathered from (rows, int8); a table the LM head reads
            # takes the dot-product layout.
            assert p.dtype in ("int8", "uint8"), p.name
            continue
        assert p.dtype == dtypes[quant.scheme.table.kind if table else kind], p.name
    assert sum(p.dtype == dtypes[kind] for p in quantized) >= 7 * m.model.num_layers
    assert not any(n.endswith("_proj.weight") for n in stored), "a float copy of a quantized weight was stored"
    # Loaded in place: the executor's params are the stored dtypes, not float copies.
    loaded = {p.name: str(a.dtype) for p, a in zip(m.params, engine._executor._params)}
    assert all(loaded[p.name] == p.dtype for p in quantized)

    # Graph optimizations off: onnxruntime would otherwise rewrite DequantizeLinear ->
    # MatMul into integer matmuls that also quantize the activations (a different model).
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def session(q):
        path = tmp_path / f"prefill-{q.name}-{q.activations}.onnx"
        ir.save(_quantized_onnx(checkpoint(variant), q), path)
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    sess = session(quant)
    # With int8 activations, an input within float noise (~1e-7: Kiln's and onnxruntime's
    # float kernels differ by that) of a rounding boundary lands one level apart, and on
    # this 64-wide random model one such flip can move a sequence's logits by half of
    # what quantizing the activations at all does. So most sequences must match to 1e-3
    # (a missing, mis-scaled or mis-laid-out quantization breaks every one), and none may
    # be off by more than twice that whole effect (weight-only graph vs this one).
    weight_only = session(parse_quant(quant.scheme.name)) if quant.activations == "int8" else None
    float_close = []

    def run(tokens):
        feeds = {"input_ids": tokens[None], "position_ids": np.arange(tokens.shape[-1], dtype=np.int64)[None]}
        return [s.run(["logits"], feeds)[0].reshape(-1, m.model.vocab_size)[-1] for s in (sess, weight_only) if s]

    def check(got, expected):
        error, tolerance = np.abs(got - expected[0]), 1e-3 + 1e-3 * np.abs(expected[0])
        if weight_only is None:
            assert (error <= tolerance).all(), error.max()
            return
        effect = np.abs(expected[1] - expected[0]).max()
        assert effect > 1e-3  # the oracle quantizes the activations
        assert error.max() <= 2 * effect, (error.max(), effect)
        float_close.append(bool((error <= tolerance).all()))

    rng = np.random.default_rng()
    ids = rng.integers(0, m.model.vocab_size, (11,), dtype=np.int64)

    ex = engine._executor
    cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=64, prefill_chunk_size=32,
                                        page_size=ex.page_size))
    cache.add(0)
    check(ex.forward(cache, [Chunk(0, tuple(ids.tolist()), 0)])[0], run(ids))

    # Decode steps: a batch wider than the manifest's decode_max_batch runs through prefill
    # (weight tiles dequantized once for all rows), a single sequence through the static
    # decode_b1 (and, forced, through the dynamic decode); all must give onnxruntime's
    # next-token logits.
    limit = m.dispatch.decode_max_batch
    assert limit == (16 if quant.activations == "int8" else {"int8": 16, "int4": 8, "fp16": 8}[kind])
    batch, length = limit + 1, 9
    prompts = rng.integers(0, m.model.vocab_size, (batch, length + 3), dtype=np.int64)

    cache = ex.create_cache(CacheConfig(max_batch_size=batch, max_total_tokens=64 * batch, prefill_chunk_size=32,
                                        page_size=ex.page_size))
    for s in range(batch):
        cache.add(s)
        ex.forward(cache, [Chunk(s, tuple(prompts[s, :length].tolist()), 0)])
    wide = [Chunk(s, (int(prompts[s, length]),), length) for s in range(batch)]
    assert ex.route(wide) == "prefill"
    got = ex.forward(cache, wide)
    for s in range(batch):
        check(got[s], run(prompts[s, :length + 1]))
    alone = [Chunk(0, (int(prompts[0, length + 1]),), length + 1)]
    assert ex.route(alone) == "decode_b1"
    check(ex.forward(cache, alone)[0], run(prompts[0, :length + 2]))
    alone = [Chunk(0, (int(prompts[0, length + 2]),), length + 2)]
    check(ex.forward(cache, alone, via="decode")[0], run(prompts[0]))
    assert weight_only is None or np.mean(float_close) >= 0.75, float_close


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_tiny_quantized_weight_keeps_its_scales_as_params(scheme):
    """A weight so small that its scale / minimum have <= 16 elements (which the importer
    would otherwise make constants): still stored and read as the kernels expect, and the
    compiled function computes what onnxruntime computes on the quantized graph."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from kiln.compiler.lower.importer import import_graphs, param_arrays
    from kiln.compiler.passes.quantize_weights import quantize_weights
    from kiln.runtime.quantization import parse_quant

    rng = np.random.default_rng()
    w = rng.standard_normal((4, 32)).astype(np.float32)  # [N=4, K=32]: one block per row
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    quantized = quantize_weights(parse_quant(scheme))(ir.serde.deserialize_model(model))
    assert any(v.name.endswith(".scale") and v.const_value.size <= 16 for v in quantized.graph.initializers.values())
    x = rng.standard_normal((2, 32)).astype(np.float32)
    options = ort.SessionOptions()  # no fusion into onnxruntime's activation-quantizing kernels
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    expected = ort.InferenceSession(ir.to_proto(quantized).SerializeToString(), options,
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    graphs = {"main": quantized}
    mod, params = import_graphs(graphs)
    assert {p.name for p in params.specs} >= {"w.qweight", "w.scale"}
    target = parse_target("llvm").tvm_target()
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target)), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x), [tvm.runtime.tensor(a) for a in param_arrays(graphs, params)])
    np.testing.assert_allclose(out[0].numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_decode_batch_takes_row_tiles(kind):
    """A dynamic decode batch of a quantized weight runs in padded tiles of four rows (each
    dequantized weight vector feeds the tile's rows): numpy's x @ W.T for batches that
    fill no tile, one tile, and one and a bit."""
    rng = np.random.default_rng()
    rows, cols = 48, 96
    group = None if kind == "fp16" else 32
    onnx_arrays, ref = _random_weight(rng, kind, rows, cols, group, True)
    storage = _storage(kind, rows, cols, group, True, True)
    arrays = stored_arrays(storage, *onnx_arrays)
    specs = stored_specs(storage)
    target = parse_target("llvm").tvm_target()
    m = tvm.tirx.Var("batch", "int64")
    xp = te.placeholder((m, 1, cols), "float32", "x")
    params = [te.placeholder(shape, dtype, name) for name, (shape, dtype) in specs.items()]
    y = matmul_nt_te(storage, row_tiles=True)(xp, *params)
    sch = CPUMatmulNT().apply(te.create_prim_func([xp, *params, y]), target, False)
    assert "matmul_row_tiles" in sch.mod.script()
    lib = tvm.compile(sch.mod, target=target)
    for batch in (1, 4, 5):
        x = rng.standard_normal((batch, 1, cols)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((batch, 1, rows), np.float32))
        lib["main"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(arrays[k]) for k in specs], out)
        np.testing.assert_allclose(out.numpy(), x @ ref.T, rtol=1e-4, atol=1e-4)
