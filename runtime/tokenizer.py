"""The artifact's tokenizer: ``tokenizers`` for text <-> ids, jinja2 for chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from .errors import ArtifactError, InvalidRequestError

Message = Mapping[str, str]
ROLES = ("system", "user", "assistant", "tool")


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

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add another.
        # Contents were checked by validate_messages; this catches the rest of the rendered
        # prompt (other message keys the template reads, the template's own text).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False,
                           field="messages")

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
        validate_messages(messages)
        import jinja2

        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise InvalidRequestError("messages", f"rejected by the chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as err:
                raise ArtifactError(f"the artifact's chat template does not parse ({err})") from None
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.config.get("bos_token") or "",
                eos_token=self.config.get("eos_token") or "",
            )
        except jinja2.TemplateError as err:
            raise InvalidRequestError("messages", f"the chat template failed on these messages ({err})") from None


def validate_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string")
        check_unicode(f"messages[{i}].content", content)


def check_unicode(field: str, text: str) -> None:
    """Reject text with no UTF-8 form. JSON can carry a lone surrogate (``"\\ud800"``) into a
    Python str, and ``tokenizers`` raises TypeError on one; this is a bad request instead.
    One encode attempt: UTF-8 fails only on surrogates, and the error gives the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            field, f"contains invalid Unicode (a lone surrogate at character {err.start})") from None
