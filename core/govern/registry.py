"""The policy registry (docs/design.md §9): versions, four-eyes approval, promotion, rollback.

Every policy name has versions, each one verified bundle, moving candidate → approved →
production (→ rolled_back).  Entry points: :func:`register` (verify, keep a copy, record the
registry's own evaluation), :func:`approve` (four-eyes plus :func:`promotion_gate`),
:func:`promote` (an atomic, signed copy into the policies folder) and :func:`rollback`.
Every transition is one append-only row of ``registry_events``, signed by the workspace;
stages, :func:`aliases`, approvals and the signed policies index (:func:`publish_index`)
are computed from the signed rows alone, so a row written by hand counts for nothing.

Details: docs/governance.md (## Registry stages, ## The promotion gate, ## Registry events,
## The policies index is a cache of the registry).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.govern.bundle import (MAX_BUNDLE_BYTES, MAX_CENTRAL_DIRECTORY_BYTES, Approval, BundleError, ENCODER_PREFIX,
                                MANIFEST, Manifest, heldout_identity,
                                load_bundle, next_version, read_members, seal_manifest, semver_key, verify_bundle,
                                write_folder)
from core.base.errors import ConflictError, InputError, RwbError
from core.base.results import to_jsonable
from core.access.keys import signing_key, trust_store
from core.govern.policy_folder import (INDEX, PolicyIndexEntry, PromotionTarget, entry_signature_problem,
                                       policies_root, promotion_target, read_index_document, sign_entry)
from core.govern.registry_records import (AFTER, EVENT_LABEL, SIGNATURE, RegistryEvent, RegistryLog,
                                          RegistryLogBroken, UnrecordedEvent, event_payload, policy_names,
                                          production_stack, promoted_digest, registry_log, sign_record)
from core.govern.registry_records import promoted_digest_in as _promoted_digest
from core.access.users import PERMISSIONS, Actor, authorize, check_four_eyes
from core.access.audit import security_event
from core.rl.runs import get_run, open_run

if TYPE_CHECKING:  # pragma: no cover
    import sqlite3

    from core.records.store import Workspace

STAGES: tuple[str, ...] = ("candidate", "approved", "production", "rolled_back")
EVENTS: tuple[str, ...] = ("registered", "approved", "promoted", "rolled_back")
#: The candidate must beat the baseline's mean held-out return by more than this.
GATE_MARGIN = 0.0


class GateFailed(ConflictError):
    """The promotion gate refused an approval: the bundle does not beat its baseline."""


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, default=str)


# --------------------------------------------------------------------------- reading
_VERSION_COLUMNS = ("name", "version", "bundle_path", "bundle_sha256", "manifest_digest", "manifest", "run_id",
                    "created_by", "trained_by", "registered_by", "registered_at")


def _row(conn: "sqlite3.Connection", name: str, version: str) -> dict[str, Any]:
    row = conn.execute(f"SELECT {', '.join(_VERSION_COLUMNS)} FROM policy_versions WHERE name=? AND version=?",
                       (name, version)).fetchone()
    if row is None:
        known = [r[0] for r in conn.execute("SELECT version FROM policy_versions WHERE name=?", (name,))]
        if not known:
            names = [r[0] for r in conn.execute("SELECT DISTINCT name FROM policy_versions ORDER BY name")]
            raise InputError(f"no policy named {name!r} is registered"
                             + (f" (registered: {', '.join(names)})" if names else
                                " (none yet: `rwb registry register BUNDLE.zip`)"), field="name")
        raise InputError(f"{name} has no version {version!r} (registered: "
                         f"{', '.join(sorted(known, key=semver_key))})", field="version")
    d = dict(zip(_VERSION_COLUMNS, row))
    d["manifest"] = json.loads(d["manifest"])
    return d


_replay = production_stack


def _log(ws: "Workspace", name: str | None, conn: "sqlite3.Connection | None" = None) -> RegistryLog:
    """The registry's log (of ``name``, or all), each row checked against the workspace's trust store."""
    return registry_log(conn or ws.conn, name, trust_store(ws))


def _events(ws: "Workspace", name: str, conn: "sqlite3.Connection | None" = None) -> list[RegistryEvent]:
    """The events of ``name`` the registry recorded itself (signed by its workspace): the only
    ones a stage, an approval or a production version is read from.  A row inserted or
    changed by hand is not among them (:func:`unrecorded_events` lists those)."""
    return _log(ws, name, conn).recorded


def _state(ws: "Workspace", name: str, conn: "sqlite3.Connection | None" = None
           ) -> tuple[dict[str, str], list[str]]:
    return _replay(_events(ws, name, conn))


def production_version(ws: "Workspace", name: str) -> str | None:
    """The version of ``name`` in production (per this workspace's registry), or None."""
    stack = _state(ws, name)[1]
    return stack[-1] if stack else None


def previous_version(ws: "Workspace", name: str) -> str | None:
    """The version :func:`rollback` would restore (None when there is none)."""
    stack = _state(ws, name)[1]
    return stack[-2] if len(stack) >= 2 else None


def aliases(ws: "Workspace", name: str) -> dict[str, str | None]:
    """``{"production", "approved", "candidate"}`` → the version each alias points to: the
    production version, and the highest approved and highest candidate version."""
    stage, stack = _state(ws, name)

    def top(s: str) -> str | None:
        vs = sorted((v for v, st in stage.items() if st == s), key=semver_key)
        return vs[-1] if vs else None

    return {"production": stack[-1] if stack else None, "approved": top("approved"), "candidate": top("candidate")}


def _approvals(events: Sequence[RegistryEvent], version: str) -> list[dict[str, Any]]:
    """The approvals of ``version`` as its ``approved`` events recorded them (the promoted
    copy's manifest carries them)."""
    return [{"by": e.actor, "role": e.role, "at": e.at, "comment": e.comment, "gate": e.detail.get("gate")}
            for e in events if e.event == "approved" and e.version == version]


def _best_logged(ev: Mapping[str, Any]) -> str | None:
    """``"noisy 1.998"``: the best logged behaviour of an evaluation and its held-out return."""
    best = ev.get("best_logged") or {}
    if best.get("behaviour") is None or best.get("return_mean") is None:
        return None
    return f"{best['behaviour']} {best['return_mean']:.4g}"


def _record(events: Sequence[RegistryEvent], version: str) -> dict[str, Any]:
    """The registry's own record of ``version`` (the detail of its ``registered`` event):
    ``bundle_sha256``, ``manifest_digest``, ``signer``, ``trained_by`` (the run table's)
    and ``evaluation`` (the registry's).  Empty for a version registered before the
    registry kept its own records."""
    for e in events:
        if e.event == "registered" and e.version == version:
            return e.detail
    return {}


@dataclass(frozen=True)
class RecordedApproval:
    """An approval of a version, as the registry recorded it."""

    by: str
    at: str
    #: Why, in the approver's words
    comment: str


@dataclass(frozen=True)
class PolicyVersion:
    """A registered version as :func:`list_versions` lists it: its stage (read from the
    events), the registry's own record of it and its approvals.  Who trained the run, the
    signer and the figures are the registry's, never the manifest's claims."""

    name: str
    version: str
    #: ``candidate``, ``approved``, ``production`` or ``rolled_back``
    stage: str
    run_id: str | None
    #: Who exported the bundle
    created_by: str
    #: Who trained the run, per the workspace's run table (None for a version registered
    #: before the registry kept its own records)
    trained_by: str | None
    #: When the bundle was exported
    created_at: str | None
    #: Fingerprint of the key whose signature the registry verified
    signer: str | None
    #: Where the registry's evaluation comes from, in words
    evaluated_from: str | None
    registered_by: str
    registered_at: str
    #: The reward template, ``name vN``
    template: str
    dataset: str | None
    #: Mean held-out return of the policy, by the registry's evaluation
    return_mean: float | None
    #: Mean return of the logged expert on the same held-out episodes
    expert_return: float | None
    #: The best logged behaviour and its held-out return, e.g. ``"noisy 1.998"``
    best_logged: str | None
    heldout_episodes: int | None
    approvals: list[RecordedApproval]
    #: The workspace's own copy of the bundle zip
    bundle_path: str
    #: sha256 of that copy at registration
    bundle_sha256: str
    manifest_digest: str


@dataclass(frozen=True)
class PolicyVersionDetail(PolicyVersion):
    """One registered version (:func:`get_version`): its summary and its manifest."""

    #: The manifest of the registered bundle, as verified at registration
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Registration(PolicyVersionDetail):
    """What :func:`register` did: the registered version, and whether it was there already."""

    #: True when these bytes were registered before (registering them again changes nothing)
    already_registered: bool


def _summary(row: Mapping[str, Any], stage: str, events: Sequence[RegistryEvent]) -> dict[str, Any]:
    """The fields of :class:`PolicyVersion` for one row of ``policy_versions``."""
    m = row["manifest"]
    rec = _record(events, row["version"])
    ev = rec.get("evaluation") or {}
    return {
        "name": row["name"], "version": row["version"], "stage": stage, "run_id": row["run_id"],
        "created_by": row["created_by"], "trained_by": rec.get("trained_by"), "created_at": m.get("created_at"),
        "signer": rec.get("signer"), "evaluated_from": rec.get("evaluated_from"),
        "registered_by": row["registered_by"], "registered_at": row["registered_at"],
        "template": f"{m['template']['name']} v{m['template']['version']}", "dataset": m.get("dataset"),
        "return_mean": (ev.get("policy") or {}).get("return_mean"), "expert_return": ev.get("expert_return"),
        "best_logged": _best_logged(ev), "heldout_episodes": ev.get("episodes"),
        "approvals": [RecordedApproval(by=a["by"], at=a["at"], comment=a["comment"])
                      for a in _approvals(events, row["version"])],
        "bundle_path": row["bundle_path"], "bundle_sha256": row["bundle_sha256"],
        "manifest_digest": row["manifest_digest"],
    }


def _detail(ws: "Workspace", name: str, version: str) -> dict[str, Any]:
    """The fields of :class:`PolicyVersionDetail` for ``name@version``."""
    row = _row(ws.conn, name, version)
    events = _events(ws, name)
    stage = _replay(events)[0].get(version, "candidate")
    return {**_summary(row, stage, events), "manifest": row["manifest"]}


def get_version(ws: "Workspace", name: str, version: str) -> PolicyVersionDetail:
    """One registered version: summary, stage and its full manifest (under ``manifest``)."""
    return PolicyVersionDetail(**_detail(ws, name, version))


def list_versions(ws: "Workspace", name: str | None = None) -> list[PolicyVersion]:
    """Registered versions (of ``name``, or all), by name then semantic version, newest last,
    each with its stage, evaluation headline and approvals."""
    sql = f"SELECT {', '.join(_VERSION_COLUMNS)} FROM policy_versions"
    args: tuple[Any, ...] = ()
    if name is not None:
        sql += " WHERE name=?"
        args = (name,)
    rows = [dict(zip(_VERSION_COLUMNS, r)) for r in ws.conn.execute(sql, args)]
    out = []
    for n in sorted({r["name"] for r in rows}):
        events = _events(ws, n)
        stage = _replay(events)[0]
        for r in sorted((r for r in rows if r["name"] == n), key=lambda r: semver_key(r["version"])):
            r["manifest"] = json.loads(r["manifest"])
            out.append(PolicyVersion(**_summary(r, stage.get(r["version"], "candidate"), events)))
    return out


def history(ws: "Workspace", name: str | None = None) -> list[RegistryEvent]:
    """Every registry event (of ``name``, or all), oldest first: who did what, when and why.
    The raw log: rows the registry did not write are listed too (:func:`unrecorded_events`)."""
    return _log(ws, name).events


def unrecorded_events(ws: "Workspace", name: str | None = None) -> list[UnrecordedEvent]:
    """Rows of the log (of ``name``, or all) that the registry's own functions did not write
    — no signature by a key the workspace trusts, or one that does not cover the row as it
    is — each with why.  They count for nothing: no stage, approval or production reads them."""
    return _log(ws, name).unrecorded


@dataclass(frozen=True)
class VersionComparison:
    """One version's evaluation report in :func:`compare_versions`: the registry's own
    evaluation on the version's held-out episodes."""

    #: ``name@version``
    policy: str
    stage: str
    run: str | None
    heldout_episodes: int | None
    #: The held-out set's fingerprint, shortened: versions with the same one were evaluated
    #: on the same episodes
    heldout_set: str
    #: Mean return and success rate of the policy
    return_policy: float | None
    success_policy: float | None
    #: Mean return the logged expert earned, and a random policy within the masks
    return_expert_log: float | None
    return_random_in_mask: float | None
    off_support_rate: float | None
    mask_violations: int | None
    #: Accuracy of the RDE on the held-out episodes of the behaviour it was fit on
    rde_accuracy: float | None
    #: Per logged behaviour, the mean return its logs earned
    logged_returns: dict[str, float]

    def row(self) -> dict[str, Any]:
        """The report as one row of a table, under the column labels the Policies page shows."""
        return {
            "policy": self.policy, "stage": self.stage, "run": self.run,
            "held-out episodes": self.heldout_episodes, "held-out set": self.heldout_set,
            "return (policy)": self.return_policy, "success (policy)": self.success_policy,
            "return (expert log)": self.return_expert_log, "return (random in mask)": self.return_random_in_mask,
            "off-support rate": self.off_support_rate, "mask violations": self.mask_violations,
            "RDE accuracy (held-out, its behaviour)": self.rde_accuracy,
            **{f"return (log: {b})": r for b, r in sorted(self.logged_returns.items())},
        }


def compare_versions(ws: "Workspace", versions: list[tuple[str, str]]) -> list[VersionComparison]:
    """Evaluation reports side by side: one per ``(name, version)``."""
    rows = []
    for name, version in versions:
        v = get_version(ws, name, version)
        ev = _record(_events(ws, name), version).get("evaluation") or {}
        pol, rnd = ev.get("policy") or {}, ev.get("random_in_mask") or {}
        rows.append(VersionComparison(
            policy=f"{name}@{version}", stage=v.stage, run=v.run_id, heldout_episodes=ev.get("episodes"),
            heldout_set=(ev.get("heldout_fingerprint") or "")[:12], return_policy=pol.get("return_mean"),
            success_policy=pol.get("success_rate"), return_expert_log=ev.get("expert_return"),
            return_random_in_mask=rnd.get("return_mean"), off_support_rate=pol.get("off_support_rate"),
            mask_violations=pol.get("mask_violations"),
            rde_accuracy=(ev.get("rde_heldout_expert") or {}).get("accuracy"),
            logged_returns=dict(ev.get("logged") or {})))
    return rows


# --------------------------------------------------------------------------- register
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def register(ws: "Workspace", actor: Actor, bundle_path: str | Path, *, comment: str = "") -> Registration:
    """Verify a bundle zip and register it as a *candidate* version.  Needs ``export_bundle``.

    The workspace keeps its own copy of the zip.  Registering the same bytes again is a
    no-op (``already_registered: true``); another bundle under a registered name and
    version is refused — export it with a new version.  Every refusal is recorded in the
    security log (``register_refused``, with its reason) before it is raised."""
    with _refusal_recorded(ws, actor, "register", file=str(bundle_path)):
        return _register(ws, actor, bundle_path, comment)


def _register(ws: "Workspace", actor: Actor, bundle_path: str | Path, comment: str) -> Registration:
    """:func:`register`, its refusals raised to the caller."""
    authorize(ws, actor, "export_bundle")
    src = Path(bundle_path)
    if not src.is_file() or src.suffix.lower() != ".zip":
        raise InputError(f"register a bundle zip file (got {src})", file=str(src))
    # A bundle's members are capped at MAX_BUNDLE_BYTES in all; the zip's headers add little.
    # Refuse a larger file by its size, before a byte of it is read.
    limit = MAX_BUNDLE_BYTES + MAX_CENTRAL_DIRECTORY_BYTES + (1 << 20)
    size = src.stat().st_size
    if size > limit:
        security_event(ws, actor, "bundle_refused", file=str(src), size=size,
                       reason=f"{size:,} bytes is more than a bundle may hold ({limit:,})")
        raise BundleError(f"bundle refused: {size:,} bytes is more than a bundle may hold ({limit:,})",
                          file=str(src))
    folder = ws.artifact_dir("registry")
    fd, tmp_name = tempfile.mkstemp(prefix=".incoming-", suffix=".zip", dir=folder)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with open(src, "rb") as source, os.fdopen(fd, "wb") as f:
            while chunk := source.read(min(1 << 20, limit + 1 - f.tell())):
                digest.update(chunk)
                f.write(chunk)
            if f.tell() > limit:  # the file grew after its size was read
                raise BundleError(f"bundle refused: {src} grew past {limit:,} bytes while it was read",
                                  file=str(src))
        sha = digest.hexdigest()
        # verify the copy we keep, not the caller's file, which may change meanwhile
        report = verify_bundle(tmp, trust=trust_store(ws))
        if not report.ok:
            security_event(ws, actor, "bundle_refused", file=str(src), bundle_sha256=sha, reason=report.reason)
            raise BundleError(f"bundle refused: {report.reason}", file=str(src))
        m = Manifest.model_validate(report.manifest)
        if m.approvals:
            raise BundleError(f"{m.policy_version} arrives with approvals in its manifest; approvals are given in "
                              "the registry (register the exported bundle, not a promoted copy)", field="approvals")
        _check_run_record(ws, m)
        have = ws.conn.execute("SELECT bundle_sha256 FROM policy_versions WHERE name=? AND version=?",
                               (m.name, m.version)).fetchone()
        own: dict[str, Any] = {}
        if have is None:  # (the same bytes again are a no-op below, with nothing to evaluate)
            own = _own_record(ws, m, read_members(tmp))
        with ws.transaction() as conn:
            have = conn.execute("SELECT bundle_sha256 FROM policy_versions WHERE name=? AND version=?",
                                (m.name, m.version)).fetchone()
            if have is not None:
                if have[0] == sha:
                    return Registration(**_detail(ws, m.name, m.version), already_registered=True)
                raise ConflictError(f"{m.policy_version} is already registered with other content; export the "
                                    f"bundle with a new version (next: {next_version(ws, m.name)})")
            dest = ws.artifact_dir("registry", m.name) / f"{m.version}-{sha[:16]}.zip"
            os.replace(tmp, dest)
            conn.execute(f"INSERT INTO policy_versions ({', '.join(_VERSION_COLUMNS)}) VALUES "
                         f"({', '.join('?' * len(_VERSION_COLUMNS))})",
                         (m.name, m.version, str(dest), sha, m.digest, _json(report.manifest), m.run_id,
                          m.created_by, m.trained_by, actor.name, _now_iso()))
            _event(ws, conn, m.name, m.version, "registered", actor, comment,
                   {"bundle_sha256": sha, "source": str(src.resolve()), "manifest_digest": m.digest,
                    "signer": report.signer, "registered_by": actor.name, **own})
    finally:
        tmp.unlink(missing_ok=True)
    return Registration(**_detail(ws, m.name, m.version), already_registered=False)


def _own_record(ws: "Workspace", m: Manifest, members: Mapping[str, bytes]) -> dict[str, Any]:
    """The registry's own record of a bundle's run: who created the run (the workspace's
    run table) and the run's evaluation on its held-out episodes, computed here
    (:func:`core.rl.evaluation.evaluate`, the protocol export uses), after checking that the
    bundle's weights are the run's checkpoint — so the figures are the bundle's.  When the
    bundle carries a served copy, the figures are the copy's (what production would serve,
    what the promotion gate reads), with its agreement computed here.  A run that is not in
    this workspace cannot be evaluated here (its episodes and split live in the workspace
    that trained it): refused.  A refusal of the weights goes to the security log."""
    from core.rl.evaluation import evaluate  # deferred: loads torch

    if not ws.conn.execute("SELECT 1 FROM runs WHERE id=?", (m.run_id,)).fetchone():
        raise BundleError(f"run {m.run_id} of {m.policy_version} is not in this workspace: the registry evaluates "
                          "every bundle itself on its run's held-out episodes and never takes the manifest's "
                          "figures; register the bundle in the workspace that trained the run", field="run_id")
    run = get_run(ws, m.run_id)
    ctx = open_run(ws, m.run_id)
    try:
        served = _check_weights(ctx, members, m)
    except BundleError as exc:
        security_event(ws, None, "bundle_weights_refused", policy=m.policy_version, run_id=m.run_id,
                       manifest_digest=m.digest, reason=exc.reason)
        raise
    report = evaluate(ws, m.run_id, policy=None if served is None else served[0])
    # stored as JSON: the report's fields as keys, then what the registry adds
    evaluation = {**report.to_dict(), **heldout_identity(ctx.data.tables, ctx.data.heldout_episodes, run),
                  "split": "heldout", "metric": "return_mean", "expert_return": report.logged.get("expert"),
                  "evaluated_at": _now_iso()}
    own = {"trained_by": run.created_by, "evaluation": json.loads(_json(evaluation)),
           "evaluated_from": f"run {m.run_id} in this workspace (its held-out split)"}
    if served is not None:
        own["evaluated_from"] += f", the bundle's served {served[1]['precision']} copy"
        own["served"] = served[1]
    return own


def _check_weights(ctx: Any, members: Mapping[str, bytes], m: Manifest) -> tuple[Any, dict[str, Any]] | None:
    """The bundle's policy and encoder weights must be the run's checkpoint (``ctx``: the run
    opened), tensor for tensor.  Its served copy, if any, must agree with that checkpoint on
    the run's held-out states as the manifest records, computed again here, and pass the bar
    (core.govern.served_copy).  Returns the copy and the figures computed here (None without one)."""
    import torch
    from safetensors.torch import load as load_tensors

    from core.govern import served_copy  # deferred: loads torch
    from core.govern.bundle import served_module  # deferred with the copy's other helpers, used here only

    agent = ctx.agent
    ours = agent.state_dict()
    theirs = {**load_tensors(members["policy.safetensors"]),
              **{ENCODER_PREFIX + k: v for k, v in load_tensors(members["encoder.safetensors"]).items()}}
    same = set(ours) == set(theirs) and all(
        ours[k].shape == theirs[k].shape and torch.equal(ours[k].cpu(), theirs[k]) for k in ours)
    if not same:
        raise BundleError(f"the weights in {m.policy_version} are not the checkpoint of run {m.run_id}; the registry "
                          "evaluates the run, so it registers only that run's own policy", field="policy.safetensors")
    if m.served is None:
        return None
    try:
        copy = served_module(members, m)
    except (InputError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise BundleError(f"the served copy in {m.policy_version} cannot be built: {exc}", field="served") from None
    obs, mask = served_copy.heldout_states(ctx.data.tables, ctx.data.heldout_episodes.cpu().tolist(), agent)
    figures = served_copy.agreement(agent, copy, obs, mask)
    why = figures.differs_from(m.served.heldout.model_dump())
    if why is not None:
        raise BundleError(f"the served {m.served.precision} copy in {m.policy_version} does not agree with run "
                          f"{m.run_id}'s checkpoint as its manifest records ({why})", field="served")
    why = figures.problem()
    if why is not None:
        raise BundleError(f"the served {m.served.precision} copy in {m.policy_version} may not be served: {why}",
                          field="served")
    return copy, {"precision": m.served.precision, "heldout": figures.to_dict()}


def _check_run_record(ws: "Workspace", m: Manifest) -> None:
    """When the bundle's run is in this workspace, its manifest must agree with the run
    record on who trained it and against which template (four-eyes reads ``trained_by``)."""
    row = ws.conn.execute("SELECT created_by, template_hash FROM runs WHERE id=?", (m.run_id,)).fetchone()
    if row is None:
        return
    if m.trained_by != row[0]:
        raise BundleError(f"the manifest says run {m.run_id} was trained by {m.trained_by!r}, the workspace "
                          f"records {row[0]!r}", field="trained_by")
    if m.template.sha256 != row[1]:
        raise BundleError(f"the manifest's template is not the one run {m.run_id} trained against",
                          field="template")


def _event(ws: "Workspace", conn: "sqlite3.Connection", name: str, version: str, event: str, actor: Actor,
           comment: str, detail: Mapping[str, Any] | None = None) -> RegistryEvent:
    """Append one event, signed with the workspace's key over the whole row (its id
    included) and naming the recorded event of ``name`` it follows, inside the caller's
    transaction (which holds the write lock, so the id taken here is the row's)."""
    log = _log(ws, name, conn)
    log.check_whole(name)
    seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='registry_events'").fetchone()
    top = conn.execute("SELECT MAX(id) FROM registry_events").fetchone()
    new_id = max(int(seq[0]) if seq else 0, int(top[0] or 0)) + 1
    body = json.loads(_json({**(detail or {}), AFTER: log.last_sequence(name)}))  # the form read back
    row = RegistryEvent(id=new_id, name=name, version=version, event=event, actor=actor.name, role=actor.role,
                        at=_now_iso(), comment=comment or "", detail=body)
    signed = {**body, SIGNATURE: sign_record(signing_key(ws), EVENT_LABEL, event_payload(row))}
    conn.execute("INSERT INTO registry_events (id, name, version, event, actor, role, at, comment, detail) "
                 "VALUES (?,?,?,?,?,?,?,?,?)", (row.id, name, version, event, row.actor, row.role, row.at,
                                                row.comment, _json(signed)))
    return replace(row, detail=signed)


def _registered_bundle(row: Mapping[str, Any]) -> Path:
    """The workspace copy of a registered bundle, checked against its recorded sha256."""
    path = Path(row["bundle_path"])
    if not path.is_file():
        raise BundleError(f"the registered copy of {row['name']} {row['version']} is missing", file=str(path))
    if _sha256_file(path) != row["bundle_sha256"]:
        raise BundleError(f"the registered copy of {row['name']} {row['version']} was changed after "
                          "registration", file=str(path))
    return path


def bundle_bytes(ws: "Workspace", name: str, version: str) -> bytes:
    """The registered bundle zip of ``name@version`` (for a download), checked against the
    sha256 recorded at registration."""
    row = _row(ws.conn, name, version)
    path = Path(row["bundle_path"])
    if not path.is_file():
        raise BundleError(f"the registered copy of {name} {version} is missing", file=str(path))
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != row["bundle_sha256"]:
        raise BundleError(f"the registered copy of {name} {version} was changed after registration", file=str(path))
    return data


# --------------------------------------------------------------------------- the gate
def _evaluation(events: Sequence[RegistryEvent], version: str) -> dict[str, Any]:
    """The registry's own evaluation of ``version`` (never the manifest's figures)."""
    return _record(events, version).get("evaluation") or {}


@dataclass(frozen=True)
class PromotionGate:
    """The verdict of :func:`promotion_gate` and the numbers behind it."""

    #: ``name@version`` of the version asking to be approved
    candidate: str
    #: What the returns below measure, in words
    metric: str
    #: The candidate's mean return (None when the registry holds no held-out evaluation of it)
    candidate_return: float | None
    #: How many held-out episodes the returns are over
    episodes: int | None
    heldout_fingerprint: str | None
    #: How much the candidate must beat the baseline by
    margin: float
    #: The production version of the name, None when there is none
    production: str | None
    #: What the candidate is compared with: ``logged expert behaviour`` or ``production name@version``
    baseline: str
    baseline_return: float | None
    #: Where the baseline's return comes from
    baseline_source: str
    passed: bool
    #: One sentence: why it passed or failed
    reason: str
    #: Why the baseline has no return on the candidate's episodes, when it has none
    baseline_problem: str | None = None
    #: Episodes the production policy was re-run on, when it was
    baseline_episodes: int | None = None


def promotion_gate(ws: "Workspace", name: str, version: str, *, margin: float = GATE_MARGIN) -> PromotionGate:
    """Whether ``name@version`` may be approved: its mean return on held-out episodes
    must beat the baseline's by more than ``margin``, with no mask violation.

    The baseline is the current production version of ``name`` when there is one (and it
    is another version), evaluated on the *same* held-out episodes under the *same*
    reward template — its own report when it was evaluated on that set, else the
    production policy re-run on the candidate's held-out episodes (possible when both
    share the action catalog and the candidate's run is in this workspace).  Without a
    production version, the baseline is the logged expert behaviour (the best logged
    behaviour; when the logs hold no expert, the best one they hold), paired: the policy
    started from the start states of that behaviour's held-out episodes against what the
    behaviour's logs earned on them.  Returns the verdict with the numbers behind it."""
    cand = _row(ws.conn, name, version)
    events = _events(ws, name)
    ev = _evaluation(events, version)
    pol = ev.get("policy") or {}
    out: dict[str, Any] = {"candidate": f"{name}@{version}", "metric": "mean template return on held-out episodes",
                           "candidate_return": pol.get("return_mean"), "episodes": ev.get("episodes"),
                           "heldout_fingerprint": ev.get("heldout_fingerprint"), "margin": float(margin)}
    prod = production_version(ws, name)
    out["production"] = prod
    if prod is None or prod == version:
        out.update(baseline="logged expert behaviour", baseline_return=ev.get("expert_return"),
                   baseline_source="the registry's evaluation of the candidate")
        out["baseline_source"] = "the registry's evaluation of the candidate"
        best = (ev.get("best_logged") or {}).get("behaviour")
        paired = (ev.get("paired") or {}).get(best) or {}
        if paired.get("policy") is not None:
            # The same requests from the same first states: the policy started where the
            # held-out episodes of the best logged behaviour (the expert, when the logs have
            # one) started, against what that behaviour's logs earned there.
            out.update(candidate_return=paired["policy"], baseline_return=paired.get("logged"),
                       episodes=paired.get("episodes"),
                       baseline=f"logged {best} behaviour" + (" (the best logged)" if best != "expert" else ""),
                       metric=f"mean template return from the start states of the held-out {best} episodes")
    else:
        prow = _row(ws.conn, name, prod)
        pev = _evaluation(events, prod)
        out["baseline"] = f"production {name}@{prod}"
        same_set = (pev.get("heldout_fingerprint") == ev.get("heldout_fingerprint")
                    and pev.get("template_sha256") == ev.get("template_sha256"))
        if same_set:
            out.update(baseline_return=(pev.get("policy") or {}).get("return_mean"),
                       baseline_source="the registry's evaluation of the production version (same held-out "
                                       "episodes and template)")
        else:
            out.update(_reevaluate_production(ws, cand, prow, ev))
    passed, reason = _verdict(out, pol, float(margin))
    return PromotionGate(**out, passed=passed, reason=reason)


def _verdict(g: Mapping[str, Any], pol: Mapping[str, Any], margin: float) -> tuple[bool, str]:
    c, b = g.get("candidate_return"), g.get("baseline_return")
    if c is None:
        return False, (f"{g['candidate']} has no held-out evaluation in the registry's records (registered before "
                       "the registry evaluated bundles itself: export and register it again as a new version)")
    if b is None:
        return False, (g.get("baseline_problem") or
                       f"the baseline ({g['baseline']}) has no return on the candidate's held-out episodes")
    if int(pol.get("mask_violations") or 0) > 0:
        return False, f"{g['candidate']} took masked actions in its evaluation ({pol['mask_violations']})"
    if not c > b + margin:
        return False, (f"{g['candidate']} does not beat {g['baseline']} on held-out episodes: mean return "
                       f"{c:.4g} vs {b:.4g} (needs > {b + margin:.4g})")
    return True, f"{g['candidate']} beats {g['baseline']}: mean return {c:.4g} vs {b:.4g} on held-out episodes"


def _reevaluate_production(ws: "Workspace", cand: Mapping[str, Any], prod: Mapping[str, Any],
                           ev: Mapping[str, Any]) -> dict[str, Any]:
    """The production policy re-run on the candidate's held-out episodes, with the protocol
    of the candidate's own evaluation (:func:`core.rl.evaluation.evaluate`: greedy, every
    held-out episode once per repeat, the same seeds)."""
    from core.rl.evaluation import _summarise  # deferred: loads torch
    from core.rl.rollouts import episode_stats  # deferred: loads torch and gymnasium

    cm, pm = cand["manifest"], prod["manifest"]
    src = "the production policy re-run on the candidate's held-out episodes"
    if cm["catalog_version"] != pm["catalog_version"]:
        return {"baseline_return": None, "baseline_source": src,
                "baseline_problem": (f"the production version acts over catalog {pm['catalog_version']}, the "
                                     f"candidate over {cm['catalog_version']}: they cannot be run on the same "
                                     "episodes; evaluate both on one held-out set before approving")}
    if not ws.conn.execute("SELECT 1 FROM runs WHERE id=?", (cm["run_id"],)).fetchone():
        return {"baseline_return": None, "baseline_source": src,
                "baseline_problem": f"the candidate's run {cm['run_id']} is not in this workspace, so the "
                                    "production policy cannot be re-run on its held-out episodes"}
    ctx = open_run(ws, cm["run_id"], need_policy=False)
    agent = load_bundle(_registered_bundle(prod), trust=trust_store(ws)).policy
    repeats, seed = int(ev.get("repeats") or 1), 0
    passes = [episode_stats(ctx.data.tables, agent, ctx.data.heldout_episodes, greedy=True,
                            every_episode=True, seed=seed + 1000 * r, support_episodes="all")
              for r in range(repeats)]
    pooled = _summarise(passes)
    return {"baseline_return": pooled.return_mean, "baseline_source": src,
            "baseline_episodes": pooled.episodes}


# --------------------------------------------------------------------------- the registry's own records
def _checked_events(ws: "Workspace", conn: "sqlite3.Connection", name: str, actor: Actor) -> list[RegistryEvent]:
    """The recorded events of ``name`` for a decision: refused (and logged) when the log
    lost events; each row the registry did not write is logged and left out."""
    log = _log(ws, name, conn)
    try:
        log.check_whole(name)
    except RegistryLogBroken as exc:
        security_event(ws, actor, "registry_log_broken", policy=name, reason=str(exc))
        raise
    for row in log.unrecorded:
        security_event(ws, actor, "registry_record_refused", policy=name, event_id=row.event.id,
                       event_type=row.event.event, version=row.event.version, by=row.event.actor, reason=row.reason)
    return log.recorded


def _registration(ws: "Workspace", actor: Actor, row: Mapping[str, Any],
                  events: Sequence[RegistryEvent]) -> RegistryEvent:
    """The recorded ``registered`` event of ``row``'s version, which the row must agree with
    (``policy_versions`` is a plain table; the event is signed by the registry)."""
    name, version = row["name"], row["version"]
    reg = next((e for e in events if e.event == "registered" and e.version == version), None)
    if reg is None or "trained_by" not in reg.detail:
        raise ConflictError(f"{name}@{version} has no registration the registry recorded itself (who trained the "
                            "run, its evaluation, signed by this workspace); export and register it again as a "
                            "new version")
    for key in ("bundle_sha256", "manifest_digest", "registered_by"):
        if reg.detail.get(key) != row[key]:
            reason = (f"the policy_versions row of {name}@{version} says {key} {str(row[key])[:16]!r}, the "
                      f"registry's signed registration {str(reg.detail.get(key))[:16]!r}")
            security_event(ws, actor, "registry_record_refused", policy=name, version=version,
                           table="policy_versions", field=key, reason=reason)
            raise ConflictError(f"{reason}: the row was changed after registration; the registry will not use it")
    return reg


def _current_approval(events: Sequence[RegistryEvent], version: str) -> RegistryEvent | None:
    """The recorded approval that makes ``version`` approved now: its latest ``approved``
    event not followed by a rollback away from it (which asks for a new approval)."""
    current = None
    for e in events:
        if e.event == "approved" and e.version == version:
            current = e
        elif e.event == "rolled_back" and e.detail.get("from") == version:
            current = None
    return current


def _approval_problems(approval: RegistryEvent, reg: RegistryEvent, name: str, version: str) -> list[str]:
    """Why a recorded approval does not let ``name@version`` be promoted (empty when it does)."""
    problems = []
    recorded_gate = approval.detail.get("gate")
    gate: dict[str, Any] = recorded_gate if isinstance(recorded_gate, dict) else {}
    if gate.get("passed") is not True or gate.get("candidate") != f"{name}@{version}":
        problems.append("it records no passing promotion gate of this version")
    if approval.role not in PERMISSIONS["approve"]:
        problems.append(f"{approval.actor} approved as {approval.role}, a role without the approve permission")
    who = approval.actor.casefold()
    for did, person in (("registered", reg.detail.get("registered_by")), ("trained", reg.detail.get("trained_by"))):
        if isinstance(person, str) and person.casefold() == who:
            problems.append(f"four-eyes rule: {approval.actor} {did} this version")
    bound = (approval.detail.get("registered"), approval.detail.get("manifest_digest"),
             approval.detail.get("bundle_sha256"))
    if bound != (reg.id, reg.detail.get("manifest_digest"), reg.detail.get("bundle_sha256")):
        problems.append("it approves other bytes than the registered bundle")
    return problems


def _verified_approval(ws: "Workspace", actor: Actor, row: Mapping[str, Any],
                       events: Sequence[RegistryEvent]) -> RegistryEvent:
    """The approval chain of ``row``'s version, re-checked from the recorded events at
    promotion: its signed registration (which the row agrees with), and an approval written
    by :func:`approve` after a passing gate, by a person holding the approve permission
    then, who neither registered the bundle nor trained the run, for the registered bytes."""
    name, version = row["name"], row["version"]
    reg = _registration(ws, actor, row, events)
    approval = _current_approval(events, version)
    problems = (["the registry recorded no approval of it"] if approval is None
                else _approval_problems(approval, reg, name, version))
    if approval is None or problems:
        security_event(ws, actor, "approval_refused", policy=f"{name}@{version}",
                       event_id=approval.id if approval else None, by=approval.actor if approval else None,
                       reason="; ".join(problems))
        raise ConflictError(f"{name}@{version} cannot be promoted: its approval does not hold "
                            f"({'; '.join(problems)}); approve it again (`rwb registry approve`)")
    return approval


def _not_counted(ws: "Workspace", name: str, version: str) -> str:
    """A note naming rows of ``version`` in the log that the registry did not write."""
    rows = [u for u in _log(ws, name).unrecorded if u.event.version == version]
    if not rows:
        return ""
    listed = ", ".join(f"event {u.event.id} ({u.event.event} by {u.event.actor})" for u in rows[:5])
    return f"; the log holds rows the registry did not write, which count for nothing: {listed}"


# --------------------------------------------------------------------------- approve
def approve(ws: "Workspace", actor: Actor, name: str, version: str, comment: str) -> PolicyVersionDetail:
    """Approve a candidate for promotion.  Needs ``approve``, a person who neither trained
    nor exported it (four-eyes), a comment saying why, and a passing promotion gate.  The
    approval is recorded for the registered bytes (their digests and registration event).
    A refused approval is recorded too: in the security log (``approve_refused``, with
    who, when and why), since the registry's own log holds only what it did."""
    with _refusal_recorded(ws, actor, "approve", policy=f"{name}@{version}", comment=str(comment or "").strip()):
        return _approve(ws, actor, name, version, comment)


def _approve(ws: "Workspace", actor: Actor, name: str, version: str, comment: str) -> PolicyVersionDetail:
    """:func:`approve`, its refusals raised to the caller."""
    authorize(ws, actor, "approve")
    if not isinstance(comment, str) or not comment.strip():
        raise InputError("say why you approve (a comment is required)", field="comment")
    row = _row(ws.conn, name, version)
    reg = _registration(ws, actor, row, _events(ws, name))
    # the registry's record, never the manifest: who registered it, who trained the run
    check_four_eyes(actor, reg.detail.get("registered_by"), reg.detail["trained_by"])
    _registered_bundle(row)
    gate = promotion_gate(ws, name, version)
    if not gate.passed:
        raise GateFailed(f"promotion gate: {gate.reason}")
    with ws.transaction() as conn:
        stage, stack = _replay(_checked_events(ws, conn, name, actor))
        if (stack[-1] if stack else None) != gate.production:
            raise ConflictError(f"the production version of {name} changed while the gate ran; approve again")
        current = stage.get(version)
        if current not in ("candidate", "rolled_back"):
            raise ConflictError(f"{name}@{version} is {current}; only a candidate (or a rolled-back version) "
                                "can be approved")
        _event(ws, conn, name, version, "approved", actor, comment.strip(),
               {"gate": to_jsonable(gate), "registered": reg.id, "manifest_digest": reg.detail["manifest_digest"],
                "bundle_sha256": reg.detail["bundle_sha256"]})
    return get_version(ws, name, version)


# --------------------------------------------------------------------------- refusals are recorded
#: The security-log event recording a refusal of each registry action
#: (:func:`core.govern.history.governance_history` lists them beside what was done).
REFUSED_EVENTS: dict[str, str] = {"register": "register_refused", "approve": "approve_refused",
                                  "promote": "promote_refused", "rollback": "rollback_refused"}


@contextlib.contextmanager
def _refusal_recorded(ws: "Workspace", actor: Actor, action: str, **subject: Any) -> Iterator[None]:
    """Write a refusal of ``action`` (a :class:`~core.base.errors.RwbError`: a role, the
    four-eyes rule, the gate, a bundle, a conflict, bad input) to the security log with who,
    what (``subject``) and why, then let it reach the caller.  When the log itself cannot be
    written, the refusal still reaches the caller, with a note saying so."""
    try:
        yield
    except RwbError as exc:
        try:
            security_event(ws, actor if isinstance(actor, Actor) else None, REFUSED_EVENTS[action],
                           action=action, **subject, reason=str(exc), error=type(exc).__name__)
        except OSError as log_error:
            exc.add_note(f"(the refusal could not be written to the security log: {log_error})")
        raise


# --------------------------------------------------------------------------- promote and rollback
def _writable_root(root: str | Path | None, what: str) -> Path:
    """The policies folder, refused (ConflictError, before anything is written) when this
    process cannot write it."""
    target: PromotionTarget = promotion_target(root)
    if not target.writable:
        raise ConflictError(f"cannot {what}: the policies folder {target.path} cannot be written ({target.reason}); "
                            "promote from a checkout this user may write, or point RWB_POLICIES_DIR at a folder it "
                            "may write")
    return Path(target.path)


@contextlib.contextmanager
def _folder_written(base: Path) -> Iterator[None]:
    """An operating-system error while writing the policies folder, as a refusal that says
    where (the registry's transaction is rolled back: nothing was recorded)."""
    try:
        yield
    except OSError as exc:
        raise ConflictError(f"the policies folder {base} could not be written ({exc}); nothing was recorded in "
                            "the registry") from None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on the policies folder (other workspaces may promote into it too)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_index(root: Path, index: Mapping[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".index.", suffix=".json.tmp", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # part of the package: readable like its other files
        os.replace(tmp, root / INDEX)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _install(ws: "Workspace", root: Path, row: Mapping[str, Any], approvals: list[dict[str, Any]]) -> Manifest:
    """Write the registered bundle into ``root/<name>/<version>/`` with ``approvals`` in its
    manifest, signed with ``ws``'s key: into a temp folder, verified there, then renamed
    into place."""
    members = read_members(_registered_bundle(row))
    manifest = Manifest.model_validate_json(members[MANIFEST])
    body = manifest.model_dump(mode="json", exclude={"digest"})
    body["approvals"] = [Approval.model_validate(a).model_dump(mode="json") for a in approvals]
    sealed = seal_manifest(body)
    target_parent = root / row["name"]
    target_parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{row['version']}.", suffix=".tmp", dir=target_parent))
    tmp.rmdir()
    try:
        write_folder(tmp, sealed, members, key=signing_key(ws))
        report = verify_bundle(tmp, trust=trust_store(ws))
        if not report.ok:
            raise BundleError(f"the promoted copy failed verification: {report.reason}", file=str(tmp))
        target = target_parent / row["version"]
        if target.exists():  # promoted before (e.g. rolled back, approved again): replace it whole
            old = target_parent / f".{row['version']}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sealed


def _index_entry(events: Sequence[RegistryEvent]) -> dict[str, Any] | None:
    """The index entry of one name, written from its recorded events alone (None when
    nothing of it is in production)."""
    stack = _replay(events)[1]
    if not stack:
        return None
    versions: dict[str, dict[str, Any]] = {}
    rolled_back = []
    for e in events:
        if e.event == "promoted":
            versions[e.version] = {"manifest_digest": e.detail.get("manifest_digest"), "promoted_at": e.at,
                                   "promoted_by": e.actor, "run_id": e.detail.get("run_id"),
                                   "approved_by": list(e.detail.get("approved_by") or [])}
        elif e.event == "rolled_back":
            restored = versions.setdefault(e.version, {})
            restored["manifest_digest"] = e.detail.get("manifest_digest")
            if e.detail.get("reinstalled"):
                restored["reinstalled_at"] = e.at
            rolled_back.append({"version": e.detail.get("from"), "at": e.at, "by": e.actor})
    entry: dict[str, Any] = {"active": stack[-1], "previous": list(reversed(stack[:-1])), "versions": versions,
                             "updated_at": events[-1].at}
    if rolled_back:
        entry["rolled_back"] = rolled_back
    return entry


def _publish(ws: "Workspace", actor: Actor, base: Path, names: Sequence[str]) -> dict[str, PolicyIndexEntry]:
    """Write the entries of ``names`` into ``base``'s ``index.json`` from the registry's
    recorded events, each signed with the workspace's key and carrying the id of the
    latest event it reflects; entries of other names (other registries') are kept as they
    are.  An entry found unsigned or edited is logged before it is replaced.  The caller
    holds the folder's lock; the events are committed."""
    path = base / INDEX
    try:
        document = read_index_document(base)
    except InputError as exc:
        security_event(ws, actor, "policy_index_refused", path=str(path), reason=exc.reason, rewritten=True)
        document = {"rwb_policies": 1, "policies": {}}
    key, trust = signing_key(ws), trust_store(ws)
    out = {}
    for name in names:
        log = _log(ws, name)
        try:
            log.check_whole(name)
        except RegistryLogBroken as exc:
            security_event(ws, actor, "registry_log_broken", policy=name, reason=str(exc))
            raise
        events = log.recorded
        old = document["policies"].get(name)
        problem = None if old is None else entry_signature_problem(name, old, trust)
        if problem is not None:
            security_event(ws, actor, "policy_index_refused", policy=name, path=str(path), reason=problem,
                           index_active=old.get("active"), rewritten=True)
        entry = _index_entry(events)
        if entry is None:
            raise ConflictError(f"nothing of {name} is in production in this workspace's registry: there is no "
                                "index entry to publish (promote a version first)")
        document["policies"][name] = sign_entry(key, name, entry, events[-1].id)
        out[name] = PolicyIndexEntry.from_document(name, document["policies"][name])
    _write_index(base, document)
    return out


def _published(ws: "Workspace", actor: Actor, base: Path, name: str, done: str) -> PolicyIndexEntry:
    """:func:`_publish` of ``name`` after a committed transition (``done``, in words): the
    registry holds it even when the index cannot be written, and the error says how to
    write it again."""
    try:
        return _publish(ws, actor, base, [name])[name]
    except OSError as exc:
        raise ConflictError(f"{done} in the registry, but the policies index in {base} could not be written "
                            f"({exc}); `rwb registry publish-index {name}` writes it from the registry's "
                            "records") from None


def promote(ws: "Workspace", actor: Actor, name: str, version: str, comment: str = "", *,
            root: str | Path | None = None) -> PolicyIndexEntry:
    """Make an approved version production: re-check its approval chain from the
    registry's recorded events, write it into the policies folder
    (``core/policies/<name>/<version>/``, or ``root`` / ``$RWB_POLICIES_DIR``) and write
    its signed entry in ``index.json``.  Needs ``promote``.  Returns the index entry of ``name``.

    Refused before anything is written when the folder cannot be written
    (:func:`~core.govern.policy_folder.promotion_target` says why); every refusal is
    recorded in the security log (``promote_refused``, with its reason)."""
    with _refusal_recorded(ws, actor, "promote", policy=f"{name}@{version}"):
        return _promote(ws, actor, name, version, comment, root)


def _promote(ws: "Workspace", actor: Actor, name: str, version: str, comment: str,
             root: str | Path | None) -> PolicyIndexEntry:
    """:func:`promote`, its refusals raised to the caller."""
    authorize(ws, actor, "promote")
    base = _writable_root(root, f"promote {name}@{version}")
    with _folder_written(base), _locked(base):
        with ws.transaction() as conn:
            events = _checked_events(ws, conn, name, actor)
            stage, stack = _replay(events)
            row = _row(conn, name, version)
            if stage.get(version) != "approved":
                raise ConflictError(f"{name}@{version} is {stage.get(version, 'not registered')}; only an approved "
                                    "version can be promoted (approve it first)" + _not_counted(ws, name, version))
            _verified_approval(ws, actor, row, events)
            sealed = _install(ws, base, row, _approvals(events, version))
            previous = stack[-1] if stack else None
            _event(ws, conn, name, version, "promoted", actor, comment,
                   {"from": previous, "path": str(base / name / version), "manifest_digest": sealed.digest,
                    "run_id": sealed.run_id, "approved_by": [a.by for a in sealed.approvals]})
        return _published(ws, actor, base, name, f"{name}@{version} is production")


def rollback(ws: "Workspace", actor: Actor, name: str, comment: str = "", *,
             root: str | Path | None = None) -> PolicyIndexEntry:
    """Make the previous production version of ``name`` active again.  Needs ``rollback``.

    The version rolled back from becomes ``rolled_back`` (it needs a new approval to be
    promoted again).  The restored version is re-verified in the policies folder against
    the digest the registry recorded when it installed it, and rewritten from the
    registry's copy when it is missing, damaged or another copy there; the event records
    the digest of the copy the registry installed, never one read from the folder.  Like
    :func:`promote`, refused when the folder cannot be written, and every refusal is
    recorded in the security log (``rollback_refused``)."""
    with _refusal_recorded(ws, actor, "rollback", policy=name):
        return _rollback(ws, actor, name, comment, root)


def _rollback(ws: "Workspace", actor: Actor, name: str, comment: str, root: str | Path | None) -> PolicyIndexEntry:
    """:func:`rollback`, its refusals raised to the caller."""
    authorize(ws, actor, "rollback")
    base = _writable_root(root, f"roll {name} back")
    with _folder_written(base), _locked(base):
        with ws.transaction() as conn:
            events = _checked_events(ws, conn, name, actor)
            _, stack = _replay(events)
            if len(stack) < 2:
                what = f"only {stack[-1]} was ever promoted" if stack else "nothing was promoted"
                raise ConflictError(f"{name} has no previous production version to roll back to ({what})")
            current, previous = stack[-1], stack[-2]
            row = _row(conn, name, previous)
            _registration(ws, actor, row, events)
            folder = base / name / previous
            recorded = _promoted_digest(events, previous)
            report = verify_bundle(folder, trust=trust_store(ws)) if folder.is_dir() else None
            intact = recorded is not None and report is not None and report.ok and \
                (report.manifest or {}).get("digest") == recorded
            digest = recorded if intact else _install(ws, base, row, _approvals(events, previous)).digest
            _event(ws, conn, name, previous, "rolled_back", actor, comment,
                   {"from": current, "reinstalled": not intact, "path": str(folder), "manifest_digest": digest})
        return _published(ws, actor, base, name, f"{name} is rolled back to {previous}")


def publish_index(ws: "Workspace", actor: Actor, name: str | None = None, *,
                  root: str | Path | None = None) -> list[PolicyIndexEntry]:
    """Write the index entry of ``name`` (or of every name this registry has in production)
    again from the registry's recorded events, signed: after an index was edited, lost, or
    written by a version that did not sign it.  Changes nothing in the registry.  Needs
    ``promote``."""
    authorize(ws, actor, "promote")
    base = policies_root(root)
    names = [name] if name is not None else [n for n in policy_names(ws) if _state(ws, n)[1]]
    if not names:
        raise ConflictError("nothing is in production in this workspace's registry: there is no index to publish")
    with _locked(base):
        return list(_publish(ws, actor, base, names).values())


__all__ = ["EVENTS", "GATE_MARGIN", "GateFailed", "PolicyIndexEntry", "PolicyVersion", "PolicyVersionDetail",
           "PromotionGate", "REFUSED_EVENTS", "RecordedApproval", "Registration", "RegistryEvent", "STAGES",
           "UnrecordedEvent", "VersionComparison", "aliases", "approve", "bundle_bytes", "compare_versions",
           "get_version", "history", "list_versions", "next_version", "policy_names", "previous_version",
           "production_version", "promote", "promoted_digest", "promotion_gate", "publish_index", "register",
           "rollback", "unrecorded_events"]
