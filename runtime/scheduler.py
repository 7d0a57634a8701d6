"""Continuous batching policy, in plain Python (no TVM, no engine, no sampling).

Every step the scheduler emits one plan: the KV-cache operations to apply (add, fork,
remove) and "n tokens for sequence s" chunks to run in one forward. Prefill, chunked
prefill and decode are all chunks; a sequence needs logits when its chunk reaches its
last known token.

* Budget: at most ``max_batched_tokens`` tokens and ``max_num_seqs`` sequences per step.
  Running sequences go first (decodes, then unfinished prefills, in policy order), then
  waiting ones are admitted in policy order (FCFS by arrival, or priority then arrival).
* Pages: every chunk's pages are reserved in a ``PageLedger`` that mirrors the cache, so
  the cache never runs out mid-step. Admission keeps ``watermark_pages`` free; when a
  running sequence needs a page and none is free, idle prefix holders are evicted first,
  then the lowest-priority, newest running sequence is preempted by recompute (its KV is
  dropped; it waits again with its generated tokens and re-prefills them later).
* Prefix reuse: after a prompt is computed its full pages are kept by a holder sequence
  (``PrefixIndex``); later prompts with the same leading pages fork from it.
* n > 1 samples: sample 0 prefills the prompt; the others fork from it once the prompt
  is computed and take their first token from the same logits.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .page_ledger import PageLedger
from .prefix_index import PrefixIndex

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batched_tokens: int
    total_pages: int
    page_size: int
    watermark_pages: int = 0
    policy: str = "fcfs"
    prefix_reuse: bool = True
    max_prefix_holders: int = 64

    def __post_init__(self):
        for name in ("max_num_seqs", "max_batched_tokens", "total_pages", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.watermark_pages < self.total_pages:
            raise ValueError(f"watermark_pages must be in [0, total_pages), got {self.watermark_pages}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted (recompute)
    FORK_PENDING = "fork-pending"  # n > 1 sample waiting for its prompt to be computed
    RUNNING = "running"  # in the cache
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One sample of a request: its tokens, and how many of them the cache holds."""

    request_id: str
    index: int
    prompt: tuple[int, ...]
    priority: int
    arrival: int
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_id: int | None = None
    computed: int = 0
    parent: "Seq | None" = None  # sample 0, for a FORK_PENDING sample
    children: list["Seq"] = field(default_factory=list)
    prompt_registered: bool = False
    preemptions: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        return self.length - self.computed

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        p = len(self.prompt)
        return tuple(self.prompt[start:min(stop, p)]) + tuple(self.output[max(start - p, 0):max(stop - p, 0)])

    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)


@dataclass(frozen=True)
class KVOp:
    kind: str  # "add" | "fork" | "remove"
    seq_id: int
    parent: int | None = None
    position: int | None = None


@dataclass(frozen=True)
class Scheduled:
    seq: Seq
    start: int
    tokens: tuple[int, ...]
    needs_logits: bool


@dataclass(frozen=True)
class StepPlan:
    ops: tuple[KVOp, ...]
    chunks: tuple[Scheduled, ...]
    preempted: tuple[Seq, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ledger = PageLedger(config.total_pages, config.page_size)
        self.prefix = PrefixIndex(config.page_size, config.max_prefix_holders) if config.prefix_reuse else None
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.pending_forks: list[Seq] = []
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self._free_ids: list[int] = []
        self._holder_prompts: dict[int, tuple[int, ...]] = {}

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Sequence[int], n: int = 1, priority: int = 0) -> list[Seq]:
        if not prompt:
            raise ValueError("prompt must not be empty")
        pages = -(-len(prompt) // self.config.page_size)
        if pages + 1 > self.config.total_pages - self.config.watermark_pages:
            raise ValueError(f"a {len(prompt)}-token prompt needs more KV pages than the cache has")
        arrival = next(self._arrivals)
        prompt = tuple(prompt)
        first = Seq(request_id, 0, prompt, priority, arrival)
        seqs = [first]
        for i in range(1, n):
            child = Seq(request_id, i, prompt, priority, arrival, status=Status.FORK_PENDING, parent=first)
            first.children.append(child)
            seqs.append(child)
        self.waiting.append(first)
        self.pending_forks.extend(seqs[1:])
        self._sort_waiting()
        return seqs

    def release(self, seq: Seq) -> list[KVOp]:
        """A sequence is done (finished or aborted): free its cache entry now."""
        ops = []
        if seq.status is Status.RUNNING:
            ops.append(self._drop(seq))
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.FORK_PENDING:
            self.pending_forks.remove(seq)
        seq.status = Status.FINISHED
        return ops

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_forks)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        ops: list[KVOp] = []
        preempted: list[Seq] = []
        chunks: list[Scheduled] = []
        budget = cfg.max_batched_tokens
        self._resolve_pending_forks(ops)

        # Running sequences: decodes first, then unfinished prefills, each in policy order.
        order = sorted(self.running, key=self._priority_key)
        order = [s for s in order if s.remaining == 1] + [s for s in order if s.remaining > 1]
        scheduled: set[int] = set()
        for seq in order:
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.remaining, budget)
            if not self._make_room(self.ledger.pages_to_append(seq.seq_id, n), ops, preempted, protect=seq,
                                   scheduled=scheduled):
                continue  # even preempting everyone else does not fit it: wait for pages
            chunks.append(self._chunk(seq, n))
            scheduled.add(id(seq))
            budget -= n

        # Admission, in policy order, while budget, sequence slots and pages allow.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            start, holder = 0, None
            if self.prefix is not None:
                match = self.prefix.longest_match(seq.all_tokens(), seq.length - 1)
                if match is not None:
                    holder, start = match
            n = min(seq.length - start, budget)
            need = -(-(start + n) // cfg.page_size) - -(-start // cfg.page_size) + self.ledger.pages_to_fork(start)
            if not self._evict_holders_for(need + cfg.watermark_pages, keep=holder, ops=ops):
                break
            self.waiting.pop(0)
            seq.seq_id = self._new_id()
            if holder is None:
                ops.append(KVOp("add", seq.seq_id))
                self.ledger.add(seq.seq_id)
            else:
                ops.append(KVOp("fork", seq.seq_id, parent=holder, position=start))
                self.ledger.fork(holder, seq.seq_id, start)
            seq.status, seq.computed = Status.RUNNING, start
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            scheduled.add(id(seq))
            budget -= n

        assert budget >= 0 and len(chunks) <= cfg.max_num_seqs and len(self.running) <= cfg.max_num_seqs
        assert self.ledger.free_pages >= 0
        return StepPlan(tuple(ops), tuple(chunks), tuple(preempted))

    def commit(self, plan: StepPlan) -> list[KVOp]:
        """After the forward ran: the chunks' tokens are in the cache. Returns cache
        operations to apply now (forks of n > 1 samples, prefix holders)."""
        ops: list[KVOp] = []
        for c in plan.chunks:
            seq = c.seq
            seq.computed = c.start + len(c.tokens)
            if seq.computed >= len(seq.prompt) and seq.index == 0:
                ops += self._fork_children(seq)
                ops += self._register_prompt(seq)
        return ops

    # -- helpers ------------------------------------------------------------------------
    def _chunk(self, seq: Seq, n: int) -> Scheduled:
        start = seq.computed
        taken = self.ledger.append(seq.seq_id, n)
        assert taken is not None, "pages were checked before"
        return Scheduled(seq, start, seq.tokens(start, start + n), needs_logits=start + n == seq.length)

    def _priority_key(self, seq: Seq):
        if self.config.policy == "priority":
            return (-seq.priority, seq.arrival, seq.index)
        return (seq.arrival, seq.index)

    def _sort_waiting(self) -> None:
        self.waiting.sort(key=self._priority_key)

    def _new_id(self) -> int:
        return self._free_ids.pop() if self._free_ids else next(self._seq_ids)

    def _drop(self, seq: Seq) -> KVOp:
        op = KVOp("remove", seq.seq_id)
        self.ledger.remove(seq.seq_id)
        self._free_ids.append(seq.seq_id)
        seq.seq_id = None
        return op

    def _make_room(self, need: int, ops: list[KVOp], preempted: list[Seq], protect: Seq, scheduled: set[int]) -> bool:
        while self.ledger.free_pages < need:
            if self._evict_one_holder(ops):
                continue
            victims = [s for s in self.running if s is not protect and id(s) not in scheduled]
            if not victims:
                return False
            victim = max(victims, key=self._priority_key)  # lowest priority, newest
            ops.append(self._drop(victim))
            self.running.remove(victim)
            victim.status, victim.computed = Status.WAITING, 0
            victim.preemptions += 1
            preempted.append(victim)
            self.waiting.append(victim)
            self._sort_waiting()
        return True

    def _evict_one_holder(self, ops: list[KVOp], keep: int | None = None) -> bool:
        if self.prefix is None:
            return False
        for holder in self.prefix.holders():
            if holder != keep and self.ledger.pages_freed_by_remove(holder) > 0:
                self.prefix.remove(holder)
                self._holder_prompts.pop(holder, None)
                ops.append(KVOp("remove", holder))
                self.ledger.remove(holder)
                self._free_ids.append(holder)
                return True
        return False

    def _evict_holders_for(self, need: int, keep: int | None, ops: list[KVOp]) -> bool:
        while self.ledger.free_pages < need:
            if not self._evict_one_holder(ops, keep=keep):
                break
        return self.ledger.free_pages >= need

    def _fork_children(self, seq: Seq) -> list[KVOp]:
        ops = []
        pos = len(seq.prompt)
        for child in [c for c in seq.children if c.status is Status.FORK_PENDING]:
            if (self.ledger.free_pages < self.ledger.pages_to_fork(pos)
                    or len(self.running) >= self.config.max_num_seqs):
                break  # stays pending: schedule() retries, or recomputes it if sample 0 leaves
            child.seq_id = self._new_id()
            self.ledger.fork(seq.seq_id, child.seq_id, pos)
            ops.append(KVOp("fork", child.seq_id, parent=seq.seq_id, position=pos))
            child.status, child.computed = Status.RUNNING, pos
            self.pending_forks.remove(child)
            self.running.append(child)
        return ops

    def _resolve_pending_forks(self, ops: list[KVOp]) -> None:
        """n > 1 samples that could not fork when their prompt was computed: fork now, or
        recompute on their own if sample 0 has left the cache for good."""
        for child in list(self.pending_forks):
            parent = child.parent
            if parent.status is Status.RUNNING and parent.computed >= len(parent.prompt):
                if len(self.running) >= self.config.max_num_seqs:
                    continue
                ops += self._fork_children(parent)
            elif parent.status is Status.FINISHED:
                self.pending_forks.remove(child)
                child.status = Status.WAITING
                self.waiting.append(child)
                self._sort_waiting()

    def _register_prompt(self, seq: Seq) -> list[KVOp]:
        if self.prefix is None or seq.prompt_registered:
            return []
        seq.prompt_registered = True
        full = len(seq.prompt) - len(seq.prompt) % self.config.page_size
        if full == 0 or self.prefix.covered(seq.prompt) >= full:
            return []
        ops: list[KVOp] = []
        if len(self.prefix) >= self.prefix.max_holders:
            oldest = self.prefix.least_recently_used()
            self.prefix.remove(oldest)
            self._holder_prompts.pop(oldest, None)
            ops.append(KVOp("remove", oldest))
            self.ledger.remove(oldest)
            self._free_ids.append(oldest)
        holder = self._new_id()
        self.ledger.fork(seq.seq_id, holder, full)  # page-aligned: shares pages, takes none
        ops.append(KVOp("fork", holder, parent=seq.seq_id, position=full))
        self.prefix.insert(holder, seq.prompt[:full])
        self._holder_prompts[holder] = seq.prompt[:full]
        return ops

    # -- invariants ---------------------------------------------------------------------
    def check(self) -> None:
        self.ledger.check()
        live = {s.seq_id for s in self.running}
        holders = set(self.prefix.holders()) if self.prefix else set()
        assert live | holders == set(self.ledger.sequences()), "ledger and scheduler disagree on sequences"
        assert not live & holders
        for s in self.running:
            assert s.status is Status.RUNNING and 0 <= s.computed <= s.length
            assert self.ledger.length(s.seq_id) == s.computed, "ledger length != computed between steps"
        for s in self.waiting:
            assert s.status is Status.WAITING and s.seq_id is None
        assert len(self.running) <= self.config.max_num_seqs
