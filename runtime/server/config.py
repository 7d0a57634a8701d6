"""The HTTP server's settings, validated once (from ``kiln serve``'s flags or a caller)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """``api_key``: required as ``Authorization: Bearer <key>`` on ``/v1/*`` (and, with
    ``api_key_all_routes``, on ``/health``, ``/ready`` and ``/metrics`` too).
    ``max_request_bytes``: larger bodies get 413 (2 MiB holds any prompt a 128k-token
    context can take; the default model's 8k context needs ~40 KB). ``body_timeout_s``:
    a body not received in full by then gets 408. ``header_timeout_s``: a connection that
    has not sent a whole request head by then is closed (half-open and slow clients).
    ``keep_alive_s``: idle keep-alive connections are closed after this. ``shutdown_timeout_s``:
    on SIGTERM / SIGINT, running requests get this long to finish before they are ended
    with finish reason "abort". ``sse_ping_s``: SSE streams send a keep-alive comment
    after this much silence. ``retry_after_s``: the Retry-After of 429 and 503 answers."""

    api_key: str | None = None
    api_key_all_routes: bool = False
    max_request_bytes: int = 2 * 1024 * 1024
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    sse_ping_s: float = 15.0
    retry_after_s: int = 1

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        for name in ("body_timeout_s", "header_timeout_s", "keep_alive_s", "sse_ping_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.shutdown_timeout_s, (int, float)) or not 0 <= self.shutdown_timeout_s < math.inf:
            raise ValueError(f"shutdown_timeout_s must be >= 0 seconds, got {self.shutdown_timeout_s!r}")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be a non-negative integer, got {self.retry_after_s!r}")
