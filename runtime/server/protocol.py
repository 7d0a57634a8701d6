"""OpenAI request bodies (plus Kiln's sampling extensions), validated by pydantic and
turned into ``SamplingParams`` once, here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import InvalidRequestError
from ..guided import Guide
from ..sampling import SamplingParams


GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    # Unknown fields are rejected by name rather than silently ignored.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=0)
    user: str | None = None
    # Kiln / vLLM extensions
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guide(self) -> Guide | None:
        """The request's output constraint (at most one of the fields may be given)."""
        given = [name for name in GUIDE_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.get("type") == "text")]
        if len(given) > 1:
            raise InvalidRequestError(given[1], f"give one output constraint, not {' and '.join(given)}")
        if not given:
            return None
        name, value = given[0], getattr(self, given[0])
        match name:
            case "response_format":
                return Guide.from_response_format(value)
            case "guided_json":
                return Guide.json_schema(value, name)
            case "guided_regex":
                return Guide.regex(value, name)
            case "guided_choice":
                return Guide.choice(value, name)
            case _:
                return Guide.grammar(value, name)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        if value is None:
            return value
        for key, bias in value.items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return value

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()), seed=self.seed,
                stop=() if self.stop is None else self.stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs, n=self.n,
                guide=self.guide())
        except InvalidRequestError:
            raise
        except ValueError as err:
            raise InvalidRequestError("body", str(err)) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("send one prompt per request (batching happens in the server)")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        return value


class ChatMessage(BaseModel):
    """Shapes only; the engine validates the rest, naming the field (messages.py)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None  # text, or OpenAI's content parts (text parts only)
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    # Accepted for the SDKs that send it; a forced call ("required", a named function) is
    # one call, and "auto" reads however many the model writes.
    parallel_tool_calls: bool | None = None
