"""The tokenizer files an artifact ships: ``tokenizer.json`` (for the ``tokenizers``
library) and ``tokenizer_config.json`` (chat template, BOS/EOS tokens)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.errors import UnsupportedModelError

# The keys of a foreign tokenizer_config.json that Kiln's runtime reads.
_KEPT_KEYS = ("chat_template", "bos_token", "eos_token", "add_bos_token")


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "TokenizerFiles":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(
                f"{folder}: no tokenizer.json (Kiln needs the fast-tokenizer file of the model)"
            )
        config: dict = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            raw = json.loads(config_path.read_text())
            config = {k: _token_text(raw[k]) for k in _KEPT_KEYS if k in raw}
        template_path = folder / "chat_template.jinja"  # newer HF layout
        if "chat_template" not in config and template_path.is_file():
            config["chat_template"] = template_path.read_text()
        return cls(tokenizer_json=path.read_text(), tokenizer_config=config)

    def write(self, out_dir: Path) -> list[str]:
        out_dir = Path(out_dir)
        (out_dir / "tokenizer.json").write_text(self.tokenizer_json)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config, indent=2))
        return ["tokenizer.json", "tokenizer_config.json"]


def _token_text(value):
    # tokenizer_config.json may spell special tokens as {"content": "<s>", ...}
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    return value
