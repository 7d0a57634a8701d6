"""Parse a Hugging Face ``config.json`` into Kiln's ``ModelConfig``.

Foreign configs carry many keys Kiln does not need (dropout, initializer range, ...): they
are tolerated. Keys that change the computation and that Kiln cannot honour (an unknown
architecture, an unsupported RoPE scaling, a non-SiLU activation) are rejected by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kiln.runtime.model_config import ARCHITECTURES, ModelConfig, RopeScaling

from kiln.runtime.errors import UnsupportedModelError

# HF model_type -> Kiln architecture. Mistral and Llama share a computation; Qwen2 adds
# q/k/v biases.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}

# Kiln serves at most this many positions unless the user asks for more: the KV cache
# is sized from it, and few deployments of these models need a longer window.
DEFAULT_CONTEXT_CAP = 8192


def _rope_parameters(cfg: dict) -> tuple[float, RopeScaling | None]:
    """Read RoPE theta and scaling from either the transformers 4 (``rope_theta`` +
    ``rope_scaling``) or the transformers 5 (``rope_parameters``) spelling."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(
            f"config.json: rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    try:
        if kind == "linear":
            return float(theta), RopeScaling(kind="linear", factor=float(merged["factor"]))
        return float(theta), RopeScaling(
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json: rope scaling {kind!r} lacks {missing}") from None


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_hf_config(cfg: dict, context_length: int | None = None) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        archs = cfg.get("architectures") or []
        raise UnsupportedModelError(
            f"config.json: model_type {model_type!r} ({', '.join(archs) or 'no architectures listed'}) "
            f"is not supported; Kiln compiles {', '.join(sorted(MODEL_TYPES))}"
        )
    architecture = MODEL_TYPES[model_type]
    assert architecture in ARCHITECTURES
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act {act!r} is not supported (only silu)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json lacks required key {missing}") from None
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = _rope_parameters(cfg)

    trained = int(cfg.get("max_position_embeddings", 2048))
    window = trained
    sliding = cfg.get("sliding_window")
    uses_sliding = architecture == "mistral" or cfg.get("use_sliding_window", False)
    if uses_sliding and sliding:
        # Kiln attends over the whole context; capping the context at the sliding window
        # makes that exact (no token is ever older than the window).
        window = min(window, int(sliding))
    if context_length is None:
        context_length = min(window, DEFAULT_CONTEXT_CAP)
    elif context_length > window:
        raise ValueError(
            f"context_length {context_length} exceeds the model's window of {window} positions"
        )

    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        context_length=int(context_length),
        qkv_bias=bias or architecture == "qwen2",
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")),
        name=str(cfg.get("_name_or_path", "")),
    )


def load_hf_config(folder: Path, context_length: int | None = None) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{path}: not valid JSON ({err})") from None
    config = parse_hf_config(cfg, context_length)
    if not config.name:
        config = dataclasses.replace(config, name=Path(folder).resolve().name)
    return config
