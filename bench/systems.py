"""Three ways to run one model on a batch of B equal prompts: the Kiln artifact, an ONNX
graph in onnxruntime, Kiln's torch model in eager mode. Each offers

    prefill(ids [B, L] int64) -> state         (all B prompts in one call)
    decode_steps(state, tokens [steps][B])      (one call per step, B sequences)

and repeats of ``decode_steps`` start from the same ``state``. Imports are lazy: the
Kiln worker must load only the TVM runtime, the onnxruntime worker neither TVM nor torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class KilnSystem:
    """The artifact's functions on its paged KV cache: one ragged prefill of B sequences,
    then batched decode steps."""

    def __init__(self, artifact: Path, batch: int, prompt_len: int, steps: int):
        from kiln.runtime.engine import Engine
        from kiln.runtime.executor import CacheConfig

        self.ex = Engine.load(artifact)._executor
        # Room for the prompts, one decode fork of each, and page rounding.
        tokens = batch * (2 * (prompt_len + steps) + 2 * self.ex.page_size)
        self.cache = self.ex.create_cache(CacheConfig(
            max_batch_size=2 * batch, max_total_tokens=tokens, prefill_chunk_size=batch * prompt_len,
            page_size=self.ex.page_size))
        self.seqs: list[int] = []

    def prefill(self, ids: np.ndarray):
        from kiln.runtime.executor import Chunk

        for seq in self.seqs:  # the previous repeat's prompts
            self.cache.remove(seq)
        base = (max(self.seqs) + 1) if self.seqs else 0
        self.seqs = [base + b for b in range(ids.shape[0])]
        for seq in self.seqs:
            self.cache.add(seq)
        self.ex.forward(self.cache, [Chunk(seq, tuple(row.tolist()), 0) for seq, row in zip(self.seqs, ids)])
        return list(self.seqs), ids.shape[1]

    def decode_steps(self, state, tokens) -> None:
        from kiln.runtime.executor import Chunk

        seqs, length = state
        # Each repeat decodes from the same prompts: forks share the prompts' pages.
        children = [seq + 1_000_000 for seq in seqs]
        for seq, child in zip(seqs, children):
            self.cache.fork(seq, child, length)
        for i, step in enumerate(tokens):
            self.ex.forward(self.cache, [Chunk(child, (int(tok),), length + i) for child, tok in zip(children, step)])
        for child in children:
            self.cache.remove(child)


class OrtSystem:
    """The exported prefill / decode ONNX graphs (explicit past/present KV) on
    onnxruntime's CPU provider with all graph optimizations."""

    def __init__(self, folder: Path):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.sessions = {name: ort.InferenceSession(str(Path(folder) / f"{name}.onnx"), opts,
                                                    providers=["CPUExecutionProvider"])
                         for name in ("prefill", "decode")}
        self.past_names = [i.name for i in self.sessions["decode"].get_inputs()][2:]

    def prefill(self, ids: np.ndarray):
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        out = self.sessions["prefill"].run(None, {"input_ids": ids, "position_ids": pos})
        return out[1:], ids.shape[1]

    def decode_steps(self, state, tokens) -> None:
        past, length = state
        for i, step in enumerate(tokens):
            feeds = {"input_ids": np.asarray(step, dtype=np.int64)[:, None],
                     "position_ids": np.full((len(step), 1), length + i, dtype=np.int64)}
            feeds.update(zip(self.past_names, past))
            past = self.sessions["decode"].run(None, feeds)[1:]


class TorchSystem:
    """Kiln's own torch Llama (float32), eager, explicit KV."""

    def __init__(self, module):
        import torch

        self.torch, self.module = torch, module

    def prefill(self, ids: np.ndarray):
        torch = self.torch
        with torch.no_grad():
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            _, past = self.module(torch.from_numpy(ids), pos)
        return past, ids.shape[1]

    def decode_steps(self, state, tokens) -> None:
        past, length = state
        torch = self.torch
        with torch.no_grad():
            for i, step in enumerate(tokens):
                ids = torch.tensor(step, dtype=torch.int64)[:, None]
                _, past = self.module(ids, torch.full_like(ids, length + i), past)
