"""What an outcome study reports on its held-out tasks (the tasks Optuna never sees): the
all-pairs and within-task AUC, each with its 90% interval over tasks, of the best trial and of
the template's own weights side by side (:class:`HeldOutReport`), and the figure a study
answers to (:func:`primary_figures`), which ``tune apply`` compares before it saves weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.rewards.outcomes import Fidelity

#: What each primary figure is called in messages, and the trial attribute and held-out figure key holding it.
PRIMARY: dict[str, tuple[str, str, str]] = {
    "within_task": ("held-out within-task AUC", "held_out_within", "within_task"),
    "all_pairs": ("held-out all-pairs AUC", "held_out_auc", "auc"),
}


@dataclass(frozen=True)
class HeldOutReport:
    """Both ranking figures on the held-out tasks, for the best trial and the template's own weights."""

    #: The study's primary figure: within_task (the default objective) or all_pairs
    metric: str
    #: Held-out tasks with a labelled episode
    tasks: int
    #: Held-out tasks with both a successful and a failed episode (the within-task pairs come from them)
    tasks_with_both: int
    #: Labelled held-out episodes
    episodes: int
    #: The best feasible trial (None before one)
    best_trial: int | None
    #: The best trial's all-pairs and within-task AUC with 90% intervals (None before a feasible trial)
    best: Fidelity | None
    #: The template's own weights on the same tasks
    template: Fidelity


def primary_figures(attrs: Mapping[str, Any], trial_attrs: Mapping[str, Any]
                    ) -> tuple[str, str, float | None, float | None]:
    """(primary key, its name, the trial's held-out figure, the template's) of an outcome study,
    from its stored attributes and one trial's user attributes (studies from before the
    within-task objective answer to the held-out all-pairs AUC)."""
    primary = attrs.get("primary") or "all_pairs"
    label, trial_key, figure_key = PRIMARY[primary]
    held = (((attrs.get("baseline") or {}).get("figures") or {}).get("held_out") or {})
    return primary, label, _number(trial_attrs.get(trial_key)), _number(held.get(figure_key))


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None
