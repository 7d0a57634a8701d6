"""RoPE frequency tables (plain numpy, float64 for accuracy at long positions)."""

from __future__ import annotations

import math

import numpy as np

from kiln.runtime.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[head_dim / 2] float64 inverse frequencies, with linear / llama3 scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # llama3: wavelengths longer than original_max / low_freq_factor are divided by factor,
    # shorter than original_max / high_freq_factor kept, and the band between interpolated.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled)


def cos_sin_cache(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [context_length, head_dim / 2] float32, the layout ONNX RotaryEmbedding takes."""
    positions = np.arange(config.context_length, dtype=np.float64)
    angles = np.outer(positions, inverse_frequencies(config))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
