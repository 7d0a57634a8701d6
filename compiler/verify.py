"""``kiln verify``: the exported ONNX graphs (and optionally a compiled artifact) against
the torch model, on fresh random inputs.

prefill: random token ids [B, S] at positions 0..S-1;
decode:  one random token per row after a torch prefill of S random tokens, so the past
         KV has realistic magnitudes.
Errors are max |difference| of the logits and of the present KV tensors.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from .export.onnx_export import export_graphs, input_names
from .models.source import resolve_model


@dataclass(frozen=True)
class GraphReport:
    graph: str
    backend: str
    logits_error: float
    kv_error: float
    relative_error: float  # logits error / max |reference logit|


@dataclass(frozen=True)
class _Case:
    feeds: dict[str, np.ndarray]
    logits: np.ndarray
    kv: list[np.ndarray]


def _cases(module, batch: int, seq: int, rng: np.random.Generator) -> dict[str, _Case]:
    config = module.config
    ids = rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int64)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
    with torch.no_grad():
        logits, present = module(torch.from_numpy(ids), torch.from_numpy(pos))
        step = rng.integers(0, config.vocab_size, (batch, 1), dtype=np.int64)
        step_pos = np.full((batch, 1), seq, dtype=np.int64)
        logits2, present2 = module(torch.from_numpy(step), torch.from_numpy(step_pos), present)
    flat = lambda kv: [t.numpy() for pair in kv for t in pair]  # noqa: E731
    past = flat(present)
    decode_feeds = {"input_ids": step, "position_ids": step_pos}
    decode_feeds.update(zip(input_names(config, "decode")[2:], past))
    return {
        "prefill": _Case({"input_ids": ids, "position_ids": pos}, logits.numpy(), past),
        "decode": _Case(decode_feeds, logits2.numpy(), flat(present2)),
    }


def _report(graph: str, backend: str, case: _Case, logits: np.ndarray, kv: list[np.ndarray]) -> GraphReport:
    logit_err = float(np.abs(logits - case.logits).max())
    kv_err = max(float(np.abs(a - b).max()) for a, b in zip(kv, case.kv))
    return GraphReport(graph, backend, logit_err, kv_err, logit_err / max(float(np.abs(case.logits).max()), 1e-30))


def verify_model(model, context_length=None, artifact: Path | None = None, batch: int = 2, seq: int = 7,
                 seed: int | None = None, log=lambda _: None) -> list[GraphReport]:
    import onnxruntime as ort

    if batch < 1 or seq < 1:
        raise ValueError("batch and seq must be >= 1")
    source = resolve_model(model, context_length)
    if seq + 1 > source.config.context_length:
        raise ValueError(f"seq {seq} does not fit the context window {source.config.context_length}")
    module = source.build_module()
    log("export ONNX ...")
    graphs = export_graphs(module)
    cases = _cases(module, batch, seq, np.random.default_rng(seed))
    reports = []
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        for name, graph in graphs.items():
            path = Path(tmp) / f"{name}.onnx"
            ir.save(graph, path, external_data=f"{name}.onnx.data")
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            out = session.run(None, cases[name].feeds)
            reports.append(_report(name, "onnxruntime", cases[name], out[0], out[1:]))
    if artifact is not None:
        reports += _verify_artifact(Path(artifact), cases)
    return reports


def _verify_artifact(folder: Path, cases: dict[str, _Case]) -> list[GraphReport]:
    """The artifact runs the same rows as one ragged batch of B sequences in its paged KV
    cache; the KV compared is what the cache holds for each sequence."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.executor import CacheConfig, Chunk

    engine = Engine.load(folder)
    ex = engine._executor  # noqa: SLF001  (verification reaches the raw functions)
    model = engine.config
    p, d = cases["prefill"], cases["decode"]
    batch, seq = p.feeds["input_ids"].shape
    cache = ex.create_cache(CacheConfig(max_batch_size=batch, max_total_tokens=batch * (seq + 1) + 64,
                                        prefill_chunk_size=batch * seq, page_size=ex.page_size))
    for i in range(batch):
        cache.add(i)
    logits = ex.forward(cache, [Chunk(i, tuple(int(t) for t in p.feeds["input_ids"][i]), 0) for i in range(batch)])
    reports = [_report("prefill", "kiln-tvm", p, logits, _cached_kv(cache, batch, seq, model))]
    steps = [Chunk(i, (int(d.feeds["input_ids"][i, 0]),), seq) for i in range(batch)]
    logits = ex.forward(cache, steps)
    reports.append(_report("decode", "kiln-tvm", d, logits, _cached_kv(cache, batch, seq + 1, model)))
    return reports


def _cached_kv(cache, batch: int, length: int, model) -> list[np.ndarray]:
    """Per layer key / value [B, Hkv, length, D], the layout of the ONNX graphs' present."""
    per_seq = [cache.read_kv(i, length, model) for i in range(batch)]  # ([L, T, Hkv, D], ...)
    out = []
    for layer in range(model.num_layers):
        for which in (0, 1):
            out.append(np.stack([kv[which][layer].transpose(1, 0, 2) for kv in per_seq]))
    return out
