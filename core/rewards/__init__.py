"""The reward pyramid (docs/design.md §5): components, templates, scoring, expectations.

* :mod:`~core.rewards.frame` — the steps frame (all steps as numpy columns);
* :mod:`~core.rewards.components` — registered components, one small class each;
* :mod:`~core.rewards.template` — YAML templates, validated with line numbers;
* :mod:`~core.rewards.pyramid` — component matrix, gating, returns, explanations;
* :mod:`~core.rewards.cache` — component columns cached in the workspace;
* :mod:`~core.rewards.expectations` — reward unit tests and hacking probes;
* :mod:`~core.rewards.outcomes`, :mod:`~core.rewards.calibration`, :mod:`~core.rewards.learned`
  — recorded outcomes: grouped statistics, calibration, the learned outcome term;
* :mod:`~core.rewards.agent_signals` — domain-free success signals of tool-using agents;
* :mod:`~core.rewards.criteria` — components that use a task's own success criteria;
* :mod:`~core.rewards.api` — :func:`validate`, :func:`score`, :func:`reweight`,
  :func:`check`: the functions behind ``rwb reward`` and the Reward Pyramid page;
* :mod:`~core.rewards.trajectory`, :mod:`~core.rewards.markup`, :mod:`~core.rewards.export` — the
  reward outside the workbench: chat trajectories scored by a pinned template, tool-call markup
  in decoded text, adapters for TRL, verifiers, verl and OpenRLHF (docs/export.md).

Details: docs/rewards.md.  May import: :mod:`core.data`, :mod:`core.access`, :mod:`core.records`, :mod:`core.base`.
"""

from core.rewards.api import (LevelDescription, ValidationReport, as_template, check, frame_from_episodes,
                              frame_from_file, load_frame, reweight, score, validate)
from core.rewards.cache import ComponentCache
from core.rewards.components import (COMPONENTS, LEVEL_TITLES, LEVELS, Component, ComponentDescription,
                                     ScoringContext, available_components, register)
from core.rewards.expectations import CheckReport, ExpectationResult, evaluate_expectations
from core.rewards.frame import StepsFrame, build_frame
from core.rewards.agent_signals import AnswerConsistency, UnrecoveredErrors, WriteActions
from core.rewards.criteria import (CallBudget, CommunicatedInfo, EpisodeCriteria, ExpectedCalls, UnexpectedWrites,
                                   criteria_features)
from core.rewards.learned import LearnedOutcome
from core.rewards.pyramid import ComponentMatrix, Pyramid, ScoreResult, ScoreSummary, StepContribution
from core.rewards.trajectory import (Trajectory, TrajectoryScore, TrajectoryScorer, episode_messages,
                                     score_trajectories, score_trajectory)
from core.rewards.template import (ComponentSpec, ExpectationSpec, LevelSpec, Template, TemplateError,
                                   list_templates, load_template, parse_template, templates_dir)

__all__ = [
    "AnswerConsistency", "COMPONENTS", "CallBudget", "CommunicatedInfo", "EpisodeCriteria", "ExpectedCalls",
    "UnexpectedWrites", "criteria_features", "LEVELS", "LEVEL_TITLES", "CheckReport", "Component", "ComponentCache",
    "ComponentDescription", "ComponentMatrix", "ComponentSpec", "ExpectationResult", "ExpectationSpec",
    "LearnedOutcome", "LevelDescription", "LevelSpec", "Pyramid", "ScoreResult", "ScoreSummary", "ScoringContext",
    "StepContribution", "ValidationReport", "StepsFrame", "Template", "TemplateError", "Trajectory", "TrajectoryScore",
    "TrajectoryScorer", "UnrecoveredErrors", "WriteActions", "episode_messages", "score_trajectories", "score_trajectory",
    "as_template", "available_components", "build_frame", "check", "evaluate_expectations",
    "frame_from_episodes", "frame_from_file", "list_templates", "load_frame", "load_template",
    "parse_template", "register", "reweight", "score", "templates_dir", "validate",
]
