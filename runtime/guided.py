"""Grammar-constrained decoding: what a request may generate (``Guide``), compiled once per
distinct constraint and checked against the artifact's tokenizer (``GrammarCompiler``),
and the per-step token masks the sampler applies (``fill_masks``).

The grammar engine is llguidance (Rust, no dependencies). xgrammar, the other library the
field uses, imports torch and transformers when imported (2.6 s here), and the runtime
never imports torch; llguidance computes a mask for SmolLM2's 49,152-token vocabulary in
6-170 us per token on this CPU, and its numpy helpers write masks straight into an array.

A ``Guide`` is plain data, validated for shape where it is built (the HTTP layer or the
Python API); whether its schema, regex or grammar compiles is checked by
``GrammarCompiler`` on the caller's thread before the request is queued, so a bad one is
a 400 naming the field and never reaches the engine core. Each sample of a constrained
request owns one ``LLMatcher``; the core fills the masks of every constrained row of a
step in one call, samples, and advances each matcher on its token.

A constrained sample can end only where its grammar is complete: the end-of-sequence
token is allowed by the mask only in an accepting state, and once the grammar can take
nothing more the mask allows only end-of-sequence.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from .errors import InvalidRequestError, KilnError

GuideKind = Literal["json", "regex", "choice", "grammar"]
MAX_GUIDE_CHARS = 256 * 1024  # a schema / regex / grammar larger than this is refused
MAX_CHOICES = 1024
GRAMMAR_CACHE_SIZE = 256
# JSON is emitted with one space after ':' and ',' and no other whitespace: a small model
# allowed free whitespace can loop on newlines until max_tokens (a known failure of
# flexible-whitespace JSON grammars), and this is the form the models saw most in training.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Guide:
    """A constraint on a request's output. ``kind``: "json" (``spec`` a JSON schema as
    JSON text), "regex", "choice" (a JSON list of
    strings), or "grammar" (Lark, or llama.cpp's GBNF). ``field`` names the request field
    it came from, for errors."""

    kind: GuideKind
    spec: str  # the schema as JSON text (its property order kept), the regex, choices or grammar
    field: str = "response_format"

    def __post_init__(self):
        if self.kind not in ("json", "regex", "choice", "grammar"):
            raise InvalidRequestError(self.field, f"unknown constraint kind {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequestError(self.field, "must be text")
        if len(self.spec) > MAX_GUIDE_CHARS:
            raise InvalidRequestError(self.field, f"is {len(self.spec)} characters; at most {MAX_GUIDE_CHARS}")

    # -- constructors, each validating the shape of what it is given ----------------------
    @classmethod
    def json_schema(cls, schema, field: str = "response_format.json_schema.schema") -> "Guide":
        """A JSON schema given as a dict (or JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise InvalidRequestError(field, f"is not valid JSON ({err})") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise InvalidRequestError(field, "must be a JSON schema object")
        # Key order kept: a schema's property order is the order the output follows.
        return cls("json", json.dumps(schema, ensure_ascii=False), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> "Guide":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json", json.dumps({"type": "object"}), field)

    @classmethod
    def regex(cls, pattern: str, field: str = "guided_regex") -> "Guide":
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(field, "must be a non-empty regular expression")
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "guided_choice") -> "Guide":
        if (isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
        if len(options) > MAX_CHOICES:
            raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(options)}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), field)

    @classmethod
    def grammar(cls, text: str, field: str = "guided_grammar") -> "Guide":
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError(field, "must be a non-empty Lark or GBNF grammar")
        return cls("grammar", text, field)

    @classmethod
    def from_response_format(cls, value, field: str = "response_format") -> "Guide | None":
        """OpenAI's ``response_format`` (a dict, as JSON gives it), a pydantic model class,
        or a Guide. ``{"type": "text"}`` and None: no constraint."""
        if value is None or isinstance(value, Guide):
            return value
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model
            return cls.json_schema(value.model_json_schema(), field)
        if not isinstance(value, Mapping):
            raise InvalidRequestError(field, "must be an object with a type")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(field)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping):
                raise InvalidRequestError(f"{field}.json_schema", "must be an object with a name and a schema")
            if "schema" not in spec:
                raise InvalidRequestError(f"{field}.json_schema.schema", "is required")
            return cls.json_schema(spec["schema"], f"{field}.json_schema.schema")
        raise InvalidRequestError(f"{field}.type", f"must be text, json_object or json_schema, got {kind!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar this guide stands for (not yet checked)."""
        import llguidance

        match self.kind:
            case "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            case "choice":
                return llguidance.grammar_from("choice", self.spec)
            case _:
                try:
                    return llguidance.grammar_from("grammar", self.spec)
                except ValueError as err:  # GBNF that does not convert to Lark
                    raise InvalidRequestError(self.field, str(err)) from None


@dataclass(frozen=True)
class CompilerStats:
    compiled: int  # distinct guides compiled (cache misses)
    cache_hits: int
    compile_seconds: float  # total time spent compiling


class GrammarCompiler:
    """Compiles guides against one tokenizer, caching each distinct guide's checked
    grammar (LRU, by kind and canonical text). Thread-safe: request threads call it.

    ``tokenizer_json``: the artifact's tokenizer.json text; ``vocab_size``: the width of
    the model's logits (may exceed the tokenizer's: those ids are never allowed);
    ``eos_ids``: the tokens that end a constrained output where its grammar is complete."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE, on_compile: Callable[[float | None], None] = lambda s: None):
        """``on_compile(seconds)`` after each compile; ``on_compile(None)`` on a cache hit."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._cache: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer = None  # built on first use (~0.2 s for a 49k vocabulary)
        self._compiled = self._hits = 0
        self._seconds = 0.0
        self._on_compile = on_compile

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, guide: Guide) -> str:
        """The checked llguidance grammar of ``guide``; InvalidRequestError naming the
        guide's field if its schema, regex or grammar is invalid or unsupported."""
        key = (guide.kind, guide.spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
        if cached is not None:
            self._on_compile(None)
            return cached
        import llguidance

        if not self.eos_ids:
            raise InvalidRequestError(guide.field, "this model has no end-of-sequence token, so a constrained "
                                                   "output could not end; constraints are not available")
        started = time.perf_counter()
        tokenizer = self.tokenizer
        with _as_request_error(guide.field):
            text = guide.grammar_text()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise InvalidRequestError(guide.field, _short(messages[0] if messages else "invalid grammar"))
        seconds = time.perf_counter() - started
        self._on_compile(seconds)
        with self._lock:
            self._seconds += seconds
            self._compiled += 1
            self._cache[key] = text
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return text

    def matchers(self, guide: Guide, n: int) -> list:
        """``n`` fresh matchers (one per sample) for ``guide``."""
        import llguidance

        text = self.compile(guide)
        with _as_request_error(guide.field):
            first = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if first.is_error():
            raise InvalidRequestError(guide.field, _short(first.get_error()))
        return [first] + [first.deep_copy() for _ in range(n - 1)]

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(self._compiled, self._hits, self._seconds)


@contextlib.contextmanager
def _as_request_error(field: str):
    """llguidance reports a bad grammar as ValueError, and a Rust panic on odd input as
    pyo3's PanicException (a BaseException): both are the request's fault, a 400."""
    try:
        yield
    except InvalidRequestError:
        raise
    except Exception as err:  # noqa: BLE001
        raise InvalidRequestError(field, _short(str(err))) from None
    except BaseException as err:
        if type(err).__name__ != "PanicException":
            raise
        raise InvalidRequestError(field, f"the grammar engine failed on it ({_short(str(err))})") from None


def _short(message: str, limit: int = 500) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."


def fill_masks(executor, matchers: Sequence, vocab_size: int) -> np.ndarray:
    """The allowed tokens of each matcher's next step: bool [len(matchers), vocab_size],
    computed in one parallel call (llguidance writes a bitmask, 32 tokens per int32)."""
    import llguidance.numpy as llnp

    bitmask = llnp.allocate_token_bitmask(len(matchers), vocab_size)  # int32 [k, ceil(V / 32)]
    llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
    return unpack_bitmask(bitmask, vocab_size)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [k, W] bitmask (bit j of word w: token 32 w + j) -> bool [k, vocab_size]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def advance(matcher, token: int) -> None:
    """Move a sample's matcher past its sampled token (the mask allowed it, so this fails
    only on an engine bug: the request fails, nothing else)."""
    if not matcher.consume_token(token):
        raise KilnError(f"the grammar rejected token {token}: {matcher.get_error()}")
