"""Shared fixtures: tiny random checkpoints and compiled artifacts, built once per run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The test process compiles and runs: load the full TVM before kiln.runtime can pick the
# runtime-only library (runtime-only behaviour is tested in subprocesses).
import kiln.compiler  # noqa: E402,F401
from helpers import make_checkpoint  # noqa: E402


def _has_cuda_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and Path("/dev/nvidia0").exists()


DEFAULT_MODEL_FIXTURES = {"smollm2_artifact", "smollm2_source", "smollm2_module", "smollm2_graphs"}


def pytest_collection_modifyitems(config, items):
    # A test that compiles or runs the full default model is slow (`-m "not slow"` skips
    # them; `make test` runs everything).
    for item in items:
        if DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if _has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(variant) -> an HF folder with fresh random weights (cached per variant)."""
    cache: dict[str, Path] = {}

    def make(variant: str = "llama") -> Path:
        if variant not in cache:
            cache[variant] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{variant}"), variant)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, checkpoint):
    """compiled(variant, target, kv_dtype) -> an artifact folder of that tiny checkpoint
    (cached). The KV cache is float32 unless asked: most tests hold the artifact to torch's
    float32 numbers (1e-4), which a float16 / int8 cache rounds away from by design
    (test_kv_dtypes.py bounds those)."""
    from kiln.compiler.compile import CompileOptions, compile_model
    from kiln.compiler.targets import parse_target

    cache: dict[tuple[str, str, str], Path] = {}

    def make(variant: str = "llama", target: str = "llvm", kv_dtype: str = "float32") -> Path:
        key = (variant, target, kv_dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"art-{variant}-{target.replace(':', '-')}-{kv_dtype}") / "artifact"
            cache[key] = compile_model(checkpoint(variant), out, CompileOptions(parse_target(target), kv_dtype=kv_dtype))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct) compiled for this CPU, with a
    float32 KV cache: its tests hold it to torch's float32 logits (1e-3 on logits of ~30);
    the float16 / int8 caches are held to the float32 one in test_kv_quality.py."""
    from kiln.compiler.compile import CompileOptions, compile_model
    from kiln.compiler.targets import parse_target

    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    return compile_model("default", out, CompileOptions(parse_target("llvm"), context_length=2048,
                                                        kv_dtype="float32"))


@pytest.fixture(scope="session")
def smollm2_source():
    from kiln.compiler.models.source import resolve_model

    return resolve_model("default", context_length=2048)


@pytest.fixture(scope="session")
def smollm2_module(smollm2_source):
    return smollm2_source.build_module()


@pytest.fixture(scope="session")
def smollm2_graphs(smollm2_source, smollm2_module):
    """(source, fresh_graphs): the default model exported once; ``fresh_graphs()`` returns
    a private copy (passes rewrite graphs in place)."""
    import onnx_ir as ir

    from kiln.compiler.export.onnx_export import ExportedGraphs, export_graphs

    exported = export_graphs(smollm2_module)
    protos = {name: ir.to_proto(model) for name, model in exported.items()}
    del exported

    def fresh_graphs() -> ExportedGraphs:
        return ExportedGraphs(**{name: ir.from_proto(proto) for name, proto in protos.items()})

    return smollm2_source, fresh_graphs
