"""Weights from a Hugging Face folder of ``*.safetensors`` shards, as float32 tensors
named like Kiln's module (which follows the HF names)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kiln.runtime.errors import UnsupportedModelError


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{folder}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name).to(torch.float32)
        except Exception as err:  # safetensors raises its own error types
            raise UnsupportedModelError(f"{path}: unreadable safetensors file ({err})") from None
    return weights
