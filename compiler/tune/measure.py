"""MetaSchedule builder and runner for ``kiln tune``.

TVM's LocalBuilder starts fresh worker processes for every batch of candidates and its
LocalRunner's worker imports all of MetaSchedule; each such import parses TVM's tensor
intrinsics (TVMScript), 20-50 s on a 2-core machine, more than the default timeouts, so
every candidate failed. Here two long-lived ``measure_worker.py`` processes, which import
only TVM, build and time the candidates (~0.1 s and a few ms each). Both stay out of the
tuning process: timing in it crashed the tuner in TVM's thread pool after a few hundred
candidates, and some candidates keep LLVM busy for minutes (the timeout kills them).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from pathlib import Path

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

WORKER = Path(__file__).with_name("measure_worker.py")


@derived_object
class WorkerBuilder(ms.builder.PyBuilder):
    """Builds each candidate into ``<work_dir>/<n>.so`` in a ``MeasureWorker("build")``."""

    def __init__(self, work_dir: str | Path, timeout_s: float = 30.0):
        super().__init__()
        self.work_dir = Path(work_dir)
        self.worker = MeasureWorker("build", timeout_s)
        self._ids = itertools.count()

    def build(self, build_inputs):
        results = []
        for build_input in build_inputs:
            reply = self.worker.request({"mod": tvm.ir.save_json(build_input.mod),
                                         "target": tvm.ir.save_json(build_input.target),
                                         "path": str(self.work_dir / f"{next(self._ids)}.so")})
            # A candidate LLVM or TVM rejects (or that hangs LLVM): MetaSchedule skips it.
            results.append(ms.builder.BuilderResult(reply.get("path"), reply.get("error")))
        return results

    def close(self) -> None:
        self.worker.close()


@derived_object
class _Done(ms.runner.PyRunnerFuture):
    def __init__(self, result: ms.runner.RunnerResult):
        super().__init__()
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> ms.runner.RunnerResult:
        return self._result


class MeasureWorker:
    """One ``measure_worker.py`` process ("build" or "run"); restarted when a candidate
    kills it or hangs."""

    def __init__(self, mode: str, timeout_s: float = 30.0):
        self.mode, self.timeout_s = mode, timeout_s
        self._process: subprocess.Popen | None = None

    STARTUP_S = 300.0  # importing TVM on a loaded 2-core machine

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, str(WORKER), self.mode], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._read(process, self.STARTUP_S) is None:
            process.kill()
            process.wait()
            raise RuntimeError(f"the {self.mode} worker ({WORKER}) did not start (exit code {process.returncode})")
        return process

    @staticmethod
    def _read(process: subprocess.Popen, timeout_s: float) -> dict | None:
        """The process's next reply, or None when it writes none in time (hung or dead)."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return json.loads(line[0]) if line and line[0] else None

    def request(self, request: dict) -> dict:
        if self._process is None or self._process.poll() is not None:
            self._process = self._start()
        process = self._process
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            reply = self._read(process, self.timeout_s)
        except BrokenPipeError:  # it died after its last reply
            reply = None
        if reply is not None:
            return reply
        self.close()  # the next request starts another
        code = process.returncode
        what = f"no reply in {self.timeout_s:.0f} s" if code == -9 else f"exit code {code}"
        return {"error": f"{self.mode} worker failed on this candidate ({what})"}

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None


@derived_object
class WorkerRunner(ms.runner.PyRunner):
    """Times candidates in a ``MeasureWorker``, as they run inside a decode step: weights
    cold (cycled through copies larger than ``cold_bytes``, at most ``max_copies``), TVM's
    thread pool warm; ``repeat`` figures of at least ``min_repeat_ms`` each."""

    def __init__(self, repeat: int = 5, min_repeat_ms: int = 20, cold_bytes: int = 128 << 20,
                 max_copies: int = 256, timeout_s: float = 30.0):
        super().__init__()
        self.settings = {"repeat": repeat, "min_repeat_ms": min_repeat_ms, "cold_bytes": cold_bytes,
                         "max_copies": max_copies}
        self.worker = MeasureWorker("run", timeout_s)

    def run(self, runner_inputs):
        futures = []
        for runner_input in runner_inputs:
            reply = self.worker.request({"path": runner_input.artifact_path,
                                         "args": [info.as_json() for info in runner_input.args_info],
                                         **self.settings})
            result = ms.runner.RunnerResult(reply.get("costs"), reply.get("error"))
            futures.append(_Done(result))
        return futures

    def close(self) -> None:
        self.worker.close()
