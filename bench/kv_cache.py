"""What each KV-cache precision holds and what a decode step costs with it, side by side.

    python bench/kv_cache.py ARTIFACT [ARTIFACT ...] [--contexts 512,4096] [--batches 1,8]
                             [--steps 16] [--rounds 3] [--out bench/out]

ARTIFACTs: the same model compiled with different ``--kv-dtype`` (e.g. float32, float16,
int8), each compiled for a context of at least the largest --contexts value.

Capacity (arithmetic from the manifest): bytes per cached token over all layers, tokens
and full-context sequences that fit in 1 GiB.

Decode: for each (context, batch), one sequence is prefilled with ``context`` random
tokens, forked batch - 1 times at that (page-aligned) position, and every sequence then
decodes --steps tokens together; the step time is the median over steps, the table the
median over rounds (each round runs every artifact once, in rotating order, so drift on
this shared machine hits all alike). A fork shares the prefix pages, but each step still
reads batch x context cached tokens, and at 4,096 tokens one sequence's cache (12-94 MB
here) is far past the last-level cache, so the reads come from memory as without forks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

GIB = 1 << 30


def _capacity(engine) -> dict:
    from kiln.runtime.kv_sizing import kv_bytes_per_token, kv_dtype

    m = engine.manifest
    per_token = kv_bytes_per_token(m.model, m.kv_cache)
    return {"dtype": kv_dtype(m.kv_cache), "bytes_per_token": per_token, "tokens_per_gib": GIB // per_token,
            "full_context_seqs_per_gib": GIB // per_token // m.model.context_length,
            "context_length": m.model.context_length}


def _decode_step_s(engine, context: int, batch: int, steps: int, rng) -> float:
    from kiln.runtime.executor import CacheConfig, Chunk

    ex = engine._executor  # noqa: SLF001
    page = ex.page_size
    cache = ex.create_cache(CacheConfig(max_batch_size=batch, max_total_tokens=context + batch * (steps + page) * 2,
                                        prefill_chunk_size=512, page_size=page))
    vocab = engine.manifest.model.vocab_size
    prompt = rng.integers(0, vocab, context).tolist()
    cache.add(0)
    for i in range(0, context, 512):
        ex.forward(cache, [Chunk(0, tuple(prompt[i:i + 512]), i)])
    for sid in range(1, batch):
        cache.fork(0, sid, context)
    times = []
    for s in range(steps):
        chunks = [Chunk(sid, (int(rng.integers(0, vocab)),), context + s) for sid in range(batch)]
        t0 = time.perf_counter()
        ex.forward(cache, chunks)
        times.append(time.perf_counter() - t0)
    for sid in range(batch):
        cache.remove(sid)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    args = p.parse_args(argv)

    from kiln.runtime.engine import Engine

    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    engines = [Engine.load(a, background=False) for a in args.artifacts]
    caps = [_capacity(e) for e in engines]
    for a, c in zip(args.artifacts, caps):
        if c["context_length"] < max(contexts) + args.steps:
            sys.exit(f"{a}: compiled for a context of {c['context_length']}, the bench needs "
                     f"{max(contexts) + args.steps}")
    rng = np.random.default_rng(0)
    samples: dict[tuple[int, int, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(range(len(engines)))
        order = order[r % len(order):] + order[:r % len(order)]
        for ctx in contexts:
            for b in batches:
                for i in order:
                    samples.setdefault((i, ctx, b), []).append(_decode_step_s(engines[i], ctx, b, args.steps, rng))
    rows = []
    for i, cap in enumerate(caps):
        row = dict(cap, artifact=str(args.artifacts[i]))
        for ctx in contexts:
            for b in batches:
                step = statistics.median(samples[(i, ctx, b)])
                row[f"decode_tok_s_ctx{ctx}_b{b}"] = b / step
        rows.append(row)
    base = rows[0]
    head = ["KV dtype", "B/token", "vs first", "tokens/GiB", "full-context seqs/GiB"] + [
        f"decode tok/s ctx {c} B{b}" for c in contexts for b in batches]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [row["dtype"], f"{row['bytes_per_token']:,}", f"{row['bytes_per_token'] / base['bytes_per_token']:.1%}",
                 f"{row['tokens_per_gib']:,}", f"{row['full_context_seqs_per_gib']}"]
        for c in contexts:
            for b in batches:
                v = row[f"decode_tok_s_ctx{c}_b{b}"]
                cells.append(f"{v:.1f} ({v / base[f'decode_tok_s_ctx{c}_b{b}']:.2f}x)")
        print("| " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_cache.json").write_text(json.dumps({"rounds": args.rounds, "steps": args.steps, "rows": rows},
                                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
