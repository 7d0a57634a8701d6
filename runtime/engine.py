"""The Python API: load an artifact, generate or stream text.

    engine = Engine.load("artifacts/smollm2-135m-llvm")
    print(engine.generate("The capital of France is", max_tokens=16).text)
    for delta in engine.stream([{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1):
        print(delta.text, end="", flush=True)

A prompt is either a string (tokenized as is, with the tokenizer's BOS rule) or a list
of chat messages (rendered through the model's chat template).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from .artifact import Manifest, load_manifest, verify_files
from .detokenizer import IncrementalDetokenizer
from .device import open_device
from .errors import InvalidRequestError, PromptTooLongError
from .executor import ExplicitKVExecutor
from .sampling import SamplingParams, make_generator, sample_token
from .stop import StopMatcher
from .tokenizer import Message, Tokenizer

Prompt = str | Sequence[Message]


@dataclass(frozen=True)
class Delta:
    """One generated token's contribution to a stream. ``text`` may be "" while bytes of
    a character or a possible stop string are held back; the last delta has a
    ``finish_reason`` ("stop": EOS / stop string / stop token, "length": max_tokens or
    the context window)."""

    text: str
    token_id: int | None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    time_to_first_token_s: float
    total_time_s: float

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total_time_s - self.time_to_first_token_s
        return (len(self.token_ids) - 1) / decode_time if len(self.token_ids) > 1 and decode_time > 0 else 0.0


class Engine:
    def __init__(self, folder: Path, manifest: Manifest, executor: ExplicitKVExecutor, tokenizer: Tokenizer):
        self.folder = folder
        self.manifest = manifest
        self.config = manifest.model
        self._executor = executor
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str | Path, device_id: int = 0, verify_hashes: bool = True) -> "Engine":
        """Load an artifact folder. Raises ArtifactError (missing, corrupt, altered, or too
        new an artifact) or DeviceError (its target cannot run on this host)."""
        folder = Path(path)
        manifest = load_manifest(folder)
        verify_files(folder, manifest, check_hashes=verify_hashes)
        device = open_device(manifest.target, device_id)
        executor = ExplicitKVExecutor(folder, manifest, device)
        tokenizer = Tokenizer.from_folder(folder, manifest.model.eos_token_ids)
        return cls(folder, manifest, executor, tokenizer)

    # -- public API ---------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 on_token: Callable[[Delta], None] | None = None, **overrides) -> Completion:
        """Generate to completion. ``overrides`` are SamplingParams fields
        (``max_tokens=``, ``temperature=``, ``top_k=``, ``top_p=``, ``seed=``, ``stop=``...)."""
        start = time.perf_counter()
        first = None
        texts, ids, finish = [], [], "length"
        prompt_ids = self.encode_prompt(prompt)
        for delta in self._run(prompt_ids, _params(params, overrides)):
            if first is None:
                first = time.perf_counter() - start
            texts.append(delta.text)
            if delta.token_id is not None:
                ids.append(delta.token_id)
            if delta.finish_reason:
                finish = delta.finish_reason
            if on_token is not None:
                on_token(delta)
        total = time.perf_counter() - start
        return Completion("".join(texts), tuple(ids), finish, len(prompt_ids), first or total, total)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **overrides) -> Iterator[Delta]:
        """Yield one Delta per generated token. Bad input raises before the first delta."""
        prompt_ids = self.encode_prompt(prompt)
        params = _params(params, overrides)
        return self._run(prompt_ids, params)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode_chat(prompt)
        else:
            raise InvalidRequestError("prompt", "must be a string or a list of chat messages")
        if not ids:
            raise InvalidRequestError("prompt", "is empty after tokenization")
        if len(ids) >= self.config.context_length:
            raise PromptTooLongError(
                f"prompt: {len(ids)} tokens do not fit the context window of {self.config.context_length} "
                f"tokens (at least one must be left for the output)"
            )
        return ids

    # -- the generation loop (one sequence) --------------------------------------------
    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Delta]:
        for t in params.stop_token_ids:
            if t >= self.config.vocab_size:
                raise InvalidRequestError("stop_token_ids", f"{t} is outside the vocabulary ({self.config.vocab_size})")
        return self._generate(prompt_ids, params)

    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Delta]:
        ex = self._executor
        rng = make_generator(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stops = StopMatcher(params.stop)
        end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        budget = min(params.max_tokens, self.config.context_length - len(prompt_ids))

        ids = np.asarray([prompt_ids], dtype=np.int64)
        logits, kv = ex.prefill(ids, np.arange(len(prompt_ids), dtype=np.int64)[None])
        for step in range(budget):
            token = sample_token(logits[0], params, rng)
            if token in end_ids:
                yield Delta(stops.feed(detok.flush()) + stops.flush(), token, "stop")
                return
            text = stops.feed(detok.add(token))
            if not stops.stopped and step == budget - 1:
                text += stops.feed(detok.flush())
                text += stops.flush()
            if stops.stopped:
                yield Delta(text, token, "stop")
                return
            if step == budget - 1:
                yield Delta(text, token, "length")
                return
            yield Delta(text, token)
            position = np.asarray([[kv.length]], dtype=np.int64)
            logits, kv = ex.decode(np.asarray([[token]], dtype=np.int64), position, kv)


def _params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    params = params or SamplingParams()
    if overrides:
        params = params.replace(**overrides)
    return params
