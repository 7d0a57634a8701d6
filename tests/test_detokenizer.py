"""IncrementalDetokenizer after a prompt, against whole-text decoding, for the three kinds
of decoder Kiln meets: byte-level BPE (SmolLM2, Llama 3, Qwen), sentencepiece-style
Metaspace (a Unigram model, like T5's), and Llama 2 / Mistral style BPE with byte fallback.

The reference for text generated after a prompt is decode(prompt + output) less
decode(prompt); every delta must be a stable prefix of it (no partial characters)."""

from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import make_tokenizer
from kiln.runtime.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "quick", "brown", "fox", "Paris", "capital", "of", "France", "kiln", "model",
         "héllo", "wörld", "naïve", "café", "3.14", "∑∫√", "你好世界", "こんにちは", "🤗🚀✨",
         "👩‍👩‍👧", "🙂", "x*2", "(a,", "b)"]
# The sentencepiece-style models see no CJK or emoji in training: those fall back to bytes
# (byte-fallback model) or are single characters of the alphabet (Unigram).
SP_TRAINING = ["The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
               "Kiln compiles a model; héllo wörld, naïve café 3.14 and x*2 (a, b).",
               "Hello there, the capital of France is Paris."] * 20


def _unigram_metaspace() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    alphabet = sorted(set("".join(SP_TRAINING + WORDS)))
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=[*SPECIALS, "<unk>"], unk_token="<unk>",
                                      initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(SP_TRAINING, trainer)
    return tok


def _byte_fallback_bpe() -> Tokenizer:
    """Llama 2's layout: BPE with <0xNN> byte tokens, Metaspace pre-tokenizer, and the
    decoder chain Replace(▁ -> space), ByteFallback, Fuse, Strip(one leading space)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIALS, "<unk>"], show_progress=False)
    tok.train_from_iterator(SP_TRAINING, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte-level", "metaspace-unigram", "byte-fallback-bpe"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte-level":
        folder = tmp_path_factory.mktemp("tok")
        make_tokenizer(folder)
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    return _unigram_metaspace() if request.param == "metaspace-unigram" else _byte_fallback_bpe()


class _Decoder:
    """What IncrementalDetokenizer is given: anything with decode(ids, skip_special_tokens)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def _stream(tok, prompt, out):
    detok = IncrementalDetokenizer(_Decoder(tok), prompt)
    return [detok.add(i) for i in out] + [detok.flush()]


def _reference(tok, prompt, out):
    whole, head = tok.decode(prompt + out), tok.decode(prompt)
    assert whole.startswith(head)
    return whole[len(head):]


def _check(deltas, reference, context):
    for n in range(len(deltas)):
        so_far = "".join(deltas[:n + 1])
        assert reference.startswith(so_far), (context, deltas[:n + 1], reference)
    assert "".join(deltas) == reference, (context, deltas, reference)
    if "\ufffd" not in reference:
        assert all("\ufffd" not in d for d in deltas), (context, deltas)


def _split_points(tok, ids):
    """Where a prompt can end: its text complete and a prefix of the whole text."""
    whole = tok.decode(ids)
    return [k for k in range(1, len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd")
            and whole.startswith(tok.decode(ids[:k]))]


def test_text_after_a_prompt_joins_to_the_whole_decode(tokenizer):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for _ in range(40):
        ids = tokenizer.encode("User: " + _random_text(rng), add_special_tokens=False).ids
        k = rng.choice(_split_points(tokenizer, ids))
        prompt, out = ids[:k], ids[k:]
        _check(_stream(tokenizer, prompt, out), _reference(tokenizer, prompt, out), (seed, prompt, out))


def test_special_token_in_the_middle_is_skipped(tokenizer):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    specials = [tokenizer.token_to_id(s) for s in SPECIALS]
    for _ in range(40):
        ids = tokenizer.encode("User: " + _random_text(rng), add_special_tokens=False).ids
        k = rng.choice(_split_points(tokenizer, ids))
        prompt, out = ids[:k], ids[k:]
        j = rng.randrange(len(out) + 1)
        out = out[:j] + [rng.choice(specials)] + out[j:]
        reference = _reference(tokenizer, prompt, out)
        assert not any(s in reference for s in SPECIALS)
        _check(_stream(tokenizer, prompt, out), reference, (seed, prompt, out))


def test_first_generated_word_keeps_its_leading_space(tokenizer):
    ids = tokenizer.encode("The capital of France", add_special_tokens=False).ids
    prompt_len = len(tokenizer.encode("The capital", add_special_tokens=False).ids)
    prompt, out = ids[:prompt_len], ids[prompt_len:]
    assert tokenizer.decode(prompt) == "The capital"
    deltas = _stream(tokenizer, prompt, out)
    assert "".join(deltas) == " of France"


def test_prompt_tail_cut_inside_a_character():
    """The last CONTEXT_TOKENS prompt ids start inside a byte-fallback character: a window
    starting there would turn its whole run of byte tokens into U+FFFDs."""
    tok = _byte_fallback_bpe()
    ids = tok.encode("User: emoji 🤗🚀✨ and more", add_special_tokens=False).ids
    tokens = [tok.id_to_token(i) for i in ids]
    k = len(tok.encode("User: emoji 🤗🚀", add_special_tokens=False).ids)
    assert tok.decode(ids[:k]) == "User: emoji 🤗🚀"
    assert all(t.startswith("<0x") for t in tokens[k - CONTEXT_TOKENS:k + 3])  # one byte run
    prompt, out = ids[:k], ids[k:]
    _check(_stream(tok, prompt, out), _reference(tok, prompt, out), tokens)
    assert _reference(tok, prompt, out) == "✨ and more"


def test_generation_ending_mid_character_flushes_what_is_left(tokenizer):
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False).ids
    out = ids[:-1]
    if not tokenizer.decode(out).endswith("\ufffd"):  # the last id completes the rocket
        pytest.skip("this tokenizer has 🚀 as one token")
    detok = IncrementalDetokenizer(_Decoder(tokenizer), tokenizer.encode("User:", add_special_tokens=False).ids)
    text = "".join(detok.add(i) for i in out)
    assert "\ufffd" not in text
    rest = detok.flush()
    assert rest.startswith("\ufffd")
    assert text + rest == _reference(tokenizer, tokenizer.encode("User:", add_special_tokens=False).ids, out)
