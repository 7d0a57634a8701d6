"""The processes that build and time MetaSchedule's candidate kernels for ``kiln tune``.

Run by path (``python measure_worker.py build|run``), not as part of the kiln package, so
it imports only TVM: ``build`` the compiler without MetaSchedule (~3 s; a worker importing
MetaSchedule spends 20-50 s parsing tensor intrinsics on a 2-core machine), ``run`` the
TVM runtime only (0.8 s). Each lives as long as the tuning session, so a candidate costs
its own build or timing only, and a candidate that hangs LLVM or crashes a kernel takes
down only its worker (the parent kills it after a timeout, starts another and reports
that candidate as failed).

Protocol: one JSON request per stdin line, one JSON reply per stdout line.
  build request: {"mod": "<tvm.ir.save_json of the IRModule>", "target": "<save_json of the Target>", "path": "<out .so>"}
  build reply:   {"path": "<out .so>"} or {"error": "<what failed>"}
  run request:   {"path": "<candidate .so>", "args": [["TENSOR", dtype, shape], ...],
                  "repeat": r, "min_repeat_ms": ms, "cold_bytes": b, "max_copies": n}
  run reply:     {"costs": [seconds per repeat, ...]} or {"error": "<what failed>"}
The first line it writes, {"ready": mode}, says its imports are done.
"""

import json
import os
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "run"
if MODE == "run":
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
else:
    os.environ.pop("TVM_USE_RUNTIME_LIB", None)
sys.modules["torch"] = None  # tvm_ffi imports torch when installed (~15 s); nothing here needs it

import numpy as np  # noqa: E402
import tvm  # noqa: E402


def _arrays(args_info, rng) -> list[np.ndarray]:
    """Random arrays for the kernel's parameters (integers small: they may be indices or
    packed weights, any bit pattern is valid for those)."""
    out = []
    for kind, dtype, shape in args_info:
        if kind != "TENSOR":
            raise ValueError(f"argument kind {kind!r} is not a tensor")
        if dtype.startswith(("int", "uint")):
            out.append(rng.integers(0, 8, size=shape).astype(dtype))
        else:
            out.append(rng.standard_normal(size=shape).astype(dtype))
    return out


def _measure(request, device, rng):
    """Seconds per call, one figure per repeat, timed as the kernel runs inside a decode
    step: its weights (every argument but the first, the activations) come from DRAM and
    TVM's thread pool is awake. Cycling through copies of the weights that together
    exceed the last-level cache does both; flushing the caches before each call instead
    (MetaSchedule's default) lets the pool's threads fall asleep, and waking them cost a
    parallel kernel ~190 us here, so every small kernel measured fastest serial."""
    module = tvm.runtime.load_module(request["path"])
    function = module[module.entry_name]
    first, *rest = _arrays(request["args"], rng)
    weight_bytes = sum(a.nbytes for a in rest)
    copies = max(1, min(request["max_copies"], -(-request["cold_bytes"] // max(weight_bytes, 1))))
    activations = tvm.runtime.tensor(first, device)
    calls = [[activations, *(tvm.runtime.tensor(a, device) for a in rest)] for _ in range(copies)]
    for args in calls:  # warm-up: page in every copy, start the thread pool
        function(*args)
    costs = []
    for _ in range(request["repeat"]):
        count, start = 0, time.perf_counter()
        while True:
            for args in calls:
                function(*args)
            count += copies
            elapsed = time.perf_counter() - start
            if elapsed * 1e3 >= request["min_repeat_ms"]:
                break
        costs.append(elapsed / count)
    return costs


def _build(request):
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(tvm.ir.load_json(request["mod"]))
    tvm.compile(mod, target=tvm.ir.load_json(request["target"])).export_library(request["path"])
    return request["path"]


def main() -> None:
    device, rng = tvm.cpu(), np.random.default_rng(0)
    sys.stdout.write(json.dumps({"ready": MODE}) + "\n")  # imports done: timeouts start now
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"path": _build(request)} if MODE == "build" else {"costs": _measure(request, device, rng)}
        except Exception as err:  # the candidate's failure, not the worker's
            reply = {"error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
