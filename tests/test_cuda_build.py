"""CUDA artifacts build here with nvcc and carry real sm_XX machine code; they run only
where a GPU is present."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kiln.runtime.errors import DeviceError

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import nvidia  # nvidia-cuda-cuobjdump wheel

    for root in nvidia.__path__:
        for path in Path(root).glob("cu*/bin/cuobjdump"):
            return str(path)
    pytest.fail("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def _fatbins(library: Path) -> list[bytes]:
    """Every fatbin embedded in a shared library (header: magic, u16 version, u16 header
    size, u64 payload size)."""
    data = library.read_bytes()
    out, pos = [], data.find(FATBIN_MAGIC)
    while pos >= 0:
        _, header, size = struct.unpack_from("<HHQ", data, pos + 4)
        out.append(data[pos:pos + header + size])
        pos = data.find(FATBIN_MAGIC, pos + header + size)
    return out


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_artifact_carries_sass_for_its_arch(compiled, tmp_path, arch):
    folder = compiled("llama", f"cuda:{arch}")
    library = folder / "model.so"
    fatbins = _fatbins(library)
    assert fatbins, "no fatbin in model.so"
    assert b"__global__" not in library.read_bytes(), "CUDA source was shipped instead of machine code"
    tool = _cuobjdump()
    elves = []
    for i, blob in enumerate(fatbins):
        path = tmp_path / f"k{i}.fatbin"
        path.write_bytes(blob)
        listing = subprocess.run([tool, "--list-elf", str(path)], capture_output=True, text=True, check=True).stdout
        elves += [line for line in listing.splitlines() if ".cubin" in line]
    assert elves and all(f".{arch}." in e for e in elves), elves
    from kiln.runtime.artifact import load_manifest

    m = load_manifest(folder)
    assert (m.target.kind, m.target.arch, m.target.device) == ("cuda", arch, "cuda")


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


@pytest.mark.skipif(_has_gpu(), reason="this host has a GPU")
def test_cuda_artifact_on_a_host_without_gpu_is_a_clear_error(compiled):
    from kiln.runtime.engine import Engine

    with pytest.raises(DeviceError, match="CUDA"):
        Engine.load(compiled("llama", "cuda:sm_90"))


@pytest.mark.gpu
def test_cuda_artifact_generates_like_the_cpu_artifact(compiled):
    from kiln.runtime.engine import Engine

    cpu = Engine.load(compiled("llama", "llvm")).generate("The quick brown fox", max_tokens=16, ignore_eos=True)
    gpu = Engine.load(compiled("llama", "cuda:sm_90")).generate("The quick brown fox", max_tokens=16, ignore_eos=True)
    assert gpu.token_ids == cpu.token_ids


def test_quantized_cuda_artifact_builds(checkpoint, tmp_path):
    """int4 weights for sm_90: the dequantizing kernels keep the plain form GPU rules
    schedule (the CPU's padded row tiles and float32 panels are CPU-only), and the params
    keep their storage: packed nibbles, float16 scales, float32 weights nowhere as panels."""
    from kiln.compiler.compile import CompileOptions, compile_model
    from kiln.compiler.targets import parse_target
    from kiln.runtime.artifact import load_manifest
    from kiln.runtime.quantization import parse_quant

    folder = compile_model(checkpoint("llama"), tmp_path / "artifact",
                           CompileOptions(parse_target("cuda:sm_90"), quant=parse_quant("int4-g32")))
    m = load_manifest(folder)
    assert m.quantization == "int4-g32" and m.target.arch == "sm_90"
    assert any(p.dtype == "uint8" for p in m.params)
    assert all(len(p.shape) <= 2 for p in m.params)
    assert _fatbins(folder / "model.so")
