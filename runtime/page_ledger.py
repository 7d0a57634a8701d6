"""Page bookkeeping that mirrors TVM's paged KV cache, in plain Python.

The scheduler must never ask the cache for a page it does not have (TVM aborts the step),
so it predicts every step's page use with this ledger. The rules follow
``src/runtime/vm/paged_kv_cache.cc``:

* a sequence of length L holds ceil(L / P) pages (P = page size);
* appending n tokens takes ceil((L + n) / P) - ceil(L / P) new pages;
* fork(parent, child, pos) shares the parent's first floor(pos / P) full pages with the
  child and copies a trailing partial page (pos % P tokens) into one new page;
* a page returns to the free list when no sequence refers to it.

Partial pages are never shared, so an append never writes a shared page. Allocation
returns the pages it took, or None when there are too few (nothing changes then).

    seq A (len 37, P = 16):   [p0 full][p1 full][p2 5/16]
    fork(A, B, pos=32):   B = [p0][p1]            (shared, refcount 2)
    fork(A, C, pos=37):   C = [p0][p1][p3 copy of p2's 5 tokens]
"""

from __future__ import annotations


class PageLedger:
    def __init__(self, total_pages: int, page_size: int):
        if total_pages < 1 or page_size < 1:
            raise ValueError("total_pages and page_size must be positive")
        self.total_pages = total_pages
        self.page_size = page_size
        self._free = list(range(total_pages - 1, -1, -1))
        self._refs = [0] * total_pages
        self._pages: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}

    # -- queries ----------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.total_pages - len(self._free)

    def __contains__(self, seq: int) -> bool:
        return seq in self._pages

    def sequences(self) -> list[int]:
        return list(self._pages)

    def length(self, seq: int) -> int:
        return self._length[seq]

    def pages_to_append(self, seq: int, n: int) -> int:
        length = self._length[seq]
        return _pages(length + n, self.page_size) - _pages(length, self.page_size)

    def pages_to_fork(self, pos: int) -> int:
        return 1 if pos % self.page_size else 0

    def pages_of(self, seqs) -> int:
        """Distinct pages the sequences ``seqs`` refer to (shared pages counted once)."""
        return len({p for seq in seqs for p in self._pages[seq]})

    def pages_freed_by_remove(self, seq: int) -> int:
        return sum(1 for p in self._pages[seq] if self._refs[p] == 1)

    # -- changes ----------------------------------------------------------------------
    def add(self, seq: int) -> None:
        if seq in self._pages:
            raise KeyError(f"sequence {seq} already exists")
        self._pages[seq] = []
        self._length[seq] = 0

    def append(self, seq: int, n: int) -> list[int] | None:
        need = self.pages_to_append(seq, n)
        if need > len(self._free):
            return None
        taken = self._take(need)
        self._pages[seq].extend(taken)
        self._length[seq] += n
        return taken

    def fork(self, parent: int, child: int, pos: int) -> list[int] | None:
        if child in self._pages:
            raise KeyError(f"sequence {child} already exists")
        if not 0 <= pos <= self._length[parent]:
            raise ValueError(f"fork position {pos} outside parent of length {self._length[parent]}")
        if self.pages_to_fork(pos) > len(self._free):
            return None
        shared = self._pages[parent][: pos // self.page_size]
        for p in shared:
            self._refs[p] += 1
        copied = self._take(self.pages_to_fork(pos))
        self._pages[child] = shared + copied
        self._length[child] = pos
        return copied

    def remove(self, seq: int) -> int:
        """Drop a sequence; returns how many pages became free."""
        freed = 0
        for p in self._pages.pop(seq):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        del self._length[seq]
        return freed

    def _take(self, n: int) -> list[int]:
        taken = [self._free.pop() for _ in range(n)]
        for p in taken:
            self._refs[p] = 1
        return taken

    # -- invariants -------------------------------------------------------------------
    def check(self) -> None:
        refs = [0] * self.total_pages
        for seq, pages in self._pages.items():
            assert len(pages) == _pages(self._length[seq], self.page_size), f"seq {seq}: page count"
            for p in pages:
                refs[p] += 1
        assert refs == self._refs, "reference counts drifted"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert all((refs[p] == 0) == (p in free) for p in range(self.total_pages)), "free list drifted"


def _pages(length: int, page_size: int) -> int:
    return -(-length // page_size)
