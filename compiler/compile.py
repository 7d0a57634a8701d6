"""``kiln compile``: model -> ONNX -> passes -> Relax -> kernels -> artifact."""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.runtime.artifact import LIBRARY_FILE, PARAMS_FILE, SCHEMA_VERSION, FunctionSpec, Manifest
from kiln.runtime.kv_layout import KV_DTYPES, KVLayout
from kiln.runtime.quantization import SCHEMES, QuantConfig, parse_quant
from kiln.runtime.version import __version__

from .artifact_writer import write_artifact, write_params
from .dispatch import choose_dispatch
from .export.onnx_export import ExportedGraphs, export_graphs
from .lower.buckets import with_buckets
from .lower.build import build_module, export_library
from .lower.importer import param_arrays
from .lower.kv_cache import CACHE_ARGS, FACTORY, PAGE_SIZE
from .models.source import ModelSource, resolve_model
from .passes.pipeline import run_passes
from .targets import TargetSpec
from .tune.database import database_dir, open_database


@dataclass(frozen=True)
class CompileOptions:
    target: TargetSpec
    context_length: int | None = None
    dump_dir: Path | None = None
    quant: QuantConfig = QuantConfig(SCHEMES["fp32"])
    tuned: bool = True  # apply the target's committed MetaSchedule database when there is one
    # The database folder to apply instead of the target's under schedules/ (kiln tune's
    # step gate builds with its candidate records). None: the target's, when tuned.
    schedules_dir: Path | None = None
    # How the KV cache stores keys and values (``kiln.runtime.kv_layout``); None: the
    # target's default (``default_kv_dtype``).
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype not in (None, "float32") and self.target.kind != "llvm":
            raise ValueError(f"kv_dtype {self.kv_dtype}: packed KV caches are read by Kiln's CPU kernels only; "
                             f"{self.target.kind} artifacts keep float32 KV for now")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {self.context_length}")
        if self.quant.activations == "int8" and not self.target.int8_dot:
            raise ValueError(f"int8 activations multiply with integer dot products (avx512_vnni or avx2); "
                             f"target {self.target.describe()} has neither (use --act float32)")
        if self.schedules_dir is not None and not self.tuned:
            raise ValueError("schedules_dir names a database to apply, but tuned is False")

    @property
    def resolved_kv_dtype(self) -> str:
        return self.kv_dtype or default_kv_dtype(self.target)

    def database_folder(self) -> Path | None:
        """The folder whose MetaSchedule database this compile applies (None: default rules only)."""
        if not self.tuned:
            return None
        return Path(self.schedules_dir) if self.schedules_dir is not None else database_dir(self.target)


Log = Callable[[str], None]


def default_kv_dtype(target: TargetSpec) -> str:
    """float16 on CPU targets (top-1 agreement with float32 KV above 99.5% on the default
    model: README, "KV-cache precision"); CUDA artifacts keep float32 until TVM's CUDA
    kernels read a packed cache."""
    return "float16" if target.kind == "llvm" else "float32"


def default_activations(quant: str, target: TargetSpec) -> str | None:
    """``kiln compile``'s default for ``--act``: int8 activations for int8 and int4 weights
    where the target has integer dot products (AVX-512 VNNI: 1.7-2.2x the weight-only decode
    and prefill on the default model for int8; AVX2: 1.5-1.7x; at +0.1-0.2% perplexity and
    97-98% top-1 agreement with float32: README, "Quantization"); None (the scheme's own)
    otherwise."""
    scheme = parse_quant(quant).scheme
    if target.int8_dot and (scheme.kind == "int8" or (scheme.kind == "int4" and scheme.group_size % 16 == 0)):
        return "int8"
    return None


@contextlib.contextmanager
def _step(log: Log, what: str):
    start = time.perf_counter()
    log(f"{what} ...")
    yield
    log(f"{what}: {time.perf_counter() - start:.1f}s")


def prepare_graphs(model: str | Path, options: CompileOptions,
                   log: Log = lambda _: None) -> tuple[ModelSource, ExportedGraphs]:
    """The model's ONNX graphs after Kiln's passes: what gets lowered (and tuned)."""
    source = resolve_model(model, options.context_length)
    with _step(log, "load weights"):
        module = source.build_module()
    with _step(log, "export ONNX"):
        graphs = export_graphs(module)
    del module
    return source, run_passes(graphs, options.dump_dir, log, options.quant)


def compile_model(model: str | Path, out_dir: str | Path, options: CompileOptions, log: Log = lambda _: None) -> Path:
    source, graphs = prepare_graphs(model, options, log)
    return compile_graphs(source, graphs, out_dir, options, log)


def compile_graphs(source: ModelSource, graphs: ExportedGraphs, out_dir: str | Path, options: CompileOptions,
                   log: Log = lambda _: None) -> Path:
    import tvm

    config = source.config
    target_info = options.target.info()
    functions, static_dims = with_buckets(dict(graphs.items()), options.target, config.context_length)
    folder = options.database_folder()
    database = open_database(folder) if folder is not None else None
    if database is None and options.schedules_dir is not None:
        raise ValueError(f"schedules_dir: {folder} holds no MetaSchedule database")
    # Kernels with a record in the database get its schedule, the rest dlight's rules.
    schedules = (f"MetaSchedule records from {folder} ({len(database)} records), "
                 "default rules elsewhere" if database is not None else "default rules")
    log(f"schedules: {schedules}")
    with _step(log, f"build for {options.target.key}"):
        executable, params = build_module(functions, options.target, config, static_dims, database,
                                          options.resolved_kv_dtype)

    def build(tmp: Path):
        with _step(log, "write artifact"):
            export_library(executable, tmp / LIBRARY_FILE, options.target)
            arrays = param_arrays(dict(graphs.items()), params)
            entries = write_params(tmp / PARAMS_FILE, [(p.name, a) for p, a in zip(params.specs, arrays)])
            tokenizer_files = source.load_tokenizer().write(tmp)
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            kiln_version=__version__,
            tvm_version=str(tvm.__version__),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            source=source.origin,
            model=config,
            target=target_info,
            quantization=options.quant.scheme.name,
            activation_dtype=options.quant.activations,
            kv_cache={"layout": "paged", "page_size": PAGE_SIZE,
                      "num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads,
                      "head_dim": config.head_dim, "rope": "graph",
                      **KVLayout.of(config, options.resolved_kv_dtype).to_dict(config.num_layers)},
            functions={
                FACTORY: FunctionSpec(CACHE_ARGS, ("kv_cache",)),
                **{name: FunctionSpec((*(v.name for v in g.graph.inputs), "kv_cache"),
                                      tuple(v.name for v in g.graph.outputs))
                   for name, g in functions.items()},
            },
            params=entries,
            files={},
            dispatch=choose_dispatch(options.target, options.quant, config.context_length),
            extra={"quantization": options.quant.describe(), "schedules": schedules},
        )
        return manifest, [LIBRARY_FILE, PARAMS_FILE, *tokenizer_files]

    return write_artifact(Path(out_dir), build)


def default_out_dir(model: str | Path, target: TargetSpec, quant: QuantConfig | None = None,
                    kv_dtype: str | None = None) -> Path:
    """``artifacts/<model name>[-<quant>]-<target key>``: a convenience name only (so
    builds of one model do not overwrite each other); the manifest, not the folder name,
    says what an artifact is."""
    if str(model) == "default":
        stem = "smollm2-135m-instruct"
    else:
        path = Path(model)
        stem = (path.stem if path.suffix == ".gguf" else path.resolve().name).lower()
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem)
    scheme = "" if quant is None or quant.is_float else f"-{quant.name}"
    kv = "" if kv_dtype in (None, default_kv_dtype(target)) else f"-kv{kv_dtype}"
    return Path("artifacts") / f"{safe}{scheme}{kv}-{target.key}"
