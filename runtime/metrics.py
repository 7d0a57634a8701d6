"""Serving metrics, kept by the engine and rendered in the Prometheus text format.

Histograms: time to first token, inter-token latency, step time. Gauges are read from
the engine when rendering (queue depth, running requests, KV pages). Counters: requests,
tokens in and out, preemptions, rejections.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass, field

RATE_WINDOW_S = 10

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


class EngineMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.step_time = Histogram()
        self.requests = 0
        self.finished = 0
        self.aborted = 0
        self.rejected = 0
        self.preemptions = 0
        self.generated_tokens = 0
        self.processed_tokens = 0
        self._submitted: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._recent: collections.deque[list] = collections.deque()  # [second, tokens] buckets

    def _count_recent(self, now: float) -> None:
        second = int(now)
        if self._recent and self._recent[-1][0] == second:
            self._recent[-1][1] += 1
        else:
            self._recent.append([second, 1])
        while self._recent and self._recent[0][0] <= second - RATE_WINDOW_S:
            self._recent.popleft()

    def recent_tokens_per_second(self) -> float:
        now = int(time.time())
        with self._lock:
            return sum(n for sec, n in self._recent if sec > now - RATE_WINDOW_S) / RATE_WINDOW_S

    def on_submit(self, request_id: str) -> None:
        with self._lock:
            self.requests += 1
            self._submitted[request_id] = time.perf_counter()

    def on_token(self, request_id: str) -> None:
        now = time.perf_counter()
        with self._lock:
            self.generated_tokens += 1
            self._count_recent(time.time())
            last = self._last_token.get(request_id)
            if last is None:
                start = self._submitted.get(request_id)
                if start is not None:
                    self.ttft.observe(now - start)
            else:
                self.itl.observe(now - last)
            self._last_token[request_id] = now

    def on_step(self, tokens: int, sequences: int, seconds: float, preempted: int) -> None:
        with self._lock:
            self.processed_tokens += tokens
            self.preemptions += preempted
            self.step_time.observe(seconds)

    def on_finish(self, request_id: str) -> None:
        with self._lock:
            self.finished += 1
            self._forget(request_id)

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted += 1
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._submitted.pop(request_id, None)
        self._last_token.pop(request_id, None)

    def render(self, gauges: dict[str, float]) -> str:
        """Prometheus exposition text; ``gauges`` are current engine readings."""
        with self._lock:
            uptime = max(time.time() - self.started, 1e-9)
            lines = []
            lines += self.ttft.render("kiln_time_to_first_token_seconds", "Time from request to its first token.")
            lines += self.itl.render("kiln_inter_token_latency_seconds", "Time between consecutive tokens of a request.")
            lines += self.step_time.render("kiln_step_seconds", "Duration of one engine step (one forward).")
            counters = {
                "kiln_requests_total": (self.requests, "Requests accepted."),
                "kiln_requests_finished_total": (self.finished, "Requests finished."),
                "kiln_requests_aborted_total": (self.aborted, "Requests cancelled or disconnected."),
                "kiln_requests_rejected_total": (self.rejected, "Requests refused because the queue was full."),
                "kiln_preemptions_total": (self.preemptions, "Sequences preempted for lack of KV pages."),
                "kiln_generated_tokens_total": (self.generated_tokens, "Tokens generated."),
                "kiln_processed_tokens_total": (self.processed_tokens, "Tokens run through the model."),
            }
            for name, (value, help_text) in counters.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
            average = self.generated_tokens / uptime
        gauges = {**gauges, "generated_tokens_per_second": self.recent_tokens_per_second(),
                  "generated_tokens_per_second_since_start": average}
        for name, value in gauges.items():
            lines += [f"# TYPE kiln_{name} gauge", f"kiln_{name} {value}"]
        return "\n".join(lines) + "\n"
