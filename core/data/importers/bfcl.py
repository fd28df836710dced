"""BFCL multi-turn: user turns + ground-truth Python-call strings + per-class tool docs.

The question file (``BFCL_v4_multi_turn_base.json``, JSON Lines) holds, per entry, the
user's turns and the API classes involved.  Its ground truth sits in
``possible_answer/<same file name>`` beside it: per turn, a list of calls written as
Python, e.g. ``"mv(source='a.pdf', destination='temp')"``.  They are parsed with
:mod:`ast` and their arguments read with ``ast.literal_eval`` (literals only — never
``eval``); positional arguments take the names of the tool's documented parameters in
order.  Tool schemas come from ``multi_turn_func_doc/<class file>.json``.

BFCL ships no tool results (they come from executing its Python classes), so every call
step has ``result_replayed=False``.  Each user turn goes into the observation of the
turn's first step (``observation["state"]["turn"]`` numbers the turns); the episode ends
with a ``final_answer`` step.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError
from core.data.importers.base import (
    Document,
    Importer,
    ParsedFile,
    RawRecord,
    ReadOptions,
    convert_records,
    dedupe_tools,
    load_document,
    models_of,
    register,
    validation_to_input_error,
)

#: BFCL's API classes and the func-doc file that documents each.
CLASS_DOCS: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}

#: BFCL's Python-flavoured type names → JSON Schema.
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array",
          "int": "integer", "str": "string", "bool": "boolean"}


def json_schema(node: Any) -> Any:
    """BFCL parameter docs → JSON Schema (``dict``→object, ``float``→number, ``any``→no type)."""
    if isinstance(node, list):
        return [json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "type" and isinstance(v, str):
            if v == "any":
                continue
            out[k] = _TYPES.get(v, v)
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: json_schema(p) for name, p in v.items()}
        else:
            out[k] = json_schema(v)
    return out


def _to_json_value(v: Any) -> Any:
    """literal_eval results → JSON values (tuples become lists); anything else is refused."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_to_json_value(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _to_json_value(x) for k, x in v.items()}
    raise ValueError(f"{type(v).__name__} values are not JSON")


def parse_call(text: Any, param_order: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """``"mv(source='a', destination='b')"`` → ``("mv", {"source": "a", "destination": "b"})``.

    Raises ValueError with the reason when ``text`` is not one plain call of literals."""
    if not isinstance(text, str):
        raise ValueError(f"expected a call as text, got {type(text).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not a Python call: {exc.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call):
        raise ValueError("not a function call")
    if isinstance(call.func, ast.Name):
        name = call.func.id
    elif isinstance(call.func, ast.Attribute):  # "TwitterAPI.post_tweet(...)"
        name = call.func.attr
    else:
        raise ValueError("the called thing is not a plain name")
    params: dict[str, Any] = {}
    order = param_order.get(name, [])
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            raise ValueError("*args are not supported")
        if i >= len(order):
            raise ValueError(f"positional argument {i + 1} of {name}() has no documented name")
        params[order[i]] = _to_json_value(ast.literal_eval(arg))
    for kw in call.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs are not supported")
        params[kw.arg] = _to_json_value(ast.literal_eval(kw.value))
    return name, params


def _read_jsonl(path: Path, what: str) -> list[Any]:
    if not path.is_file():
        raise InputError(f"{what} not found: expected {path}", file=str(path))
    doc = load_document(path)
    for r in doc.records:
        if r.error is not None:
            raise r.error
    return [r.value for r in doc.records]


@register
class BfclImporter(Importer):
    format = "bfcl"
    description = ("BFCL multi-turn questions + possible_answer Python-call strings (parsed "
                   "with ast) + multi_turn_func_doc schemas.")

    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        first = doc.first
        return isinstance(first, dict) and "question" in first and (
            "involved_classes" in first or "initial_config" in first)

    def read(self, doc: Document, options: ReadOptions) -> ParsedFile:
        folder = doc.path.parent
        answers_path = folder / "possible_answer" / doc.path.name
        answers: dict[str, Any] = {}
        for i, a in enumerate(_read_jsonl(answers_path, "BFCL ground truth (possible_answer)")):
            if not isinstance(a, dict) or not isinstance(a.get("id"), str):
                raise InputError("entry has no id", file=str(answers_path), record=i, field="id")
            answers[a["id"]] = a.get("ground_truth")
        class_tools: dict[str, list[ToolSchema]] = {}
        warnings: list[str] = []
        used_tools: list[ToolSchema] = []

        def tools_of(cls: str) -> list[ToolSchema]:
            if cls not in class_tools:
                stem = CLASS_DOCS.get(cls)
                path = folder / "multi_turn_func_doc" / f"{stem}.json"
                if stem is None or not path.is_file():
                    warnings.append(f"no tool docs for BFCL class {cls!r}: its calls have no schema")
                    class_tools[cls] = []
                else:
                    tools = []
                    for i, d in enumerate(_read_jsonl(path, "BFCL tool docs")):
                        try:
                            tools.append(ToolSchema(
                                name=d["name"], description=d.get("description") or "",
                                parameters=json_schema(d.get("parameters") or {"type": "dict", "properties": {}}),
                                meta={"bfcl_class": cls, "response": json_schema(d.get("response"))}))
                        except (KeyError, TypeError, ValidationError) as exc:
                            raise InputError(f"bad tool doc: {exc}", file=str(path), record=i) from None
                    class_tools[cls] = tools
            return class_tools[cls]

        def convert(rec: RawRecord) -> Episode:
            record = rec.value
            if not isinstance(record, dict):
                raise doc.error(f"an entry must be an object, got {type(record).__name__}", rec)
            entry_id = record.get("id")
            if not isinstance(entry_id, str) or not entry_id:
                raise doc.error("entry has no id", rec, "id")
            turns = record.get("question")
            if not isinstance(turns, list):
                raise doc.error("question must be a list of turns", rec, "question")
            classes = record.get("involved_classes") or []
            if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
                raise doc.error("involved_classes must be a list of class names", rec, "involved_classes")
            if entry_id not in answers:
                raise doc.error(f"no ground truth for this id in {answers_path.name}", rec, "id")
            truth = answers[entry_id]
            if not isinstance(truth, list) or len(truth) != len(turns):
                raise doc.error(f"ground truth has {len(truth) if isinstance(truth, list) else 'no'} "
                                f"turns for {len(turns)} question turns", rec, "ground_truth")
            tools = [t for cls in classes for t in tools_of(cls)]
            order = {t.name: list((t.parameters.get("properties") or {}).keys()) for t in tools}
            steps: list[dict[str, Any]] = []
            pending: list[dict[str, Any]] = []
            query = ""
            for k, (turn, calls) in enumerate(zip(turns, truth)):
                if not isinstance(turn, list):
                    raise doc.error("a turn must be a list of messages", rec, f"question[{k}]")
                for j, m in enumerate(turn):
                    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                        raise doc.error("a message needs text content", rec, f"question[{k}][{j}]")
                    role = m.get("role") if isinstance(m.get("role"), str) else "user"
                    pending.append({"role": role, "content": m["content"]})
                    query = query or (m["content"] if role == "user" else "")
                if not isinstance(calls, list):
                    raise doc.error("a turn's ground truth must be a list of calls", rec,
                                    f"ground_truth[{k}]")
                for j, text in enumerate(calls):
                    try:
                        name, params = parse_call(text, order)
                    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as exc:
                        raise doc.error(str(exc) or "unparsable call", rec, f"ground_truth[{k}][{j}]") from None
                    steps.append({"t": len(steps),
                                  "observation": {"messages": pending, "state": {"turn": k}} if pending
                                  else {"state": {"turn": k}},
                                  "action": {"kind": "tool_call", "tool": name, "params": params},
                                  "result_replayed": False})
                    pending = []
            steps.append({"t": len(steps),
                          "observation": {"messages": pending, "state": {"turn": max(len(turns) - 1, 0)}}
                          if pending else None,
                          "action": {"kind": "final_answer"}})
            excluded = record.get("excluded_function")
            body = {
                "episode_id": entry_id, "domain": "bfcl",
                "task": {"query": query, "task_type": "+".join(sorted(classes)) or None,
                         "intents": sorted(classes)},
                "steps": steps,
                "outcome": {"resolved": True, "extra": {"gold": True}},
                "source": {"file": doc.name, "format": self.format, "line": rec.line,
                           "record": rec.record, "raw": {"entry": record, "ground_truth": truth}},
                "behaviour": "expert",
                "meta": {"gold": True, "involved_classes": classes,
                         "excluded_function": excluded if isinstance(excluded, list) else [],
                         "initial_config": record.get("initial_config")},
            }
            try:
                ep = Episode.model_validate(body)
            except ValidationError as exc:
                raise validation_to_input_error(exc, doc, rec) from None
            used_tools.extend(tools)
            return ep

        items, rejected = convert_records(doc, options, convert)
        episodes = models_of(items, options)
        return ParsedFile(format=self.format, episodes=episodes, prepared=items, tools=dedupe_tools(used_tools),
                          rejected=rejected, domain="bfcl", default_dataset=doc.path.stem,
                          warnings=sorted(set(warnings)))
