"""Grammar-constrained decoding: token masks against numpy and a prefix-of-a-choice
reference, the masked sampler against numpy, and constrained requests through the engine
on a tiny random model (whose unconstrained output is noise), batched, forked (n > 1),
preempted and recomputed, cancelled, and refused when the constraint is bad."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.guided import GrammarCompiler, Guide, fill_masks, unpack_bitmask
from kiln.runtime.sampling import SampleState, SamplingParams, make_generators, process_logits, sample_rows
from kiln.runtime.sampling import sampling_distribution

# Bounded, so even a random model finishes it in a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["fox", "dog", "cat"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "kind", "ok"],
    "additionalProperties": False,
}


def _bits_reference(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bit j of int32 word w allows token 32 w + j (llguidance's layout), bit by bit."""
    out = np.zeros((bitmask.shape[0], vocab), dtype=bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab):
            out[r, t] = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
    return out


def test_unpacked_bitmask_matches_bit_arithmetic():
    rng = np.random.default_rng()
    vocab = int(rng.integers(33, 300))
    bitmask = rng.integers(-2**31, 2**31, size=(3, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    assert np.array_equal(unpack_bitmask(bitmask, vocab), _bits_reference(bitmask, vocab))


def _state(params: SamplingParams, end_ids=frozenset({0}), num_output=0) -> SampleState:
    state = SampleState(params, make_generators(params.seed, 1)[0], [1, 2, 3], end_ids)
    state.num_output = num_output
    return state


def test_masked_sampling_matches_numpy():
    rng = np.random.default_rng()
    vocab = 200
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * 3
    allowed = rng.random((4, vocab)) < 0.1
    allowed[:, 0] = False
    # Greedy: the argmax over the allowed tokens.
    tokens, lps = sample_rows(logits, [_state(SamplingParams(temperature=0.0, logprobs=2))] * 4, list(allowed))
    for row, mask, token, lp in zip(logits, allowed, tokens, lps):
        assert token == int(np.flatnonzero(mask)[np.argmax(row[mask])])
        # Log-probabilities are the model's, over the whole vocabulary.
        ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
        assert lp.logprob == pytest.approx(ref[token], abs=1e-9)
    # Sampling: softmax(logits / T) renormalized over the allowed tokens, with penalties.
    params = SamplingParams(temperature=0.7, presence_penalty=0.5, seed=int(rng.integers(1 << 30)))
    state = _state(params)
    state.output_counts = {int(t): 1 for t in rng.choice(vocab, 20)}
    probs = sampling_distribution(process_logits(logits[0], state, allowed[0]), params)
    x = logits[0].astype(np.float64)
    x[list(state.output_counts)] -= 0.5
    ref = np.where(allowed[0], np.exp((x - x[allowed[0]].max()) / 0.7), 0.0)
    np.testing.assert_allclose(probs, ref / ref.sum(), rtol=1e-9, atol=1e-15)
    draws, _ = sample_rows(np.repeat(logits[:1], 64, axis=0), [_state(params)] * 64, [allowed[0]] * 64)
    assert all(allowed[0, t] for t in draws)


def test_a_complete_grammar_ends_even_before_min_tokens():
    vocab = 50
    logits = np.random.default_rng().normal(size=(1, vocab)).astype(np.float32)
    only_end = np.zeros(vocab, dtype=bool)
    only_end[0] = True
    params = SamplingParams(temperature=0.0, min_tokens=10, max_tokens=20)
    assert sample_rows(logits, [_state(params)], [only_end])[0] == [0]
    # While the grammar allows more than the end token, min_tokens still holds the end back.
    both = only_end.copy()
    both[7] = True
    logits[0, 0] = 100.0
    assert sample_rows(logits, [_state(params)], [both])[0] == [7]


@pytest.fixture(scope="module")
def tiny_compiler(checkpoint):
    folder = checkpoint("llama")
    return GrammarCompiler((folder / "tokenizer.json").read_text(), 384, [2])


def test_choice_masks_allow_only_tokens_that_keep_a_prefix_of_a_choice(tiny_compiler, checkpoint):
    """Reference: a token may be allowed only if the text so far plus its text is a prefix
    of a choice, and the end token only if the text so far is a whole choice (sound); and
    each choice's own tokenization is allowed all the way to the end (complete).
    (llguidance narrows a forced continuation to its canonical token, so not every
    token of the prefix set is allowed.)"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint("llama") / "tokenizer.json"))
    rng = random.Random()
    words = ["fox", "dog", "brown", "quick", "capital", "France", "lazy", "jumps", "Paris"]
    choices = sorted({" ".join(rng.sample(words, rng.randint(1, 3))) for _ in range(5)})
    guide = Guide.choice(choices)
    executor = llguidance.LLExecutor()
    pieces = {t: tok.decode([t]) for t in range(tok.get_vocab_size()) if t not in (0, 1, 2)}

    def reference(text: str) -> set[int]:
        ok = {t for t, p in pieces.items() if p and any(c.startswith(text + p) for c in choices)}
        return ok | ({2} if text in choices else set())

    # Random walks: every allowed token is in the reference set.
    matchers = tiny_compiler.matchers(guide, 4)
    texts = [""] * len(matchers)
    for _ in range(40):
        live = [i for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        for i, mask in zip(live, fill_masks(executor, [matchers[i] for i in live], 384)):
            allowed = set(np.flatnonzero(mask).tolist())
            assert allowed and allowed <= reference(texts[i]), texts[i]
            token = rng.choice(sorted(allowed))
            assert matchers[i].consume_token(token)
            texts[i] += "" if token == 2 else pieces[token]
    assert all(t in choices for t in texts)
    # Each choice's tokenization walks through the masks, and may end there.
    for choice in choices:
        (matcher,) = tiny_compiler.matchers(guide, 1)
        for token in tok.encode(choice, add_special_tokens=False).ids + [2]:
            assert fill_masks(executor, [matcher], 384)[0][token], (choice, token)
            assert matcher.consume_token(token)


def _engine(compiled, **config) -> Engine:
    return Engine.load(compiled("llama"), EngineConfig(**{"max_num_seqs": 6, "max_batched_tokens": 64, **config}))


PROMPTS = ["The quick brown fox", "Paris is the capital of", "def f(x):", "naïve café 你好"]


def test_constrained_requests_validate_batch_like_alone_and_free_their_pages(compiled):
    engine = _engine(compiled)
    guide = Guide.json_schema(SCHEMA)
    seed = random.randrange(1 << 30)
    params = dict(max_tokens=100, temperature=1.0, seed=seed, n=3, guide=guide)
    alone = engine.generate(PROMPTS[0], **params)
    others = [engine.submit(p, max_tokens=40, temperature=1.0, ignore_eos=True) for p in PROMPTS[1:]]
    extra = [engine.submit(p, max_tokens=100, temperature=0.8, seed=seed + i, guide=guide)
             for i, p in enumerate(PROMPTS)]
    batched = engine.submit(PROMPTS[0], **params).result(timeout=120)
    assert [c.token_ids for c in batched.choices] == [c.token_ids for c in alone.choices]
    outputs = [c for c in alone.choices] + [s.result(timeout=120).choices[0] for s in extra]
    for choice in outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in alone.choices}) > 1  # three samples, three matchers
    for s in others:  # the unconstrained ones beside them: the random model's noise
        s.result(timeout=120)
    unconstrained = engine.generate(PROMPTS[0], max_tokens=40, temperature=1.0, seed=seed)
    with pytest.raises(json.JSONDecodeError):
        json.loads(unconstrained.text)
    assert engine.wait_idle(30)
    engine.run_in_core(engine.core.check)
    assert engine.stats().kv_pages_requests == 0
    engine.close()


def test_preempted_constrained_requests_recompute_to_the_same_output(compiled):
    """A cache that holds ~2 sequences at once: requests are preempted and recomputed;
    each matcher keeps its state (the tokens sampled so far stay), so every output equals
    the same request run alone."""
    guide = Guide.regex(r"((fox|dog|[0-9]{1,3}) (jumps|runs) over the lazy (dog|fox)[.!] ){2,3}")
    seeds = [random.randrange(1 << 30) for _ in range(8)]
    prompt = "The quick brown fox jumps over the lazy dog."
    cramped = _engine(compiled, max_num_seqs=8, max_total_tokens=256, max_batched_tokens=32, prefix_reuse=False)
    streams = [cramped.submit(prompt, max_tokens=90, temperature=1.0, seed=s, guide=guide) for s in seeds]
    squeezed = [s.result(timeout=120) for s in streams]
    assert cramped.metrics.preemptions > 0
    cramped.close()
    roomy = _engine(compiled, max_num_seqs=1)
    for seed, out in zip(seeds, squeezed):
        assert out.token_ids == roomy.generate(prompt, max_tokens=90, temperature=1.0, seed=seed, guide=guide).token_ids
        assert out.finish_reason == "stop"
    roomy.close()


def test_cancelled_constrained_requests_free_everything(compiled):
    engine = _engine(compiled)
    guide = Guide.json_schema(SCHEMA)
    streams = [engine.submit(p, max_tokens=100, temperature=1.0, guide=guide, n=2) for p in PROMPTS]
    next(iter(streams[1]))
    streams[1].cancel()
    streams[2].cancel()
    for i in (0, 3):
        for c in streams[i].result(timeout=120).choices:
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert engine.wait_idle(30)
    engine.run_in_core(engine.core.check)
    assert engine.stats().kv_pages_requests == 0
    engine.close()


@pytest.fixture(scope="module")
def shared_engine(compiled):
    engine = _engine(compiled)
    yield engine
    engine.close()


@pytest.mark.parametrize("make,field", [
    (lambda: Guide.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "[x"}}}),
     "response_format.json_schema.schema"),
    (lambda: Guide.json_schema({"type": "object", "if": {"type": "string"}}), "response_format.json_schema.schema"),
    (lambda: Guide.json_schema("{not json"), "response_format.json_schema.schema"),
    (lambda: Guide.json_schema([1, 2]), "response_format.json_schema.schema"),
    (lambda: Guide.regex("(unclosed"), "guided_regex"),
    (lambda: Guide.regex(""), "guided_regex"),
    (lambda: Guide.choice([]), "guided_choice"),
    (lambda: Guide.choice(["a", 3]), "guided_choice"),
    (lambda: Guide.grammar("start: undefined_rule"), "guided_grammar"),
    (lambda: Guide.from_response_format({"type": "xml"}), "response_format.type"),
    (lambda: Guide.from_response_format({"type": "json_schema"}), "response_format.json_schema"),
    (lambda: SamplingParams(guide=Guide.json_object(), ignore_eos=True), "ignore_eos"),
])
def test_bad_constraints_are_refused_naming_the_field(shared_engine, make, field):
    with pytest.raises(InvalidRequestError) as err:
        guide = make()
        shared_engine.submit("The quick brown fox", max_tokens=4, guide=guide)
    assert err.value.field == field, err.value
    # Nothing reached the core; the engine serves the next request.
    assert shared_engine.generate("The quick brown fox", max_tokens=3, guide=Guide.choice(["fox"])).text == "fox"
    assert shared_engine.stats().requests == 0
