"""Kiln's own PyTorch definition of the Llama family (Llama 2/3, Qwen2, Mistral).

One module serves two purposes:
* eager reference (plain torch ops), checked against transformers in the parity tests;
* ONNX export: with ``export_ops=True`` RoPE and attention go through ``torch.onnx.ops``
  so the exported graph carries the standard opset-23 ``RotaryEmbedding`` and
  ``Attention`` nodes (with explicit ``past_key``/``present_key``), which the compiler's
  passes rewrite and its lowering converts, instead of a soup of gathers and matmuls.

Shapes: B batch, S new tokens, P past tokens, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.model_config import ModelConfig

from .rope import cos_sin_cache

KV = tuple[torch.Tensor, torch.Tensor]  # key, value: [B, Hkv, P, D] each


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm exports as ONNX RMSNormalization (opset 23).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.export_ops = False

    def forward(self, x, position_ids, cos, sin, past: KV | None):
        # x: [B, S, hidden]; position_ids: [B, S]; cos/sin: [context, D/2]
        c = self.config
        q = self.q_proj(x)  # [B, S, H*D]
        k = self.k_proj(x)  # [B, S, Hkv*D]
        v = self.v_proj(x)
        if self.export_ops:
            q = torch.onnx.ops.rotary_embedding(q, cos, sin, position_ids, num_heads=c.num_heads)
            k = torch.onnx.ops.rotary_embedding(k, cos, sin, position_ids, num_heads=c.num_kv_heads)
            past_k, past_v = past if past is not None else (None, None)
            y, present_k, present_v, _ = torch.onnx.ops.attention(
                q, k, v, past_key=past_k, past_value=past_v,
                is_causal=past is None, q_num_heads=c.num_heads, kv_num_heads=c.num_kv_heads,
            )
            return self.o_proj(y), (present_k, present_v)

        b, s, _ = x.shape
        q = q.view(b, s, c.num_heads, c.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = k.view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin, position_ids), _rotate(k, cos, sin, position_ids)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)  # [B, Hkv, P+S, D]
            v = torch.cat([past[1], v], dim=2)
        # Causal over the new tokens, full over the past (bottom-right aligned).
        p = k.shape[2] - s
        mask = None
        if s > 1:
            mask = torch.ones(s, p + s, dtype=torch.bool, device=x.device).tril(p)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, s, c.q_size)
        return self.o_proj(y), (k, v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor):
    """Half-split ("rotate_half") RoPE. x: [B, heads, S, D]; position_ids: [B, S]."""
    c = cos[position_ids].unsqueeze(1)  # [B, 1, S, D/2]
    s = sin[position_ids].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, position_ids, cos, sin, past):
        attn, present = self.self_attn(self.input_layernorm(x), position_ids, cos, sin, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the HF checkpoints (``model.layers.0.self_attn.q_proj.weight``)
    so safetensors load by name."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = cos_sin_cache(config)
        self.register_buffer("rope_cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("rope_sin", torch.from_numpy(sin), persistent=False)

    def set_export_ops(self, enabled: bool) -> None:
        for layer in self.model.layers:
            layer.self_attn.export_ops = enabled

    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        position_ids: torch.Tensor,  # [B, S] int64
        past: list[KV] | None = None,  # per layer, [B, Hkv, P, D]
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Returns logits ([B, V] for the last position, or [B, S, V] with ``all_logits``)
        and each layer's present key/value ([B, Hkv, P+S, D])."""
        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        presents = []
        for i, layer in enumerate(self.model.layers):
            x, present = layer(x, position_ids, self.rope_cos, self.rope_sin,
                               None if past is None else past[i])
            presents.append(present)
        if not all_logits:
            x = x[:, -1, :]  # [B, hidden]: generation needs only the next-token logits
        logits = F.linear(self.model.norm(x), self.lm_head_weight())
        return logits, presents
