"""The ONNX -> ONNX rewrite pipeline: each pass takes and returns an onnx-ir model and is
tested alone; ``--dump-dir`` writes every phase's graphs so each one can be inspected or
run in onnxruntime.

Phases (in order):
  exported                what the torch exporter produced (standard opset-23 ops,
                          explicit KV; onnxruntime runs it: the oracle of `kiln verify`)
  quantize-weights        (``--quant`` other than fp32) weights -> int8 / int4 / fp16 storage
                          with standard DequantizeLinear / Cast; still onnxruntime-runnable
                          (passes/quantize_weights.py)
  quantize-activations    (int8 activations) the inputs of int8-weight MatMuls through a
                          QuantizeActivations function of standard ops; still
                          onnxruntime-runnable (passes/quantize_activations.py)
  paged-attention         each layer's Attention over past/present -> kiln::PagedAttention
                          on the runtime's paged KV cache (passes/paged_attention.py)
  select-logit-positions  prefill returns logits at given token positions, for ragged
                          batches of several sequences (passes/select_logit_positions.py)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import onnx_ir as ir

from ..export.onnx_export import ExportedGraphs
from kiln.runtime.quantization import QuantConfig
from .paged_attention import rewrite_paged_attention
from .quantize_activations import quantize_activations
from .quantize_weights import quantize_weights
from .select_logit_positions import select_logit_positions

Phase = tuple[str, Callable[[ir.Model], ir.Model], tuple[str, ...]]


def phases(quant: QuantConfig | None = None) -> list[Phase]:
    """(phase name, pass, graphs it applies to), in order. A pass rewrites an onnx-ir
    model in place and returns it."""
    out: list[Phase] = []
    if quant is not None and not quant.is_float:
        out.append(("quantize-weights", quantize_weights(quant), ("prefill", "decode")))
    if quant is not None and quant.activations == "int8":
        out.append(("quantize-activations", quantize_activations, ("prefill", "decode")))
    out += [
        ("paged-attention", rewrite_paged_attention, ("prefill", "decode")),
        ("select-logit-positions", select_logit_positions, ("prefill",)),
    ]
    return out


def run_passes(graphs: ExportedGraphs, dump_dir: Path | None = None, log=lambda _: None,
               quant: QuantConfig | None = None) -> ExportedGraphs:
    if dump_dir is not None:
        save_graphs(graphs, Path(dump_dir), "0-exported")
    for i, (phase, fn, targets) in enumerate(phases(quant), start=1):
        graphs = ExportedGraphs(**{name: fn(model) if name in targets else model for name, model in graphs.items()})
        log(f"pass {phase}")
        if dump_dir is not None:
            save_graphs(graphs, Path(dump_dir), f"{i}-{phase}")
    return graphs


def save_graphs(graphs: ExportedGraphs, folder: Path, phase: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, model in graphs.items():
        ir.save(model, folder / f"{phase}.{name}.onnx", external_data=f"{phase}.{name}.onnx.data")
