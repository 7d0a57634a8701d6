"""Incremental, UTF-8-safe detokenization.

Byte-level BPE splits multi-byte characters across tokens; decoding a partial character
yields U+FFFD. The detokenizer decodes a short window of ids (a few already-emitted
tokens of context, so word-initial spaces survive sentencepiece decoders, plus the new
ones) and emits only text that no later token can change: never a trailing partial
character.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        self._ids: list[int] = tail
        self._prefix = 0  # start of the decode window
        self._read = len(tail)  # ids before this are emitted

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (possibly "")."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left, partial characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT) and not final:
            return ""
        delta = full_text[len(prefix_text):]
        # The emitted chunk becomes the next window's context.
        self._prefix, self._read = self._read, len(self._ids)
        return delta
