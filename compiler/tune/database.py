"""Where MetaSchedule databases live and how ``kiln compile`` finds them.

One folder per target key under ``schedules/`` (``llvm-znver4``, ``cuda-sm_90``), holding
MetaSchedule's JSON database (``database_workload.json``, ``database_tuning_record.json``).
Records are keyed by each kernel's structure, so one database serves every model and
quantization whose kernels it has seen; kernels without a record get the default rules.
A tuned schedule is only valid for the CPU it was measured on: the key names the LLVM CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..targets import TargetSpec

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


def schedules_root() -> Path:
    """``$KILN_SCHEDULES``, else the repository's ``schedules/``."""
    env = os.environ.get("KILN_SCHEDULES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "schedules"


def target_key(target: TargetSpec) -> str:
    """``llvm-<mcpu>`` (this host's CPU when the spec names none) or ``cuda-sm_XX``."""
    if target.kind != "llvm":
        return target.key
    return f"llvm-{target.tvm_target().attrs['mcpu']}"


def database_dir(target: TargetSpec, root: Path | None = None) -> Path:
    return (root or schedules_root()) / target_key(target)


def open_database(folder: Path, create: bool = False):
    """The JSON database in ``folder`` (None when it has none and ``create`` is False)."""
    from tvm.s_tir import meta_schedule as ms

    folder = Path(folder)
    if not create and not (folder / WORKLOADS).is_file():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(str(folder / WORKLOADS), str(folder / RECORDS), allow_missing=create,
                                    module_equality="structural")


def load_database(target: TargetSpec, root: Path | None = None):
    """The committed database for ``target``, or None (the default rules schedule all)."""
    return open_database(database_dir(target, root))


def compact_database(folder: Path, floors: dict[int, float] | None = None) -> int:
    """Keep only the fastest measured record of each kernel in ``folder``'s database (what
    ``kiln compile`` applies; the rest only grows the committed files), and none for a kernel
    whose ``floors[structural hash]`` (its default schedule's seconds) it does not beat.
    Returns how many records remain."""
    if open_database(folder) is None:
        return 0
    best = {key: r for key, r in kernel_records(folder).items()
            if mean_seconds(r.run_secs) < (floors or {}).get(key, float("inf"))}
    write_records(folder, best.values())
    return len(best)


def kernel_records(folder: Path) -> dict:
    """{kernel's structural hash: its fastest measured record} of ``folder``'s database
    ({} when it has none). A kernel none of whose candidates ran has no entry."""
    import tvm_ffi

    database = open_database(folder)
    best = {}
    for record in database.get_all_tuning_records() if database is not None else ():
        if not measured(record.run_secs):
            continue
        key = tvm_ffi.structural_hash(record.workload.mod)
        if key not in best or mean_seconds(record.run_secs) < mean_seconds(best[key].run_secs):
            best[key] = record
    return best


def write_records(folder: Path, records) -> None:
    """Make ``folder``'s database hold exactly ``records`` (none: an empty database, which
    ``kiln compile`` applies as the default rules). Written aside and moved in, so a crash
    leaves the old files whole."""
    import tempfile

    from tvm.s_tir import meta_schedule as ms

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        out = open_database(Path(tmp), create=True)
        for record in records:
            workload = out.commit_workload(record.workload.mod)
            out.commit_tuning_record(ms.database.TuningRecord(
                record.trace, workload, record.run_secs, record.target, record.args_info))
        del out
        for name in (WORKLOADS, RECORDS):
            os.replace(Path(tmp) / name, folder / name)


# MetaSchedule commits a candidate that failed to build or run with run_secs [1e10].
FAILED_SECONDS = 1e9


def measured(run_secs) -> bool:
    """Whether a record's run_secs are a measurement (not absent, not the failure mark)."""
    return bool(run_secs) and all(float(s) < FAILED_SECONDS for s in run_secs)


def mean_seconds(run_secs) -> float:
    """The mean of a MetaSchedule measurement's per-repeat seconds."""
    return sum(float(s) for s in run_secs) / len(run_secs)
