"""Times the static-bucket steps of several artifacts, alternating between them: the
measurement behind ``kiln tune``'s step gate (``gate.py``).

Run by path (``python step_timer.py REQUEST_JSON``), not as part of the kiln package, so
the process loads the TVM runtime library and ``kiln.runtime`` only: the compiler, torch
and onnx are blocked (importing them raises), and the kernels run as a served model's do.

Request: {"artifacts": [folder, ...], "steps": n, "warmup": w, "context": c[, "seed": s]}
Reply (one JSON line on stdout): {"medians": [{bucket: seconds per step}, ...]}, one
dict per artifact, over the artifacts' static buckets (the manifest's
``dispatch.function_names()``, which must be the same for all).

A bucket's step is driven by the driver of its kind (``KINDS``, matched by name), over
``kiln.bench.steps``: it sets its sequences up in its own KV cache and times one step
per call.
"""

import json
import os
import re
import sys

os.environ["TVM_USE_RUNTIME_LIB"] = "1"
for _name in ("torch", "onnx", "onnx_ir", "onnxruntime", "kiln.compiler"):
    sys.modules[_name] = None  # tvm_ffi imports torch when installed (~15 s); nothing here needs these

import numpy as np  # noqa: E402

from kiln.bench.steps import DecodeSequences, PrefillPrompt  # noqa: E402
from kiln.runtime.artifact import load_manifest  # noqa: E402
from kiln.runtime.device import open_device  # noqa: E402
from kiln.runtime.executor import PagedExecutor  # noqa: E402


class DecodeStep:
    """``decode_b<N>``: one decode step of N sequences, each holding ~``context`` tokens."""

    PATTERN = re.compile(r"decode_b(\d+)")

    def __init__(self, ex: PagedExecutor, name: str, match: re.Match, context: int, steps: int, rng):
        self.name, self.seqs = name, DecodeSequences(ex, int(match.group(1)), context, steps, rng)

    def step(self) -> float:
        """Seconds of one step."""
        return self.seqs.step(self.name)


class PrefillStep:
    """``prefill_t<T>``: the prefill of a fresh T-token prompt."""

    PATTERN = re.compile(r"prefill_t(\d+)")

    def __init__(self, ex: PagedExecutor, name: str, match: re.Match, context: int, steps: int, rng):
        self.name, self.prompt = name, PrefillPrompt(ex, int(match.group(1)), rng)

    def step(self) -> float:
        return self.prompt.step(self.name)


# Each kind of static bucket: a class with PATTERN (its function names), __init__ (these
# arguments: set its sequences up in its own cache) and step() (run one, return seconds).
KINDS = (DecodeStep, PrefillStep)


def driver(ex: PagedExecutor, name: str, context: int, steps: int, rng):
    for kind in KINDS:
        match = kind.PATTERN.fullmatch(name)
        if match:
            return kind(ex, name, match, context, steps, rng)
    raise ValueError(f"no step driver for the bucket {name!r} (known kinds: "
                     f"{', '.join(k.PATTERN.pattern for k in KINDS)})")


def measure(request: dict) -> dict:
    folders = request["artifacts"]
    steps, warmup = int(request["steps"]), int(request["warmup"])
    rng = np.random.default_rng(request.get("seed"))
    executors = []
    for folder in folders:
        manifest = load_manifest(folder)
        executors.append(PagedExecutor(folder, manifest, open_device(manifest.target)))
    names = [set(ex.manifest.dispatch.function_names()) for ex in executors]
    if any(n != names[0] for n in names):
        raise ValueError(f"the artifacts have different static buckets: {[sorted(n) for n in names]}")
    buckets = sorted(names[0])
    drivers = [{b: driver(ex, b, int(request["context"]), steps + warmup, rng) for b in buckets}
               for ex in executors]
    times = [{b: [] for b in buckets} for _ in executors]
    order = list(range(len(executors)))
    for _ in range(warmup + steps):
        # One step each in turn, so drifting machine load hits every artifact alike, and the
        # order reversed each round, so none always runs right after another's step.
        for b in buckets:
            for i in order:
                times[i][b].append(drivers[i][b].step())
        order.reverse()
    return {"medians": [{b: float(np.median(t[b][warmup:])) for b in buckets} for t in times]}


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
