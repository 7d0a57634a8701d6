"""Typed KV-cache operations: what the scheduler asks of the cache, applied by the engine
core in order (before a step's forward for admissions and evictions, after it for forks of
n > 1 samples and prefix holders)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AddSeq:
    """A new, empty sequence."""

    seq_id: int


@dataclass(frozen=True)
class ForkSeq:
    """``child`` shares ``parent``'s first ``position`` tokens (full pages shared, a
    partial page copied)."""

    child: int
    parent: int
    position: int


@dataclass(frozen=True)
class RemoveSeq:
    """Drop a sequence; pages no other sequence refers to become free."""

    seq_id: int


KVOp = AddSeq | ForkSeq | RemoveSeq


def apply_ops(cache, ops) -> None:
    """Apply ``ops`` to a cache with ``add`` / ``fork`` / ``remove`` (TVM's, or a fake)."""
    for op in ops:
        match op:
            case AddSeq(seq_id):
                cache.add(seq_id)
            case ForkSeq(child, parent, position):
                cache.fork(parent, child, position)
            case RemoveSeq(seq_id):
                cache.remove(seq_id)
            case _:
                raise TypeError(f"not a KV operation: {op!r}")
