"""kiln tune's step gate: the decision on fake step timers (keep every record when the step
is faster, fall back to the records claiming the most gain, else keep none), its rewrite
of a real database, and one real gate timing on the tiny model: both artifacts build, the
runtime-only timer returns their decode_b1 step times, and the searched records leave the
logits as they were."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tvm

from kiln.compiler.compile import CompileOptions, compile_graphs, prepare_graphs
from kiln.compiler.targets import parse_target
from kiln.compiler.tune.database import kernel_records, open_database
from kiln.compiler.tune.gate import (GATE_FILE, ArtifactTimer, Candidate, GateOptions, gate_database, passes,
                                     run_gate, subsets, write_evidence)
from kiln.compiler.tune.tuner import TaskResult

from helpers import matmul_module

OPTIONS = GateOptions(min_gain=0.02, slack=0.01)
UNTUNED = {"decode_b1": 0.020, "prefill_t128": 0.100}


def _candidates(gains: dict[str, float]) -> tuple[Candidate, ...]:
    return tuple(Candidate(key=i + 1, name=name, gain_us=gain) for i, (name, gain) in enumerate(gains.items()))


class FakeTimer:
    """Step times from per-kernel effects that need not match the claimed gains:
    ``effects[key]`` is the fraction it changes each bucket's step by (negative: faster)."""

    def __init__(self, effects: dict[int, float]):
        self.effects, self.calls = effects, []

    def __call__(self, keys: frozenset[int]):
        self.calls.append(keys)
        factor = 1.0 + sum(self.effects[k] for k in keys)
        return dict(UNTUNED), {b: s * factor for b, s in UNTUNED.items()}


def test_passes_needs_the_margin_on_some_bucket_and_no_slower_bucket():
    assert passes(UNTUNED, {b: s * 0.97 for b, s in UNTUNED.items()}, OPTIONS)
    assert not passes(UNTUNED, {b: s * 0.99 for b, s in UNTUNED.items()}, OPTIONS)  # under the margin
    assert not passes(UNTUNED, {b: s * 1.05 for b, s in UNTUNED.items()}, OPTIONS)
    # Decode records: decode 3% faster, prefill as it was (no dilution by the untouched bucket).
    assert passes(UNTUNED, {"decode_b1": 0.0194, "prefill_t128": 0.100}, OPTIONS)
    # decode 10% faster, prefill 5% slower: one bucket lost.
    assert not passes(UNTUNED, {"decode_b1": 0.018, "prefill_t128": 0.105}, OPTIONS)
    # ... within the noise slack it may.
    assert passes(UNTUNED, {"decode_b1": 0.018, "prefill_t128": 0.1005}, OPTIONS)
    with pytest.raises(ValueError, match="different buckets"):
        passes(UNTUNED, {"decode_b1": 0.01}, OPTIONS)


@pytest.mark.parametrize("n, sizes", [(1, [1]), (2, [2, 1]), (3, [3, 2, 1]), (8, [8, 4, 1]), (9, [9, 5, 1])])
def test_subsets_are_all_then_top_half_then_top_one_by_claimed_gain(n, sizes):
    rng = np.random.default_rng()
    gains = rng.permutation(n).astype(float) * 10.0
    candidates = _candidates({f"k{i}": g for i, g in enumerate(gains)})
    tried = subsets(candidates)
    assert [len(s) for s in tried] == sizes
    by_gain = sorted(candidates, key=lambda c: -c.gain_us)
    assert all(list(s) == by_gain[:len(s)] for s in tried)
    assert subsets(()) == []


def test_gate_keeps_every_record_when_the_step_is_faster():
    candidates = _candidates({"a": 50.0, "b": 20.0, "c": 5.0})
    timer = FakeTimer({1: -0.02, 2: -0.01, 3: 0.0})
    result = run_gate(candidates, timer, OPTIONS)
    assert timer.calls == [frozenset({1, 2, 3})]  # one build and timing when the whole set passes
    assert result.kept == candidates and [a.passed for a in result.attempts] == [True]
    assert "kept 3 of 3 records" in result.summary()


def test_gate_keeps_nothing_when_no_subset_is_faster():
    candidates = _candidates({"a": 50.0, "b": 20.0, "c": 5.0, "d": 1.0})
    timer = FakeTimer({1: 0.03, 2: -0.01, 3: -0.01, 4: 0.0})  # the most claimed gain hurts most
    result = run_gate(candidates, timer, OPTIONS)
    assert timer.calls == [frozenset({1, 2, 3, 4}), frozenset({1, 2}), frozenset({1})]
    assert result.kept == () and not any(a.passed for a in result.attempts)
    assert "kept 0 of 4 records" in result.summary()


def test_gate_falls_back_to_the_top_records_when_the_rest_slow_the_step():
    # The largest claimed gain is real; a lesser one (measured alone) slows the step down.
    candidates = _candidates({"gemv": 120.0, "down": 60.0, "norm": 30.0, "rope": 8.0, "add": math.inf})
    timer = FakeTimer({1: -0.03, 2: -0.01, 3: 0.08, 4: 0.0, 5: -0.03})
    result = run_gate(candidates, timer, OPTIONS)
    # Everything: +0.01 -> fail; the top 3 (add, gemv, down): -0.07 -> kept.
    assert timer.calls == [frozenset({1, 2, 3, 4, 5}), frozenset({5, 1, 2})]
    assert [c.name for c in result.kept] == ["add", "gemv", "down"]
    assert [a.passed for a in result.attempts] == [False, True]


def test_no_records_means_no_timing():
    timer = FakeTimer({})
    result = run_gate((), timer, OPTIONS)
    assert timer.calls == [] and result.kept == () and "no records" in result.summary()


def _matmul_tasks(shapes):
    """MetaSchedule's workload IRModule of one matmul kernel per (m, k, n)."""
    from tvm.s_tir import meta_schedule as ms

    from kiln.compiler.lower.pipeline import fusion_passes

    target = parse_target("llvm").tvm_target()
    mods = []
    for m, k, n in shapes:
        with target:
            fused = tvm.transform.Sequential(fusion_passes())(matmul_module(m, k, n))
        (task,) = ms.relax_integration.extract_tasks(fused, target)
        mods.append(task.dispatched[0])
    return mods, target


def test_gate_database_drops_the_records_the_gate_rejects_and_keeps_other_kernels(tmp_path):
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    mods, target = _matmul_tasks([(1, 32, 24), (1, 48, 16), (2, 16, 8)])
    database = open_database(tmp_path, create=True)
    for mod in mods:
        workload = database.commit_workload(mod)
        database.commit_tuning_record(ms.database.TuningRecord(
            tvm.s_tir.Schedule(mod).trace, workload, [1e-5], target, ms.arg_info.ArgInfo.from_prim_func(mod["main"])))
    del database
    keys = [tvm_ffi.structural_hash(m) for m in mods]
    # The first two kernels are this model's; the third another's (a record tuning it left).
    tasks = [TaskResult("claims_more", 2, 40.0, 10.0, keys[0]), TaskResult("claims_less", 1, 20.0, 10.0, keys[1])]
    timer = FakeTimer({keys[0]: 0.05, keys[1]: -0.05})  # the larger claim slows the step
    result = gate_database(tmp_path, tasks, timer, OPTIONS)
    # All (fails), then the top one, claims_more (fails): nothing of this model's kept.
    assert timer.calls == [frozenset(keys[:2]), frozenset(keys[:1])] and result.kept == ()
    assert set(kernel_records(tmp_path)) == {keys[2]}
    # gate.json carries the measurements and the decision.
    evidence = json.loads(write_evidence(tmp_path, {"fp32": result}, OPTIONS, 1).read_text())
    assert (tmp_path / GATE_FILE).is_file() and evidence["gated"] and evidence["records"] == 1
    fp32 = evidence["schemes"]["fp32"]
    assert fp32["kept"] == [] and [a["passed"] for a in fp32["attempts"]] == [False, False]
    assert fp32["attempts"][0]["untuned_ms"]["decode_b1"] == pytest.approx(20.0)
    assert fp32["attempts"][0]["tuned_ms"]["decode_b1"] == pytest.approx(20.0)  # +0.05 - 0.05


# -- the real gate on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(checkpoint):
    spec = parse_target("llvm")
    source, graphs = prepare_graphs(checkpoint("llama"), CompileOptions(spec))
    return spec, source, graphs


@pytest.fixture(scope="module")
def searched(tiny, tmp_path_factory):
    """A database of real records: MetaSchedule's short search over one GEMV of the tiny
    model's decode_b1 (a full ``tune_graphs`` searches all ~20 static kernels: minutes)."""
    from kiln.compiler.tune.measure import WorkerBuilder, WorkerRunner
    from kiln.compiler.tune.tuner import fused_module, search, static_tasks, tune_context

    spec, source, graphs = tiny
    tvm_target = spec.tvm_target()
    tasks = static_tasks(fused_module(dict(graphs.items()), spec, source.config), tvm_target)
    # A decode_b1 matmul: its activations [1, 1, K] (prefill buckets' have T rows).
    gemv = next(t for t in tasks if "matmul" in t.task_name
                and all(int(d) == 1 for d in t.dispatched[0]["main"].params[0].shape[:-1]))
    folder = tmp_path_factory.mktemp("searched")
    work = tmp_path_factory.mktemp("candidates")
    builder, runner = WorkerBuilder(work), WorkerRunner(repeat=2, min_repeat_ms=1)
    try:
        search([tune_context(gemv.dispatched[0], tvm_target, gemv.task_name)], [1.0], 2, builder, runner,
               open_database(folder, create=True), str(work))
    finally:
        builder.close()
        runner.close()
    assert len(kernel_records(folder)) == 1
    return folder


def _decode_logits(folder, prompt, token) -> np.ndarray:
    """Logits of one decode_b1 step after ``prompt``, in a fresh cache."""
    from kiln.runtime.artifact import load_manifest
    from kiln.runtime.device import open_device
    from kiln.runtime.executor import CacheConfig, Chunk, PagedExecutor

    manifest = load_manifest(folder)
    ex = PagedExecutor(folder, manifest, open_device(manifest.target))
    cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=len(prompt) + 2 * ex.page_size,
                                        prefill_chunk_size=len(prompt), page_size=ex.page_size))
    cache.add(0)
    ex.forward(cache, [Chunk(0, tuple(prompt), 0)])
    return ex.forward(cache, [Chunk(0, (token,), len(prompt))], via="decode_b1")


def test_the_gate_times_both_artifacts_and_the_records_keep_the_logits(tiny, searched):
    spec, source, graphs = tiny
    options = GateOptions(steps=4, warmup=1, context=32)
    with ArtifactTimer(source, graphs, CompileOptions(spec), searched, options) as timer:
        untuned, tuned = timer(frozenset(kernel_records(searched)))
        for medians in (untuned, tuned):
            assert "decode_b1" in medians
            assert all(0 < s < 10 and math.isfinite(s) for s in medians.values()), medians
        assert set(untuned) == set(tuned)
        manifests = [json.loads((a / "manifest.json").read_text()) for a in (timer.untuned, timer.tuned)]
        assert manifests[0]["extra"]["schedules"] == "default rules"
        assert "records-1 (1 records)" in manifests[1]["extra"]["schedules"]  # the record was applied
        rng = np.random.default_rng()
        vocab = source.config.vocab_size
        prompt, token = rng.integers(0, vocab, 20).tolist(), int(rng.integers(0, vocab))
        ref, got = (_decode_logits(a, prompt, token) for a in (timer.untuned, timer.tuned))
        assert ref.shape == (1, vocab) and np.abs(ref).max() > 1e-3
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_a_named_database_folder_must_hold_one(tiny, tmp_path):
    spec, source, graphs = tiny
    with pytest.raises(ValueError, match="schedules_dir"):
        compile_graphs(source, graphs, tmp_path / "art", CompileOptions(spec, schedules_dir=tmp_path / "none"))
    with pytest.raises(ValueError, match="schedules_dir"):
        CompileOptions(spec, tuned=False, schedules_dir=tmp_path)
