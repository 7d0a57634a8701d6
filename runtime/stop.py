"""Stop strings over streamed text.

Text that could be the beginning of a stop string is held back until the next delta
proves it is not (or the stream ends), so a stop string never leaks to the client, even
split across tokens.

Matching is incremental: one KMP automaton per stop string (its failure table built once),
each fed every character once, so a character costs O(number of stops) amortized however
long the stops or the held-back text are. The state of stop ``s`` is the length of the
longest suffix of the text so far that is a proper prefix of ``s``; the held-back text is
the longest of these over all stops, and everything before it is released at once.

When a stop completes within a delta, the emitted text ends before the earliest-starting
occurrence of any stop that lies wholly in the text received so far, this delta included.
So the cut can depend on how the text was split into deltas, but only when one stop occurs
strictly inside another (``"bc"`` in ``"abcd"``: ``"abcd"`` in one delta cuts at ``a``,
``"abc"`` then ``"d"`` cuts after it, since ``"bc"`` completes first).
"""

from __future__ import annotations

from typing import Sequence


def _failure_table(stop: str) -> tuple[int, ...]:
    """KMP prefix function: ``table[i]`` is the length of the longest proper prefix of
    ``stop[:i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        stops = tuple(stops)
        self._stops = tuple(s for s in stops if s)
        # An empty stop (SamplingParams rejects them) occurs before any text: stop at once.
        self._stops_at_once = len(self._stops) < len(stops)
        self._automata = tuple((s, _failure_table(s)) for s in self._stops)
        self._chars = frozenset("".join(self._stops))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._idle = [0] * len(self._stops)
        self._states = list(self._idle)  # per stop: length of its current partial match
        self._active = False  # some state may be non-zero
        self._pending = ""  # text received but not yet released: the longest partial match
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add detokenized text; return the part safe to emit. Sets ``stopped`` when a
        stop string appears (the returned text then ends just before it)."""
        if self.stopped:
            return ""
        if self._stops_at_once:
            self.stopped, self._pending = True, ""
            return ""
        if not self._stops:
            return text
        automata, states, chars = self._automata, self._states, self._chars
        base = len(self._pending)  # positions below are in pending + text
        cut = -1
        for j, ch in enumerate(text):
            if ch not in chars:  # extends no partial match and starts none
                if self._active:
                    states[:] = self._idle
                    self._active = False
                continue
            pos = base + j
            # After a match, keep scanning this delta only while a longer stop could still
            # complete here having started before the cut (one stop inside another).
            if cut >= 0 and pos - self._longest + 1 >= cut:
                break
            for k, (stop, table) in enumerate(automata):
                q = states[k]
                while q and stop[q] != ch:
                    q = table[q - 1]
                if stop[q] == ch:
                    q += 1
                    if q == len(stop):
                        if cut < 0 or pos - q + 1 < cut:
                            cut = pos - q + 1
                        q = table[q - 1]
                states[k] = q
            self._active = True
        whole = self._pending + text
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return whole[:cut]
        # Each state grew by at most one per character, so the hold fits in ``whole``.
        split = len(whole) - max(states)
        self._pending = whole[split:]
        return whole[:split]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        self._states[:] = self._idle
        self._active = False
        return out
