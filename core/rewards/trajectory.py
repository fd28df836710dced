"""One scorer for trajectories given as chat messages: the reward outside the workbench.

:class:`TrajectoryScorer` pins a template (``name@version`` and the sha256 of its text) and
scores OpenAI-style message lists, with an optional tools schema and the task's criteria,
into a :class:`TrajectoryScore`: the episode return, each component's value before its
weight, each level's share and every step's reward.  The training-framework adapters
(:mod:`core.rewards.export`) and the HTTP reward service (:mod:`core.serve.reward_service`)
call it; ``rwb reward score --each`` gives the same numbers for episodes of a file or dataset.

Each trajectory is scored on its own — its own catalog (the tools given, presets learned from
its own calls) and its own history — never against the other trajectories of a batch, so a
completion's reward does not depend on its batch mates.  A batch is still one frame: the
components run once over all its steps and the sentence model embeds all its new texts in
one call; only components that compare with earlier calls (``episode_local = False``) run
episode by episode.

Details: docs/export.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.base import embed as text_embedding
from core.base.errors import InputError
from core.data.importers.base import Document, RawRecord, dumps_canonical
from core.data.importers.chat import convert_messages
from core.data.task_criteria import criteria_digest, normalise_task
from core.records.catalog import NormalizedBatch, build_catalog
from core.records.episodes import Action, Episode, Outcome, ToolSchema
from core.rewards.components import COMPONENTS, ScoringContext
from core.rewards.criteria import EpisodeCriteria
from core.rewards.frame import KINDS, StepsFrame, build_frame
from core.rewards.markup import INVALID_TOOL_CALL
from core.rewards.pyramid import Pyramid, ScoreResult
from core.rewards.template import Template, load_template
from core.rewards.versions import TemplateVersion, get_template, parse_spec, sha256_text, shipped_version

#: The tool name a text parser gives a call it could not read: such a call is INVALID
#: whatever the catalog, and its reason is the parser's.
INVALID_CALL_TOOL = INVALID_TOOL_CALL
#: Bounds on one trajectory (a batch is bounded by its callers: the HTTP service, the adapters).
MAX_MESSAGES = 2_000
MAX_TOOLS = 512

DEFAULT_TEMPLATE = "tool_agent"


# --------------------------------------------------------------------------- values
@dataclass(frozen=True)
class Trajectory:
    """One trajectory to score: chat messages, the tools the agent had, the task's criteria.

    ``outcome`` (the :class:`~core.records.episodes.Outcome` fields: ``resolved``,
    ``final_reward``, ``business_metric``, ``sentiment``) feeds templates with outcome terms."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    task: Mapping[str, Any] | None = None
    id: str | None = None
    outcome: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ComponentInfo:
    """A component of the pinned template: its name, level and group (``L1``… for level
    components, ``penalty``, ``episode``)."""

    name: str
    level: str
    group: str


@dataclass(frozen=True)
class StepScore:
    """One step of a scored trajectory."""

    t: int
    #: tool_call, reply, final_answer, terminate or escalate
    kind: str
    tool: str | None
    #: The step's reward (gated level sums plus penalties)
    reward: float
    #: False for a call the catalog refuses (unknown tool, arguments off the schema, unreadable)
    valid: bool
    invalid_reason: str | None


@dataclass(frozen=True)
class TrajectoryScore:
    """What a trajectory earned under a pinned template.

    ``score == Σ weights[c] · components[c] + constant`` over the components that apply;
    ``components[c]`` is None where ``c`` does not apply (a criteria component for a trajectory
    without task criteria), and its neutral part is in ``constant``."""

    score: float
    components: dict[str, float | None]
    weights: dict[str, float]
    constant: float
    #: Per level key, then ``penalty`` and ``episode``: that part of the score
    levels: dict[str, float]
    steps: list[StepScore]
    #: ``name@version`` of the template
    template: str
    template_sha256: str
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the HTTP service's answer for one trajectory)."""
        return {"id": self.id, "score": self.score, "components": dict(self.components),
                "weights": dict(self.weights), "constant": self.constant, "levels": dict(self.levels),
                "steps": [{"t": s.t, "kind": s.kind, "tool": s.tool, "reward": s.reward, "valid": s.valid,
                           "invalid_reason": s.invalid_reason} for s in self.steps],
                "template": self.template, "template_sha256": self.template_sha256}


# --------------------------------------------------------------------------- pinned templates
@dataclass(frozen=True)
class PinnedTemplate:
    """A template with the label and digest it is pinned by."""

    template: Template
    #: ``name@version`` (``@0``: the shipped file; also a file named so, as an export writes it),
    #: or ``name@<file path>`` for another file
    label: str
    #: sha256 of the template's YAML text
    sha256: str


def pin_template(template: str | Path | Template, ws=None, sha256: str | None = None) -> PinnedTemplate:
    """Resolve a template reference and check its digest.

    ``template``: ``name`` (with a workspace its latest saved version, else the shipped file),
    ``name@N`` (N > 0 needs the workspace), a YAML file, or a :class:`Template` (its
    :meth:`~Template.to_yaml` text is what is digested).  ``sha256``: refuse a template whose
    text has another digest (a pinned export whose template changed)."""
    if isinstance(template, Template):
        text = template.to_yaml()
        pinned = PinnedTemplate(template, f"{template.name}@{template.source or 'memory'}", sha256_text(text))
    else:
        spec = str(template)
        path = Path(spec)
        if spec.endswith((".yaml", ".yml")) or path.is_file():
            if not path.is_file():
                raise InputError(f"no template file {spec}", field="template")
            text = path.read_text(encoding="utf-8")
            t = load_template(path)
            # an exported copy is named <name>@<version>.yaml: it keeps its version's label
            exported = path.stem.partition("@")
            label = path.stem if exported[0] == t.name and exported[2].isdigit() else f"{t.name}@{path}"
            pinned = PinnedTemplate(t, label, sha256_text(text))
        else:
            name, version = parse_spec(spec)
            found: TemplateVersion | None
            if ws is not None:
                found = get_template(ws, name, version)
            elif version in (None, 0):
                found = shipped_version(name)
            else:
                raise InputError(f"template reference {spec!r} names a workspace version; open the "
                                 "workspace to use it", field="template")
            if found is None:
                raise InputError(f"no shipped template named {name!r}; a template saved in a "
                                 "workspace needs the workspace", field="template")
            pinned = PinnedTemplate(found.template(), found.label, found.sha256)
    if sha256 is not None and sha256 != pinned.sha256:
        raise InputError(f"template {pinned.label} has sha256 {pinned.sha256}, but {sha256} is pinned: "
                         "the template changed since it was pinned", field="template")
    return pinned


# --------------------------------------------------------------------------- messages → episodes
def _document(where: str) -> tuple[Document, RawRecord]:
    return Document(Path(where), "json-object", []), RawRecord(None, 0)


def _tools_of(value: Any, where: str) -> list[ToolSchema]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InputError(f"tools must be a list of tool schemas, not {type(value).__name__}", field=where)
    if len(value) > MAX_TOOLS:
        raise InputError(f"{len(value)} tools; at most {MAX_TOOLS}", field=where)
    out = []
    for i, item in enumerate(value):
        try:
            out.append(item if isinstance(item, ToolSchema) else ToolSchema.from_openai(item))
        except (ValueError, TypeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else "not a tool schema"
            raise InputError(f"bad tool schema: {reason}", field=f"{where}[{i}]") from None
    return out


def task_criteria(task: Mapping[str, Any] | None, where: str = "task") -> dict[str, Any] | None:
    """A task's criteria as the criteria components read them: the workbench's record
    (``expected_calls``, ``communicate``, ``forbidden``, ``call_budget``; ``task_id`` optional)
    or a tau2 task (``evaluation_criteria``); None for no task."""
    if task is None:
        return None
    if isinstance(task, str):
        raise InputError("task criteria are an object, not text (decode the JSON first)", field=where)
    return normalise_task(dict(task) if isinstance(task, Mapping) else task, where)


def _outcome_of(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(f"an outcome is an object, not {type(value).__name__}", field=where)
    try:
        return Outcome.model_validate(dict(value)).model_dump()
    except ValueError as exc:
        raise InputError(f"bad outcome: {str(exc).splitlines()[0]}", field=where) from None


def trajectory_episode(messages: Any, *, episode_id: str = "trajectory", where: str = "messages",
                       outcome: Mapping[str, Any] | None = None) -> Episode:
    """The :class:`Episode` of a message list: the chat importer's steps (docs/importers.md,
    "Chat messages to steps"); errors name the message and field under ``where``."""
    if isinstance(messages, (list, tuple)) and len(messages) > MAX_MESSAGES:
        raise InputError(f"{len(messages)} messages; at most {MAX_MESSAGES}", field=where)
    doc, rec = _document(where)
    try:
        conv = convert_messages(list(messages) if isinstance(messages, tuple) else messages,
                                where=where, doc=doc, rec=rec)
    except InputError as exc:
        raise InputError(exc.reason, field=exc.field or where) from None
    body: dict[str, Any] = {"episode_id": episode_id, "task": {"query": conv.query}, "steps": conv.steps,
                            "outcome": _outcome_of(outcome, f"{where.rsplit('.', 1)[0]}.outcome"
                                                   if "." in where else "outcome")}
    if conv.trailing:
        body["meta"] = {"trailing_messages": conv.trailing}
    try:
        return Episode.model_validate(body)
    except ValueError as exc:
        errors = getattr(exc, "errors", None)
        first = errors(include_url=False)[0] if callable(errors) else {"msg": str(exc), "loc": ()}
        loc = tuple(first.get("loc", ()))
        field_path = where
        if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int) and loc[1] < len(conv.step_fields):
            field_path = conv.step_fields[loc[1]]
        raise InputError(str(first.get("msg", "invalid value")).removeprefix("Value error, "),
                         field=field_path) from None


def _as_trajectory(item: Any, i: int) -> Trajectory:
    if isinstance(item, Trajectory):
        return item
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - {"messages", "tools", "task", "id", "outcome"})
        if unknown:
            raise InputError(f"unknown key(s) {', '.join(map(str, unknown))}; a trajectory has messages, "
                             "tools, task, id, outcome", field=f"trajectories[{i}].{unknown[0]}")
        if "messages" not in item:
            raise InputError("a trajectory needs its messages", field=f"trajectories[{i}].messages")
        tid = item.get("id")
        if tid is not None and not isinstance(tid, str):
            raise InputError("an id is text", field=f"trajectories[{i}].id")
        return Trajectory(messages=item["messages"], tools=item.get("tools"), task=item.get("task"),
                          id=tid, outcome=item.get("outcome"))
    raise InputError(f"a trajectory is an object with messages, not {type(item).__name__}",
                     field=f"trajectories[{i}]")


# --------------------------------------------------------------------------- one catalog per episode
class _EachEpisodeNormalizer:
    """Normalises each episode's calls with that episode's own catalog (what the frame needs
    from a catalog); calls the text parser could not read are INVALID with its reason."""

    reply_id, final_id, escalate_id = 0, 1, 2

    def __init__(self, episodes: Sequence[Episode], tools: Sequence[Sequence[ToolSchema]]):
        self.catalogs = [build_catalog(list(t), calls=_readable_calls(ep)) for ep, t in zip(episodes, tools)]
        self.calls_per_episode = [sum(s.action.kind == "tool_call" for s in ep.steps) for ep in episodes]
        self.version = hashlib.sha256("|".join(c.version for c in self.catalogs).encode()).hexdigest()[:16]

    def normalize_many(self, actions: Sequence[Action]) -> NormalizedBatch:
        parts, start = [], 0
        for catalog, n in zip(self.catalogs, self.calls_per_episode):
            chunk = list(actions[start:start + n])
            start += n
            batch = catalog.normalize_many(chunk)
            for j, a in enumerate(chunk):
                if a.tool == INVALID_CALL_TOOL:
                    batch.tool_known[j] = batch.args_ok[j] = False
                    batch.token_ids[j] = -1
                    batch.reasons[j] = _parse_error(a)
            parts.append(batch)
        if not parts:
            return NormalizedBatch(np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, bool), [],
                                   np.zeros(0, np.int64))
        return NormalizedBatch(np.concatenate([p.token_ids for p in parts]),
                               np.concatenate([p.tool_known for p in parts]),
                               np.concatenate([p.args_ok for p in parts]),
                               [r for p in parts for r in p.reasons],
                               np.concatenate([p.tool_ids for p in parts]))


def _readable_calls(ep: Episode) -> list[tuple[str, Mapping[str, Any]]]:
    return [(s.action.tool, s.action.params) for s in ep.steps
            if s.action.kind == "tool_call" and s.action.tool and s.action.tool != INVALID_CALL_TOOL]


def _parse_error(a: Action) -> str:
    error = a.params.get("error") if isinstance(a.params, Mapping) else None
    return f"unreadable tool call: {error}" if isinstance(error, str) and error else "unreadable tool call"


def each_episode_frame(episodes: Sequence[Episode], tools: Sequence[Sequence[ToolSchema]]) -> StepsFrame:
    """One frame of ``episodes`` in which every episode's calls are normalised by its own
    catalog (``tools[i]`` plus presets from its own calls): what scoring each on its own needs."""
    return build_frame(episodes, _EachEpisodeNormalizer(episodes, tools))


# --------------------------------------------------------------------------- the decomposition
def _decompose(result: ScoreResult, applies: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per episode: the value of each component before its weight ([E, C], template order
    of ``all_components``), each level's share ([E, L+2]: levels, penalty, episode) and the
    constant part of components that do not apply ([E])."""
    t, frame, matrix = result.template, result.frame, result.matrix
    n_ep, n_levels = frame.n_episodes, len(t.levels)
    specs = t.step_components
    disc = matrix.discount(frame, t.gamma)
    earn = result._earn                         # [L, N]: does each level count at each step
    level_of = {lv.key: i for i, lv in enumerate(t.levels)}
    gated = np.empty_like(matrix.step_values)   # [C, N]: what each column adds to the step reward
    for j, spec in enumerate(specs):
        li = level_of.get(spec.group)
        gated[j] = matrix.step_values[j] * (earn[li] if li is not None and t.gating else 1.0)
    has, starts = matrix.episode_starts(frame)
    step_part = np.zeros((n_ep, len(specs)))
    if starts.size and len(specs):
        step_part[has] = np.add.reduceat(gated * disc, starts, axis=1).T
    values = np.concatenate([t.a * step_part, t.b * matrix.episode_values], axis=1)
    weights = np.array([c.weight for c in t.all_components], dtype=np.float64)
    weighted = values * weights
    constant = np.where(applies, 0.0, weighted).sum(axis=1)
    group = [level_of.get(c.group, n_levels) for c in specs] + [n_levels + 1] * len(t.episode_terms)
    shares = np.zeros((n_ep, n_levels + 2))
    for j, g in enumerate(group):
        shares[:, g] += weighted[:, j]
    return values, shares, constant


def _applies(template: Template, criteria: list[dict[str, Any] | None]) -> np.ndarray:
    """[E, C]: does each component apply to each episode (criteria components need criteria)."""
    has = np.array([c is not None for c in criteria], dtype=bool)
    cols = []
    for spec in template.all_components:
        uses = bool(getattr(COMPONENTS.get(spec.component), "uses_criteria", False))
        cols.append(has if uses else np.ones(len(criteria), dtype=bool))
    return np.stack(cols, axis=1) if cols else np.zeros((len(criteria), 0), dtype=bool)


def _training_step(step: Any) -> int:
    """A training step: a whole number ≥ 0."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InputError(f"a training step is a whole number ≥ 0, not {step!r}", field="step")
    return int(step)


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


# --------------------------------------------------------------------------- the scorer
class TrajectoryScorer:
    """A pinned template, ready to score trajectories (thread-unsafe: one per worker).

    The sentence model is loaded on the first text to embed and kept, with an in-memory cache
    of every text it embedded (a workspace's cache when ``ws`` is given)."""

    def __init__(self, template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                 sha256: str | None = None, embedder: Any = None):
        pinned = pin_template(template, ws, sha256)
        self.template, self.label, self.sha256 = pinned.template, pinned.label, pinned.sha256
        self.pyramid = Pyramid(self.template)
        self.components = [ComponentInfo(c.name, self.pyramid.components[c.name].level, c.group)
                           for c in self.template.all_components]
        if embedder is None:
            embedder = (text_embedding.workspace_embedder(ws) if ws is not None
                        else text_embedding.Embedder(cache_dir=None))
        self.embedder = embedder

    @property
    def component_names(self) -> list[str]:
        return [c.name for c in self.components]

    @property
    def has_schedules(self) -> bool:
        return bool(self.template.schedules)

    def weights_at(self, step: int | None = None) -> dict[str, float]:
        """The template's weights; at a training ``step``, with its weight schedules applied."""
        return self.template.weights() if step is None else self.template.weights_at(_training_step(step))

    def score(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
              task: Mapping[str, Any] | None = None, step: int | None = None,
              outcome: Mapping[str, Any] | None = None) -> TrajectoryScore:
        """Score one trajectory."""
        return self.score_batch([Trajectory(messages, tools, task, None, outcome)], step=step)[0]

    def score_batch(self, trajectories: Sequence[Trajectory | Mapping[str, Any]], *,
                    step: int | None = None) -> list[TrajectoryScore]:
        """Score trajectories, each on its own, in one frame (see the module docstring)."""
        items = [_as_trajectory(x, i) for i, x in enumerate(trajectories)]
        episodes, tools, criteria = [], [], []
        for i, tr in enumerate(items):
            where = f"trajectories[{i}]"
            episodes.append(trajectory_episode(tr.messages, episode_id=f"t{i}", where=f"{where}.messages",
                                               outcome=tr.outcome))
            tools.append(_tools_of(tr.tools, f"{where}.tools"))
            criteria.append(task_criteria(tr.task, f"{where}.task"))
        return self.score_episodes(episodes, tools, criteria, step=step, ids=[tr.id for tr in items])

    def score_episodes(self, episodes: Sequence[Episode], tools: Sequence[Sequence[ToolSchema]],
                       criteria: Sequence[dict[str, Any] | None] | None = None, *, step: int | None = None,
                       ids: Sequence[str | None] | None = None) -> list[TrajectoryScore]:
        """Score episodes each on its own (``tools[i]``: the schemas of episode i's catalog;
        ``criteria[i]``: its task's normalised criteria or None)."""
        if step is not None:
            step = _training_step(step)
        if not episodes:
            return []
        crit = list(criteria) if criteria is not None else [None] * len(episodes)
        frame = each_episode_frame(episodes, tools)
        by_episode = {ep.episode_id: c for ep, c in zip(episodes, crit) if c is not None}
        ctx = ScoringContext(embedder=self.embedder, each_episode=True, criteria=EpisodeCriteria(
            by_episode=by_episode, digest=criteria_digest(dict(sorted(by_episode.items())))) if by_episode else None)
        result = self.pyramid.score(frame, ctx=ctx)
        if step is not None and self.template.schedules:
            result = result.reweight(self.template.weights_at(step))
        return self._scores(result, crit, ids)

    def _scores(self, result: ScoreResult, criteria: Sequence[dict[str, Any] | None],
                ids: Sequence[str | None] | None) -> list[TrajectoryScore]:
        t, frame = result.template, result.frame
        applies = _applies(t, list(criteria))
        values, shares, constant = _decompose(result, applies)
        names = [c.name for c in t.all_components]
        weights = {c.name: float(c.weight) for c in t.all_components}
        level_keys = [lv.key for lv in t.levels] + ["penalty", "episode"]
        kinds = np.asarray(KINDS, dtype=object)[frame.kind]
        tool_names = frame.tool_name_of()
        valid = frame.tool_known & frame.args_ok
        out = []
        for e in range(frame.n_episodes):
            lo, n = int(frame.ep_start[e]), int(frame.ep_len[e])
            steps = [StepScore(t=int(frame.t[r]), kind=str(kinds[r]),
                               tool=None if tool_names[r] is None else str(tool_names[r]),
                               reward=_finite(result.step_reward[r]), valid=bool(valid[r]),
                               invalid_reason=frame.invalid_reason[r]) for r in range(lo, lo + n)]
            out.append(TrajectoryScore(
                score=_finite(result.returns[e]),
                components={k: (_finite(values[e, j]) if applies[e, j] else None) for j, k in enumerate(names)},
                weights=weights, constant=_finite(constant[e]),
                levels={k: _finite(shares[e, j]) for j, k in enumerate(level_keys)},
                steps=steps, template=self.label, template_sha256=self.sha256,
                id=None if ids is None else ids[e]))
        return out


def score_trajectory(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                     task: Mapping[str, Any] | None = None, template: str | Path | Template = DEFAULT_TEMPLATE,
                     ws=None) -> TrajectoryScore:
    """Score one trajectory of chat messages with a template (see :class:`TrajectoryScorer`;
    build one scorer to score many: it keeps the sentence model and its cache)."""
    return TrajectoryScorer(template, ws=ws).score(messages, tools=tools, task=task)


def score_trajectories(trajectories: Sequence[Trajectory | Mapping[str, Any]], *,
                       template: str | Path | Template = DEFAULT_TEMPLATE, ws=None) -> list[TrajectoryScore]:
    """Score a batch of trajectories, each on its own (see :class:`TrajectoryScorer`)."""
    return TrajectoryScorer(template, ws=ws).score_batch(trajectories)


# --------------------------------------------------------------------------- episodes → messages
def _result_content(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else dumps_canonical(value)


def episode_messages(episode: Episode) -> list[dict[str, Any]]:
    """The chat messages of a recorded episode, such that :func:`trajectory_episode` gives
    back the steps the reward reads (kinds, calls, results, errors, texts, timing).

    Steps the chat form cannot say by itself carry the workbench's keys on their assistant
    message: ``rwb_kind`` (``terminate``, ``escalate``, or a ``final_answer``/``reply`` that the
    message order would not give) and ``latency_ms``; a result that did not fail says
    ``is_error: false``, so that a text that merely starts with "Error" stays a result."""
    msgs: list[dict[str, Any]] = []
    steps = episode.steps
    first_obs = steps[0].observation if steps else None
    seen_query = isinstance(first_obs, Mapping) and any(
        isinstance(m, Mapping) and m.get("role") == "user" for m in first_obs.get("messages") or [])
    if episode.task.query and not seen_query:
        msgs.append({"role": "user", "content": episode.task.query})
    answers: list[tuple[dict[str, Any], str]] = []   # the messages of non-call steps, with their kinds
    for s in steps:
        obs = s.observation
        if isinstance(obs, Mapping) and isinstance(obs.get("messages"), list):
            for m in obs["messages"]:   # what the agent saw before the step (never its own turns)
                if isinstance(m, Mapping) and isinstance(m.get("role"), str) and m["role"] != "assistant":
                    msgs.append({k: m[k] for k in ("role", "content", "name", "tool_call_id") if k in m})
        a = s.action
        msg: dict[str, Any] = {"role": "assistant", "content": s.output_text}
        if a.kind == "tool_call":
            args: Any = a.raw_arguments if a.raw_arguments is not None else dict(a.params)
            msg["tool_calls"] = [{"id": f"call_{s.t}", "type": "function",
                                  "function": {"name": a.tool, "arguments": args}}]
        else:
            answers.append((msg, a.kind))
        if s.timestamp is not None:
            msg["timestamp"] = s.timestamp
        if s.latency_ms is not None:
            msg["latency_ms"] = s.latency_ms
        msgs.append(msg)
        if a.kind == "tool_call" and s.result_replayed:
            result: dict[str, Any] = {"role": "tool", "tool_call_id": f"call_{s.t}", "name": a.tool,
                                      "content": _result_content(s.tool_result), "is_error": s.tool_error is not None}
            if s.tool_error is not None and s.tool_result is None:
                result["content"] = s.tool_error
            msgs.append(result)
    trailing = episode.meta.get("trailing_messages") if isinstance(episode.meta, Mapping) else None
    if isinstance(trailing, list):
        msgs.extend(dict(m) for m in trailing if isinstance(m, Mapping))
    for msg, kind in answers:
        # the chat rule: the last reply, with nothing after it, is the final answer
        by_rule = "final_answer" if msg is msgs[-1] else "reply"
        if kind != by_rule:
            msg["rwb_kind"] = kind
    return msgs


__all__ = ["ComponentInfo", "DEFAULT_TEMPLATE", "INVALID_CALL_TOOL", "PinnedTemplate", "StepScore", "Trajectory",
           "TrajectoryScore", "TrajectoryScorer", "each_episode_frame", "episode_messages", "pin_template",
           "score_trajectories", "score_trajectory", "task_criteria", "trajectory_episode"]
