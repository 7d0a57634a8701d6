"""The serving engine: continuous batching over an artifact's paged KV cache.

    engine = Engine.load("artifacts/smollm2-135m-instruct-llvm")
    print(engine.generate("The capital of France is", max_tokens=16).text)
    for delta in engine.stream([{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1):
        print(delta.text, end="", flush=True)

Every request, from any thread, goes through one engine loop (a background thread): each
step the scheduler plans "n tokens for sequence s" chunks under a token budget, the
executor runs them in one forward, the sampler picks one token per sequence that needs
one, and each token is detokenized and streamed. A prompt is a string (tokenized with the
tokenizer's BOS rule) or a list of chat messages (rendered by the model's chat template).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from .artifact import Manifest, load_manifest, verify_files
from .detokenizer import IncrementalDetokenizer
from .device import open_device
from .errors import InvalidRequestError, KilnError, PromptTooLongError
from .executor import CacheConfig, Chunk, PagedExecutor
from .metrics import EngineMetrics
from .model_config import ModelConfig
from .outputs import Completion, Delta
from .sampling import SampleState, SamplingParams, make_generators, sample_rows
from .scheduler import POLICIES, Scheduler, SchedulerConfig, Seq
from .stop import StopMatcher
from .stream import RequestCancelled, RequestStream
from .tokenizer import Message, Tokenizer

log = logging.getLogger("kiln.engine")
Prompt = str | Sequence[int] | Sequence[Message]


class EngineOverloadedError(KilnError):
    """Too many requests are waiting; try again later."""


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits, validated once. ``max_total_tokens``: KV-cache capacity in tokens
    over all sequences (default: the context window, at least 8192);
    ``max_batched_tokens``: tokens per step (the prefill chunk); ``max_waiting``: queued
    requests beyond which ``submit`` refuses new ones."""

    max_num_seqs: int = 16
    max_total_tokens: int | None = None
    max_batched_tokens: int = 512
    watermark: float = 0.01
    policy: str = "fcfs"
    prefix_reuse: bool = True
    max_waiting: int = 256

    def __post_init__(self):
        for name in ("max_num_seqs", "max_batched_tokens", "max_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_total_tokens is not None and (not isinstance(self.max_total_tokens, int)
                                                  or self.max_total_tokens < 1):
            raise ValueError(f"max_total_tokens must be a positive integer, got {self.max_total_tokens!r}")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError("max_batched_tokens must be >= max_num_seqs (each running sequence decodes a token)")
        if not 0.0 <= self.watermark < 0.5:
            raise ValueError(f"watermark must be in [0, 0.5), got {self.watermark}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(eq=False)
class _Sample:
    seq: Seq
    state: SampleState
    detok: IncrementalDetokenizer
    stops: StopMatcher
    budget: int
    finished: bool = False


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    stream: RequestStream
    samples: list[_Sample] = field(default_factory=list)


class Engine:
    def __init__(self, model: ModelConfig, executor, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 manifest: Manifest | None = None, folder: Path | None = None, background: bool = True):
        """``background=False``: no engine thread; the caller drives ``step()`` (tests)."""
        self._background = background
        self.config = model
        self.engine_config = config or EngineConfig()
        self.manifest = manifest
        self.folder = folder
        self.tokenizer = tokenizer
        self._executor = executor
        ec = self.engine_config
        total = ec.max_total_tokens or max(model.context_length, 8192)
        # One sequence must always fit, so a lone long generation can never stall.
        total = max(total, model.context_length + executor.page_size)
        self._cache_config = CacheConfig(max_batch_size=ec.max_num_seqs, max_total_tokens=total,
                                         prefill_chunk_size=ec.max_batched_tokens, page_size=executor.page_size)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Sample] = {}
        self.metrics = EngineMetrics()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ids = itertools.count()
        self._reset_state()

    @classmethod
    def load(cls, path: str | Path, config: EngineConfig | None = None, device_id: int = 0,
             verify_hashes: bool = True, background: bool = True) -> "Engine":
        """Load an artifact folder. Raises ArtifactError (missing, corrupt, altered, or too
        new an artifact) or DeviceError (its target cannot run on this host)."""
        folder = Path(path)
        manifest = load_manifest(folder)
        verify_files(folder, manifest, check_hashes=verify_hashes)
        device = open_device(manifest.target, device_id)
        executor = PagedExecutor(folder, manifest, device)
        tokenizer = Tokenizer.from_folder(folder, manifest.model.eos_token_ids)
        return cls(manifest.model, executor, tokenizer, config, manifest, folder, background)

    def _reset_state(self) -> None:
        self.cache = self._executor.create_cache(self._cache_config)
        ec = self.engine_config
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=ec.max_num_seqs, max_batched_tokens=ec.max_batched_tokens,
            total_pages=self.cache.total_pages, page_size=self._cache_config.page_size,
            watermark_pages=int(self.cache.total_pages * ec.watermark), policy=ec.policy,
            prefix_reuse=ec.prefix_reuse))

    # -- public API -----------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Delta], None] | None = None,
               **overrides) -> RequestStream:
        """Queue a request; returns its stream at once. Bad input raises here, before any
        work is queued. ``on_token`` runs on the engine thread for every delta."""
        params = _params(params, overrides)
        params.check_vocab(self.config.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", "must be an integer")
        prompt_ids = self.encode_prompt(prompt)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, params.n, len(prompt_ids), self.abort, on_token)
        # Output budget: max_tokens, and what the context window leaves after the prompt.
        budget = min(params.max_tokens, self.config.context_length - len(prompt_ids))
        end_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                        else self.tokenizer.eos_token_ids)
        with self._lock:
            if self._closed:
                raise KilnError("the engine is closed")
            if request_id in self._requests:
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
            if len(self.scheduler.waiting) >= self.engine_config.max_waiting:
                self.metrics.rejected += 1
                raise EngineOverloadedError(
                    f"{len(self.scheduler.waiting)} requests are already waiting (max_waiting); retry later")
            seqs = self.scheduler.add_request(request_id, prompt_ids, params.n, priority)
            req = _Request(request_id, params, stream)
            for seq, rng in zip(seqs, make_generators(params.seed, params.n)):
                req.samples.append(_Sample(
                    seq, SampleState(params, rng, prompt_ids, end_ids),
                    IncrementalDetokenizer(self.tokenizer, prompt_ids), StopMatcher(params.stop), budget))
            self._requests[request_id] = req
            self.metrics.on_submit(request_id)
            self._ensure_thread()
            self._wake.notify_all()
        return stream

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 on_token: Callable[[Delta], None] | None = None, priority: int = 0, **overrides) -> Completion:
        """Generate to completion. ``overrides`` are SamplingParams fields (``max_tokens=``,
        ``temperature=``, ``top_k=``, ``top_p=``, ``seed=``, ``stop=``, ``n=``...).
        ``on_token`` is called on this thread for every delta, in order."""
        stream = self.submit(prompt, params, priority=priority, **overrides)
        if on_token is None:
            try:
                return stream.result()
            except BaseException:
                stream.cancel()
                raise
        for delta in stream:
            on_token(delta)
        return stream.completion()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
               **overrides) -> Iterator[Delta]:
        """Yield deltas as they are generated; leaving the loop early cancels the request.
        Bad input raises here, before the first delta."""
        return iter(self.submit(prompt, params, priority=priority, **overrides))

    def astream(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0, **overrides):
        """``async for`` over the deltas (same semantics as ``stream``)."""
        return self.submit(prompt, params, priority=priority, **overrides).__aiter__()

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its pages are freed now (at most one running step later)."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return False
            for sample in req.samples:
                self._release(sample)
            self.metrics.on_abort(request_id)
        req.stream.fail(RequestCancelled(f"request {request_id} was cancelled"))
        return True

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A string, chat messages, or token ids -> token ids (validated)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary "
                                                    f"[0, {self.config.vocab_size})")
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode_chat(prompt)
        else:
            raise InvalidRequestError("prompt", "must be a string, token ids, or a list of chat messages")
        if not ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        if len(ids) >= self.config.context_length:
            raise PromptTooLongError(
                f"prompt: {len(ids)} tokens do not fit the context window of {self.config.context_length} "
                f"tokens (at least one must be left for the output)"
            )
        return ids

    def stats(self) -> dict:
        with self._lock:
            return {
                "waiting": len(self.scheduler.waiting) + len(self.scheduler.pending_forks),
                "running": len(self.scheduler.running),
                "kv_pages_total": self.cache.total_pages,
                "kv_pages_used": self.cache.total_pages - self.cache.available_pages(),
                "prefix_holders": len(self.scheduler.prefix) if self.scheduler.prefix else 0,
            }

    def idle(self) -> bool:
        with self._lock:
            return not self._requests and not self.scheduler.has_work()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            pending = list(self._requests)
        for rid in pending:
            self.abort(rid)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if not self._background:
            return
        if self._thread is None or not self._thread.is_alive():
            first = self._thread is None
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()
            if first:
                # The loop thread is a daemon (it must not keep a program alive), but one
                # still inside the TVM runtime while the interpreter tears down aborts the
                # process ("terminate called without an active exception"): a caller that
                # got its last token returns while the loop still frees the sequence's
                # pages. Join it at exit, before teardown.
                atexit.register(_close_at_exit, weakref.ref(self))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.scheduler.has_work():
                    self._wake.wait()
                if self._closed:
                    return
                try:
                    self.step()
                except Exception as err:  # a failed step must not take the engine down
                    log.exception("engine step failed")
                    self._fail_all(err)

    def step(self) -> bool:
        """Run one scheduling step (the loop thread calls this; tests may too)."""
        with self._lock:
            plan = self.scheduler.schedule()
            self._apply(plan.ops)
            if not plan.chunks:
                return bool(plan.ops)
            started = time.perf_counter()
            chunks = [Chunk(c.seq.seq_id, c.tokens, c.start, None if c.needs_logits else ())
                      for c in plan.chunks]
            logits = self._executor.forward(self.cache, chunks)
            self._apply(self.scheduler.commit(plan))
            rows, samples = [], []
            row = 0
            for c in plan.chunks:
                if not c.needs_logits:
                    continue
                owner = self._sample_of(c.seq)
                if owner is not None:
                    # Samples that fork from this prompt take their first token from its logits.
                    group = [owner] + [self._sample_of(ch) for ch in c.seq.children
                                       if not ch.output and self._sample_of(ch) is not None
                                       and c.start + len(c.tokens) == len(c.seq.prompt)]
                    for s in group:
                        rows.append(row)
                        samples.append(s)
                row += 1
            if samples:
                tokens, logprobs = sample_rows(logits[rows], [s.state for s in samples])
                for sample, token, lp in zip(samples, tokens, logprobs):
                    self._on_token(sample, token, lp)
            self.metrics.on_step(plan.num_tokens, len(plan.chunks), time.perf_counter() - started,
                                 len(plan.preempted))
            return True

    def _sample_of(self, seq: Seq) -> _Sample | None:
        req = self._requests.get(seq.request_id)
        if req is None or seq.index >= len(req.samples):
            return None
        sample = req.samples[seq.index]
        return None if sample.finished else sample

    def _apply(self, ops) -> None:
        for op in ops:
            if op.kind == "add":
                self.cache.add(op.seq_id)
            elif op.kind == "fork":
                self.cache.fork(op.parent, op.seq_id, op.position)
            else:
                self.cache.remove(op.seq_id)

    def _on_token(self, sample: _Sample, token: int, logprobs) -> None:
        seq = sample.seq
        req = self._requests.get(seq.request_id)
        if req is None or sample.finished:
            return  # cancelled during this step (e.g. from an on_token callback)
        seq.output.append(token)
        finish = None
        if token in sample.state.end_ids:
            text, finish = sample.stops.feed(sample.detok.flush()) + sample.stops.flush(), "stop"
        else:
            text = sample.stops.feed(sample.detok.add(token))
            if sample.stops.stopped:
                finish = "stop"
            elif len(seq.output) >= sample.budget:
                text += sample.stops.feed(sample.detok.flush())
                text += sample.stops.flush()
                finish = "stop" if sample.stops.stopped else "length"
        self.metrics.on_token(seq.request_id)
        req.stream.push(Delta(text, token, finish, seq.index, logprobs))
        if finish is not None:
            self._release(sample)
            if all(s.finished for s in req.samples):
                self._requests.pop(seq.request_id, None)
                self.metrics.on_finish(seq.request_id)

    def _release(self, sample: _Sample) -> None:
        if not sample.finished:
            sample.finished = True
            self._apply(self.scheduler.release(sample.seq))

    def _fail_all(self, err: Exception) -> None:
        """A step failed: fail every request and start from a clean cache."""
        failed = list(self._requests.values())
        self._requests.clear()
        try:
            self._reset_state()
        except Exception:  # noqa: BLE001  (keep the original error for the streams)
            log.exception("could not reset the KV cache")
        wrapped = err if isinstance(err, KilnError) else KilnError(f"generation failed: {err}")
        for req in failed:
            req.stream.fail(wrapped)


def _close_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def _params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    params = params or SamplingParams()
    if overrides:
        params = params.replace(**overrides)
    return params
