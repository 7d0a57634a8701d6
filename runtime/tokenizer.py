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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add another.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

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
