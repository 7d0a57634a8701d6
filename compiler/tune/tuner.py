"""``kiln tune``: MetaSchedule search over the static-shape kernels of a model's buckets,
next to Kiln's own schedules, into the target's database.

Tasks are the fused kernels (``lower/pipeline.fusion_passes``) whose shapes are all static:
those of the static buckets (``lower/buckets.py``, ``decode_b1``). Dynamic kernels keep the
default rules: MetaSchedule cannot tune them. After searching, each task's default-rule
schedule is measured the same way, and the database keeps a kernel's best record only
where it beat that: elsewhere ``kiln compile`` keeps applying the live default rules
(a committed copy of their schedule would pin today's version of them). Then the step
gate (``gate.py``) keeps only records that make a whole static-bucket step faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx_ir as ir

from kiln.runtime.model_config import ModelConfig

from ..lower.buckets import with_buckets
from ..targets import TargetSpec
from .database import mean_seconds, measured, open_database
from .gate import GateOptions, GateResult


@dataclass(frozen=True)
class TuneOptions:
    target: TargetSpec
    trials: int = 64  # candidates measured per task
    out_dir: Path | None = None  # default: schedules/<target key>/
    # Keep records only if the whole static-bucket step runs faster with them (gate.py):
    # per-kernel wins measured alone made the step slower.
    gate: bool = True
    gate_options: GateOptions = GateOptions()

    def __post_init__(self):
        if not isinstance(self.trials, int) or self.trials < 0:
            raise ValueError(f"trials must be a non-negative integer, got {self.trials!r}")
        if self.target.kind != "llvm":
            raise ValueError(f"tuning runs kernels on this machine: target {self.target.key} needs its GPU "
                             "(tune on a machine that has one)")


@dataclass(frozen=True)
class TaskResult:
    name: str
    calls: int  # how often one step calls it
    default_us: float | None  # Kiln's default schedule, as measured (None: no default rule applies)
    best_us: float | None  # MetaSchedule's best candidate (None: none built and ran)
    key: int  # the kernel's structural hash (the database's workload key)

    @property
    def tuned(self) -> bool:
        """Its record beat the default schedule (and is kept unless the step gate drops it)."""
        return self.best_us is not None and (self.default_us is None or self.best_us < self.default_us)


Log = Callable[[str], None]


def fused_module(graphs: dict[str, ir.Model], target: TargetSpec, config: ModelConfig, kv_dtype: str | None = None):
    """The model's module after fusion: every kernel is one PrimFunc, unscheduled.
    ``kv_dtype``: the KV cache's stored form (default: the target's, as ``kiln compile``)."""
    import tvm

    from ..compile import default_kv_dtype
    from ..lower.build import relax_module
    from ..lower.pipeline import fusion_passes

    functions, static_dims = with_buckets(graphs, target, config.context_length)
    mod, _ = relax_module(functions, target, config, static_dims, kv_dtype or default_kv_dtype(target))
    with target.tvm_target():
        return tvm.transform.Sequential(fusion_passes())(mod)


def static_tasks(mod, tvm_target):
    """MetaSchedule's tasks for the module's unscheduled, fully static kernels."""
    from tvm import tirx
    from tvm.s_tir import meta_schedule as ms

    tasks = []
    for task in ms.relax_integration.extract_tasks(mod, tvm_target):
        func = task.dispatched[0]["main"]
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            continue  # a hand-written kernel (attention)
        shapes = [getattr(p, "shape", None) for p in func.params]  # None: a scalar parameter
        if all(isinstance(d, tirx.IntImm) for shape in shapes if shape is not None for d in shape):
            tasks.append(task)
    return tasks


def _default_schedule(func, tvm_target):
    """Kiln's default rule's schedule of one kernel (the first rule that applies), or None."""
    from ..lower.schedule_rules import default_rules

    for rule in default_rules(tvm_target.kind.name):
        sch = rule.apply(func, tvm_target, False)
        if sch is not None:
            return sch if not isinstance(sch, list) else sch[0]
    return None


def _measure_default(task, tvm_target, builder, runner) -> float | None:
    """Seconds per call of the default rule's schedule of a task, measured as candidates are."""
    from tvm.s_tir import meta_schedule as ms

    mod = task.dispatched[0]
    sch = _default_schedule(mod["main"], tvm_target)
    if sch is None:
        return None
    built = builder.build([ms.builder.BuilderInput(sch.mod, tvm_target)])[0]
    if built.error_msg:
        return None
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    result = runner.run([ms.runner.RunnerInput(built.artifact_path, "cpu", args_info)])[0].result()
    if result.error_msg:
        return None
    return mean_seconds(result.run_secs)


def _best_us(database, task, tvm_target) -> float | None:
    mod = task.dispatched[0]
    if not database.has_workload(mod):
        return None
    records = database.get_top_k(database.commit_workload(mod), 1)
    if not records or not measured(records[0].run_secs):  # none ran
        return None
    return mean_seconds(records[0].run_secs) * 1e6


def tune_graphs(graphs: dict[str, ir.Model], config: ModelConfig, options: TuneOptions, out_dir: Path,
                log: Log = lambda _: None) -> list[TaskResult]:
    import tempfile

    import tvm_ffi

    from .measure import WorkerBuilder, WorkerRunner

    tvm_target = options.target.tvm_target()
    mod = fused_module(graphs, options.target, config)
    tasks = static_tasks(mod, tvm_target)
    log(f"{len(tasks)} static kernels to tune, {options.trials} candidates each")
    database = open_database(out_dir, create=True)
    with tempfile.TemporaryDirectory(prefix="kiln-tune-") as work_dir:
        builder, runner = WorkerBuilder(work_dir), WorkerRunner()
        try:
            if options.trials and tasks:
                contexts = [tune_context(t.dispatched[0], tvm_target, t.task_name) for t in tasks]
                search(contexts, [t.weight for t in tasks], options.trials, builder, runner, database, work_dir)
            defaults = {}
            for task in tasks:
                seconds = _measure_default(task, tvm_target, builder, runner)
                defaults[task.task_name] = None if seconds is None else seconds * 1e6
        finally:
            builder.close()
            runner.close()
    results = [TaskResult(t.task_name, int(t.weight), defaults[t.task_name], _best_us(database, t, tvm_target),
                          tvm_ffi.structural_hash(t.dispatched[0])) for t in tasks]
    for r in results:
        log(f"  {r.name:<48} x{r.calls:<3} default {_us(r.default_us)}  MetaSchedule {_us(r.best_us)}"
            f"{'  -> tuned' if r.tuned else ''}")
    return results


def tune_context(mod, tvm_target, name: str):
    """MetaSchedule's evolutionary search context for one kernel (a one-function IRModule)."""
    from tvm.s_tir import meta_schedule as ms

    from .intrinsics import import_tensor_intrinsics

    import_tensor_intrinsics()  # before MetaSchedule does, slowly
    # One search thread: with more, MetaSchedule calls Python (the logger) from its own
    # threads, which segfaulted here in 1 of 2 runs.
    return ms.TuneContext(mod=mod, target=tvm_target, space_generator="post-order-apply",
                          search_strategy="evolutionary", task_name=name, num_threads=1).clone()


def search(contexts, weights, trials: int, builder, runner, database, work_dir: str) -> None:
    """MetaSchedule's search over the contexts, ``trials`` candidates each, into ``database``."""
    from tvm.s_tir import meta_schedule as ms

    ms.tune_tasks(tasks=contexts, task_weights=[float(w) for w in weights], work_dir=work_dir,
                  max_trials_global=trials * len(contexts), max_trials_per_task=trials,
                  num_trials_per_iter=min(16, trials), builder=builder, runner=runner, database=database,
                  cost_model="xgb",
                  # Not the default RemoveBuildArtifact: it deletes the folder of a candidate's
                  # file, which is the builder's whole work_dir (a temporary folder).
                  measure_callbacks=[ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel()])


def _us(value: float | None) -> str:
    return "      -" if value is None else f"{value:7.1f} us"


@dataclass(frozen=True)
class TuneReport:
    tasks: tuple[TaskResult, ...]
    gates: dict[str, GateResult] | None  # by weight scheme; None: the gate was skipped
    records: int  # records the database holds at the end
    database: Path


def tune_model(model: str | Path, quants, options: TuneOptions, log: Log = lambda _: None) -> TuneReport:
    """Tune the static kernels of ``model`` compiled with each of ``quants`` (QuantConfigs)
    into ``options.out_dir`` (default: the target's folder under ``schedules/``), then gate
    the records on the step time of each scheme's artifact (unless ``options.gate`` is off)."""
    from ..compile import CompileOptions, prepare_graphs
    from .database import compact_database, database_dir
    from .gate import ArtifactTimer, gate_database, write_evidence

    out_dir = Path(options.out_dir) if options.out_dir else database_dir(options.target)
    results, floors, gates = [], {}, {}
    for quant in quants:
        log(f"== {quant.scheme.name}")
        compile_options = CompileOptions(options.target, quant=quant)
        source, graphs = prepare_graphs(model, compile_options, log)
        tasks = tune_graphs(dict(graphs.items()), source.config, options, out_dir, log)
        results += tasks
        # A kernel whose default schedule measured faster gets no record: compile keeps the rules.
        floors.update({r.key: (r.default_us or float("inf")) * 1e-6 for r in tasks})
        kept = compact_database(out_dir, floors)
        log(f"database: {out_dir} ({kept} kernels with a record faster than the default schedule)")
        if options.gate:
            # Gated per scheme while its graphs are at hand. A kernel two schemes share is
            # decided by the later scheme's gate (its search may re-add a dropped record).
            with ArtifactTimer(source, graphs, compile_options, out_dir, options.gate_options, log) as timer:
                gates[quant.scheme.name] = gate_database(out_dir, tasks, timer, options.gate_options, log)
            log(gates[quant.scheme.name].summary())
        del source, graphs
    database = open_database(out_dir)
    records = len(database.get_all_tuning_records()) if database is not None else 0
    write_evidence(out_dir, gates if options.gate else None, options.gate_options, records)
    return TuneReport(tuple(results), gates if options.gate else None, records, out_dir)
