"""The Relax pipeline applies MetaSchedule records from a database before the default
rules: a kernel with a record gets that record's schedule, and computes the same."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from kiln.compiler.lower.pipeline import fusion_passes, relax_pipeline
from kiln.compiler.targets import parse_target

from helpers import matmul_module


def test_pipeline_applies_a_database_record():
    target = parse_target("llvm").tvm_target()
    m, k, n = 2, 64, 51
    mod = matmul_module(m, k, n)
    with target:
        fused = tvm.transform.Sequential(fusion_passes())(mod)
    (task,) = ms.relax_integration.extract_tasks(fused, target)
    workload_mod = task.dispatched[0]
    # A record whose schedule is recognisable: the output rows split by 3 (no default rule
    # splits by 3), with a fake run time.
    sch = tvm.s_tir.Schedule(workload_mod)
    (block,) = sch.get_child_blocks(sch.get_sblock("root", func_name="main"))
    *_, j, _ = sch.get_loops(block)
    sch.split(j, [None, 3])
    database = ms.database.MemoryDatabase()
    workload = database.commit_workload(workload_mod)
    args = ms.arg_info.ArgInfo.from_prim_func(workload_mod["main"])
    database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-6], target, args))

    rng = np.random.default_rng()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for db in (database, None):
        ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target, db))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)
    # The tuned kernel is the record's: its loop nest carries the split by 3 (17 = 51 / 3).
    scheduled = relax_pipeline_kernels(mod, target, database)
    assert any("range(17)" in s or "T.int64(17)" in s for s in scheduled), scheduled
    untuned = relax_pipeline_kernels(mod, target, None)
    assert not any("range(17)" in s or "T.int64(17)" in s for s in untuned)


def relax_pipeline_kernels(mod, target, database) -> list[str]:
    """The scripts of the kernels as Kiln's pipeline leaves them (scheduled TIR)."""
    out = relax_pipeline(target, database)(mod)
    return [f.script() for _, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
