"""The ``delta`` objects of a streamed chat completion, one sample's text at a time.

Without tools a delta's text is its content. With tools each sample's text goes through a
``StreamingToolParser``: content comes out as soon as it cannot be part of a call, and a
call as OpenAI streams it (its first delta carries the id, type and name with empty
arguments, the next ones append arguments) once it is complete; a sample that ended after
calls finishes with "tool_calls". The first delta of each sample carries the role.
"""

from __future__ import annotations

from ..outputs import Delta
from ..tool_calls import ContentDelta


class ChatPieces:
    def __init__(self, tool_use=None):
        self._tool_use = tool_use
        self._parsers: dict = {}  # sample index -> StreamingToolParser
        self._called: set[int] = set()  # samples that emitted a call
        self._started: set[int] = set()

    def of(self, delta: Delta) -> list[tuple[dict, str | None]]:
        """(delta object, finish reason) pairs for one engine delta; [] if it says nothing."""
        if self._tool_use is None:
            events = [ContentDelta(delta.text)] if delta.text else []
        else:
            parser = self._parsers.get(delta.index) or self._parsers.setdefault(delta.index, self._tool_use.parser())
            events = parser.feed(delta.text) if delta.text else []
            if delta.finish_reason is not None:
                events += parser.finish()
        pieces: list[dict] = []
        for e in events:
            if isinstance(e, ContentDelta):
                if e.text:
                    pieces.append({"content": e.text})
                continue
            self._called.add(delta.index)
            call = {"index": e.index, "function": {"arguments": e.arguments}}
            if e.id is not None:
                call = {"index": e.index, "id": e.id, "type": "function",
                        "function": {"name": e.name, "arguments": e.arguments}}
            pieces.append({"tool_calls": [call]})
        finish = delta.finish_reason
        if finish == "stop" and delta.index in self._called:
            finish = "tool_calls"
        if finish is not None or (delta.logprobs and not pieces):
            pieces.append({})
        if not pieces:
            return []
        if delta.index not in self._started:
            self._started.add(delta.index)
            pieces[0] = {"role": "assistant", "content": pieces[0].get("content", ""), **pieces[0]}
        return [(p, finish if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
