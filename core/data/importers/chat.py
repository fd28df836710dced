"""Chat-message logs → steps: shared by the ``openai`` and ``openai-legacy`` importers.

Each assistant message becomes one ``tool_call`` step per call (answered by the matching
tool result), or a ``reply`` step, the last of which is the ``final_answer``; every other
message goes into the ``observation["messages"]`` of the next step.  Reading is defensive:
null or multi-part content and unparsable arguments are kept, never fatal.

Details: docs/importers.md (## Chat messages to steps).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from core.data.importers.base import Document, RawRecord, dumps_canonical, loads

RESULT_ROLES = frozenset({"tool", "function"})
#: What an assistant message without calls may say its step is (``rwb_kind``): the workbench's
#: own kinds, which chat logs have no words for (core.rewards.trajectory.episode_messages writes them).
STEP_KINDS = ("reply", "final_answer", "terminate", "escalate")
_ERROR_TEXT = re.compile(r"^\s*(error|exception|traceback)\b", re.IGNORECASE)


@dataclass
class Conversation:
    """Steps (as dicts ready for ``Episode`` validation) and where each came from."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    #: Source field of each step, e.g. ``messages[4].tool_calls[0]`` (for error messages).
    step_fields: list[str] = field(default_factory=list)
    #: Text of the first user message: the task.
    query: str = ""
    #: Messages after the last step (e.g. a final user turn nobody answered).
    trailing: list[dict[str, Any]] = field(default_factory=list)


def content_text(content: Any) -> str | None:
    """Message content as text: strings as is, lists of parts joined, null stays None."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, dict):  # {"type": "text", "text": {"value": ...}}
                    text = text.get("value")
                if isinstance(text, str):
                    parts.append(text)
                else:  # images, audio, files: say that something was there
                    parts.append(f"[{part.get('type', 'part')}]")
            elif part is not None:
                parts.append(dumps_canonical(part))
        return "\n".join(parts)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    return dumps_canonical(content)


def decode_result(text: str | None) -> Any:
    """A tool's answer: decoded when it is a JSON object or array, else the text itself."""
    if text is None:
        return None
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            return loads(text)
        except (ValueError, RecursionError):
            return text
    return text


def result_error(message: dict[str, Any], text: str | None, decoded: Any) -> str | None:
    """Error text of a failed call, when the result message says it failed (``is_error:
    false`` says it did not, whatever the text)."""
    if message.get("is_error") is False:
        return None
    if message.get("is_error") is True or message.get("status") == "error":
        return text or "error"
    err = message.get("error")
    if err:
        return err if isinstance(err, str) else dumps_canonical(err)
    if isinstance(decoded, dict):
        err = decoded.get("error")
        if isinstance(err, str) and err.strip():
            return err
        if isinstance(err, dict) and err:
            return dumps_canonical(err)
    if isinstance(text, str) and _ERROR_TEXT.match(text):
        return text
    return None


def parse_arguments(args: Any) -> tuple[dict[str, Any], str | None]:
    """``function.arguments`` → (params, raw_arguments).

    A JSON object (string or already decoded) gives the params; empty means no params;
    anything else keeps the text in ``raw_arguments`` with empty params, so the catalog
    can flag the call INVALID ("unparsable arguments") instead of the import failing."""
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            value = loads(args)
        except (ValueError, RecursionError):
            return {}, args
        if isinstance(value, dict):
            return value, None
        return {}, args
    return {}, dumps_canonical(args)


def _seen_message(m: dict[str, Any], role: str, text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": role, "content": text}
    name = m.get("name")
    if isinstance(name, str):
        out["name"] = name
    call_id = m.get("tool_call_id")
    if isinstance(call_id, str):
        out["tool_call_id"] = call_id
    return out


def _calls_of(m: dict[str, Any], where: str, doc: Document, rec: RawRecord
              ) -> list[tuple[str, str, str | None, dict[str, Any], str | None]]:
    """(field, tool name, call id, params, raw_arguments) for each call of an assistant message."""
    calls: list[Any] = []
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise doc.error("tool_calls must be a list", rec, f"{where}.tool_calls")
        calls.extend((f"{where}.tool_calls[{k}]", c) for k, c in enumerate(tool_calls))
    fc = m.get("function_call")
    if fc is not None and not tool_calls:
        if isinstance(fc, str):  # some exporters stringify it
            try:
                fc = loads(fc)
            except (ValueError, RecursionError):
                raise doc.error("function_call is text that is not JSON", rec,
                                f"{where}.function_call") from None
        calls.append((f"{where}.function_call", {"function": fc}))
    out = []
    for f, call in calls:
        if not isinstance(call, dict):
            raise doc.error("a tool call must be an object", rec, f)
        fn = call.get("function")
        if fn is None and "custom" in call:  # {"type": "custom", "custom": {"name", "input"}}
            fn = {"name": (call["custom"] or {}).get("name"),
                  "arguments": (call["custom"] or {}).get("input")}
        if fn is None and "name" in call:  # flattened {"name": ..., "arguments": ...}
            fn = call
        if not isinstance(fn, dict):
            raise doc.error("tool call has no 'function' object", rec, f"{f}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise doc.error("tool call has no function name", rec, f"{f}.function.name")
        params, raw = parse_arguments(fn.get("arguments"))
        call_id = call.get("id")
        out.append((f, name, call_id if isinstance(call_id, str) and call_id else None, params, raw))
    return out


def convert_messages(messages: Any, *, where: str, doc: Document, rec: RawRecord,
                     finish_tool: str | None = None, none_text: bool = False) -> Conversation:
    """Turn one conversation into step dicts (docs/importers.md, "Chat messages to steps").

    ``where`` names the message list in errors (``messages`` or the ``--messages-key``).
    ``finish_tool``: a call of this name ends the episode (ToolBench's ``Finish``).
    ``none_text``: treat the content string ``"None"`` as no content (ToolBench writes it)."""
    if isinstance(messages, str):  # stringified message lists occur in exported logs
        try:
            messages = loads(messages)
        except (ValueError, RecursionError):
            raise doc.error("messages is text that is not JSON", rec, where) from None
    if not isinstance(messages, list):
        raise doc.error(f"expected a list of chat messages, got {type(messages).__name__}", rec, where)

    roles: list[str] = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise doc.error("a chat message must be an object", rec, f"{where}[{j}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise doc.error("chat message has no role", rec, f"{where}[{j}].role")
        roles.append(role)

    # Result messages by call id, in order; consumed ones are answered calls.
    by_id: dict[str, list[int]] = {}
    for j, m in enumerate(messages):
        if roles[j] in RESULT_ROLES:
            cid = m.get("tool_call_id")
            if isinstance(cid, str) and cid:
                by_id.setdefault(cid, []).append(j)
    consumed: set[int] = set()

    def find_result(j: int, call_id: str | None, name: str) -> int | None:
        for k in by_id.get(call_id, ()) if call_id else ():
            if k > j and k not in consumed:  # an answer comes after its call
                return k
        # No id to match: the next unanswered result before the next assistant turn.
        for k in range(j + 1, len(messages)):
            if roles[k] == "assistant":
                break
            if roles[k] in RESULT_ROLES and k not in consumed:
                m = messages[k]
                if isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]:
                    continue  # results with an id answer only the call with that id
                rname = m.get("name")
                if isinstance(rname, str) and rname and rname != name:
                    continue
                return k
        return None

    conv = Conversation()
    pending: list[dict[str, Any]] = []
    t = 0
    explicit_kind = False   # the last step's kind was given (rwb_kind), not inferred
    for j, m in enumerate(messages):
        role = roles[j]
        text = content_text(m.get("content"))
        if none_text and text == "None":
            text = None
        if role in RESULT_ROLES:
            if j not in consumed:  # a result nobody asked for: the agent still saw it
                pending.append(_seen_message(m, role, text))
            continue
        if role != "assistant":
            if role == "user" and not conv.query and text:
                conv.query = text
            pending.append(_seen_message(m, role, text))
            continue
        stamp = m.get("timestamp", m.get("created_at"))
        stamp = stamp if isinstance(stamp, str) else None
        calls = _calls_of(m, f"{where}[{j}]", doc, rec)
        latency = _latency(m, f"{where}[{j}]", doc, rec)
        if not calls:
            kind = m.get("rwb_kind")
            if kind is not None and kind not in STEP_KINDS:
                raise doc.error(f"rwb_kind is one of {', '.join(STEP_KINDS)}, not {kind!r}", rec,
                                f"{where}[{j}].rwb_kind")
            conv.steps.append({"t": t, "observation": {"messages": pending} if pending else None,
                               "action": {"kind": kind or "reply"}, "output_text": text,
                               "timestamp": stamp})
            if latency is not None:
                conv.steps[-1]["latency_ms"] = latency
            explicit_kind = kind is not None
            conv.step_fields.append(f"{where}[{j}]")
            t += 1
            pending = []
            continue
        for n, (f, name, call_id, params, raw) in enumerate(calls):
            step: dict[str, Any] = {
                "t": t, "observation": {"messages": pending} if (pending and n == 0) else None,
                "output_text": text if n == 0 else None, "timestamp": stamp}
            if latency is not None and n == 0:
                step["latency_ms"] = latency
            if finish_tool is not None and name == finish_tool:
                step["action"] = _finish_action(params)
                answer = params.get("final_answer")
                if isinstance(answer, str):
                    step["output_text"] = answer
            else:
                step["action"] = {"kind": "tool_call", "tool": name, "params": params,
                                  "raw_arguments": raw}
                k = find_result(j, call_id, name)
                if k is None:
                    step["result_replayed"] = False  # the log holds no answer to this call
                else:
                    consumed.add(k)
                    rtext = content_text(messages[k].get("content"))
                    decoded = decode_result(rtext)
                    step["tool_result"] = decoded
                    step["tool_error"] = result_error(messages[k], rtext, decoded)
            conv.steps.append(step)
            conv.step_fields.append(f)
            t += 1
        explicit_kind = False
        pending = []
    if conv.steps and not pending and not explicit_kind and conv.steps[-1]["action"]["kind"] == "reply":
        conv.steps[-1]["action"]["kind"] = "final_answer"
    conv.trailing = pending
    return conv


def _latency(m: dict[str, Any], where: str, doc: Document, rec: RawRecord) -> float | None:
    """``latency_ms`` of an assistant message: a finite number ≥ 0, or absent."""
    value = m.get("latency_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise doc.error("latency_ms must be a finite number ≥ 0", rec, f"{where}.latency_ms")
    return float(value)


def _finish_action(params: dict[str, Any]) -> dict[str, Any]:
    """ToolBench's ``Finish(return_type=give_answer|give_up_and_restart, final_answer=…)``."""
    rt = params.get("return_type")
    kind = "terminate" if rt == "give_up_and_restart" else "final_answer"
    return {"kind": kind, "params": {"return_type": rt} if isinstance(rt, str) else {}}


__all__ = ["Conversation", "content_text", "convert_messages", "decode_result", "parse_arguments",
           "result_error"]
