"""Optuna objectives over a :class:`~core.tuning.problem.TuningProblem`, one per study
objective (all maximised):

* :class:`OutcomeObjective` — returns should rank successful episodes above failed ones: the
  statistic (smooth within-task AUC by default, smooth or exact all-pairs AUC, Kendall τ) on
  task-grouped folds of the design tasks, averaged, less a pull toward the template's weights
  on small data; reported on the outer held-out tasks, which nothing is chosen by.
* :class:`PreferenceObjective` — returns should order analyst-labelled episode pairs as the
  analyst did (share of training pairs, ties half).
* :class:`PolicyObjective` — a short PPO run per trial (:func:`core.rl.ppo.train`); the
  success rate of the trained greedy policy, reported to Optuna's pruner after each update.
"""

from __future__ import annotations

import abc
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna

from core.base.errors import InputError
from core.rewards.outcomes import Fidelity, fidelity, grouped_folds, tasks_with_both, within_task_auc
from core.tuning.config import CV_FOLDS, MIN_TASKS_WITH_BOTH, POLICY_DEFAULTS, TuneConfig
from core.tuning.constraints import ScoredTrial
from core.tuning.labels import Labels
from core.tuning.problem import TuningProblem
from core.tuning.statistics import auc, kendall_tau, outcome_pairs, pair_agreement, soft_auc, task_pairs

#: Within-task pairs of one fold (or the held-out side) listed for the exact per-trial figure (one
#: comparison each); beyond it, ranking inside each task is cheaper (also exact).
WITHIN_EXACT_PAIRS = 200_000

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


class TuningObjective(abc.ABC):
    """An Optuna objective over a :class:`TuningProblem` (maximised).

    Contract: ``__call__(trial)`` draws the trial's weights and parameters from the
    problem's space, sets one constraint per compiled expectation
    (``trial.set_constraint``), stores the held-out figure as the user attribute
    ``held_out`` and returns the training figure.  :meth:`figures` gives the full
    train/held-out figures of any weights (for the baseline and the best trial)."""

    name: str = ""
    #: Prune trials that break an expectation before measuring them (worth it when
    #: measuring is expensive; they can never be the best trial anyway).
    skip_infeasible: bool = False

    def __init__(self, problem: TuningProblem):
        self.problem = problem

    def __call__(self, trial: optuna.Trial) -> float:
        weights, params = self.problem.space.suggest(trial)
        state = self.problem.trial_state(weights, params)
        broken = []
        for key, value in self.problem.constraints.values(state).items():
            trial.set_constraint(key, value)
            if value > 0:
                broken.append(key)
        if broken and self.skip_infeasible:
            raise optuna.TrialPruned(f"breaks {', '.join(broken)}: not trained")
        train, held = self.measure(state, trial)
        if train is None:
            raise optuna.TrialPruned("the training split gives no figure for these weights")
        trial.set_user_attr("held_out", held)
        return train

    @abc.abstractmethod
    def measure(self, state: ScoredTrial, trial: optuna.Trial | None) -> tuple[float | None, float | None]:
        """(training figure, held-out figure) of one trial."""

    @abc.abstractmethod
    def figures(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, dict[str, Any]]:
        """``{"train": {...}, "held_out": {...}}`` for the given weights."""


class OutcomeObjective(TuningObjective):
    """Returns should rank successful episodes above failed ones: the statistic averaged over
    task-grouped folds of the design tasks (the problem's training side), less :meth:`penalty`;
    reported on the outer held-out tasks (see the docstring of :mod:`core.tuning.studies` for
    why this design and not a choice by held-out figures).

    The statistic (:attr:`metric`): ``within_task`` (smooth AUC over pairs of a success and a
    failure of the same task, :func:`~core.tuning.statistics.task_pairs`), ``soft_auc`` (smooth,
    all pairs; ``all_pairs`` asks for it), ``auc`` or ``kendall``.  ``within_task`` falls back to
    all pairs, with a line in :attr:`warnings`, when fewer than
    :data:`~core.tuning.config.MIN_TASKS_WITH_BOTH` design tasks (or fewer than two folds) hold
    both outcomes.  :attr:`primary` names the held-out figure the study answers to:
    ``within_task`` or ``all_pairs`` (the exact AUCs).

    Each trial records the user attributes ``held_out`` (the statistic on the held-out tasks),
    ``held_out_auc`` and ``held_out_within`` (exact all-pairs and within-task AUC on the
    held-out tasks), ``cv`` (the mean over folds, before the penalty), ``cv_auc``,
    ``cv_auc_folds``, ``cv_within`` (mean fold within-task AUC) and ``penalty``.  Folds that
    cannot rank anything under the statistic are left out (:attr:`folds` holds the others).
    Every per-trial figure is numpy over the trial's per-episode returns and index pairs fixed
    here, once."""

    name = "outcome"

    def __init__(self, problem: TuningProblem, labels: Labels, metric: str = "within_task", *,
                 groups: np.ndarray, n_folds: int = CV_FOLDS, seed: int = 0, penalty: float = 0.0):
        super().__init__(problem)
        self.labels, self.penalty_weight = labels, float(penalty)
        #: the metric the study asked for (its config) and what this objective measures
        self.requested = metric
        #: what the analyst should know about the objective (a fallback to all pairs, …)
        self.warnings: list[str] = []
        known = labels.known
        self.train = problem.train_idx[known[problem.train_idx]]
        self.held = problem.held_idx[known[problem.held_idx]]
        for side, idx in (("design (training)", self.train), ("held-out", self.held)):
            s = labels.success[idx]
            if idx.size == 0 or s.min() == s.max():
                raise InputError(f"the {side} split needs episodes with a known outcome of both kinds "
                                 f"(it has {int((s == 1).sum())} successful and {int((s == 0).sum())} "
                                 "failed); import outcomes (--reward-key), choose another label, split_by "
                                 "or held-out fraction", field="split_by")
        y = labels.success
        #: one integer task code per episode (the split's groups)
        self.codes = np.unique(np.asarray(groups).astype(str), return_inverse=True)[1].astype(np.int64)
        codes = self.codes
        dealt = [self.train[rows] for rows in grouped_folds(groups[self.train], n_folds, seed=seed)]
        #: the design folds (episode indices)
        self.dealt = dealt
        #: design and held-out tasks with both outcomes
        self.design_tasks_with_both = tasks_with_both(y[self.train], codes[self.train])
        self.held_tasks_with_both = tasks_with_both(y[self.held], codes[self.held])
        metric = "soft_auc" if metric == "all_pairs" else metric
        if metric == "within_task":
            paired = [f for f in dealt if tasks_with_both(y[f], codes[f]) > 0]
            if self.design_tasks_with_both < MIN_TASKS_WITH_BOTH or len(paired) < 2:
                n_design = int(np.unique(codes[self.train]).size)
                self.warnings.append(
                    f"only {self.design_tasks_with_both} of the {n_design} design tasks have both a successful "
                    f"and a failed episode (in {len(paired)} of {len(dealt)} folds); the within-task objective "
                    f"needs {MIN_TASKS_WITH_BOTH} in at least 2 folds, so this study ranks all pairs instead "
                    "(metric all_pairs). Label more runs of the same tasks to tune within tasks")
                metric = "soft_auc"
        #: the statistic measured: within_task, soft_auc, auc or kendall
        self.metric = metric
        #: the held-out figure the study answers to (exact AUC): within_task or all_pairs
        self.primary = "within_task" if metric == "within_task" else "all_pairs"
        if self.primary == "within_task":
            self.folds = [f for f in dealt if tasks_with_both(y[f], codes[f]) > 0]
        else:
            self.folds = [f for f in dealt if 0 < y[f].sum() < f.size]
        if len(self.folds) < 2:
            raise InputError(f"only {len(self.folds)} of the {len(dealt)} task-grouped folds of the design "
                             "episodes hold both outcomes; use fewer folds (--folds) or a smaller held-out "
                             "fraction", field="cv_folds")
        if self.primary == "within_task" and self.held_tasks_with_both == 0:
            self.warnings.append("no held-out task has both a successful and a failed episode: the held-out "
                                 "within-task AUC, which this study answers to, is undefined there; hold out "
                                 "more tasks (--heldout) or label more runs of the same tasks")
        self.groups = groups
        # fixed (success, failure) pairs of each fold and of the held-out side (positions within it):
        # those the statistic averages over, and every within-task pair (for the exact figure)
        self.fold_pairs = [task_pairs(y[f], codes[f]) if metric == "within_task" else outcome_pairs(y[f])
                           for f in self.folds]
        self.held_pairs = outcome_pairs(y[self.held])
        self.held_task_pairs = task_pairs(y[self.held], codes[self.held])
        self._exact_within = [self._within_pairs(f) for f in self.folds]
        self._exact_held_within = self._within_pairs(self.held)
        space = problem.space
        self.tuned = [k for k, (lo, hi) in space.weights.items() if hi > lo]
        base = problem.template.weights()
        self.anchor = np.array([min(max(base[k], space.weights[k][0]), space.weights[k][1]) for k in self.tuned])
        self.span = np.array([space.weights[k][1] - space.weights[k][0] for k in self.tuned])
        names = problem.model.step_names + problem.model.episode_names
        self._position = np.array([names.index(k) for k in self.tuned], dtype=np.int64)

    def _within_pairs(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Every within-task pair of ``idx`` (positions within it), or None when there are more
        than :data:`WITHIN_EXACT_PAIRS` (the exact figure then ranks inside each task instead)."""
        y, codes = self.labels.success[idx], self.codes[idx]
        pairs = task_pairs(y, codes, limit=WITHIN_EXACT_PAIRS + 1)
        return None if pairs[0].size > WITHIN_EXACT_PAIRS else pairs

    def within(self, returns: np.ndarray, idx: np.ndarray, pairs: tuple[np.ndarray, np.ndarray] | None
               ) -> float | None:
        """Exact within-task AUC of ``returns`` on the episodes ``idx`` (None without a pair):
        the share of its within-task pairs ordered right, ties half
        (:func:`core.rewards.outcomes.within_task_auc`)."""
        if pairs is not None:
            return pair_agreement(returns[idx], *pairs)
        value = within_task_auc(returns[idx], self.labels.success[idx], self.codes[idx])
        return None if math.isnan(value) else value

    def penalty(self, state: ScoredTrial) -> float:
        """:data:`~core.tuning.labels.SMALL_DATA_PENALTY`-style pull: weight × mean over the tuned weights of
        ((w − w_template) / (high − low))² (0 when the data is comfortable)."""
        if self.penalty_weight == 0.0 or not self.tuned:
            return 0.0
        w = np.concatenate([state.w_step, state.w_episode])[self._position]
        return float(self.penalty_weight * np.mean(((w - self.anchor) / self.span) ** 2))

    def _stat(self, returns: np.ndarray, idx: np.ndarray, pairs: tuple[np.ndarray, np.ndarray],
              metric: str) -> float | None:
        if metric in ("soft_auc", "within_task"):
            return soft_auc(returns[idx], *pairs)
        if metric == "auc":
            return auc(returns[idx], self.labels.success[idx])
        return kendall_tau(returns[idx], self.labels.value[idx])

    def _cv(self, returns: np.ndarray, metric: str) -> tuple[float | None, list[float | None]]:
        if metric == "within_exact":
            per_fold = [self.within(returns, f, p) for f, p in zip(self.folds, self._exact_within)]
        elif metric == "soft_auc" and self.metric == "within_task":
            # the all-pairs smooth AUC of a within-task study: its own pairs
            per_fold = [soft_auc(returns[f], *outcome_pairs(self.labels.success[f])) for f in self.folds]
        else:
            per_fold = [self._stat(returns, f, p, metric) for f, p in zip(self.folds, self.fold_pairs)]
        values = [v for v in per_fold if v is not None]
        return (float(np.mean(values)) if values else None), per_fold

    def measure(self, state: ScoredTrial, trial: optuna.Trial | None) -> tuple[float | None, float | None]:
        r = state.combined.returns
        cv, _ = self._cv(r, self.metric)
        held_pairs = self.held_task_pairs if self.metric == "within_task" else self.held_pairs
        held = self._stat(r, self.held, held_pairs, self.metric)
        penalty = self.penalty(state)
        if trial is not None:
            cv_auc, folds = self._cv(r, "auc")
            trial.set_user_attr("cv", cv)
            trial.set_user_attr("cv_auc", cv_auc)
            trial.set_user_attr("cv_auc_folds", folds)
            trial.set_user_attr("cv_within", self._cv(r, "within_exact")[0])
            trial.set_user_attr("held_out_auc", auc(r[self.held], self.labels.success[self.held]))
            trial.set_user_attr("held_out_within", self.within(r, self.held, self._exact_held_within))
            trial.set_user_attr("penalty", penalty)
        return (None if cv is None else cv - penalty), held

    def figures(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, dict[str, Any]]:
        state = self.problem.trial_state(weights, params)
        r = state.combined.returns
        y = self.labels.success
        cv_auc, auc_folds = self._cv(r, "auc")
        within, within_folds = self._cv(r, "within_exact")
        train = {"auc": cv_auc, "soft_auc": self._cv(r, "soft_auc")[0], "kendall_tau": self._cv(r, "kendall")[0],
                 "auc_folds": auc_folds, "folds": len(self.folds), "penalty": self.penalty(state),
                 "episodes": int(self.train.size), "successes": int(y[self.train].sum()),
                 "within_task": within, "within_task_folds": within_folds,
                 "tasks_with_both": self.design_tasks_with_both}
        if self.metric == "within_task":
            train["soft_within_task"] = self._cv(r, "within_task")[0]
        held = {"auc": auc(r[self.held], y[self.held]), "soft_auc": soft_auc(r[self.held], *self.held_pairs),
                "kendall_tau": kendall_tau(r[self.held], self.labels.value[self.held]),
                "episodes": int(self.held.size), "successes": int(y[self.held].sum()),
                "within_task": self.within(r, self.held, self._exact_held_within),
                "tasks_with_both": self.held_tasks_with_both}
        if self.metric == "within_task":
            held["soft_within_task"] = soft_auc(r[self.held], *self.held_task_pairs)
        return {"train": train, "held_out": held}

    def held_out_fidelity(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]],
                          *, n_boot: int = 200, seed: int = 0) -> Fidelity:
        """All-pairs and within-task AUC of these weights on the held-out tasks, each with its 90%
        interval over resampled tasks (:func:`core.rewards.outcomes.fidelity`)."""
        r = self.problem.trial_state(weights, params).combined.returns
        return fidelity(r[self.held], self.labels.success[self.held], self.codes[self.held], n_boot=n_boot,
                        seed=seed)

    def split_summary(self) -> "OutcomeSplit":
        """Which tasks (groups) lie where: the held-out ones and those of each design fold."""
        def names(idx: np.ndarray) -> list[str]:
            return sorted({str(g) for g in self.groups[idx].tolist()})
        used = {id(f) for f in self.folds}
        return OutcomeSplit(held_out_groups=names(self.problem.held_idx),
                            design_folds=[names(f) for f in self.dealt], folds_used=len(self.folds),
                            unused_folds=[i for i, f in enumerate(self.dealt) if id(f) not in used],
                            labelled_design_episodes=int(self.train.size),
                            labelled_held_out_episodes=int(self.held.size))


@dataclass(frozen=True)
class OutcomeSplit:
    """Where the outcome objective's tasks lie (:meth:`OutcomeObjective.split_summary`); a
    study records it in its ``split`` attributes."""

    #: Tasks (groups) of the outer held-out side, in name order.
    held_out_groups: list[str]
    #: Tasks of each task-grouped design fold, in name order.
    design_folds: list[list[str]]
    #: Design folds that hold both outcomes (the cross-validation uses only these).
    folds_used: int
    #: Positions in ``design_folds`` of the folds left out for holding one outcome only.
    unused_folds: list[int]
    #: Episodes with a known outcome on the design (training) side and on the held-out side.
    labelled_design_episodes: int
    labelled_held_out_episodes: int


class PreferenceObjective(TuningObjective):
    """Returns should order each analyst-labelled pair as the analyst did."""

    name = "preferences"

    def __init__(self, problem: TuningProblem, better: np.ndarray, worse: np.ndarray):
        super().__init__(problem)
        held = problem.held_out[better]  # a pair goes with its preferred episode's group
        self.train = (better[~held], worse[~held])
        self.held = (better[held], worse[held])
        if self.train[0].size == 0:
            raise InputError("no preference pair falls in the training split; add more pairs or "
                             "change split_by / the held-out fraction", field="preferences")

    def measure(self, state: ScoredTrial, trial: optuna.Trial | None) -> tuple[float | None, float | None]:
        r = state.combined.returns
        return pair_agreement(r, *self.train), pair_agreement(r, *self.held)

    def figures(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, dict[str, Any]]:
        r = self.problem.trial_state(weights, params).combined.returns
        return {side: {"agreement": pair_agreement(r, *pairs), "pairs": int(pairs[0].size)}
                for side, pairs in (("train", self.train), ("held_out", self.held))}


class PolicyObjective(TuningObjective):
    """A short PPO run per trial: success rate of the trained greedy policy.

    Each update reports the rollout success rate (``trial.report``) so the pruner can stop
    the run; review requests of the curriculum's L3 are not enqueued from tuning runs."""

    name = "policy"
    skip_infeasible = True

    def __init__(self, problem: TuningProblem, training_data: Any, cfg: Any):
        import torch  # PyTorch takes seconds to import: only for policy studies

        super().__init__(problem)
        tables = training_data.tables
        if [str(x) for x in problem.frame.episode_ids.tolist()] != list(tables.episode_ids):
            raise InputError("the simulator lists the episodes in another order than the reward frame; "
                             "rebuild the dataset's state features", field="dataset")
        self.base, self.cfg = training_data, cfg
        self.train = torch.as_tensor(problem.train_idx, dtype=torch.int64)
        self.held = torch.as_tensor(problem.held_idx, dtype=torch.int64)

    def _tables(self, state: ScoredTrial) -> Any:
        import torch  # PyTorch takes seconds to import: only for policy studies

        tb = self.base.tables
        contrib = self.problem.model.contributions(state.combined, state.w_step, state.step_values)
        tensors = dict(tb.tensors)
        tensors.update({
            "step_reward": torch.as_tensor(state.combined.step_reward, dtype=torch.float32),
            "step_reward64": torch.as_tensor(state.combined.step_reward, dtype=torch.float64),
            "components": torch.as_tensor(np.ascontiguousarray(contrib.T), dtype=torch.float32),
            "final": torch.as_tensor(state.combined.final, dtype=torch.float64),
            "episode_return": torch.as_tensor(state.combined.returns, dtype=torch.float64)})
        return replace(tb, tensors={k: v.to(tb.device) for k, v in tensors.items()})

    def _train(self, state: ScoredTrial, trial: optuna.Trial | None) -> tuple[Any, Any]:
        from core.rl import ppo  # imports PyTorch: only for policy studies
        from core.rl.sim import logged_returns  # imports PyTorch: only for policy studies

        tables = self._tables(state)
        data = ppo.TrainingData(tables=tables, train_episodes=self.train, heldout_episodes=self.held,
                                logged_returns=logged_returns(tables, self.train), approved=self.base.approved,
                                dataset=self.base.dataset, source=self.base.source)
        with tempfile.TemporaryDirectory(prefix="rwb-tune-ppo-") as tmp:
            recorder = ScoredTrialRecorder(trial, Path(tmp))
            result = ppo.train(self.cfg, data, recorder=recorder)
        if recorder.pruned:
            raise optuna.TrialPruned(f"pruned after update {recorder.last_step}")
        return result.agent, tables

    def _success(self, tables: Any, agent: Any, episodes: Any) -> float | None:
        from core.rl.rollouts import episode_stats  # imports PyTorch: only for policy studies

        if episodes.numel() == 0:
            return None
        stats = episode_stats(tables, agent, episodes, every_episode=True, seed=self.cfg.seed,
                              device=agent_device(agent))
        value = stats.success_rate
        return None if value is None or not math.isfinite(value) else float(value)

    def measure(self, state: ScoredTrial, trial: optuna.Trial | None) -> tuple[float | None, float | None]:
        agent, tables = self._train(state, trial)
        return self._success(tables, agent, self.train), self._success(tables, agent, self.held)

    def figures(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, dict[str, Any]]:
        agent, tables = self._train(self.problem.trial_state(weights, params), None)
        return {"train": {"success_rate": self._success(tables, agent, self.train)},
                "held_out": {"success_rate": self._success(tables, agent, self.held)}}


def agent_device(agent: Any) -> Any:
    """The device an agent's parameters live on."""
    return next(agent.parameters()).device


@dataclass
class ScoredTrialRecorder:
    """core.rl.ppo's Recorder for one tuning trial: reports, prunes, keeps no checkpoint."""

    trial: optuna.Trial | None
    folder: Path
    run_id: str = "tuning"
    pruned: bool = False
    last_step: int = 0

    def on_update(self, update_idx: int, env_steps: int, metrics: Mapping[str, Any]) -> bool:
        self.last_step = update_idx
        value = metrics.get("success_rate")
        if self.trial is None or value is None or not math.isfinite(float(value)):
            return False
        self.trial.report(float(value), update_idx)
        if self.trial.should_prune():
            self.pruned = True
            return True
        return False

    def checkpoint_dir(self, update_idx: int) -> Path:
        return self.folder / f"{update_idx:06d}"

    def on_checkpoint(self, update_idx: int, env_steps: int, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)  # a trial's policy is not kept

    def on_review(self, requests: Sequence[Any]) -> int:
        return 0


def policy_objective(ws: "Workspace", problem: TuningProblem, cfg: TuneConfig, dataset: str | None,
                     episodes: str | Path | None) -> PolicyObjective:
    """The policy objective of a study: PPO settings :data:`~core.tuning.config.POLICY_DEFAULTS`
    under the study's own, on the simulator of ``dataset`` (or the ``episodes`` file)."""
    from core.rl import ppo  # imports PyTorch: only for policy studies
    from core.rl.loading import load_training_data  # imports PyTorch: only for policy studies

    settings = {**POLICY_DEFAULTS, **dict(cfg.policy)}
    ppo_cfg = ppo.PPOConfig.from_dict(settings).validate()
    data = load_training_data(ws, problem.template, dataset=dataset, episodes_file=episodes, config=ppo_cfg)
    return PolicyObjective(problem, data, ppo_cfg)
