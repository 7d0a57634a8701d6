"""Runs an artifact's compiled functions over TVM's paged KV cache: mechanism only (no
scheduling, no sampling).

The artifact exposes, by name (checked against the manifest at load):
  create_kv_cache(Shape[max_batch_size, max_total_seq_len, prefill_chunk_size,
                        page_size, support_sliding_window]) -> kv cache object
  prefill(input_ids [1, T], position_ids [1, T], logit_positions [N], kv, params)
      -> (logits [N, V],)   ragged: the new tokens of several sequences, concatenated
  decode(input_ids [B, 1], position_ids [B, 1], kv, params) -> (logits [B, V],)
A decode step of more sequences than the manifest's ``dispatch.decode_max_batch`` runs
through ``prefill`` instead (the same tokens as one ragged batch), and one of exactly N
sequences through ``decode_b<N>`` when the artifact has that static bucket (see ``Dispatch``).
Which sequence each token belongs to is the cache's state for the step
(``kv_state_begin_forward``); the cache owns pages, copies and attention kernels.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .artifact import LIBRARY_FILE, Manifest, prefill_bucket_name, read_params
from .errors import ArtifactError
from .kv_layout import KVLayout
from .tvm_runtime import VirtualMachine, tvm

REQUIRED_FUNCTIONS = ("create_kv_cache", "prefill", "decode")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of one KV cache. ``max_batch_size``: sequences per forward;
    ``max_total_tokens``: KV slots over all sequences (pages = ceil(tokens / page_size));
    ``prefill_chunk_size``: tokens per forward."""

    max_batch_size: int
    max_total_tokens: int
    prefill_chunk_size: int
    page_size: int

    def __post_init__(self):
        for name in ("max_batch_size", "max_total_tokens", "prefill_chunk_size", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Chunk:
    """``tokens`` of sequence ``seq_id`` at positions ``start ..``; logits are returned for
    the chunk offsets in ``logits_at`` (default: its last token)."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    logits_at: tuple[int, ...] | None = None

    def logit_offsets(self) -> tuple[int, ...]:
        return (len(self.tokens) - 1,) if self.logits_at is None else self.logits_at


class _Builtins:
    """TVM's KV-state builtins, looked up once."""

    def __init__(self):
        g = tvm.get_global_func
        self.add = g("vm.builtin.kv_state_add_sequence")
        self.remove = g("vm.builtin.kv_state_remove_sequence")
        self.fork = g("vm.builtin.kv_state_fork_sequence")
        self.popn = g("vm.builtin.kv_state_popn")
        self.clear = g("vm.builtin.kv_state_clear")
        self.begin = g("vm.builtin.kv_state_begin_forward")
        self.end = g("vm.builtin.kv_state_end_forward")
        self.available = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self.debug_get_kv = g("vm.builtin.attention_kv_cache_debug_get_kv")
        self.total_length = g("vm.builtin.attention_kv_cache_get_total_sequence_length")


class KVCache:
    """One paged KV cache object with its sequence operations (thin wrappers: TVM checks
    its own invariants and raises on misuse)."""

    def __init__(self, handle, builtins: _Builtins, config: CacheConfig, device, layout: KVLayout):
        self.handle, self._b, self.config, self.device, self.layout = handle, builtins, config, device, layout
        self.total_pages = int(builtins.available(handle))

    def add(self, seq_id: int) -> None:
        self._b.add(self.handle, seq_id)

    def remove(self, seq_id: int) -> None:
        self._b.remove(self.handle, seq_id)

    def fork(self, parent: int, child: int, position: int) -> None:
        """``child`` shares ``parent``'s first ``position`` tokens (full pages shared,
        a partial page copied)."""
        self._b.fork(self.handle, parent, child, position)

    def popn(self, seq_id: int, n: int) -> None:
        self._b.popn(self.handle, seq_id, n)

    def clear(self) -> None:
        self._b.clear(self.handle)

    def available_pages(self) -> int:
        return int(self._b.available(self.handle))

    def read_kv(self, seq_id: int, length: int, model) -> tuple[np.ndarray, np.ndarray]:
        """A sequence's cached keys and values (for verification), decoded from the stored
        form: two [num_layers, length, num_kv_heads, head_dim] float32 arrays."""
        shape = (model.num_layers, length, model.num_kv_heads, self.layout.words)
        k = tvm.runtime.empty(shape, "float32", self.device)
        v = tvm.runtime.empty(shape, "float32", self.device)
        self._b.debug_get_kv(self.handle, seq_id, 0, length, k, v)
        return self.layout.decode(k.numpy()), self.layout.decode(v.numpy())


class PagedExecutor:
    def __init__(self, folder: Path, manifest: Manifest, device):
        self.manifest = manifest
        self.device = device
        missing = [f for f in (*REQUIRED_FUNCTIONS, *manifest.dispatch.function_names())
                   if f not in manifest.functions]
        if missing:
            raise ArtifactError(
                f"{folder}: artifact lacks the function(s) {', '.join(missing)} that its manifest "
                "needs (built by an older Kiln, or a manifest edited by hand?); recompile it")
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
        self._builtins = _Builtins()
        self.page_size = int(manifest.kv_cache["page_size"])
        self.kv_layout = KVLayout.of(manifest.model, manifest.kv_cache.get("dtype", "float32"))
        self._prefill_buckets = {prefill_bucket_name(t): t for t in manifest.dispatch.static_prefill}

    def create_cache(self, config: CacheConfig) -> KVCache:
        if config.page_size != self.page_size:
            raise ValueError(f"page_size: this artifact's kernels use {self.page_size}-token pages")
        shape = tvm.runtime.ShapeTuple([config.max_batch_size, config.max_total_tokens,
                                        config.prefill_chunk_size, config.page_size, 0])
        return KVCache(self._fns["create_kv_cache"](shape), self._builtins, config, self.device, self.kv_layout)

    def _tensor(self, array: np.ndarray):
        return tvm.runtime.tensor(array, self.device)

    def route(self, chunks: Sequence[Chunk]) -> str:
        """The function ``forward`` runs for these chunks: "prefill", "decode" or a static
        bucket "decode_b<N>" ("prefill" may run in static pieces: ``Dispatch.prefill_plan``)."""
        if any(len(c.tokens) != 1 for c in chunks):
            return "prefill"
        limit = self.manifest.dispatch.decode_max_batch
        if limit is not None and len(chunks) > limit:
            return "prefill"
        return self.manifest.dispatch.static_function(len(chunks)) or "decode"

    def forward(self, cache: KVCache, chunks: Sequence[Chunk], via: str | None = None) -> np.ndarray:
        """Append every chunk's tokens to its sequence and return the requested logits,
        [sum of len(logit_offsets)] x vocab, in chunk order. ``via`` forces one function for
        the whole step ("decode" and its buckets need one token per chunk, a prefill bucket
        exactly its token count, "prefill" is then the dynamic function alone; benchmarks and
        tests compare the routes). Without it a prefill runs in ``Dispatch.prefill_plan``'s
        pieces: static buckets first, the remainder through ``prefill``."""
        if via is not None:
            self._check_via(via, chunks)
        context = self.manifest.model.context_length
        for c in chunks:  # positions past the context index past the RoPE tables: refuse, never run
            if c.start + len(c.tokens) > context:
                raise ValueError(f"sequence {c.seq_id}: positions up to {c.start + len(c.tokens) - 1} exceed the "
                                 f"artifact's context of {context} tokens")
        if not chunks:
            return np.zeros((0, self.manifest.model.vocab_size), dtype=np.float32)
        total = sum(len(c.tokens) for c in chunks)
        if via is None:
            via = self.route(chunks)
            if via == "prefill" and all(_ascending(c.logit_offsets()) for c in chunks):
                return self._prefill_pieces(cache, chunks, self.manifest.dispatch.prefill_plan(total))
        if via == "prefill" or via in self._prefill_buckets:
            return self._prefill_pieces(cache, chunks, [(via, total)])
        return self._decode(cache, chunks, via)

    def _check_via(self, via: str, chunks: Sequence[Chunk]) -> None:
        dispatch = self.manifest.dispatch
        if via not in ("prefill", "decode", *dispatch.function_names()):
            raise ValueError(f"via must be 'prefill', 'decode' or one of this artifact's buckets "
                             f"{sorted(dispatch.function_names())}, got {via!r}")
        total = sum(len(c.tokens) for c in chunks)
        if via in self._prefill_buckets:
            if total != self._prefill_buckets[via]:
                raise ValueError(f"{via} runs exactly {self._prefill_buckets[via]} tokens, got {total}")
        elif via != "prefill":
            if any(len(c.tokens) != 1 for c in chunks):
                raise ValueError(f"{via} runs one token per sequence")
            if via != "decode" and via != dispatch.static_function(len(chunks)):
                raise ValueError(f"{via} runs a batch of exactly its size, got {len(chunks)} sequences")

    def _decode(self, cache: KVCache, chunks: Sequence[Chunk], via: str) -> np.ndarray:
        ids = np.asarray([[c.tokens[0]] for c in chunks], dtype=np.int64)
        pos = np.asarray([[c.start] for c in chunks], dtype=np.int64)
        with self._step(cache, chunks):
            logits = self._fns[via](self._tensor(ids), self._tensor(pos), cache.handle, self._params)[0]
        rows = [i for i, c in enumerate(chunks) if c.logit_offsets()]
        out = logits.numpy()
        return out if len(rows) == len(chunks) else out[rows]

    def _prefill_pieces(self, cache: KVCache, chunks: Sequence[Chunk], plan: list[tuple[str, int]]) -> np.ndarray:
        """Run the chunks' tokens, in order, as ``plan``'s (function, token count) pieces: a
        chunk may be cut between two pieces (its second part then attends to the first
        through the cache, as in chunked prefill). Each chunk's logit offsets ascend, so the
        pieces' logits, concatenated, come in the chunks' order."""
        if len(plan) == 1:
            return self._prefill(cache, chunks, plan[0][0])
        pieces = _cut(chunks, [n for _, n in plan])
        return np.concatenate([self._prefill(cache, piece, fn) for piece, (fn, _) in zip(pieces, plan)])

    def _prefill(self, cache: KVCache, chunks: Sequence[Chunk], fn: str) -> np.ndarray:
        ids = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64)[None]
        pos = np.concatenate([np.arange(c.start, c.start + len(c.tokens), dtype=np.int64)
                              for c in chunks])[None]
        offsets, base = [], 0
        for c in chunks:
            offsets.extend(base + o for o in c.logit_offsets())
            base += len(c.tokens)
        wanted = bool(offsets)
        if not wanted:
            offsets = [base - 1]  # the graph needs at least one row; discarded below
        with self._step(cache, chunks):
            logits = self._fns[fn](self._tensor(ids), self._tensor(pos),
                                   self._tensor(np.asarray(offsets, dtype=np.int64)),
                                   cache.handle, self._params)[0].numpy()
        return logits if wanted else logits[:0]

    @contextlib.contextmanager
    def _step(self, cache: KVCache, chunks: Sequence[Chunk]):
        """The cache's state for one forward: which sequence each token belongs to."""
        b = self._builtins
        b.begin(cache.handle, tvm.runtime.ShapeTuple([c.seq_id for c in chunks]),
                tvm.runtime.ShapeTuple([len(c.tokens) for c in chunks]))
        try:
            yield
        finally:
            b.end(cache.handle)


def _ascending(offsets: tuple[int, ...]) -> bool:
    return all(a < b for a, b in zip(offsets, offsets[1:]))


def _cut(chunks: Sequence[Chunk], sizes: list[int]) -> list[list[Chunk]]:
    """The chunks' tokens cut, in order, into pieces of ``sizes`` tokens. Each part keeps
    the logit offsets that fall in it (ascending), so the pieces' logits, concatenated,
    are the uncut call's rows in order."""
    pieces = []
    i, taken = 0, 0  # the next chunk, and how many of its tokens earlier pieces took
    for size in sizes:
        piece = []
        while size:
            c = chunks[i]
            n = min(size, len(c.tokens) - taken)
            at = tuple(o - taken for o in c.logit_offsets() if taken <= o < taken + n)
            piece.append(Chunk(c.seq_id, c.tokens[taken:taken + n], c.start + taken, at))
            size -= n
            taken += n
            if taken == len(c.tokens):
                i, taken = i + 1, 0
        pieces.append(piece)
    return pieces
