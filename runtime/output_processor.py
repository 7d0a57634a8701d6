"""From sampled tokens to what a client sees: detokenize, hold back and cut stop strings,
decide when a sample is finished. Pure Python over plain values (no TVM, no engine, no
stream): the engine core feeds it each sampled token and pushes the resulting delta.

A sample finishes with "stop" on an end token (EOS or a stop token id) or a stop string,
and with "length" when it has produced its budget (``max_tokens``, or what the context
window leaves after the prompt). An end token's own text is not emitted; a stop string and
whatever follows it never reach the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .detokenizer import IncrementalDetokenizer
from .stop import StopMatcher


@dataclass(eq=False)
class OutputState:
    """One sample's text state between steps."""

    detok: IncrementalDetokenizer
    stops: StopMatcher
    end_ids: frozenset[int]
    budget: int
    produced: int = 0
    finish_reason: str | None = field(default=None, init=False)

    @classmethod
    def create(cls, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str], end_ids: frozenset[int],
               budget: int) -> "OutputState":
        return cls(IncrementalDetokenizer(tokenizer, prompt_ids), StopMatcher(stop), end_ids, budget)


@dataclass(frozen=True)
class TokenOutput:
    text: str  # newly released text ("" while a character or possible stop string is held back)
    finish_reason: str | None  # None while the sample goes on


def process_token(state: OutputState, token: int) -> TokenOutput:
    """Account one sampled token of a sample that has not finished."""
    if state.finish_reason is not None:
        raise ValueError("the sample has already finished")
    state.produced += 1
    stops = state.stops
    if token in state.end_ids:
        text, finish = stops.feed(state.detok.flush()) + stops.flush(), "stop"
    else:
        text = stops.feed(state.detok.add(token))
        if stops.stopped:
            finish = "stop"
        elif state.produced >= state.budget:
            text += stops.feed(state.detok.flush()) + stops.flush()
            finish = "stop" if stops.stopped else "length"
        else:
            finish = None
    state.finish_reason = finish
    return TokenOutput(text, finish)
