"""Per-kernel wall time of one artifact call, via the VM's instrumentation hook.

    python bench/kernel_profile.py ARTIFACT [--prompt-len 64] [--repeat 3]

Prints, for prefill and one decode step, each kernel's total time (summed over its
calls), its share, and its call count: the list to work down when making Kiln faster.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from kiln.runtime.engine import Engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    engine = Engine.load(args.artifact, verify_hashes=False)
    ex = engine._executor
    vm = ex._vm
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.config.vocab_size, (1, args.prompt_len), dtype=np.int64)
    pos = np.arange(args.prompt_len, dtype=np.int64)[None]
    logits, kv = ex.prefill(ids, pos)
    step = np.asarray([[1]], dtype=np.int64)
    step_pos = np.asarray([[args.prompt_len]], dtype=np.int64)
    for name, call in (("prefill", lambda: ex.prefill(ids, pos)), ("decode", lambda: ex.decode(step, step_pos, kv))):
        totals = collections.defaultdict(float)
        counts = collections.Counter()
        start = {}

        def instrument(func, symbol, before, ret, *rest):
            if before:
                start[symbol] = time.perf_counter()
            else:
                totals[symbol] += time.perf_counter() - start.pop(symbol)
                counts[symbol] += 1
            return 0

        call()
        vm.set_instrument(instrument)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            call()
        wall = (time.perf_counter() - t0) / args.repeat
        vm.set_instrument(None)
        total = sum(totals.values()) / args.repeat
        print(f"\n== {name}: {wall * 1000:.1f} ms per call, kernels {total * 1000:.1f} ms")
        for sym, t in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
            t /= args.repeat
            print(f"{t * 1000:9.2f} ms {100 * t / total:5.1f}%  x{counts[sym] // args.repeat:<4} {sym}")


if __name__ == "__main__":
    main()
