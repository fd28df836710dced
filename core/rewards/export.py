"""The reward leaves the workbench: adapters that hand a pinned template to RL frameworks.

One :class:`~core.rewards.trajectory.TrajectoryScorer` scores every trajectory on its own; the
adapters only reshape what a framework passes in (chat messages, decoded text, dataset columns)
into trajectories and what the scorer gives back into what the framework expects:

* :func:`trl_reward_funcs` — TRL ``GRPOTrainer``: one named reward function per component (or per
  level) plus the matching ``reward_weights``; picklable, sync or async, ``None`` where a
  component does not apply, the template's weight schedules read from ``trainer_state``;
* :func:`verifiers_task` / :func:`verifiers_taskset` — verifiers 0.4: a ``vf.Task`` with one
  ``@vf.reward(weight=...)`` method per component;
* :func:`verl_compute_score` — verl's ``compute_score(data_source, solution_str, ground_truth,
  extra_info)``;
* :func:`openrlhf_reward_func` — OpenRLHF's ``reward_func(queries, prompts, labels, **kwargs)``;
* :func:`write_export` — ``rwb reward export``: a small module that pins the template's digest
  and exposes one of the above, with a README snippet.

trl, verifiers and torch are imported inside the functions that need them: none is needed to
import this module.  Details: docs/export.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import tempfile
import threading
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.base import bounded_json
from core.base.errors import InputError
from core.rewards.markup import completion_messages, detect_markup, detect_template, transcript_messages
from core.rewards.template import Template
from core.rewards.trajectory import DEFAULT_TEMPLATE, TrajectoryScore, TrajectoryScorer, pin_template
from core.rewards.versions import get_template, parse_spec, sha256_text, shipped_version

#: The frameworks ``rwb reward export --to`` writes a module for.
FRAMEWORKS = ("trl", "verifiers", "verl", "openrlhf")
#: How TRL reward functions split the reward: one per component, or one per level.
GRANULARITIES = ("component", "level")
#: The keys of a label envelope (verl ``ground_truth``, OpenRLHF ``labels``); a label without any
#: of them is the task's criteria itself.
LABEL_KEYS = frozenset({"task", "tools", "outcome"})
#: Bounds on a JSON cell (tools, criteria, label): size, then nesting depth.
MAX_JSON_BYTES = 4_000_000
MAX_JSON_DEPTH = 64
#: The verifiers reward that carries the part of the score from components that do not apply.
CONSTANT_REWARD = "constant"


# --------------------------------------------------------------------------- the pinned scorer
class _SharedScorer:
    """A pinned template and, per process, one scorer made on first use; the adapters' functions
    share one, so the N functions of a batch score it once (the last batch is kept).

    It pickles as the template, its label and its digest only: a worker process that unpickles
    it builds its own scorer (and sentence model) when it first scores."""

    def __init__(self, template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                 sha256: str | None = None):
        scorer = TrajectoryScorer(template, ws=ws, sha256=sha256)
        self.template: Template = scorer.template
        self.label: str = scorer.label
        self.sha256: str = scorer.sha256
        self._scorer: TrajectoryScorer | None = scorer
        self._lock = threading.Lock()
        self._last: tuple[str, list[TrajectoryScore]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"template": self.template, "label": self.label, "sha256": self.sha256}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.template, self.label, self.sha256 = state["template"], state["label"], state["sha256"]
        self._scorer, self._lock, self._last = None, threading.Lock(), None

    @property
    def scorer(self) -> TrajectoryScorer:
        if self._scorer is None:
            scorer = TrajectoryScorer(self.template)
            # the scores name the template as it was pinned, not as the re-serialised copy
            scorer.label, scorer.sha256 = self.label, self.sha256
            self._scorer = scorer
        return self._scorer

    def weights_at(self, step: int | None = None) -> dict[str, float]:
        return self.template.weights() if step is None else self.template.weights_at(int(step))

    def score_batch(self, trajectories: list[dict[str, Any]], step: int | None) -> list[TrajectoryScore]:
        """Score a batch, or give back the last batch's scores when it is the same batch (the
        same trajectories at the same step): one scoring for all the functions of one batch."""
        key = hashlib.blake2b(json.dumps([trajectories, step], sort_keys=True, default=str).encode(),
                              digest_size=16).hexdigest()
        with self._lock:    # async functions score in threads: the second waits, then reuses
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            scores = self.scorer.score_batch(trajectories, step=step)
            self._last = (key, scores)
            return scores


# --------------------------------------------------------------------------- inputs → trajectories
def _json_value(value: Any, field: str) -> Any:
    """A dataset cell that may hold JSON text (Arrow stores ragged schemas best as text), read
    within bounds (size and depth checked before parsing)."""
    if isinstance(value, str):
        return bounded_json.loads(value, max_bytes=MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH, field=field)
    return value


def _tools(value: Any, field: str) -> list[dict[str, Any]] | None:
    value = _json_value(value, field)
    if value is None or isinstance(value, (list, tuple)):
        return None if value is None else list(value)
    raise InputError(f"tools are a list of tool schemas, not {type(value).__name__}", field=field)


def _criteria(value: Any, field: str) -> dict[str, Any] | None:
    """Task criteria: an object, its JSON text, or nothing (None or an empty text)."""
    if isinstance(value, str) and not value.strip():
        return None
    value = _json_value(value, field)
    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    raise InputError(f"task criteria are an object, not {type(value).__name__}", field=field)


def _label_parts(value: Any, field: str) -> dict[str, Any]:
    """A verl ``ground_truth`` or OpenRLHF ``label`` as trajectory keys: nothing (None or empty
    text), the task's criteria, or an envelope ``{"task", "tools", "outcome"}`` (object or JSON
    text; the same reading as ``rwb reward serve``'s ``/get_reward``)."""
    body = _criteria(value, field)
    if not body:
        return {}
    if not LABEL_KEYS & set(body):
        return {"task": body}
    unknown = sorted(set(body) - LABEL_KEYS)
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r}; a label has task, tools, outcome (or is the task's "
                         "criteria itself)", field=f"{field}.{unknown[0]}")
    out: dict[str, Any] = {"task": _criteria(body.get("task"), f"{field}.task"),
                           "tools": _tools(body.get("tools"), f"{field}.tools")}
    if body.get("outcome") is not None:
        out["outcome"] = body["outcome"]
    return out


def _assistant_messages(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant message as the scorer reads it: one that carries no ``tool_calls`` but
    whose text holds tool-call markup (a chat template TRL did not parse) is parsed."""
    content = message.get("content")
    if not message.get("tool_calls") and isinstance(content, str) and detect_markup(content):
        parsed = completion_messages(content)
        return [{**dict(message), **parsed[0]}] + parsed[1:]
    return [dict(message)]


def _chat(value: Any, field: str, *, role: str) -> list[dict[str, Any]]:
    """A prompt or completion as messages: a message list as it is (assistant turns parsed for
    markup); text with chat-template turns as its transcript, other text as one ``role`` message
    (a completion's text parsed for tool calls)."""
    if isinstance(value, str):
        if role == "assistant" or detect_template(value):
            return transcript_messages(value)
        return [{"role": role, "content": value}]
    if isinstance(value, Sequence):
        out: list[dict[str, Any]] = []
        for j, m in enumerate(value):
            if not isinstance(m, Mapping):
                raise InputError(f"a message is an object, not {type(m).__name__}", field=f"{field}[{j}]")
            out.extend(_assistant_messages(m) if m.get("role") == "assistant" else [dict(m)])
        return out
    raise InputError(f"expected a message list or text, not {type(value).__name__}", field=field)


def _column(kwargs: Mapping[str, Any], name: str, i: int) -> Any:
    column = kwargs.get(name)
    return column[i] if isinstance(column, Sequence) and not isinstance(column, str) and i < len(column) else None


def trl_trajectories(prompts: Sequence[Any], completions: Sequence[Any],
                     kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """TRL's batch as trajectories: prompt + completion messages, with the dataset's ``tools``
    and ``task`` columns of each sample when the dataset has them."""
    if len(prompts) != len(completions):
        raise InputError(f"{len(prompts)} prompts but {len(completions)} completions", field="completions")
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        messages = (_chat(prompt, f"prompts[{i}]", role="user")
                    + _chat(completion, f"completions[{i}]", role="assistant"))
        out.append({"messages": messages, "tools": _tools(_column(kwargs, "tools", i), f"tools[{i}]"),
                    "task": _criteria(_column(kwargs, "task", i), f"task[{i}]")})
    return out


def _training_step(kwargs: Mapping[str, Any]) -> int | None:
    state = kwargs.get("trainer_state")
    step = getattr(state, "global_step", None)
    return int(step) if step is not None else None


# --------------------------------------------------------------------------- TRL
class TrlRewardFunc:
    """One TRL reward function: a component (or a level) of the pinned template.

    ``f(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]``; ``__name__``
    is the component's (or level's) name, so TRL logs ``rewards/<name>/mean``.  With weight
    schedules, the value is scaled by ``w(step) / exported weight`` (see :func:`trl_reward_funcs`)."""

    def __init__(self, shared: _SharedScorer, name: str, members: tuple[str, ...], export_weight: float,
                 level: bool):
        self._shared, self.__name__ = shared, name
        self.members, self.export_weight, self.level = members, export_weight, level

    def __repr__(self) -> str:
        return f"<reward {self.__name__} of {self._shared.label}>"

    def values(self, scores: Sequence[TrajectoryScore]) -> list[float | None]:
        """This function's value for each score (already scored at the batch's step)."""
        return [self._value(s) for s in scores]

    def _value(self, s: TrajectoryScore) -> float | None:
        if self.level:   # the level's weighted sum; exported weight 1
            parts = [s.weights[c] * v for c in self.members if (v := s.components[c]) is not None]
            return math.fsum(parts) if parts else None
        (c,) = self.members
        v = s.components[c]
        if v is None or s.weights[c] == self.export_weight:
            return v
        return v * s.weights[c] / self.export_weight

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None,
                 **kwargs: Any) -> list[float | None]:
        step = _training_step(kwargs) if self._shared.template.schedules else None
        return self.values(self._shared.score_batch(trl_trajectories(prompts, completions, kwargs), step))


class AsyncTrlRewardFunc(TrlRewardFunc):
    """:class:`TrlRewardFunc` as a coroutine: scoring runs in a worker thread, so TRL's event
    loop stays free (TRL gathers async reward functions concurrently; they still score once)."""

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],  # type: ignore[override]
                       completion_ids: Any = None, **kwargs: Any) -> list[float | None]:
        call = super().__call__
        return await asyncio.to_thread(call, prompts, completions, completion_ids, **kwargs)


@dataclass(frozen=True)
class TrlReward:
    """What TRL's ``GRPOTrainer`` takes: ``reward_funcs=funcs``, ``GRPOConfig(reward_weights=weights)``.

    ``Σ weights[i] · funcs[i]`` is the scorer's score less ``constant`` (the part of the score
    from components that do not apply), at every training step."""

    funcs: list[TrlRewardFunc]
    weights: list[float]
    async_funcs: list[AsyncTrlRewardFunc]
    names: list[str]
    template: str
    sha256: str
    granularity: str

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], step: int | None = None,
              **columns: Any) -> list[TrajectoryScore]:
        """The scorer's full scores for a TRL batch (``columns``: the dataset's ``tools``/``task``)."""
        shared = self.funcs[0]._shared if self.funcs else None
        if shared is None:
            return []
        return shared.score_batch(trl_trajectories(prompts, completions, columns),
                                  step if shared.template.schedules else None)


def _export_weight(shared: _SharedScorer, name: str, base: float) -> float:
    """The reward weight TRL gets for a component: its template weight, except 1 for a
    scheduled component whose template weight is 0 (it could not be scaled back from 0)."""
    return 1.0 if base == 0.0 and name in shared.template.schedules else base


def trl_reward_funcs(template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                     granularity: str = "component", sha256: str | None = None) -> TrlReward:
    """Reward functions for TRL's ``GRPOTrainer``, one per component (or per level), with the
    matching ``reward_weights``.

    Example::

        reward = trl_reward_funcs("tool_agent")
        GRPOTrainer(model, reward_funcs=reward.funcs, args=GRPOConfig(reward_weights=reward.weights))

    ``granularity="component"``: ``funcs[i]`` gives component i's value before its weight (None
    where it does not apply) and ``weights[i]`` its template weight.  With weight schedules the
    value is ``v · w(step) / weights[i]``, ``step`` being ``trainer_state.global_step``, so
    ``Σ weights[i] · funcs[i]`` follows the schedule; a scheduled component whose template weight
    is 0 is exported with weight 1 and gives ``v · w(step)``.  ``granularity="level"``: one
    function per level (``L1``…, ``penalty``, ``episode``) giving the level's weighted sum, each
    with weight 1 (None when no component of the level applies)."""
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity is one of {', '.join(GRANULARITIES)}, not {granularity!r}",
                         field="granularity")
    shared = _SharedScorer(template, ws=ws, sha256=sha256)
    base = shared.weights_at(None)
    groups: list[tuple[str, tuple[str, ...], float, bool]]
    if granularity == "component":
        groups = [(c.name, (c.name,), _export_weight(shared, c.name, base[c.name]), False)
                  for c in shared.scorer.components]
    else:
        order: dict[str, list[str]] = {}
        for c in shared.scorer.components:
            order.setdefault(c.group, []).append(c.name)
        groups = [(g, tuple(names), 1.0, True) for g, names in order.items()]
    funcs = [TrlRewardFunc(shared, *g) for g in groups]
    async_funcs = [AsyncTrlRewardFunc(shared, *g) for g in groups]
    return TrlReward(funcs=funcs, weights=[g[2] for g in groups], async_funcs=async_funcs,
                     names=[g[0] for g in groups], template=shared.label, sha256=shared.sha256,
                     granularity=granularity)


# --------------------------------------------------------------------------- verl
def _nan_if_none(v: float | None) -> float:
    return math.nan if v is None else float(v)


class VerlComputeScore:
    """verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``:
    ``{"score": ..., **components}`` (NaN for a component that does not apply).

    ``solution_str``: the decoded response (all turns, tool results included, in the model's
    own chat markup); ``ground_truth``: the task's criteria (object or JSON) or the envelope
    ``{"task", "tools", "outcome"}``, or None; ``extra_info["tools"]``: the tools schema."""

    def __init__(self, shared: _SharedScorer):
        self._shared = shared

    def trajectory(self, solution_str: str, ground_truth: Any = None,
                   extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        if not isinstance(solution_str, str):
            raise InputError(f"solution_str is decoded text, not {type(solution_str).__name__}",
                             field="solution_str")
        parts = _label_parts(ground_truth, "ground_truth")
        if extra_info is not None and not isinstance(extra_info, Mapping):
            raise InputError(f"extra_info is an object, not {type(extra_info).__name__}", field="extra_info")
        if extra_info and extra_info.get("tools") is not None:
            parts["tools"] = _tools(extra_info["tools"], "extra_info.tools")
        return {"messages": transcript_messages(solution_str), **parts}

    def __call__(self, data_source: Any, solution_str: str, ground_truth: Any = None,
                 extra_info: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, float]:
        s = self._shared.score_batch([self.trajectory(solution_str, ground_truth, extra_info)], None)[0]
        return {"score": s.score, **{c: _nan_if_none(v) for c, v in s.components.items()}}


def verl_compute_score(template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                       sha256: str | None = None) -> VerlComputeScore:
    """verl's custom reward function for a pinned template (``reward.custom_reward_function``).

    Example::

        compute_score = verl_compute_score("tool_agent")
        compute_score("tools", solution_str, ground_truth=None, extra_info={"tools": [...]})
        # {"score": -0.42, "tool_validity": 0.1, ...}"""
    shared = _SharedScorer(template, ws=ws, sha256=sha256)
    if "score" in shared.weights_at():
        raise InputError("a component named 'score' would hide the score in verl's dict", field="template")
    return VerlComputeScore(shared)


# --------------------------------------------------------------------------- OpenRLHF
class OpenRlhfRewardFunc:
    """OpenRLHF's ``reward_func(queries, prompts, labels, **kwargs)``: ``{"rewards", "scores",
    "extra_logs"}`` as float32 tensors (``scores`` = ``rewards``; a component that does not apply
    logs NaN).

    ``queries``: decoded prompt + response texts; ``labels``: per query, the task's criteria
    (JSON) or the envelope ``{"task", "tools", "outcome"}``, or empty."""

    def __init__(self, shared: _SharedScorer):
        self._shared = shared

    def trajectories(self, queries: Sequence[str], labels: Sequence[Any] | None) -> list[dict[str, Any]]:
        if isinstance(queries, str) or not isinstance(queries, Sequence):
            raise InputError("queries is a list of decoded texts", field="queries")
        if labels is not None and len(labels) != len(queries):
            raise InputError(f"{len(labels)} labels for {len(queries)} queries", field="labels")
        out = []
        for i, q in enumerate(queries):
            if not isinstance(q, str):
                raise InputError(f"a query is decoded text, not {type(q).__name__}", field=f"queries[{i}]")
            parts = _label_parts(None if labels is None else labels[i], f"labels[{i}]")
            out.append({"messages": transcript_messages(q), **parts})
        return out

    def __call__(self, queries: Sequence[str], prompts: Sequence[str] | None = None,
                 labels: Sequence[Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        import torch  # deferred: torch is heavy and only OpenRLHF's shape needs tensors

        scores = self._shared.score_batch(self.trajectories(queries, labels), None)
        rewards = torch.tensor([s.score for s in scores], dtype=torch.float32)
        names = [c.name for c in self._shared.scorer.components]
        logs = {c: torch.tensor([_nan_if_none(s.components[c]) for s in scores], dtype=torch.float32)
                for c in names}
        return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": logs}


def openrlhf_reward_func(template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                         sha256: str | None = None) -> OpenRlhfRewardFunc:
    """OpenRLHF's custom reward function for a pinned template (``--remote_rm_url file.py``).

    Example::

        reward_func = openrlhf_reward_func("tool_agent")
        reward_func(queries, prompts, labels)["rewards"]   # tensor([...])"""
    return OpenRlhfRewardFunc(_SharedScorer(template, ws=ws, sha256=sha256))


# --------------------------------------------------------------------------- verifiers
def _vf_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(getattr(p, "text", "") or "" for p in getattr(content, "parts", content) or [])


def trace_messages(trace: Any) -> list[dict[str, Any]]:
    """A verifiers ``Trace``'s final branch (prompt and completion) as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    for m in trace.messages:
        msg: dict[str, Any] = {"role": m.role, "content": _vf_text(m.content)}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


def _vf_tools(tools: Sequence[Any]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


_VF_CLASSES: dict[str, Any] = {}


def _verifiers_classes() -> tuple[Any, Any, Any]:
    """The verifiers base classes of the task (made once: verifiers is imported on first use)."""
    if not _VF_CLASSES:
        import verifiers.v1 as vf  # type: ignore[import-untyped]  # deferred: verifiers is an optional extra

        class RewardTaskData(vf.TaskData):
            """A row to score against: the tools schema and the task's criteria (both optional)."""

            tools: list[dict[str, Any]] | None = None
            criteria: dict[str, Any] | None = None

        class RewardTaskBase(vf.Task[RewardTaskData]):
            """Scores its trace with the pinned template once; each reward method reads its part."""

            _rwb_shared: _SharedScorer

            def rwb_score(self, trace: Any) -> TrajectoryScore:
                tools = self.data.tools if self.data.tools is not None else _vf_tools(
                    trace.tools or (trace.branches[-1].tools if trace.nodes else []))
                traj = {"messages": trace_messages(trace), "tools": tools, "task": self.data.criteria}
                return self._rwb_shared.score_batch([traj], None)[0]

        class RewardTaskset(vf.Taskset):
            """Rows (``prompt``, ``tools``, ``task``) as tasks of the pinned template."""

            rwb_rows: list[dict[str, Any]] = []
            rwb_task_class: Any = None

            def load(self):
                for i, row in enumerate(self.rwb_rows):
                    yield self.rwb_task_class(_task_data(RewardTaskData, row, f"rows[{i}]"), self.config.task)

        _VF_CLASSES.update(vf=vf, data=RewardTaskData, task=RewardTaskBase, taskset=RewardTaskset)
    return _VF_CLASSES["vf"], _VF_CLASSES["data"], _VF_CLASSES["task"]


def _task_data(data_cls: Any, row: Mapping[str, Any] | None, field: str) -> Any:
    row = dict(row or {})
    unknown = sorted(set(row) - {"prompt", "tools", "task", "id", "name"})
    if unknown:
        raise InputError(f"unknown key(s) {', '.join(unknown)}; a row has prompt, tools, task, id, name",
                         field=f"{field}.{unknown[0]}")
    return data_cls(prompt=row.get("prompt"), id=row.get("id"), name=row.get("name"),
                    tools=_tools(row.get("tools"), f"{field}.tools"),
                    criteria=_criteria(row.get("task"), f"{field}.task"))


def _component_reward(vf: Any, name: str, weight: float) -> Any:
    async def reward(self, trace):
        value = self.rwb_score(trace).components[name]
        # a component that does not apply is left out of trace.rewards (keyed, empty)
        return {} if value is None else value

    reward.__name__ = reward.__qualname__ = name
    return vf.reward(reward, weight=weight)


def verifiers_task_class(template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                         sha256: str | None = None) -> type:
    """The ``vf.Task`` subclass of a pinned template: one ``@vf.reward(weight=w)`` method per
    component, named after it, plus ``constant`` (weight 1): the part of the score from
    components that do not apply, so that ``trace.reward`` is the scorer's score."""
    vf, _, base = _verifiers_classes()
    shared = _SharedScorer(template, ws=ws, sha256=sha256)
    weights = shared.weights_at(None)
    if CONSTANT_REWARD in weights:
        raise InputError(f"a component named {CONSTANT_REWARD!r} would clash with the constant reward",
                         field="template")
    body: dict[str, Any] = {name: _component_reward(vf, name, w) for name, w in weights.items()}

    async def constant(self, trace):
        return self.rwb_score(trace).constant

    constant.__name__ = constant.__qualname__ = CONSTANT_REWARD
    body[CONSTANT_REWARD] = vf.reward(constant, weight=1.0)
    body.update(_rwb_shared=shared, __doc__=f"Reward {shared.label} (sha256 {shared.sha256[:12]}).",
                __module__=__name__)
    return type("RewardTask", (base,), body)


def verifiers_task_data(row: Mapping[str, Any] | None = None, field: str = "row") -> Any:
    """The task data of a row: ``prompt``, ``tools`` (schema list or its JSON) and ``task``
    (criteria or their JSON), each optional; ``id`` and ``name`` are kept too."""
    _, data_cls, _ = _verifiers_classes()
    return _task_data(data_cls, row, field)


def verifiers_task(template: str | Path | Template = DEFAULT_TEMPLATE, *, ws=None,
                   row: Mapping[str, Any] | None = None, sha256: str | None = None) -> Any:
    """A verifiers 0.4 ``vf.Task`` scoring traces with a pinned template (see
    :func:`verifiers_task_class`) for one ``row`` (:func:`verifiers_task_data`).
    ``await task.score(trace)`` fills ``trace.rewards``; the trace's tools are used when the
    row has none."""
    data = verifiers_task_data(row)
    return verifiers_task_class(template, ws=ws, sha256=sha256)(data)


def verifiers_taskset(template: str | Path | Template | type = DEFAULT_TEMPLATE,
                      rows: Sequence[Mapping[str, Any]] = (), *, ws=None, sha256: str | None = None) -> Any:
    """A ``vf.Taskset`` of ``rows`` (``prompt``, ``tools``, ``task``), one task per row, all
    sharing one scorer; ``template`` may be a class made by :func:`verifiers_task_class`."""
    vf, _, _ = _verifiers_classes()
    cls = template if isinstance(template, type) else verifiers_task_class(template, ws=ws, sha256=sha256)
    taskset_cls = type("RewardTaskset", (_VF_CLASSES["taskset"],),
                       {"rwb_rows": [dict(r) for r in rows], "rwb_task_class": cls, "__module__": __name__})
    return taskset_cls(vf.TasksetConfig())


# --------------------------------------------------------------------------- rwb reward export
@dataclass(frozen=True)
class ExportResult:
    """What :func:`write_export` wrote: the files, the entry point (``module:attribute``), the
    framework's snippet (also in the README), the template's label and digest."""

    files: list[Path]
    entry_point: str
    snippet: str
    template: str
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"files": [str(f) for f in self.files], "entry_point": self.entry_point,
                "snippet": self.snippet, "template": self.template, "sha256": self.sha256}


_ATTRIBUTE = {"trl": "reward", "verifiers": "load_task", "verl": "compute_score", "openrlhf": "reward_func"}

#: Per framework: the module's import of ``core`` and its body after the pin.
_MODULE_BODY = {
    "trl": ("from core.rewards.export import trl_reward_funcs",
            "#: ``reward.funcs`` → ``GRPOTrainer(reward_funcs=...)``; ``reward.weights`` → "
            "``GRPOConfig(reward_weights=...)``\n"
            "reward = trl_reward_funcs(str(TEMPLATE), sha256=SHA256)\n"
            "reward_funcs = reward.funcs\nreward_weights = reward.weights\n"),
    "verifiers": ("from core.rewards.export import verifiers_task_class, verifiers_task_data, verifiers_taskset",
                  "#: The ``vf.Task`` class: one ``@vf.reward`` method per component\n"
                  "RewardTask = verifiers_task_class(str(TEMPLATE), sha256=SHA256)\n\n\n"
                  "def load_task(row=None):\n"
                  "    \"\"\"A verifiers ``vf.Task`` for one row (``prompt``, ``tools``, ``task``).\"\"\"\n"
                  "    return RewardTask(verifiers_task_data(row))\n\n\n"
                  "def load_taskset(rows):\n"
                  "    \"\"\"A verifiers ``vf.Taskset``: one task per row.\"\"\"\n"
                  "    return verifiers_taskset(RewardTask, rows)\n"),
    "verl": ("from core.rewards.export import verl_compute_score",
             "#: ``reward.custom_reward_function.name=compute_score``\n"
             "compute_score = verl_compute_score(str(TEMPLATE), sha256=SHA256)\n"),
    "openrlhf": ("from core.rewards.export import openrlhf_reward_func",
                 "#: ``--remote_rm_url <this file>``\n"
                 "reward_func = openrlhf_reward_func(str(TEMPLATE), sha256=SHA256)\n"),
}


def _snippet(framework: str, module: str, path: str, label: str) -> str:
    if framework == "trl":
        return (f"from trl import GRPOConfig, GRPOTrainer\nfrom {module} import reward\n\n"
                "trainer = GRPOTrainer(model=model, train_dataset=dataset,   # columns: prompt, tools, task\n"
                "                      reward_funcs=reward.funcs,\n"
                "                      args=GRPOConfig(output_dir=\"out\", reward_weights=reward.weights))\n"
                "trainer.train()   # logs rewards/<component>/mean")
    if framework == "verifiers":
        return (f"import asyncio\nfrom {module} import load_task\n\n"
                "task = load_task({\"tools\": tools, \"task\": criteria})   # a verifiers.v1 Task\n"
                "asyncio.run(task.score(trace))   # fills trace.rewards; trace.reward is the return")
    if framework == "verl":
        return ("python -m verl.trainer.main_ppo ... \\\n"
                f"    reward.custom_reward_function.path={path} \\\n"
                "    reward.custom_reward_function.name=compute_score")
    return (f"# in-process: OpenRLHF loads reward_func from the file\n"
            f"python -m openrlhf.cli.train_ppo_ray ... --remote_rm_url {path} --label_key task\n"
            f"# or over HTTP: rwb reward serve --template {label} --port 5000, then\n"
            "#   --remote_rm_url http://127.0.0.1:5000/get_reward")


def write_export(template: str, framework: str, out_dir: str | Path, *, ws=None,
                 shown_dir: str | None = None) -> ExportResult:
    """Write ``rwb_reward_<name>_<version>.py`` (imports ``core``, exposes the framework's entry
    point), a copy of the template's YAML as ``<name>@<version>.yaml`` pinned by its sha256 (the
    module refuses a changed copy) and a README with the framework's snippet, into ``out_dir``.

    ``shown_dir``: how the snippet and README name the folder (default: its absolute path);
    an archive names it by its path once unpacked."""
    if framework not in FRAMEWORKS:
        raise InputError(f"unknown framework {framework!r}; one of {', '.join(FRAMEWORKS)}", field="to")
    pinned = pin_template(template, ws)
    text = _template_text(template, ws, pinned)
    name, _, version = pinned.label.partition("@")
    version = version if version.isdigit() else "file"
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder", field="out")
    out.mkdir(parents=True, exist_ok=True)
    module = f"rwb_reward_{name}_{version}"
    yaml_path, py_path, readme = out / f"{name}@{version}.yaml", out / f"{module}.py", out / "README.md"
    label = f"{name}@{version}"
    yaml_path.write_text(text, encoding="utf-8")
    py_path.write_text(
        f'"""Reward {label} for {framework}, exported by ``rwb reward export`` (Reward Workbench).\n\n'
        f"The template is the YAML file beside this module, pinned by its sha256: a changed copy is\n"
        f'refused.  See README.md and docs/export.md in Reward Workbench.\n"""\n\n'
        f"from pathlib import Path\n\n{_MODULE_BODY[framework][0]}\n\n"
        f"TEMPLATE = Path(__file__).with_name({yaml_path.name!r})\n"
        f"TEMPLATE_LABEL = {label!r}\n"
        f"SHA256 = {pinned.sha256!r}\n\n"
        + _MODULE_BODY[framework][1], encoding="utf-8")
    shown = f"{shown_dir.rstrip('/')}/{py_path.name}" if shown_dir is not None else str(py_path.resolve())
    snippet = _snippet(framework, module, shown, label)
    lang = "bash" if framework in ("verl", "openrlhf") else "python"
    readme.write_text(
        f"# Reward {label} for {framework}\n\n"
        f"Exported by `rwb reward export --template {label} --to {framework}`. `{py_path.name}` scores\n"
        f"trajectories with the template in `{yaml_path.name}` (sha256 `{pinned.sha256}`); it refuses a\n"
        "changed copy. It imports `core`: install Reward Workbench where the trainer runs.\n\n"
        f"```{lang}\n{snippet}\n```\n", encoding="utf-8")
    return ExportResult(files=[py_path, yaml_path, readme], entry_point=f"{module}:{_ATTRIBUTE[framework]}",
                        snippet=snippet, template=label, sha256=pinned.sha256)


@dataclass(frozen=True)
class ExportArchive:
    """An export as one zip: its files under ``folder/``, the snippet naming them there."""

    #: ``name@version`` and sha256 of the pinned template
    template: str
    sha256: str
    entry_point: str
    snippet: str
    folder: str
    #: The archive's member names
    names: list[str]
    #: The zip's bytes (fixed dates: the same export is the same archive)
    data: bytes


def export_archive(template: str, framework: str, *, ws=None) -> ExportArchive:
    """The export of ``template`` for ``framework`` as a zip (what the Export page downloads);
    its README and snippet name the module as ``./<folder>/<module>.py``."""
    spec = pin_template(template, ws).label
    folder = f"rwb_reward_{spec.replace('@', '_')}_{framework}"
    with tempfile.TemporaryDirectory(prefix="rwb-export-") as tmp:
        result = write_export(template, framework, Path(tmp) / folder, ws=ws, shown_dir=f"./{folder}")
        buffer = io.BytesIO()
        names = [f"{folder}/{path.name}" for path in result.files]
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, path in zip(names, result.files):
                entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                archive.writestr(entry, path.read_bytes(), compress_type=zipfile.ZIP_DEFLATED)
    return ExportArchive(template=result.template, sha256=result.sha256, entry_point=result.entry_point,
                         snippet=result.snippet, folder=folder, names=names, data=buffer.getvalue())


def _template_text(template: str, ws, pinned: Any) -> str:
    """The YAML text whose digest is the pin: the file, the saved version or the shipped file."""
    path = Path(template)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    else:
        name, version = parse_spec(template)
        saved = get_template(ws, name, version) if ws is not None else shipped_version(name)
        text = saved.yaml if saved is not None else ""
    if sha256_text(text) != pinned.sha256:
        raise InputError(f"template {pinned.label} changed while it was exported", field="template")
    return text


__all__ = ["AsyncTrlRewardFunc", "ExportArchive", "ExportResult", "FRAMEWORKS", "GRANULARITIES", "OpenRlhfRewardFunc", "TrlReward",
           "TrlRewardFunc", "VerlComputeScore", "openrlhf_reward_func", "trace_messages", "trl_reward_funcs",
           "trl_trajectories", "verifiers_task", "verifiers_task_class", "verifiers_task_data", "verifiers_taskset",
           "verl_compute_score", "export_archive", "write_export"]
