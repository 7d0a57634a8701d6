"""The engine core: the one owner of the scheduler, the KV cache, the executor and every
request's state, driven by one loop that no client ever waits on.

Clients talk to it through ``inbox`` only (a queue whose ``put`` never blocks): requests
to add, requests to abort, "finish everything" at shutdown. Each step the core drains the
inbox, schedules, runs the forward, samples, turns tokens into deltas and pushes them
into each request's stream, then publishes an immutable ``EngineStats`` snapshot that
``/health``, ``/metrics`` and ``Engine.stats()`` read without any lock.

Failures stay with the request that caused them: an exception while sampling or emitting
for one request fails that request only (its stream carries the error, its pages are
freed). A step whose forward (or KV operation) fails re-queues its sequences as suspects,
which then run alone: one that fails again alone is failed, the others recover. After a
failure the page ledger is checked against the cache; if they disagree the cache is
recreated and every running sequence recomputes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

from .errors import KilnError
from .executor import CacheConfig, Chunk
from .guided import advance, fill_masks
from .kv_ops import apply_ops
from .metrics import EngineMetrics
from .output_processor import OutputState, process_token
from .outputs import Delta
from .sampling import SampleState, SamplingParams, make_generators, sample_rows
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Seq
from .stream import RequestCancelled, RequestStream

log = logging.getLogger("kiln.engine")

IDLE_POLL_S = 0.5  # an idle core still wakes this often, so its heartbeat stays fresh


# -- the request record ---------------------------------------------------------------------
@dataclass(eq=False)
class SampleRecord:
    """One sample of a request: its scheduler sequence, sampler and text state."""

    request: "RequestRecord"
    sampler: SampleState
    output: OutputState
    seq: Seq | None = None  # set when the core adds the request to the scheduler
    last_token_at: float | None = None
    finished: bool = False


@dataclass(eq=False)
class RequestRecord:
    """Everything about one request, built on the caller's thread (tokenized, validated,
    stop matchers compiled) and owned by the core once it is in the inbox."""

    request_id: str
    params: SamplingParams
    prompt_ids: tuple[int, ...]
    priority: int
    stream: RequestStream
    arrival: float = field(default_factory=time.perf_counter)
    samples: list[SampleRecord] = field(default_factory=list)
    queued: bool = True  # counted against max_waiting until first scheduled or ended

    @classmethod
    def create(cls, request_id: str, params: SamplingParams, prompt_ids, priority: int, stream: RequestStream,
               tokenizer, end_ids: frozenset[int], budget: int, grammars: list | None = None) -> "RequestRecord":
        """``grammars``: one matcher per sample for a constrained request."""
        record = cls(request_id, params, tuple(prompt_ids), priority, stream)
        grammars = grammars or [None] * params.n
        for rng, grammar in zip(make_generators(params.seed, params.n), grammars, strict=True):
            record.samples.append(SampleRecord(
                record, SampleState(params, rng, record.prompt_ids, end_ids, grammar=grammar),
                OutputState.create(tokenizer, record.prompt_ids, params.stop, end_ids, budget)))
        return record


# -- inbox messages -------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    record: RequestRecord


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FinishAll:
    """End every request now with a final delta carrying ``reason`` (shutdown)."""

    reason: str


@dataclass(frozen=True)
class RunInCore:
    """Run ``fn()`` on the core between two steps (inspection in tests and tools)."""

    fn: Callable[[], object]
    result: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    pass


# -- the published snapshot -----------------------------------------------------------------
@dataclass(frozen=True)
class EngineStats:
    """What the core looked like after its last step or poll."""

    waiting: int = 0  # requests' sequences not in the cache (new, preempted, unforked samples)
    running: int = 0  # sequences in the cache
    requests: int = 0  # requests the core holds
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_requests: int = 0  # referred to by running sequences
    kv_pages_prefix_cached: int = 0  # held only by prefix holders: evictable
    prefix_holders: int = 0
    steps: int = 0
    published_at: float = field(default_factory=time.monotonic)  # time.monotonic()

    def gauges(self) -> dict[str, float]:
        return {"queue_depth": self.waiting, "running_requests": self.running,
                "kv_pages_total": self.kv_pages_total, "kv_pages_used": self.kv_pages_used,
                "kv_pages_requests": self.kv_pages_requests, "kv_pages_prefix_cached": self.kv_pages_prefix_cached,
                "kv_page_usage_ratio": self.kv_pages_used / max(self.kv_pages_total, 1),
                "prefix_holders": self.prefix_holders}


class EngineCore:
    def __init__(self, executor, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 metrics: EngineMetrics, on_dequeued: Callable[[], None] = lambda: None):
        self.executor = executor
        self.cache_config = cache_config
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cache = executor.create_cache(cache_config)
        if scheduler_config.total_pages != self.cache.total_pages:
            raise ValueError(f"the scheduler counts {scheduler_config.total_pages} pages, "
                             f"the cache has {self.cache.total_pages}")
        self.scheduler = Scheduler(scheduler_config)
        self.requests: dict[str, RequestRecord] = {}
        self._on_dequeued = on_dequeued
        self._steps = 0
        self._grammar_executor = None
        self.dead: BaseException | None = None  # set if the core cannot go on (no cache)
        self.stats = EngineStats()
        self._publish()

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """The core's thread: drain the inbox (blocking while there is no work), step."""
        while True:
            try:
                if not self._drain_inbox(block=not self.scheduler.has_work()):
                    return
                if self.scheduler.has_work():
                    self._step()
                else:
                    self._publish()  # the heartbeat
            except Exception as err:  # noqa: BLE001  (the loop must survive anything)
                log.exception("engine core error outside a step; recreating the KV cache")
                if not self._reset_cache(err):
                    return

    def has_work(self) -> bool:
        """Messages to apply or sequences to run."""
        return not self.inbox.empty() or self.scheduler.has_work()

    def step(self) -> bool:
        """One iteration without the thread (tests drive the core with this): apply the
        inbox, then run one step. True if anything was scheduled."""
        self._drain_inbox(block=False)
        return self._step() if self.scheduler.has_work() else False

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued message; False when told to stop."""
        try:
            message = self.inbox.get(timeout=IDLE_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(message, Stop):
                return False
            self._handle(message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, message) -> None:
        match message:
            case AddRequest(record):
                self._add(record)
            case AbortRequest(request_id):
                record = self.requests.get(request_id)
                if record is not None:
                    self._end(record, "cancelled", RequestCancelled(f"request {request_id} was cancelled"))
            case FinishAll(reason):
                for record in list(self.requests.values()):
                    self._finish_now(record, reason)
            case RunInCore(fn, result):
                try:
                    result.set_result(fn())
                except Exception as err:  # noqa: BLE001  (handed to the caller)
                    result.set_exception(err)
            case _:
                raise TypeError(f"unknown engine message {message!r}")

    def _add(self, record: RequestRecord) -> None:
        try:
            seqs = self.scheduler.add_request(record.request_id, record.prompt_ids, record.params.n, record.priority)
        except ValueError as err:  # the engine checks capacity before; a last guard
            self._end(record, "failed", KilnError(str(err)), release=False)
            return
        for sample, seq in zip(record.samples, seqs):
            sample.seq, seq.owner = seq, sample
        self.requests[record.request_id] = record

    # -- one step -------------------------------------------------------------------------
    def _step(self) -> bool:
        out = self.scheduler.schedule()
        started = time.perf_counter()
        try:
            self._apply(out.kv_ops)
            if not out.seqs:
                self._publish()
                return bool(out.kv_ops)
            for c in out.seqs:
                self._dequeue(c.seq.owner.request)
            chunks = [Chunk(c.seq.seq_id, c.tokens, c.start, None if c.logits_row is not None else ())
                      for c in out.seqs]
            logits = self.executor.forward(self.cache, chunks)  # [out.num_logits_rows, vocab]
            self._apply(self.scheduler.commit(out))
        except Exception as err:  # noqa: BLE001  (a failed step must not take the engine down)
            self._recover(out, err)
            self._publish()
            return True
        self._sample(out, logits)
        self._steps += 1
        self.metrics.on_step(out.num_tokens, time.perf_counter() - started, len(out.preempted))
        self._publish()
        return True

    def _sample(self, out: SchedulerOutput, logits) -> None:
        """Draw one token for every sample a row feeds, and emit it. A failure while
        sampling or emitting for one request fails that request only."""
        now = time.perf_counter()
        tokens = 0
        masks = self._grammar_masks(out, logits.shape[-1])
        for c in out.seqs:
            if c.logits_row is None:
                continue
            for seq in c.feeds:
                sample: SampleRecord = seq.owner
                if sample is None or sample.finished:
                    continue  # aborted or failed during this step
                try:
                    if isinstance(masks.get(sample), BaseException):
                        raise masks[sample]
                    token, logprobs = _sample_one(logits[c.logits_row], sample.sampler, masks.get(sample))
                    if sample.sampler.grammar is not None:
                        advance(sample.sampler.grammar, token)
                    self._emit(sample, token, logprobs, now)
                    tokens += 1
                except Exception as err:  # noqa: BLE001
                    log.exception("request %s failed while sampling or streaming", sample.request.request_id)
                    self._end(sample.request, "failed", err)
        if tokens:
            self.metrics.on_tokens(tokens, time.time())

    def _grammar_masks(self, out: SchedulerOutput, vocab_size: int) -> dict:
        """The allowed tokens (bool [vocab]) of every constrained sample this step samples,
        filled in one parallel call; if that call fails, each such sample maps to the error
        (its request fails, the others go on)."""
        constrained = [seq.owner for c in out.seqs if c.logits_row is not None for seq in c.feeds
                       if seq.owner is not None and not seq.owner.finished and seq.owner.sampler.grammar is not None]
        if not constrained:
            return {}
        started = time.perf_counter()
        try:
            rows = fill_masks(self.grammar_executor(), [s.sampler.grammar for s in constrained], vocab_size)
        except Exception as err:  # noqa: BLE001
            log.exception("computing grammar masks failed")
            return {s: err for s in constrained}
        self.metrics.grammar_masks.observe(time.perf_counter() - started)
        return dict(zip(constrained, rows))

    def grammar_executor(self):
        """llguidance's thread pool for masks, made on the first constrained step."""
        if self._grammar_executor is None:
            import llguidance

            self._grammar_executor = llguidance.LLExecutor()
        return self._grammar_executor

    def _emit(self, sample: SampleRecord, token: int, logprobs, now: float) -> None:
        seq, record = sample.seq, sample.request
        seq.output.append(token)
        result = process_token(sample.output, token)
        if sample.last_token_at is not None:
            self.metrics.itl.observe(now - sample.last_token_at)
        elif all(s.last_token_at is None for s in record.samples):  # the request's first token
            self.metrics.ttft.observe(now - record.arrival)
        sample.last_token_at = now
        if result.finish_reason is not None:
            # Pages first: a client that sees its stream end finds them free.
            sample.finished = True
            self._apply(self.scheduler.release(seq))
        record.stream.push(Delta(result.text, token, result.finish_reason, seq.index, logprobs))
        if all(s.finished for s in record.samples):
            self._end(record, record.samples[0].output.finish_reason or "stop", None)

    # -- ending requests ------------------------------------------------------------------
    def _end(self, record: RequestRecord, outcome: str, error: BaseException | None, release: bool = True) -> None:
        """Take ``record`` out of the core: free its samples' pages, end its stream with
        ``error`` if any (a finished stream has ended already), count it."""
        if release:
            for sample in record.samples:
                if not sample.finished:
                    sample.finished = True
                    if sample.seq is not None:
                        self._apply(self.scheduler.release(sample.seq))
        if self.requests.pop(record.request_id, None) is None and release:
            return  # already ended
        self._dequeue(record)
        if error is not None:
            if outcome == "failed" and not isinstance(error, KilnError):
                error = KilnError(f"generation failed: {error}")
            record.stream.fail(error)
        self.metrics.on_end(outcome, time.perf_counter() - record.arrival)

    def _finish_now(self, record: RequestRecord, reason: str) -> None:
        """End a request early but cleanly: each unfinished sample gets a last delta with
        ``reason`` as its finish reason (the stream completes; no error)."""
        for sample in record.samples:
            if not sample.finished:
                sample.finished = True
                self._apply(self.scheduler.release(sample.seq))
                record.stream.push(Delta("", None, reason, sample.seq.index))
        self._end(record, reason, None)

    def _dequeue(self, record: RequestRecord) -> None:
        if record.queued:
            record.queued = False
            self._on_dequeued()

    # -- failures -------------------------------------------------------------------------
    def _recover(self, out: SchedulerOutput, err: BaseException) -> None:
        """A step failed. Its sequences wait again as suspects (run alone next); the
        requests of those that were suspects already (they failed alone) are failed."""
        self.metrics.on_failed_step()
        alone = [c.seq.owner.request for c in out.seqs if c.seq.suspect]
        log.error("engine step failed (%d sequences; %s): %s", len(out.seqs),
                  "failing its request" if alone else "retrying each sequence alone", err, exc_info=err)
        try:
            self._apply(self.scheduler.requeue_failed(out))
            self._verify_pages()
        except Exception:  # noqa: BLE001
            log.exception("KV cache and page ledger disagree after the failed step; recreating the cache")
            if not self._reset_cache(err):
                return
        for record in alone:
            if record.request_id in self.requests:
                self._end(record, "failed", err)

    def _verify_pages(self) -> None:
        free, available = self.scheduler.ledger.free_pages, self.cache.available_pages()
        if free != available:
            raise KilnError(f"page ledger has {free} free pages, the KV cache {available}")

    def _reset_cache(self, err: BaseException) -> bool:
        """Recreate the KV cache; every running sequence waits again (recompute). If even
        that fails the core is dead: every request fails and ``dead`` is set."""
        try:
            self.cache = self.executor.create_cache(self.cache_config)
            self.scheduler.reset()
            return True
        except Exception as fatal:  # noqa: BLE001
            log.exception("cannot recreate the KV cache: the engine core stops")
            self.dead = fatal
            for record in list(self.requests.values()):
                self._end(record, "failed", KilnError(f"the engine failed: {err}"), release=False)
            return False

    def _apply(self, ops) -> None:
        apply_ops(self.cache, ops)

    # -- the snapshot ---------------------------------------------------------------------
    def _publish(self) -> None:
        sch = self.scheduler
        used = sch.ledger.used_pages
        held = sch.pages_held_by_requests()
        self.stats = EngineStats(
            waiting=len(sch.waiting) + len(sch.pending_forks), running=len(sch.running),
            requests=len(self.requests), kv_pages_total=sch.ledger.total_pages, kv_pages_used=used,
            kv_pages_requests=held, kv_pages_prefix_cached=used - held,
            prefix_holders=len(sch.prefix) if sch.prefix is not None else 0, steps=self._steps)

    def check(self) -> None:
        """Invariants between steps: the scheduler's, and its ledger against the cache."""
        self.scheduler.check()
        self._verify_pages()


def _sample_one(row, state: SampleState, allowed=None):
    """One token from one logits row [vocab] (the batched sampler, one row at a time, so
    a failure stays with its request), among the tokens ``allowed`` (bool [vocab])."""
    tokens, logprobs = sample_rows(row[None], [state], None if allowed is None else [allowed])
    return tokens[0], logprobs[0]
