"""Which cached sequences hold which prompt prefixes, at page granularity.

A *holder* is a KV-cache sequence kept only to hold the full pages of a prompt prefix
(a system prompt, few-shot examples) after the request that computed them is gone. A new
prompt that starts with the same full pages forks from the holder instead of recomputing
them. The index is a trie whose edges are pages of tokens; each node remembers a holder
that covers it. Holders are evicted least recently used when pages run short.

Plain Python: no TVM, no engine state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    holders: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self, page_size: int, max_holders: int = 64):
        self.page_size = page_size
        self.max_holders = max_holders
        self._root = _Node()
        # holder -> its path from the root: (page, node) per level. LRU order.
        self._holders: OrderedDict[int, list[tuple[tuple[int, ...], _Node]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self) -> list[int]:
        """Holder sequence ids, least recently used first."""
        return list(self._holders)

    def _pages(self, tokens) -> list[tuple[int, ...]]:
        p = self.page_size
        return [tuple(tokens[i:i + p]) for i in range(0, len(tokens) - len(tokens) % p, p)]

    def longest_match(self, tokens, max_length: int) -> tuple[int, int] | None:
        """(holder, length): the holder of the longest cached page-aligned prefix of
        ``tokens`` no longer than ``max_length``, or None."""
        node, best, depth = self._root, None, 0
        for page in self._pages(tokens[:max_length]):
            node = node.children.get(page)
            if node is None:
                break
            depth += 1
            if node.holders:
                best = (next(iter(node.holders)), depth * self.page_size)
        if best is not None:
            self._holders.move_to_end(best[0])
        return best

    def covered(self, tokens) -> int:
        """How many leading tokens of ``tokens`` some holder already covers."""
        node, depth = self._root, 0
        for page in self._pages(tokens):
            node = node.children.get(page)
            if node is None or not node.holders:
                break
            depth += 1
        return depth * self.page_size

    def insert(self, holder: int, tokens) -> None:
        """Register ``holder`` as holding the full pages of ``tokens``."""
        path, node = [], self._root
        for page in self._pages(tokens):
            node = node.children.setdefault(page, _Node())
            node.holders.add(holder)
            path.append((page, node))
        if not path:
            raise ValueError("a holder must cover at least one full page")
        self._holders[holder] = path

    def remove(self, holder: int) -> None:
        """Forget ``holder`` and prune the nodes no holder covers any more: a loop up the
        holder's own path (a prompt of thousands of pages is as deep a trie; no recursion)."""
        path = self._holders.pop(holder)
        for _, node in path:
            node.holders.discard(holder)
        for depth in range(len(path) - 1, -1, -1):
            page, node = path[depth]
            if node.holders or node.children:
                break
            parent = path[depth - 1][1] if depth else self._root
            del parent.children[page]

    def least_recently_used(self) -> int | None:
        return next(iter(self._holders), None)
