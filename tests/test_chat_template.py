"""Chat templates render exactly as transformers renders them."""

from __future__ import annotations

import json

import pytest

from helpers import make_tokenizer
from kiln.runtime.errors import InvalidRequestError
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


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def test_a_lone_surrogate_in_the_prompt_is_a_bad_request(tokenizer):
    prompt = json.loads('"ab\\ud800c"')  # what a JSON body can carry into a str
    with pytest.raises(InvalidRequestError) as info:
        tokenizer.encode(prompt)
    assert info.value.field == "prompt"
    assert "lone surrogate at character 2" in str(info.value)


@pytest.mark.parametrize("index", [0, 1])
def test_a_lone_surrogate_in_chat_content_is_a_bad_request(tokenizer, index):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    messages[index]["content"] = json.loads('"\\udfff tail"')
    for call in (tokenizer.encode_chat, tokenizer.apply_chat_template):
        with pytest.raises(InvalidRequestError) as info:
            call(messages)
        assert info.value.field == f"messages[{index}].content"
        assert "lone surrogate at character 0" in str(info.value)


def test_a_lone_surrogate_rendered_from_elsewhere_is_a_bad_request(tokenizer):
    # A template reading a key other than content: the rendered prompt is checked too.
    named = Tokenizer(tokenizer._tok, {**tokenizer.config, "chat_template": "{{ messages[0]['name'] }}:"})
    with pytest.raises(InvalidRequestError) as info:
        named.encode_chat([{"role": "user", "content": "hi", "name": "x\ud800"}])
    assert info.value.field == "messages"


@pytest.mark.parametrize("text", ["emoji 🤗🚀✨ 👩‍👩‍👧", "你好世界, こんにちは", "naïve café ∑∫√",
                                  json.loads('"\\ud83d\\ude00 a JSON surrogate pair"')])
def test_valid_non_ascii_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    assert text in tokenizer.decode(ids, skip_special_tokens=False)
