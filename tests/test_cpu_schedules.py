"""Kiln's CPU schedule rule for reduction-free kernels, on a fresh TE kernel with a
dynamic dim: spread over cores, vectorized, and numpy's numbers."""

from __future__ import annotations

import re
import numpy as np
import pytest
import tvm
from tvm import te, tirx

from kiln.compiler.lower.schedules import CPUElementwise
from kiln.compiler.lower.schedules.cpu_matmul import vector_lanes
from kiln.compiler.targets import parse_target


def _kernel(n: int):
    s = tirx.Var("s", "int64")
    x = te.placeholder((1, s, 2 * n), "float32", "x")
    # A split-and-combine (as a fused gate / up would be) and a broadcast bias.
    b = te.placeholder((n,), "float32", "b")
    y = te.compute((1, s, n), lambda i, j, k: x[i, j, k] * x[i, j, k + n] + b[k], name="y")
    return te.create_prim_func([x, b, y]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("n", [64, 24])  # a vector multiple, and not
def test_elementwise_kernel_is_parallel_vectorized_and_correct(n):
    target = parse_target("llvm").tvm_target()
    sch = CPUElementwise().apply(_kernel(n), target, False)
    assert sch is not None
    text = sch.mod.script()
    assert "T.parallel" in text
    vec = vector_lanes(target)
    assert ("T.vectorized" in text) == (n % vec == 0 and n > vec)
    lib = tvm.compile(sch.mod, target=target)
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 33, 2 * n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((1, 33, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(b), out)
    np.testing.assert_allclose(out.numpy(), x[..., :n] * x[..., n:] + b, rtol=1e-6, atol=1e-6)  # FMA rounding


def test_reductions_are_left_to_other_rules():
    k = te.reduce_axis((0, 8), "k")
    x = te.placeholder((4, 8), "float32", "x")
    y = te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="y")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
    assert CPUElementwise().apply(func, parse_target("llvm").tvm_target(), False) is None


def _rms_norm_module(rows):
    """relax rms_norm of x [rows, 1, 96] (rows: an int, or a symbolic name) by a weight."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, 1, 96], "float32"))
    w = relax.Var("w", relax.TensorType([96], "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-5)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("rows", [1, "batch"])
def test_one_row_reduction_runs_serial_and_correct(rows):
    """A static one-row RMSNorm is one serial row (dlight's Reduction rule parallelized its
    weight cast and recomputed the row per element); a dynamic batch keeps that rule."""
    from tvm import relax

    from kiln.compiler.lower.pipeline import relax_pipeline

    target = parse_target("llvm").tvm_target()
    if rows == "batch":
        rows = tirx.Var("batch", "int64")
    mod = _rms_norm_module(rows)
    scheduled = relax_pipeline(target)(mod)
    (kernel,) = [f.script() for gv, f in scheduled.functions_items()
                 if isinstance(f, tirx.PrimFunc) and "rms_norm" in gv.name_hint]
    assert ("T.parallel" in kernel) == isinstance(rows, tirx.Var)
    ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
    rng = np.random.default_rng()
    n = 1 if isinstance(rows, int) else 5
    x = rng.standard_normal((n, 1, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,packed", [(128, 1536, True), (128, 96, True), (6, 96, False)])
def test_static_rows_take_the_packed_gemm(m, k, packed):
    """A static row count divisible by four (a prefill bucket's projection) is a packed
    GEMM: each core copies its panel of weight rows transposed to [K, cols] and
    accumulates whole output vectors (no K-lane partial sums to add up); other row counts
    keep the K-lane form. Both compute x @ W.T as numpy does."""
    from tvm import relax

    from kiln.compiler.lower.pipeline import relax_pipeline

    from helpers import matmul_module

    target = parse_target("llvm").tvm_target()
    mod = matmul_module(m, k, 48)
    scheduled = relax_pipeline(target)(mod)
    (kernel,) = [f.script() for gv, f in scheduled.functions_items()
                 if isinstance(f, tirx.PrimFunc) and "matmul" in gv.name_hint]
    assert ("w_global[v1, v0] = w[v0, v1]" in kernel) == packed
    assert ("NT_matmul_rf" in kernel) != packed
    ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
    rng = np.random.default_rng()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((48, k)).astype(np.float32)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)


def test_every_kernel_of_a_model_is_marked_noalias(checkpoint):
    """All kernels, the KV cache's TVMScript ones included, carry tirx.noalias: one kernel
    without it in the module made TVM's codegen drop the noalias compute function of
    others (a 128-row projection ran 2.3x slower; lower/noalias.py)."""
    from kiln.compiler.compile import CompileOptions, prepare_graphs
    from kiln.compiler.lower.buckets import with_buckets
    from kiln.compiler.lower.build import relax_module
    from kiln.compiler.lower.pipeline import relax_pipeline

    spec = parse_target("llvm")
    source, graphs = prepare_graphs(checkpoint("llama"), CompileOptions(spec))
    functions, static = with_buckets(dict(graphs.items()), spec, source.config.context_length)
    mod, _ = relax_module(functions, spec, source.config, static)
    lowered = relax_pipeline(spec.tvm_target())(mod)
    kernels = {gv.name_hint: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert any("tree_attn" in name for name in kernels)  # the kernel that lacked it
    missing = [name for name, f in kernels.items() if not (f.attrs is not None and f.attrs.get("tirx.noalias", False))]
    assert not missing


@pytest.mark.parametrize("rows,staged", [((1,), False), ((3,), False), ((128,), True), (("batch",), False),
                                         (("batch", 1), False), (("batch", "seq"), True)])
def test_panel_weights_take_the_broadcast_matmul(rows, staged):
    """A float32 weight stored as K-major panels [N / 32, K, 32] (lower/quant_weights.py) is
    read in place by every row count, a decode GEMV (static or dynamic batch) and a
    prefill GEMM alike: no K-lane partial sums, no staged copy, and numpy's x @ W.T
    (dynamic counts in padded row tiles of 4 or 8; here 5 and 2 x 3 rows: partial tiles)."""
    from kiln.compiler.lower.quant_weights import PANEL, WeightStorage, float_panels, matmul_nt_te
    from kiln.compiler.lower.schedules import CPUMatmulNT

    n, k = 96, 80
    storage = WeightStorage("fp32", n, k, "w")
    assert storage.tile == PANEL
    lead = [tirx.Var(d, "int64") if isinstance(d, str) else d for d in rows]
    x = te.placeholder((*lead, k), "float32", "x")
    panels = te.placeholder((n // PANEL, k, PANEL), "float32", "w")
    y = matmul_nt_te(storage, staged=staged, row_tiles=True)(x, panels)
    func = te.create_prim_func([x, panels, y]).with_attr("global_symbol", "main")
    target = parse_target("llvm").tvm_target()
    sch = CPUMatmulNT().apply(func, target, False)
    assert sch is not None
    text = sch.mod.script()
    # One buffer (no rfactor partial sums, no staged weight copy): a static row count's
    # tile of accumulators, or a dynamic one's padded row tiles.
    dynamic = any(isinstance(d, str) for d in rows)
    buffers = ["matmul_row_tiles"] if dynamic else ["matmul_global"]
    assert re.findall(r"(\w+) = T.sblock_alloc_buffer", text) == buffers and "T.parallel" in text
    lib = tvm.compile(sch.mod, target=target)
    rng = np.random.default_rng()
    shape = [{"batch": 5 if len(rows) == 1 else 2, "seq": 3}.get(d, d) for d in rows]
    xs = rng.standard_normal((*shape, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((*shape, n), np.float32))
    lib["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(float_panels(w, PANEL)), out)
    np.testing.assert_allclose(out.numpy(), xs.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
