"""Training runs: records, metrics per update, checkpoints, resume, stop, background launch.

A run is one training of a policy against one reward template on one dataset or episodes file:
a row of ``runs`` (configuration, template, device, status ``running`` / ``finished`` /
``failed`` / ``stopped``), one row of ``run_metrics`` per update and complete checkpoints in
``run_checkpoints``.  Entry points: :func:`train` (create or resume a run and train it),
:func:`launch_run` (the same as a detached process), :func:`resume_run`, :func:`stop_run`, :func:`get_run`,
:func:`list_runs`, :func:`run_metrics` and :func:`compare_runs`.  Their results are the frozen
dataclasses of :mod:`core.rl.run_records` (re-exported here).

Details: docs/training.md (## Runs, ## Checkpoints, resume, stop and background runs).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.base.errors import ConflictError, InputError, PermissionDenied
from core.base.package_data import import_root
from core.access.users import Actor, LOCAL_ADMIN, authorize, get_user, multi_user
from core.data.importers import read_file
from core.guard.masking import MaskRules
from core.guard.review import enqueue_many
from core.rl.run_records import (CheckpointRecord, HeadlineMetrics, LaunchedRun, ListedRun, RunRecord, RunResult,
                                 StopResult)

if TYPE_CHECKING:  # pragma: no cover
    from core.rl.ppo import PPOConfig
    from core.rewards.template import Template
    from core.records.store import Workspace

STATUSES: tuple[str, ...] = ("running", "finished", "failed", "stopped")
#: Checkpoint folders kept per run (older ones are deleted once a newer one is recorded).
KEEP_CHECKPOINTS = 2

_RUN_COLUMNS = (
    "id", "status", "dataset", "episodes_file", "template_name", "template_version", "template_hash",
    "template_yaml", "masks_source", "masks_yaml", "device", "config", "total_steps", "env_steps", "updates", "curriculum_level",
    "pid", "host", "stop_requested", "created_by", "created_at", "started_at", "ended_at",
    "heartbeat_at", "error", "final_metrics", "log_path")


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, default=_json_default)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def finite_or_none(x: Any) -> Any:
    """JSON has no NaN: non-finite floats become None (recursively)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


# --------------------------------------------------------------------------- process liveness
def process_alive(pid: int | None, host: str | None) -> bool | None:
    """Whether the trainer process ``pid`` still runs: None when it ran on another host
    (it cannot be checked from here).  A zombie (exited, not yet reaped) counts as dead."""
    if pid is None:
        return False
    if host is not None and host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        # state is the first field after the parenthesised command name
        return stat[stat.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError, IndexError):
        return True


# --------------------------------------------------------------------------- records
def _row_dict(row: Sequence[Any]) -> dict[str, Any]:
    d = dict(zip(_RUN_COLUMNS, row))
    d["config"] = json.loads(d["config"])
    d["final_metrics"] = None if d["final_metrics"] is None else json.loads(d["final_metrics"])
    d["stop_requested"] = bool(d["stop_requested"])
    d["process_alive"] = process_alive(d["pid"], d["host"]) if d["status"] == "running" else False
    # A run the database calls running whose process is gone was killed: say so.
    d["interrupted"] = d["status"] == "running" and d["process_alive"] is False
    d["display_status"] = "interrupted" if d["interrupted"] else d["status"]
    return d


def _get_row(ws: "Workspace", run_id: str) -> tuple[Any, ...]:
    row = ws.conn.execute(f"SELECT {', '.join(_RUN_COLUMNS)} FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        known = [r[0] for r in ws.conn.execute("SELECT id FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 5")]
        raise InputError(f"no run {run_id!r} in the workspace"
                         + (f" (latest: {', '.join(known)})" if known else " (no runs yet: `rwb train`)"),
                         field="run")
    return row


#: The fields of a run's record: every column of :data:`_RUN_COLUMNS` but the YAML texts, then the derived ones.
_RECORD_FIELDS = tuple(f.name for f in fields(RunRecord))


def _record_values(row: Sequence[Any]) -> dict[str, Any]:
    """The values of a :class:`RunRecord` from a ``runs`` row."""
    d = _row_dict(row)
    return {name: d[name] for name in _RECORD_FIELDS}


def get_run(ws: "Workspace", run_id: str) -> RunRecord:
    """One run's record (config parsed; ``process_alive``/``interrupted`` derived)."""
    return RunRecord(**_record_values(_get_row(ws, run_id)))


def list_runs(ws: "Workspace", *, status: str | None = None, dataset: str | None = None,
              limit: int = 100) -> list[ListedRun]:
    """Runs, newest first, with their last update's headline metrics under ``last``."""
    where, args = [], []
    if status is not None:
        if status not in STATUSES:
            raise InputError(f"status must be one of {', '.join(STATUSES)}", field="status")
        where.append("status=?")
        args.append(status)
    if dataset is not None:
        where.append("dataset=?")
        args.append(dataset)
    sql = (f"SELECT {', '.join(_RUN_COLUMNS)} FROM runs"
           + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY created_at DESC, rowid DESC LIMIT ?")
    out = []
    for row in ws.conn.execute(sql, [*args, int(limit)]).fetchall():
        values = _record_values(row)
        out.append(ListedRun(**values, last=last_metrics(ws, values["id"])))
    return out


def last_metrics(ws: "Workspace", run_id: str) -> HeadlineMetrics:
    """The headline figures of the run's last recorded update (all None before the first)."""
    last = ws.conn.execute("SELECT metrics FROM run_metrics WHERE run_id=? ORDER BY update_idx DESC "
                           "LIMIT 1", (run_id,)).fetchone()
    m = json.loads(last[0]) if last else {}
    return HeadlineMetrics(**{f.name: m.get(f.name) for f in fields(HeadlineMetrics)})


def run_template(ws: "Workspace", run_id: str) -> "Template":
    """The exact reward template the run trains against (stored with the run)."""
    from core.rewards.template import parse_template  # deferred: loads pandas and scipy

    row = _row_dict(_get_row(ws, run_id))
    return parse_template(row["template_yaml"], file=f"run {run_id} template")


def run_masks(ws: "Workspace", run_id: str) -> Any:
    """The mask rules the run trains under (stored with it; None when it has none).  The
    workspace's review rules join them when the simulator is built."""
    text = _row_dict(_get_row(ws, run_id))["masks_yaml"]
    return None if text is None else MaskRules.from_yaml(text)


def template_hash(template: "Template") -> str:
    """sha256 of the template's canonical YAML (what the run's rewards depend on)."""
    return hashlib.sha256(template.to_yaml().encode("utf-8")).hexdigest()


def new_run_id() -> str:
    """``run-YYYYMMDD-HHMMSS-xxxx``: sortable by creation and readable aloud."""
    return time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)


def _default_masks(ws: "Workspace", dataset: str | None, episodes_file: str | Path | None) -> Path | None:
    """The committed mask rules of the data's domain (what a run trains under by default)."""
    from core.rl.loading import domain_masks, masks_for_domain  # deferred: loads torch and gymnasium

    if dataset is not None:
        return domain_masks(ws, dataset)

    parsed = read_file(episodes_file)  # type: ignore[arg-type]
    return masks_for_domain(parsed.episodes[0].domain if parsed.episodes else None)


def resolve_run_template(ws: "Workspace", template: "Template | str | Path") -> tuple["Template", str]:
    """The template a run trains against and its version label: a workspace version
    (``finance_risk@3``, or a bare name = the latest version, ``@0`` = the shipped file), a
    YAML file, or a Template (its YAML ``version``)."""
    from core.rewards.template import Template  # deferred: loads pandas and scipy
    from core.rewards.versions import get_template, parse_spec  # deferred: loads pandas and scipy

    if isinstance(template, Template):
        return template, str(template.version)
    spec = str(template)
    path = Path(spec)
    if path.is_file() or spec.endswith((".yaml", ".yml")):
        from core.rewards.template import load_template  # deferred: loads pandas and scipy

        t = load_template(path)
        return t, f"file v{t.version}"
    name, version = parse_spec(spec)
    tv = get_template(ws, name, version)
    return tv.template(), f"@{tv.version}"


def create_run(ws: "Workspace", actor: Actor, *, template: "Template", config: "PPOConfig",
               dataset: str | None = None, episodes_file: str | Path | None = None,
               masks: str | Path | None = None, template_version: str | None = None,
               refuse_twin: bool = False) -> str:
    """Record a new run (status ``running``, no process yet) and return its id.  Needs ``train``.

    ``masks``: a mask-rules YAML file; default the committed rules of the data's domain
    (``datasets/<domain>/masks.yaml``).  The rules' text is stored with the run, so a resume
    trains under the same rules.  ``refuse_twin``: raise :class:`ConflictError` naming the run
    when an identical run is in flight (checked in the same write transaction as the insert,
    so two launches racing each other cannot both pass)."""
    authorize(ws, actor, "train")
    if (dataset is None) == (episodes_file is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file "
                         "(--episodes FILE)")
    file_info = None
    if episodes_file is not None:
        path = Path(episodes_file).resolve()
        if not path.is_file():
            raise InputError(f"no such episodes file: {path}", file=str(path))
        file_info = {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    elif not ws.has_dataset(dataset):  # type: ignore[arg-type]
        known = ", ".join(d.name for d in ws.datasets()) or "none yet"
        raise InputError(f"no dataset named {dataset!r} (known: {known}); import episodes first",
                         field="dataset")
    from dataclasses import asdict

    masks_path = Path(masks) if masks is not None else _default_masks(ws, dataset, episodes_file)
    masks_yaml = None
    if masks_path is not None:
        if not masks_path.is_file():
            raise InputError(f"no such mask rules file: {masks_path}", file=str(masks_path))
        masks_yaml = masks_path.read_text(encoding="utf-8")
        MaskRules.from_yaml(masks_yaml)  # refuse broken rules before the run exists
    run_id = new_run_id()
    cfg = asdict(config)
    file_json = None if file_info is None else _json(file_info)
    with ws.transaction() as conn:
        if refuse_twin:
            twin = in_flight_twin(ws, template_hash=template_hash(template), dataset=dataset,
                                  episodes_file=file_json, masks_yaml=masks_yaml, config=_json(cfg))
            if twin is not None:
                raise ConflictError(
                    f"run {twin} is already training {template.name} {template_version or template.version} on "
                    "the same data with the same settings: watch it or stop it first, or change a setting "
                    "(the seed, say) to start another run")
        conn.execute(
            "INSERT INTO runs (id, status, dataset, episodes_file, template_name, template_version, "
            "template_hash, template_yaml, masks_source, masks_yaml, device, config, total_steps, created_by, "
            "created_at, log_path) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, "running", dataset, file_json, template.name,
             template_version or str(template.version), template_hash(template), template.to_yaml(),
             None if masks_path is None else str(masks_path), masks_yaml, config.device,
             _json(cfg), int(config.total_steps), actor.name, _now_iso(),
             str(run_dir(ws, run_id) / "train.log")))
    return run_id


#: Seconds a launched run may sit without a recorded trainer process and still count as in flight.
LAUNCH_GRACE_S = 60


def in_flight_twin(ws: "Workspace", *, template_hash: str, dataset: str | None, episodes_file: str | None,
                   masks_yaml: str | None, config: str) -> str | None:
    """The id of a run in flight (status running: its trainer alive, on another host, or
    launched under :data:`LAUNCH_GRACE_S` ago and not yet recorded) that trains exactly this:
    the same template text, data, mask rules and settings (``config`` as stored, canonical
    JSON).  None when there is none."""
    recent = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - LAUNCH_GRACE_S))
    rows = ws.conn.execute(
        "SELECT id, pid, host, created_at FROM runs WHERE status='running' AND template_hash=? AND dataset IS ? "
        "AND episodes_file IS ? AND masks_yaml IS ? AND config=? ORDER BY created_at DESC, rowid DESC",
        (template_hash, dataset, episodes_file, masks_yaml, config)).fetchall()
    for run_id, pid, host, created_at in rows:
        if pid is None and created_at >= recent:
            return run_id                      # queued: launched, its process not recorded yet
        if pid is not None and process_alive(pid, host) is not False:
            return run_id
    return None


def run_dir(ws: "Workspace", run_id: str) -> Path:
    """``artifacts/runs/<id>/`` (created)."""
    return ws.artifact_dir("runs", run_id)


def mark_started(ws: "Workspace", run_id: str, *, device: str) -> None:
    """The calling process now trains ``run_id`` on ``device`` (a launch token is used up)."""
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET status='running', pid=?, host=?, device=?, stop_requested=0, "
                     "launch_token_hash=NULL, "
                     "started_at=COALESCE(started_at, ?), ended_at=NULL, error=NULL, heartbeat_at=? "
                     "WHERE id=?", (os.getpid(), socket.gethostname(), device, _now_iso(), time.time(),
                                    run_id))


def record_update(ws: "Workspace", run_id: str, update_idx: int, env_steps: int,
                  metrics: Mapping[str, Any]) -> bool:
    """Store one update's metrics; returns True when a stop was requested."""
    with ws.transaction() as conn:
        conn.execute("INSERT OR REPLACE INTO run_metrics(run_id, update_idx, env_steps, at, metrics) "
                     "VALUES (?,?,?,?,?)", (run_id, int(update_idx), int(env_steps), time.time(),
                                            _json(finite_or_none(dict(metrics)))))
        conn.execute("UPDATE runs SET env_steps=?, updates=?, curriculum_level=?, heartbeat_at=? WHERE id=?",
                     (int(env_steps), int(update_idx), metrics.get("curriculum_level"), time.time(), run_id))
        row = conn.execute("SELECT stop_requested FROM runs WHERE id=?", (run_id,)).fetchone()
    return bool(row and row[0])


def record_checkpoint(ws: "Workspace", run_id: str, update_idx: int, env_steps: int, path: Path) -> None:
    """Record a complete checkpoint folder and delete all but the newest KEEP_CHECKPOINTS."""
    with ws.transaction() as conn:
        conn.execute("INSERT OR REPLACE INTO run_checkpoints(run_id, update_idx, env_steps, path, at) "
                     "VALUES (?,?,?,?,?)", (run_id, int(update_idx), int(env_steps), str(path), time.time()))
        old = conn.execute("SELECT update_idx, path FROM run_checkpoints WHERE run_id=? ORDER BY update_idx DESC "
                           "LIMIT -1 OFFSET ?", (run_id, KEEP_CHECKPOINTS)).fetchall()
        conn.executemany("DELETE FROM run_checkpoints WHERE run_id=? AND update_idx=?",
                         [(run_id, u) for u, _ in old])
    for _, p in old:  # after the commit: a crash here leaves an unrecorded folder, never a dangling row
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(ws: "Workspace", run_id: str) -> CheckpointRecord | None:
    """The newest recorded checkpoint of a run, or None."""
    row = ws.conn.execute("SELECT update_idx, env_steps, path, at FROM run_checkpoints WHERE run_id=? "
                          "ORDER BY update_idx DESC LIMIT 1", (run_id,)).fetchone()
    return None if row is None else CheckpointRecord(*row)


def checkpoints(ws: "Workspace", run_id: str) -> list[CheckpointRecord]:
    """Recorded checkpoints of a run, oldest first."""
    return [CheckpointRecord(*r) for r in ws.conn.execute(
        "SELECT update_idx, env_steps, path, at FROM run_checkpoints WHERE run_id=? ORDER BY update_idx",
        (run_id,))]


def truncate_metrics(ws: "Workspace", run_id: str, after_update: int) -> int:
    """Drop metrics of updates after ``after_update`` (a resumed run redoes them)."""
    with ws.transaction() as conn:
        cur = conn.execute("DELETE FROM run_metrics WHERE run_id=? AND update_idx>?", (run_id, int(after_update)))
    return cur.rowcount


def finish_run(ws: "Workspace", run_id: str, status: str, *, final_metrics: Mapping[str, Any] | None = None,
               error: str | None = None) -> None:
    """End a run with ``status`` (finished, failed or stopped)."""
    if status not in ("finished", "failed", "stopped"):
        raise ValueError(f"a run ends finished, failed or stopped, not {status!r}")
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET status=?, ended_at=?, error=?, final_metrics=COALESCE(?, final_metrics), "
                     "heartbeat_at=? WHERE id=?",
                     (status, _now_iso(), error,
                      None if final_metrics is None else _json(finite_or_none(dict(final_metrics))),
                      time.time(), run_id))


# --------------------------------------------------------------------------- metrics
def run_metrics(ws: "Workspace", run_id: str) -> list[dict[str, Any]]:
    """Every update's metrics of a run, in order (each dict has ``update`` and ``env_steps``).

    Rows of dicts, not a dataclass: an update records whatever metrics its trainer produces
    (grouped ones such as ``reward_components`` among them), and curves and tables read
    them by name."""
    _get_row(ws, run_id)
    return [{**json.loads(r[2]), "update": r[0], "env_steps": r[1]} for r in ws.conn.execute(
        "SELECT update_idx, env_steps, metrics FROM run_metrics WHERE run_id=? ORDER BY update_idx", (run_id,))]


@dataclass(frozen=True)
class Curve:
    """A metric the Training page draws as a curve: a plain title, the exact technical term
    (the tooltip) and what a healthy curve looks like."""

    metric: str
    #: What the analyst reads above the chart
    title: str
    #: The exact term, for the tooltip
    technical: str
    #: What good looks like, in words
    good: str
    #: Shown first, outside the Details (the few curves a non-specialist reads)
    plain: bool = False


#: Metrics shown as curves, in order: the plain ones first.
CURVES: tuple[Curve, ...] = (
    Curve("return_mean", "Average reward per episode",
          "return_mean: mean template return of the episodes finished in the update's training rollout",
          "rises towards the best logged behaviour's (dashed line)", plain=True),
    Curve("entropy_marginal", "Exploration (entropy, nats)",
          "entropy_marginal: entropy of the actions taken over all visited states, in nats",
          "stays at or above 1 nat; a fall towards 0 means the policy repeats itself", plain=True),
    Curve("success_rate", "Share of episodes that succeed", "success_rate: share of finished training episodes "
          "that succeeded", "rises", plain=True),
    Curve("best_logged_return", "Best logged behaviour's reward per episode",
          "best_logged_return: mean logged return of the best behaviour on the training episodes",
          "a fixed reference: the policy should reach it"),
    Curve("eval_return", "Reward per episode, acting greedily", "eval_return: greedy policy's mean return on "
          "training episodes", "rises with the average reward"),
    Curve("kl", "How much each update changes the policy", "KL(old ‖ new): KL divergence of the policy before "
          "and after an update", "small and steady, near the KL target"),
    Curve("beta", "Brake on policy changes", "KL penalty β (adaptive: ×1.5 above 1.5·target, ×0.5 below "
          "0.5·target)", "settles; it keeps rising while updates change the policy too much"),
    Curve("clip_fraction", "Share of changes cut short", "clip fraction: share of samples whose PPO ratio was "
          "clipped", "below about 0.2"),
    Curve("value_loss", "Reward-prediction error", "value loss: mean squared error of the critic",
          "falls, then levels off"),
    Curve("policy_loss", "Policy objective", "policy loss: PPO's clipped surrogate objective (negated)",
          "small; no trend needed"),
    Curve("entropy", "Choice spread per situation (nats)", "entropy: mean entropy of the policy per state, in "
          "nats", "falls slowly; a drop to 0 means it stopped trying alternatives"),
    Curve("explained_variance", "How well the critic predicts rewards", "explained variance of the critic",
          "rises towards 1"),
    Curve("off_support_rate", "Actions unlike any in the logs", "off-support rate: share of steps whose action "
          "no logged step took in a similar state", "low: the simulator is trusted only near the logs"),
    Curve("mask_violations", "Forbidden actions taken (must stay 0)", "mask violations", "0"),
    Curve("curriculum_level", "Training stage", "curriculum level: L0 behaviour cloning (copy the logs), L1 "
          "ε-exploration, L2 UCB exploration bonus, L3 review of risky repeats", "climbs as stages unlock"),
    Curve("epsilon", "Share of random tries", "ε: probability of a random action among the unmasked ones",
          "0 outside stage L1"),
    Curve("ucb_bonus", "Bonus for trying uncertain actions", "UCB bonus: standard deviation of the critic "
          "ensemble", "small"),
    Curve("env_steps_per_s", "Training speed (steps per second)", "env-steps per second", "higher is faster"),
    Curve("grad_norm", "Size of each update's correction", "gradient norm before clipping",
          "steady, without spikes"),
)
#: Dict-valued metrics: one curve per key.
GROUPED_CURVES: tuple[Curve, ...] = (
    Curve("reward_components", "Reward per component (mean per step)", "reward_components: mean value of each "
          "template component per step", "the components the template rewards rise"),
    Curve("entropy_per_tool", "Choice spread per tool (nats)", "entropy per tool: the policy's entropy over "
          "each tool's argument presets, in nats", "above 0 while the tool is still explored"),
    Curve("grad_norms", "Update size per layer", "gradient norm per layer (L2)",
          "every layer above 1e-7 (no dead layer) and below 1,000"),
)


def run_curves(ws: "Workspace", run_ids: Sequence[str]) -> dict[str, Any]:
    """Every curve of :data:`CURVES` and :data:`GROUPED_CURVES` for ``run_ids``, as wide
    DataFrames indexed by env steps (one column per run; per key for a grouped metric of
    one run), keyed by metric name.  Metrics no update recorded are left out."""
    import pandas as pd

    rows = {run_id: run_metrics(ws, run_id) for run_id in run_ids}
    out: dict[str, Any] = {}
    for metric in (c.metric for c in CURVES):
        cols = {}
        for run_id, ms in rows.items():
            values = [m.get(metric) for m in ms]
            if any(v is not None for v in values):
                cols[run_id] = pd.Series(pd.to_numeric(pd.Series(values, dtype="object"), errors="coerce").to_numpy(),
                                         index=[m["env_steps"] for m in ms])
        if cols:
            out[metric] = pd.DataFrame(cols).rename_axis("env_steps").sort_index()
    for metric in (c.metric for c in GROUPED_CURVES):
        parts = []
        for run_id, ms in rows.items():
            present = [m for m in ms if isinstance(m.get(metric), dict)]
            if not present:
                continue
            table = pd.DataFrame([m[metric] for m in present], index=[m["env_steps"] for m in present])
            if len(run_ids) > 1:
                table.columns = [f"{run_id}: {c}" for c in table.columns]
            parts.append(table)
        if parts:
            out[metric] = pd.concat(parts, axis=1).rename_axis("env_steps").sort_index()
    return out


def run_progress(ws: "Workspace", run_ids: Sequence[str]) -> tuple[tuple[str, int, str], ...]:
    """``(run id, updates, status)`` of each run: changes exactly when its curves can."""
    out = []
    for run_id in run_ids:
        row = ws.conn.execute("SELECT updates, status FROM runs WHERE id=?", (run_id,)).fetchone()
        out.append((run_id, -1 if row is None else int(row[0]), "" if row is None else str(row[1])))
    return tuple(out)


def compare_runs(ws: "Workspace", run_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Side-by-side summary rows: config differences and final/last metrics of each run.

    A display table (column titles as the page shows them, one ``config.<setting>`` column
    per setting the runs differ in), so rows of dicts rather than a dataclass."""
    runs = [get_run(ws, r) for r in run_ids]
    keys = sorted({k for r in runs for k in r.config})
    differing = [k for k in keys if len({_json(r.config.get(k)) for r in runs}) > 1]
    out = []
    for r in runs:
        rows = run_metrics(ws, r.id)
        last = rows[-1] if rows else {}
        best = max((x["return_mean"] for x in rows if x.get("return_mean") is not None), default=None)
        kls = [x["kl"] for x in rows if x.get("kl") is not None]
        out.append({
            "run": r.id, "status": r.display_status, "dataset": r.dataset or r.episodes_file,
            "template": f"{r.template_name} {r.template_version}", "device": r.device,
            "steps": r.env_steps, "updates": r.updates,
            "reward per episode (last)": last.get("return_mean"), "reward per episode (best)": best,
            "success (last)": last.get("success_rate"), "exploration, nats (last)": last.get("entropy_marginal"),
            "policy change, spread (KL std)": _std(kls), "training stage": last.get("curriculum_level"),
            "mask violations": sum(int(x.get("mask_violations") or 0) for x in rows),
            "steps per second": last.get("env_steps_per_s"),
            **{f"config.{k}": _json(r.config.get(k)) for k in differing},
        })
    return out


def _std(xs: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# --------------------------------------------------------------------------- a run's policy and data
@dataclass
class RunContext:
    """A run with its configuration, template, rebuilt training data and trained policy."""

    run: RunRecord
    config: "PPOConfig"
    template: "Template"
    data: Any
    agent: Any
    #: The checkpoint the policy was loaded from (None without one)
    checkpoint: CheckpointRecord | None


def open_run(ws: "Workspace", run_id: str, *, device: str = "cpu", need_policy: bool = True) -> RunContext:
    """Rebuild what a run trained on (simulator tables, split, baselines — as its trainer
    built them) and load its latest checkpoint's policy (None without one, unless
    ``need_policy`` makes that an error)."""
    from core.rl.checkpoints import load_agent  # deferred: loads torch
    from core.rl.loading import load_training_data  # deferred: loads torch and gymnasium
    from core.rl.ppo import PPOConfig  # deferred: loads torch and gymnasium

    run = get_run(ws, run_id)
    cfg = PPOConfig.from_dict(run.config)
    template = run_template(ws, run_id)
    ckpt = latest_checkpoint(ws, run_id)
    if ckpt is None and need_policy:
        raise ConflictError(f"run {run_id} has no checkpoint yet (status {run.display_status}); "
                            "wait for its first checkpoint or resume it")
    episodes_file = None
    if run.episodes_file:
        info = json.loads(run.episodes_file)
        episodes_file = info["path"]
        if not Path(episodes_file).is_file():
            raise InputError(f"the episodes file of run {run_id} is gone: {episodes_file}", file=episodes_file)
    data = load_training_data(ws, template, dataset=run.dataset, episodes_file=episodes_file,
                              masks=run_masks(ws, run_id), config=cfg)
    agent = None
    if ckpt is not None:
        agent = load_agent(Path(ckpt.path), device).eval()
        if agent.n_actions != data.tables.n_actions:
            raise ConflictError(f"the data of run {run_id} now has {data.tables.n_actions} action tokens, the "
                                f"trained policy {agent.n_actions}: the dataset or its tools changed since training")
    return RunContext(run=run, config=cfg, template=template, data=data, agent=agent, checkpoint=ckpt)


# --------------------------------------------------------------------------- stop
def stop_run(ws: "Workspace", actor: Actor, run_id: str) -> StopResult:
    """Ask a running run to stop after its current update.  Needs ``train``.

    A run whose process is gone (killed) is marked ``stopped`` at once; a run that has
    ended already is refused."""
    authorize(ws, actor, "train")
    run = get_run(ws, run_id)
    if run.status != "running":
        raise ConflictError(f"run {run_id} is {run.status}, not running")
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET stop_requested=1 WHERE id=?", (run_id,))
    stopped_now = run.process_alive is False
    if stopped_now:
        finish_run(ws, run_id, "stopped", error="stopped while no trainer process was running")
    return StopResult(run=get_run(ws, run_id), stopped_now=stopped_now)


# --------------------------------------------------------------------------- train (foreground)
@dataclass
class _Recorder:
    """What :func:`core.rl.ppo.train` calls back into: metrics, checkpoints, stop flag."""

    ws: "Workspace"
    run_id: str
    progress: Callable[[dict[str, Any]], None] | None = None
    #: Set by SIGTERM: stop after this update, like a stop request.
    terminate: bool = False

    def on_update(self, update_idx: int, env_steps: int, metrics: Mapping[str, Any]) -> bool:
        stop = record_update(self.ws, self.run_id, update_idx, env_steps, metrics)
        if self.progress is not None:
            self.progress({**metrics, "update": update_idx, "env_steps": env_steps})
        return stop or self.terminate

    def checkpoint_dir(self, update_idx: int) -> Path:
        return run_dir(self.ws, self.run_id) / "checkpoints" / f"{update_idx:06d}"

    def on_checkpoint(self, update_idx: int, env_steps: int, path: Path) -> None:
        record_checkpoint(self.ws, self.run_id, update_idx, env_steps, path)

    def on_review(self, requests: Sequence[Any]) -> int:
        """Curriculum L3: high-risk repeats go to the review queue (origin ``training``).

        The trainer enqueues as a service principal ("trainer", holding only
        ``enqueue_review``): the run's launcher was authorised to train when it started."""
        if not requests:
            return 0
        return len(set(enqueue_many(self.ws, Actor.service("trainer"), requests)))


def train(ws: "Workspace", actor: Actor, *, template: "Template | str | Path | None" = None,
          dataset: str | None = None, episodes_file: str | Path | None = None,
          config: "PPOConfig | None" = None, masks: str | Path | None = None, resume: str | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Train a policy in this process: create a run (or ``resume`` one) and run PPO to the end.

    Returns the run's id, status and last update's metrics (evaluate it with
    :func:`core.rl.evaluation.evaluate`).  A stop request ends it with status ``stopped``;
    an exception marks it ``failed`` (and is re-raised).  Needs ``train``."""
    from core.rl import ppo  # deferred: loads torch and gymnasium
    from core.rl.loading import load_training_data  # deferred: loads torch and gymnasium

    authorize(ws, actor, "train")
    if resume is not None:
        if any(x is not None for x in (template, dataset, episodes_file, config, masks)):
            raise InputError("--resume continues a run with its own template, data and settings; "
                             "give nothing else")
        run = get_run(ws, resume)
        if run.status == "finished":
            raise ConflictError(f"run {resume} has finished; start a new run instead")
        if run.status == "running" and run.process_alive is not False and run.pid is not None \
                and run.pid != os.getpid():
            raise ConflictError(f"run {resume} is still being trained by process {run.pid} on "
                                f"{run.host}; stop it first (rwb runs stop {resume})")
        run_id = resume
        cfg = ppo.PPOConfig.from_dict(run.config)
        tmpl = run_template(ws, run_id)
        dataset = run.dataset
        if run.episodes_file:
            info = json.loads(run.episodes_file)
            episodes_file = info["path"]
            if not Path(episodes_file).is_file() or \
                    hashlib.sha256(Path(episodes_file).read_bytes()).hexdigest() != info["sha256"]:
                raise InputError(f"the episodes file of run {run_id} is missing or changed since the run "
                                 "started; a resume must train on the same data", file=str(episodes_file))
    else:
        if template is None:
            raise InputError("give a reward template (--template NAME or FILE)", field="template")
        tmpl, label = resolve_run_template(ws, template)
        cfg = config or ppo.PPOConfig()
        cfg.validate()
        run_id = create_run(ws, actor, template=tmpl, config=cfg, dataset=dataset, episodes_file=episodes_file,
                            masks=masks, template_version=label)
    recorder = _Recorder(ws, run_id, progress)

    def _on_sigterm(signum, frame):  # noqa: ARG001 - a polite kill stops after the update
        # only a flag: the handler may interrupt a database write of this very connection
        recorder.terminate = True

    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (e.g. inside a server): no signal handler
        previous = None
    try:
        mark_started(ws, run_id, device=ppo.resolve_device(cfg.device))
        data = load_training_data(ws, tmpl, dataset=dataset, episodes_file=episodes_file,
                                  masks=run_masks(ws, run_id), config=cfg)
        ckpt = latest_checkpoint(ws, run_id) if resume is not None else None
        if resume is not None:
            truncate_metrics(ws, run_id, ckpt.update_idx if ckpt else 0)
        result = ppo.train(cfg, data, recorder=recorder, resume_from=None if ckpt is None else Path(ckpt.path))
    except BaseException as exc:
        finish_run(ws, run_id, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    status = "stopped" if result.stopped else "finished"
    finish_run(ws, run_id, status, final_metrics=result.final_metrics)
    return RunResult(run_id=run_id, status=status, metrics=finite_or_none(result.final_metrics))


# --------------------------------------------------------------------------- launch (background)
def launch_run(ws: "Workspace", actor: Actor, *, template: "Template | str | Path",
               dataset: str | None = None, episodes_file: str | Path | None = None,
               config: "PPOConfig | Mapping[str, Any] | None" = None,
               masks: str | Path | None = None) -> LaunchedRun:
    """Create a run and train it in a detached background process (``rwb train --resume RUN``).

    ``config``: a PPOConfig or a mapping of its settings (what the Training page sends).
    The process has its own session, so it survives the page (or terminal) that launched
    it; its output goes to ``artifacts/runs/<id>/train.log``.  Needs ``train``."""
    from core.rl import ppo  # deferred: loads torch and gymnasium

    authorize(ws, actor, "train")
    tmpl, label = resolve_run_template(ws, template)
    if config is None or isinstance(config, Mapping):
        cfg = ppo.PPOConfig.from_dict(dict(config or {}))
    else:
        cfg = config
    cfg.validate()
    run_id = create_run(ws, actor, template=tmpl, config=cfg, dataset=dataset, episodes_file=episodes_file,
                        masks=masks, template_version=label, refuse_twin=True)
    return _spawn_trainer(ws, run_id)


def _spawn_trainer(ws: "Workspace", run_id: str) -> LaunchedRun:
    """Start ``rwb train --resume RUN`` for ``run_id`` as a detached process and record it."""
    log_path = run_dir(ws, run_id) / "train.log"
    cmd = [sys.executable, "-m", "core.cli", "--workspace", str(ws.root), "train", "--resume", run_id, "--quiet"]
    root = import_root()  # the folder that holds the core package, for an uninstalled checkout
    # The child acts for the launcher: a one-time token (its hash stored with the run) lets
    # it resume this run as the user who launched it, without a password.
    token = secrets.token_urlsafe(24)
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET launch_token_hash=? WHERE id=?", (_token_hash(token), run_id))
    env = {**os.environ, LAUNCH_TOKEN_ENV: token,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("RWB_PASSWORD", None)
    # OpenMP threads that spin while waiting steal the cores they wait for on a shared machine
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=str(ws.root), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    # Record the child at once, so the page shows it running before it has opened the workspace.
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET pid=?, host=?, started_at=COALESCE(started_at, ?) WHERE id=?",
                     (proc.pid, socket.gethostname(), _now_iso(), run_id))
    return LaunchedRun(run_id=run_id, pid=proc.pid, log=str(log_path))


def resume_refusal(ws: "Workspace", run_id: str) -> str | None:
    """Why ``run_id`` cannot be resumed now, in words; None when it can: it is stopped,
    interrupted (its trainer process gone), or failed after a checkpoint."""
    run = get_run(ws, run_id)
    if run.status == "finished":
        return f"run {run_id} has finished its planned steps; start a new run to train further"
    if run.status == "running" and not run.interrupted:
        return f"run {run_id} is training now; it can be resumed once it has stopped"
    if run.status == "failed" and latest_checkpoint(ws, run_id) is None:
        return f"run {run_id} failed before its first checkpoint: there is nothing to resume; start a new run"
    return None


def resume_run(ws: "Workspace", actor: Actor, run_id: str) -> LaunchedRun:
    """Continue a stopped, interrupted or failed run from its last checkpoint, in a detached
    background process (what ``rwb train --resume RUN --background`` does).  Needs ``train``.

    Refused (:class:`ConflictError`, with :func:`resume_refusal`'s reason) while the run
    trains, once it has finished, or when it failed before its first checkpoint.  The
    refusal and the claim are one write transaction, so two resumes racing each other
    cannot both start a trainer."""
    authorize(ws, actor, "train")
    with ws.transaction() as conn:
        reason = resume_refusal(ws, run_id)
        row = conn.execute("SELECT status, pid, heartbeat_at FROM runs WHERE id=?", (run_id,)).fetchone()
        if reason is None and row[0] == "running" and row[1] is None and row[2] is not None \
                and time.time() - float(row[2]) < LAUNCH_GRACE_S:
            reason = f"run {run_id} is being resumed already; its trainer is starting"
        if reason is not None:
            raise ConflictError(reason)
        # claimed: running, no trainer recorded yet (the spawn below records it)
        conn.execute("UPDATE runs SET status='running', pid=NULL, host=NULL, stop_requested=0, ended_at=NULL, "
                     "error=NULL, heartbeat_at=? WHERE id=?", (time.time(), run_id))
    return _spawn_trainer(ws, run_id)


def steps_progress(run: RunRecord) -> str:
    """The run's environment steps, done against planned, in words.

    A run trains whole updates (rollout batches of ``n_envs × rollout_len`` steps), so its
    last update can run past the planned total: that is said, not hidden nor capped
    (``40,960 steps done (planned 40,000; the last update runs whole batches)``)."""
    done, planned = int(run.env_steps), int(run.total_steps)
    if done > planned:
        return f"{done:,} steps done (planned {planned:,}; the last update runs whole batches)"
    if run.status == "finished" or done == planned:
        return f"{done:,} steps done (planned {planned:,})"
    return f"{done:,} of {planned:,} planned steps done"


#: Environment variable that carries a launch token to the background trainer.
LAUNCH_TOKEN_ENV = "RWB_LAUNCH_TOKEN"


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def launched_actor(ws: "Workspace", run_id: str, token: str) -> Actor:
    """The user who launched ``run_id`` in the background, for the trainer process that
    holds its launch token (refused when the token does not match or was used)."""
    import hmac


    row = ws.conn.execute("SELECT launch_token_hash, created_by FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None or row[0] is None or not hmac.compare_digest(row[0], _token_hash(token)):
        raise PermissionDenied(f"the launch token does not open run {run_id}; resume it as a user "
                               "(rwb train --resume RUN --as NAME)")
    if not multi_user(ws):
        return LOCAL_ADMIN
    return get_user(ws, row[1]).actor()


def run_log(ws: "Workspace", run_id: str, tail: int = 4000) -> str:
    """The last ``tail`` characters of a background run's log (empty when none)."""
    run = get_run(ws, run_id)
    path = Path(run.log_path) if run.log_path else None
    if path is None or not path.is_file():
        return ""
    data = path.read_bytes()[-tail:]
    return data.decode("utf-8", errors="replace")
