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


def _longest_partial(text, stops):
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _strictly_inside(a, b):
    """``a`` occurs in ``b`` touching neither end."""
    return any(b.startswith(a, i) for i in range(1, len(b) - len(a)))


def _reference_by_deltas(deltas, stops):
    """The text received up to the first delta after which a stop has appeared, cut before
    the earliest occurrence of any stop in it (or all the text, and False, if none)."""
    received = ""
    for d in deltas:
        received += d
        cuts = [received.find(s) for s in stops if s in received]
        if cuts:
            return received[:min(cuts)], True
    return received, False


def _random_stops(rng, alphabet):
    stops = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        if stops and kind < 0.4:  # a prefix or suffix of another stop
            other = rng.choice(stops)
            n = rng.randint(1, len(other))
            stops.append(other[:n] if rng.random() < 0.5 else other[-n:])
        elif stops and kind < 0.6:  # overlaps another: starts with its tail
            other = rng.choice(stops)
            tail = other[-rng.randint(1, len(other)):]
            stops.append(tail + "".join(rng.choices(alphabet, k=rng.randint(1, 3))))
        else:
            stops.append("".join(rng.choices(alphabet, k=rng.randint(1, 6))))
    return stops


def test_stop_matching_against_whole_text_references():
    """Small alphabets make partial matches frequent. After every delta the output so far
    is a prefix of the reference (it never runs past the cut), and, until a stop appears,
    all the received text except its longest partial match of a stop has been released."""
    rng = random.Random(1234)
    inside = 0
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "a\n", "xyz"])
        stops = _random_stops(rng, alphabet)
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 60)))
        deltas, i = [], 0
        while i < len(text):
            n = rng.randint(0, 6)  # empty deltas too
            deltas.append(text[i:i + n])
            i += n
        expected, stops_found = _reference_by_deltas(deltas, stops)
        if any(_strictly_inside(a, b) for a in stops for b in stops):
            inside += 1
        else:
            # Then the cut does not depend on the deltas: before the earliest occurrence.
            assert (expected, stops_found) == _reference_stop(text, stops)
        matcher = StopMatcher(stops)
        out, received = "", ""
        for d in deltas:
            out += matcher.feed(d)
            received += d
            assert expected.startswith(out), (stops, deltas, out)
            if matcher.stopped:
                break
            assert not any(s in received for s in stops)
            assert out == received[:len(received) - _longest_partial(received, stops)], (stops, deltas)
        assert matcher.stopped == stops_found
        out += matcher.flush()
        assert out == expected, (stops, deltas)
        assert matcher.feed("more") == "" or not matcher.stopped
    assert 0 < inside < 3000  # both kinds of stop lists were drawn


def test_a_stop_inside_another_cuts_by_what_was_received():
    # "bc" completes first when "d" is a later delta; "abcd" starts earlier when one delta
    # holds both.
    whole = StopMatcher(["abcd", "bc"])
    assert whole.feed("xabcd") == "x" and whole.stopped
    split = StopMatcher(["abcd", "bc"])
    assert split.feed("xabc") == "xa" and split.stopped
    assert split.feed("d") == "" and split.flush() == ""


def test_long_stops_hold_only_the_partial_match():
    stop = "a" * 20_000 + "b"
    matcher = StopMatcher([stop, "xy"])
    out = "".join(matcher.feed("a" * 7) for _ in range(3000))  # 21000 a's: 1000 released
    assert out == "a" * 1000
    assert matcher.feed("x") == "a" * 20_000  # now only "x" (the start of "xy") is held
    assert matcher.feed("b") == "xb" and not matcher.stopped
    assert matcher.feed("a" * 20_000 + "b") == "" and matcher.stopped
