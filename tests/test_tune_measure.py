"""kiln tune's builder and runner: candidates built and timed in long-lived worker
processes, a failing or hanging candidate reported as failed without stopping the
search, and a MetaSchedule search through them commits measured records whose best
schedule computes what numpy does."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from kiln.compiler.lower.pipeline import fusion_passes, relax_pipeline
from kiln.compiler.targets import parse_target
from kiln.compiler.tune.database import FAILED_SECONDS, measured
from kiln.compiler.tune.measure import MeasureWorker, WorkerBuilder, WorkerRunner
from kiln.compiler.tune.tuner import search, tune_context

from helpers import matmul_module

M, K, N = 1, 96, 40


@pytest.fixture(scope="module")
def target():
    return parse_target("llvm").tvm_target()


@pytest.fixture(scope="module")
def task(target):
    """MetaSchedule's task for the single matmul kernel of x [1, 96] @ w [40, 96].T."""
    with target:
        fused = tvm.transform.Sequential(fusion_passes())(matmul_module(M, K, N))
    (task,) = ms.relax_integration.extract_tasks(fused, target)
    return task.dispatched[0]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    builder, runner = WorkerBuilder(tmp_path_factory.mktemp("candidates")), WorkerRunner(repeat=4, min_repeat_ms=1)
    yield builder, runner
    builder.close()
    runner.close()


def _random(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_a_candidate_is_built_and_timed_out_of_process(task, target, workers):
    builder, runner = workers
    sch = tvm.s_tir.Schedule(task)
    (built,) = builder.build([ms.builder.BuilderInput(sch.mod, target)])
    assert built.error_msg is None, built.error_msg
    args_info = ms.arg_info.ArgInfo.from_prim_func(task["main"])
    (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", args_info)])
    result = future.result()
    assert result.error_msg is None, result.error_msg
    costs = [float(c) for c in result.run_secs]
    assert len(costs) == 4 and all(0 < c < 1 for c in costs)
    # The worker's file is the kernel: loaded here, it computes x @ w.T.
    rng = np.random.default_rng()
    x, w = _random(rng, (M, K)), _random(rng, (N, K))
    out = tvm.runtime.tensor(np.zeros((M, N), np.float32))
    module = tvm.runtime.load_module(built.artifact_path)
    module[module.entry_name](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    np.testing.assert_allclose(out.numpy(), x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_failing_candidate_does_not_stop_the_worker(tmp_path):
    worker = MeasureWorker("run", timeout_s=60)
    try:
        missing = tmp_path / "missing.so"
        reply = worker.request({"path": str(missing), "args": [], "repeat": 1, "min_repeat_ms": 0,
                                "cold_bytes": 0, "max_copies": 1})
        assert "missing.so" in reply["error"]
        process = worker._process
        assert process.poll() is None  # still serving
        process.kill()  # as a crashing kernel would
        process.wait()
        reply = worker.request({"path": str(missing), "args": [], "repeat": 1, "min_repeat_ms": 0,
                                "cold_bytes": 0, "max_copies": 1})
        assert "missing.so" in reply["error"] and worker._process is not process  # a new worker
    finally:
        worker.close()


def test_a_hanging_candidate_is_killed_and_reported(task, target, tmp_path):
    builder = WorkerBuilder(tmp_path)
    try:
        builder.build([ms.builder.BuilderInput(task, target)])  # worker started, LLVM warm
        first = builder.worker._process
        builder.worker.timeout_s = 1e-4  # no build replies this fast: as if LLVM hung
        (late,) = builder.build([ms.builder.BuilderInput(task, target)])
        assert late.artifact_path is None and "no reply" in late.error_msg
        builder.worker.timeout_s = 60
        (built,) = builder.build([ms.builder.BuilderInput(task, target)])
        assert built.error_msg is None and builder.worker._process is not first
    finally:
        builder.close()


def test_search_commits_measured_records_that_compute_the_kernel(task, target, workers, tmp_path):
    builder, runner = workers
    database = ms.database.MemoryDatabase()
    search([tune_context(task, target, "matmul")], [1.0], 8, builder, runner, database, str(tmp_path))
    records = database.get_all_tuning_records()  # fewer than 8 when candidates repeat
    # A candidate that failed (a build timeout on a loaded machine) carries MetaSchedule's
    # failure mark, never a time that could win; the others carry real seconds.
    ran = [r.run_secs for r in records if measured(r.run_secs)]
    failed = [r.run_secs for r in records if not measured(r.run_secs)]
    assert ran and all(0 < float(s) < 1 for run_secs in ran for s in run_secs)
    assert all(float(s) >= FAILED_SECONDS for run_secs in failed for s in run_secs)
    # The best record, applied by Kiln's pipeline, computes x @ w.T.
    module = matmul_module(M, K, N)
    ex = tvm.compile(module, target=target, relax_pipeline=relax_pipeline(target, database))
    rng = np.random.default_rng()
    x, w = _random(rng, (M, K)), _random(rng, (N, K))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


def _database_with_records(folder, task, target, times) -> None:
    """A JSON database in ``folder`` with a record per time for the task, one never
    measured and one that failed (MetaSchedule's mark, faster-looking to nothing)."""
    from kiln.compiler.tune.database import open_database

    database = open_database(folder, create=True)
    workload = database.commit_workload(task)
    args_info = ms.arg_info.ArgInfo.from_prim_func(task["main"])
    for seconds in [*times, None, 1e10]:
        run_secs = None if seconds is None else [float(seconds)]
        trace = tvm.s_tir.Schedule(task).trace
        database.commit_tuning_record(ms.database.TuningRecord(trace, workload, run_secs, target, args_info))


def test_compaction_keeps_the_fastest_record_that_beats_the_default(task, target, tmp_path):
    import tvm_ffi

    from kiln.compiler.tune.database import compact_database, open_database

    times = np.random.default_rng().uniform(1e-6, 1e-3, size=5)
    key = tvm_ffi.structural_hash(task)
    _database_with_records(tmp_path / "a", task, target, times)
    assert compact_database(tmp_path / "a", floors={key: float(times.min()) * 2}) == 1
    (record,) = open_database(tmp_path / "a").get_all_tuning_records()
    assert float(record.run_secs[0]) == pytest.approx(times.min(), rel=1e-6)
    # The default schedule measured faster than every record: the kernel keeps the rules.
    _database_with_records(tmp_path / "b", task, target, times)
    assert compact_database(tmp_path / "b", floors={key: float(times.min()) * 0.5}) == 0
    assert len(open_database(tmp_path / "b").get_all_tuning_records()) == 0
    # A kernel none of whose candidates ran keeps the rules even without a floor.
    _database_with_records(tmp_path / "c", task, target, [])
    assert compact_database(tmp_path / "c") == 0
