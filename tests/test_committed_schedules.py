"""The committed MetaSchedule database (schedules/<target key>/, written by ``make tune``
for the default model at fp32) holds records only for static kernels the default model
has as Kiln lowers it today: a change to lowering that renames or reshapes a tuned kernel
leaves its record unused, and this says to re-run ``make tune``. Tests never tune;
numerics of the tuned kernels are checked here (the static buckets against the dynamic
functions) and by test_smollm2 (its artifact is compiled with this database, and its
one-sequence decode steps run the tuned decode_b1)."""

from __future__ import annotations

import pytest
import tvm_ffi

from kiln.compiler.compile import CompileOptions, prepare_graphs
from kiln.compiler.targets import parse_target
from kiln.compiler.tune.database import WORKLOADS, database_dir, load_database, target_key
from kiln.compiler.tune.tuner import fused_module, static_tasks


@pytest.mark.slow
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


def test_tuned_buckets_compute_what_the_dynamic_functions_do(smollm2_artifact):
    """The default model compiled with the committed database (when there is one): its
    static buckets, whose kernels the records schedule, give the logits of the dynamic
    ``prefill`` and ``decode`` on fresh random tokens."""
    import numpy as np

    from kiln.runtime.engine import Engine
    from kiln.runtime.executor import CacheConfig, Chunk

    ex = Engine.load(smollm2_artifact, background=False)._executor
    buckets = ex.manifest.dispatch
    assert buckets.static_decode == (1,) and buckets.static_prefill == (128,)
    rng = np.random.default_rng()
    vocab = ex.manifest.model.vocab_size
    prompt = tuple(rng.integers(0, vocab, 128).tolist())
    step = int(rng.integers(0, vocab))
    logits = {}
    for route in ("static", "dynamic"):
        cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=256, prefill_chunk_size=128,
                                            page_size=ex.page_size))
        cache.add(0)
        first = ex.forward(cache, [Chunk(0, prompt, 0)], via="prefill_t128" if route == "static" else "prefill")
        second = ex.forward(cache, [Chunk(0, (step,), 128)], via="decode_b1" if route == "static" else "decode")
        logits[route] = (first, second)
    for got, want in zip(logits["static"], logits["dynamic"]):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)
