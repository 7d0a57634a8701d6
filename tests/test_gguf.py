"""GGUF reading: llama.cpp's Q/K row order undone, tokenizer rebuilt faithfully."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.compiler.models.gguf_model import GGUFModel, unpermute_rope_rows
from kiln.runtime.errors import UnsupportedModelError


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The permutation llama.cpp's HF->GGUF converter applies (written from its definition:
    per head, rows [first half | second half] become interleaved pairs)."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        block = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d][0::2] = block[: d // 2]
        out[h * d:(h + 1) * d][1::2] = block[d // 2:]
    return out


@pytest.mark.parametrize("heads,head_dim,cols", [(9, 64, 5), (3, 8, 7), (1, 2, 3)])
def test_unpermute_inverts_llama_cpp_permutation(heads, head_dim, cols):
    w = np.random.default_rng().standard_normal((heads * head_dim, cols)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w)
    bias = np.random.default_rng().standard_normal(heads * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(bias[:, None], heads)[:, 0], heads), bias)


def test_default_model_config(smollm2_source):
    c = smollm2_source.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.eos_token_ids == (2,)


def test_gguf_tokenizer_matches_transformers(smollm2_source):
    import transformers
    from tokenizers import Tokenizer

    path = Path(smollm2_source.origin)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    files = smollm2_source.load_tokenizer()
    ours = Tokenizer.from_str(files.tokenizer_json)
    texts = [
        "What is the capital of France?",
        "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, tabs\tand\n\nnewlines   ",
        "digits 1234567890 3.14159 and 2026-12-02",
        "unicode: héllo wörld, 你好, こんにちは, emoji 🤗🚀, math ∑∫√",
        "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    ]
    for text in texts:
        assert ours.encode(text).ids == ref(text)["input_ids"], text
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert files.tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in files.tokenizer_config["chat_template"]


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match="broken.gguf"):
        GGUFModel(bad)
