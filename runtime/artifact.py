"""The artifact on disk: its manifest schema, file integrity, and weights.

An artifact is a folder::

    manifest.json          this schema (below): what the artifact is and holds
    model.so               compiled VM executable + kernels for one target
    params.bin             every weight, 64-byte aligned, indexed by the manifest
    tokenizer.json         tokenizers-library file
    tokenizer_config.json  chat template, special tokens

The manifest describes everything (model config, target, quantization, functions, KV
geometry, file hashes); nothing is encoded in file names. The compiler writes it with
``Manifest.to_dict``; the runtime reads it with ``load_manifest`` and refuses artifacts
that are incomplete, altered, or newer than it understands.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ArtifactError
from .model_config import ModelConfig

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
PARAMS_FILE = "params.bin"
LIBRARY_FILE = "model.so"
PARAM_ALIGNMENT = 64  # TVM requires 64-byte aligned buffers to use them in place

_NUMPY_DTYPES = {"float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "uint32", "bool"}


@dataclass(frozen=True)
class TargetInfo:
    kind: str  # "llvm" | "cuda"
    device: str  # "cpu" | "cuda"
    arch: str | None = None  # "sm_90"
    mcpu: str | None = None  # LLVM CPU name the kernels were built for
    cpu_features: tuple[str, ...] = ()  # /proc/cpuinfo flags the kernels need

    @property
    def key(self) -> str:
        return self.kind if self.arch is None else f"{self.kind}-{self.arch}"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class FunctionSpec:
    """A compiled function's contract: named inputs before the params tuple, and outputs."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Dispatch:
    """Which compiled function runs a step. A decode step of more than ``decode_max_batch``
    sequences runs through ``prefill`` (one token per sequence, ragged): with quantized
    weights its GEMMs dequantize each weight tile once for all rows, where ``decode``'s
    GEMVs dequantize it again for every row. None: every decode step runs ``decode``.
    ``static_decode``: batch sizes with a static-shape copy of ``decode`` named
    ``decode_b<N>`` (kernels tuned for exactly that batch), run for decode steps of N.
    ``static_prefill``: token counts with a static-shape copy of ``prefill`` named
    ``prefill_t<T>`` (GEMMs tiled over rows as well as columns); a prefill of more tokens
    runs in pieces of those sizes and the remainder through ``prefill`` (``prefill_plan``)."""

    decode_max_batch: int | None = None
    static_decode: tuple[int, ...] = ()
    static_prefill: tuple[int, ...] = ()

    def __post_init__(self):
        m = self.decode_max_batch
        if m is not None and not _positive_int(m):
            raise ValueError(f"dispatch.decode_max_batch must be a positive integer or null, got {m!r}")
        for name in ("static_decode", "static_prefill"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(_positive_int(b) for b in value) or len(set(value)) != len(value):
                raise ValueError(f"dispatch.{name} must be a list of distinct positive integers, got {value!r}")

    def function_names(self) -> tuple[str, ...]:
        return (*(decode_bucket_name(b) for b in self.static_decode),
                *(prefill_bucket_name(t) for t in self.static_prefill))

    def static_function(self, batch: int) -> str | None:
        """The static bucket for a decode step of ``batch`` sequences, if the artifact has one."""
        return decode_bucket_name(batch) if batch in self.static_decode else None

    def prefill_plan(self, tokens: int) -> list[tuple[str, int]]:
        """(function, tokens) pieces that run a prefill of ``tokens`` tokens in order: as many
        of the largest static bucket as fit, then the next, the rest through ``prefill``."""
        plan = []
        for size in sorted(self.static_prefill, reverse=True):
            plan += [(prefill_bucket_name(size), size)] * (tokens // size)
            tokens %= size
        return plan + ([("prefill", tokens)] if tokens else [])

    def to_dict(self) -> dict:
        return {"decode_max_batch": self.decode_max_batch, "static_decode": list(self.static_decode),
                "static_prefill": list(self.static_prefill)}

    @classmethod
    def from_dict(cls, data: dict) -> "Dispatch":
        lists = {name: data.get(name, []) for name in ("static_decode", "static_prefill")}
        return cls(decode_max_batch=data.get("decode_max_batch"),
                   **{name: tuple(v) if isinstance(v, list) else v for name, v in lists.items()})


def decode_bucket_name(batch: int) -> str:
    return f"decode_b{batch}"


def prefill_bucket_name(tokens: int) -> str:
    return f"prefill_t{tokens}"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    kiln_version: str
    tvm_version: str
    model: ModelConfig
    target: TargetInfo
    quantization: str
    activation_dtype: str
    kv_cache: dict
    functions: dict[str, FunctionSpec]
    params: tuple[TensorEntry, ...]
    files: dict[str, FileEntry]
    source: str = ""
    created: str = ""
    dispatch: Dispatch = Dispatch()
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "kiln_version": self.kiln_version,
            "tvm_version": self.tvm_version,
            "created": self.created,
            "source": self.source,
            "model": self.model.to_dict(),
            "target": {"kind": self.target.kind, "device": self.target.device, "arch": self.target.arch,
                       "mcpu": self.target.mcpu, "cpu_features": list(self.target.cpu_features)},
            "quantization": self.quantization,
            "activation_dtype": self.activation_dtype,
            "kv_cache": self.kv_cache,
            "functions": {k: {"inputs": list(f.inputs), "outputs": list(f.outputs)}
                          for k, f in self.functions.items()},
            "params": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset,
                        "nbytes": p.nbytes} for p in self.params],
            "files": {k: {"sha256": f.sha256, "bytes": f.bytes} for k, f in self.files.items()},
            "dispatch": self.dispatch.to_dict(),
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        version = data.get("schema_version")
        if not isinstance(version, int):
            raise ArtifactError("manifest.json: schema_version is missing or not an integer")
        if version > SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest.json: schema version {version} is newer than this Kiln understands "
                f"({SCHEMA_VERSION}); upgrade kiln-llm to load this artifact"
            )
        if version < 1:
            raise ArtifactError(f"manifest.json: schema version {version} is not valid")
        try:
            t = data["target"]
            return cls(
                schema_version=version,
                kiln_version=str(data["kiln_version"]),
                tvm_version=str(data["tvm_version"]),
                created=str(data.get("created", "")),
                source=str(data.get("source", "")),
                model=ModelConfig.from_dict(data["model"]),
                target=TargetInfo(kind=t["kind"], device=t["device"], arch=t.get("arch"),
                                  mcpu=t.get("mcpu"), cpu_features=tuple(t.get("cpu_features", ()))),
                quantization=str(data["quantization"]),
                activation_dtype=str(data["activation_dtype"]),
                kv_cache=dict(data["kv_cache"]),
                functions={k: FunctionSpec(tuple(f["inputs"]), tuple(f["outputs"]))
                           for k, f in data["functions"].items()},
                params=tuple(TensorEntry(p["name"], p["dtype"], tuple(p["shape"]), int(p["offset"]),
                                         int(p["nbytes"])) for p in data["params"]),
                files={k: FileEntry(f["sha256"], int(f["bytes"])) for k, f in data["files"].items()},
                dispatch=Dispatch.from_dict(dict(data.get("dispatch", {}))),
                extra=dict(data.get("extra", {})),
            )
        except KeyError as missing:
            raise ArtifactError(f"manifest.json: missing field {missing}") from None
        except (TypeError, ValueError) as err:
            raise ArtifactError(f"manifest.json: invalid content ({err})") from None


def load_manifest(path: str | Path) -> Manifest:
    folder = Path(path)
    if not folder.exists():
        raise ArtifactError(f"{folder}: no such artifact")
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: an artifact is a folder (with {MANIFEST}), not a file")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{folder}: not a Kiln artifact (no {MANIFEST})")
    try:
        data = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{manifest_path}: corrupt manifest ({err})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{manifest_path}: corrupt manifest (not a JSON object)")
    return Manifest.from_dict(data)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_files(folder: str | Path, manifest: Manifest, check_hashes: bool = True) -> None:
    """Every file the manifest lists exists with its size (and, by default, its hash)."""
    folder = Path(folder)
    for name, entry in manifest.files.items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{folder}: artifact is incomplete, {name} is missing")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ArtifactError(f"{path}: size {size} does not match the manifest ({entry.bytes}); the file is corrupt")
        if check_hashes and sha256_file(path) != entry.sha256:
            raise ArtifactError(f"{path}: sha256 does not match the manifest; the file is corrupt or was altered")


def read_params(folder: str | Path, manifest: Manifest) -> list[np.ndarray]:
    """The weights as numpy views of one copy-on-write memory map of ``params.bin``, in
    manifest order: nothing is copied or converted here."""
    path = Path(folder) / PARAMS_FILE
    blob = np.memmap(path, dtype=np.uint8, mode="c")
    out = []
    for p in manifest.params:
        if p.dtype not in _NUMPY_DTYPES:
            raise ArtifactError(f"{path}: weight {p.name} has unsupported dtype {p.dtype}")
        dtype = np.dtype(p.dtype)
        count = int(np.prod(p.shape, dtype=np.int64))
        if p.offset % PARAM_ALIGNMENT or p.offset + count * dtype.itemsize > blob.size or count * dtype.itemsize != p.nbytes:
            raise ArtifactError(f"{path}: weight {p.name} lies outside the file or is misaligned")
        out.append(blob[p.offset:p.offset + p.nbytes].view(dtype).reshape(p.shape))
    return out
