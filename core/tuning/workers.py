"""Studies as background workers: :func:`launch_tuning` starts ``rwb tune`` as a detached
process that outlives the page (and the app) that started it, after :func:`tuning_refusal`
found nothing that refuses the data at once; :func:`stop_tuning` asks the workers of a study
to stop after their current trial, :func:`tuning_log` reads a worker's log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.access.users import Actor, authorize
from core.base.errors import ConflictError, InputError
from core.base.package_data import import_root
from core.tuning.config import CV_FOLDS, SearchSpace, TuneConfig, outcome_readers
from core.tuning.data import data_label, default_study_name, resolve_template_ref
from core.tuning.labels import MIN_LABELLED
from core.tuning.preferences import list_preferences
from core.tuning.records import StudyRecord, end_run, get_study, now_iso, running_worker, stored_url, study_runs

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: The ``rwb`` command as a child process of this interpreter (works without the console script).
CLI: tuple[str, ...] = (sys.executable, "-c", "from core.cli import console; console()")


def stop_tuning(ws: "Workspace", actor: Actor, name: str) -> StudyRecord:
    """Ask the running workers of a study (started from this workspace) to stop after their
    current trial; a run whose process is gone is marked stopped at once.  Returns the study's
    record after the request.  Needs ``train``."""
    authorize(ws, actor, "train")
    runs = [r for r in study_runs(ws, name) if r.status in ("starting", "running")]
    if not runs:
        record = get_study(ws, name)
        raise ConflictError(f"study {name!r} has no running worker: it is {record.status}"
                            + (f" ({record.cause})" if record.cause else ""))
    with ws.transaction() as conn:
        for r in runs:
            conn.execute("UPDATE tuning_runs SET stop_requested=1 WHERE id=?", (r.id,))
    for r in runs:
        if r.process_alive is False:
            end_run(ws, r.id, "stopped", done=r.trials_done, best=r.best_value,
                    error="stopped while no worker process was running")
    return get_study(ws, name)


def tuning_refusal(ws: "Workspace", dataset: str, objective: str = "outcome") -> str | None:
    """Why a study of ``objective`` on ``dataset`` would be refused as soon as its worker reads
    the data, in one sentence; None when nothing cheap to check refuses it (the worker checks
    the rest, and a failure is recorded with its cause).  Reads the dataset's counts only."""
    info = next((d for d in ws.datasets(include_archived=True) if d.name == dataset), None)
    if info is None:
        return f"there is no dataset {dataset!r} in this workspace"
    if info.n_episodes < 2:
        return (f"tuning needs at least two episodes: {dataset} has {info.n_episodes}. Import more episodes "
                "into it, or pick a larger dataset")
    if objective == "outcome" and info.n_episodes < MIN_LABELLED:
        return (f"tuning towards outcomes needs at least {MIN_LABELLED} episodes with a known outcome: "
                f"{dataset} has {info.n_episodes} episodes. Import more, or tune on preference labels")
    if objective == "preferences" and not list_preferences(ws, dataset):
        return (f"the preferences objective needs preference labels and {dataset} has none yet: add some "
                "(this episode is better than that one) first")
    return None


@dataclass(frozen=True)
class LaunchedTuning:
    """A study's background worker as :func:`launch_tuning` started it."""

    #: The study's name, settled before the worker starts
    study: str
    #: The worker's tuning run (``tuning_runs.id``; ``rwb tune … --run-id``)
    run_id: int
    #: The worker's process id
    pid: int
    #: The worker's log file (``artifacts/tuning/logs/``)
    log: str


def launch_tuning(ws: "Workspace", actor: Actor, template: str, *, dataset: str | None = None,
                  episodes: str | Path | None = None, config: TuneConfig | None = None, trials: int = 200,
                  storage: str | None = None, study: str | None = None,
                  bounds: Mapping[str, Any] | None = None, fixed: Sequence[str] = ()) -> LaunchedTuning:
    """Start :func:`~core.tuning.studies.tune` as a detached background process (``rwb tune … --run-id N``).

    It has its own session, so it survives the page that launched it (and the app); its
    output goes to ``artifacts/tuning/logs/``.  The study name is settled here, so the
    page can watch it at once.  Data that cannot be tuned (:func:`tuning_refusal`: one episode,
    too few for the outcome objective, no preference labels) is refused before any worker
    starts.  Needs ``train``."""
    authorize(ws, actor, "train")
    cfg = (config or TuneConfig()).validate()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"trials must be a whole number ≥ 1, got {trials!r}", field="trials")
    ref = resolve_template_ref(ws, template)
    if (dataset is None) == (episodes is None):
        raise InputError("give exactly one of a dataset or an episodes file", field="dataset")
    if dataset is not None:
        ws.require_dataset(dataset)
        refusal = tuning_refusal(ws, dataset, cfg.objective)
        if refusal is not None:  # refused here, at once, rather than by a worker a moment later
            raise InputError(f"not started: {refusal}", field="dataset")
    space = SearchSpace.for_template(ref.template, bounds, fixed,
                                     exclude=outcome_readers(ref.template) if cfg.withholds else ())
    name = study or default_study_name(ref, cfg, data_label(dataset, episodes), space)
    logs = ws.artifact_dir("tuning", "logs")
    log_path = logs / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    with ws.transaction() as conn:
        # checked in the write transaction that adds the worker, so two launches cannot both pass
        other = running_worker(ws, name, None) if storage is None else None
        if other is not None:
            process = "not started yet" if other.pid is None else f"process {other.pid}"
            raise ConflictError(f"study {name!r} is already running (tuning run {other.run}, {process}): "
                                "watch it or stop it first, or give another study name to start a new one")
        # the study row exists before the worker starts, so lists show it at once
        conn.execute(
            "INSERT OR IGNORE INTO tuning_studies(name, storage, objective, template_name, template_version, "
            "template_sha256, dataset, episodes_file, config, created_by, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (name, stored_url(storage), cfg.objective, ref.name, ref.version, ref.sha256, dataset,
             None if episodes is None else str(Path(episodes).resolve()), json.dumps(cfg.to_dict(), sort_keys=True),
             actor.name, now_iso()))
        cur = conn.execute(
            "INSERT INTO tuning_runs(study, status, trials_requested, log_path, started_by, started_at) "
            "VALUES (?, 'starting', ?, ?, ?, ?)", (name, trials, str(log_path), actor.name, now_iso()))
        assert cur.lastrowid is not None  # an INSERT sets it
        run_id = int(cur.lastrowid)
    cmd = [*CLI, "--workspace", str(ws.root), "tune", "--template", ref.ref,
           "--objective", cfg.objective, "--split-by", cfg.split_by, "--heldout", str(cfg.heldout_fraction),
           "--label", cfg.label, "--threshold", str(cfg.success_threshold), "--metric", cfg.metric,
           "--seed", str(cfg.seed), "--sampler", cfg.sampler, "--trials", str(trials), "--study", name,
           "--run-id", str(run_id), "--json"]
    if dataset is not None:
        cmd += ["--dataset", dataset]
    elif episodes is not None:  # exactly one of the two is given (checked above)
        cmd += ["--episodes", str(Path(episodes).resolve())]
    if cfg.withhold_outcome is not None:
        cmd.append("--withhold-outcome" if cfg.withhold_outcome else "--show-outcome")
    if cfg.group_key is not None:
        cmd += ["--group-key", cfg.group_key]
    if cfg.cv_folds != CV_FOLDS:
        cmd += ["--folds", str(cfg.cv_folds)]
    for key, value in (bounds or {}).items():
        text = value if isinstance(value, str) else (
            ",".join(map(str, value)) if not (isinstance(value, (list, tuple)) and len(value) == 2 and
                                              all(isinstance(v, (int, float)) for v in value))
            else f"{value[0]}:{value[1]}")
        cmd += ["--bound", f"{key}={text}"]
    for name_fixed in fixed:
        cmd += ["--fix", name_fixed]
    if cfg.policy:
        cmd += ["--policy-config", json.dumps(dict(cfg.policy))]
    root = import_root()  # the folder that holds the core package, for an uninstalled checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    if storage is not None:
        env["RWB_TUNE_STORAGE"] = storage  # not on the command line: it may carry a password
    else:
        env.pop("RWB_TUNE_STORAGE", None)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=str(ws.root), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET pid=?, host=? WHERE id=?", (proc.pid, socket.gethostname(), run_id))
    return LaunchedTuning(study=name, run_id=run_id, pid=proc.pid, log=str(log_path))


def tuning_log(ws: "Workspace", name: str, tail: int = 4000) -> str:
    """The end of the latest background run's log of a study (empty when none)."""
    logs = [r.log_path for r in study_runs(ws, name) if r.log_path]
    if not logs or not Path(logs[-1]).is_file():
        return ""
    return Path(logs[-1]).read_bytes()[-tail:].decode("utf-8", errors="replace")
