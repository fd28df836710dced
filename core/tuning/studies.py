"""Running a study (:func:`tune`): Optuna over a reward pyramid's weights and chosen component
parameters (docs/design.md §5, §10).

A study asks which weights, within the analyst's bounds, make the pyramid agree best with what
is known about the episodes, under one objective: ``outcome`` (rank successful episodes above
failed ones, on task-grouped design folds, reported on outer held-out tasks), ``preferences``
(analysts' pair labels) or ``policy`` (a short PPO run per trial).  The template's expectations
are constraints; small data is refused or pulled toward the template's weights.

Details: docs/tuning.md (## The outcome objective, ## Small data, ## The preferences and policy
objectives, ## Expectations as constraints, ## Trial cost, ## Study storage).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optuna

from core.access.users import Actor, authorize
from core.base.embed import workspace_embedder
from core.base.errors import ConflictError, InputError
from core.base.results import to_jsonable
from core.rewards.cache import ComponentCache
from core.rewards.components import ScoringContext
from core.rewards.criteria import episodes_criteria
from core.rewards.expectations import evaluate_expectations
from core.rewards.frame import StepsFrame
from core.rewards.labels import labels_version
from core.rewards.outcomes import Fidelity
from core.rewards.pyramid import Pyramid, ScoreResult
from core.rewards.template import Template
from core.tuning.config import SearchSpace, TuneConfig, outcome_readers
from core.tuning.heldout import HeldOutReport
from core.tuning.data import (data_label, default_study_name, load_episodes_and_frame, resolve_template_ref,
                              withhold_outcomes)
from core.tuning.labels import check_outcome_data, outcome_labels, split_episodes, split_keys, task_groups
from core.tuning.objectives import (OutcomeObjective, PreferenceObjective, TuningObjective,
                                    policy_objective)
from core.tuning.preferences import preference_pairs
from core.tuning.problem import TuningProblem
from core.tuning.records import (CONFIG_ATTR, HELD_OUT_ATTR, end_run, fail_run, failure_text, finite, heartbeat,
                                 record_study, running_worker, start_run)
from core.tuning.storage import BatchedTrialWriter, default_storage_url, describe_url, open_storage

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Trials of one call listed in its result (the most recent).
TRIAL_ROWS = 500


@dataclass
class TuneResult:
    """What :func:`tune` returns (``--json`` prints :meth:`to_dict`)."""

    study: str
    storage: str
    objective: str
    metric: str
    trials_run: int
    trials_total: int
    feasible_trials: int
    stopped: bool
    seconds: float
    trials_per_min: float
    #: process CPU seconds of the optimisation (on a shared machine, wall time includes waiting)
    cpu_seconds: float
    baseline: dict[str, Any]
    best: dict[str, Any] | None
    skipped_expectations: list[dict[str, Any]]
    split: dict[str, Any]
    recomputed_components: list[str]
    run_id: int | None = None
    #: what the analyst should know about the result (small labelled set, a fallback to all pairs, …)
    warnings: list[str] = field(default_factory=list)
    #: the trials this call ran (at most TRIAL_ROWS, the most recent)
    trials: list[TrialRow] = field(default_factory=list)
    #: outcome objective: the held-out figure the study answers to (within_task or all_pairs; None elsewhere)
    primary: str | None = None
    #: outcome objective: all-pairs and within-task AUC with 90% intervals on the held-out tasks, of
    #: the best trial and of the template's own weights (:class:`~core.tuning.heldout.HeldOutReport`)
    held_out_report: dict[str, Any] | None = None

    @property
    def best_value(self) -> float | None:
        return None if self.best is None else self.best["value"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = finite(asdict(self) | {"best_value": self.best_value,
                                                     "best_weights": None if self.best is None else
                                                     self.best["weights"]})
        return out


@dataclass
class _LoopState:
    """Where one :func:`tune` call's optimisation loop stands (shared with its callbacks)."""

    flushed_at: float          # time.monotonic() of the last flush to the records
    best: float | None         # the feasible best value so far
    first: int                 # number of the first trial this call runs
    done: int = 0              # trials this call finished
    stop: bool = False         # SIGTERM asked to stop after the running trial
    stopped: bool = False      # a stop was asked (SIGTERM or the run's record) and the loop told to end


def _objective_metric(cfg: TuneConfig, objective: TuningObjective) -> str:
    """The figure key of the objective's value (as in ``figures()``): what the study is scored by."""
    if isinstance(objective, OutcomeObjective):
        return {"within_task": "soft_within_task", "soft_auc": "soft_auc", "auc": "auc",
                "kendall": "kendall_tau"}[objective.metric]
    return {"preferences": "agreement", "policy": "success_rate"}[cfg.objective]


def tune(ws: "Workspace", actor: Actor, template: Template | str | Path, *, dataset: str | None = None,
         episodes: str | Path | None = None, frame: StepsFrame | None = None,
         config: TuneConfig | None = None, trials: int = 100,
         storage: str | None = None, study: str | None = None, bounds: Mapping[str, Any] | None = None,
         fixed: Sequence[str] = (), timeout: float | None = None, flush_seconds: float = 1.0,
         run_id: int | None = None, progress: Callable[[dict[str, Any]], None] | None = None,
         groups: np.ndarray | None = None) -> TuneResult:
    """Run (or continue) a study: ``trials`` more trials of ``config.objective`` over the
    weights (and bounded parameters) of ``template`` on a dataset, an episodes file, or a
    steps ``frame`` the caller already holds (notebooks, benchmarks).  With a frame, the
    task of each episode is ``groups`` (:func:`task_groups` of the episodes it was built
    from) or, without them, the request text.

    ``progress``, when given, is called after every trial with ``{"study", "trials_done",
    "trials", "best_value", "trial": <the trial's TrialRow, as in TuneResult.trials>}``.

    ``storage``: None for the workspace's Optuna journal (in-memory trials, written in
    batches every ``flush_seconds``), or an SQLAlchemy URL (Optuna's RDB storage) or a
    journal file used directly (several workers may share it).  ``study``: its name (default: from the
    template, objective, data and settings, so a rerun continues it).  The first trial of a
    new study is the template's own weights (the baseline).

    A launched worker's run (``run_id``) that fails, before or during its trials, is recorded as
    ``failed`` with the cause (:func:`~core.tuning.records.fail_run`).  Needs ``train``."""
    try:
        authorize(ws, actor, "train")
        return _tune(ws, actor, template, dataset=dataset, episodes=episodes, frame=frame, config=config,
                     trials=trials, storage=storage, study=study, bounds=bounds, fixed=fixed, timeout=timeout,
                     flush_seconds=flush_seconds, run_id=run_id, progress=progress, groups=groups)
    except BaseException as exc:
        if run_id is not None:  # a launched worker: its run says why it ended, where the Studies list shows it
            fail_run(ws, run_id, exc)
        raise


def _tune(ws: "Workspace", actor: Actor, template: Template | str | Path, *, dataset: str | None,
          episodes: str | Path | None, frame: StepsFrame | None, config: TuneConfig | None, trials: int,
          storage: str | None, study: str | None, bounds: Mapping[str, Any] | None, fixed: Sequence[str],
          timeout: float | None, flush_seconds: float, run_id: int | None,
          progress: Callable[[dict[str, Any]], None] | None, groups: np.ndarray | None) -> TuneResult:
    """The body of :func:`tune` (the actor is authorised there)."""
    cfg = (config or TuneConfig()).validate()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"trials must be a whole number ≥ 1, got {trials!r}", field="trials")
    if not flush_seconds > 0:
        raise InputError("flush_seconds must be > 0", field="flush_seconds")
    if cfg.objective == "preferences" and dataset is None:
        raise InputError("preference labels belong to a workspace dataset: give --dataset", field="dataset")

    # ------------------------------------------------------------------ data, template, split
    ref = resolve_template_ref(ws, template)
    t = ref.template
    if frame is not None:
        if dataset is not None or episodes is not None:
            raise InputError("give one of a dataset, an episodes file or a frame", field="dataset")
        if cfg.objective == "policy":
            raise InputError("the policy objective trains on a dataset or an episodes file, not a frame",
                             field="frame")
        full, loaded = frame, None
    else:
        if groups is not None:
            raise InputError("task groups go with a frame; a dataset or file has its own", field="groups")
        loaded, full = load_episodes_and_frame(ws, dataset=dataset, episodes=episodes)
    if full.n_episodes < 2:
        raise InputError("tuning needs at least two episodes", field="dataset")
    scoring = withhold_outcomes(full) if cfg.withholds else full
    space = SearchSpace.for_template(t, bounds, fixed, exclude=outcome_readers(t) if cfg.withholds else ())
    labels = outcome_labels(full, cfg.label, cfg.success_threshold)
    if groups is not None:
        if cfg.split_by != "task" or np.asarray(groups).shape != (full.n_episodes,):
            raise InputError(f"groups must give the task of each of the frame's {full.n_episodes} episodes "
                             "(split_by task)", field="groups")
        keys = np.asarray(groups, dtype=object)
    elif cfg.split_by == "task" and loaded is not None:
        keys = task_groups(full, loaded, cfg.group_key)
    else:
        if cfg.group_key is not None:
            raise InputError("group_key reads the imported records; give a dataset or an episodes file "
                             "(or the frame's task groups)", field="group_key")
        keys = split_keys(full, cfg.split_by)
    data_check = check_outcome_data(labels, keys, cfg.split_by) if cfg.objective == "outcome" else None
    held = split_episodes(keys, labels.success, cfg.heldout_fraction, cfg.seed)

    # ------------------------------------------------------------------ component matrix (once)
    # the dataset's task criteria reach the criteria components (docs/criteria.md)
    criteria = episodes_criteria(ws, dataset, loaded) if (dataset is not None and loaded is not None) else None
    ctx = ScoringContext(embedder=workspace_embedder(ws), criteria=criteria)
    cache = ComponentCache.for_workspace(ws, criteria.digest if criteria is not None else "")
    matrix = Pyramid(t).compute_matrix(scoring, ctx=ctx, cache=cache)
    problem = TuningProblem(t, scoring, matrix, space, held, ctx=ctx, label_frame=full)
    if cfg.objective == "outcome":
        assert data_check is not None, "the outcome objective's data are checked above"
        objective: TuningObjective = OutcomeObjective(problem, labels, cfg.metric, groups=keys, n_folds=cfg.cv_folds,
                                                      seed=cfg.seed, penalty=data_check.penalty)
    elif cfg.objective == "preferences":
        assert dataset is not None, "preferences need a dataset (checked above)"
        objective = PreferenceObjective(problem, *preference_pairs(ws, dataset, full))
    else:
        objective = policy_objective(ws, problem, cfg, dataset, episodes)

    base_weights = {k: t.weights()[k] for k in space.weights}
    outcome = objective if isinstance(objective, OutcomeObjective) else None
    warnings = (list(data_check.warnings) if data_check is not None else []) + \
        (outcome.warnings if outcome is not None else [])
    template_fidelity = outcome.held_out_fidelity(t.weights(), {}) if outcome is not None else None
    baseline = {"weights": t.weights(),
                "figures": objective.figures(t.weights(), {}) if cfg.objective != "policy" else None,
                # the template's own weights against its expectations (training split)
                "constraints": problem.constraints.values(problem.trial_state(t.weights(), {}))}
    data_tag = (data_label(dataset, episodes, labels_version(ws, dataset) if dataset is not None else 0)
                if frame is None else f"frame-{full.content_hash[:8]}")
    name = study or default_study_name(ref, cfg, data_tag, space)
    attrs = {
        "config": cfg.to_dict(), "space": space.to_dict(),
        "template": {"name": ref.name, "version": ref.version, "ref": ref.ref, "sha256": ref.sha256,
                     "yaml": ref.yaml},
        "data": {"dataset": dataset, "episodes_file": None if episodes is None else str(Path(episodes).resolve()),
                 "content_hash": full.content_hash, "n_episodes": full.n_episodes, "n_steps": full.n_steps,
                 # the people's labels put over the recorded outcomes (0: none)
                 "labels_version": labels_version(ws, dataset) if dataset is not None else 0},
        "split": {"by": cfg.split_by, "group_key": cfg.group_key, "groups": int(np.unique(keys.astype(str)).size),
                  "train_episodes": int((~held).sum()), "held_out_episodes": int(held.sum()),
                  **(cast("dict[str, Any]", to_jsonable(objective.split_summary()))
                     if isinstance(objective, OutcomeObjective) else {})},
        "baseline": finite(baseline), "metric": _objective_metric(cfg, objective),
        "primary": None if outcome is None else outcome.primary, "warnings": warnings,
        "held_out": None if outcome is None or template_fidelity is None else
        finite(to_jsonable(_held_out_report(outcome, None, None, template_fidelity))),
    }

    # ------------------------------------------------------------------ storage and study
    url = storage if storage is not None else default_storage_url(ws)
    distributed = storage is not None
    rdb = open_storage(url, heartbeat=distributed)
    sampler = make_sampler(cfg, distributed=distributed)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2) if cfg.objective == "policy"
              else optuna.pruners.NopPruner())
    persisted = optuna.create_study(storage=rdb, study_name=name, direction="maximize", load_if_exists=True,
                                    sampler=sampler, pruner=pruner)
    existing = persisted.user_attrs.get(CONFIG_ATTR)
    if existing is None:
        persisted.set_user_attr(CONFIG_ATTR, attrs)
    else:
        _check_same_study(name, existing, attrs)
    record_study(ws, name, storage, attrs, created_by=actor.name)
    if not distributed:
        other = running_worker(ws, name, run_id)
        if other is not None:
            raise ConflictError(f"study {name!r} is being tuned by process {other.pid} on {other.host} "
                                f"(run {other.run}); stop it first, or run several workers on a shared storage "
                                "(--storage)")
    if distributed:
        working, writer = persisted, None
    else:
        working = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner, study_name=name)
        prior = persisted.get_trials(deepcopy=False)
        working.add_trials(prior)
        writer = BatchedTrialWriter(rdb, name)
        if writer.written != len(prior):  # pragma: no cover - a writer between the two reads
            raise ConflictError(f"study {name!r} changed while it was being opened; try again")
    first = len(working.get_trials(deepcopy=False))   # this call's trials start here
    if not first:
        working.enqueue_trial({k: min(max(v, space.weights[k][0]), space.weights[k][1])
                               for k, v in base_weights.items()}, user_attrs={"baseline": True})

    # ------------------------------------------------------------------ optimise
    run = start_run(ws, name, trials, run_id, started_by=actor.name)
    state = _LoopState(flushed_at=time.monotonic(), best=_best_value(working), first=first)

    def flush(study_obj: optuna.Study, in_loop: bool = True) -> None:
        if writer is not None:
            fresh = []
            for tr in study_obj.get_trials(deepcopy=False)[writer.written:]:
                if not tr.state.is_finished():
                    break  # keep the written numbers contiguous
                fresh.append(tr)
            writer.write(fresh)
        best = _best_value(study_obj)
        if heartbeat(ws, run, state.done, best) or state.stop:
            state.stopped = True
            if in_loop:  # Study.stop works only from inside optimize (a callback)
                study_obj.stop()
        state.flushed_at = time.monotonic()

    def after_trial(study_obj: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        state.done += 1
        if progress is not None:
            row = trial_row(frozen)
            if row.feasible and row.value is not None and (state.best is None or row.value > state.best):
                state.best = row.value   # running best: study.best_value is O(trials) per call
            progress({"study": name, "trials_done": state.done, "trials": trials, "best_value": state.best,
                      "trial": row})
        if state.stop or time.monotonic() - state.flushed_at >= flush_seconds:
            flush(study_obj)

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001 - stop politely after this trial
        state.stop = True

    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (a server): no handler, the stop flag still works
        previous = None
    t0, c0 = time.perf_counter(), time.process_time()
    status, error = "finished", None
    run_objective: Callable[[optuna.Trial], float] = objective
    if distributed:
        worker = f"{socket.gethostname()}:{os.getpid()}"

        def run_objective(trial: optuna.Trial) -> float:
            trial.set_user_attr("worker", worker)  # which worker ran it, in the shared study
            return objective(trial)
    try:
        working.optimize(run_objective, n_trials=trials, timeout=timeout, callbacks=[after_trial],
                         gc_after_trial=False, show_progress_bar=False)
    except BaseException as exc:
        status, error = "failed", failure_text(exc)
        raise
    finally:
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        per_min = state.done / seconds * 60 if seconds > 0 else 0.0
        try:
            flush(working, in_loop=False)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if status == "finished" and state.stopped:
                status = "stopped"
            end_run(ws, run, status, done=state.done, best=_best_value(working), per_min=per_min, error=error)

    # ------------------------------------------------------------------ report
    all_trials = working.get_trials(deepcopy=False)
    complete = [tr for tr in all_trials if tr.state == optuna.trial.TrialState.COMPLETE]
    feasible = [tr for tr in complete if all(v <= 0 for v in tr.constraints.values())]
    best: dict[str, Any] | None = None
    best_fidelity: Fidelity | None = None
    if feasible:
        bt = working.best_trial
        weights, params = space.decode(bt.params)
        full_weights = {**t.weights(), **weights}
        if outcome is not None:
            best_fidelity = outcome.held_out_fidelity(full_weights, params)
        best = {"trial": bt.number, "value": bt.value, "held_out_value": bt.user_attrs.get("held_out"),
                "held_out_auc": bt.user_attrs.get("held_out_auc"), "cv_auc": bt.user_attrs.get("cv_auc"),
                "weights": full_weights, "params": params, "constraints": dict(bt.constraints)}
        best["held_out_within"] = bt.user_attrs.get("held_out_within")
        best["cv_within"] = bt.user_attrs.get("cv_within")
        if cfg.objective != "policy":
            best["figures"] = objective.figures(full_weights, params)
            best_t = problem.template_for(full_weights, params)
            best["expectations"] = _expectation_checks(best_t, problem, params)
    held_out_report = None
    if outcome is not None:
        assert template_fidelity is not None, "an outcome study measures the template on its held-out tasks"
        report = _held_out_report(outcome, None if best is None else int(best["trial"]), best_fidelity,
                                  template_fidelity)
        held_out_report = cast("dict[str, Any]", finite(to_jsonable(report)))
        if best is not None:
            # the page reads the best trial's intervals from here (they need the data to compute)
            persisted.set_user_attr(HELD_OUT_ATTR, held_out_report)
    return TuneResult(
        study=name, storage=describe_url(url), objective=cfg.objective, metric=_objective_metric(cfg, objective),
        trials_run=state.done, trials_total=len(all_trials), feasible_trials=len(feasible),
        stopped=state.stopped, seconds=seconds, trials_per_min=per_min, cpu_seconds=cpu_seconds,
        baseline=finite(baseline),
        best=finite(best), skipped_expectations=problem.constraints.skipped, split=attrs["split"],
        recomputed_components=sorted(set(problem.recomputed)), run_id=run,
        warnings=warnings,
        trials=finite([trial_row(tr) for tr in all_trials[state.first:]][-TRIAL_ROWS:]),
        primary=None if outcome is None else outcome.primary, held_out_report=held_out_report)


def _held_out_report(objective: OutcomeObjective, best_trial: int | None, best: Fidelity | None,
                     template: Fidelity) -> HeldOutReport:
    """Both figures of the best trial and of the template on the objective's held-out tasks."""
    return HeldOutReport(metric=objective.primary, tasks=int(np.unique(objective.codes[objective.held]).size),
                         tasks_with_both=objective.held_tasks_with_both, episodes=int(objective.held.size),
                         best_trial=best_trial, best=best, template=template)


@dataclass(frozen=True)
class TrialRow:
    """One trial of a study as the CLI, :class:`TuneResult` and the page list it (:func:`trial_row`)."""

    #: The trial's number in the study
    trial: int
    #: Optuna's state in lower case: "complete", "pruned", "fail", "running", …
    state: str
    #: The objective's training figure (None until complete)
    value: float | None
    #: The objective's held-out figure
    held_out: float | None
    #: Outcome objective: AUC on the outer held-out tasks and mean AUC over the design folds
    held_out_auc: float | None
    cv_auc: float | None
    #: Outcome objective: the small-data pull toward the template's weights
    penalty: float | None
    #: Optuna's parameters of the trial (weights and component parameters)
    params: dict[str, Any]
    #: Complete and satisfying every expectation
    feasible: bool
    #: The template's own weights (the study's first trial)
    baseline: bool
    #: Outcome objective: within-task AUC on the outer held-out tasks and mean within-task AUC over the design folds
    held_out_within: float | None = None
    cv_within: float | None = None


def trial_row(trial: optuna.trial.FrozenTrial) -> TrialRow:
    """One trial as the CLI, the result and the page list it."""
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    attrs = trial.user_attrs
    return TrialRow(trial=trial.number, state=trial.state.name.lower(), value=trial.value,
                    held_out=attrs.get("held_out"), held_out_auc=attrs.get("held_out_auc"),
                    cv_auc=attrs.get("cv_auc"), penalty=attrs.get("penalty"), params=dict(trial.params),
                    feasible=complete and all(v <= 0 for v in trial.constraints.values()),
                    baseline=bool(attrs.get("baseline", False)), held_out_within=attrs.get("held_out_within"),
                    cv_within=attrs.get("cv_within"))


def _expectation_checks(template: Template, problem: TuningProblem,
                        params: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``rwb reward check`` of a template on the train and held-out splits (slow path: the
    reference the compiled constraints are tested against)."""
    if not template.expectations:
        return {}
    state = problem.trial_state(template.weights(), params)
    out = {}
    for side, idx in (("train", problem.train_idx), ("held_out", problem.held_idx)):
        # component values from the full matrix: history-dependent components keep the
        # whole data's context, as while tuning
        sub = problem.pyramid_matrix(template, state.step_values, state.episode_values, idx)
        report = evaluate_expectations(ScoreResult(template, problem.label_frame.take_episodes(idx), sub))
        out[side] = {"passed": report.passed,
                     "results": {r.name: {"passed": r.passed, "message": r.message} for r in report.results}}
    return out


def _check_same_study(name: str, existing: Mapping[str, Any], attrs: Mapping[str, Any]) -> None:
    """Workers (and reruns) of one study must tune the same thing."""
    diffs = []
    if existing["template"]["sha256"] != attrs["template"]["sha256"]:
        diffs.append("the template text")
    if existing["config"] != attrs["config"]:
        keys = sorted(k for k in set(existing["config"]) | set(attrs["config"])
                      if existing["config"].get(k) != attrs["config"].get(k))
        diffs.append("settings " + ", ".join(keys))
    if existing["space"] != attrs["space"]:
        diffs.append("the search space (bounds, fixed weights)")
    if existing["data"]["content_hash"] != attrs["data"]["content_hash"]:
        diffs.append("the episodes or their outcome labels")
    if diffs:
        raise ConflictError(f"study {name!r} already exists with different {'; '.join(diffs)}; give another "
                            "--study name to start a new study")


def _best_value(study: optuna.Study) -> float | None:
    """The feasible best value so far (None before any feasible trial)."""
    try:
        return float(study.best_value)
    except ValueError:
        return None


def make_sampler(cfg: TuneConfig, *, distributed: bool) -> optuna.samplers.BaseSampler:
    """Multivariate TPE (weights interact through the gates), with the constant-liar
    heuristic when several workers share the study; or random search."""
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=cfg.seed)
    # Distributed workers get different seeds: identical seeds would propose identical points.
    seed = cfg.seed if not distributed else (cfg.seed * 1_000_003 + os.getpid()) % 2**31
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=distributed,
                                      n_startup_trials=10)
