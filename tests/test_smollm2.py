"""End to end on the embedded default model, SmolLM2-135M-Instruct (compiled once)."""

from __future__ import annotations

import numpy as np
import torch

from helpers import torch_greedy
from kiln.runtime.engine import Engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answer_is_paris(smollm2_artifact):
    engine = Engine.load(smollm2_artifact)
    out = engine.generate(QUESTION, max_tokens=32)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_32_greedy_tokens_identical_to_torch(smollm2_artifact, smollm2_module):
    engine = Engine.load(smollm2_artifact)
    prompt = "Once upon a time, in a small village by the sea,"
    expected = torch_greedy(smollm2_module, engine.tokenizer.encode(prompt), 32)
    out = engine.generate(prompt, max_tokens=32, ignore_eos=True)
    assert list(out.token_ids) == expected


def test_logits_match_torch_prefill_and_decode(smollm2_artifact, smollm2_module):
    from kiln.runtime.executor import CacheConfig, Chunk

    ex = Engine.load(smollm2_artifact)._executor
    cache = ex.create_cache(CacheConfig(max_batch_size=2, max_total_tokens=256, prefill_chunk_size=64,
                                        page_size=ex.page_size))
    rng = np.random.default_rng()
    ids = rng.integers(0, 49152, 20).tolist()
    cache.add(0)
    logits = ex.forward(cache, [Chunk(0, tuple(ids), 0)])
    with torch.no_grad():
        ref, past = smollm2_module(torch.tensor([ids]), torch.arange(20)[None])
    errors = [np.abs(logits[0] - ref.numpy()[0]).max()]
    for step in range(4):
        tok = int(rng.integers(0, 49152))
        with torch.no_grad():
            ref, past = smollm2_module(torch.tensor([[tok]]), torch.tensor([[20 + step]]), past)
        logits = ex.forward(cache, [Chunk(0, (tok,), 20 + step)])
        errors.append(np.abs(logits[0] - ref.numpy()[0]).max())
    assert max(errors) <= 1e-3, errors  # logits reach ~30: this is <= 3e-5 relative


def test_streaming_deltas_add_up_and_utf8_is_whole(smollm2_artifact):
    engine = Engine.load(smollm2_artifact)
    msgs = [{"role": "user", "content": "Write the word café and the emoji 🚀 three times."}]
    deltas = list(engine.stream(msgs, max_tokens=40, temperature=0.8, seed=7))
    text = "".join(d.text for d in deltas)
    assert "\ufffd" not in text
    assert all("\ufffd" not in d.text for d in deltas)
    ids = [d.token_id for d in deltas if d.token_id is not None and d.token_id not in engine.tokenizer.eos_token_ids]
    assert text == engine.tokenizer.decode(ids)
    again = engine.generate(msgs, max_tokens=40, temperature=0.8, seed=7)
    assert again.text == text  # same seed, same output
