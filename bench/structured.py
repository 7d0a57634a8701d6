"""What a JSON-schema constraint costs a decode step: the same batch decoded with and
without a grammar, side by side, and how long compiling the schemas of the test corpus takes.

    python bench/structured.py ARTIFACT [--batches 1,4,16] [--rounds 3] [--tokens 128]
                               [--temperatures 0,0.7] [--out bench/out]

Workload: ``batch`` copies of one chat prompt asking for a list of customers, submitted
together, each generating exactly --tokens tokens:

* unconstrained: ``ignore_eos=True`` and ``max_tokens=--tokens``;
* constrained: the schema below, whose minItems forces an output longer than --tokens
  (~10 objects of ~25 tokens), with the same max_tokens, so it ends with "length" after
  the same number of tokens (ignore_eos cannot be combined with a guide).

Per-step time: the median gap between consecutive tokens of a stream, taken on the engine
thread (``on_token``), counting only the window in which every row of the batch decodes
(after the last row's first token, before the first row's last): prefill and a shrinking
batch stay out. It covers the forward, the grammar masks, sampling and emitting. Decode
tok/s = batch / step time. Each round runs every (batch, temperature) once per mode,
alternating which mode goes first; the table shows medians over rounds.
Overhead = (constrained step - unconstrained step) / unconstrained step. Greedy and
sampled rows take different paths through the sampler (greedy: an argmax on the masked
float32 row; sampled: the mask applied to a float64 copy), so both are measured.

Compile: on a fresh engine, each corpus schema (tests/data/json_schema_corpus.json)
through ``engine.grammars.compile`` twice: first compile, then from the cache; then the
per-request part that no cache covers, building one matcher (``engine.grammars.matchers``).
The grammar tokenizer (built once per engine) is built before and timed apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schema_corpus.json"
PROMPT = [{"role": "user", "content": "List ten fictional customers of a bike shop as JSON: for each, their name, "
                                      "age, city, email and whether their account is active."}]
_TEXT = {"type": "string", "maxLength": 24}
SCHEMA = {"type": "array", "minItems": 10, "maxItems": 10, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "email", "active"],
    "properties": {"name": _TEXT, "age": {"type": "integer", "minimum": 18, "maximum": 90}, "city": _TEXT,
                   "email": {"type": "string", "format": "email", "maxLength": 32}, "active": {"type": "boolean"}}}}
MODES = ("unconstrained", "constrained")
TARGETS = {1: 0.05, 16: 0.10}  # the ceilings on the per-step overhead, by batch


def run_batch(engine, guide, batch: int, tokens: int, temperature: float, seed: int) -> dict:
    """One batch of ``batch`` requests decoded together; its per-step time and tok/s."""
    stamps: list[list[float]] = [[] for _ in range(batch)]

    def record(i):
        def on_token(delta):
            if delta.token_id is not None:  # the final delta may carry no token
                stamps[i].append(time.perf_counter())
        return on_token

    extra = {"guide": guide} if guide is not None else {"ignore_eos": True}
    start = time.perf_counter()
    streams = [engine.submit(PROMPT, max_tokens=tokens, temperature=temperature, seed=seed + i, on_token=record(i),
                             **extra) for i in range(batch)]
    lengths = [len(s.result().token_ids) for s in streams]
    elapsed = time.perf_counter() - start
    if min(lengths) < tokens:
        raise SystemExit(f"a row ended after {min(lengths)} of {tokens} tokens: the schema must force longer output")
    # Window in which every row decodes: after the last first token, before the first last.
    # stamps[i]: the times of row i's tokens, [tokens].
    opened, closed = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if a >= opened and b <= closed]
    if not gaps:
        raise SystemExit(f"no step had all {batch} rows decoding; raise --tokens")
    step = statistics.median(gaps)
    return {"step_s": step, "decode_tok_s": batch / step, "e2e_tok_s": sum(lengths) / elapsed,
            "window_steps": len(gaps) // batch}


def compile_corpus(engine) -> dict:
    """Seconds per corpus schema: first compile, then cached, then a request's matcher."""
    from kiln.runtime.guided import Guide

    start = time.perf_counter()
    _ = engine.grammars.tokenizer
    tokenizer_s = time.perf_counter() - start
    guides = [Guide.json_schema(entry["schema"]) for entry in json.loads(CORPUS.read_text())]
    passes = []
    for _ in ("first", "cached"):
        seconds = []
        for guide in guides:
            start = time.perf_counter()
            engine.grammars.compile(guide)
            seconds.append(time.perf_counter() - start)
        passes.append(seconds)
    stats = engine.grammars.stats()
    assert stats.compiled == len(guides) and stats.cache_hits == len(guides), stats
    # Not cached: every request builds its matcher (the lexer) from the cached grammar.
    seconds = []
    for guide in guides:
        start = time.perf_counter()
        engine.grammars.matchers(guide, 1)
        seconds.append(time.perf_counter() - start)
    passes.append(seconds)
    return {"schemas": len(guides), "tokenizer_s": tokenizer_s,
            **{f"{name}_{key}": fn(seconds) for name, seconds in zip(("first", "cached", "matcher"), passes)
               for key, fn in (("total_s", sum), ("median_s", statistics.median), ("max_s", max))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.7", help="0: greedy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens each row generates")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args()

    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.guided import Guide

    batches = [int(x) for x in args.batches.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]

    def load():
        # No prefix reuse: every round prefills its prompts alike (prefill is outside the
        # timed window, but it would change how the rows' first tokens are staggered).
        return Engine.load(args.artifact, EngineConfig(max_num_seqs=max(batches), prefix_reuse=False,
                                                       max_total_tokens=max(8192, max(batches) * (args.tokens + 256))))

    engine = load()
    compile_stats = compile_corpus(engine)
    engine.close()
    print(f"compile {compile_stats['schemas']} corpus schemas: first {compile_stats['first_total_s']:.3f}s "
          f"(median {compile_stats['first_median_s'] * 1e3:.2f} ms, max {compile_stats['first_max_s'] * 1e3:.2f} ms), "
          f"cached {compile_stats['cached_total_s'] * 1e3:.3f} ms total; grammar tokenizer "
          f"{compile_stats['tokenizer_s']:.3f}s once; a request's matcher median "
          f"{compile_stats['matcher_median_s'] * 1e3:.2f} ms, max {compile_stats['matcher_max_s'] * 1e3:.2f} ms",
          flush=True)

    engine = load()
    guide = Guide.json_schema(SCHEMA)
    engine.generate(PROMPT, max_tokens=4, guide=guide)  # warm-up: compiles the schema, starts llguidance's pool
    engine.generate(PROMPT, max_tokens=4)
    samples: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for batch in batches:
            for temperature in temperatures:
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    row = run_batch(engine, guide if mode == "constrained" else None, batch, args.tokens,
                                    temperature, seed=1000 * r)
                    samples.setdefault((batch, temperature, mode), []).append(row)
                    print(f"round {r + 1} batch {batch:>2} T={temperature:g} {mode:>13}: "
                          f"step {row['step_s'] * 1e3:7.2f} ms  {row['decode_tok_s']:6.1f} tok/s "
                          f"({row['window_steps']} steps timed)", flush=True)
    engine.close()

    rows = []
    for batch in batches:
        for temperature in temperatures:
            med = {mode: {key: statistics.median(s[key] for s in samples[(batch, temperature, mode)])
                          for key in ("step_s", "decode_tok_s", "e2e_tok_s")} for mode in MODES}
            free, guided = med["unconstrained"]["step_s"], med["constrained"]["step_s"]
            rows.append({"batch": batch, "temperature": temperature, **{
                f"{mode}_{key}": value for mode in MODES for key, value in med[mode].items()},
                "overhead": (guided - free) / free, "target": TARGETS.get(batch),
                "rounds": {mode: samples[(batch, temperature, mode)] for mode in MODES}})

    print(f"\n{'batch':>5} {'T':>4} {'free step':>10} {'JSON step':>10} {'overhead':>9} {'target':>7} "
          f"{'free tok/s':>11} {'JSON tok/s':>11}")
    for row in rows:
        target = f"<={row['target']:.0%}" if row["target"] is not None else "-"
        print(f"{row['batch']:>5} {row['temperature']:>4g} {row['unconstrained_step_s'] * 1e3:>8.2f}ms "
              f"{row['constrained_step_s'] * 1e3:>8.2f}ms {row['overhead']:>+9.1%} {target:>7} "
              f"{row['unconstrained_decode_tok_s']:>11.1f} {row['constrained_decode_tok_s']:>11.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "structured.json"
    path.write_text(json.dumps({"command": sys.argv, "tokens": args.tokens, "rounds": args.rounds, "schema": SCHEMA,
                                "compile": compile_stats, "rows": rows}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
