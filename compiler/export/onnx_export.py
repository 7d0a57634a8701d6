"""Export Kiln's torch model to two standard ONNX graphs with explicit KV.

prefill(input_ids [B, S], position_ids [B, S])
    -> logits [B, V] (last position), present.{i}.key / .value [B, Hkv, S, D]
decode(input_ids [B, 1], position_ids [B, 1], past.{i}.key / .value [B, Hkv, P, D])
    -> logits [B, V], present.{i}.key / .value [B, Hkv, P + 1, D]

Batch, sequence and past length are dynamic (dim params ``batch``, ``seq``, ``past``).
The exporter's own graph optimizer is off: it would constant-fold each ``Transpose`` of a
weight into an anonymous ``[K, N]`` initializer, losing the parameter names (which the
two graphs share, so the artifact stores each weight once) and the ``[N, K]`` layout that
GEMV kernels and per-output-channel quantization want. Graphs are returned as onnx-ir
models, which hold weights over protobuf's 2 GiB limit.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import onnx_ir as ir
import torch

from kiln.compiler.models.llama import LlamaForCausalLM
from kiln.runtime.model_config import ModelConfig

OPSET = 23
IR_VERSION = 10  # onnxruntime accepts IR versions up to 13
GRAPH_NAMES = ("prefill", "decode")


def input_names(config: ModelConfig, graph: str) -> list[str]:
    names = ["input_ids", "position_ids"]
    if graph == "decode":
        names += [f"past.{i}.{kv}" for i in range(config.num_layers) for kv in ("key", "value")]
    return names


def output_names(config: ModelConfig) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(config.num_layers) for kv in ("key", "value")]


class _Prefill(torch.nn.Module):
    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids):
        logits, presents = self.lm(input_ids, position_ids)
        return (logits, *[t for kv in presents for t in kv])


class _Decode(torch.nn.Module):
    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.lm(input_ids, position_ids, pairs)
        return (logits, *[t for kv in presents for t in kv])


@dataclass(frozen=True)
class ExportedGraphs:
    prefill: ir.Model
    decode: ir.Model

    def items(self):
        return (("prefill", self.prefill), ("decode", self.decode))


def export_graphs(lm: LlamaForCausalLM) -> ExportedGraphs:
    config = lm.config
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=config.context_length)
    past = torch.export.Dim("past", min=1, max=config.context_length - 1)
    kv_shape = lambda b, p: (b, config.num_kv_heads, p, config.head_dim)  # noqa: E731

    # Example inputs only fix dtypes; shapes are dynamic. Sizes avoid 0/1 specialization.
    ids = torch.zeros(2, 3, dtype=torch.int64)
    prefill = _export(
        _Prefill(lm), (ids, ids.clone()),
        {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}},
        input_names(config, "prefill"), output_names(config),
    )
    step = torch.zeros(2, 1, dtype=torch.int64)
    pasts = [torch.zeros(kv_shape(2, 3)) for _ in range(2 * config.num_layers)]
    decode = _export(
        _Decode(lm), (step, step.clone(), pasts),
        {"input_ids": {0: batch}, "position_ids": {0: batch}, "past": [{0: batch, 2: past}] * len(pasts)},
        input_names(config, "decode"), output_names(config),
    )
    return ExportedGraphs(prefill=prefill, decode=decode)


def _export(module, args, dynamic_shapes, inputs, outputs) -> ir.Model:
    lm = module.lm
    lm.set_export_ops(True)
    try:
        with _quiet():
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=OPSET, optimize=False,
                input_names=inputs, output_names=outputs, dynamic_shapes=dynamic_shapes,
                verbose=False,
            )
    finally:
        lm.set_export_ops(False)
    model = program.model
    model.ir_version = IR_VERSION
    _strip_wrapper_prefix(model.graph, "lm.")
    return model


def _strip_wrapper_prefix(graph: ir.Graph, prefix: str) -> None:
    """Name initializers exactly like the checkpoint (``model.layers.0...``)."""
    for name in list(graph.initializers):
        if name.startswith(prefix):
            value = graph.initializers.pop(name)
            value.name = name[len(prefix):]
            graph.initializers[value.name] = value


@contextlib.contextmanager
def _quiet():
    """The exporter logs progress and warns about torchvision; keep the CLI readable."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch._dynamo", "torch.export", "torch.fx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(_NullIO()):
                yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _NullIO:
    def write(self, _):
        return 0

    def flush(self):
        pass
