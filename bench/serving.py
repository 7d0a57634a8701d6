"""Continuous vs static batching on a mixed workload, through the same engine and kernels.

    python bench/serving.py ARTIFACT [--requests 64] [--limits 1,2,4,8,16] [--out bench/out]

Workload: --requests prompts of 8-40 tokens arriving together, with long-tailed output
lengths (most short, a few long: a Pareto draw clipped to [12, 256]), greedy decoding.

* continuous: the engine admits a waiting request whenever a sequence slot frees up
  (max_num_seqs = the batch limit), chunking prefills into the decode steps.
* static: request-level batching as in HF ``generate`` or FasterTransformer: requests
  are taken a batch at a time and every row of a batch decodes until the batch's longest
  request is done (a finished row keeps its slot and its compute); only each request's
  own tokens count as output. Same engine, kernels and prefill.
* static-shrink: a kinder static variant whose finished rows leave the batch early (the
  batch still waits for its longest request before the next one starts).

Reports throughput (generated tokens / s), time to first token and inter-token latency
(p50 / p99, measured from the common arrival) for each batch limit, and writes a PNG of
throughput vs p99 TTFT and vs p50 inter-token latency.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def workload(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab - 100, int(rng.integers(8, 41))).tolist() for _ in range(n)]
    outputs = np.clip((rng.pareto(1.0, n) + 1) * 12, 12, 256).astype(int).tolist()
    return prompts, outputs


def _percentiles(values):
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if values else (0.0, 0.0)


MODES = ("continuous", "static", "static-shrink")


def run(engine, prompts, outputs, mode: str, limit: int) -> dict:
    """Timestamps are taken on the engine thread as each token is produced; a request's
    tokens beyond its own output length (static padding) are not counted."""
    arrival = time.perf_counter()
    stamps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}

    def record(i):
        def on_token(delta):
            if len(stamps[i]) < outputs[i]:
                stamps[i].append(time.perf_counter())
        return on_token

    order = list(range(len(prompts)))
    batches = [order] if mode == "continuous" else [order[i:i + limit] for i in range(0, len(order), limit)]
    for batch in batches:
        longest = max(outputs[i] for i in batch)
        streams = [engine.submit(prompts[i], max_tokens=longest if mode == "static" else outputs[i],
                                 ignore_eos=True, on_token=record(i)) for i in batch]
        for stream in streams:
            stream.result()
    elapsed = time.perf_counter() - arrival
    first = [t[0] - arrival for t in stamps.values() if t]
    gaps = [b - a for t in stamps.values() for a, b in zip(t, t[1:])]
    tokens = sum(len(t) for t in stamps.values())
    return {"mode": mode, "limit": limit, "throughput": tokens / elapsed,
            "seconds": elapsed, "tokens": tokens, "ttft_p50": _percentiles(first)[0],
            "ttft_p99": _percentiles(first)[1], "itl_p50": _percentiles(gaps)[0], "itl_p99": _percentiles(gaps)[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--limits", default="1,2,4,8,16")
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args()

    from kiln.runtime.engine import Engine, EngineConfig

    limits = [int(x) for x in args.limits.split(",")]
    rows = []
    for limit in limits:
        for mode in MODES:
            engine = Engine.load(args.artifact, EngineConfig(
                max_num_seqs=limit, max_batched_tokens=max(args.max_batched_tokens, limit),
                max_total_tokens=max(8192, limit * 320), prefix_reuse=False, max_waiting=args.requests + 1))
            prompts, outputs = workload(args.requests, engine.config.vocab_size)
            engine.generate(prompts[0][:8], max_tokens=2)  # warm-up
            row = run(engine, prompts, outputs, mode, limit)
            engine.close()
            rows.append(row)
            print(f"{row['mode']:>13} limit {limit:>3}: {row['throughput']:7.1f} tok/s  "
                  f"TTFT p50 {row['ttft_p50']:6.2f}s p99 {row['ttft_p99']:6.2f}s  "
                  f"ITL p50 {row['itl_p50'] * 1000:6.1f}ms p99 {row['itl_p99'] * 1000:6.1f}ms", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'limit':>5} {'continuous tok/s':>17} {'static tok/s':>13} {'ratio':>6} "
          f"{'cont p99 TTFT':>14} {'static p99 TTFT':>16} {'shrink tok/s':>13} {'ratio':>6}")
    for limit in limits:
        c, s, k = (next(r for r in rows if r["limit"] == limit and r["mode"] == m) for m in MODES)
        print(f"{limit:>5} {c['throughput']:>17.1f} {s['throughput']:>13.1f} {c['throughput'] / s['throughput']:>6.2f} "
              f"{c['ttft_p99']:>13.2f}s {s['ttft_p99']:>15.2f}s {k['throughput']:>13.1f} "
              f"{c['throughput'] / k['throughput']:>6.2f}")
    _plot(rows, args.out / "serving.png")
    print(f"\nwrote {args.out / 'serving.json'} and {args.out / 'serving.png'}")


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("continuous", "o-"), ("static", "s--"), ("static-shrink", "^:")):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["limit"])
        for ax, key, label in ((axes[0], "ttft_p99", "p99 time to first token (s)"),
                               (axes[1], "itl_p50", "p50 inter-token latency (s)")):
            ax.plot([r[key] for r in sel], [r["throughput"] for r in sel], style, label=mode)
            for r in sel:
                ax.annotate(str(r["limit"]), (r[key], r["throughput"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
            ax.set_xlabel(label)
            ax.set_ylabel("throughput (generated tokens / s)")
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Kiln: continuous vs static batching (labels: batch limit)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
