"""Relax IRModule -> compiled VM executable for one target."""

from __future__ import annotations

import contextlib
import os

import onnx_ir as ir

from kiln.runtime.kv_layout import KVLayout
from kiln.runtime.model_config import ModelConfig

from ..targets import TargetSpec
from .importer import ParamTable, import_graphs
from .kv_cache import add_kv_cache_factory, use_kiln_cpu_attention
from .pipeline import relax_pipeline


@contextlib.contextmanager
def cuda_compile_mode(target: TargetSpec):
    """CUDA kernels go through nvcc into a real sm_XX fatbin: TVM's default nvrtc mode
    needs cuda-python and the default export embeds CUDA source instead of machine code."""
    if target.kind != "cuda":
        yield
        return
    previous = os.environ.get("TVM_CUDA_COMPILE_MODE")
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TVM_CUDA_COMPILE_MODE", None)
        else:
            os.environ["TVM_CUDA_COMPILE_MODE"] = previous


def relax_module(graphs: dict[str, ir.Model], target: TargetSpec, config: ModelConfig,
                 static_dims: dict[str, dict[str, int]] | None = None, kv_dtype: str = "float32"):
    """Import the graphs into one module and add the KV-cache factory (and, on CPU, Kiln's
    attention kernels): what the pipeline compiles. Returns (module, params).
    ``static_dims``: the static buckets (``buckets.py``); ``kv_dtype``: the cache's stored
    form (``kiln.runtime.kv_layout``)."""
    from tvm import relax

    cpu = target.kind == "llvm"
    layout = KVLayout.of(config, kv_dtype)
    mod, params = import_graphs(graphs, static_dims=static_dims, float_panels=cpu, row_tiles=cpu, kv_dtype=kv_dtype,
                                 dot_isa=target.dot_isa)
    bb = relax.BlockBuilder(mod)
    add_kv_cache_factory(bb, config, target.tvm_target(), layout)
    mod = bb.get()
    if target.kind == "llvm":
        mod = use_kiln_cpu_attention(mod, layout)
    return mod, params


def build_module(graphs: dict[str, ir.Model], target: TargetSpec, config: ModelConfig,
                 static_dims: dict[str, dict[str, int]] | None = None, database=None, kv_dtype: str = "float32"):
    """``relax_module``, compiled. Returns (executable, params). ``database``: MetaSchedule
    records to apply before the default rules (``tune/``)."""
    import tvm

    mod, params = relax_module(graphs, target, config, static_dims, kv_dtype)
    tvm_target = target.tvm_target()
    with cuda_compile_mode(target):
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=relax_pipeline(tvm_target, database))
    return executable, params


def export_library(executable, path, target: TargetSpec) -> None:
    """Write ``model.so``. CUDA kernels are packed as an sm_XX fatbin (``cuda_fatbin``)."""
    from .cuda_fatbin import fatbin_packer

    with cuda_compile_mode(target):
        if target.kind == "cuda":
            executable.export_library(str(path), fpack_imports=fatbin_packer(target.arch))
        else:
            executable.export_library(str(path))


__all__ = ["build_module", "export_library", "ParamTable"]
