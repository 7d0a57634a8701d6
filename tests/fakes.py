"""A fake executor for engine and scheduler tests: no TVM, no model.

The fake cache stores each sequence's tokens and checks that every chunk continues its
sequence exactly (right start position, forks copy the right prefix). Its "model" is a
deterministic function of the sequence's whole content, so a request's output depends on
its tokens alone: whatever is batched beside it, however it was chunked, preempted and
recomputed, or forked from a prefix holder, it must come out the same.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kiln.runtime.model_config import ModelConfig


class FakeCache:
    def __init__(self, config, page_size: int):
        self.config = config
        self.page_size = page_size
        self.total_pages = -(-config.max_total_tokens // page_size) + 1  # as TVM sizes it
        self.seqs: dict[int, list[int]] = {}
        self.pages: dict[int, list[object]] = {}
        self.ops: list[tuple] = []

    def add(self, seq_id):
        assert seq_id not in self.seqs, f"add: {seq_id} exists"
        self.seqs[seq_id], self.pages[seq_id] = [], []
        self.ops.append(("add", seq_id))

    def remove(self, seq_id):
        del self.seqs[seq_id], self.pages[seq_id]
        self.ops.append(("remove", seq_id))

    def fork(self, parent, child, position):
        assert child not in self.seqs and 0 <= position <= len(self.seqs[parent])
        self.seqs[child] = list(self.seqs[parent][:position])
        full = position // self.page_size
        self.pages[child] = self.pages[parent][:full] + ([object()] if position % self.page_size else [])
        self.ops.append(("fork", parent, child, position))
        self._check_pages()

    def append(self, seq_id, start, tokens):
        assert start == len(self.seqs[seq_id]), f"seq {seq_id}: chunk starts at {start}, holds {len(self.seqs[seq_id])}"
        self.seqs[seq_id].extend(tokens)
        need = -(-len(self.seqs[seq_id]) // self.page_size) - len(self.pages[seq_id])
        self.pages[seq_id].extend(object() for _ in range(need))
        self._check_pages()

    def used_pages(self) -> int:
        return len({id(p) for pages in self.pages.values() for p in pages})

    def available_pages(self) -> int:
        return self.total_pages - self.used_pages()

    def _check_pages(self):
        assert self.used_pages() <= self.total_pages, "the fake KV cache ran out of pages"


def fake_logits(tokens, vocab: int) -> np.ndarray:
    """Peaked logits whose argmax and shape depend only on the token sequence."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return (rng.standard_normal(vocab) * 3).astype(np.float32)


class FakeExecutor:
    page_size = 4

    def __init__(self, vocab: int = 64):
        self.vocab = vocab
        self.forwards: list[list] = []

    def create_cache(self, config):
        self.cache = FakeCache(config, self.page_size)
        return self.cache

    def forward(self, cache, chunks):
        assert len(chunks) <= cache.config.max_batch_size
        assert sum(len(c.tokens) for c in chunks) <= cache.config.prefill_chunk_size
        assert len({c.seq_id for c in chunks}) == len(chunks)
        self.forwards.append([(c.seq_id, c.start, len(c.tokens)) for c in chunks])
        rows = []
        for c in chunks:
            cache.append(c.seq_id, c.start, c.tokens)
            for off in c.logit_offsets():
                rows.append(fake_logits(cache.seqs[c.seq_id][:c.start + off + 1], self.vocab))
        return np.stack(rows) if rows else np.zeros((0, self.vocab), np.float32)


def fake_model(vocab: int = 64, context: int = 96) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                       context_length=context, eos_token_ids=())


class FakeTokenizer:
    """Prompts are space-separated token ids ("3 14 15"); text is ids joined with spaces."""

    eos_token_ids = frozenset()
    max_token_chars = 8

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def encode_chat(self, messages):
        return self.encode(" ".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


def expected_greedy(prompt, steps: int, vocab: int = 64) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(steps):
        out.append(int(np.argmax(fake_logits(tokens, vocab))))
        tokens.append(out[-1])
    return out


def fake_engine(context: int = 96, **config):
    """(engine, executor): an Engine over the fake executor, driven by ``step()``."""
    from kiln.runtime.engine import Engine, EngineConfig

    ex = FakeExecutor()
    engine = Engine(fake_model(context=context), ex, FakeTokenizer(), EngineConfig(**config), background=False)
    return engine, ex


def run_to_idle(engine, max_steps: int = 20_000) -> int:
    """Step until idle, checking the core's invariants (scheduler, ledger = cache) after
    every step; returns the number of steps."""
    steps = 0
    while engine.core.has_work():
        engine.step()
        engine.core.check()
        steps += 1
        assert steps < max_steps, "no progress"
    return steps
