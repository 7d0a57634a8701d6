"""Chat templates render exactly as transformers renders them."""

from __future__ import annotations

import pytest

from kiln.runtime.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye ✨"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_template_matches_transformers(smollm2_artifact, smollm2_source, messages):
    from pathlib import Path

    import transformers

    path = Path(smollm2_source.origin)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_folder(smollm2_artifact)
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.encode_chat(messages) == ref(expected, add_special_tokens=False)["input_ids"]


def test_hf_folder_template_matches_transformers(checkpoint, compiled):
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(checkpoint("llama"))
    ours = Tokenizer.from_folder(compiled("llama"))
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
