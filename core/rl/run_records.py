"""What the functions of :mod:`core.rl.runs` return: a run's record, its checkpoints, the
outcome of a training, a launch and a stop.

Frozen dataclasses whose fields are the keys the ``--json`` output of ``rwb train`` and
``rwb runs list|show|stop`` has always carried, in the same order (JSON via
:func:`core.base.results.to_jsonable`).  Metrics stay dicts: an update records whatever
metric names its trainer produces (docs/training.md, ## Runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunRecord:
    """One training run as :func:`core.rl.runs.get_run` reads it: the columns of its ``runs``
    row (less the template's and mask rules' YAML text) and the liveness of its trainer."""

    id: str
    #: As recorded: ``running``, ``finished``, ``failed`` or ``stopped``
    status: str
    #: The workspace dataset it trains on (None when it trains on an episodes file)
    dataset: str | None
    #: The episodes file it trains on, as stored: JSON text ``{"path", "sha256"}`` (None for a dataset)
    episodes_file: str | None
    template_name: str
    #: ``@N`` (a workspace version), ``file vX`` (a YAML file) or the template's own version
    template_version: str
    #: sha256 of the template's canonical YAML
    template_hash: str
    #: The mask rules file it trains under (None without mask rules)
    masks_source: str | None
    #: ``cpu``, ``cuda`` or ``auto`` until the trainer resolves it
    device: str
    #: Its training settings (a :class:`core.rl.ppo.PPOConfig` as a dict)
    config: dict[str, Any]
    total_steps: int
    #: Environment steps trained so far
    env_steps: int
    #: Updates recorded so far
    updates: int
    #: Curriculum level of the last recorded update (None before the first)
    curriculum_level: int | None
    #: The trainer process (None before one started)
    pid: int | None
    #: The host of the trainer process
    host: str | None
    #: Whether someone asked it to stop after its current update
    stop_requested: bool
    #: The user who created it
    created_by: str
    #: ISO 8601 UTC times
    created_at: str
    started_at: str | None
    ended_at: str | None
    #: Unix time of the trainer's last sign of life
    heartbeat_at: float | None
    #: Why it failed, or a note on how it ended
    error: str | None
    #: The last update's metrics, once it ended
    final_metrics: dict[str, Any] | None
    #: The background trainer's log file
    log_path: str | None
    #: Whether its trainer process still runs: False once it ended, None when it runs on
    #: another host (it cannot be checked from here)
    process_alive: bool | None
    #: Recorded as running, but its trainer process is gone (killed): resume it
    interrupted: bool
    #: ``status``, or ``interrupted`` when it is
    display_status: str


@dataclass(frozen=True)
class HeadlineMetrics:
    """The figures of a run's last recorded update that a list of runs shows (None where the
    update recorded none, or before the first update)."""

    return_mean: float | None
    success_rate: float | None
    kl: float | None
    beta: float | None
    entropy: float | None
    curriculum_level: int | None
    env_steps_per_s: float | None
    mask_violations: int | None
    #: The best logged behaviour's mean return on the training episodes (what the reward should reach)
    best_logged_return: float | None


@dataclass(frozen=True)
class ListedRun(RunRecord):
    """A run as :func:`core.rl.runs.list_runs` lists it: its record and its last update's figures."""

    last: HeadlineMetrics


@dataclass(frozen=True)
class CheckpointRecord:
    """A complete checkpoint of a run, recorded in ``run_checkpoints``."""

    #: The update after which it was written
    update_idx: int
    #: Environment steps trained by then
    env_steps: int
    #: Its folder (``artifacts/runs/<id>/checkpoints/<update>/``)
    path: str
    #: Unix time it was recorded
    at: float


@dataclass(frozen=True)
class RunResult:
    """What :func:`core.rl.runs.train` returns once the run ends."""

    run_id: str
    #: ``finished`` (its step budget reached) or ``stopped`` (a stop request)
    status: str
    #: The last update's metrics (non-finite numbers as None)
    metrics: dict[str, Any]


@dataclass(frozen=True)
class LaunchedRun:
    """A run :func:`core.rl.runs.launch_run` started in a background process."""

    run_id: str
    #: The background trainer process
    pid: int
    #: Its log file (``artifacts/runs/<id>/train.log``)
    log: str


@dataclass(frozen=True)
class StopResult:
    """What :func:`core.rl.runs.stop_run` did to a running run."""

    #: The run as recorded after the request
    run: RunRecord
    #: True when the run was marked ``stopped`` at once (its trainer process was gone); False
    #: when its trainer stops after the update under way
    stopped_now: bool
