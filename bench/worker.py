"""One measurement in a fresh process, so its resident memory is the system's own:

    python -m kiln.bench.worker kiln|onnxruntime|torch --artifact A [--onnx DIR]
        --batch B --prompt-len L --steps N --repeats R

Prints one JSON object: median seconds of a B x L prefill and of N batched decode steps
(after one warm-up each), the process's resident memory after importing its framework
(``rss_base_mb``) and its peak (``rss_peak_mb``). Inputs are random token ids from a
fixed seed, the same for every system.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, lazy initialization, first-touch of mapped weights
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_mb() -> tuple[float, float]:
    """(resident, peak resident) of this process in MiB, from /proc."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


def inputs(vocab: int, batch: int, prompt_len: int, steps: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, prompt_len), dtype=np.int64)
    tokens = rng.integers(0, vocab, (steps, batch)).tolist()
    return ids, tokens


def _system(args):
    """Import the system's framework, record the baseline memory, then load the model."""
    if args.system == "kiln":
        import sys

        # A serving box has neither: tvm_ffi would import torch if it could, and its
        # memory would count as Kiln's.
        sys.modules["torch"] = sys.modules["onnx"] = None
        import kiln.runtime.engine  # noqa: F401  (TVM runtime only: the parent sets TVM_USE_RUNTIME_LIB)
        from kiln.runtime.artifact import load_manifest

        from .systems import KilnSystem

        base = memory_mb()[0]
        return base, KilnSystem(args.artifact, args.batch, args.prompt_len, args.steps), load_manifest(args.artifact)
    if args.system == "onnxruntime":
        import onnxruntime  # noqa: F401

        from kiln.runtime.artifact import load_manifest

        from .systems import OrtSystem

        base = memory_mb()[0]
        return base, OrtSystem(args.onnx), load_manifest(args.artifact)
    if args.system == "torch":
        import os

        import torch

        from kiln.compiler.models.source import resolve_model
        from kiln.runtime.artifact import load_manifest

        from .systems import TorchSystem

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        manifest = load_manifest(args.artifact)
        base = memory_mb()[0]
        module = resolve_model(manifest.source, manifest.model.context_length).build_module()
        return base, TorchSystem(module), manifest
    raise SystemExit(f"unknown system {args.system!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    base, system, manifest = _system(args)
    ids, tokens = inputs(manifest.model.vocab_size, args.batch, args.prompt_len, args.steps)
    prefill_s = _median_time(lambda: system.prefill(ids), args.repeats)
    state = system.prefill(ids)
    decode_s = _median_time(lambda: system.decode_steps(state, tokens), args.repeats)
    _, peak = memory_mb()
    print(json.dumps({"prefill_s": prefill_s, "decode_s": decode_s, "rss_base_mb": base, "rss_peak_mb": peak}))


if __name__ == "__main__":
    main()
