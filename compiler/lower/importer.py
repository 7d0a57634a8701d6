"""ONNX (onnx-ir) graphs -> one Relax IRModule, one function per graph.

Kiln imports its graphs itself rather than through TVM's ``from_onnx``: its graphs use a
small set of standard ops (opset 23 ``Attention``, ``RotaryEmbedding``,
``RMSNormalization``, ...) plus Kiln's own custom-domain ops, several graphs share one set
of weights, and the KV state of later stages is a runtime object rather than a tensor.
Each op's conversion is a registered converter (``registry.py``, ``converters/``).

Function signature: ``fn(*graph_inputs, [kv_cache], params) -> (outputs...)`` where
``params`` is a tuple of every weight in ``ParamTable`` order and ``kv_cache`` (an
Object: TVM's paged KV cache) is present when the graph has ``kiln::PagedAttention``
nodes. Weights stay function inputs (never constants), so TVM never folds them, and
quantized weights keep their storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import tvm
from tvm import relax

from .context import ConvertContext, relax_dtype
from .quant_weights import int8_dot_weights, stored_arrays, stored_specs, weight_storages
from .converters import quantized
from .registry import lookup

# Kiln ops that read or write the paged KV cache: their function takes the cache object.
KV_CACHE_DOMAIN = "kiln"
KV_CACHE_OPS = ("PagedAttention",)

# Initializers with at most this many elements become Relax constants (index tensors,
# scalars); anything larger is a weight and becomes a parameter.
CONSTANT_MAX_ELEMENTS = 16


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ParamTable:
    """Every weight the module's functions take, in the order of the ``params`` tuple."""

    specs: tuple[ParamSpec, ...]
    # float32 projection weights stored as panels (``quant_weights.float_panel_storage``):
    # the CPU layout; GPU targets keep them [N, K].
    float_panels: bool = False
    # int8 weights stored for the dot-product kernels (``quant_weights.int8_dot_weights``).
    int8_dot: frozenset[str] = frozenset()

    def index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.specs)}


def _is_param(value: ir.Value) -> bool:
    tensor = value.const_value
    return tensor is not None and int(np.prod(tensor.shape.numpy())) > CONSTANT_MAX_ELEMENTS


def collect_params(graphs: dict[str, ir.Model], float_panels: bool = False) -> ParamTable:
    """Union of the graphs' weights by name; a name must mean the same tensor in each.
    Quantized weights (and float32 panels) get the shape and dtype Kiln stores them in
    (``quant_weights``)."""
    stored = {}
    int8_dot = int8_dot_weights(graphs.items())
    for storage in weight_storages(graphs.items(), float_panels, int8_dot).values():
        stored.update(stored_specs(storage))
    specs: dict[str, ParamSpec] = {}
    for gname, model in graphs.items():
        for name, value in model.graph.initializers.items():
            if not _is_param(value) and name not in stored:  # a quantized weight's scales stay params, however small
                continue
            shape, dtype = stored.get(name) or (tuple(int(d) for d in value.const_value.shape.numpy()),
                                                relax_dtype(value.const_value.dtype))
            spec = ParamSpec(name, tuple(shape), dtype)
            if name in specs and specs[name] != spec:
                raise ValueError(f"weight {name!r} differs between graphs ({specs[name]} vs {spec} in {gname})")
            specs.setdefault(name, spec)
    return ParamTable(tuple(specs.values()), float_panels, int8_dot)


def param_arrays(graphs: dict[str, ir.Model], params: ParamTable) -> list[np.ndarray]:
    """The arrays of ``params``, in order, as the compiled module takes them."""
    values: dict[str, ir.Value] = {}
    for _, model in graphs.items():
        for name, value in model.graph.initializers.items():
            values.setdefault(name, value)
    arrays: dict[str, np.ndarray] = {}
    for storage in weight_storages(graphs.items(), params.float_panels, params.int8_dot).values():
        arrays.update(stored_arrays(storage, *(values[name].const_value.numpy() for name in storage.stored)))
    out = []
    for spec in params.specs:
        array = arrays[spec.name] if spec.name in arrays else values[spec.name].const_value.numpy()
        if tuple(array.shape) != spec.shape or str(array.dtype) != spec.dtype:
            raise ValueError(f"weight {spec.name!r}: stored as {array.dtype}{list(array.shape)}, "
                             f"the module expects {spec.dtype}{list(spec.shape)}")
        out.append(array)
    return out


def import_graphs(graphs: dict[str, ir.Model], params: ParamTable | None = None,
                  static_dims: dict[str, dict[str, int]] | None = None,
                  float_panels: bool = False, row_tiles: bool = False,
                  kv_dtype: str = "float32", dot_isa: str | None = None) -> tuple[tvm.IRModule, ParamTable]:
    """``static_dims[fname]``: ONNX dim names fixed to a size in that function (a static
    bucket of a dynamic graph: every kernel it calls gets static shapes). ``float_panels``:
    store float32 projection weights as panels (CPU targets; ignored when ``params`` is
    given: its own choice holds). ``row_tiles``: ``ConvertContext.row_tiles`` (CPU targets).
    ``kv_dtype``: how the paged KV cache stores K / V (``ConvertContext.kv_dtype``).
    ``dot_isa``: what int8-activation matmuls build for (``ConvertContext.dot_isa``)."""
    params = params or collect_params(graphs, float_panels)
    panels = {s.data: s for s in weight_storages(graphs.items(), True).values()
              if s.kind == "fp32"} if params.float_panels else {}
    bb = relax.BlockBuilder()
    for fname, model in graphs.items():
        _import_function(bb, fname, model.graph, params, (static_dims or {}).get(fname, {}), panels, row_tiles,
                         kv_dtype, dot_isa)
    return bb.get(), params


def _many_tokens(graph: ir.Graph) -> bool:
    """input_ids [batch, tokens]: a prefill takes a run of tokens per sequence, a decode
    exactly one."""
    ids = graph.inputs[0]
    return ids.shape is None or ids.shape[-1] != 1


def _import_function(bb: relax.BlockBuilder, fname: str, graph: ir.Graph, params: ParamTable,
                     static_dims: dict[str, int], panels: dict, row_tiles: bool, kv_dtype: str,
                     dot_isa: str | None) -> None:
    ctx = ConvertContext(bb=bb, many_tokens=_many_tokens(graph), row_tiles=row_tiles, kv_dtype=kv_dtype,
                         int8_dot=params.int8_dot, dot_isa=dot_isa,
                         dims={name: tvm.tirx.IntImm("int64", size) for name, size in static_dims.items()})
    inputs = [relax.Var(v.name.replace(".", "_"), relax.TensorType(ctx.shape_of(v), relax_dtype(v.dtype)))
              for v in graph.inputs]
    if any(n.domain == KV_CACHE_DOMAIN and n.op_type in KV_CACHE_OPS for n in graph):
        ctx.kv_cache = relax.Var("kv_cache", relax.ObjectType())
        inputs.append(ctx.kv_cache)
    param_tuple = relax.Var("params", relax.TupleType(
        [relax.TensorType(list(p.shape), p.dtype) for p in params.specs]))
    index = params.index()
    values = ctx.values
    values.update({v.name: var for v, var in zip(graph.inputs, inputs)})

    with bb.function(fname, inputs + [param_tuple], {"num_input": len(inputs)}):
        with bb.dataflow():
            for name, init in graph.initializers.items():
                if name in index:
                    values[name] = bb.emit(relax.TupleGetItem(param_tuple, index[name]), name_hint=_hint(name))
                    if name in panels:
                        values[name] = quantized.record_panels(ctx, panels[name], values[name])
                else:
                    array = init.const_value.numpy()
                    ctx.constants[name] = array
                    values[name] = relax.const(array)
            for node in graph:
                if node.outputs and node.outputs[0].name in ctx.folded:
                    values[node.outputs[0].name] = values[node.inputs[0].name]
                    continue
                args = [None if v is None or v.name == "" else values[v.name] for v in node.inputs]
                convert = lookup(node)
                try:
                    result = convert(ctx, node, args)
                except (ValueError, TypeError, RuntimeError) as err:
                    raise ValueError(f"converting {node.op_type} node {node.name!r}: {err}") from err
                results = result if isinstance(result, (list, tuple)) else [result]
                for out, expr in zip(node.outputs, results):
                    if expr is None or out.name == "":
                        continue
                    values[out.name] = expr if isinstance(expr, (tvm.ir.expr.Constant, relax.Var)) else bb.emit(expr, name_hint=_hint(out.name))
            outputs = [values[v.name] for v in graph.outputs]
            gv = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(gv)


def _hint(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
