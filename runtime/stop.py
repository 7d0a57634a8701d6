"""Stop strings over streamed text.

Text that could be the beginning of a stop string is held back until the next delta
proves it is not (or the stream ends), so a stop string never leaks to the client, even
split across tokens.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # text received but not yet released
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add detokenized text; return the part safe to emit. Sets ``stopped`` when a
        stop string appears (the returned text then ends just before it)."""
        if self.stopped:
            return ""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        safe = len(self._pending) - self._hold
        # Release everything that cannot start a stop string.
        while safe < len(self._pending) and not self._could_start(self._pending[max(safe, 0):]):
            safe += 1
        safe = max(safe, 0)
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out

    def _could_start(self, tail: str) -> bool:
        return any(s.startswith(tail) for s in self._stops)

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
