"""OpenAI chat messages -> the message dicts a Hugging Face chat template reads.

Accepted, as OpenAI's API sends them: roles system, developer (rendered as system: HF
templates do not know it), user, assistant and tool; ``content`` as a string or a list of
``{"type": "text", "text": ...}`` parts (joined); an assistant message with ``tool_calls``
and no content; a tool message answering a call by ``tool_call_id``.

For a template that renders tools itself (``native_tools``), assistant calls keep the HF
form the templates read (``tool_calls[i].function.arguments`` as a dict) and tool messages
their ``tool_call_id`` and function ``name``. For one that does not (SmolLM2's), a call is
written into the assistant's text in the JSON form the fallback asks the model for, and a
tool result becomes a user message naming the tool: every template renders user turns.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

from .errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages, native_tools: bool = False) -> list[dict]:
    """Validate ``messages`` (InvalidRequestError naming the field) and convert them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant calls
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidRequestError(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
        content = _content(m.get("content"), f"{where}.content", optional=bool(calls))
        if role == "developer":
            role = "system"
        if role == "assistant" and calls:
            for call in calls:
                names[call["id"]] = call["function"]["name"]
            if native_tools:
                out.append({"role": "assistant", "content": content, "tool_calls": calls})
            else:
                written = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) for c in calls)
                out.append({"role": "assistant", "content": (content + "\n" if content else "") + written})
            continue
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise InvalidRequestError(f"{where}.tool_call_id", "must be a string")
            name = m.get("name") or names.get(call_id or "", "")
            if native_tools:
                out.append({"role": "tool", "content": content, "tool_call_id": call_id or "", "name": name})
            else:
                out.append({"role": "user", "content": f"Result of the tool call{f' {name}' if name else ''}:\n"
                                                       f"{content}"})
            continue
        message = {"role": role, "content": content}
        if m.get("name") is not None:  # OpenAI's participant name; some templates read it
            if not isinstance(m["name"], str):
                raise InvalidRequestError(f"{where}.name", "must be a string")
            message["name"] = m["name"]
        out.append(message)
    return out


def _content(value, where: str, optional: bool) -> str:
    if value is None:
        if optional:
            return ""
        raise InvalidRequestError(where, "is required")
    if isinstance(value, str):
        return check_unicode(where, value)
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(f"{where}[{j}]", f"only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                                           f"are supported, got {kind!r}")
            texts.append(check_unicode(f"{where}[{j}].text", part["text"]))
        return "".join(texts)
    raise InvalidRequestError(where, "must be a string or a list of text parts")


def _tool_calls(value, where: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidRequestError(f"{where}.tool_calls", "must be a list")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{at}.function", "must be an object with a name and arguments")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as err:
                raise InvalidRequestError(f"{at}.function.arguments", f"is not valid JSON ({err})") from None
        if not isinstance(arguments, Mapping):
            raise InvalidRequestError(f"{at}.function.arguments", "must be a JSON object")
        call_id = call.get("id") or f"call_{j}"
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{at}.id", "must be a string")
        calls.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": dict(arguments)}})
    return calls


def check_unicode(field: str, text: str) -> str:
    """Reject text with no UTF-8 form. JSON can carry a lone surrogate (``"\\ud800"``) into a
    Python str, and ``tokenizers`` raises TypeError on one; this is a bad request instead.
    One encode attempt: UTF-8 fails only on surrogates, and the error gives the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            field, f"contains invalid Unicode (a lone surrogate at character {err.start})") from None
    return text
