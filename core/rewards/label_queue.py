"""The labelling queue: which episodes a person should label next, and what labels buy.

:func:`propose_next` ranks a dataset's unlabelled episodes by how unsure the current model
is of their outcome (the template's fitted ``learned_outcome`` term, else a logistic model
fitted on the labels so far, else the template's return ranked to the middle) and deals them out over
tasks, fewest labels first, so that each label adds a task's second outcome before a third
run of a task already covered.  :func:`dataset_learning_curve` is the held-out AUC against
the number of labelled episodes (``core.rewards.outcome_model.learning_curve``) on a workspace
dataset's outcomes.  Labels themselves live in :mod:`core.rewards.labels`.

Details: docs/labels.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from core.base import embed as text_embedding
from core.base.errors import InputError
from core.data.episode_views import action_label
from core.records.episodes import Episode
from core.rewards.api import as_template, load_frame, score
from core.rewards.components import ScoringContext
from core.rewards.criteria import frame_criteria
from core.rewards.labels import current_labels, dataset_outcomes, labels_version
from core.rewards.learned import MIN_EPISODES, MIN_TASKS, LearnedOutcome
from core.rewards.outcome_model import FEATURE_SETS, Config, LearningCurve, feature_table, fit_linear, learning_curve
from core.rewards.outcomes import tasks_with_both

if TYPE_CHECKING:
    from core.records.store import Workspace

#: The template whose return ranks episodes when no model can be had and none is given.
DEFAULT_TEMPLATE = "tool_agent"
#: Most proposals one call returns.
MAX_PROPOSALS = 200
#: Longest text (request, last answer, step line) a proposal carries.
MAX_TEXT = 600
#: How the model's guess was had: the template's fitted term, a model fitted on the labels
#: so far, or the template's return ranked (no probability).
ModelSource = Literal["template_term", "fitted_on_labels", "return_rank"]
#: The model fitted on the labels so far: counts and task-relative counts, no embedding.
QUEUE_CONFIG = Config("counts_task", "all_pairs", 0.1)


@dataclass(frozen=True)
class Proposal:
    """One episode proposed for labelling."""

    #: The episode and its task (the group key's value)
    episode_id: str
    task: str
    #: The user's request and the agent's last words (each cut to ``MAX_TEXT`` characters)
    request: str
    last_answer: str
    #: The conversation's steps, one short line each (``2. get_order(order_id=7) → ok``)
    steps: tuple[str, ...]
    #: The model's success probability; None when only the return ranked it
    probability: float | None
    #: 0 (the model is sure) … 1 (a coin toss): 1 - 2·|p - 0.5|, or of the return's percentile
    uncertainty: float
    #: The outcome the log recorded (1, 0, a graded value) or None when it recorded none
    recorded: float | None
    #: Why it was picked, in words
    why: str


@dataclass(frozen=True)
class Proposals:
    """The next episodes to label, and the state of the label set they were chosen from."""

    dataset: str
    #: The label set's version (:func:`core.rewards.labels.labels_version`)
    labels_version: int
    #: Episodes of the dataset; those a person labelled (withdrawn labels not counted);
    #: those with a known outcome (labelled, else recorded)
    n_episodes: int
    n_labelled: int
    n_known: int
    #: Tasks, and tasks with both a success and a failure known
    n_tasks: int
    n_tasks_with_both: int
    #: Where the probabilities come from, and that in words
    model: ModelSource
    model_note: str
    items: tuple[Proposal, ...]


def _cut(text: str | None) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _step_line(step: Any) -> str:
    if step.action.kind == "tool_call":
        what = "error: " + _cut(step.tool_error)[:80] if step.tool_error else "ok"
        return f"{step.t}. {action_label(step.action)} → {what}"
    return f"{step.t}. {step.action.kind}: {_cut(step.output_text)[:120]}"


def _last_answer(ep: Episode) -> str:
    for step in reversed(ep.steps):
        if step.output_text and step.output_text.strip():
            return _cut(step.output_text)
    return ""


def _learned_term(template) -> dict[str, Any] | None:
    for spec in template.episode_terms:
        if spec.component == "learned_outcome" and (spec.params or {}).get("features"):
            return dict(spec.params)
    return None


def _labels_model(frame, labels: np.ndarray, groups: np.ndarray, ctx: ScoringContext
                  ) -> tuple[np.ndarray | None, str]:
    """(success probability per episode, note) of a logistic model on tool-use statistics and
    task-relative counts fitted on the known outcomes; None and why not when there are too few.
    It is refitted on every proposal, so it is one plain model (no nested cross-validation, no
    sentence embedding): ranking the uncertain episodes needs no more."""
    known = np.flatnonzero(~np.isnan(labels))
    y = (labels[known] > 0.5).astype(int)
    n_tasks = int(np.unique(groups[known].astype(str)).size)
    if known.size < MIN_EPISODES or n_tasks < MIN_TASKS or min(y.sum(), (1 - y).sum()) < 5:
        return None, (f"{known.size} known outcomes over {n_tasks} tasks ({int(y.sum())} successes); a model "
                      f"needs {MIN_EPISODES} over {MIN_TASKS} tasks with 5 of each outcome")
    config = QUEUE_CONFIG
    table = feature_table(frame, ctx, groups.astype(str), FEATURE_SETS[config.features] + ("criteria",))
    x = table.matrix
    model = fit_linear(x[known], y, groups[known].astype(str), config.objective, config.C)
    if model is None:
        return None, "no model could be fitted on these outcomes"
    return model.predict(x), (f"a model fitted on the {known.size} known outcomes over {n_tasks} tasks "
                              f"({config.features} features, C={config.C:g})")


def _guess(ws: "Workspace", frame, labels: np.ndarray, groups: np.ndarray, template,
           ) -> tuple[np.ndarray | None, np.ndarray, ModelSource, str]:
    """(probability or None, uncertainty in [0, 1], source, note) per episode of ``frame``."""
    ctx = ScoringContext(embedder=text_embedding.workspace_embedder(ws), criteria=frame_criteria(ws, frame))
    base = as_template(template or DEFAULT_TEMPLATE, ws)
    params = _learned_term(base)
    if params is not None:
        prob = LearnedOutcome(**params).predict(frame, ctx, groups.astype(str))
        note = (f"the learned_outcome term of {base.name!r} (fitted on {params.get('trained_on', '?')} "
                "episodes)")
        return prob, 1.0 - 2.0 * np.abs(prob - 0.5), "template_term", note
    fitted, note = _labels_model(frame, labels, groups, ctx)
    if fitted is not None:
        return fitted, 1.0 - 2.0 * np.abs(fitted - 0.5), "fitted_on_labels", note
    returns = score(ws, base, frame=frame).returns
    order = np.argsort(np.argsort(returns, kind="stable"), kind="stable")
    pct = (order + 0.5) / max(returns.size, 1)
    note = f"the return of {base.name!r}, ranked: episodes in the middle first (no model yet: {note})"
    return None, 1.0 - 2.0 * np.abs(pct - 0.5), "return_rank", note


def _deal(candidates: np.ndarray, groups: np.ndarray, uncertainty: np.ndarray, known_per_task: dict[str, int],
          n: int) -> list[tuple[int, int]]:
    """(episode index, round) of up to ``n`` candidates dealt round-robin over tasks: each
    round takes the most uncertain remaining episode of every task, tasks with the fewest
    known outcomes (then the most uncertain episode) first."""
    by_task: dict[str, list[int]] = {}
    for i in candidates[np.argsort(-uncertainty[candidates], kind="stable")]:
        by_task.setdefault(str(groups[i]), []).append(int(i))
    tasks = sorted(by_task, key=lambda g: (known_per_task.get(g, 0), -uncertainty[by_task[g][0]], g))
    picked: list[tuple[int, int]] = []
    depth = 0
    while len(picked) < n and tasks:
        tasks = [g for g in tasks if len(by_task[g]) > depth]
        for g in tasks:
            if len(picked) == n:
                break
            picked.append((by_task[g][depth], depth))
        depth += 1
    return picked


def propose_next(ws: "Workspace", dataset: str, n: int = 10, template: Any = None, *,
                 group_key: str | None = None) -> Proposals:
    """The ``n`` episodes of ``dataset`` to label next: never one a person has labelled,
    spread over tasks, the most uncertain first (see the module docstring).  Episodes whose
    outcome nobody recorded come before those a label would only confirm or correct."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROPOSALS:
        raise InputError(f"propose between 1 and {MAX_PROPOSALS} episodes; got {n!r}", field="n")
    ws.require_dataset(dataset)
    episodes = ws.load_episodes(dataset)
    if not episodes:
        raise InputError(f"dataset {dataset!r} has no episodes to label", field="dataset")
    labels, groups = dataset_outcomes(ws, dataset, group_key)
    given = current_labels(ws, dataset)
    labelled = np.array([given.get(ep.episode_id) is not None for ep in episodes], dtype=bool)
    known = ~np.isnan(labels)
    known_per_task: dict[str, int] = {}
    for g in groups[known]:
        known_per_task[str(g)] = known_per_task.get(str(g), 0) + 1
    with_both = tasks_with_both(labels[known], groups[known])
    version = labels_version(ws, dataset)
    frame = load_frame(ws, dataset)
    prob, uncertainty, source, note = _guess(ws, frame, labels, groups, template)
    picked: list[tuple[int, int]] = []
    for pool in (np.flatnonzero(~labelled & ~known), np.flatnonzero(~labelled & known)):
        if len(picked) < n and pool.size:
            picked += _deal(pool, groups, uncertainty, known_per_task, n - len(picked))
    items = []
    for i, depth in picked:
        ep = episodes[i]
        task = str(groups[i])
        share = known_per_task.get(task, 0)
        guess = (f"the model gives {prob[i]:.2f}" if prob is not None
                 else f"its return sits at uncertainty {uncertainty[i]:.2f} of the ranking")
        recorded = None if np.isnan(labels[i]) else float(labels[i])
        why = (f"{guess}; its task has {share} known outcome{'s' if share != 1 else ''}"
               + (", the first pick of that task" if depth == 0 else f", pick {depth + 1} of that task")
               + ("; no outcome recorded" if recorded is None
                  else f"; the log recorded {recorded:g}: a label confirms or corrects it"))
        items.append(Proposal(
            episode_id=ep.episode_id, task=task, request=_cut(ep.task.query), last_answer=_last_answer(ep),
            steps=tuple(_step_line(s) for s in ep.steps), probability=None if prob is None else float(prob[i]),
            uncertainty=float(uncertainty[i]), recorded=recorded, why=why))
    return Proposals(dataset=dataset, labels_version=version, n_episodes=len(episodes),
                     n_labelled=int(labelled.sum()), n_known=int(known.sum()), n_tasks=int(np.unique(groups.astype(str)).size),
                     n_tasks_with_both=int(with_both), model=source, model_note=note, items=tuple(items))


def dataset_learning_curve(ws: "Workspace", dataset: str, *, group_key: str | None = None,
                           sizes: tuple[int, ...] = (10, 20, 40, 80, 160)) -> LearningCurve:
    """Held-out AUC against the number of labelled episodes on ``dataset``'s outcomes (people's
    labels over the recorded ones): :func:`core.rewards.outcome_model.learning_curve`."""
    frame = load_frame(ws, dataset)
    labels, groups = dataset_outcomes(ws, dataset, group_key)
    ctx = ScoringContext(embedder=text_embedding.workspace_embedder(ws), criteria=frame_criteria(ws, frame))
    return learning_curve(frame, labels, groups, ctx, sizes=sizes)
