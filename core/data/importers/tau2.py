"""tau2-bench ``tasks.json``: gold (expert) tool-call sequences, results replayed from ``db.json``.

Each task's ``evaluation_criteria.actions`` becomes an episode of tool calls; pure reads
of a ``db.json`` beside the file and ``calculate`` calls (evaluated on the syntax tree,
never with ``eval``) get their results replayed, everything else ``result_replayed=False``.
Tool schemas are inferred from the calls (descriptions from ``tools-data.json`` when
present); ``transfer_to_human_agents`` becomes an ``escalate`` step.

Details: docs/importers.md (## tau2-bench tasks).
"""

from __future__ import annotations

import ast
import operator
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.records.catalog import json_type_name
from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError
from core.data.importers.base import (
    Document,
    Importer,
    ParsedFile,
    RawRecord,
    ReadOptions,
    common_domain,
    convert_records,
    is_finite_number,
    load_document,
    models_of,
    register,
    validation_to_input_error,
)

ESCALATE_TOOLS = frozenset({"transfer_to_human_agents"})


class ToolFailed(Exception):
    """The replayed tool answered with an error (as the tau2 environment would)."""


# --------------------------------------------------------------------------- retail replay
def _fold(text: Any) -> str:
    """Case- and accent-insensitive form of a name or email (tau2 matches names this way)."""
    decomposed = unicodedata.normalize("NFKD", str(text))
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold().strip()


def _find_user_by_email(db: dict[str, Any], email: str) -> str:
    wanted = _fold(email)
    for user_id, user in db["users"].items():
        if _fold(user.get("email", "")) == wanted:
            return user_id
    raise ToolFailed("User not found")


def _find_user_by_name_zip(db: dict[str, Any], first_name: str, last_name: str, zip: str) -> str:
    first, last = _fold(first_name), _fold(last_name)
    for user_id, user in db["users"].items():
        name = user.get("name") or {}
        if (_fold(name.get("first_name", "")) == first and _fold(name.get("last_name", "")) == last
                and (user.get("address") or {}).get("zip") == zip):
            return user_id
    raise ToolFailed("User not found")


def _lookup(table: str, what: str, arg: str) -> Callable[..., Any]:
    """A read of one row by key; ``arg`` is the tool's parameter name (``order_id``…)."""
    def get(db: dict[str, Any], **kwargs: Any) -> Any:
        if set(kwargs) != {arg}:
            raise TypeError(f"expected exactly the argument {arg!r}")
        try:
            return db[table][kwargs[arg]]
        except (KeyError, TypeError):
            raise ToolFailed(f"{what} not found") from None
    return get


def _get_item(db: dict[str, Any], item_id: str) -> Any:
    for product in db["products"].values():
        variants = product.get("variants") or {}
        if item_id in variants:
            return variants[item_id]
    raise ToolFailed("Item not found")


def _list_product_types(db: dict[str, Any]) -> dict[str, str]:
    return dict(sorted((p.get("name", pid), pid) for pid, p in db["products"].items()))


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """tau2's ``calculate``: + - * / and parentheses on numbers, rounded to 2 decimals.

    Walks the syntax tree; never calls ``eval``."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ToolFailed("Invalid expression")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and is_finite_number(node.value):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](value(node.left), value(node.right))
        raise ToolFailed("Invalid characters in expression")

    try:
        return str(round(value(ast.parse(expression, mode="eval")), 2))
    except (SyntaxError, ZeroDivisionError, OverflowError, RecursionError, ValueError):
        raise ToolFailed("Invalid expression") from None


#: Pure reads of the retail database: name -> (function, tables whose writes invalidate it).
RETAIL_READS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {
    "find_user_id_by_email": (_find_user_by_email, frozenset({"users"})),
    "find_user_id_by_name_zip": (_find_user_by_name_zip, frozenset({"users"})),
    "get_user_details": (_lookup("users", "User", "user_id"), frozenset({"users"})),
    "get_order_details": (_lookup("orders", "Order", "order_id"), frozenset({"orders"})),
    "get_product_details": (_lookup("products", "Product", "product_id"), frozenset()),
    "get_item_details": (_get_item, frozenset()),
    "list_all_product_types": (_list_product_types, frozenset()),
}
#: Tables each retail write may change (writes touch users' gift cards/addresses and orders,
#: never the product catalogue).
RETAIL_WRITES_TOUCH = frozenset({"users", "orders"})


def tool_type(name: str, described: dict[str, Any] | None) -> str:
    """READ / WRITE / GENERIC: from tools-data.json when it knows the tool, else by name."""
    if described and isinstance(described.get("type"), str):
        return described["type"]
    if name == "calculate":
        return "GENERIC"
    if name in RETAIL_READS or name.startswith(("get_", "find_", "search_", "list_")):
        return "READ"
    return "WRITE"


# --------------------------------------------------------------------------- schemas
def _merge_types(types: set[str]) -> str | None:
    if len(types) == 1:
        return next(iter(types))
    if types == {"integer", "number"}:
        return "number"
    return None


def infer_schema(name: str, calls: list[dict[str, Any]], described: dict[str, Any] | None,
                 domain: str) -> ToolSchema:
    """A ToolSchema from the arguments of every gold call of ``name``."""
    order: list[str] = []
    types: dict[str, set[str]] = {}
    item_types: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for args in calls:
        for k, v in args.items():
            if k not in types:
                order.append(k)
                types[k], item_types[k], counts[k] = set(), set(), 0
            types[k].add(json_type_name(v))
            counts[k] += 1
            if isinstance(v, list):
                item_types[k].update(json_type_name(x) for x in v)
    doc_params = {p.get("name"): p for p in (described or {}).get("parameters", [])
                  if isinstance(p, dict)}
    properties: dict[str, Any] = {}
    for k in order:
        prop: dict[str, Any] = {}
        t = _merge_types(types[k])
        if t:
            prop["type"] = t
        it = _merge_types(item_types[k])
        if t == "array" and it:
            prop["items"] = {"type": it}
        desc = (doc_params.get(k) or {}).get("description")
        if isinstance(desc, str):
            prop["description"] = desc
        properties[k] = prop
    required = [k for k in order if counts[k] == len(calls)]
    kind = tool_type(name, described)
    description = (described or {}).get("description")
    return ToolSchema(
        name=name,
        description=description if isinstance(description, str) else f"tau2 {domain} tool {name}",
        parameters={"type": "object", "properties": properties, "required": required},
        risk="medium" if kind == "WRITE" and name not in ESCALATE_TOOLS else "low",
        meta={"tau2_type": kind, "schema_source": "inferred from the gold calls"},
    )


def _load_side_file(path: Path) -> Any:
    doc = load_document(path)
    if doc.layout == "jsonl":
        raise InputError("expected one JSON object", file=str(path))
    return doc.head[0].value


def _tools_data(folder: Path, domain: str) -> dict[str, dict[str, Any]]:
    """tau2 leaderboard ``tools-data.json`` entries of ``domain`` by name (empty when absent)."""
    for candidate in (folder / "tools-data.json", folder.parent / "tools-data.json"):
        if candidate.is_file():
            data = _load_side_file(candidate)
            block = data.get(domain) if isinstance(data, dict) else None
            tools = block.get("tools") if isinstance(block, dict) else None
            if isinstance(tools, list):
                return {t["name"]: t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)}
            return {}
    return {}


def _retail_db(folder: Path) -> dict[str, Any] | None:
    path = folder / "db.json"
    if not path.is_file():
        return None
    db = _load_side_file(path)
    for table in ("users", "orders", "products"):
        if not isinstance(db, dict) or not isinstance(db.get(table), dict):
            raise InputError(f"db.json has no '{table}' table; it is not a tau2 retail database",
                             file=str(path), field=table)
    return db


# --------------------------------------------------------------------------- importer
def _domain_of(record: dict[str, Any], doc: Document) -> str:
    scenario = record.get("user_scenario")
    instructions = scenario.get("instructions") if isinstance(scenario, dict) else None
    domain = instructions.get("domain") if isinstance(instructions, dict) else None
    return domain if isinstance(domain, str) and domain else doc.path.parent.name or "tau2"


def _gold_actions(record: dict[str, Any], doc: Document, rec: RawRecord) -> list[tuple[str, dict[str, Any]]]:
    criteria = record.get("evaluation_criteria")
    if criteria is None:
        return []
    if not isinstance(criteria, dict):
        raise doc.error("evaluation_criteria must be an object", rec, "evaluation_criteria")
    actions = criteria.get("actions") or []
    if not isinstance(actions, list):
        raise doc.error("actions must be a list", rec, "evaluation_criteria.actions")
    out = []
    for i, a in enumerate(actions):
        where = f"evaluation_criteria.actions[{i}]"
        if not isinstance(a, dict):
            raise doc.error("an action must be an object", rec, where)
        name = a.get("name")
        if not isinstance(name, str) or not name:
            raise doc.error("action has no tool name", rec, f"{where}.name")
        args = a.get("arguments")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise doc.error("arguments must be an object", rec, f"{where}.arguments")
        out.append((name, args))
    return out


def _task_type(actions: list[tuple[str, dict[str, Any]]]) -> str:
    """What the task is about: the verb of its first write (return, exchange, cancel…)."""
    for name, _ in actions:
        if tool_type(name, None) == "WRITE":
            return name.split("_")[0]
    return "inquiry"


@register
class Tau2Importer(Importer):
    format = "tau2"
    description = ("tau2-bench tasks.json gold action sequences; results replayed from a "
                   "db.json beside it for pure reads.")

    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        first = doc.first
        return (doc.layout == "json-list" and isinstance(first, dict)
                and "evaluation_criteria" in first and "user_scenario" in first)

    def read(self, doc: Document, options: ReadOptions) -> ParsedFile:
        folder = doc.path.parent
        db = _retail_db(folder)
        calls_by_tool: dict[str, list[dict[str, Any]]] = {}
        domains: list[str] = []
        replayed = [0, 0]

        def convert(rec: RawRecord) -> Episode:
            record = rec.value
            if not isinstance(record, dict):
                raise doc.error(f"a task must be an object, got {type(record).__name__}", rec)
            task_id = record.get("id")
            if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or str(task_id) == "":
                raise doc.error("task has no id", rec, "id")
            domain = _domain_of(record, doc)
            actions = _gold_actions(record, doc, rec)
            use_db = db if domain == "retail" else None
            steps: list[dict[str, Any]] = []
            dirty: set[str] = set()
            for name, args in actions:
                step: dict[str, Any] = {"t": len(steps),
                                        "action": {"kind": "escalate" if name in ESCALATE_TOOLS
                                                   else "tool_call", "tool": name, "params": args}}
                read = RETAIL_READS.get(name) if use_db is not None else None
                if name == "calculate":
                    self._answer(step, calculate, args)
                elif read is not None and not (read[1] & dirty):
                    self._answer(step, lambda **kw: read[0](use_db, **kw), args)
                else:
                    step["result_replayed"] = False
                    if tool_type(name, None) == "WRITE":
                        dirty |= RETAIL_WRITES_TOUCH
                replayed[0 if step.get("result_replayed", True) else 1] += 1
                steps.append(step)
            criteria = record.get("evaluation_criteria") or {}
            if not steps or steps[-1]["action"]["kind"] != "escalate":
                info = criteria.get("communicate_info")
                text = "; ".join(x for x in info if isinstance(x, str)) if isinstance(info, list) else None
                steps.append({"t": len(steps), "action": {"kind": "final_answer"},
                              "output_text": text or None})
            scenario = record.get("user_scenario")
            instructions = scenario.get("instructions") if isinstance(scenario, dict) else None
            query = instructions.get("reason_for_call") if isinstance(instructions, dict) else None
            basis = criteria.get("reward_basis")
            body = {
                "episode_id": f"{domain}-{task_id}",
                "domain": domain,
                "task": {"query": query if isinstance(query, str) else "",
                         "task_type": _task_type(actions)},
                "steps": steps,
                "outcome": {"resolved": True,
                            "extra": {"gold": True, "reward_basis": basis if isinstance(basis, list) else None}},
                "source": {"file": doc.name, "format": self.format, "line": rec.line,
                           "record": rec.record, "raw": record},
                "behaviour": "expert",
                "meta": {"gold": True, "task_id": str(task_id)},
            }
            try:
                ep = Episode.model_validate(body)
            except ValidationError as exc:
                raise validation_to_input_error(exc, doc, rec) from None
            for name, args in actions:
                calls_by_tool.setdefault(name, []).append(args)
            domains.append(domain)
            return ep

        items, rejected = convert_records(doc, options, convert)
        episodes = models_of(items, options)
        domain = common_domain(items)
        described = _tools_data(folder, domain) if domain else {}
        tools = [infer_schema(name, calls, described.get(name), domain or "tau2")
                 for name, calls in sorted(calls_by_tool.items())]
        warnings = []
        if replayed[1]:
            why = ("writes, or reads of data a write had changed" if db is not None
                   else "there is no db.json beside the tasks file to replay reads from")
            warnings.append(f"{replayed[1]} of {sum(replayed)} gold calls have no replayed "
                            f"result: {why}")
        return ParsedFile(format=self.format, episodes=episodes, prepared=items, tools=tools, rejected=rejected,
                          domain=domain, default_dataset=f"tau2_{domain}" if domain else doc.path.stem,
                          warnings=warnings)

    @staticmethod
    def _answer(step: dict[str, Any], fn: Callable[..., Any], args: dict[str, Any]) -> None:
        """Fill the step's result by calling the replay function with the logged arguments."""
        try:
            step["tool_result"] = fn(**args)
        except ToolFailed as exc:
            step["tool_error"] = str(exc)
        except TypeError:  # wrong or missing argument names: the call cannot be replayed
            step["result_replayed"] = False
            step["tool_error"] = "arguments do not fit the tool; result not replayed"
