"""Map an artifact's target to a TVM device on this host, or say why it cannot run here."""

from __future__ import annotations

import platform
from pathlib import Path

from .artifact import TargetInfo
from .errors import DeviceError


def host_cpu_flags() -> set[str] | None:
    """/proc/cpuinfo flags of this host, or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def open_device(target: TargetInfo, device_id: int = 0):
    from .tvm_runtime import tvm

    if target.device == "cpu":
        flags = host_cpu_flags()
        if flags is not None and platform.machine() in ("x86_64", "AMD64"):
            missing = sorted(set(target.cpu_features) - flags)
            if missing:
                raise DeviceError(
                    f"this artifact's CPU kernels were built for {target.mcpu} and need "
                    f"{', '.join(missing)}, which this CPU lacks; recompile with --target llvm on this host"
                )
        return tvm.cpu(device_id)
    if target.device == "cuda":
        _load_cuda_backend()
        dev = tvm.cuda(device_id)
        if not dev.exist:
            raise DeviceError(
                f"this artifact targets CUDA ({target.arch}) but no CUDA GPU is visible on this host; "
                "run it on a GPU machine or compile for --target llvm"
            )
        return dev
    raise DeviceError(f"artifact target device {target.device!r} is not supported by this runtime")


def _load_cuda_backend() -> None:
    """A runtime-only TVM does not load its CUDA sidecar library by itself."""
    from tvm import base
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" in base._LOADED_LIBS:
        return
    runtime_dir = Path(base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
    except (OSError, RuntimeError) as err:
        raise DeviceError(
            f"this artifact targets CUDA but TVM's CUDA runtime cannot be loaded here ({err}); "
            "is the NVIDIA driver (libcuda.so.1) installed?"
        ) from None
