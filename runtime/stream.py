"""A request's stream: deltas flow from the engine thread to one consumer, which reads
them as a blocking iterator, an async iterator, or not at all (callback / ``result()``).

The stream carries errors: if the engine fails the request, the consumer's next read
raises that error. Closing an iterator early (``break``) cancels the request, which frees
its KV pages at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from .errors import KilnError
from .outputs import Choice, Completion, Delta

_END = object()
log = logging.getLogger("kiln.stream")


class RequestCancelled(KilnError):
    """The request was cancelled before it finished."""


class RequestStream:
    """``cancel(request_id)`` is called when the consumer leaves early; ``on_end(stream)``
    once, when the stream ends (finished, failed or cancelled)."""

    def __init__(self, request_id: str, n: int, prompt_tokens: int, cancel: Callable[[str], None],
                 on_delta: Callable[[Delta], None] | None = None,
                 on_end: Callable[["RequestStream"], None] | None = None, tool_use=None):
        """``tool_use`` (tool_use.ToolUse): read tool calls out of each finished sample."""
        self.request_id = request_id
        self.tool_use = tool_use
        self.prompt_tokens = prompt_tokens
        self._n = n
        self._cancel = cancel
        self._on_delta = on_delta
        self._on_end = on_end
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._texts = [[] for _ in range(n)]
        self._ids = [[] for _ in range(n)]
        self._logprobs = [[] for _ in range(n)]
        self._finish: list[str | None] = [None] * n
        self._error: BaseException | None = None
        self._closed = False  # no delta is taken after the end (an abort races the engine)
        self._done = threading.Event()
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    # -- engine side (engine thread) ------------------------------------------------------
    def push(self, delta: Delta) -> None:
        with self._lock:
            if self._closed:
                return
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._texts[delta.index].append(delta.text)
            if delta.token_id is not None:
                self._ids[delta.index].append(delta.token_id)
            if delta.logprobs is not None:
                self._logprobs[delta.index].append(delta.logprobs)
            if delta.finish_reason is not None:
                self._finish[delta.index] = delta.finish_reason
            last = all(f is not None for f in self._finish)
            if last:
                self._closed = True
        if self._on_delta is not None:
            self._on_delta(delta)
        self._emit(delta)
        if last:
            self._end()

    def fail(self, error: BaseException) -> bool:
        """End the stream with ``error`` (the consumer's next read raises it); False if it
        had already ended."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._error = error
        self._end()
        return True

    def _end(self) -> None:
        self.finished_at = time.perf_counter()
        self._done.set()
        self._emit(_END)
        if self._on_end is not None:
            self._on_end(self)

    def _emit(self, item) -> None:
        # Under the lock: an async consumer attaching between the check and the put would
        # drain ``_sync`` first and never see this item.
        with self._lock:
            if self._async is None:
                self._sync.put(item)
                return
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody reads any more
                pass

    # -- consumer side --------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        if not self._done.is_set():
            log.info("request %s cancelled by its consumer", self.request_id)
            self._cancel(self.request_id)

    def _delta(self, item) -> Delta | None:
        """The delta, or None at the end of the stream (raising the stream's error)."""
        if item is _END:
            if self._error is not None:
                raise self._error
            return None
        return item

    def __iter__(self):
        try:
            while (delta := self._delta(self._sync.get())) is not None:
                yield delta
        finally:
            self.cancel()

    async def __aiter__(self):
        with self._lock:
            if self._async is None:
                self._loop = asyncio.get_running_loop()
                self._async = asyncio.Queue()
                while True:  # deltas that arrived before the consumer attached
                    try:
                        self._async.put_nowait(self._sync.get_nowait())
                    except queue.Empty:
                        break
        try:
            while (delta := self._delta(await self._async.get())) is not None:
                yield delta
        finally:
            self.cancel()

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request finishes; raise its error, if any."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.completion()

    def _with_tool_calls(self, choice: Choice) -> Choice:
        content, calls = self.tool_use.parse(choice.text)
        if not calls:
            return choice
        finish = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        return dataclasses.replace(choice, content=content, tool_calls=tuple(calls), finish_reason=finish)

    def completion(self) -> Completion:
        with self._lock:
            choices = tuple(
                Choice(i, "".join(self._texts[i]), tuple(self._ids[i]), self._finish[i] or "stop",
                       tuple(self._logprobs[i]) if self._logprobs[i] else None)
                for i in range(self._n))
        if self.tool_use is not None:
            choices = tuple(self._with_tool_calls(c) for c in choices)
        first = (self.first_token_at or self.finished_at or time.perf_counter()) - self.created
        total = (self.finished_at or time.perf_counter()) - self.created
        return Completion(self.request_id, choices, self.prompt_tokens, first, total)
