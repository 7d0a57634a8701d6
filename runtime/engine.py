"""The serving engine: continuous batching over an artifact's paged KV cache.

    engine = Engine.load("artifacts/smollm2-135m-instruct-llvm")
    print(engine.generate("The capital of France is", max_tokens=16).text)
    for delta in engine.stream([{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1):
        print(delta.text, end="", flush=True)

``Engine`` is the client side; ``EngineCore`` (core.py) owns the scheduler, the KV cache
and every request's state on its own thread. A call here validates and tokenizes on the
caller's thread, hands the request to the core through a queue that never blocks on a
step, and returns the request's stream; tokens arrive in it as the core produces them.
Stats come from the snapshot the core publishes each step. Nothing a client calls waits
for a forward pass. (TVM's kernels release the GIL, so the core and the callers' threads
share one process: measured with ``bench/serving_load.py``.)

A prompt is a string (tokenized with the tokenizer's BOS rule), a list of token ids, or a
list of chat messages (rendered by the model's chat template).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from . import kv_budget
from .artifact import Manifest, load_manifest, verify_files
from .core import AbortRequest, AddRequest, EngineCore, EngineStats, FinishAll, RequestRecord, RunInCore, Stop
from .device import open_device
from .errors import InvalidRequestError, KilnError, PromptTooLongError
from .executor import CacheConfig, PagedExecutor
from .guided import GrammarCompiler, Guide
from .kv_budget import KVCacheMemory
from .kv_sizing import KVCapacity, cache_pages, kv_bytes_per_token, kv_dtype, tokens_for, tokens_in_budget
from .metrics import EngineMetrics
from .model_config import ModelConfig
from .outputs import Completion, Delta
from .sampling import SamplingParams
from .scheduler import POLICIES, Scheduler, SchedulerConfig
from .stream import RequestCancelled, RequestStream
from .tokenizer import Message, Tokenizer
from .tool_calls import detect_format, marker_token_ids
from .tool_use import prepare_chat

log = logging.getLogger("kiln.engine")
Prompt = str | Sequence[int] | Sequence[Message]


class EngineOverloadedError(KilnError):
    """Too many requests are waiting; try again later."""


class EngineUnavailableError(KilnError):
    """The engine is shutting down, closed, or has failed; try again later (elsewhere)."""


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits, validated once. ``max_total_tokens``: KV-cache capacity in tokens
    over all sequences (default: the context window, at least 8192; never less than one
    full-context sequence); ``kv_cache_memory``: the KV cache's memory budget instead, a
    byte count or a fraction of the memory available at load ("2GiB", "800M", 123456,
    "0.3", "30%", 0.3: ``kv_budget.py``; a KVCacheMemory once validated), checked then
    against that memory and refused if it cannot hold one full-context sequence;
    ``max_batched_tokens``: tokens per step (the prefill chunk); None: the artifact's
    largest static prefill bucket (128 tokens on CPU: a step then runs in one static
    piece, and the streams decoding beside a prefill wait ~2 decode steps, not ~6 as with
    512; a lone prompt's prefill takes as long either way), else 512;
    ``max_waiting``: queued requests beyond which ``submit`` refuses new ones;
    ``stall_timeout_s``: a core that publishes nothing for this long is reported
    unhealthy."""

    max_num_seqs: int = 16
    max_total_tokens: int | None = None
    kv_cache_memory: KVCacheMemory | str | int | float | None = None
    max_batched_tokens: int | None = None
    watermark: float = 0.01
    policy: str = "fcfs"
    prefix_reuse: bool = True
    max_waiting: int = 256
    stall_timeout_s: float = 60.0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_batched_tokens", "max_waiting"):
            value = getattr(self, name)
            if value is None and name == "max_batched_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_total_tokens is not None and (not isinstance(self.max_total_tokens, int)
                                                  or self.max_total_tokens < 1):
            raise ValueError(f"max_total_tokens must be a positive integer, got {self.max_total_tokens!r}")
        if self.kv_cache_memory is not None:
            if self.max_total_tokens is not None:
                raise ValueError("give max_total_tokens or kv_cache_memory (a token count or a memory budget for "
                                 "the KV cache), not both")
            # Parsed once here; the engine only ever sees a KVCacheMemory.
            object.__setattr__(self, "kv_cache_memory", KVCacheMemory.parse(self.kv_cache_memory))
        if self.max_batched_tokens is not None and self.max_batched_tokens < self.max_num_seqs:
            raise ValueError("max_batched_tokens must be >= max_num_seqs (each running sequence decodes a token)")
        if not 0.0 <= self.watermark < 0.5:
            raise ValueError(f"watermark must be in [0, 0.5), got {self.watermark}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")


class Engine:
    def __init__(self, model: ModelConfig, executor, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 manifest: Manifest | None = None, folder: Path | None = None, background: bool = True):
        """``background=False``: no core thread; the caller drives ``step()`` (tests)."""
        self._background = background
        self.config = model
        self.engine_config = _resolved(config or EngineConfig(), manifest)
        self.manifest = manifest
        self.folder = folder
        self.tokenizer = tokenizer
        self.metrics = EngineMetrics()
        kv_cache = manifest.kv_cache if manifest is not None else {}
        bytes_per_token = kv_bytes_per_token(model, kv_cache)
        budget = _kv_budget(self.engine_config, executor, manifest)
        cache_config, scheduler_config = _sizes(model, executor.page_size, self.engine_config, bytes_per_token,
                                                budget)
        self.kv_capacity = KVCapacity(kv_dtype(kv_cache), bytes_per_token, executor.page_size,
                                      scheduler_config.total_pages, model.context_length, budget)
        self.metrics.set_kv_capacity(self.kv_capacity)
        log.info("%s", self.kv_capacity.describe())
        self.core = EngineCore(executor, cache_config, scheduler_config, self.metrics, self._dequeued)
        # Guards the client-side registry below; held for a few dict operations, never
        # across a step (the core never takes it while it computes).
        self._lock = threading.Lock()
        self._live: dict[str, RequestStream] = {}
        self._queued = 0  # requests submitted and not yet scheduled (bounded by max_waiting)
        self._draining = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._tool_syntax_cache: tuple[str, dict[str, int]] | None = None
        self.metrics.read_gauges_from(self._gauges)

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

    # The core's state, for tests and tools that drive ``step()`` themselves.
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def cache(self):
        return self.core.cache

    @property
    def _executor(self):
        return self.core.executor

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles and caches the constraints of constrained requests (made on first use)."""
        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.config.vocab_size,
                                                 self.tokenizer.eos_token_ids, on_compile=self.metrics.on_grammar)
            return self._grammars

    def _tool_syntax(self) -> tuple[str, dict[str, int]]:
        """The model's tool-call format (from its chat template) and which call markers are
        tokens of its vocabulary; worked out once."""
        if self._tool_syntax_cache is None:
            fmt = detect_format(self.tokenizer.chat_template)
            self._tool_syntax_cache = (fmt, marker_token_ids(self.tokenizer.to_json()) if fmt != "kiln_json" else {})
        return self._tool_syntax_cache

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt served: the context window less one output token (the KV
        cache is sized to hold it)."""
        return min(self.config.context_length - 1, self.scheduler.config.max_prompt_tokens)

    # -- public API -----------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Delta], None] | None = None,
               tools: Sequence[Mapping] | None = None, tool_choice=None, **overrides) -> RequestStream:
        """Queue a request; returns its stream at once (never waits for a step). Bad input
        raises here, before any work is queued; so does a full queue
        (EngineOverloadedError) or a draining / closed engine (EngineUnavailableError).
        The prompt is tokenized on the caller's thread. ``on_token`` runs on the core
        thread for every delta; if it raises, the request fails. ``tools`` / ``tool_choice``
        (OpenAI's forms, with chat messages): the completion's choices carry the parsed
        ``tool_calls`` (tool_use.py)."""
        params = _params(params, overrides)
        params.check_vocab(self.config.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", "must be an integer")
        chat = prepare_chat(prompt, tools, tool_choice, params.guide, self._tool_syntax)
        if chat.guide is not params.guide:
            params = params.replace(guide=chat.guide)
        # Compiled and checked here, on the caller's thread: a bad schema never reaches the core.
        grammars = self.grammars.matchers(params.guide, params.n) if params.guide is not None else None
        prompt_ids = self.encode_prompt(chat.messages, chat.render_tools)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, params.n, len(prompt_ids), self.abort, on_token, self._stream_ended,
                               chat.tool_use)
        # Output budget: max_tokens, and what the context window leaves after the prompt.
        budget = min(params.max_tokens, self.config.context_length - len(prompt_ids))
        end_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                        else self.tokenizer.eos_token_ids)
        record = RequestRecord.create(request_id, params, prompt_ids, priority, stream, self.tokenizer, end_ids,
                                      budget, grammars)
        with self._lock:
            if self._closed or self._draining:
                self.metrics.on_reject()
                raise EngineUnavailableError("the engine is shutting down" if self._draining
                                             else "the engine is closed")
            if self.core.dead is not None:
                raise EngineUnavailableError(f"the engine has failed ({self.core.dead})")
            if request_id in self._live:
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
            if self._queued >= self.engine_config.max_waiting:
                self.metrics.on_reject()
                raise EngineOverloadedError(
                    f"{self._queued} requests are already waiting (max_waiting); retry later")
            self._live[request_id] = stream
            self._queued += 1
        self.metrics.on_submit()
        if params.guide is not None:
            self.metrics.on_constrained(params.guide.kind)
        self.core.inbox.put(AddRequest(record))
        self._ensure_thread()
        return stream

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 on_token: Callable[[Delta], None] | None = None, priority: int = 0, **overrides) -> Completion:
        """Generate to completion. ``overrides`` are SamplingParams fields (``max_tokens=``,
        ``temperature=``, ``top_k=``, ``top_p=``, ``seed=``, ``stop=``, ``n=``, ``guide=``...)
        or ``response_format=`` (OpenAI's dict, or a pydantic model class: JSON of its schema).
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
        """``async for`` over the deltas (same semantics as ``stream``). The prompt is
        tokenized on the calling thread: from an event loop, submit in a worker thread."""
        return self.submit(prompt, params, priority=priority, **overrides).__aiter__()

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its stream ends now with RequestCancelled, and the core frees
        its pages before its next step. False if no such request is running."""
        with self._lock:
            stream = self._live.get(request_id)
        if stream is None:
            return False
        cancelled = stream.fail(RequestCancelled(f"request {request_id} was cancelled"))
        self.core.inbox.put(AbortRequest(request_id))
        return cancelled

    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping] | None = None) -> list[int]:
        """A string, chat messages (with the ``tools`` their template renders), or token ids
        -> token ids (validated)."""
        limit = self.max_prompt_tokens
        if isinstance(prompt, str):
            # A text longer than the limit times the longest token's text cannot fit: refuse
            # it before tokenizing (which takes ~1 us a character).
            if len(prompt) > (limit + 1) * self.tokenizer.max_token_chars:
                raise PromptTooLongError(f"prompt: {len(prompt)} characters cannot fit the {limit}-token limit")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary "
                                                    f"[0, {self.config.vocab_size})")
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode_chat(prompt, tools=tools)
        else:
            raise InvalidRequestError("prompt", "must be a string, token ids, or a list of chat messages")
        if not ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        if len(ids) > limit:
            raise PromptTooLongError(
                f"prompt: {len(ids)} tokens do not fit: at most {limit} prompt tokens (a context window of "
                f"{self.config.context_length} tokens, at least one left for the output)")
        return ids

    def stats(self) -> EngineStats:
        """The snapshot the core published after its last step (never waits for one)."""
        return self.core.stats

    def health(self) -> EngineHealth:
        """Whether the core is alive and making progress (for ``/health``)."""
        stats = self.core.stats
        silent = time.monotonic() - stats.published_at
        if self.core.dead is not None:
            return EngineHealth(False, f"the engine core failed: {self.core.dead}", silent)
        if self._background and self._thread is not None and not self._thread.is_alive() and not self._closed:
            return EngineHealth(False, "the engine core thread has died", silent)
        if self._background and silent > self.engine_config.stall_timeout_s:
            return EngineHealth(False, f"the engine core has made no progress for {silent:.0f} s", silent)
        return EngineHealth(True, "ok", silent)

    @property
    def draining(self) -> bool:
        return self._draining

    def idle(self) -> bool:
        """No request is live, queued or holding pages."""
        with self._lock:
            live = bool(self._live)
        stats = self.core.stats
        return not live and self.core.inbox.empty() and not stats.running and not stats.waiting \
            and not stats.requests

    def drain(self, timeout: float, reason: str = "abort") -> bool:
        """Graceful shutdown: refuse new requests, let running ones finish for up to
        ``timeout`` seconds, then end the rest with a final delta whose finish reason is
        ``reason``. True if every request finished on its own."""
        with self._lock:
            self._draining = True
        if self.wait_idle(timeout):
            return True
        log.warning("shutdown: ending %d requests still running after %.1f s", len(self._live), timeout)
        self.core.inbox.put(FinishAll(reason))
        self._ensure_thread()
        self.wait_idle(10.0)
        return False

    def wait_idle(self, timeout: float) -> bool:
        """Poll ``idle()`` for up to ``timeout`` seconds; whether it became idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def run_in_core(self, fn: Callable[[], object], timeout: float = 60.0):
        """Run ``fn()`` on the core between two steps and return its result: for tests and
        tools that inspect the core's state (this does wait for the step in flight)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.core.inbox.put(RunInCore(fn, future))
        if not self._background:
            self.core.step()
        else:
            self._ensure_thread()
        return future.result(timeout)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live.values())
        for stream in live:
            stream.fail(EngineUnavailableError("the engine was closed"))
        self.core.inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)

    def step(self) -> bool:
        """Apply queued requests and aborts, then run one step (``background=False``)."""
        return self.core.step()

    # -- internals ------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if not self._background:
            return
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            first = self._thread is None
            self._thread = threading.Thread(target=self.core.run, name="kiln-engine", daemon=True)
            self._thread.start()
        if first:
            # The core thread is a daemon (it must not keep a program alive), but one
            # still inside the TVM runtime while the interpreter tears down aborts the
            # process ("terminate called without an active exception"): a caller that
            # got its last token returns while the core still frees the sequence's
            # pages. Join it at exit, before teardown.
            atexit.register(_close_at_exit, weakref.ref(self))

    def _stream_ended(self, stream: RequestStream) -> None:
        with self._lock:
            if self._live.get(stream.request_id) is stream:
                del self._live[stream.request_id]

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _gauges(self) -> dict[str, float]:
        health = self.health()
        return {**self.core.stats.gauges(), "engine_healthy": float(health.ok), "draining": float(self._draining),
                "seconds_since_last_step": health.silent_s}


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    detail: str
    silent_s: float  # seconds since the core last published a snapshot


def _resolved(config: EngineConfig, manifest: Manifest | None) -> EngineConfig:
    if config.max_batched_tokens is not None:
        return config
    buckets = manifest.dispatch.static_prefill if manifest is not None else ()
    return dataclasses.replace(config, max_batched_tokens=max(max(buckets, default=512), config.max_num_seqs))


def _kv_budget(ec: EngineConfig, executor, manifest: Manifest | None) -> int | None:
    """``kv_cache_memory`` in bytes, checked against the memory its device has now (a GPU
    artifact's cache lives in GPU memory), or None without a budget."""
    if ec.kv_cache_memory is None:
        return None
    on_gpu = manifest is not None and manifest.target.device != "cpu"
    return ec.kv_cache_memory.resolve(kv_budget.available_memory(executor.device if on_gpu else None))


def _sizes(model: ModelConfig, page_size: int, ec: EngineConfig, bytes_per_token: int,
           budget: int | None) -> tuple[CacheConfig, SchedulerConfig]:
    """KV-cache and scheduler sizes. Capacity matches what is promised: a prompt of up to
    context - 1 tokens and its output always fit one sequence alone above the watermark,
    whatever ``max_total_tokens`` says (the cache grows to that); a ``budget`` (bytes) too
    small for that is refused (kv_sizing.py)."""
    if budget is None:
        total = tokens_for(ec.max_total_tokens or max(model.context_length, 8192), model.context_length,
                           page_size, ec.watermark)
    else:
        total = tokens_in_budget(budget, bytes_per_token, page_size, model.context_length, ec.watermark)
    total_pages = cache_pages(total, page_size)
    watermark = int(total_pages * ec.watermark)
    cache = CacheConfig(max_batch_size=ec.max_num_seqs, max_total_tokens=total,
                        prefill_chunk_size=ec.max_batched_tokens, page_size=page_size)
    scheduler = SchedulerConfig(max_num_seqs=ec.max_num_seqs, max_batched_tokens=ec.max_batched_tokens,
                                total_pages=total_pages, page_size=page_size, watermark_pages=watermark,
                                policy=ec.policy, prefix_reuse=ec.prefix_reuse)
    return cache, scheduler


def _close_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def _params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    params = params or SamplingParams()
    if "response_format" in overrides:  # OpenAI's form (a dict or a pydantic model class)
        overrides = dict(overrides)
        overrides["guide"] = Guide.from_response_format(overrides.pop("response_format"))
    if overrides:
        params = params.replace(**overrides)
    return params
