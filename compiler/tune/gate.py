"""``kiln tune``'s step gate: a database's records are kept only if the whole step runs
faster with them.

MetaSchedule's per-kernel wins, each measured alone, made the batch-1 decode step of the
135M model 16-36% slower once compiled in: a kernel timed in isolation is not the kernel
inside the step. So the gate builds the model twice, with the default rules only and with
the candidate records, times the static-bucket steps of both artifacts in one runtime-only
process (``step_timer.py``, the two alternating step by step), and keeps the records only
if the tuned step is faster by a margin. If not, it retries with the records claiming the
most gain (the top half, then the top one) and keeps the first subset that passes, else
none (``kiln compile`` then uses the default rules everywhere).

The decision (``run_gate``) takes the timer as a function, so it is tested without
building anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STEP_TIMER = Path(__file__).with_name("step_timer.py")
GATE_FILE = "gate.json"  # next to the database: the measurements behind its records

Log = Callable[[str], None]
Medians = dict[str, float]  # bucket function name -> median seconds per step
# records to compile in (kernel keys) -> (untuned medians, tuned medians), timed together
Timer = Callable[[frozenset[int]], tuple[Medians, Medians]]


@dataclass(frozen=True)
class GateOptions:
    steps: int = 30  # measured steps per artifact and bucket
    warmup: int = 3  # first steps of each, dropped (thread pool start, first touch of weights)
    context: int = 128  # tokens each decode sequence holds
    min_gain: float = 0.03  # some bucket's tuned step must be this much faster
    slack: float = 0.03  # and no bucket slower than this (noise: its kernels may have no record)
    timeout_s: float = 900.0  # one timing run (loads both artifacts)

    def __post_init__(self):
        for name in ("steps", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain!r}")
        if not 0.0 <= self.slack < 1.0:
            raise ValueError(f"slack must be in [0, 1), got {self.slack!r}")


@dataclass(frozen=True)
class Candidate:
    """A kernel whose record the database holds, with the gain its per-kernel timing claims."""

    key: int  # structural hash (the database's workload key)
    name: str
    gain_us: float  # (default - best) us x calls per step; inf when no default schedule was measured


@dataclass(frozen=True)
class Attempt:
    kernels: tuple[str, ...]  # the records compiled into the tuned artifact
    untuned: Medians
    tuned: Medians
    passed: bool

    def describe(self) -> str:
        rows = ", ".join(f"{b} {self.untuned[b] * 1e3:.2f} ms untuned vs {self.tuned[b] * 1e3:.2f} ms tuned "
                         f"({(self.tuned[b] / self.untuned[b] - 1) * 100:+.1f}%)" for b in sorted(self.untuned))
        return f"{len(self.kernels)} records: {rows} -> {'pass' if self.passed else 'fail'}"


@dataclass(frozen=True)
class GateResult:
    candidates: tuple[Candidate, ...]
    attempts: tuple[Attempt, ...]
    kept: tuple[Candidate, ...]

    def summary(self) -> str:
        if not self.attempts:
            return "step gate: no records to test"
        last = next((a for a in self.attempts if a.passed), self.attempts[-1])
        rows = ", ".join(f"{b} {last.untuned[b] * 1e3:.1f} ms untuned vs {last.tuned[b] * 1e3:.1f} ms tuned"
                         for b in sorted(last.untuned))
        return f"step gate: {rows} -> kept {len(self.kept)} of {len(self.candidates)} records"

    def to_dict(self) -> dict:
        return {
            "candidates": [{"kernel": c.name, "claimed_gain_us": None if math.isinf(c.gain_us) else c.gain_us}
                           for c in self.candidates],
            "attempts": [{"kernels": list(a.kernels), "untuned_ms": _ms(a.untuned), "tuned_ms": _ms(a.tuned),
                          "passed": a.passed} for a in self.attempts],
            "kept": [c.name for c in self.kept],
        }


def _ms(medians: Medians) -> dict[str, float]:
    return {b: round(s * 1e3, 4) for b, s in sorted(medians.items())}


def passes(untuned: Medians, tuned: Medians, options: GateOptions) -> bool:
    """Some bucket's tuned step is at least ``min_gain`` faster and none is more than
    ``slack`` slower. Not a mean over buckets: a record speeds up the bucket whose kernel
    it schedules, and the others (decode records leave ``prefill_t128`` as it was) would
    dilute its gain."""
    if set(untuned) != set(tuned) or not untuned:
        raise ValueError(f"the two artifacts timed different buckets: {sorted(untuned)} vs {sorted(tuned)}")
    ratios = [tuned[b] / untuned[b] for b in untuned]
    return min(ratios) <= 1.0 - options.min_gain and max(ratios) <= 1.0 + options.slack


def subsets(candidates: tuple[Candidate, ...]) -> list[tuple[Candidate, ...]]:
    """What the gate tries, in order: every record, then the top half and the top one by
    claimed gain (each attempt costs a build and a timing run, so only these few)."""
    ranked = tuple(sorted(candidates, key=lambda c: (-c.gain_us, c.name)))
    sizes = sorted({len(ranked), math.ceil(len(ranked) / 2), 1} - {0}, reverse=True)
    return [ranked[:n] for n in sizes] if ranked else []


def run_gate(candidates: tuple[Candidate, ...], timer: Timer, options: GateOptions,
             log: Log = lambda _: None) -> GateResult:
    """Try ``subsets`` of the candidates through ``timer``; keep the first that passes
    (the largest: every record in it was measured helping together), else none."""
    attempts = []
    for subset in subsets(candidates):
        untuned, tuned = timer(frozenset(c.key for c in subset))
        attempt = Attempt(tuple(c.name for c in subset), untuned, tuned, passes(untuned, tuned, options))
        attempts.append(attempt)
        log(f"  step gate, {attempt.describe()}")
        if attempt.passed:
            return GateResult(tuple(candidates), tuple(attempts), subset)
    return GateResult(tuple(candidates), tuple(attempts), ())


def time_steps(artifacts: list[Path], options: GateOptions) -> list[Medians]:
    """Median seconds per static-bucket step of each artifact, timed together in one
    runtime-only process (``step_timer.py``)."""
    request = {"artifacts": [str(a) for a in artifacts], "steps": options.steps, "warmup": options.warmup,
               "context": options.context}
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    proc = subprocess.run([sys.executable, str(STEP_TIMER), json.dumps(request)], capture_output=True, text=True,
                          env=env, timeout=options.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"step timer failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["medians"]


class ArtifactTimer:
    """The gate's real timer, a context manager owning a temporary folder: builds the
    untuned artifact once and, per call, a tuned one with the given records of
    ``folder``'s database, and times the two together. The latest tuned artifact stays
    (``self.tuned``) until the next call or the exit: each holds the model's weights."""

    def __init__(self, source, graphs, compile_options, folder: Path, options: GateOptions,
                 log: Log = lambda _: None):
        from .database import kernel_records

        self.source, self.graphs, self.compile_options = source, graphs, compile_options
        self.records, self.options, self.log = kernel_records(folder), options, log
        self.untuned: Path | None = None
        self.tuned: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._builds = 0

    def __enter__(self) -> "ArtifactTimer":
        self._tmp = tempfile.TemporaryDirectory(prefix="kiln-gate-")
        return self

    def __exit__(self, *exc) -> None:
        self._tmp.cleanup()

    def _build(self, name: str, schedules_dir: Path | None) -> Path:
        from ..compile import compile_graphs

        options = dataclasses.replace(self.compile_options, tuned=schedules_dir is not None,
                                      schedules_dir=schedules_dir)
        return compile_graphs(self.source, self.graphs, Path(self._tmp.name) / name, options, self.log)

    def __call__(self, keys: frozenset[int]) -> tuple[Medians, Medians]:
        from .database import write_records

        if self.untuned is None:
            self.untuned = self._build("untuned", None)
        if self.tuned is not None:
            shutil.rmtree(self.tuned, ignore_errors=True)
        self._builds += 1
        database = Path(self._tmp.name) / f"records-{self._builds}"
        write_records(database, [self.records[k] for k in sorted(keys)])
        self.tuned = self._build(f"tuned-{self._builds}", database)
        untuned, tuned = time_steps([self.untuned, self.tuned], self.options)
        return untuned, tuned


def gate_database(folder: Path, tasks, timer: Timer, options: GateOptions, log: Log = lambda _: None) -> GateResult:
    """Gate the records of ``folder``'s database that belong to ``tasks`` (one scheme's
    ``TaskResult``s) through ``timer`` (an ``ArtifactTimer`` of that scheme's graphs), and
    drop from the database those the gate does not keep. Records of other kernels stay."""
    from .database import kernel_records, mean_seconds, write_records

    records = kernel_records(folder)
    candidates, seen = [], set()
    for task in tasks:
        if task.key in records and task.key not in seen:
            seen.add(task.key)
            best_us = mean_seconds(records[task.key].run_secs) * 1e6
            gain = math.inf if task.default_us is None else (task.default_us - best_us) * task.calls
            candidates.append(Candidate(task.key, task.name, gain))
    result = run_gate(tuple(candidates), timer, options, log)
    kept = {c.key for c in result.kept}
    write_records(folder, [r for k, r in records.items() if k not in seen or k in kept])
    return result


def write_evidence(folder: Path, gates: dict[str, GateResult] | None, options: GateOptions, records: int) -> Path:
    """``gate.json`` next to the database: per weight scheme the step times measured and
    what was kept (None: the gate was skipped, and the records are unchecked)."""
    evidence = {"records": records, "gated": gates is not None}
    if gates is not None:
        evidence["options"] = dataclasses.asdict(options)
        evidence["schemes"] = {scheme: g.to_dict() for scheme, g in gates.items()}
    path = Path(folder) / GATE_FILE
    path.write_text(json.dumps(evidence, indent=2) + "\n")
    return path
