"""Tool calls in decoded model text → OpenAI chat messages, so text completions can be scored.

verl hands a reward its ``solution_str`` and OpenRLHF its ``query``: decoded text carrying the model's
own tool-call markup.  This module reads the common markups (Hermes/Qwen ``<tool_call>``, Llama 3.x
JSON calls, Mistral ``[TOOL_CALLS]``, see :data:`MARKUPS`) and the chat templates around them (ChatML,
Llama 3 headers, Mistral ``[INST]``): :func:`parse_tool_calls` splits one completion into content and
calls, :func:`completion_messages` makes it one assistant message, :func:`transcript_messages` turns a
whole multi-turn transcript into messages with tool results matched to calls in order.

A call that does not parse never raises: it becomes a call named :data:`INVALID_TOOL_CALL` whose
arguments hold the text and the reason, so the scorer marks it INVALID.  Input is bounded (text length,
calls per message, JSON depth).  Details: docs/export.md ("Text completions").
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from core.base import bounded_json
from core.base.errors import InputError

#: The tool-call markups read here; ``"auto"`` picks one from the text.
MARKUPS = ("hermes", "llama3", "mistral")
#: Longest text accepted, in characters.
MAX_TEXT_CHARS = 1_000_000
#: Calls parsed per message; any further call markup becomes one invalid call (see docs/export.md).
MAX_CALLS = 64
#: Deepest nesting of lists and objects in one call's JSON (the call object itself counts as 1).
MAX_CALL_DEPTH = 32
#: Name of the tool call that stands for a call that did not parse; no catalog has this tool.
INVALID_TOOL_CALL = "invalid_tool_call"
#: Characters of an unparseable call's text kept in its ``raw`` argument.
MAX_RAW_CHARS = 2_000

#: Special tokens that end a turn; stripped from the end of a completion.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>")


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in text.  ``error`` is None for a call that parsed; otherwise it says why
    not, ``name`` is whatever name could be read ("" if none) and ``arguments`` the arguments text as
    found ({} if none).  ``raw`` is the call's text as the model wrote it."""

    name: str
    arguments: dict[str, Any] | str
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ParsedText:
    """A completion split into ``content`` (the text outside the call markup, stripped) and ``calls``;
    ``markup`` is the markup read (None when ``"auto"`` found none)."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    markup: str | None = None


# --------------------------------------------------------------------------- input checks
def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise InputError(f"expected text, got {type(text).__name__}", field="text")
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"{len(text):,} characters is more than the {MAX_TEXT_CHARS:,} allowed", field="text",
                         hint="score a shorter completion or split the transcript")
    return text


def _check_markup(markup: Any) -> str:
    if markup != "auto" and markup not in MARKUPS:
        raise InputError(f"unknown tool-call markup {markup!r}", field="markup", allowed=("auto", *MARKUPS))
    return str(markup)


# --------------------------------------------------------------------------- JSON pieces
#: A JSON string (possibly unterminated: it then runs to the end) or a bracket.
_JSON_STRUCTURE = re.compile(r'"(?:[^"\\]+|\\.)*"?|[{}\[\]]')


def _json_end(text: str, start: int) -> int | None:
    """End of the JSON object or array that opens at ``text[start]`` (brackets matched outside
    strings), or None when it is never closed."""
    depth = 0
    for m in _JSON_STRUCTURE.finditer(text, start):
        tok = m.group()
        if tok[0] == '"':
            continue
        depth += 1 if tok in "{[" else -1
        if depth == 0:
            return m.end()
    return None


def _load(text: str, what: str) -> Any:
    """``text`` as JSON within the call bounds; InputError says why not, naming ``what``."""
    return bounded_json.loads(text, max_bytes=4 * MAX_TEXT_CHARS, max_depth=MAX_CALL_DEPTH, field=what)


def _reason(exc: InputError, what: str) -> str:
    """The refusal of :func:`_load` in a sentence, with the JSON path when it points inside ``what``."""
    return f"{exc.reason} at {exc.field.replace('.[', '[')}" if exc.field and exc.field != what else exc.reason


def _call_from_value(value: Any, raw: str) -> ParsedCall:
    """A parsed JSON call object (``{"name", "arguments" | "parameters"}``, optionally nested in
    ``{"type": "function", "function": {...}}``) as a :class:`ParsedCall`."""
    if not isinstance(value, dict):
        return ParsedCall("", {}, raw, f"a tool call must be a JSON object, got {_json_type(value)}")
    if isinstance(value.get("function"), dict) and "name" not in value:
        value = value["function"]
    name = value.get("name")
    if "arguments" in value:
        args = value["arguments"]
    else:
        args = value.get("parameters")
    if not isinstance(name, str) or not name.strip():
        what = "has no \"name\"" if name is None else f"has a \"name\" that is not a tool name ({_json_type(name)})"
        found: dict[str, Any] | str = args if isinstance(args, str) else {}
        return ParsedCall("", found, raw, f"the tool call {what}")
    return _with_arguments(name.strip(), args, raw)


def _with_arguments(name: str, args: Any, raw: str) -> ParsedCall:
    """A call to ``name`` whose arguments are ``args`` (dict, JSON text of an object, or None)."""
    if args is None:
        return ParsedCall(name, {}, raw)
    if isinstance(args, str):
        text = args
        if not text.strip():
            return ParsedCall(name, {}, raw)
        try:
            args = _load(text, "arguments")
        except InputError as exc:
            return ParsedCall(name, text, raw, f"arguments of {name}: {_reason(exc, 'arguments')}")
        if not isinstance(args, dict):
            return ParsedCall(name, text, raw, f"arguments of {name} must be a JSON object, got {_json_type(args)}")
        return ParsedCall(name, args, raw)
    if not isinstance(args, dict):
        return ParsedCall(name, {}, raw, f"arguments of {name} must be a JSON object, got {_json_type(args)}")
    return ParsedCall(name, args, raw)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _json_calls(text: str, what: str) -> list[ParsedCall]:
    """The calls in one JSON call object, or in a JSON list of them."""
    try:
        value = _load(text.strip(), "call")
    except InputError as exc:
        return [ParsedCall("", {}, text, f"{what}: {_reason(exc, 'call')}")]
    if isinstance(value, list):
        if not value:
            return [ParsedCall("", {}, text, f"{what}: an empty list of tool calls")]
        return [_call_from_value(v, json.dumps(v, ensure_ascii=False)) for v in value]
    return [_call_from_value(value, text)]


def _too_many(calls: list[ParsedCall], rest: str = "") -> list[ParsedCall]:
    """At most :data:`MAX_CALLS` calls; the calls past that (and ``rest``, call text not read) become
    one invalid call."""
    if len(calls) <= MAX_CALLS and not rest:
        return calls
    extra = calls[MAX_CALLS:]
    raw = "".join(c.raw for c in extra) + rest
    return calls[:MAX_CALLS] + [ParsedCall("", {}, raw, f"more than {MAX_CALLS} tool calls in one message: "
                                           f"the calls after the {MAX_CALLS}th were not read")]


# --------------------------------------------------------------------------- Hermes / Qwen
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per message.  A final
    unclosed tag (a stop string cut it off) still counts when its JSON parses."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        if len(calls) >= MAX_CALLS:
            return "".join(content).strip(), _too_many(calls, text[start:])
        body_start = start + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        next_open = text.find(_HERMES_OPEN, body_start)
        closed = end >= 0 and (next_open < 0 or end < next_open)
        body_end = end if closed else (next_open if next_open >= 0 else len(text))
        after = body_end + len(_HERMES_CLOSE) if closed else body_end
        raw = text[start:after]
        found = _json_calls(text[body_start:body_end], "<tool_call>")
        if not closed and any(c.error for c in found):
            found = [ParsedCall(c.name, c.arguments, c.raw, f"unclosed <tool_call> tag; {c.error}") for c in found]
        calls += [c if len(found) > 1 else ParsedCall(c.name, c.arguments, raw, c.error) for c in found]
        pos = after
    return "".join(content).strip(), _too_many(calls)


# --------------------------------------------------------------------------- Llama 3.x
_PYTHON_TAG = "<|python_tag|>"
_BUILTIN_CALL = re.compile(r"\s*([A-Za-z_]\w*)\.call\((.*)\)\s*", re.S)
#: A message that opens with a JSON call object (or a list of them): ``{"name":``, ``{"function":``,
#: ``{"type": "function"``.  Other JSON (``{"answer": 42}``) is content.
_LOOKS_LIKE_CALL = re.compile(r'\s*(?:\[\s*)?\{\s*(?:"(?:name|function)"\s*:|"type"\s*:\s*"function")')


def _parse_llama3(text: str) -> tuple[str, list[ParsedCall]]:
    """Llama 3.x custom tools: JSON ``{"name": ..., "parameters": {...}}`` objects (or a JSON list of
    them) separated by ``;``, after ``<|python_tag|>`` or as the whole message; built-in tools as
    ``<|python_tag|>name.call(k=v, ...)``; other ``<|python_tag|>`` text is code for ``code_interpreter``."""
    tag = text.find(_PYTHON_TAG)
    if tag >= 0:
        before, body = text[:tag], text[tag + len(_PYTHON_TAG):]
    else:
        before, body = "", text
    stripped = body.strip()
    if tag >= 0 and stripped and stripped[0] not in "{[":
        return before.strip(), [_builtin_call(stripped)]
    content, calls = _llama_json_calls(body)
    return (before + content).strip(), calls


def _llama_json_calls(text: str) -> tuple[str, list[ParsedCall]]:
    calls: list[ParsedCall] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos >= n or text[pos] not in "{[":
            break
        if len(calls) >= MAX_CALLS:
            return "", _too_many(calls, text[pos:])
        end = _json_end(text, pos)
        if end is None:
            calls += [ParsedCall("", {}, text[pos:], "unclosed JSON tool call: the text ends inside it")]
            pos = n
            break
        calls += _json_calls(text[pos:end], "JSON tool call")
        pos = end
    return text[pos:].strip(), _too_many(calls)


def _builtin_call(code: str) -> ParsedCall:
    """``brave_search.call(query="x")`` → a call to ``brave_search``; any other text after
    ``<|python_tag|>`` is code for the ``code_interpreter`` tool (as Meta's reference decoder reads it)."""
    m = _BUILTIN_CALL.fullmatch(code)
    if not m:
        return ParsedCall("code_interpreter", {"code": code}, code)
    name = m.group(1)
    try:
        call = ast.parse(f"f({m.group(2)})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(kw.arg is None for kw in call.keywords):
            raise ValueError("arguments must be keyword=value pairs")
        args = {str(kw.arg): ast.literal_eval(kw.value) for kw in call.keywords}
        json.dumps(args, allow_nan=False)  # literals only, and JSON-able (no sets, bytes or complex numbers)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
        return ParsedCall(name, m.group(2), code, f"arguments of {name}: not literal keyword arguments ({reason})")
    if bounded_json.depth_of(args, MAX_CALL_DEPTH) > MAX_CALL_DEPTH - 1:
        return ParsedCall(name, m.group(2), code, f"arguments of {name}: nested deeper than {MAX_CALL_DEPTH} levels")
    return ParsedCall(name, args, code)


# --------------------------------------------------------------------------- Mistral
_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([^\s\[{]*)\s*)?(?:\[ARGS\])?\s*")


def _parse_mistral(text: str) -> tuple[str, list[ParsedCall]]:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11) and
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+, also with ``[CALL_ID]id`` and without ``[ARGS]``), one
    ``[TOOL_CALLS]`` per call."""
    parts = text.split(_MISTRAL_CALLS)
    content = [parts[0]]
    calls: list[ParsedCall] = []
    for i, part in enumerate(parts[1:], start=1):
        if len(calls) >= MAX_CALLS:
            return "".join(content).strip(), _too_many(calls, _MISTRAL_CALLS + _MISTRAL_CALLS.join(parts[i:]))
        raw = _MISTRAL_CALLS + part
        start = len(part) - len(part.lstrip())
        if start < len(part) and part[start] == "[":
            end = _json_end(part, start)
            if end is None:
                calls.append(ParsedCall("", {}, raw, "unclosed JSON list after [TOOL_CALLS]: the text ends inside it"))
                continue
            calls += _json_calls(part[start:end], "[TOOL_CALLS]")
            content.append(part[end:])
            continue
        m = _MISTRAL_NAMED.match(part)
        name = m.group(1) if m else ""
        args_at = m.end() if m else start
        if not name:
            calls.append(ParsedCall("", {}, raw, "[TOOL_CALLS] is not followed by a tool name or a JSON list"))
            continue
        if args_at >= len(part) or part[args_at] != "{":
            calls.append(ParsedCall(name, part[args_at:], raw, f"arguments of {name}: no JSON object after the name"))
            continue
        end = _json_end(part, args_at)
        if end is None:
            calls.append(ParsedCall(name, part[args_at:], raw, f"arguments of {name}: unclosed JSON object"))
            continue
        calls.append(_with_arguments(name, part[args_at:end], raw))
        content.append(part[end:])
    return "".join(content).strip(), _too_many(calls)


# --------------------------------------------------------------------------- one completion
_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


def detect_markup(text: str) -> str | None:
    """The markup ``"auto"`` reads in ``text``: ``<tool_call>`` → hermes, ``[TOOL_CALLS]`` → mistral,
    ``<|python_tag|>`` or a message that opens with a JSON call object (``{"name": ...``, a list of
    them) → llama3; else None."""
    if _HERMES_OPEN in text:
        return "hermes"
    if _MISTRAL_CALLS in text:
        return "mistral"
    if _PYTHON_TAG in text or _LOOKS_LIKE_CALL.match(text):
        return "llama3"
    return None


def _strip_end_tokens(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for token in _END_TOKENS:
            if text.endswith(token):
                text, changed = text[:-len(token)].rstrip(), True
    return text


def parse_tool_calls(text: str, markup: str = "auto") -> ParsedText:
    """``text`` (one decoded completion) split into content and tool calls.

    >>> p = parse_tool_calls('Checking.<tool_call>{"name": "get_order", "arguments": {"id": 7}}</tool_call>')
    >>> p.content, p.calls[0].name, p.calls[0].arguments, p.markup
    ('Checking.', 'get_order', {'id': 7}, 'hermes')
    """
    text = _strip_end_tokens(_check_text(text))
    markup = _check_markup(markup)
    found = detect_markup(text) if markup == "auto" else markup
    if found is None:
        return ParsedText(text, [], None)
    content, calls = _PARSERS[found](text)
    return ParsedText(content, calls, found)


def _openai_calls(calls: list[ParsedCall], first_id: int) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls, start=first_id):
        if c.error is None:
            name, args = c.name, c.arguments
        else:
            raw = c.raw if len(c.raw) <= MAX_RAW_CHARS else c.raw[:MAX_RAW_CHARS] + "…"
            name, args = INVALID_TOOL_CALL, {"raw": raw, "error": c.error}
        out.append({"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _assistant(parsed: ParsedText, first_id: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = _openai_calls(parsed.calls, first_id)
    return message


def completion_messages(text: str, markup: str = "auto") -> list[dict[str, Any]]:
    """One completion as ``[{"role": "assistant", "content": ..., "tool_calls": [...]}]`` (OpenAI
    shape, dict arguments, ids ``call_0``, ``call_1``, ...; no ``tool_calls`` key without calls).  A call
    that did not parse is a call to :data:`INVALID_TOOL_CALL` with arguments ``{"raw", "error"}``."""
    return [_assistant(parse_tool_calls(text, markup), 0)]


# --------------------------------------------------------------------------- transcripts
_CHATML_TURN = re.compile(r"<\|im_start\|>([^\n<]*)\n?")
_LLAMA_TURN = re.compile(r"<\|start_header_id\|>([^<]*)<\|end_header_id\|>\n{0,2}")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?(?:</tool_response>|$)", re.S)
_MISTRAL_MARK = re.compile(r"\[/?INST\]|\[/?TOOL_RESULTS\]|\[/?SYSTEM_PROMPT\]|\[/?AVAILABLE_TOOLS\]|</s>|<s>")
_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
          "gpt": "assistant", "tool": "tool", "ipython": "tool", "function": "tool", "observation": "tool"}


class _Transcript:
    """Messages under construction: call ids numbered across the transcript, tool results matched to
    the calls still waiting for one, in order."""

    def __init__(self, markup: str):
        self.markup = markup
        self.messages: list[dict[str, Any]] = []
        self.n_calls = 0
        self.waiting: list[tuple[str, str]] = []  # (call id, tool name) without a result yet

    def add(self, role: str, text: str) -> None:
        if role == "assistant":
            self.assistant(text)
        elif role == "tool":
            self.tool(text)
        else:
            text = _strip_end_tokens(text)
            if text:
                self.messages.append({"role": role, "content": text})

    def assistant(self, text: str) -> None:
        parsed = parse_tool_calls(text, self.markup)
        if not parsed.content and not parsed.calls:
            return
        message = _assistant(parsed, self.n_calls)
        self.n_calls += len(parsed.calls)
        self.waiting = [(c["id"], c["function"]["name"]) for c in message.get("tool_calls", [])]
        self.messages.append(message)

    def tool(self, content: str) -> None:
        message: dict[str, Any] = {"role": "tool", "content": _strip_end_tokens(content)}
        if self.waiting:
            call_id, name = self.waiting.pop(0)
            message["tool_call_id"], message["name"] = call_id, name
        self.messages.append(message)

    def user_or_tool_responses(self, text: str) -> None:
        """A ChatML user (or tool) turn: each ``<tool_response>`` block is a tool result; text
        around the blocks is the user's."""
        rest = _TOOL_RESPONSE.sub("", text)
        for block in _TOOL_RESPONSE.finditer(text):
            self.tool(block.group(1))
        self.add("user", rest)


def _role(name: str) -> str:
    return _ROLES.get(name.strip().lower(), "user")


def _turns(text: str, marker: re.Pattern[str], t: _Transcript) -> list[tuple[str, str]]:
    """(role, body) of each turn opened by ``marker``; text before the first turn is the assistant's
    (a response decoded without its prompt starts inside the assistant turn)."""
    found = list(marker.finditer(text))
    starts = [m.start() for m in found[1:]] + [len(text)]
    t.add("assistant", text[:found[0].start() if found else len(text)].replace("<|begin_of_text|>", ""))
    return [(_role(m.group(1)), text[m.end():end]) for m, end in zip(found, starts)]


def _chatml(text: str, t: _Transcript) -> None:
    for role, body in _turns(text, _CHATML_TURN, t):
        if role in ("user", "tool") and "<tool_response>" in body:
            t.user_or_tool_responses(_strip_end_tokens(body))
        else:
            t.add(role, body)


def _llama3(text: str, t: _Transcript) -> None:
    for role, body in _turns(text, _LLAMA_TURN, t):
        t.add(role, body)


def _mistral(text: str, t: _Transcript) -> None:
    """``<s>[SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]user[/INST]assistant</s>[TOOL_RESULTS]..[/TOOL_RESULTS]``;
    ``[AVAILABLE_TOOLS]`` is the tools schema, not a message, and text between ``</s>`` and the next
    marker belongs to no turn."""
    role, pos = "assistant", 0  # a response decoded without its prompt starts after [/INST]
    for m in _MISTRAL_MARK.finditer(text):
        _mistral_turn(t, role, text[pos:m.start()])
        role = _MISTRAL_ROLE_AFTER.get(m.group(), "none")
        pos = m.end()
    _mistral_turn(t, role, text[pos:])


_MISTRAL_ROLE_AFTER = {"[INST]": "user", "[/INST]": "assistant", "[TOOL_RESULTS]": "tool",
                       "[/TOOL_RESULTS]": "assistant", "[SYSTEM_PROMPT]": "system"}


def _mistral_turn(t: _Transcript, role: str, body: str) -> None:
    if role == "tool":
        t.tool(_mistral_result(body))
    elif role in ("user", "system", "assistant"):
        t.add(role, body)


def _mistral_result(text: str) -> str:
    """A ``[TOOL_RESULTS]`` body: ``{"content": ..., "call_id": ...}`` (v3) gives its content, any
    other text is the result itself."""
    text = text.strip()
    if text.startswith("{") and '"content"' in text:
        try:
            value = _load(text, "content")
        except InputError:
            return text
        if isinstance(value, dict) and "content" in value:
            inner = value["content"]
            return inner if isinstance(inner, str) else json.dumps(inner, ensure_ascii=False)
    return text


def detect_template(text: str) -> str | None:
    """The chat template of a transcript: ``"chatml"``, ``"llama3"``, ``"mistral"`` or None (plain text)."""
    if "<|im_start|>" in text:
        return "chatml"
    if "<|start_header_id|>" in text:
        return "llama3"
    if _MISTRAL_MARK.search(text.replace("</s>", "").replace("<s>", "")):
        return "mistral"
    return None


def transcript_messages(text: str, markup: str = "auto") -> list[dict[str, Any]]:
    """A whole decoded transcript (chat-template text with system, user and assistant turns, the
    model's tool-call markup and the tool results) as OpenAI messages.  ``markup`` is the tool-call
    markup of the assistant turns; the template (ChatML/Qwen, Llama 3, Mistral) is read from its
    special tokens, and text before the first turn marker is the assistant's (a response decoded
    without its prompt).  Plain text is one assistant message, as :func:`completion_messages`."""
    text = _check_text(text)
    markup = _check_markup(markup)
    template = detect_template(text)
    if template is None:
        return completion_messages(text, markup)
    t = _Transcript(markup)
    {"chatml": _chatml, "llama3": _llama3, "mistral": _mistral}[template](text, t)
    return t.messages


__all__ = ["INVALID_TOOL_CALL", "MARKUPS", "MAX_CALLS", "MAX_CALL_DEPTH", "MAX_TEXT_CHARS", "ParsedCall",
           "ParsedText", "completion_messages", "detect_markup", "detect_template", "parse_tool_calls",
           "transcript_messages"]
