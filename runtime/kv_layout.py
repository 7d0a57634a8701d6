"""How one cached token's keys and values are stored: the KV dtype as 32-bit words.

TVM's paged KV cache takes one element dtype for its pages *and* for the q / k / v / output
tensors it is handed, so a float16 or int8 cache cannot sit beside float32 queries as
such. Kiln declares every cache as float32 *words* and keeps the real format inside them:

    dtype     words per head row (D = head_dim)      bytes per token per layer
    float32   D                                      2 * Hkv * 4D
    float16   D / 2   (two float16 a word)            2 * Hkv * 2D
    int8      D / 4 + 1  (four int8 a word, then      2 * Hkv * (D + 4)
              the row's float32 scale)

int8 rows are symmetric per token and head: ``x ~= scale * int8`` with
``scale = max|x| / 127`` (a new token never rescales cached ones; per-channel key scales
as KIVI uses would need the whole sequence, or a calibration, up front). The graph packs
k / v into words before the cache appends them; Kiln's CPU attention kernels read the
words back as float16 / int8 (no float copy of the cache is ever made). A query head
(D float32) is handed to the cache as ``q_split`` rows of ``words`` (the last padded), so
the declared query-head count is ``num_heads * q_split``; the output comes back the same way.

Pure Python and numpy: the runtime sizes caches and decodes ``read_kv`` with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KV_DTYPES = ("float32", "float16", "int8")
INT8_MAX = 127


@dataclass(frozen=True)
class KVLayout:
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        if self.dtype != "float32" and self.head_dim % 4:
            raise ValueError(f"kv_dtype {self.dtype} needs a head_dim divisible by 4, got {self.head_dim}")

    @classmethod
    def of(cls, model, dtype: str = "float32") -> "KVLayout":
        return cls(dtype, model.num_heads, model.num_kv_heads, model.head_dim)

    @property
    def words(self) -> int:
        """32-bit words per (token, KV head) row: the cache's declared head dim."""
        d = self.head_dim
        return {"float32": d, "float16": d // 2, "int8": d // 4 + 1}[self.dtype]

    @property
    def q_split(self) -> int:
        """Rows of ``words`` one query head (head_dim float32) takes."""
        return -(-self.head_dim // self.words)

    @property
    def q_stride(self) -> int:
        """float32 words a query / output head takes in the cache's tensors (head_dim + pad)."""
        return self.q_split * self.words

    @property
    def cache_q_heads(self) -> int:
        return self.num_heads * self.q_split

    @property
    def elems_per_word(self) -> int:
        return {"float32": 1, "float16": 2, "int8": 4}[self.dtype]

    def bytes_per_token(self, num_layers: int) -> int:
        return num_layers * 2 * self.num_kv_heads * self.words * 4

    def to_dict(self, num_layers: int) -> dict:
        return {"dtype": self.dtype, "words_per_head": self.words, "bytes_per_token": self.bytes_per_token(num_layers)}

    # numpy reference of the stored form (tests, ``KVCache.read_kv``)
    def encode(self, x: np.ndarray) -> np.ndarray:
        """[..., head_dim] float -> [..., words] float32 words, as the graph packs them."""
        x = np.asarray(x, dtype=np.float32)
        if self.dtype == "float32":
            return x.copy()
        if self.dtype == "float16":
            return np.ascontiguousarray(x.astype(np.float16)).view(np.float32)
        scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(INT8_MAX)
        inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
        q = np.clip(np.rint(x * inv), -INT8_MAX, INT8_MAX).astype(np.int8)
        return np.concatenate([np.ascontiguousarray(q).view(np.float32), scale.astype(np.float32)], axis=-1)

    def decode(self, words: np.ndarray) -> np.ndarray:
        """[..., words] float32 words -> [..., head_dim] float32 values."""
        words = np.ascontiguousarray(words, dtype=np.float32)
        if self.dtype == "float32":
            return words.copy()
        if self.dtype == "float16":
            return words.view(np.float16).astype(np.float32)
        data = np.ascontiguousarray(words[..., :-1]).view(np.int8).astype(np.float32)
        return data * words[..., -1:]
