"""Ship CUDA kernels as machine code: replace the CUDA source that TVM packs into
``model.so`` with an nvcc-built fatbin for the target arch.

Why: on a build host without the CUDA driver (like CI), TVM 0.27's codegen keeps the
kernels as CUDA *source* (its "fallback" module) and the runtime would JIT-compile them
at load through a Python nvcc/nvrtc callback -- which a runtime-only serving box does not
have. Kiln therefore compiles the source here, once, with nvcc into a fatbin holding
sm_XX SASS (plus compute_XX PTX for newer GPUs), and packs that instead.

The packed-imports blob (``runtime.ModulePackImportsToTensor``) is::

    u64 payload_size
    u64 n, u64[n]  import-tree row pointers
    u64 m, u64[m]  import-tree child indices
    then per module: str kind, and unless kind == "_lib": bytes payload
      (str and bytes are u64 length + data)

and a CUDA module's payload is ``str fmt, fmap, bytes code`` (``SaveToBytes``); for the
source module fmt is "cuda" and code the source text. Only fmt and code change here.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOB_SYMBOL = "__tvm_ffi__library_bin"


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _str(data: bytes) -> bytes:
    return _u64(len(data)) + data


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def chunk(self) -> bytes:
        n = self.u64()
        out = self.data[self.pos:self.pos + n]
        if len(out) != n:
            raise ValueError("truncated module blob")
        self.pos += n
        return out


def rewrite_blob(blob: bytes, compiler: "NvccCompiler") -> tuple[bytes, int]:
    """Return the blob with every CUDA source module compiled by ``compiler``, and how
    many modules were rewritten."""
    r = _Reader(blob)
    size = r.u64()
    end = 8 + size
    if end != len(blob):
        raise ValueError(f"module blob declares {size} bytes but holds {len(blob) - 8}")
    rows = [r.u64() for _ in range(r.u64())]
    children = [r.u64() for _ in range(r.u64())]
    out = [_u64(len(rows)), *map(_u64, rows), _u64(len(children)), *map(_u64, children)]
    rewritten = 0
    while r.pos < end:
        kind = r.chunk()
        out.append(_str(kind))
        if kind == b"_lib":
            continue
        payload = r.chunk()
        if kind == b"cuda":
            payload, changed = _rewrite_cuda_payload(payload, compiler)
            rewritten += changed
        out.append(_str(payload))
    body = b"".join(out)
    return _u64(len(body)) + body, rewritten


def _rewrite_cuda_payload(payload: bytes, compiler: "NvccCompiler") -> tuple[bytes, bool]:
    r = _Reader(payload)
    fmt = r.chunk()
    if fmt != b"cuda":
        return payload, False  # already machine code (ptx / cubin / fatbin)
    # The code is the payload's last field and the function map sits between: the map's
    # layout is TVM's business, so it is carried over byte for byte.
    source = compiler.source_of(payload)
    fmap = payload[r.pos:len(payload) - 8 - len(source)]
    return _str(b"fatbin") + fmap + _str(compiler(source)), True


class NvccCompiler:
    """nvcc -> fatbin holding sm_XX SASS plus compute_XX PTX. ``sources`` are the CUDA
    modules' texts (``inspect_source("cuda")``), used to find each payload's trailing
    code field exactly."""

    def __init__(self, arch: str, sources: list[str]):
        self.arch = arch
        number = arch.removeprefix("sm_")
        self.flags = ["-gencode", f"arch=compute_{number},code=[sm_{number},compute_{number}]"]
        self.sources = [s.encode() for s in sources]

    def source_of(self, payload: bytes) -> bytes:
        for source in self.sources:
            if payload.endswith(_str(source)):
                return source
        raise ValueError("CUDA module payload does not end with any known kernel source")

    def __call__(self, source: bytes) -> bytes:
        import tvm
        from tvm.support import nvcc

        with tvm.target.Target({"kind": "cuda", "arch": self.arch}):  # nvcc reads the arch from it
            return bytes(nvcc.compile_cuda(source.decode(), target_format="fatbin", arch=self.flags,
                                           compiler="nvcc"))


def cuda_sources(module) -> list[str]:
    """The CUDA source text of every CUDA module under ``module``."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        if m.kind == "cuda":
            out.append(m.inspect_source("cuda"))
        stack.extend(m.imports)
    return out


def fatbin_packer(arch: str):
    """An ``export_library(fpack_imports=...)`` hook embedding the rewritten blob with the
    assembler's ``.incbin`` (a C array of a large fatbin would take the compiler minutes)."""

    def pack(module, is_system_lib: bool, symbol_prefix: str, workspace_dir: str) -> str:
        import tvm_ffi

        tensor = tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(module)
        sources = cuda_sources(module)
        # On a host with the CUDA driver TVM may already have compiled the kernels (then
        # every CUDA payload is machine code and nothing is rewritten).
        blob, _ = rewrite_blob(tensor.numpy().tobytes(), NvccCompiler(arch, sources))
        workspace = Path(workspace_dir)
        data = workspace / "kiln_imports.bin"
        data.write_bytes(blob)
        symbol = symbol_prefix + BLOB_SYMBOL
        asm = workspace / "kiln_imports.S"
        asm.write_text(
            "\t.section .rodata\n"
            f"\t.globl {symbol}\n"
            f"\t.type {symbol}, @object\n"
            "\t.balign 16\n"
            f"{symbol}:\n"
            f"\t.incbin \"{data.as_posix()}\"\n"
            f"\t.size {symbol}, {len(blob)}\n"
            "\t.section .note.GNU-stack,\"\",@progbits\n"
        )
        return str(asm)

    return pack
