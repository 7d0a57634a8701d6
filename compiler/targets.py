"""Compile targets: one registry, the single source of ``--target`` choices.

A target spec is ``llvm`` (this host's CPU), ``llvm:<mcpu>`` (an LLVM CPU name such as
``x86-64-v3``), ``cuda`` (sm_90) or ``cuda:sm_XX``. The manifest records the resolved
target; the runtime maps its ``device`` to a TVM device and, for CPU kernels, checks the
host has the instruction-set features they were built with.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kiln.runtime.artifact import TargetInfo

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
DEFAULT_CUDA_ARCH = "sm_90"
TARGET_CHOICES = ("llvm", "llvm:<mcpu>", "cuda", *(f"cuda:{a}" for a in CUDA_ARCHS))

# LLVM feature name -> /proc/cpuinfo flag, for the features whose absence would make
# generated code fault with an illegal instruction.
_CPUINFO_FLAGS = {
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "ssse3": "ssse3", "avx": "avx", "avx2": "avx2",
    "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512vbmi": "avx512vbmi",
    "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16", "avxvnni": "avx_vnni",
}


# LLVM features each integer dot-product ISA of the int8 kernels needs, best first.
DOT_ISAS = {"avx512_vnni": {"avx512vnni", "avx512bw", "avx512f"}, "avx2": {"avx2"}}


@dataclass(frozen=True)
class TargetSpec:
    kind: str  # "llvm" | "cuda"
    arch: str | None = None  # "sm_90" for cuda
    mcpu: str | None = None  # llvm: None = this host's CPU

    @property
    def key(self) -> str:
        """Folder-safe name: ``llvm``, ``cuda-sm_90``."""
        return self.kind if self.arch is None else f"{self.kind}-{self.arch}"

    def tvm_target(self):
        import tvm
        from tvm.target import codegen

        if self.kind == "llvm":
            mcpu = self.mcpu or codegen.llvm_get_system_cpu()
            return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": _cores()})
        return tvm.target.Target({"kind": "cuda", "arch": self.arch},
                                 host={"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})

    def describe(self) -> str:
        if self.kind == "llvm":
            return f"llvm:{self.mcpu}" if self.mcpu else "llvm (this host's CPU)"
        return f"{self.kind}:{self.arch}"

    def dot_isas(self) -> tuple[str, ...]:
        """The integer dot-product ISAs of Kiln's int8 kernels (``lower/kernels/cpu_int8_matmul.py``)
        the target's CPU has, best first: ``avx512_vnni`` (``vpdpbusd``), ``avx2``
        (``vpmaddubsw`` + ``vpmaddwd``)."""
        if self.kind != "llvm":
            return ()
        from tvm.target import codegen

        target = self.tvm_target()
        with target:
            features = set(codegen.llvm_get_cpu_features(target))
        return tuple(name for name, needs in DOT_ISAS.items() if needs <= features)

    @property
    def dot_isa(self) -> str | None:
        """The ISA int8-activation kernels build for on this target (None: they cannot)."""
        return next(iter(self.dot_isas()), None)

    @property
    def int8_dot(self) -> bool:
        return self.dot_isa is not None

    def info(self) -> TargetInfo:
        """What the manifest records (resolved: the concrete CPU name and its features)."""
        from tvm.target import codegen

        target = self.tvm_target()
        if self.kind != "llvm":
            return TargetInfo(kind=self.kind, device="cuda", arch=self.arch)
        mcpu = str(target.attrs["mcpu"])
        with target:
            features = codegen.llvm_get_cpu_features(target)
        flags = tuple(sorted(_CPUINFO_FLAGS[f] for f in features if f in _CPUINFO_FLAGS))
        return TargetInfo(kind="llvm", device="cpu", mcpu=mcpu, cpu_features=flags)


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_target(spec: str) -> TargetSpec:
    text = spec.strip()
    lower = text.lower()
    if lower in ("llvm", "cpu"):
        return TargetSpec("llvm")
    match = re.fullmatch(r"llvm:([A-Za-z0-9_.\-]+)", text)
    if match:
        return TargetSpec("llvm", mcpu=match.group(1))
    match = re.fullmatch(r"cuda(?::(sm_\d+))?", lower)
    if match:
        arch = match.group(1) or DEFAULT_CUDA_ARCH
        if arch not in CUDA_ARCHS:
            raise ValueError(f"target {spec!r}: CUDA arch {arch} is not supported (supported: {', '.join(CUDA_ARCHS)})")
        return TargetSpec("cuda", arch)
    raise ValueError(f"target {spec!r} is not supported (choices: {', '.join(TARGET_CHOICES)})")
