"""Incremental detokenization and stop strings, against whole-text references."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from helpers import make_tokenizer
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.stop import StopMatcher

SAMPLES = ["héllo wörld", "你好世界, こんにちは", "emoji 🤗🚀✨ and 👩‍👩‍👧 family", "plain ascii text",
           "mixed: naïve café 3.14 ∑∫√ 🙂"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


class _Decoder:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_deltas_never_split_characters(tokenizer):
    dec = _Decoder(tokenizer)
    rng = random.Random()
    for _ in range(20):
        text = " ".join(rng.sample(SAMPLES, 3))
        ids = tokenizer.encode(text).ids
        prompt = tokenizer.encode("prompt: ").ids
        detok = IncrementalDetokenizer(dec, prompt)
        deltas = [detok.add(i) for i in ids] + [detok.flush()]
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == text
        # Multi-byte characters really were split across tokens (the test means something).
    assert any(len(tokenizer.decode([i]).encode()) and "\ufffd" in tokenizer.decode([i])
               for i in tokenizer.encode("".join(SAMPLES)).ids)


def test_flush_emits_a_trailing_partial_character(tokenizer):
    dec = _Decoder(tokenizer)
    ids = tokenizer.encode("🚀").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(dec)
    text = "".join(detok.add(i) for i in ids[:-1])
    assert text == ""  # held back: incomplete character
    assert detok.flush() != ""  # generation ended mid-character: the replacement shows


def _reference_stop(text, stops):
    cuts = [text.find(s) for s in stops if s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


@pytest.mark.parametrize("trial", range(30))
def test_stop_strings_never_leak(trial):
    rng = random.Random()
    alphabet = "ab c\nEND"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = rng.sample(["END", "c\n", "ab a", "\n\n", "bbb"], rng.randint(1, 3))
    matcher = StopMatcher(stops)
    out, pieces, i = [], [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i:i + n])
        i += n
    for piece in pieces:
        emitted = matcher.feed(piece)
        out.append(emitted)
        so_far = "".join(out)
        assert not any(s in so_far for s in stops), (so_far, stops)
        if matcher.stopped:
            break
    if not matcher.stopped:
        out.append(matcher.flush())
    expected, stopped = _reference_stop(text, stops)
    assert "".join(out) == expected
    assert matcher.stopped == stopped
