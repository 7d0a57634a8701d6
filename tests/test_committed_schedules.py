"""The committed MetaSchedule database (schedules/<target key>/, written by ``make tune``
for the default model at fp32) holds records only for static kernels the default model
has as Kiln lowers it today: a change to lowering that renames or reshapes a tuned kernel
leaves its record unused, and this says to re-run ``make tune``. Tests never tune;
numerics of the tuned kernels are checked by test_smollm2 (its artifact is compiled with
this database, and its one-sequence decode steps run the tuned decode_b1)."""

from __future__ import annotations

import pytest
import tvm_ffi

from kiln.compiler.compile import CompileOptions, prepare_graphs
from kiln.compiler.targets import parse_target
from kiln.compiler.tune.database import WORKLOADS, database_dir, load_database, target_key
from kiln.compiler.tune.tuner import fused_module, static_tasks


def test_committed_records_match_the_default_models_kernels():
    spec = parse_target("llvm")
    if not (database_dir(spec) / WORKLOADS).is_file():
        pytest.skip(f"no committed database for {target_key(spec)} (this host's CPU)")
    records = load_database(spec).get_all_tuning_records()
    source, graphs = prepare_graphs("default", CompileOptions(spec))
    tasks = static_tasks(fused_module(dict(graphs.items()), spec, source.config), spec.tvm_target())
    kernels = {tvm_ffi.structural_hash(t.dispatched[0]): t.task_name for t in tasks}
    stale = [r for r in records if tvm_ffi.structural_hash(r.workload.mod) not in kernels]
    assert not stale, f"{len(stale)} of {len(records)} records match no kernel of the default model (re-run `make tune`)"
    for record in records:
        assert record.run_secs and all(0 < float(s) < 1 for s in record.run_secs)
