"""The model family's configuration: one frozen dataclass shared by compiler and runtime.

The compiler parses a foreign config (HF ``config.json`` or GGUF metadata) into
``ModelConfig`` once; the artifact's manifest stores ``to_dict()`` and the runtime reads it
back with ``from_dict()``. Nothing else passes dicts of model options around.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``linear`` divides positions by ``factor``; ``llama3`` is the
    Llama 3.1 piecewise rescale of wavelengths (low / high frequency bands)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"rope_scaling.kind: {self.kind!r} is not supported (supported: {', '.join(ROPE_SCALING_KINDS)})"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family transformer (Llama 2/3, Qwen2, Mistral).

    ``context_length`` is the longest sequence the artifact serves (prompt + output); it
    never exceeds the model's trained window (or Mistral's sliding window, so that full
    attention is exact).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "context_length"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        for token in self.eos_token_ids + ((self.bos_token_id,) if self.bos_token_id is not None else ()):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"special token id {token} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_context_length(self, context_length: int) -> "ModelConfig":
        return dataclasses.replace(self, context_length=context_length)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config has unknown fields: {', '.join(unknown)}")
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)
