"""A request's tools, applied: how its prompt is rendered, what its output is constrained
to, and how its output is read back into tool calls (the syntaxes are in tool_calls.py).

With a template that renders tools (Llama 3.x, Qwen2 / Hermes, Mistral) the tools go to
the template and the model answers in its own call syntax. With one that does not
(SmolLM2's), a system message describes the tools and the one JSON form a call takes
(``tool_calls.fallback_system_prompt``). Under ``tool_choice`` "required" or a named
function the output is constrained to a call whose arguments follow the function's JSON
schema, so it always parses; under "auto" the model chooses, and text that is not a
well-formed call of a known tool stays content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .errors import InvalidRequestError
from .guided import Guide
from .tool_calls import (Format, StreamingToolParser, Tool, ToolCall, ToolChoice, call_grammar,
                         fallback_system_prompt, parse_output, parse_tool_choice, parse_tools)


@dataclass(frozen=True)
class ToolUse:
    fmt: Format
    tools: tuple[Tool, ...]
    choice: ToolChoice

    def parser(self) -> StreamingToolParser:
        """One per sample of a streamed reply."""
        return StreamingToolParser(self.fmt, self.tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_output(self.fmt, text, self.tools)


@dataclass(frozen=True)
class PreparedChat:
    messages: list  # what the template renders
    render_tools: list[dict] | None  # the ``tools`` the template reads, if it reads them
    tool_use: ToolUse | None  # None: the request has no tools (or tool_choice "none")
    guide: Guide | None  # the request's constraint, with the forced call's if any


def prepare_chat(prompt, tools, tool_choice, guide: Guide | None,
                 syntax: Callable[[], tuple[Format, Mapping[str, int]]]) -> PreparedChat:
    """Validate ``tools`` / ``tool_choice`` (InvalidRequestError naming the field) and apply
    them to a chat prompt. ``syntax()``: the model's call format and its marker token ids
    (asked only for a request with tools)."""
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    if not parsed or choice.mode == "none":
        return PreparedChat(prompt, None, None, guide)
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not all(isinstance(m, Mapping)
                                                                               for m in prompt):
        raise InvalidRequestError("tools", "tools need a chat prompt (a list of messages)")
    fmt, marker_ids = syntax()
    grammar = call_grammar(fmt, parsed, choice, marker_ids)
    if grammar is not None:
        if guide is not None:
            raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with "
                                                     f"another output constraint ({guide.field})")
        guide = Guide.grammar(grammar, field="tool_choice")
    use = ToolUse(fmt, parsed, choice)
    if fmt != "kiln_json":
        return PreparedChat(list(prompt), [t.openai() for t in parsed], use, guide)
    return PreparedChat(_with_system(list(prompt), fallback_system_prompt(parsed, choice)), None, use, guide)


def _with_system(messages: list, text: str) -> list:
    """``text`` as the system message, after the request's own system message if it has one."""
    first = messages[0] if messages else None
    if isinstance(first, Mapping) and first.get("role") in ("system", "developer") \
            and isinstance(first.get("content"), str):
        return [{**first, "role": "system", "content": f"{first['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
