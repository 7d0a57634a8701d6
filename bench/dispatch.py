"""Decode step time through ``decode``, through ``prefill`` and through a static bucket
``decode_b<N>`` where the artifact has one for the batch size, and prefill time through
the dynamic ``prefill`` alone and through the manifest's plan (static ``prefill_t<T>``
pieces, then the rest): the measurements behind the compiler's ``dispatch``
(``compiler/dispatch.py``).

    python -m kiln.bench.dispatch ARTIFACT [--batch 1,2,4,8,16] [--context 128] [--steps 12]
                                           [--prefill 100,128,200,512]

Each batch size gets fresh sequences holding --context tokens; the routes then take turns,
one step each, so drifting machine load hits all alike. Prints median ms per step, tokens/s
and which route the artifact's manifest picks. Each --prefill length is one fresh prompt
per call, the two routes alternating.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def measure(ex, batch: int, context: int, steps: int, rng) -> dict[str, float]:
    """Median seconds per decode step of ``batch`` sequences, by route."""
    from .steps import DecodeSequences

    routes = [r for r in ("decode", ex.manifest.dispatch.static_function(batch), "prefill") if r]
    seqs = DecodeSequences(ex, batch, context, (steps + 1) * len(routes), rng)
    times: dict[str, list[float]] = {route: [] for route in routes}
    for _ in range(steps + 1):  # the first step of each route warms up and is dropped
        for via in routes:
            times[via].append(seqs.step(via))
    return {via: float(np.median(t[1:])) for via, t in times.items()}


def measure_prefill(ex, tokens: int, repeats: int, rng) -> dict[str, float]:
    """Median seconds of a prefill of one ``tokens``-token prompt, by route: "prefill"
    (the dynamic function alone) and "plan" (what ``forward`` runs unforced)."""
    from .steps import PrefillPrompt

    prompt = PrefillPrompt(ex, tokens, rng)
    times: dict[str, list[float]] = {"prefill": [], "plan": []}
    for _ in range(repeats + 1):  # the first call of each route warms up and is dropped
        for route in times:
            times[route].append(prompt.step("prefill" if route == "prefill" else None))
    return {route: float(np.median(t[1:])) for route, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", default="1,2,4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=128, help="tokens each sequence holds")
    ap.add_argument("--steps", type=int, default=12, help="measured steps per route")
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths to time prefill routes for")
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    from kiln.runtime.engine import Engine
    from kiln.runtime.executor import Chunk

    engine = Engine.load(args.artifact, background=False, verify_hashes=False)
    ex = engine._executor
    rng = np.random.default_rng(0)
    print(f"{args.artifact}: quantization {ex.manifest.quantization}, dispatch {ex.manifest.dispatch.to_dict()}")
    for batch in (int(b) for b in args.batch.split(",") if b):
        t = measure(ex, batch, args.context, args.steps, rng)
        picks = ex.route([Chunk(s, (0,), 0) for s in range(batch)])
        row = "  ".join(f"{route} {sec * 1e3:6.1f} ms {batch / sec:5.0f} tok/s" for route, sec in t.items())
        print(f"B={batch:<3} {row}  | manifest picks {picks}", flush=True)
    for tokens in (int(t) for t in args.prefill.split(",") if t):
        t = measure_prefill(ex, tokens, max(3, args.steps // 4), rng)
        plan = " + ".join(f"{fn}:{n}" for fn, n in ex.manifest.dispatch.prefill_plan(tokens))
        row = "  ".join(f"{route} {sec * 1e3:7.1f} ms {tokens / sec:5.0f} tok/s" for route, sec in t.items())
        print(f"prefill {tokens:<5} {row}  | plan {plan}", flush=True)


if __name__ == "__main__":
    main()
