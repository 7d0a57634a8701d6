"""A model from one GGUF file: config from its metadata, float weights, and a tokenizer.

GGUF stores weights quantized (Q4_1, Q8_0, ...); Kiln dequantizes them to float32 with
the ``gguf`` package (numpy only) and re-quantizes later in its own passes if asked.
llama.cpp reorders the rows of Q and K of ``llama`` models for its interleaved RoPE
layout; Kiln's model uses the HF half-split layout, so those rows are permuted back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from kiln.runtime.errors import UnsupportedModelError
from kiln.runtime.model_config import ModelConfig

from .hf_config import DEFAULT_CONTEXT_CAP
from .tokenizer_files import TokenizerFiles

# GGUF general.architecture -> Kiln architecture
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}

# Per-layer tensor names: GGUF suffix -> HF suffix under model.layers.N.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFModel:
    """Reads a GGUF file lazily: ``config`` from metadata at construction, ``weights()``
    and ``tokenizer_files()`` on demand."""

    def __init__(self, path: Path, context_length: int | None = None):
        import gguf  # compiler-only dependency

        self.path = Path(path)
        if not self.path.is_file():
            raise UnsupportedModelError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as err:  # gguf raises ValueError/struct errors for bad files
            raise UnsupportedModelError(f"{self.path}: not a readable GGUF file ({err})") from None
        self._gguf = gguf
        self.config = self._parse_config(context_length)

    # -- metadata ---------------------------------------------------------------------
    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _require(self, key: str):
        value = self._field(key)
        if value is None:
            raise UnsupportedModelError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def _parse_config(self, context_length: int | None) -> ModelConfig:
        arch = self._require("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
            )
        p = f"{arch}."
        hidden = int(self._require(p + "embedding_length"))
        heads = int(self._require(p + "attention.head_count"))
        head_dim = int(self._field(p + "attention.key_length", hidden // heads))
        rope_dim = int(self._field(p + "rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModelError(f"{self.path}: partial RoPE ({rope_dim} of {head_dim}) is not supported")
        if self._field(p + "rope.scaling.type", "none") not in ("none",):
            raise UnsupportedModelError(f"{self.path}: GGUF RoPE scaling is not supported yet")
        tokens = self._require("tokenizer.ggml.tokens")
        vocab = int(self._field(p + "vocab_size", len(tokens)))
        names = {t.name for t in self._reader.tensors}
        trained = int(self._field(p + "context_length", 2048))
        if context_length is None:
            context_length = min(trained, DEFAULT_CONTEXT_CAP)
        elif context_length > trained:
            raise ValueError(f"context_length {context_length} exceeds the model's window of {trained}")
        eos = self._field("tokenizer.ggml.eos_token_id")
        bos = self._field("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._require(p + "feed_forward_length")),
            num_layers=int(self._require(p + "block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(p + "attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._require(p + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._field(p + "rope.freq_base", 10000.0)),
            context_length=int(context_length),
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
            name=str(self._field("general.name", self.path.stem)),
        )

    # -- weights ----------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for tensor in self._reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                raise UnsupportedModelError(f"{self.path}: unknown GGUF tensor {tensor.name!r}")
            array = self._gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
            if self._reader_arch() == "llama":
                if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                    array = unpermute_rope_rows(array, self.config.num_heads)
                elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                    array = unpermute_rope_rows(array, self.config.num_kv_heads)
            out[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        return out

    def _reader_arch(self) -> str:
        return self._require("general.architecture")

    # -- tokenizer --------------------------------------------------------------------
    def tokenizer_files(self) -> TokenizerFiles:
        model = self._require("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"{self.path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens = list(self._require("tokenizer.ggml.tokens"))
        merges = list(self._require("tokenizer.ggml.merges"))
        types = list(self._field("tokenizer.ggml.token_type", [1] * len(tokens)))
        pre = self._field("tokenizer.ggml.pre", "default")
        bos = self._field("tokenizer.ggml.bos_token_id")
        eos = self._field("tokenizer.ggml.eos_token_id")
        add_bos = bool(self._field("tokenizer.ggml.add_bos_token", False))
        bos_token = tokens[int(bos)] if add_bos and bos is not None else None
        tokenizer_json = byte_level_bpe_json(tokens, merges, types, pre, bos_token)
        tokenizer_config = {
            "chat_template": self._field("tokenizer.chat_template"),
            "bos_token": None if bos is None else tokens[int(bos)],
            "eos_token": None if eos is None else tokens[int(eos)],
            "add_bos_token": add_bos,
        }
        return TokenizerFiles(tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Per head it stores rows as (D/2, 2) pairs
    interleaved; HF keeps (2, D/2) halves. weight: [heads * D, ...] -> same shape."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# llama.cpp pre-tokenizer names -> HF pre_tokenizer. Each splits text before byte-level BPE.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("smollm", "starcoder", "refact"):
        # digits split one by one, then GPT-2's byte-level regex
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("llama3", "llama-bpe", "smaug-bpe", "qwen2"):
        regex = _LLAMA3_REGEX
        if pre == "qwen2":
            regex = regex.replace(r"\p{N}{1,3}", r"\p{N}")
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False}]}
    raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported")


def byte_level_bpe_json(
    tokens: list[str], merges: list[str], types: list[int], pre: str, bos_token: str | None = None
) -> str:
    """A ``tokenizers`` JSON for a GGUF byte-level BPE vocabulary. Token type 3 (control)
    and 4 (user-defined) become added tokens, matched whole before BPE; ``bos_token``, when
    given, is prepended to every encoded prompt."""
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == 3}
        for i, tok in enumerate(tokens) if types[i] in (3, 4)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(pre),
        "post_processor": None if bos_token is None else {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [tokens.index(bos_token)],
                                           "tokens": [bos_token]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": pre in ("llama3", "llama-bpe", "smaug-bpe"),
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    return json.dumps(spec, ensure_ascii=False)
