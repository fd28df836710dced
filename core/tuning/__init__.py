"""Tuning pyramid weights with Optuna, one idea per module.

The modules cover what a study varies (:mod:`~core.tuning.config`), its labels and split
(:mod:`~core.tuning.labels`), statistics, reweighting, constraints, the per-trial problem,
the objectives, the held-out report (:mod:`~core.tuning.heldout`), preference labels, data,
records, running a study (:mod:`~core.tuning.studies`, :func:`tune`), background workers
(:func:`launch_tuning`, :func:`stop_tuning`), applying the best weights (:func:`apply_study`),
the page's report (:func:`study_report`) and Optuna's storages (:mod:`~core.tuning.storage`).
Callers go through the package, which re-exports every module's public names:
``from core import tuning`` then ``tuning.tune(...)``.

May import: :mod:`core.rl` and everything below it; never :mod:`core.govern`.

Details: docs/tuning.md (## The package's modules).
"""

from core.tuning.apply import (PLAIN_FIGURES, AppliedStudy, ApplyCheck, HeldOutFigure, NoFeasibleTrial,
                               WeightApplication, WorseThanTemplate, apply_check, apply_study, list_applications)
from core.tuning.config import (CV_FOLDS, LABELS, METRICS, MIN_TASKS_WITH_BOTH, OBJECTIVES, OUTCOME_COMPONENTS,
                                POLICY_DEFAULTS, SAMPLERS, SPLIT_FIELDS, ParamRange, SearchSpace, TuneConfig,
                                outcome_readers, parse_bounds)
from core.tuning.constraints import ExpectationConstraints, ScoredTrial
from core.tuning.data import (TemplateRef, default_study_name, load_data, load_episodes_and_frame,
                              resolve_template_ref, withhold_outcomes)
from core.tuning.labels import (COMFORTABLE_LABELLED, COMFORTABLE_PER_CLASS, COMFORTABLE_TASKS, MIN_LABELLED,
                                MIN_PER_CLASS, MIN_TASKS, SMALL_DATA_PENALTY, Labels, OutcomeDataCheck,
                                check_outcome_data, outcome_labels, split_episodes, split_keys, task_groups,
                                with_people_labels)
from core.tuning.heldout import HeldOutReport, primary_figures
from core.tuning.objectives import (OutcomeObjective, OutcomeSplit, PolicyObjective, PreferenceObjective,
                                    TuningObjective, policy_objective)
from core.tuning.preferences import PreferenceLabel, add_preference, list_preferences, preference_pairs
from core.tuning.problem import TuningProblem
from core.tuning.records import (CONFIG_ATTR, RunningWorker, StudyRecord, StudyRun, fail_run, failure_text, get_study,
                                 list_studies, load_study, running_worker, storage_for, study_runs)
from core.tuning.report import (FIGURES, METRIC_CHOICES, StudyCharts, StudyReport, figure_name, space_rows,
                                study_fingerprint, study_report)
from core.tuning.reweighting import Combined, ReturnModel, matrix_layout
from core.tuning.statistics import auc, kendall_tau, outcome_pairs, pair_agreement, soft_auc, task_pairs
from core.tuning.storage import (BatchedTrialWriter, count_trials, default_storage_url, describe_url, driver_url,
                                 migrate_legacy_db, open_journal, open_rdb, open_storage, study_id)
from core.tuning.studies import TrialRow, TuneResult, make_sampler, trial_row, tune
from core.tuning.workers import CLI, LaunchedTuning, launch_tuning, stop_tuning, tuning_log, tuning_refusal

__all__ = [
    "BatchedTrialWriter", "count_trials", "default_storage_url", "describe_url", "driver_url", "migrate_legacy_db",
    "open_journal", "open_rdb", "open_storage", "study_id",
    "AppliedStudy", "ApplyCheck", "CLI", "HeldOutReport", "MIN_TASKS_WITH_BOTH", "WorseThanTemplate",
    "apply_check", "primary_figures", "task_pairs", "with_people_labels",
    "FIGURES", "HeldOutFigure", "METRIC_CHOICES", "PLAIN_FIGURES", "fail_run", "failure_text", "figure_name",
    "tuning_refusal",
    "COMFORTABLE_LABELLED", "COMFORTABLE_PER_CLASS", "COMFORTABLE_TASKS", "CONFIG_ATTR",
    "CV_FOLDS", "Combined", "ExpectationConstraints", "LABELS", "Labels", "LaunchedTuning", "METRICS",
    "MIN_LABELLED", "MIN_PER_CLASS", "MIN_TASKS", "NoFeasibleTrial", "OBJECTIVES", "OUTCOME_COMPONENTS",
    "OutcomeDataCheck", "OutcomeObjective", "OutcomeSplit",
    "POLICY_DEFAULTS", "ParamRange", "PolicyObjective", "PreferenceLabel", "PreferenceObjective", "ReturnModel",
    "RunningWorker", "SAMPLERS", "SMALL_DATA_PENALTY", "SPLIT_FIELDS", "ScoredTrial", "SearchSpace", "StudyCharts",
    "StudyRecord", "StudyReport", "StudyRun", "TemplateRef", "TrialRow", "TuneConfig", "TuneResult",
    "TuningObjective", "TuningProblem", "WeightApplication", "add_preference",
    "apply_study", "auc", "check_outcome_data", "default_study_name", "get_study", "kendall_tau",
    "launch_tuning", "list_applications", "list_preferences", "list_studies", "load_data",
    "load_episodes_and_frame", "load_study", "make_sampler", "outcome_labels", "outcome_pairs",
    "outcome_readers", "pair_agreement", "parse_bounds", "policy_objective", "preference_pairs",
    "resolve_template_ref", "running_worker", "soft_auc", "space_rows", "split_episodes", "split_keys", "stop_tuning",
    "storage_for", "study_fingerprint", "study_report", "study_runs", "task_groups", "trial_row", "tune",
    "tuning_log", "withhold_outcomes",
]
