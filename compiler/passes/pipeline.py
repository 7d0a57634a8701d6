"""The ONNX -> ONNX rewrite pipeline: each pass takes and returns an onnx-ir model and is
tested alone; ``--dump-dir`` writes every phase's graphs so each one can be inspected or
run in onnxruntime.

Phases (in order):
  exported   what the torch exporter produced (standard opset-23 ops, explicit KV)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import onnx_ir as ir

from ..export.onnx_export import ExportedGraphs

# (phase name, pass) in order. A pass maps one graph (named "prefill"/"decode") to a new one.
PASSES: list[tuple[str, Callable[[str, ir.Model], ir.Model]]] = []


def run_passes(graphs: ExportedGraphs, dump_dir: Path | None = None, log=lambda _: None) -> ExportedGraphs:
    if dump_dir is not None:
        save_graphs(graphs, Path(dump_dir), "0-exported")
    for i, (phase, fn) in enumerate(PASSES, start=1):
        graphs = ExportedGraphs(**{name: fn(name, model) for name, model in graphs.items()})
        log(f"pass {phase}")
        if dump_dir is not None:
            save_graphs(graphs, Path(dump_dir), f"{i}-{phase}")
    return graphs


def save_graphs(graphs: ExportedGraphs, folder: Path, phase: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, model in graphs.items():
        ir.save(model, folder / f"{phase}.{name}.onnx", external_data=f"{phase}.{name}.onnx.data")
