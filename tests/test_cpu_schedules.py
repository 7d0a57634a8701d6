"""Kiln's CPU schedule rule for reduction-free kernels, on a fresh TE kernel with a
dynamic dim: spread over cores, vectorized, and numpy's numbers."""

from __future__ import annotations

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
