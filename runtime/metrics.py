"""Serving metrics in Prometheus' data model (``prometheus_client``), one registry per
engine so several engines in one process never share series.

Histograms: time to first token, inter-token latency (per sample: with n > 1 each sample's
own gaps), step time, request latency. Counters: requests accepted / finished (by finish
reason) / aborted / failed / rejected, preemptions, failed steps, prompt and generated
tokens. Gauges are read at scrape time from the snapshot the engine core publishes each
step (queue depth, running requests, KV pages held by requests and by the prefix cache),
so a scrape never waits for the engine. The KV cache's size (bytes, tokens, full-context
sequences, bytes per token, and its dtype as ``kiln_kv_cache_info``) is set once at load.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily

RATE_WINDOW_S = 10
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> help of the gauges read from the engine's snapshot (``EngineStats.gauges``).
GAUGES = {
    "queue_depth": "Requests waiting to be scheduled (new or preempted).",
    "running_requests": "Sequences in the KV cache this step.",
    "kv_pages_total": "KV-cache pages in all.",
    "kv_pages_used": "KV-cache pages in use (by requests or by the prefix cache).",
    "kv_pages_requests": "KV-cache pages referred to by running requests.",
    "kv_pages_prefix_cached": "KV-cache pages held only by the prefix cache (evictable).",
    "kv_page_usage_ratio": "kv_pages_used / kv_pages_total.",
    "prefix_holders": "Cached prompt prefixes.",
    "engine_healthy": "1 while the engine core runs and makes progress, else 0.",
    "draining": "1 while shutting down (new requests are refused).",
    "seconds_since_last_step": "Time since the engine core last finished a step or polled its queue.",
}


class _TokenRate:
    """Generated tokens per second over the last RATE_WINDOW_S seconds."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buckets: collections.deque[list] = collections.deque()  # [second, tokens]

    def add(self, n: int, now: float) -> None:
        second = int(now)
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += n
            else:
                self._buckets.append([second, n])
            while self._buckets and self._buckets[0][0] <= second - RATE_WINDOW_S:
                self._buckets.popleft()

    def per_second(self, now: float) -> float:
        second = int(now)
        with self._lock:
            return sum(n for s, n in self._buckets if s > second - RATE_WINDOW_S) / RATE_WINDOW_S


class _Gauges:
    """A collector that reads the gauges at scrape time from ``source()``."""

    def __init__(self, source: Callable[[], dict[str, float]], rate: _TokenRate, started: float):
        self._source, self._rate, self._started = source, rate, started

    def collect(self):
        now = time.time()
        values = {**self._source(), "generated_tokens_per_second": self._rate.per_second(now)}
        helps = {**GAUGES, "generated_tokens_per_second": f"Generated tokens per second over the last "
                                                          f"{RATE_WINDOW_S} s."}
        for name, value in values.items():
            family = GaugeMetricFamily(f"kiln_{name}", helps[name])
            family.add_metric([], float(value))
            yield family


class EngineMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kiln_inter_token_latency_seconds",
                             "Time between consecutive tokens of one sample of a request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("kiln_step_seconds", "Duration of one engine step (one forward and sampling).",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.request_time = Histogram("kiln_request_seconds", "Time from a request's arrival to its end.",
                                      buckets=REQUEST_BUCKETS, registry=r)
        self._requests = Counter("kiln_requests", "Requests accepted.", registry=r)
        self._finished = Counter("kiln_requests_finished", "Requests finished, by the first sample's finish reason.",
                                 ["reason"], registry=r)
        self._aborted = Counter("kiln_requests_aborted", "Requests cancelled by their client or a disconnect.",
                                registry=r)
        self._failed = Counter("kiln_requests_failed", "Requests ended by an error.", registry=r)
        self._rejected = Counter("kiln_requests_rejected", "Requests refused: queue full or shutting down.",
                                 registry=r)
        self._preemptions = Counter("kiln_preemptions", "Sequences preempted (recompute) for lack of KV pages.",
                                    registry=r)
        self._failed_steps = Counter("kiln_failed_steps", "Engine steps whose forward or KV operations failed.",
                                     registry=r)
        self._generated = Counter("kiln_generated_tokens", "Tokens generated.", registry=r)
        self._processed = Counter("kiln_processed_tokens", "Tokens run through the model (prompts, recomputes, "
                                                           "decodes).", registry=r)
        self.grammar_compile = Histogram(
            "kiln_grammar_compile_seconds", "Time to compile and check a new output constraint (JSON schema, regex, "
            "grammar, forced tool call); constraints found in the cache are not counted.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_masks = Histogram(
            "kiln_grammar_mask_seconds", "Time per step to compute the token masks of its constrained samples.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self._grammar_hits = Counter("kiln_grammar_cache_hits", "Output constraints found compiled in the cache.",
                                     registry=r)
        self._constrained = Counter("kiln_constrained_requests", "Requests accepted with a constrained output, by "
                                                                 "kind (json, regex, choice, grammar).",
                                    ["kind"], registry=r)
        self._kv_info = Info("kiln_kv_cache", "The KV cache's element dtype and page size (tokens).", registry=r)
        self._kv_sizes = {
            "bytes": Gauge("kiln_kv_cache_bytes", "Bytes of the KV cache's pages.", registry=r),
            "tokens": Gauge("kiln_kv_cache_capacity_tokens", "Tokens the KV cache holds over all sequences.",
                            registry=r),
            "full_context_sequences": Gauge("kiln_kv_cache_full_context_sequences",
                                            "Sequences of the whole context window the KV cache holds at once.",
                                            registry=r),
            "bytes_per_token": Gauge("kiln_kv_bytes_per_token", "Bytes of KV one cached token takes over all "
                                                                "layers.", registry=r),
        }
        self._rate = _TokenRate()
        self._gauge_source: Callable[[], dict[str, float]] = dict
        r.register(_Gauges(lambda: self._gauge_source(), self._rate, time.time()))

    def read_gauges_from(self, source: Callable[[], dict[str, float]]) -> None:
        self._gauge_source = source

    # -- written by the engine ----------------------------------------------------------
    def set_kv_capacity(self, capacity) -> None:
        """The KV cache's size (a ``kv_sizing.KVCapacity``), once at load."""
        self._kv_info.info({"dtype": capacity.dtype, "page_size": str(capacity.page_size)})
        for name, gauge in self._kv_sizes.items():
            gauge.set(getattr(capacity, name))

    def on_submit(self) -> None:
        self._requests.inc()

    def on_constrained(self, kind: str) -> None:
        self._constrained.labels(kind).inc()

    def on_grammar(self, seconds: float | None) -> None:
        """A constraint compiled in ``seconds``, or (None) found in the cache."""
        if seconds is None:
            self._grammar_hits.inc()
        else:
            self.grammar_compile.observe(seconds)

    def on_reject(self) -> None:
        self._rejected.inc()

    def on_tokens(self, n: int, now_wall: float) -> None:
        self._generated.inc(n)
        self._rate.add(n, now_wall)

    def on_step(self, tokens: int, seconds: float, preempted: int) -> None:
        self._processed.inc(tokens)
        if preempted:
            self._preemptions.inc(preempted)
        self.step_time.observe(seconds)

    def on_failed_step(self) -> None:
        self._failed_steps.inc()

    def on_end(self, outcome: str, seconds: float) -> None:
        """A request ended: outcome is a finish reason ("stop", "length", "abort"...),
        "cancelled" or "failed"."""
        if outcome == "cancelled":
            self._aborted.inc()
        elif outcome == "failed":
            self._failed.inc()
        else:
            self._finished.labels(outcome).inc()
        self.request_time.observe(seconds)

    # -- read ---------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    @property
    def requests(self) -> int:
        return int(self.value("kiln_requests_total"))

    @property
    def finished(self) -> int:
        return int(sum(s.value for m in self._finished.collect() for s in m.samples if s.name.endswith("_total")))

    @property
    def aborted(self) -> int:
        return int(self.value("kiln_requests_aborted_total"))

    @property
    def failed(self) -> int:
        return int(self.value("kiln_requests_failed_total"))

    @property
    def rejected(self) -> int:
        return int(self.value("kiln_requests_rejected_total"))

    @property
    def preemptions(self) -> int:
        return int(self.value("kiln_preemptions_total"))
