"""The workspace's records of tuning: the studies started from it (``tuning_studies``), the
worker runs that tuned them (``tuning_runs``: progress, heartbeat, stop requests), and the
Optuna study each record names (:func:`load_study`, in its recorded storage)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna

from core.base.errors import InputError, RwbError
from core.rl.runs import process_alive
from core.tuning.storage import default_storage_url, describe_url, open_storage, study_id

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Study user attribute holding the configuration every worker and `apply` reads.
CONFIG_ATTR = "rwb"
#: Study user attribute holding the latest held-out report of an outcome study's best trial
#: (:class:`~core.tuning.heldout.HeldOutReport` as JSON; written at the end of each run).
HELD_OUT_ATTR = "rwb_held_out"
#: Seconds a launched worker may sit without a recorded process and still count as running.
LAUNCH_GRACE_S = 60


def now_iso() -> str:
    """The time now as the workspace records it (UTC, ISO 8601, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def finite(x: Any) -> Any:
    """A result made JSON-safe: non-finite floats become None, numpy scalars Python numbers
    (recursively through dicts, lists, tuples and the fields of dataclasses)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: finite(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, np.generic):
        return finite(x.item())
    return x


def stored_url(url: str | None) -> str | None:
    """What the workspace keeps of a storage URL: nothing for the default, the URL with any
    password masked otherwise (secrets stay out of the workspace database)."""
    return None if url is None else describe_url(url)


def record_study(ws: "Workspace", name: str, storage: str | None, attrs: Mapping[str, Any], *,
                 created_by: str) -> None:
    """Add study ``name`` (its settings ``attrs``, as stored with the Optuna study) to the
    workspace's list, unless it is there already."""
    with ws.transaction() as conn:
        conn.execute(
            "INSERT OR IGNORE INTO tuning_studies(name, storage, objective, template_name, template_version, "
            "template_sha256, dataset, episodes_file, config, created_by, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (name, stored_url(storage), attrs["config"]["objective"], attrs["template"]["name"],
             attrs["template"]["version"], attrs["template"]["sha256"], attrs["data"]["dataset"],
             attrs["data"]["episodes_file"], json.dumps(attrs["config"], sort_keys=True), created_by, now_iso()))


@dataclass(frozen=True)
class RunningWorker:
    """A worker run that tunes a study now (:func:`running_worker`)."""

    #: The worker run's id (``tuning_runs``)
    run: int
    #: Its process id; None while it is launched and its process not recorded yet
    pid: int | None
    host: str | None


def running_worker(ws: "Workspace", name: str, exclude_run: int | None) -> RunningWorker | None:
    """The worker run that tunes study ``name`` on the workspace's storage now:
    its process alive (or on another host), or launched under :data:`LAUNCH_GRACE_S` ago and its
    process not recorded yet.  None when there is none."""
    recent = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - LAUNCH_GRACE_S))
    for row in ws.conn.execute(
            "SELECT r.id, r.pid, r.host, r.status, r.started_at FROM tuning_runs r JOIN tuning_studies s "
            "ON s.name = r.study WHERE r.study=? AND r.status IN ('starting','running') AND s.storage IS NULL",
            (name,)):
        if row[0] == exclude_run or (row[1] is not None and row[1] == os.getpid()):
            continue
        queued = row[1] is None and row[3] == "starting" and (row[4] or "") >= recent
        if queued or (row[1] is not None and process_alive(row[1], row[2]) is not False):
            return RunningWorker(run=row[0], pid=row[1], host=row[2])
    return None


def start_run(ws: "Workspace", study: str, trials: int, run_id: int | None, *, started_by: str) -> int:
    """Record this process as a worker run of ``study`` (the launched run ``run_id``, or a new
    one); its id."""
    with ws.transaction() as conn:
        if run_id is not None:
            row = conn.execute("SELECT study, status FROM tuning_runs WHERE id=?", (run_id,)).fetchone()
            if row is None or row[0] != study:
                raise InputError(f"no tuning run {run_id} of study {study!r}", field="run_id")
            conn.execute("UPDATE tuning_runs SET status='running', pid=?, host=?, heartbeat_at=? WHERE id=?",
                         (os.getpid(), socket.gethostname(), now_iso(), run_id))
            return run_id
        cur = conn.execute(
            "INSERT INTO tuning_runs(study, status, trials_requested, pid, host, started_by, started_at, "
            "heartbeat_at) VALUES (?, 'running', ?, ?, ?, ?, ?, ?)",
            (study, trials, os.getpid(), socket.gethostname(), started_by, now_iso(), now_iso()))
        assert cur.lastrowid is not None  # an INSERT sets it
        return int(cur.lastrowid)


def heartbeat(ws: "Workspace", run_id: int, done: int, best: float | None) -> bool:
    """Record progress; True when a stop was requested."""
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET trials_done=?, best_value=?, heartbeat_at=? WHERE id=?",
                     (done, best, now_iso(), run_id))
        row = conn.execute("SELECT stop_requested FROM tuning_runs WHERE id=?", (run_id,)).fetchone()
    return bool(row and row[0])


def failure_text(exc: BaseException) -> str:
    """Why a worker run failed, as the Studies list shows it: the message of an error meant for
    the analyst (bad data, a refusal), else the exception's type and message."""
    if isinstance(exc, InputError) and exc.field and not (exc.file or exc.line is not None or exc.record is not None):
        return str(InputError(exc.reason, hint=exc.hint))   # the reason (and fix) without "field 'x':"
    if isinstance(exc, RwbError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    return f"{type(exc).__name__}: {exc}"


def fail_run(ws: "Workspace", run_id: int, exc: BaseException) -> None:
    """Record worker run ``run_id`` as failed with the cause of ``exc``, unless it already ended
    (a run that recorded its own end keeps it) or another process works it (its process id is
    recorded and is not this one's: a mistyped run id must not end someone else's run)."""
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status='failed', error=?, ended_at=?, heartbeat_at=? "
                     "WHERE id=? AND status IN ('starting', 'running') AND (pid IS NULL OR pid=?)",
                     (failure_text(exc), now_iso(), now_iso(), run_id, os.getpid()))


def end_run(ws: "Workspace", run_id: int, status: str, *, done: int, best: float | None,
            per_min: float | None = None, error: str | None = None) -> None:
    """Record how worker run ``run_id`` ended (finished, stopped or failed) and its last figures."""
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status=?, trials_done=?, best_value=?, trials_per_min=?, "
                     "error=?, ended_at=?, heartbeat_at=? WHERE id=?",
                     (status, done, best, per_min, error, now_iso(), now_iso(), run_id))


_RUN_COLUMNS = ("id", "study", "status", "trials_requested", "trials_done", "best_value", "pid", "host",
                "log_path", "stop_requested", "started_by", "started_at", "heartbeat_at", "ended_at",
                "trials_per_min", "error")


@dataclass(frozen=True)
class StudyRun:
    """One worker process that ran a study from this workspace (:func:`study_runs`)."""

    id: int
    #: The study's name
    study: str
    #: ``starting`` (launched, not working yet), ``running``, ``finished``, ``stopped`` or ``failed``
    status: str
    trials_requested: int
    #: Trials this run finished so far
    trials_done: int
    #: The study's best feasible value when the run last reported; None before one
    best_value: float | None
    #: The worker's process and host; None while a launched worker has not started
    pid: int | None
    host: str | None
    #: The worker's log (runs launched in the background); None for a foreground run
    log_path: str | None
    #: Whether someone asked the run to stop after its current trial
    stop_requested: bool
    started_by: str
    #: When it started, last reported and ended (ISO 8601, UTC); None until it happens
    started_at: str
    heartbeat_at: str | None
    ended_at: str | None
    #: Trials per minute over the run, recorded when it ends
    trials_per_min: float | None
    #: Why the run failed or was stopped without a worker; None otherwise
    error: str | None
    #: Whether the worker process runs now: None when it runs on another host (cannot be
    #: checked from here), False for an ended run
    process_alive: bool | None


def _run(row: Sequence[Any]) -> StudyRun:
    d = dict(zip(_RUN_COLUMNS, row))
    alive = process_alive(d["pid"], d["host"]) if d["status"] in ("starting", "running") else False
    return StudyRun(**{**d, "stop_requested": bool(d["stop_requested"]), "process_alive": alive})


_STUDY_COLUMNS = ("name", "storage", "objective", "template_name", "template_version", "dataset", "episodes_file",
                  "created_by", "created_at")


@dataclass(frozen=True)
class StudyRecord:
    """A study started from this workspace, as the workspace records it (:func:`list_studies`)."""

    name: str
    #: Its storage URL (password masked); None for the workspace's own storage
    storage: str | None
    objective: str
    #: The template (name and version; None for a template file outside the workspace) whose
    #: weights it tunes
    template_name: str
    template_version: int | None
    #: The data it scores: a workspace dataset or an episodes file (one of the two)
    dataset: str | None
    episodes_file: str | None
    created_by: str
    created_at: str
    #: How many worker runs tuned it
    runs: int
    #: The latest of them; None before the first
    latest_run: StudyRun | None
    #: ``running``, ``new`` (no run yet), ``interrupted`` (its last worker died without
    #: reporting) or how the last run ended (``finished``, ``stopped``, ``failed``)
    status: str
    #: Why it is not running although it did not finish: the failed or stopped run's recorded
    #: cause, or that the worker died without one; None while it runs, when new or finished
    cause: str | None = None

    @property
    def running(self) -> bool:
        """Whether a worker tunes it now (the only state in which it can be stopped)."""
        return self.status == "running"


def list_studies(ws: "Workspace") -> list[StudyRecord]:
    """Studies started from this workspace, newest first, each with its latest run."""
    out = []
    rows = ws.conn.execute(f"SELECT {', '.join(_STUDY_COLUMNS)} FROM tuning_studies ORDER BY created_at DESC, "
                           "rowid DESC").fetchall()
    for r in rows:
        runs = study_runs(ws, r[0])
        status = _study_status(runs)
        out.append(StudyRecord(**dict(zip(_STUDY_COLUMNS, r)), runs=len(runs),
                               latest_run=runs[-1] if runs else None, status=status,
                               cause=_cause(status, runs[-1] if runs else None)))
    return out


def study_runs(ws: "Workspace", name: str) -> list[StudyRun]:
    """Worker processes that ran a study from this workspace, oldest first."""
    return [_run(r) for r in ws.conn.execute(
        f"SELECT {', '.join(_RUN_COLUMNS)} FROM tuning_runs WHERE study=? ORDER BY id", (name,))]


def _study_status(runs: Sequence[StudyRun]) -> str:
    if any(r.status in ("starting", "running") and r.process_alive is not False for r in runs):
        return "running"
    if not runs:
        return "new"
    last = runs[-1]
    return "interrupted" if last.status in ("starting", "running") else last.status


def _cause(status: str, last: StudyRun | None) -> str | None:
    if last is None or status in ("running", "new", "finished"):
        return None
    if last.error:
        return last.error
    if status == "interrupted":
        return ("its worker process ended without reporting why (killed, or the machine restarted); "
                "the worker log may say more")
    return None


def get_study(ws: "Workspace", name: str) -> StudyRecord:
    """One study's workspace record (InputError when this workspace never ran it)."""
    for s in list_studies(ws):
        if s.name == name:
            return s
    known = ", ".join(s.name for s in list_studies(ws)[:10]) or "none yet"
    raise InputError(f"no tuning study {name!r} in this workspace; known: {known} (a study on a shared "
                     "storage that was started elsewhere needs --storage URL)", field="study")


def storage_for(ws: "Workspace", name: str, storage: str | None = None) -> str:
    """The storage URL of a study: ``storage`` when given, else what this workspace recorded."""
    if storage is not None:
        return storage
    row = ws.conn.execute("SELECT storage FROM tuning_studies WHERE name=?", (name,)).fetchone()
    if row is None:
        return default_storage_url(ws)
    if row[0] is None:
        return default_storage_url(ws)
    if "***" in row[0]:
        raise InputError(f"the storage of study {name!r} ({row[0]}) needs a password that the workspace "
                         "does not keep; give --storage with the full URL", field="storage")
    return str(row[0])


def load_study(ws: "Workspace", name: str, storage: str | None = None) -> optuna.Study:
    """The Optuna study ``name`` (from its recorded or the given storage)."""
    url = storage_for(ws, name, storage)
    rdb = open_storage(url)
    if study_id(rdb, name) is None:
        raise InputError(f"no study {name!r} in {describe_url(url)}", field="study")
    return optuna.load_study(study_name=name, storage=rdb)


def study_attrs(study: optuna.Study) -> dict[str, Any]:
    """The settings Reward Workbench stored with an Optuna study (InputError for a foreign study)."""
    attrs = study.user_attrs.get(CONFIG_ATTR)
    if not isinstance(attrs, dict):
        raise InputError(f"study {study.study_name!r} was not created by Reward Workbench (no {CONFIG_ATTR!r} "
                         "attribute)", field="study")
    return attrs
