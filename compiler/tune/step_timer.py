"""Times the static-bucket steps of several artifacts, alternating between them: the
measurement behind ``kiln tune``'s step gate (``gate.py``).

Run by path (``python step_timer.py REQUEST_JSON``), not as part of the kiln package, so
the process loads the TVM runtime library and ``kiln.runtime`` only: the compiler, torch
and onnx are blocked (importing them raises), and the kernels run as a served model's do.

Request: {"artifacts": [folder, ...], "steps": n, "warmup": w, "context": c[, "seed": s]}
Reply (one JSON line on stdout): {"medians": [{bucket: seconds per step}, ...]}, one
dict per artifact, over the artifacts' static buckets (the manifest's
``dispatch.function_names()``, which must be the same for all).

A bucket's step is driven by the driver of its kind (``KINDS``, matched by name): it sets
its sequences up in its own KV cache and times one step per call (the forward only, not
making its tokens or resetting the cache).
"""

import json
import os
import re
import sys
import time

os.environ["TVM_USE_RUNTIME_LIB"] = "1"
for _name in ("torch", "onnx", "onnx_ir", "onnxruntime", "kiln.compiler"):
    sys.modules[_name] = None  # tvm_ffi imports torch when installed (~15 s); nothing here needs these

import numpy as np  # noqa: E402

from kiln.runtime.artifact import load_manifest  # noqa: E402
from kiln.runtime.device import open_device  # noqa: E402
from kiln.runtime.executor import CacheConfig, Chunk, PagedExecutor  # noqa: E402


class DecodeStep:
    """``decode_b<N>``: one decode step of N sequences, each holding ~``context`` tokens
    (the cache grows by one token per step, as in serving)."""

    PATTERN = re.compile(r"decode_b(\d+)")

    def __init__(self, ex: PagedExecutor, name: str, match: re.Match, context: int, steps: int, rng):
        self.ex, self.name, self.rng = ex, name, rng
        self.batch = int(match.group(1))
        # The positions must stay inside the model's context (its RoPE tables end there).
        self.position = max(1, min(context, ex.manifest.model.context_length - steps - 1))
        self.cache = ex.create_cache(CacheConfig(
            max_batch_size=self.batch, max_total_tokens=self.batch * (self.position + steps + ex.page_size),
            prefill_chunk_size=self.position, page_size=ex.page_size))
        self.vocab = ex.manifest.model.vocab_size
        for s in range(self.batch):
            self.cache.add(s)
            ex.forward(self.cache, [Chunk(s, tuple(rng.integers(0, self.vocab, self.position).tolist()), 0)])

    def step(self) -> float:
        """Seconds of one step."""
        chunks = [Chunk(s, (int(self.rng.integers(0, self.vocab)),), self.position) for s in range(self.batch)]
        start = time.perf_counter()
        self.ex.forward(self.cache, chunks, via=self.name)
        elapsed = time.perf_counter() - start
        self.position += 1
        return elapsed


class PrefillStep:
    """``prefill_t<T>``: the prefill of a fresh T-token prompt (one sequence; its tokens
    are popped after each step, so every step starts from an empty sequence)."""

    PATTERN = re.compile(r"prefill_t(\d+)")

    def __init__(self, ex: PagedExecutor, name: str, match: re.Match, context: int, steps: int, rng):
        self.ex, self.name, self.rng = ex, name, rng
        self.tokens = int(match.group(1))
        self.cache = ex.create_cache(CacheConfig(max_batch_size=1, max_total_tokens=self.tokens + ex.page_size,
                                                 prefill_chunk_size=self.tokens, page_size=ex.page_size))
        self.cache.add(0)
        self.vocab = ex.manifest.model.vocab_size

    def step(self) -> float:
        chunk = Chunk(0, tuple(self.rng.integers(0, self.vocab, self.tokens).tolist()), 0)
        start = time.perf_counter()
        self.ex.forward(self.cache, [chunk], via=self.name)
        elapsed = time.perf_counter() - start
        self.cache.popn(0, self.tokens)
        return elapsed


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
