"""Prefill and batch-1 decode speed: the Kiln artifact vs torch eager vs onnxruntime, on
the same model, the same inputs and this machine, in one run.

onnxruntime runs the same ONNX graphs with the artifact's weight quantization (its
``DequantizeLinear`` -> ``MatMul`` pairs, which ORT fuses into its own int8 / MatMulNBits
kernels); torch eager always runs the float32 model (it has no such graph).

    python bench/decode.py ARTIFACT [--prompt-len 512] [--decode-steps 32] [--repeats 5]

Prefill: tokens/s for one prompt of --prompt-len random tokens (batch 1).
Decode:  tokens/s of --decode-steps single-token steps after that prompt (batch 1,
         explicit KV carried between steps by each system in its own way).
Every figure is the median of --repeats runs; ratios are against onnxruntime. The
machine is shared and noisy: compare ratios from one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, lazy initialization)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class KilnSystem:
    """The artifact's functions on its paged KV cache, one sequence (batch 1)."""

    name = "kiln (tvm)"

    def __init__(self, artifact: Path, prompt_len: int, steps: int):
        from kiln.runtime.engine import Engine
        from kiln.runtime.executor import CacheConfig

        self.ex = Engine.load(artifact)._executor
        self.cache = self.ex.create_cache(CacheConfig(
            max_batch_size=1, max_total_tokens=prompt_len + steps + 64, prefill_chunk_size=prompt_len,
            page_size=self.ex.page_size))
        self.seq = 0

    def prefill(self, ids):
        from kiln.runtime.executor import Chunk

        if self.seq:
            self.cache.remove(self.seq)  # the previous repeat's prompt
        self.seq += 1
        self.cache.add(self.seq)
        self.ex.forward(self.cache, [Chunk(self.seq, tuple(ids[0].tolist()), 0)])
        return self.seq, ids.shape[1]

    def decode_steps(self, state, tokens):
        from kiln.runtime.executor import Chunk

        seq, length = state
        # Each repeat decodes from the same prompt: a fork shares the prompt's pages.
        child = seq + 1_000_000
        self.cache.fork(seq, child, length)
        for i, tok in enumerate(tokens):
            self.ex.forward(self.cache, [Chunk(child, (tok,), length + i)])
        self.cache.remove(child)


class TorchSystem:
    name = "torch eager"

    def __init__(self, module):
        import torch

        self.torch, self.module = torch, module

    def prefill(self, ids):
        with self.torch.no_grad():
            t = self.torch.from_numpy(ids)
            return self.module(t, self.torch.arange(ids.shape[1])[None]), ids.shape[1]

    def decode_steps(self, state, tokens):
        (_, past), length = state
        torch = self.torch
        with torch.no_grad():
            for i, tok in enumerate(tokens):
                _, past = self.module(torch.tensor([[tok]]), torch.tensor([[length + i]]), past)


class OrtSystem:
    def __init__(self, graphs, workdir: Path, name: str = "onnxruntime"):
        import onnx_ir as ir
        import onnxruntime as ort

        self.name = name
        workdir.mkdir(parents=True, exist_ok=True)

        self.sessions = {}
        for graph_name, model in graphs.items():
            path = workdir / f"{graph_name}.onnx"
            ir.save(model, path, external_data=f"{graph_name}.onnx.data")
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self.sessions[graph_name] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.sessions["decode"].get_inputs()][2:]

    def prefill(self, ids):
        out = self.sessions["prefill"].run(None, {"input_ids": ids,
                                                  "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None]})
        return out, ids.shape[1]

    def decode_steps(self, state, tokens):
        out, length = state
        past = out[1:]
        for i, tok in enumerate(tokens):
            feeds = {"input_ids": np.asarray([[tok]], dtype=np.int64),
                     "position_ids": np.asarray([[length + i]], dtype=np.int64)}
            feeds.update(zip(self.past_names, past))
            past = self.sessions["decode"].run(None, feeds)[1:]


def _quantized_graphs(module, quant) -> dict:
    from kiln.compiler.export.onnx_export import export_graphs
    from kiln.compiler.passes.quantize_weights import quantize_weights

    rewrite = quantize_weights(quant)
    return {name: rewrite(graph) for name, graph in export_graphs(module).items()}


def _params_mb(artifact: Path) -> float:
    return sum(p.stat().st_size for p in artifact.iterdir() if p.name.startswith("params")) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--model", default=None, help="the artifact's source model [default: from its manifest]")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--systems", default="kiln,torch,onnxruntime")
    args = ap.parse_args()

    import kiln.compiler  # noqa: F401  (full TVM before the runtime loads)
    import torch

    from kiln.compiler.models.source import resolve_model
    from kiln.runtime.artifact import load_manifest
    from kiln.runtime.quantization import QuantConfig, quant_from_record

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    manifest = load_manifest(args.artifact)
    source = resolve_model(args.model or manifest.source, manifest.model.context_length)
    module = source.build_module()
    wanted = args.systems.split(",")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, manifest.model.vocab_size, (1, args.prompt_len), dtype=np.int64)
    tokens = rng.integers(0, manifest.model.vocab_size, args.decode_steps).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        systems = []
        if "kiln" in wanted:
            systems.append(KilnSystem(args.artifact, args.prompt_len, args.decode_steps))
        if "torch" in wanted:
            systems.append(TorchSystem(module))
        if "onnxruntime" in wanted:
            quant = quant_from_record(manifest.extra.get("quantization"))
            systems.append(OrtSystem(_quantized_graphs(module, quant), Path(tmp) / "same"))
            if not quant.is_float and (quant.embedding or quant.lm_head):
                # ORT has no fused kernel for Gather(DequantizeLinear(table)): it dequantizes
                # the whole [V, H] table every step. Its best configuration of the same scheme
                # keeps the embedding / LM head float: measure that too.
                proj_only = QuantConfig(quant.scheme, embedding=False, lm_head=False)
                systems.append(OrtSystem(_quantized_graphs(module, proj_only), Path(tmp) / "proj",
                                         name="ort proj-only"))
        rows = []
        for system in systems:
            prefill_s = _median_time(lambda: system.prefill(ids), args.repeats)
            state = system.prefill(ids)
            decode_s = _median_time(lambda: system.decode_steps(state, tokens), args.repeats)
            rows.append((system.name, args.prompt_len / prefill_s, args.decode_steps / decode_s))
            print(f"  measured {system.name}", flush=True)

    base = {name: (p, d) for name, p, d in rows}.get("onnxruntime")
    print(f"\nmodel {manifest.model.name} ({manifest.quantization}), target {manifest.target.key} "
          f"({manifest.target.mcpu}), {threads} threads, prompt {args.prompt_len}, "
          f"{args.decode_steps} decode steps, median of {args.repeats}; artifact params "
          f"{_params_mb(args.artifact):.1f} MB")
    print(f"{'system':<14} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill vs ort':>15} {'decode vs ort':>14}")
    for name, p, d in rows:
        ratio = (f"{p / base[0]:>14.2f}x {d / base[1]:>13.2f}x") if base else ""
        print(f"{name:<14} {p:>14.1f} {d:>13.1f} {ratio}")
    if base:
        print("(ratios against onnxruntime on the same quantized graph)")


if __name__ == "__main__":
    main()
