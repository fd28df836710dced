"""OpenAI chat-completions logs (``openai``) and legacy ``function_call`` logs (``openai-legacy``).

A file is a JSON list, a JSON Lines file or one JSON object, each record one episode with
its ``messages`` (turned into steps by :mod:`core.data.importers.chat`), an optional
reward or success flag and its tools.  Options move the keys (``messages_key``,
``reward_key``, ``id_key``); ``openai-legacy`` also reads ToolBench answer files.

Details: docs/importers.md (## OpenAI chat-completions logs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from core.records.episodes import Episode, ToolSchema
from core.data.importers.base import (
    Document,
    Importer,
    ParsedFile,
    Prepared,
    RawRecord,
    ReadOptions,
    convert_each,
    get_path,
    is_finite_number,
    loc_to_path,
    prepare_fast,
    read_whole,
    register,
)
from core.data.importers.chat import Conversation, convert_messages
from core.data.task_criteria import TASK_ID_KEYS

_TRUE_WORDS = frozenset({"true", "yes", "success", "succeeded", "resolved", "pass", "passed", "win"})
_FALSE_WORDS = frozenset({"false", "no", "failure", "fail", "failed", "unresolved", "lose", "loss"})
_OUTCOME_NUMBERS = {"final_reward": "final_reward", "reward": "final_reward", "score": "final_reward",
                    "value": "final_reward", "business_metric": "business_metric",
                    "sentiment": "sentiment"}
_OUTCOME_FLAGS = {"resolved": "resolved", "success": "resolved", "solved": "resolved"}


def outcome_value(value: Any, doc: Document, rec: RawRecord, field: str) -> dict[str, Any]:
    """One outcome value → Outcome fields: bool → resolved, number → final_reward,
    ``{"resolved":…, "final_reward":…}``-like objects field by field."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"resolved": value}
    if is_finite_number(value):
        return {"final_reward": float(value)}
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return {"resolved": True}
        if word in _FALSE_WORDS:
            return {"resolved": False}
        try:
            number = float(word)
        except ValueError:
            number = float("nan")
        if number == number and abs(number) != float("inf"):
            return {"final_reward": number}
        raise doc.error(f"outcome {value[:60]!r} is neither a number nor true/false", rec, field)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in value.items():
            if k in _OUTCOME_FLAGS and (isinstance(v, bool) or _zero_one(v)):
                out[_OUTCOME_FLAGS[k]] = bool(v)
            elif k in _OUTCOME_NUMBERS and is_finite_number(v):
                out[_OUTCOME_NUMBERS[k]] = float(v)
            elif k in _OUTCOME_FLAGS or k in _OUTCOME_NUMBERS:
                if v is not None:
                    raise doc.error(f"outcome {k!r} has the wrong type ({type(v).__name__})",
                                    rec, f"{field}.{k}")
            else:
                extra[k] = v
        if extra:
            out["extra"] = extra
        return out
    raise doc.error(f"outcome must be a number, true/false or an object, got {type(value).__name__}",
                    rec, field)


def _zero_one(value: Any) -> bool:
    """A number that is 0 or 1 (not a bool: those are flags already)."""
    return is_finite_number(value) and value in (0, 1)


def _names_a_flag(key: str) -> bool:
    """Whether a (dotted) key's last part says success: ``success``, ``outcome.resolved``…"""
    return key.rsplit(".", 1)[-1].lower() in _OUTCOME_FLAGS


def _logged_resolved(record: dict[str, Any], reward_key: str | None) -> Any:
    """The record's own resolved field (``resolved`` or ``outcome.resolved``, true/false or 0/1)
    when it has one besides ``reward_key``; None otherwise."""
    for key in ("resolved", "outcome.resolved"):
        if key == reward_key:
            continue
        value = get_path(record, key, None)
        if isinstance(value, bool) or _zero_one(value):
            return bool(value)
    return None


def record_outcome(record: dict[str, Any], reward_key: str | None, doc: Document,
                   rec: RawRecord, flag: bool = False) -> tuple[dict[str, Any], bool]:
    """Outcome fields of a record and whether an outcome key was present.

    A 0/1 value is a success flag, and sets ``resolved`` beside ``final_reward``, when the
    key says so (``success``, ``resolved``, ``solved``) or ``flag`` says every value of
    ``reward_key`` in the file is 0 or 1 (see :func:`zero_one_key`); a resolved field the
    log has besides (``resolved``, ``outcome.resolved``) wins over the flag."""
    if reward_key is not None:
        value = get_path(record, reward_key, None)
        present = value is not None or _has_path(record, reward_key)
        fields = outcome_value(value, doc, rec, reward_key)
        if _zero_one(value) and (flag or _names_a_flag(reward_key)):
            fields["resolved"] = bool(value)
    else:
        fields, present = {}, False
        for key in ("outcome", "success", "reward"):  # later keys win on the same field
            if key in record:
                present = True
                fields.update(outcome_value(record[key], doc, rec, key))
                if key == "success" and _zero_one(record[key]):
                    fields["resolved"] = bool(record[key])
    logged = _logged_resolved(record, reward_key)
    if logged is not None:
        fields["resolved"] = logged
    return fields, present


def record_task_type(record: dict[str, Any]) -> str | None:
    """The record's ``task_type``, else its task id (the first of
    :data:`~core.data.task_criteria.TASK_ID_KEYS` it holds): episodes of one task then share
    a task type, which the Episodes page filters by.  None when it has neither."""
    for key in ("task_type", *TASK_ID_KEYS):
        value = get_path(record, key, None)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            continue
        text = str(value).strip()
        if text:
            return text
    return None


def zero_one_key(doc: Document, key: str) -> bool:
    """Whether ``key`` holds a success flag in this file: every record that has a value there
    holds 0 or 1 (numbers, or true/false beside them) and at least one holds a number.  A
    graded reward (any other number, such as 0.5 or 2) keeps every value a ``final_reward``."""
    numbers = 0
    for rec in doc.records:
        if rec.error is not None or not isinstance(rec.value, dict):
            continue
        value = get_path(rec.value, key, None)
        if value is None or isinstance(value, bool):
            continue
        if not is_finite_number(value) or value not in (0, 1):
            return False
        numbers += 1
    return numbers > 0


def _has_path(record: Any, dotted: str) -> bool:
    marker = object()
    return get_path(record, dotted, marker) is not marker


def record_id(record: Any, id_key: str | None, doc: Document, rec: RawRecord, fallback: str) -> str:
    """The episode id: the value at ``id_key``, else ``fallback`` (stable, generated)."""
    if id_key is None:
        return fallback
    value = get_path(record, id_key, None)
    if value is None:
        return fallback
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise doc.error(f"id must be text or a number, got {type(value).__name__}", rec, id_key)
    text = str(value)
    if not text.strip():
        raise doc.error("id is empty", rec, id_key)
    if len(text) > 512:
        raise doc.error(f"id of {len(text)} characters is longer than 512", rec, id_key)
    return text


def record_tools(record: dict[str, Any], key: str, doc: Document, rec: RawRecord,
                 skip: frozenset[str] = frozenset()) -> list[ToolSchema]:
    """The tool schemas listed under ``record[key]`` (OpenAI ``tools`` or legacy ``functions``)."""
    raw = record.get(key)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise doc.error(f"'{key}' must be a list of tool schemas", rec, key)
    tools = []
    for i, obj in enumerate(raw):
        try:
            tool = ToolSchema.from_openai(obj)
        except (ValidationError, ValueError, TypeError) as exc:
            reason = exc.errors(include_url=False)[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise doc.error(f"bad tool schema: {reason}", rec, f"{key}[{i}]") from None
        if tool.name not in skip:
            tools.append(tool)
    return tools


def build_episode(body: dict[str, Any], conv: Conversation, doc: Document, rec: RawRecord,
                  messages_field: str, for_storage: bool = False) -> Episode | Prepared:
    """Validate an episode built from a conversation; errors name the source message.

    ``for_storage``: return the stored form from the fast path when it vouches for it."""
    if for_storage:
        prepared = prepare_fast(body)
        if prepared is not None:
            return prepared
    try:
        return Episode.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int) and loc[1] < len(conv.step_fields):
            where = conv.step_fields[loc[1]]
            rest = loc_to_path(loc[2:])
            raise doc.error(f"{rest}: {msg}" if rest else msg, rec, where) from None
        if loc and loc[0] == "task":
            raise doc.error(f"task text: {msg}", rec, messages_field) from None
        raise doc.error(msg, rec, loc_to_path(loc) or None) from None


def _generated_id(doc: Document, rec: RawRecord) -> str:
    return f"{doc.path.stem}-{rec.record}"


class _ChatImporter(Importer):
    """Shared reading of chat-message records (``openai`` and generic ``openai-legacy``)."""

    accepts_keys = frozenset({"messages_key", "reward_key", "id_key"})

    def convert_chat(self, doc: Document, rec: RawRecord, options: ReadOptions,
                     tools: list[ToolSchema]) -> Episode | Prepared:
        record = rec.value
        key = options.messages_key or "messages"
        if isinstance(record, list):  # a bare list of messages is one episode too
            record, messages = {}, record
        elif not isinstance(record, dict):
            raise doc.error(f"a record must be an object, got {type(record).__name__}", rec)
        else:
            marker = object()
            messages = get_path(record, key, marker)
            if messages is marker:
                keys = ", ".join(sorted(map(str, record))[:12]) or "none"
                hint = "" if options.messages_key else "; give --messages-key"
                raise doc.error(f"no message list under '{key}' (keys here: {keys}){hint}", rec, key)
        conv = convert_messages(messages, where=key, doc=doc, rec=rec)
        outcome, _ = record_outcome(record, options.reward_key, doc, rec, options.reward_is_flag)
        tools.extend(record_tools(record, "tools", doc, rec))
        tools.extend(record_tools(record, "functions", doc, rec))
        domain = record.get("domain")
        body: dict[str, Any] = {
            "episode_id": record_id(record, options.id_key, doc, rec, _generated_id(doc, rec)),
            "domain": domain if isinstance(domain, str) and domain else "generic",
            "task": {"query": conv.query, "task_type": record_task_type(record)},
            "steps": conv.steps,
            "outcome": outcome,
            "source": {"file": doc.name, "format": self.format, "line": rec.line,
                       "record": rec.record, "raw": rec.value},
        }
        if conv.trailing:
            body["meta"] = {"trailing_messages": conv.trailing}
        return build_episode(body, conv, doc, rec, key, options.for_storage)

    def stream(self, doc: Document, options: ReadOptions) -> tuple[ParsedFile, Iterator[Prepared]]:
        if options.reward_key is not None and zero_one_key(doc, options.reward_key):
            options = replace(options, reward_is_flag=True)
        parsed = ParsedFile(format=self.format, episodes=[], tools=[], default_dataset=doc.path.stem)

        def episodes() -> Iterator[Prepared]:
            tools: dict[str, ToolSchema] = {}  # by name, first definition wins (records often repeat them)
            found: list[ToolSchema] = []  # what the record being converted lists
            domains: set[str] = set()
            keys = [(flag, key) for flag, key in (("--reward-key", options.reward_key),
                                                  ("--id-key", options.id_key)) if key is not None]
            missing = dict.fromkeys(keys, 0)
            n = 0
            for prepared in convert_each(doc, options, lambda rec: self.convert_record(doc, rec, options, found),
                                         parsed.rejected):
                for tool in found:
                    tools.setdefault(tool.name, tool)
                found.clear()
                n += 1
                domains.add(prepared.domain)
                for flag, key in keys:
                    if not _has_path(prepared.data["source"]["raw"], key):
                        missing[flag, key] += 1
                yield prepared
            for tool in found:  # those of records rejected last
                tools.setdefault(tool.name, tool)
            parsed.tools = list(tools.values())
            parsed.domain = domains.pop() if len(domains) == 1 else None
            for (flag, key), count in missing.items():
                if not n or not count:
                    continue
                if count == n:
                    # Almost surely a mistyped key: refuse rather than import without it.
                    raise doc.error(f"{flag} '{key}' is in none of the {count} records", field=key)
                what = ("their outcome is unknown" if flag == "--reward-key"
                        else "their ids were generated as <file stem>-<record index>")
                parsed.warnings.append(f"{count} record(s) lack '{key}': {what}")

        return parsed, episodes()

    def convert_record(self, doc: Document, rec: RawRecord, options: ReadOptions,
                       tools: list[ToolSchema]) -> Episode | Prepared:
        return self.convert_chat(doc, rec, options, tools)

    def read(self, doc: Document, options: ReadOptions) -> ParsedFile:
        return read_whole(self.stream(doc, options), options)


def _messages_of(value: Any, key: str) -> list[Any] | None:
    if isinstance(value, dict):
        m = get_path(value, key, None)
        return m if isinstance(m, list) else None
    if isinstance(value, list) and value and all(isinstance(x, dict) and "role" in x for x in value[:3]):
        return value
    return None


def _is_legacy(messages: list[Any]) -> bool:
    has_fc = any(isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call"))
                 for m in messages)
    has_tc = any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                 for m in messages)
    return has_fc and not has_tc


@register
class OpenAIImporter(_ChatImporter):
    format = "openai"
    description = ("OpenAI chat-completions logs: assistant tool_calls answered by role:tool "
                   "messages (JSON list, JSON Lines or one object per file).")

    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        messages = _messages_of(doc.first, options.messages_key or "messages")
        return messages is not None and not _is_legacy(messages)


@register
class OpenAILegacyImporter(_ChatImporter):
    format = "openai-legacy"
    description = ("Legacy OpenAI function_call / role:function logs, incl. ToolBench answer "
                   "files (answer_generation.train_messages, win).")

    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        first = doc.first
        if isinstance(first, dict) and isinstance(first.get("answer_generation"), dict):
            return True
        messages = _messages_of(first, options.messages_key or "messages")
        return messages is not None and _is_legacy(messages)

    def convert_record(self, doc: Document, rec: RawRecord, options: ReadOptions,
                       tools: list[ToolSchema]) -> Episode | Prepared:
        record = rec.value
        if isinstance(record, dict) and "answer_generation" in record and options.messages_key is None:
            return self._toolbench(doc, rec, options, tools)
        return self.convert_chat(doc, rec, options, tools)

    def _toolbench(self, doc: Document, rec: RawRecord, options: ReadOptions,
                   tools: list[ToolSchema]) -> Episode | Prepared:
        record = rec.value
        ag = record["answer_generation"]
        if not isinstance(ag, dict):
            raise doc.error("answer_generation must be an object", rec, "answer_generation")
        train = ag.get("train_messages")
        if not train:
            raise doc.error(
                "no train_messages: ToolBench keeps no trajectory for this run "
                f"(valid_data={ag.get('valid_data')!r}, final_answer empty), so there is nothing "
                "to import", rec, "answer_generation.train_messages")
        if not isinstance(train, list) or not all(isinstance(x, list) for x in train):
            raise doc.error("train_messages must be a list of message lists", rec,
                            "answer_generation.train_messages")
        # train_messages holds growing prefixes of one conversation; the longest is all of it.
        k = max(range(len(train)), key=lambda i: len(train[i]))
        where = f"answer_generation.train_messages[{k}]"
        conv = convert_messages(train[k], where=where, doc=doc, rec=rec,
                                finish_tool="Finish", none_text=True)
        # Finish is ToolBench's end-of-episode protocol, mapped to final_answer/terminate:
        # it is not a tool the agent can call for information.
        tools.extend(record_tools(ag, "function", doc, rec, skip=frozenset({"Finish"})))
        if options.reward_key is not None:
            outcome, _ = record_outcome(record, options.reward_key, doc, rec, options.reward_is_flag)
        else:
            win = record.get("win")
            if win is not None and not isinstance(win, bool):
                raise doc.error("'win' must be true or false", rec, "win")
            outcome = {"resolved": win}
        finish_type = ag.get("finish_type")
        if isinstance(finish_type, str):
            outcome.setdefault("extra", {})["finish_type"] = finish_type
        query = ag.get("query")
        many = len(doc.head) > 1
        body: dict[str, Any] = {
            "episode_id": record_id(record, options.id_key, doc, rec,
                                    _generated_id(doc, rec) if many else doc.path.stem),
            "domain": "toolbench",
            "task": {"query": query if isinstance(query, str) else conv.query,
                     "task_type": record_task_type(record)},
            "steps": conv.steps,
            "outcome": outcome,
            "source": {"file": doc.name, "format": self.format, "line": rec.line,
                       "record": rec.record, "raw": record},
        }
        if conv.trailing:
            body["meta"] = {"trailing_messages": conv.trailing}
        return build_episode(body, conv, doc, rec, where, options.for_storage)
