"""What a request produces: streamed deltas and the final completion."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import TokenLogprobs
from .tool_calls import ToolCall


@dataclass(frozen=True)
class Delta:
    """One generated token's contribution to sample ``index`` of a stream. ``text`` may be
    "" while bytes of a character or a possible stop string are held back. A sample's last
    delta has a ``finish_reason``: "stop" (EOS, stop string or stop token) or "length"
    (max_tokens or the context window)."""

    text: str
    token_id: int | None
    finish_reason: str | None = None
    index: int = 0
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Choice:
    """One sample's result. ``text`` is everything generated; for a request with tools,
    ``tool_calls`` are the calls read out of it, ``content`` the text outside them (None
    if there is none), and ``finish_reason`` "tool_calls" when it ended after calls."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprobs, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None

    def __post_init__(self):
        if self.content is None and not self.tool_calls:
            object.__setattr__(self, "content", self.text)


@dataclass(frozen=True)
class Completion:
    """The whole result of a request; ``text`` / ``token_ids`` / ``finish_reason`` are
    those of sample 0."""

    request_id: str
    choices: tuple[Choice, ...]
    prompt_tokens: int
    time_to_first_token_s: float
    total_time_s: float

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total_time_s - self.time_to_first_token_s
        n = len(self.choices[0].token_ids)
        return (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
