"""Continuous batching policy, in plain Python (no TVM, no engine, no sampling).

Every step the scheduler emits one narrow message, ``SchedulerOutput``: the typed
KV-cache operations to apply first (add, fork, remove), then for each scheduled sequence
the tokens it computes this step, the logits row it samples from (if its chunk reaches its
last known token) and the samples that row feeds. Prefill, chunked prefill and decode are
all "n tokens for sequence s".

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
* Failed steps: every sequence of a step whose forward failed is dropped and waits again
  as a *suspect*; a suspect runs alone (no other sequence in its steps) until it has
  recomputed all its tokens, so a request that breaks the forward is found and failed
  alone while the others recover (``requeue_failed``).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .kv_ops import AddSeq, ForkSeq, KVOp, RemoveSeq
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

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt admission can ever take: its pages plus one for its first
        output token, above the watermark (``add_request`` refuses longer ones)."""
        return (self.total_pages - self.watermark_pages - 1) * self.page_size


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted (recompute)
    FORK_PENDING = "fork-pending"  # n > 1 sample waiting for its prompt to be computed
    RUNNING = "running"  # in the cache
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One sample of a request: its tokens, and how many of them the cache holds.
    ``owner`` is the engine's record of this sample (opaque here): the scheduler hands
    sequences back, and the engine reaches their state without a lookup."""

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
    suspect: bool = False  # was in a failed step: runs alone until recomputed
    owner: object = None

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
class ScheduledSeq:
    """``tokens`` of ``seq`` at positions ``start ..`` this step. ``logits_row``: the row
    of the step's logits [rows, vocab] this chunk's last token produces, or None when the
    chunk stops short of the sequence's end (a prefill piece). ``feeds``: the samples
    that draw their next token from that row (the sequence itself, and the n > 1 samples
    that fork from a prompt it completes)."""

    seq: Seq
    start: int
    tokens: tuple[int, ...]
    logits_row: int | None
    feeds: tuple[Seq, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    kv_ops: tuple[KVOp, ...]
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Seq, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.seqs)

    @property
    def num_logits_rows(self) -> int:
        return sum(c.logits_row is not None for c in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.pending_forks: list[Seq] = []
        self._arrivals = itertools.count()
        self._reset_cache_state()

    def _reset_cache_state(self) -> None:
        config = self.config
        self.ledger = PageLedger(config.total_pages, config.page_size)
        self.prefix = PrefixIndex(config.page_size, config.max_prefix_holders) if config.prefix_reuse else None
        self._seq_ids = itertools.count()
        self._free_ids: list[int] = []

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Sequence[int], n: int = 1, priority: int = 0) -> list[Seq]:
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > self.config.max_prompt_tokens:
            raise ValueError(f"a {len(prompt)}-token prompt needs more KV pages than the cache has "
                             f"(at most {self.config.max_prompt_tokens} tokens)")
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
        """A sequence is done (finished, aborted or failed): free its cache entry now."""
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
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        ops: list[KVOp] = []
        preempted: list[Seq] = []
        chunks: list[tuple[Seq, int, int]] = []
        self._resolve_pending_forks(ops)
        suspect = next((s for s in self.running + self.waiting if s.suspect), None)
        if suspect is not None:
            self._schedule_alone(suspect, ops, preempted, chunks)
        else:
            self._schedule_batch(ops, preempted, chunks)
        out = self._output(ops, chunks, preempted)
        assert len(out.seqs) <= cfg.max_num_seqs and len(self.running) <= cfg.max_num_seqs
        assert out.num_tokens <= cfg.max_batched_tokens and self.ledger.free_pages >= 0
        return out

    def _schedule_batch(self, ops: list[KVOp], preempted: list[Seq], chunks: list[tuple[Seq, int, int]]) -> None:
        cfg = self.config
        budget = cfg.max_batched_tokens
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
            n = self._admit(self.waiting[0], budget, ops)
            if n is None:
                break
            chunks.append(self._chunk(self.running[-1], n))
            scheduled.add(id(self.running[-1]))
            budget -= n

    def _schedule_alone(self, seq: Seq, ops: list[KVOp], preempted: list[Seq],
                        chunks: list[tuple[Seq, int, int]]) -> None:
        """A suspect's step holds it alone: if the forward fails again, it is the cause."""
        budget = self.config.max_batched_tokens
        if seq.status is Status.WAITING:
            if len(self.running) >= self.config.max_num_seqs:
                self._preempt(max(self.running, key=self._priority_key), ops, preempted)
            while (n := self._admit(seq, budget, ops)) is None:
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    return  # cannot happen: a lone prompt always fits (max_prompt_tokens)
                self._preempt(max(victims, key=self._priority_key), ops, preempted)
            chunks.append(self._chunk(seq, n))
            return
        n = min(seq.remaining, budget)
        if self._make_room(self.ledger.pages_to_append(seq.seq_id, n), ops, preempted, protect=seq, scheduled=set()):
            chunks.append(self._chunk(seq, n))

    def _admit(self, seq: Seq, budget: int, ops: list[KVOp]) -> int | None:
        """Take ``seq`` from the waiting list into the cache (forking from the longest
        cached prefix): the tokens it computes this step, or None when pages are short."""
        cfg = self.config
        start, holder = 0, None
        if self.prefix is not None:
            match = self.prefix.longest_match(seq.all_tokens(), seq.length - 1)
            if match is not None:
                holder, start = match
        n = min(seq.length - start, budget)
        need = -(-(start + n) // cfg.page_size) - -(-start // cfg.page_size) + self.ledger.pages_to_fork(start)
        if not self._evict_holders_for(need + cfg.watermark_pages, keep=holder, ops=ops):
            return None
        self.waiting.remove(seq)
        seq.seq_id = self._new_id()
        if holder is None:
            ops.append(AddSeq(seq.seq_id))
            self.ledger.add(seq.seq_id)
        else:
            ops.append(ForkSeq(seq.seq_id, holder, start))
            self.ledger.fork(holder, seq.seq_id, start)
        seq.status, seq.computed = Status.RUNNING, start
        self.running.append(seq)
        return n

    def _output(self, ops: list[KVOp], chunks: list[tuple[Seq, int, int]], preempted: list[Seq]) -> SchedulerOutput:
        seqs, row = [], 0
        for seq, start, n in chunks:
            tokens = seq.tokens(start, start + n)
            if start + len(tokens) < seq.length:
                seqs.append(ScheduledSeq(seq, start, tokens, None))
                continue
            feeds = [seq]
            if seq.index == 0 and start + len(tokens) == len(seq.prompt):
                # Samples forking from this prompt take their first token from its logits.
                feeds += [c for c in seq.children if c.status is Status.FORK_PENDING and not c.output]
            seqs.append(ScheduledSeq(seq, start, tokens, row, tuple(feeds)))
            row += 1
        return SchedulerOutput(tuple(ops), tuple(seqs), tuple(preempted))

    def commit(self, out: SchedulerOutput) -> list[KVOp]:
        """After the forward ran: the chunks' tokens are in the cache. Returns cache
        operations to apply now (forks of n > 1 samples, prefix holders)."""
        ops: list[KVOp] = []
        for c in out.seqs:
            seq = c.seq
            seq.computed = c.start + len(c.tokens)
            if seq.computed == seq.length:
                seq.suspect = False  # recomputed alone without failing: cleared
            if seq.computed >= len(seq.prompt) and seq.index == 0:
                ops += self._fork_children(seq)
                ops += self._register_prompt(seq)
        return ops

    def requeue_failed(self, out: SchedulerOutput) -> list[KVOp]:
        """The step's forward failed: drop the KV of every sequence it ran (the cache may
        hold part of the step) and make each wait again as a suspect. Returns the cache
        operations; the caller fails the requests of sequences that were suspects already."""
        ops: list[KVOp] = []
        for c in out.seqs:
            if c.seq.status is Status.RUNNING:
                self._preempt(c.seq, ops, [])
                c.seq.suspect = True
        return ops

    def reset(self) -> None:
        """The cache was recreated empty: every running sequence waits again (recompute),
        prefix holders are gone."""
        for seq in list(self.running):
            seq.seq_id = None
            self.running.remove(seq)
            seq.status, seq.computed = Status.WAITING, 0
            self.waiting.append(seq)
        self._sort_waiting()
        self._reset_cache_state()

    # -- helpers ------------------------------------------------------------------------
    def _chunk(self, seq: Seq, n: int) -> tuple[Seq, int, int]:
        """Reserve pages for ``n`` tokens of ``seq`` this step: (seq, start, n).
        ``computed`` moves at ``commit``, once the forward ran."""
        taken = self.ledger.append(seq.seq_id, n)
        assert taken is not None, "pages were checked before"
        return seq, seq.computed, n

    def _priority_key(self, seq: Seq):
        if self.config.policy == "priority":
            return (-seq.priority, seq.arrival, seq.index)
        return (seq.arrival, seq.index)

    def _sort_waiting(self) -> None:
        self.waiting.sort(key=self._priority_key)

    def _new_id(self) -> int:
        return self._free_ids.pop() if self._free_ids else next(self._seq_ids)

    def _drop(self, seq: Seq) -> KVOp:
        op = RemoveSeq(seq.seq_id)
        self.ledger.remove(seq.seq_id)
        self._free_ids.append(seq.seq_id)
        seq.seq_id = None
        return op

    def _preempt(self, victim: Seq, ops: list[KVOp], preempted: list[Seq]) -> None:
        ops.append(self._drop(victim))
        self.running.remove(victim)
        victim.status, victim.computed = Status.WAITING, 0
        victim.preemptions += 1
        preempted.append(victim)
        self.waiting.append(victim)
        self._sort_waiting()

    def _make_room(self, need: int, ops: list[KVOp], preempted: list[Seq], protect: Seq, scheduled: set[int]) -> bool:
        while self.ledger.free_pages < need:
            if self._evict_one_holder(ops):
                continue
            victims = [s for s in self.running if s is not protect and id(s) not in scheduled]
            if not victims:
                return False
            self._preempt(max(victims, key=self._priority_key), ops, preempted)  # lowest priority, newest
        return True

    def _remove_holder(self, holder: int, ops: list[KVOp]) -> None:
        self.prefix.remove(holder)
        ops.append(RemoveSeq(holder))
        self.ledger.remove(holder)
        self._free_ids.append(holder)

    def _evict_one_holder(self, ops: list[KVOp], keep: int | None = None) -> bool:
        if self.prefix is None:
            return False
        for holder in self.prefix.holders():
            if holder != keep and self.ledger.pages_freed_by_remove(holder) > 0:
                self._remove_holder(holder, ops)
                return True
        return False

    def _evict_holders_for(self, need: int, keep: int | None, ops: list[KVOp]) -> bool:
        while self.ledger.free_pages < need:
            if not self._evict_one_holder(ops, keep=keep):
                break
        return self.ledger.free_pages >= need

    def _fork_children(self, seq: Seq) -> list[KVOp]:
        ops: list[KVOp] = []
        pos = len(seq.prompt)
        for child in [c for c in seq.children if c.status is Status.FORK_PENDING]:
            if (self.ledger.free_pages < self.ledger.pages_to_fork(pos)
                    or len(self.running) >= self.config.max_num_seqs):
                break  # stays pending: schedule() retries, or recomputes it if sample 0 leaves
            child.seq_id = self._new_id()
            self.ledger.fork(seq.seq_id, child.seq_id, pos)
            ops.append(ForkSeq(child.seq_id, seq.seq_id, pos))
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
            self._remove_holder(self.prefix.least_recently_used(), ops)
        holder = self._new_id()
        self.ledger.fork(seq.seq_id, holder, full)  # page-aligned: shares pages, takes none
        ops.append(ForkSeq(holder, seq.seq_id, full))
        self.prefix.insert(holder, seq.prompt[:full])
        return ops

    # -- queries and invariants ---------------------------------------------------------
    def pages_held_by_requests(self) -> int:
        """Pages some request's sequence refers to (the rest of the used pages are held
        only by prefix holders: cached, evictable)."""
        return self.ledger.pages_of([s.seq_id for s in self.running])

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
