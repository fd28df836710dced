"""Where a workspace stands along the loop, and the next useful step (the Home page, ``rwb
workspace status``).

The loop: import agent logs → check the reward against outcomes and save a version → train a
policy → export and register it → reviewers decide flagged steps → an approver approves and
promotes it.  :func:`workspace_overview` reads each stage's state from the workspace (counts
and the latest of each thing; nothing that takes more than a moment) and decides the first
stage still to do that the acting user may do, with the reason in words.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from core.access.choices import template_matches_domain, template_name
from core.access.users import Actor
from core.base.errors import RwbError
from core.govern.registry import list_versions
from core.guard.review import stats as review_stats
from core.rewards.api import load_frame, score
from core.rewards.labels import dataset_outcomes
from core.rewards.outcomes import fidelity as outcome_fidelity
from core.rewards.outcomes import tasks_with_both
from core.rl.runs import list_runs

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: The largest dataset (in steps) whose reward fidelity is measured on the spot: scoring a sample
#: (about 1,400 steps) takes about a second once its texts are embedded, a few seconds the first
#: time; a larger dataset is left to the Reward Pyramid page.
FIDELITY_MAX_STEPS = 2_000
#: A within-task AUC at or above this ranks successes above failures of the same task well.
GOOD_FIDELITY = 0.7


@dataclass(frozen=True)
class DatasetState:
    """One dataset: its size and how much of it has an outcome."""

    name: str
    domain: str | None
    episodes: int
    #: Episodes with a recorded outcome (resolved or a final reward) or a person's label
    labelled: int
    #: One of the sample datasets the workspace was seeded with
    sample: bool
    created_at: str


@dataclass(frozen=True)
class RewardFidelity:
    """How well a template version's episode return ranks recorded outcomes: the within-task
    AUC (a success and a failure of the same task; 0.5 is chance, 1 is perfect)."""

    #: None when not measured (``note`` says why)
    within_task_auc: float | None
    #: The dataset it was measured on
    dataset: str | None
    #: Where the figure comes from, or why there is none, in words
    note: str
    #: Tasks with both a success and a failure (the pairs compared)
    tasks_with_both: int | None = None
    #: 90% interval over resampled tasks, when measured here
    ci90: tuple[float, float] | None = None
    #: Whether the figure is on tasks the version was not tuned on (a tuning study's held-out
    #: split); a figure measured on the dataset the version is made for is not
    held_out: bool = False


@dataclass(frozen=True)
class RewardState:
    """Saved reward template versions, and the fidelity of the latest one."""

    #: Versions saved in this workspace (the shipped files not counted)
    versions_saved: int
    #: ``name@N`` of the newest saved version (None before the first save)
    latest: str | None
    latest_saved_by: str | None
    latest_saved_at: str | None
    fidelity: RewardFidelity | None


@dataclass(frozen=True)
class RunState:
    """Training runs: how many, and the newest."""

    count: int
    running: int
    latest_id: str | None
    #: ``running``, ``finished``, ``failed``, ``stopped`` or ``interrupted``
    latest_status: str | None
    latest_template: str | None
    latest_dataset: str | None
    #: Finished runs no registered policy version comes from
    finished_unregistered: tuple[str, ...]


@dataclass(frozen=True)
class ReviewState:
    """The review queue."""

    #: Items waiting for a decision (pending, claimed, or with an expired claim)
    open: int
    pending: int
    decided: int


@dataclass(frozen=True)
class PolicyState:
    """Registered policies: what is in production and what waits."""

    #: ``name@version`` per policy in production
    production: tuple[str, ...]
    #: ``name@version`` approved but not (yet) in production
    approved: tuple[str, ...]
    #: ``name@version`` registered and waiting for an approval
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class NextStep:
    """The next useful step: where to do it and why."""

    #: The stage of the loop (data, reward, train, register, review, approve, promote, done)
    stage: str
    #: The app page's address where it is done (``episodes``, ``rewards``, ``training`` …)
    page: str
    #: What to do, as a link's label
    action: str
    #: Why this step, in words
    reason: str


@dataclass(frozen=True)
class WorkspaceOverview:
    """A workspace's state along the loop and the next useful step (:func:`workspace_overview`)."""

    #: The datasets in use (archived ones left out), newest first
    datasets: tuple[DatasetState, ...]
    reward: RewardState
    runs: RunState
    review: ReviewState
    policies: PolicyState
    next_step: NextStep

    @property
    def episodes(self) -> int:
        return sum(d.episodes for d in self.datasets)

    @property
    def labelled(self) -> int:
        return sum(d.labelled for d in self.datasets)

    @property
    def labelled_share(self) -> float | None:
        """Episodes with an outcome / all episodes (None without episodes)."""
        return self.labelled / self.episodes if self.episodes else None

    @property
    def own_datasets(self) -> tuple[DatasetState, ...]:
        return tuple(d for d in self.datasets if not d.sample)


# --------------------------------------------------------------------------- the stages
def _datasets(ws: "Workspace", samples: Collection[str]) -> tuple[DatasetState, ...]:
    """The datasets in use (archived ones left out), newest first."""
    rows = ws.conn.execute(
        """SELECT d.name, d.domain, d.created_at, COUNT(e.uid),
                  COALESCE(SUM(e.resolved IS NOT NULL OR e.final_reward IS NOT NULL OR EXISTS (
                      SELECT 1 FROM label_events l WHERE l.id = (
                          SELECT MAX(id) FROM label_events WHERE dataset = e.dataset
                          AND episode_id = e.episode_id) AND l.outcome IS NOT NULL)), 0)
           FROM datasets d LEFT JOIN episodes e ON e.dataset = d.name WHERE d.archived_at IS NULL
           GROUP BY d.name ORDER BY d.created_at DESC, d.rowid DESC""").fetchall()
    return tuple(DatasetState(name=r[0], domain=r[1], created_at=r[2], episodes=int(r[3]),
                              labelled=int(r[4]), sample=r[0] in samples) for r in rows)


def _fidelity_dataset(datasets: tuple[DatasetState, ...], template: str) -> DatasetState | None:
    """The newest dataset with outcomes that ``template`` is made for (by domain); for a
    generic template (made for none of these datasets' domains) the newest with outcomes."""
    with_outcomes = [d for d in datasets if d.labelled >= 2]
    matching = [d for d in with_outcomes if template_matches_domain(template, d.domain)]
    if matching:
        return matching[0]
    if any(template_matches_domain(template, d.domain) for d in datasets):
        return None  # its own data has no outcomes
    return with_outcomes[0] if with_outcomes else None


def _fidelity(ws: "Workspace", spec: str, meta: dict[str, Any],
              datasets: tuple[DatasetState, ...]) -> RewardFidelity:
    """The latest version's fidelity: the held-out figure a tuning study recorded with it,
    else the within-task AUC measured now on the dataset it is made for (a small one only)."""
    tuning = meta.get("tuning") or {}
    held = tuning.get("held_out_within")
    if isinstance(held, (int, float)) and np.isfinite(held):
        data = tuning.get("data") or {}
        return RewardFidelity(float(held), data.get("dataset"),
                              f"recorded by tuning study {tuning.get('study')} on held-out tasks",
                              held_out=True)
    target = _fidelity_dataset(datasets, template_name(spec))
    if target is None:
        return RewardFidelity(None, None, "no dataset with outcomes to measure it on")
    steps = ws.conn.execute("SELECT COALESCE(SUM(n_steps), 0) FROM episodes WHERE dataset=?",
                            (target.name,)).fetchone()[0]
    if steps > FIDELITY_MAX_STEPS:
        return RewardFidelity(None, target.name, f"not measured here: {target.name} has {steps:,} steps; "
                                                 "the Reward Pyramid page measures it")
    try:
        result = score(ws, spec, frame=load_frame(ws, target.name))
        labels, groups = dataset_outcomes(ws, target.name)
    except RwbError as exc:
        return RewardFidelity(None, target.name, f"could not be measured: {exc}")
    known = ~np.isnan(labels)
    binary = bool(np.all(np.isin(labels[known], [0.0, 1.0])))
    both = tasks_with_both(labels[known], groups[known]) if binary else 0
    if not binary or both == 0:
        return RewardFidelity(None, target.name, f"{target.name} has no task with both a success and a "
                                                 "failure to compare", both)
    within = outcome_fidelity(result.returns[known], labels[known], groups[known]).within_task
    lo, hi = within.ci90
    ci = (lo, hi) if np.isfinite(lo) and np.isfinite(hi) else None
    # the version may have been edited while looking at this very dataset: say so
    return RewardFidelity(float(within.value), target.name,
                          f"measured on {target.name}, the data it is made for (not a held-out figure)",
                          both, ci)


def _reward(ws: "Workspace", datasets: tuple[DatasetState, ...]) -> RewardState:
    count = int(ws.conn.execute("SELECT COUNT(*) FROM template_versions").fetchone()[0])
    row = ws.conn.execute("SELECT name, version, saved_by, saved_at, meta FROM template_versions "
                          "ORDER BY saved_at DESC, rowid DESC LIMIT 1").fetchone()
    if row is None:
        return RewardState(0, None, None, None, None)
    spec = f"{row[0]}@{row[1]}"
    meta = json.loads(row[4]) if row[4] else {}
    return RewardState(count, spec, row[2], row[3], _fidelity(ws, spec, meta, datasets))


def _runs(ws: "Workspace") -> RunState:
    count = int(ws.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    latest = list_runs(ws, limit=1)
    running = list_runs(ws, status="running", limit=1000)
    registered = {r[0] for r in ws.conn.execute("SELECT DISTINCT run_id FROM policy_versions")}
    finished = [r[0] for r in ws.conn.execute("SELECT id FROM runs WHERE status='finished' "
                                              "ORDER BY created_at DESC, rowid DESC")]
    first = latest[0] if latest else None
    return RunState(
        count=count, running=sum(1 for r in running if not r.interrupted),
        latest_id=first.id if first else None, latest_status=first.display_status if first else None,
        latest_template=f"{first.template_name} {first.template_version}" if first else None,
        latest_dataset=first.dataset if first else None,
        finished_unregistered=tuple(r for r in finished if r not in registered))


def _review(ws: "Workspace") -> ReviewState:
    s = review_stats(ws)
    return ReviewState(open=s.open, pending=s.pending, decided=s.decided)


def _policies(ws: "Workspace") -> PolicyState:
    by_stage: dict[str, list[str]] = {"production": [], "approved": [], "candidate": []}
    for v in list_versions(ws):
        if v.stage in by_stage:
            by_stage[v.stage].append(f"{v.name}@{v.version}")
    return PolicyState(production=tuple(by_stage["production"]), approved=tuple(by_stage["approved"]),
                       candidates=tuple(by_stage["candidate"]))


# --------------------------------------------------------------------------- the next step
def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _steps_to_do(datasets: tuple[DatasetState, ...], reward: RewardState, runs: RunState,
                 review: ReviewState, policies: PolicyState) -> list[tuple[str, str, NextStep]]:
    """Every stage still to do, in the loop's order, each with the permission it needs."""
    remaining: list[tuple[str, str, NextStep]] = []
    has_data = any(d.episodes for d in datasets)
    own = [d for d in datasets if not d.sample and d.episodes]
    if not has_data:
        remaining.append(("import", "data", NextStep("data", "episodes", "Import your agent logs",
                                                "The workspace holds no episodes yet.")))
    elif not own and reward.versions_saved == 0 and runs.count == 0:
        remaining.append(("import", "data", NextStep(
            "data", "episodes", "Import your own agent logs",
            "The workspace holds only the sample datasets: import your agent's logs to work on your own data "
            "(or look around the samples first).")))
    if has_data and reward.versions_saved == 0:
        remaining.append(("edit_template", "reward", NextStep(
            "reward", "rewards", "Check the reward against outcomes and save a version",
            "No reward template version is saved yet: a training run needs a reward you have checked.")))
    if has_data and runs.count == 0:
        remaining.append(("train", "train", NextStep("train", "training", "Train a policy",
                                                "No training run yet.")))
    elif runs.latest_status in ("failed", "interrupted"):
        remaining.append(("train", "train", NextStep(
            "train", "training", f"See why run {runs.latest_id} ended, and resume or relaunch it",
            f"The latest run is {runs.latest_status}.")))
    elif runs.running:
        remaining.append(("train", "train", NextStep(
            "train", "training", "Watch the run in progress",
            f"{_plural(runs.running, 'run')} training now.")))
    if runs.finished_unregistered:
        run = runs.finished_unregistered[0]
        remaining.append(("export_bundle", "register", NextStep(
            "register", "policies", f"Export run {run} and register it for approval",
            f"{_plural(len(runs.finished_unregistered), 'finished run')} not registered as a policy yet.")))
    if review.open:
        remaining.append(("review", "review", NextStep(
            "review", "review", "Decide the steps waiting for review",
            f"{_plural(review.open, 'item')} on the review queue wait for a decision.")))
    if policies.candidates:
        remaining.append(("approve", "approve", NextStep(
            "approve", "policies", f"Approve or turn down {policies.candidates[0]}",
            f"{_plural(len(policies.candidates), 'registered policy version')} wait for an approval.")))
    if policies.approved:
        remaining.append(("promote", "promote", NextStep(
            "promote", "policies", f"Promote {policies.approved[-1]} to production",
            f"{_plural(len(policies.approved), 'approved policy version')} not in production.")))
    return remaining


def _next_step(remaining: list[tuple[str, str, NextStep]], actor: Actor | None) -> NextStep:
    """The first stage still to do that ``actor`` may do (anyone's when nobody is signed in)."""
    for permission, _stage, step in remaining:
        if actor is None or actor.can(permission):
            return step
    if remaining:
        step = remaining[0][2]
        return NextStep(step.stage, step.page, step.action,
                        f"{step.reason} Your role ({actor.role if actor else 'none'}) does not do this step; "
                        "someone with that role does.")
    return NextStep("done", "audit", "Look at what was decided and served",
                    "Every stage of the loop is done: nothing waits for anyone.")


def workspace_overview(ws: "Workspace", actor: Actor | None = None, *,
                       samples: Collection[str] = ()) -> WorkspaceOverview:
    """The workspace's state along the loop and the next useful step for ``actor`` (anyone's
    when None).  ``samples`` names the sample datasets (own data is everything else).

    >>> overview = workspace_overview(ws, LOCAL_ADMIN, samples=["finance-sample"])  # doctest: +SKIP
    >>> overview.next_step.page                                                     # doctest: +SKIP
    'episodes'
    """
    datasets = _datasets(ws, set(samples))
    reward = _reward(ws, datasets)
    runs = _runs(ws)
    review = _review(ws)
    policies = _policies(ws)
    step = _next_step(_steps_to_do(datasets, reward, runs, review, policies), actor)
    return WorkspaceOverview(datasets=datasets, reward=reward, runs=runs, review=review,
                             policies=policies, next_step=step)
