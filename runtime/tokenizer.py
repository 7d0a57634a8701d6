"""The artifact's tokenizer: ``tokenizers`` for text <-> ids, jinja2 for chat templates."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Mapping, Sequence

from .errors import ArtifactError, InvalidRequestError
from .messages import check_unicode, normalize_messages
from .tool_calls import template_supports_tools

Message = Mapping[str, object]


class Tokenizer:
    def __init__(self, tokenizer, config: dict, eos_token_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        eos = set(eos_token_ids)
        for key in ("eos_token",):
            text = config.get(key)
            if isinstance(text, str):
                tid = tokenizer.token_to_id(text)
                if tid is not None:
                    eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        self._template = None
        self._max_token_chars: int | None = None
        self._native_tools: bool | None = None

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        try:
            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # tokenizers raises a bare Exception for bad files
            raise ArtifactError(f"{folder / 'tokenizer.json'}: unreadable tokenizer ({err})") from None
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(tok, config, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary
        entry (byte-level and metaspace vocabularies spell each byte or space as one
        character). A text longer than N times this cannot be fewer than N tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """``field`` names the request field ``text`` came from, for the error."""
        check_unicode(field, text)
        # encode_batch releases the GIL while it runs (encode holds it: a 2 MB prompt froze
        # every other thread of the server for 2.2 s; through encode_batch, 40-60 ms).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for the grammar engine)."""
        return self._tok.to_str()

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def native_tools(self) -> bool:
        """Whether the chat template renders tools and tool calls itself (Llama 3.x, Qwen2,
        Hermes, Mistral templates read ``tools``; SmolLM2's does not)."""
        if self._native_tools is None:
            self._native_tools = template_supports_tools(self.chat_template)
        return self._native_tools

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping] | None = None) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add another.
        # Contents were checked by normalize_messages; this catches the rest of the rendered
        # prompt (other message keys the template reads, the template's own text).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False,
                           field="messages")

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping] | None = None) -> str:
        """``tools``: OpenAI tool definitions, passed to a template that renders them."""
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
        messages = normalize_messages(messages, self.native_tools)
        import jinja2

        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise InvalidRequestError("messages", f"rejected by the chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3.x
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as err:
                raise ArtifactError(f"the artifact's chat template does not parse ({err})") from None
        try:
            extra = {"tools": [dict(t) for t in tools]} if tools and self.native_tools else {}
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **extra,
                bos_token=self.config.get("bos_token") or "",
                eos_token=self.config.get("eos_token") or "",
            )
        except jinja2.TemplateError as err:
            raise InvalidRequestError("messages", f"the chat template failed on these messages ({err})") from None
