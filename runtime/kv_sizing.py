"""How many tokens a KV cache is made for, and what its pages cost.

TVM's paged cache made for ``tokens`` (its ``max_total_seq_len``) holds
ceil(tokens / page_size) + 1 pages (``cache_pages``), and the scheduler admits against all
of them. One cached token costs ``bytes_per_token`` over all layers (keys and values):
the manifest says so, or ``KVLayout`` works it out for artifacts made before it did.

A cache is sized from a token count (``tokens_for``: grown until one full-context
sequence fits above the watermark) or from a memory budget (``tokens_in_budget``: the
whole pages the budget holds, TVM's extra page included, so the pages never take more
than the budget; refused when that is less than the smallest cache ``tokens_for`` makes).

    budget 1 MiB, 512 B/token, 16-token pages  ->  1 MiB // 512 // 16 = 128 pages
                                                -> tokens = (128 - 1) * 16 = 2,032
                                                -> TVM: ceil(2,032 / 16) + 1 = 128 pages

Pure arithmetic on plain values (no TVM): the engine, ``kiln inspect`` and tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .errors import ArtifactError, ConfigError
from .kv_budget import OPTION
from .kv_layout import KVLayout
from .model_config import ModelConfig

GIB = 1 << 30


def kv_dtype(kv_cache: Mapping) -> str:
    """The manifest's KV dtype; artifacts made before KV dtypes hold float32."""
    return str(kv_cache.get("dtype", "float32"))


def kv_bytes_per_token(model: ModelConfig, kv_cache: Mapping) -> int:
    """Bytes one cached token takes over all layers: the manifest's ``bytes_per_token``,
    or (older manifests) what ``KVLayout`` says for its dtype and the model's geometry."""
    stated = kv_cache.get("bytes_per_token")
    if stated is not None:
        if not isinstance(stated, int) or isinstance(stated, bool) or stated < 1:
            raise ArtifactError(f"manifest.json: kv_cache.bytes_per_token must be a positive integer, got {stated!r}")
        return stated
    try:
        return KVLayout.of(model, kv_dtype(kv_cache)).bytes_per_token(model.num_layers)
    except ValueError as err:
        raise ArtifactError(f"manifest.json: kv_cache ({err})") from None


def cache_pages(tokens: int, page_size: int) -> int:
    """Pages of TVM's cache made for ``tokens`` (create_kv_cache's max_total_seq_len)."""
    return -(-tokens // page_size) + 1


def tokens_for(requested: int, context_length: int, page_size: int, watermark: float) -> int:
    """The cache's tokens for ``requested``: at least one full-context sequence and a page,
    grown until that sequence (its pages plus one) fits above the watermark."""
    pages_for_context = -(-context_length // page_size) + 1
    total = max(requested, context_length + page_size)
    while True:
        total_pages = cache_pages(total, page_size)
        usable = total_pages - int(total_pages * watermark)
        if usable >= pages_for_context:
            return total
        total += (pages_for_context - usable) * page_size


def tokens_in_budget(budget: int, bytes_per_token: int, page_size: int, context_length: int,
                     watermark: float) -> int:
    """The cache's tokens for a budget of ``budget`` bytes: its pages, TVM's extra page
    included, are the whole pages the budget holds. ConfigError (with the minimum) when
    those are fewer than one full-context sequence needs above the watermark."""
    page_bytes = bytes_per_token * page_size
    pages = budget // page_bytes
    least = cache_pages(tokens_for(1, context_length, page_size, watermark), page_size)
    if pages < least:
        raise ConfigError(OPTION, f"{budget:,} bytes hold {pages:,} KV pages of {page_size} tokens "
                                  f"({bytes_per_token:,} B/token), but one {context_length:,}-token sequence "
                                  f"needs {least:,} pages above the watermark: at least {least * page_bytes:,} bytes")
    # Monotone: usable pages never shrink as pages grow (watermark < 0.5), so >= least fits.
    return (pages - 1) * page_size


def sequences_per_gib(bytes_per_token: int, context_length: int) -> float:
    """Full-context sequences one GiB of KV cache holds."""
    return GIB / (bytes_per_token * context_length)


def binary_size(nbytes: int) -> str:
    """1536 -> "1.50 KiB" (log lines; exact byte counts sit beside it)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class KVCapacity:
    """What the engine's KV cache holds: ``pages`` of ``page_size`` tokens, each token
    ``bytes_per_token`` of ``dtype`` KV; ``budget``: the memory budget it was sized from
    (bytes), None when sized by tokens."""

    dtype: str
    bytes_per_token: int
    page_size: int
    pages: int
    context_length: int
    budget: int | None = None

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def full_context_sequences(self) -> int:
        return self.tokens // self.context_length

    def describe(self) -> str:
        budget = "" if self.budget is None else f" of a {binary_size(self.budget)} budget"
        return (f"KV cache {self.dtype}, {self.bytes_per_token:,} B/token: {binary_size(self.bytes)}{budget} "
                f"({self.bytes:,} bytes), {self.tokens:,} tokens in {self.pages:,} pages of "
                f"{self.page_size}, {self.full_context_sequences:,} full-context sequences of "
                f"{self.context_length:,} tokens")
