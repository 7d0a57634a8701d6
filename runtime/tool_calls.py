"""OpenAI tool calling over the output syntaxes of the model families Kiln compiles.

A chat model calls a tool by writing the call in the syntax it was trained on; the server
turns that text into OpenAI ``tool_calls``. The syntaxes ("formats"):

  llama3_json  Llama 3.1/3.2 JSON tool calling: the reply *is* the call,
               ``{"name": f, "parameters": {...}}`` (maybe after ``<|python_tag|>``; several
               separated by ``;`` or newlines).
  hermes       Qwen2/2.5 and Hermes: ``<tool_call>\\n{"name": f, "arguments": {...}}\\n</tool_call>``,
               any number of them, after optional text.
  mistral      Mistral v0.3 and later: ``[TOOL_CALLS] [{"name": f, "arguments": {...}}, ...]``
               after optional text. ``[TOOL_CALLS]`` is a special token, so a detokenizer that
               skips special tokens leaves a bare leading list, which is read as calls too.
  kiln_json    a model whose chat template has no tools (SmolLM2): Kiln describes the tools
               in a system message (``fallback_system_prompt``) and the reply is
               ``{"name": f, "arguments": {...}}``, one per line.

For ``tool_choice`` "required" or a named function, ``call_grammar`` gives an llguidance
grammar that forces the reply into the format's call syntax with the arguments constrained
by the function's JSON schema, so a forced call always parses.

``parse_output`` reads a finished reply; ``StreamingToolParser`` reads it delta by delta and
is the one implementation of each syntax (``parse_output`` feeds it the whole text), so a
stream and a non-streamed reply always agree. Content is the text outside calls; when a
reply has calls and only whitespace besides, its content is None.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from .errors import InvalidRequestError
from .guided import JSON_OPTIONS

Format = Literal["llama3_json", "hermes", "mistral", "kiln_json"]
FORMATS: tuple[str, ...] = ("llama3_json", "hermes", "mistral", "kiln_json")
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
WS = " \t\r\n"

PYTHON_TAG = "<|python_tag|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALLS = "[TOOL_CALLS]"
MARKERS = (PYTHON_TAG, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_CALLS)

# Wording only Llama 3.1/3.2 templates use (JSON tool calling and the ipython role).
LLAMA3_SIGNS = (PYTHON_TAG, "<|eom_id|>", "Given the following functions",
                '{"name": function name, "parameters"')
DEFAULT_PARAMETERS = {"type": "object", "properties": {}}
# Forced arguments are written as guided.py writes JSON (the spacing models saw). Lenient:
# tool schemas come from any client framework, and a keyword llguidance does not implement
# ("contains", an unknown "format") should loosen the constraint, not fail the request.
ARGUMENT_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}


@dataclass(frozen=True)
class Tool:
    """One function the model may call (an OpenAI ``tools`` entry, validated)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object

    def openai(self) -> dict:
        """The entry as OpenAI writes it (what chat templates read as ``tools``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` "function" forces the call of ``name``; "required" forces some call."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's streaming shape: a call's first delta has its id and name and arguments "";
    the next ones (same index) append to arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


# -- request validation --------------------------------------------------------------------
def parse_tools(tools) -> tuple[Tool, ...]:
    """OpenAI's ``tools`` (a list of ``{"type": "function", "function": {...}}``) -> Tools.
    None or [] -> (): no tools."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools", "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[Tool] = []
    for i, entry in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(entry, Mapping):
            raise InvalidRequestError(at, "must be an object")
        if entry.get("type", "function") != "function":
            raise InvalidRequestError(f"{at}.type", f'must be "function", got {entry.get("type")!r}')
        fn = entry.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{at}.function", "is required: an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"{at}.function.name",
                                      f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if any(t.name == name for t in out):
            raise InvalidRequestError(f"{at}.function.name", f"duplicate function name {name!r}")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"{at}.function.description", "must be text")
        out.append(Tool(name, description, _parameters(fn.get("parameters"), f"{at}.function.parameters")))
    return tuple(out)


def _parameters(schema, field: str) -> dict:
    if schema is None:
        return dict(DEFAULT_PARAMETERS)
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(field, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(field, f'must describe an object (type "object"), got type {schema["type"]!r}')
    try:  # a copy that is surely JSON (the Python API may pass anything)
        schema = json.loads(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise InvalidRequestError(field, f"is not JSON ({err})") from None
    # Arguments are always an object: say so where the schema leaves the type out.
    return schema if "type" in schema else {"type": "object", **schema}


def parse_tool_choice(choice, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's ``tool_choice``: "none", "auto", "required" or
    ``{"type": "function", "function": {"name": ...}}``. Unset: "auto" if there are tools."""
    if choice is None or (choice == "auto" and not tools):
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                                     '{"type": "function", "function": {"name": ...}}, '
                                                     f"got {choice!r}")
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice", '"required" needs tools to call')
        return ToolChoice(choice)
    if not isinstance(choice, Mapping):
        raise InvalidRequestError("tool_choice", "must be a string or an object naming a function")
    if choice.get("type") != "function":
        raise InvalidRequestError("tool_choice.type", f'must be "function", got {choice.get("type")!r}')
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice.function.name", "is required")
    if not any(t.name == name for t in tools):
        raise InvalidRequestError("tool_choice", f"names function {name!r}, which is not in tools")
    return ToolChoice("function", name)


# -- formats ---------------------------------------------------------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template reads the ``tools`` variable (renders tool definitions)."""
    if not chat_template:
        return False
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False
    return any(n.name == "tools" and n.ctx == "load" for n in ast.find_all(nodes.Name))


def detect_format(chat_template: str | None) -> Format:
    """The call syntax the model was trained on, from its chat template; "kiln_json" when
    the template does not render tools (then render it without tools and add
    ``fallback_system_prompt``)."""
    if not template_supports_tools(chat_template):
        return "kiln_json"
    if TOOL_CALLS in chat_template or "[AVAILABLE_TOOLS]" in chat_template:
        return "mistral"
    if TOOL_CALL_OPEN in chat_template:
        return "hermes"
    if any(sign in chat_template for sign in LLAMA3_SIGNS):
        return "llama3_json"
    return "kiln_json"


def fallback_system_prompt(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """A system message teaching a model without tool support the kiln_json syntax."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                   ensure_ascii=False) for t in tools)
    rule = {
        "none": "Do not call a function now; answer in plain text.",
        "auto": "If a function helps, call it; otherwise answer in plain text.",
        "required": "You must call one of these functions.",
        "function": f"You must call the function {choice.name}.",
    }[choice.mode]
    return ("You can call these functions (each line: a name, what it does, and the JSON schema of its "
            f"arguments):\n{listing}\n\n"
            "To call a function, reply with only a JSON object in exactly this form:\n"
            '{"name": "<function name>", "arguments": {"<argument>": <value>, ...}}\n'
            f"To call several functions, write one such object per line and nothing else. {rule} "
            "When a message gives a function's result, answer the user in plain text using it.")


def marker_token_ids(tokenizer_json: str) -> dict[str, int]:
    """Ids of the call markers that are tokens of this tokenizer (tokenizer.json text)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return {t["content"]: t["id"] for t in added if t.get("content") in MARKERS}


def call_grammar(fmt: Format, tools: Sequence[Tool], choice: ToolChoice,
                 marker_ids: Mapping[str, int] | None = None) -> str | None:
    """An llguidance Lark grammar forcing one call in ``fmt``'s syntax (any tool for
    "required", the named one for "function"); None for "auto" and "none".

    ``marker_ids`` (``marker_token_ids``): a marker that is a token is written as that token
    id. It must be: llguidance treats added tokens (all ``<...>`` ones, and every special
    one) as special, which never match text, so a text literal "<tool_call>" would make
    Qwen spell the tag byte by byte instead of using its single token. ``<[TOOL_CALLS]>``
    by name is not expressible either (``<[...]>`` is llguidance's token-id syntax)."""
    if choice.mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    if not chosen:
        raise InvalidRequestError("tool_choice", f"names function {choice.name!r}, which is not in tools"
                                  if choice.name else '"required" needs tools to call')
    ids = marker_ids or {}

    def marker(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else json.dumps(text)

    key = "parameters" if fmt == "llama3_json" else "arguments"
    start = {
        "llama3_json": "start: call",
        "kiln_json": "start: call",
        "hermes": f'start: {marker(TOOL_CALL_OPEN)} "\\n" call "\\n" {marker(TOOL_CALL_CLOSE)}',
        # v0.3's template writes "[TOOL_CALLS] [", later ones "[TOOL_CALLS][".
        "mistral": f'start: {marker(TOOL_CALLS)} " "? "[" call "]"',
    }[fmt]
    lines = ["%llguidance {}", start, "call: " + " | ".join(f"call_{k}" for k in range(len(chosen)))]
    for k, tool in enumerate(chosen):
        # Names are [a-zA-Z0-9_-]: nothing to escape. Key order and spacing as the model saw them.
        head = json.dumps(f'{{"name": "{tool.name}", "{key}": ')
        schema = {**closed(tool.parameters), "x-guidance": ARGUMENT_JSON_OPTIONS}
        lines += [f'call_{k}: {head} args_{k} "}}"', f"args_{k}: %json {json.dumps(schema)}"]
    return "\n".join(lines) + "\n"


def closed(schema):
    """``schema`` with ``additionalProperties: false`` on every object that declares
    properties and does not say otherwise (OpenAI's strict function calling): a forced call
    then carries only the declared arguments (SmolLM2 otherwise pads them with keys copied
    from the schema, like "maxLength")."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: (closed(v) if k in _SUBSCHEMAS else v) for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    # An object with no declared properties (a function given no parameters) stays open.
    if out.get("properties") and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties")


# -- reading replies ---------------------------------------------------------------------
def parse_output(fmt: Format, text: str, tools: Sequence[Tool]) -> tuple[str | None, list[ToolCall]]:
    """A finished reply -> (content, calls). A reply without calls is all content."""
    parser = StreamingToolParser(fmt, tools)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    parts: dict[int, list[str]] = {}  # call index -> [id, name, arguments]
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                parts[e.index] = [e.id, e.name, ""]
            parts[e.index][2] += e.arguments
    calls = [ToolCall(*p) for p in parts.values()]
    if not calls:
        return text, []
    return content or None, calls


def new_call_id(fmt: Format) -> str:
    # Mistral's template refuses history whose tool call ids are not 9 letters or digits.
    return uuid.uuid4().hex[:9] if fmt == "mistral" else "call_" + uuid.uuid4().hex[:24]


class StreamingToolParser:
    """Reads one sample's reply delta by delta. Text is held back only while it could still
    start or be inside a call; a call is emitted as soon as it is complete.

    States: "start" (only whitespace read; json formats and mistral), "text" (between
    calls; hermes and mistral), "call" (the buffer starts with a call marker), "after_call"
    (json formats: another call may follow), "content" (json formats: the rest is content)."""

    def __init__(self, fmt: Format, tools: Sequence[Tool]):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}; one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self._names = frozenset(t.name for t in tools)
        self._buf = ""  # text not yet settled
        self._state = "text" if fmt == "hermes" else "start"
        self._scan: _JsonScan | None = None  # the JSON value being read in the buffer
        self._out: list[StreamEvent] = []
        self._calls = 0
        self._held_ws = ""  # leading whitespace: content only if other content or no call follows
        self._seen_text = False  # content other than whitespace was emitted
        self._finished = False

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise ValueError("feed after finish")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        if self._finished:
            return []
        events = self._drain(final=True)
        self._finished = True
        if self._held_ws and not self._calls:
            events.append(ContentDelta(self._held_ws))
        return events

    # Each step settles a prefix of the buffer (or changes state) and returns True, or
    # returns False to wait for more text. With ``final`` nothing more comes: never wait.
    def _drain(self, final: bool) -> list[StreamEvent]:
        step = {"hermes": self._step_hermes, "mistral": self._step_mistral}.get(self.fmt, self._step_json)
        while self._buf and step(final):
            pass
        events, self._out = self._out, []
        return events

    def _step_json(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "content":
            return self._settle_content(len(buf))
        i = _skip(buf, 0, WS + (";" if self._state == "after_call" else ""))
        if self._state == "start" and buf.startswith(PYTHON_TAG, i):
            i = _skip(buf, i + len(PYTHON_TAG), WS)
        rest = buf[i:]
        if not rest or (self._state == "start" and PYTHON_TAG.startswith(rest)):
            if not final:
                return False
            if self._state == "after_call":  # separators after the last call
                return self._consume(len(buf))
        elif rest[0] == "{":
            opens = _opens_with(rest, '"')  # a call object's first key
            if opens is None and not final:
                return False
            if opens:
                end = self._json_end(i)
                if end is None and not final:
                    return False
                if end is not None and self._emit(self._calls_in(buf[i:end], many=False)):
                    self._state = "after_call"
                    return self._consume(end)
        self._state = "content"
        return self._settle_content(len(buf))

    def _step_hermes(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._settle_text(TOOL_CALL_OPEN, final)
        close = buf.find(TOOL_CALL_CLOSE, len(TOOL_CALL_OPEN))
        if close < 0 and not final:
            return False
        body, end = (buf[len(TOOL_CALL_OPEN):close], close + len(TOOL_CALL_CLOSE)) if close >= 0 else \
            (buf[len(TOOL_CALL_OPEN):], len(buf))  # unterminated at the end: a call if its JSON is complete
        return self._settle_calls(self._calls_in(body, many=False), end)

    def _step_mistral(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "text":
            return self._settle_text(TOOL_CALLS, final)
        if self._state == "start":
            # [TOOL_CALLS] is a special token a detokenizer may skip: a leading list of calls
            # is calls too.
            i = _skip(buf, 0, WS)
            rest = buf[i:]
            if TOOL_CALLS.startswith(rest) or rest.startswith(TOOL_CALLS) or rest[0] != "[":
                if not final and TOOL_CALLS.startswith(rest) and rest != TOOL_CALLS:
                    return False
                self._state = "text"
                return True
            opens = _opens_with(rest, "{")
            if opens is None and not final:
                return False
            end = self._json_end(i) if opens else None
            if end is None and opens and not final:
                return False
            self._state = "text"
            if end is not None and self._emit(self._calls_in(buf[i:end], many=True)):
                return self._consume(end)
            return True
        # "call": the buffer starts with [TOOL_CALLS]
        i = _skip(buf, len(TOOL_CALLS), WS)
        if i == len(buf) and not final:
            return False
        if buf[i:i + 1] not in ("[", "{"):
            return self._settle_calls(None, len(TOOL_CALLS))
        end = self._json_end(i)
        if end is None and not final:
            return False
        end = len(buf) if end is None else end
        return self._settle_calls(self._calls_in(buf[i:end], many=True), end)

    # -- helpers ---------------------------------------------------------------------------
    def _settle_text(self, marker: str, final: bool) -> bool:
        """Text state: content up to the next marker (or up to a possible start of one)."""
        at = self._buf.find(marker)
        if at >= 0:
            self._settle_content(at)
            self._state, self._scan = "call", None
            return True
        keep = 0 if final else _partial_suffix(self._buf, marker)
        return self._settle_content(len(self._buf) - keep)

    def _settle_calls(self, calls: list[tuple[str, str]] | None, end: int) -> bool:
        """The buffer's first ``end`` characters are a call block: calls, or content if
        they are not valid calls."""
        self._state = "text"
        if self._emit(calls):
            return self._consume(end)
        self._settle_content(end)
        return True

    def _json_end(self, start: int) -> int | None:
        """End of the JSON object/array at buffer[start], None while it is open."""
        if self._scan is None or self._scan.start != start:
            self._scan = _JsonScan(start)
        return self._scan.run(self._buf)

    def _consume(self, n: int) -> bool:
        self._buf = self._buf[n:]
        self._scan = None
        return True

    def _settle_content(self, n: int) -> bool:
        """The buffer's first n characters are content. Returns whether n > 0."""
        text = self._buf[:n]
        if text and not self._seen_text:
            if text.isspace():
                self._held_ws += text
                text = ""
            else:
                text, self._held_ws = self._held_ws + text, ""
                self._seen_text = True
        if text:
            self._out.append(ContentDelta(text))
        return self._consume(n) if n else False

    def _calls_in(self, text: str, many: bool) -> list[tuple[str, str]] | None:
        """(name, arguments) of the calls ``text`` holds (a call object, or with ``many`` a
        list of them), or None if it is not wholly valid calls of known tools."""
        try:
            value = json.loads(text, strict=False, parse_constant=_no_constant)
        except ValueError:
            return None
        items = value if many and isinstance(value, list) else [value]
        calls = [self._call(item) for item in items]
        return calls if calls and all(calls) else None

    def _call(self, value) -> tuple[str, str] | None:
        if not isinstance(value, dict) or value.get("name") not in self._names:
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args, parse_constant=_no_constant)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return value["name"], json.dumps(args, ensure_ascii=False)

    def _emit(self, calls: list[tuple[str, str]] | None) -> bool:
        for name, arguments in calls or ():
            self._out += [ToolCallDelta(self._calls, new_call_id(self.fmt), name, ""),
                          ToolCallDelta(self._calls, None, None, arguments)]
            self._calls += 1
        return bool(calls)


class _JsonScan:
    """Finds where the JSON object or array starting at text[start] closes, reading each
    character once however the text grows (brackets counted outside strings; whether the
    value is valid JSON is json.loads's to say)."""

    def __init__(self, start: int):
        self.start = start
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.end: int | None = None

    def run(self, text: str) -> int | None:
        k = self.pos
        while self.end is None and k < len(text):
            c = text[k]
            k += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = k
        self.pos = k
        return self.end


def _opens_with(rest: str, inner: str) -> bool | None:
    """Whether ``rest`` (an opening bracket first) goes on, after whitespace, with
    ``inner``; None if it ends first."""
    i = _skip(rest, 1, WS)
    return None if i == len(rest) else rest[i] == inner


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
