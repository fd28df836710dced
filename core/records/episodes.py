"""Episode / Step schema (docs/design.md §3), validated once at the edge.

An *episode* is one recorded agent run: the user's task, the steps the agent
took (tool calls, replies, the final answer), what the tools answered, and the
outcome.  Importers (``core.data.importers``) map foreign log formats onto this
schema and keep the raw record in ``source.raw``.

Example::

    >>> ep = Episode(episode_id="e1", domain="finance",
    ...              task=Task(query="Analyse Moutai Q3"),
    ...              steps=[Step(t=0, action=Action(kind="tool_call", tool="get_stock_data",
    ...                                              params={"symbol": "600519"}))])
    >>> ep.n_steps
    1
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import CoreSchema, SchemaValidator
from pydantic_core import core_schema as cs

ActionKind = Literal["tool_call", "reply", "final_answer", "terminate", "escalate"]
ACTION_KINDS: tuple[str, ...] = ("tool_call", "reply", "final_answer", "terminate", "escalate")

#: Longest text accepted in any single field; longer input is rejected, not truncated.
MAX_TEXT_CHARS = 1_000_000


def _check_finite(value: Any, where: str) -> None:
    """Refuse NaN/inf anywhere inside a JSON-like value (they are not JSON)."""
    if value is None or (isinstance(value, (dict, list)) and not value):
        return
    try:
        # Fast path (import speed): the C encoder refuses NaN/inf itself, and a dump no
        # longer than the limit cannot hold a longer string.  Anything it rejects or
        # cannot judge (a long dump, non-JSON types, deep nesting) takes the walk below,
        # which says where the problem is.
        if len(json.dumps(value, allow_nan=False, ensure_ascii=False)) <= MAX_TEXT_CHARS:
            return
    except (ValueError, TypeError, RecursionError):
        pass
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"non-finite number {v!r} in {w}")
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise ValueError(f"text of {len(v)} characters in {w} exceeds {MAX_TEXT_CHARS}")
        if isinstance(v, dict):
            stack.extend((x, f"{w}.{k}") for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in enumerate(v))


class _Model(BaseModel):
    # str_max_length bounds every text field of every model below.  Texts inside the
    # free-form JSON fields: params, observation, tool_result and meta are walked by
    # _check_finite; every stored episode, outcome.extra and source.raw included, by
    # core.data.importers.base.check_record_size.
    model_config = ConfigDict(extra="forbid", frozen=False, str_max_length=MAX_TEXT_CHARS)


class Action(_Model):
    """What the agent did at one step."""

    kind: ActionKind
    tool: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    #: The arguments exactly as logged when they were not a JSON object (kept for the normalizer).
    raw_arguments: str | None = None

    @model_validator(mode="after")
    def _tool_iff_call(self) -> "Action":
        if self.kind == "tool_call" and not self.tool:
            raise ValueError("a tool_call action needs a tool name")
        _check_finite(self.params, "params")
        return self


class Step(_Model):
    """One step of an episode."""

    t: int = Field(ge=0)
    observation: Any = None
    action: Action
    tool_result: Any = None
    #: Error text when the tool call failed (None when it succeeded or was not a call).
    tool_error: str | None = None
    #: False when the result could not be replayed (e.g. a tau2 write action).
    result_replayed: bool = True
    output_text: str | None = None
    latency_ms: float | None = Field(default=None, ge=0)
    timestamp: str | None = None

    @field_validator("observation", "tool_result")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        _check_finite(v, "value")
        return v

    @field_validator("latency_ms")
    @classmethod
    def _finite_latency(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("latency_ms must be a finite number")
        return v

    @field_validator("output_text", "tool_error", "timestamp")
    @classmethod
    def _text_size(cls, v: str | None) -> str | None:
        if v is not None and len(v) > MAX_TEXT_CHARS:
            raise ValueError(f"text of {len(v)} characters exceeds {MAX_TEXT_CHARS}")
        return v


class Task(_Model):
    """The user's request."""

    query: str = ""
    task_type: str | None = None
    intents: list[str] = Field(default_factory=list)


class Outcome(_Model):
    """How the episode ended. Any field may be unknown (None)."""

    resolved: bool | None = None
    final_reward: float | None = None
    business_metric: float | None = None
    sentiment: float | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("final_reward", "business_metric", "sentiment")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class Source(_Model):
    """Where the episode came from; ``raw`` keeps the foreign record as read."""

    file: str | None = None
    format: str | None = None
    line: int | None = None
    record: int | None = None
    raw: Any = None


class Episode(_Model):
    """One recorded agent run."""

    episode_id: str = Field(min_length=1, max_length=512)
    domain: str = "generic"
    task: Task = Field(default_factory=Task)
    steps: list[Step] = Field(default_factory=list)
    outcome: Outcome = Field(default_factory=Outcome)
    source: Source = Field(default_factory=Source)
    #: Label of the behaviour policy that produced the episode, when known (generated data).
    behaviour: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _steps_in_order(self) -> "Episode":
        for i, s in enumerate(self.steps):
            if s.t != i:
                raise ValueError(f"steps[{i}].t is {s.t}; steps must be numbered 0..n-1 in order")
        _check_finite(self.meta, "meta")
        return self

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def to_json(self) -> str:
        """Canonical one-line JSON (the workbench's own JSONL format)."""
        return json.dumps(self.model_dump(mode="json"), ensure_ascii=False, sort_keys=True,
                          separators=(",", ":"))

    def content_hash(self) -> str:
        """sha256 of the canonical JSON without the source (same content → same hash)."""
        body = self.model_dump(mode="json", exclude={"source"})
        text = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def episode_from_body(body: str | bytes) -> Episode:
    """The :class:`Episode` of a stored canonical body.

    pydantic-core's JSON parser stops at 200 levels of nesting; imports refuse records
    nested deeper than 64 (``core.data.importers.base.MAX_JSON_DEPTH``), but a workspace filled
    before that rule may hold deeper ones, which Python's parser still reads."""
    try:
        return Episode.model_validate_json(body)
    except ValidationError as exc:
        if exc.errors()[0]["type"] != "json_invalid":
            raise
        return Episode.model_validate(json.loads(body))


class ToolSchema(_Model):
    """A tool as an agent sees it: OpenAI function-calling JSON schema."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    #: Optional workbench extensions: risk level, parameter presets, etc.
    risk: Literal["low", "medium", "high"] = "low"
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("parameters", "meta")
    @classmethod
    def _bounded(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_finite(v, "value")
        return v

    @classmethod
    def from_openai(cls, obj: dict[str, Any]) -> "ToolSchema":
        """Accept ``{"type":"function","function":{...}}`` or a bare function object."""
        fn = obj.get("function", obj) if isinstance(obj, dict) else obj
        if not isinstance(fn, dict):
            raise ValueError("tool schema must be an object")
        known = {k: fn[k] for k in ("name", "description", "parameters", "risk", "meta") if k in fn}
        if "parameters" in known and not isinstance(known["parameters"], dict):
            raise ValueError("tool schema 'parameters' must be an object")
        if known.get("description") is None:
            known["description"] = ""
        return cls(**known)


# --------------------------------------------------------------------------- fast validation to dicts
# Importing a big file is dominated by validation: building a Step and an Action model per
# step costs several times what pydantic-core needs to check the same fields into plain
# dicts, and the per-field Python validators above cost as much again.  The importers
# therefore validate with a schema derived from the models (same fields, types, defaults,
# constraints and extra="forbid"; dicts instead of models) and replace the Python
# validators by whole-episode checks (see ``episode_dict``).  Whatever that fast path
# cannot vouch for goes through ``Episode.model_validate``, which names the field.

#: The Python validators of the models above that ``episode_dict`` and its callers replace:
#: step numbering and tool_call-has-a-tool (``_whole_episode_ok``); NaN/inf and text size
#: (the caller's canonical dump with ``allow_nan=False`` and its length, see
#: ``core.data.importers.base.prepare_fast``).  A validator not listed here makes the derivation
#: fail loudly, so a new rule can never be skipped silently.
_REPLACED_VALIDATORS = frozenset({"Action._tool_iff_call", "Step._finite", "Step._finite_latency",
                                  "Step._text_size", "Outcome._finite", "Episode._steps_in_order"})


def _dumped_default(model: type[BaseModel]) -> Any:
    return lambda: model().model_dump(mode="json")


def _dict_schema(schema: Any) -> Any:
    """``schema`` (a pydantic core schema, or a part of one) with every model turned into a
    typed dict of the same fields, in sorted order, and the replaced validators removed."""
    if isinstance(schema, list):
        return [_dict_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    if kind in ("function-after", "function-before", "function-wrap", "function-plain"):
        fn = schema["function"]["function"]
        name = getattr(fn, "__qualname__", repr(fn))
        if getattr(fn, "__module__", None) != __name__ or name not in _REPLACED_VALIDATORS \
                or kind == "function-plain":
            raise TypeError(f"episode_dict cannot replace validator {name}; add its check "
                            f"to the fast path (core.records.episodes) or list it in _REPLACED_VALIDATORS")
        inner = _dict_schema(schema["schema"])
        if "ref" in schema:
            inner = dict(inner, ref=schema["ref"])
        return inner
    if kind == "model":
        fields_schema = schema["schema"]
        if fields_schema.get("type") != "model-fields" or fields_schema.get("computed_fields"):
            raise TypeError(f"episode_dict cannot derive a typed dict from {schema.get('cls')}")
        fields = {}
        for name in sorted(fields_schema["fields"]):
            field = fields_schema["fields"][name]
            inner = _dict_schema(field["schema"])
            fields[name] = cs.typed_dict_field(inner, required=inner.get("type") != "default")
        config = schema.get("config") or {}
        out = cs.typed_dict_schema(fields, extra_behavior=config.get("extra_fields_behavior"),
                                   config=config)  # type: ignore[arg-type]
        if "ref" in schema:
            out["ref"] = schema["ref"]
        return out
    plain = {k: v for k, v in schema.items() if k not in ("metadata", "serialization")}
    factory = plain.get("default_factory")
    if isinstance(factory, type) and issubclass(factory, BaseModel):
        plain["default_factory"] = _dumped_default(factory)  # a nested model's default, as a dict
    for key, value in plain.items():
        if isinstance(value, (dict, list)) and key not in ("default", "expected", "function"):
            plain[key] = _dict_schema(value)
    return plain


_EPISODE_DICT: SchemaValidator | None = None


def _episode_dict_validator() -> SchemaValidator:
    global _EPISODE_DICT
    if _EPISODE_DICT is None:
        schema: CoreSchema = _dict_schema(Episode.__pydantic_core_schema__)
        # Cache only keys: they repeat on every step, values rarely do.
        _EPISODE_DICT = SchemaValidator(schema, {"cache_strings": "keys"})
    return _EPISODE_DICT


def _whole_episode_ok(data: dict[str, Any]) -> bool:
    """The model validators' structural rules, over the whole episode at once: steps are
    numbered 0..n-1 in order, and every tool_call names a tool."""
    steps = data["steps"]
    if [s["t"] for s in steps] != list(range(len(steps))):
        return False
    return all(a["tool"] for a in (s["action"] for s in steps) if a["kind"] == "tool_call")


def episode_dict(data: Any = None, *, json_text: str | bytes | None = None) -> dict[str, Any] | None:
    """Validate one episode (a Python object, or ``json_text``) into a plain dict, or None.

    The dict equals ``Episode.model_validate(data).model_dump(mode="python")`` for every
    valid episode: same fields with defaults filled in, same types and constraints, unknown
    keys refused.  None means "not vouched for": the input is invalid, or it breaks a rule
    the models check in Python.  Callers then validate with :class:`Episode`, which says
    which field is wrong.  Not checked here, on purpose: NaN/inf and over-long text — the
    caller's canonical dump (``allow_nan=False``, length ≤ ``MAX_TEXT_CHARS``) does it once
    for the whole episode."""
    validator = _episode_dict_validator()
    try:
        out = validator.validate_python(data) if json_text is None else validator.validate_json(json_text)
    except (ValidationError, ValueError, RecursionError):
        return None
    return out if _whole_episode_ok(out) else None
