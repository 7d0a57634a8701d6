"""Per-kernel wall time of one artifact call, via the VM's instrumentation hook.

    python bench/kernel_profile.py ARTIFACT [--prompt-len 64] [--batch 1] [--repeat 3]

Prints, for a prefill of --prompt-len tokens and a decode step of --batch sequences
(each holding a --prompt-len context), each kernel's total time (summed over its calls),
its share, and its call count: the list to work down when making Kiln faster.
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
    ap.add_argument("--batch", type=int, default=1, help="sequences in the decode step")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from kiln.runtime.executor import CacheConfig, Chunk

    engine = Engine.load(args.artifact, verify_hashes=False)
    ex = engine._executor
    vm = ex._vm
    cache = ex.create_cache(CacheConfig(max_batch_size=max(args.batch, 1), max_total_tokens=(args.prompt_len + 64)
                                        * (args.batch + 2), prefill_chunk_size=args.prompt_len,
                                        page_size=ex.page_size))
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    prompt = tuple(rng.integers(0, vocab, args.prompt_len).tolist())
    for i in range(args.batch):
        cache.add(i)
        ex.forward(cache, [Chunk(i, prompt, 0)])
    cache.add(1000)
    state = {"prefill": 0, "len": args.prompt_len}

    def prefill():
        cache.remove(1000)
        cache.add(1000)
        ex.forward(cache, [Chunk(1000, prompt, 0)])

    def decode():
        ex.forward(cache, [Chunk(i, (1,), state["len"]) for i in range(args.batch)])
        state["len"] += 1

    for name, call in (("prefill", prefill), ("decode", decode)):
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
