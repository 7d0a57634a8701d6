"""Runs an artifact's compiled functions: mechanism only (no scheduling, no sampling).

The explicit-KV artifact exposes, by name (checked against the manifest at load):
  prefill(input_ids [B, S], position_ids [B, S], params) -> (logits [B, V], present...)
  decode(input_ids [B, 1], position_ids [B, 1], past..., params) -> (logits [B, V], present...)
with one key and one value tensor [B, Hkv, T, D] per layer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .artifact import LIBRARY_FILE, Manifest, read_params
from .errors import ArtifactError
from .tvm_runtime import VirtualMachine, tvm

REQUIRED_FUNCTIONS = ("prefill", "decode")


class KVState:
    """One batch's explicit KV cache: per layer key, value tensors [B, Hkv, T, D] on device."""

    __slots__ = ("tensors", "length")

    def __init__(self, tensors: list, length: int):
        self.tensors = tensors
        self.length = length


class ExplicitKVExecutor:
    def __init__(self, folder: Path, manifest: Manifest, device):
        self.manifest = manifest
        self.device = device
        missing = [f for f in REQUIRED_FUNCTIONS if f not in manifest.functions]
        if missing:
            raise ArtifactError(f"{folder}: manifest lists no {', '.join(missing)} function")
        try:
            lib = tvm.runtime.load_module(str(Path(folder) / LIBRARY_FILE))
        except Exception as err:  # TVM raises its own error types for unloadable libraries
            raise ArtifactError(f"{folder / LIBRARY_FILE}: cannot be loaded ({err})") from None
        self._vm = VirtualMachine(lib, device)
        self._fns = {}
        for name in manifest.functions:
            try:
                self._fns[name] = self._vm[name]
            except Exception:
                raise ArtifactError(f"{folder / LIBRARY_FILE}: has no compiled function {name!r}") from None
        arrays = read_params(folder, manifest)
        if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
            # Use the memory map in place: no copy, and pages are shared between processes.
            self._params = [tvm.runtime.from_dlpack(a) for a in arrays]
        else:
            self._params = [tvm.runtime.tensor(np.asarray(a), device) for a in arrays]
        self._arrays = arrays  # keeps the memory map alive
        self.num_layers = manifest.model.num_layers

    def _tensor(self, array: np.ndarray):
        return tvm.runtime.tensor(array, self.device)

    def prefill(self, token_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, KVState]:
        """token_ids, positions: [B, S] int64 -> logits [B, V] float32 and the new KV."""
        out = self._fns["prefill"](self._tensor(token_ids), self._tensor(positions), self._params)
        return out[0].numpy(), KVState(list(out)[1:], int(token_ids.shape[1]))

    def decode(self, token_ids: np.ndarray, positions: np.ndarray, kv: KVState) -> tuple[np.ndarray, KVState]:
        """token_ids, positions: [B, 1] int64; kv of length T -> logits [B, V], KV of T + 1."""
        out = self._fns["decode"](self._tensor(token_ids), self._tensor(positions), *kv.tensors, self._params)
        return out[0].numpy(), KVState(list(out)[1:], kv.length + 1)
