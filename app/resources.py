"""The one place where the app caches models, connections and bundles.

``st.cache_resource`` holds objects that are shared and never mutated by a page
(the workspace connection, the embedder); ``st.cache_data`` holds derived data.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import streamlit as st

from core.records.catalog import Catalog, catalog_for_dataset
from core.data.episode_views import dataset_version
from core.base.errors import RwbError
from core.records.store import Workspace, WorkspaceError, default_workspace_path
from core.sample.workspace_setup import WorkspaceStatus, init_workspace

#: What a page shows as a message instead of a traceback: the errors core raises for bad
#: input, missing rights, conflicts and unreadable workspaces.
USER_ERRORS = (RwbError, WorkspaceError)


def flash(key: str, kind: str, text: str) -> None:
    """Keep a message for the page's next run (a button's callback runs before it)."""
    st.session_state[key] = (kind, text)


def show_flash(key: str) -> None:
    """Show, once, the message :func:`flash` kept under ``key`` (error, info or success)."""
    kept = st.session_state.pop(key, None)
    if kept is not None:
        {"error": st.error, "info": st.info}.get(kept[0], st.success)(kept[1])

if TYPE_CHECKING:  # pragma: no cover
    from core.access.audit import AuditRecord, AuditStats
    from core.access.users import Actor, Session
    from core.guard.review import ReviewQueueStats
    from core.rewards import ScoreResult, StepsFrame, Template
    import numpy as np

    from core.rewards.calibration import CalibrationReport
    from core.rewards.label_queue import Proposals
    from core.rewards.views import PyramidReport
    from core.rl.doctor import Diagnosis
    from core.rl.evaluation import EvaluationReport
    from core.state.statemap import StateMapReport
    from core.tuning import StudyReport


def workspace_path() -> str:
    return str(os.environ.get("RWB_WORKSPACE") or default_workspace_path())


@st.cache_resource(show_spinner=False)
def _workspace(path: str) -> Workspace:
    return Workspace.open(path)


def _session_path() -> str:
    return st.session_state.get("workspace_path") or workspace_path()


def workspace() -> Workspace:
    """The workspace of this app session (``RWB_WORKSPACE`` or ./workspace)."""
    return _workspace(_session_path())


def ensure_session() -> None:
    """Shared session state owned by the router."""
    st.session_state.setdefault("workspace_path", workspace_path())


# --------------------------------------------------------------------------- workspace set-up
@st.cache_resource(show_spinner=False)
def _workspace_initialised(path: str) -> WorkspaceStatus:
    # Once per workspace and server process; a failure is not cached, so the next run retries.
    return init_workspace(_workspace(path))


def initialise_workspace() -> WorkspaceStatus:
    """Create the workspace and import the sample datasets into an empty one (first start)."""
    return _workspace_initialised(_session_path())


# --------------------------------------------------------------------------- episodes
@st.cache_resource(show_spinner="Building the action catalog…")
def _catalog(path: str, dataset: str, version: str) -> Catalog:
    # `version` changes with the dataset's episodes and tools, so an import rebuilds it.
    return catalog_for_dataset(_workspace(path), dataset)


def catalog(dataset: str) -> Catalog:
    """The action catalog of ``dataset`` (its tool schemas, or the calls observed in it)."""
    return _catalog(_session_path(), dataset, dataset_version(workspace(), dataset))


# --------------------------------------------------------------------------- state explorer
@st.cache_data(show_spinner=False, ttl=30)
def reward_templates() -> dict[str, str]:
    """Shipped reward templates: name -> a digest of the file (so an edit recomputes maps)."""
    import hashlib
    from pathlib import Path

    from core.rewards import list_templates

    return {t["name"]: hashlib.sha256(Path(t["path"]).read_bytes()).hexdigest()[:16]
            for t in list_templates()}


@st.cache_data(show_spinner=False, max_entries=8)
def _states_map(path: str, dataset: str, version: str, space: str, gating: str, intent: str,
                max_points: int, clusters: int, seed: int, template: str | None,
                template_version: str | None) -> "StateMapReport":
    # `version` (and `template_version`) change with the dataset (and the template), so an
    # import or an edit recomputes; the core function also keeps the map as a workspace
    # artifact, so a restarted app loads it instead of redoing it.
    # Imported here: the encoder pulls in torch, which the other pages do not need.
    from core.state.features import StateEncoderConfig
    from core.state.statemap import TsneConfig, states_map

    return states_map(_workspace(path), dataset=dataset, space=space,
                      encoder=StateEncoderConfig(gating=gating, intent=intent, seed=seed),  # type: ignore[arg-type]
                      tsne=TsneConfig(seed=seed), max_points=max_points, clusters=clusters,
                      template=template)


def state_map(dataset: str, *, space: str = "encoded", gating: str = "on", intent: str = "on",
              max_points: int = 20000, clusters: int = 8, seed: int = 0,
              template: str | None = None) -> "StateMapReport":
    """The state map, fidelity and entropy of ``dataset`` (computed once, then cached)."""
    template_version = reward_templates().get(template) if template else None
    return _states_map(_session_path(), dataset, dataset_version(workspace(), dataset), space, gating,
                       intent, max_points, clusters, seed, template, template_version)


# --------------------------------------------------------------------------- reward pyramid
@st.cache_resource(show_spinner=False, max_entries=4)
def _reward_frame(path: str, dataset: str, version: str) -> "StepsFrame":
    # `version` changes with the dataset's episodes and tools: an import rebuilds the frame.
    from core.rewards import load_frame

    return load_frame(_workspace(path), dataset)


@st.cache_resource(show_spinner=False, max_entries=16)
def _scored(path: str, dataset: str, version: str, components_hash: str,
            _template: "Template") -> "ScoreResult":
    # Keyed by the template's component classes and parameters, not its weights, gating or
    # expectations: every edit of those reuses this result (a matrix product, see
    # core.rewards.views.rescore).  A parameter edit changes the key; the engine's on-disk
    # component cache then recomputes only the component whose parameters changed.
    from core import rewards

    return rewards.score(_workspace(path), _template, frame=_reward_frame(path, dataset, version))


def pyramid_report(dataset: str, template: "Template") -> "PyramidReport":
    """The Reward Pyramid page's view of ``template`` on ``dataset``: components are scored
    once per (dataset version, component parameters); weights, gating and expectations are
    applied to the cached component matrix."""
    from core.rewards.views import pyramid_report as build_report

    path = _session_path()
    base = _scored(path, dataset, dataset_version(workspace(), dataset), template.components_hash(),
                   template)
    return build_report(base, template)


def labels_version(dataset: str) -> int:
    """The version of ``dataset``'s label set (a cache key: a new label changes it)."""
    from core.rewards.labels import labels_version as version_of

    return version_of(workspace(), dataset)


@st.cache_data(show_spinner=False, max_entries=8)
def _outcomes(path: str, dataset: str, version: str, labels: int) -> tuple["np.ndarray", "np.ndarray"]:
    # People's labels over the recorded outcomes: keyed by the label set's version too.
    from core.rewards.labels import dataset_outcomes

    return dataset_outcomes(_workspace(path), dataset)


@st.cache_data(show_spinner=False, max_entries=16)
def _calibration(path: str, dataset: str, version: str, labels_at: int, template_text: str, n_boot: int,
                 _template: "Template") -> "CalibrationReport":
    # Keyed by the whole template's text: weights, gating and return terms all move the
    # returns it ranks, so coming back to a template already seen reads it from here.
    from core.rewards.calibration import calibrate_result

    labels, groups = _outcomes(path, dataset, version, labels_at)
    return calibrate_result(pyramid_report(dataset, _template).result, labels, groups, n_boot=n_boot)


def calibration(dataset: str, template: "Template", n_boot: int = 100) -> "CalibrationReport":
    """Outcome calibration of ``template`` on ``dataset`` (outcomes and task groups are read
    once per dataset and label set version; the scores come from :func:`pyramid_report`'s
    cache; each template is calibrated once per dataset and label set version)."""
    return _calibration(_session_path(), dataset, dataset_version(workspace(), dataset), labels_version(dataset),
                        template.to_yaml(), n_boot, template)


@st.cache_data(show_spinner=False, max_entries=8)
def _learning_curve(path: str, dataset: str, version: str, labels_at: int) -> Any:
    from core.rewards.label_queue import dataset_learning_curve

    return dataset_learning_curve(_workspace(path), dataset)


def learning_curve(dataset: str) -> Any:
    """Held-out AUC against the number of labelled episodes on ``dataset``, once per dataset
    and label set version (:func:`core.rewards.label_queue.dataset_learning_curve`)."""
    return _learning_curve(_session_path(), dataset, dataset_version(workspace(), dataset), labels_version(dataset))


@st.cache_data(show_spinner=False, max_entries=8)
def _label_proposals(path: str, dataset: str, version: str, labels_at: int, n: int) -> "Proposals":
    from core.rewards.label_queue import propose_next

    return propose_next(_workspace(path), dataset, n)


def label_proposals(dataset: str, n: int = 5) -> "Proposals":
    """The next episodes of ``dataset`` to label, once per dataset and label set version: a
    new label proposes afresh (:func:`core.rewards.label_queue.propose_next`)."""
    return _label_proposals(_session_path(), dataset, dataset_version(workspace(), dataset), labels_version(dataset), n)


# --------------------------------------------------------------------------- acting user
#: Where acting_user() keeps the reason a session ended, for the next page to show.
SESSION_FLASH = "session_flash"
#: The session cookie this tab has looked at already: a page load sends one cookie, and
#: once this tab signed out (or found it ended) it must not sign the tab in again.
_COOKIE_SEEN = "session_cookie_seen"
#: A hand-off ticket whose cookie the browser has not fetched yet (rwb_app.session_cookie).
_COOKIE_TICKET = "session_cookie_ticket"
#: Who the last full run said acts (``str(actor)``, or None), for who_acts_changed().
_WHO_SHOWN = "who_acts_shown"


def start_session(session: "Session") -> None:
    """Make ``session`` (a fresh sign-in) this tab's, and hand its cookie to the browser so
    that a reload, a typed address or a new tab stays signed in."""
    from core.access.users import SESSION_MAX_S, session_cookie

    st.session_state["actor"] = session.actor
    st.session_state["session_token"] = session.token
    value = session_cookie(workspace(), session)
    _send_cookie(value, max_age=int(session.created_at + SESSION_MAX_S - time.time()))


def sign_out() -> None:
    """End this tab's session in the workspace (every tab and reload of it is signed out)
    and delete the browser's cookie."""
    from core.access.users import end_session

    token = st.session_state.pop("session_token", None)
    st.session_state.pop("actor", None)
    if token is not None:
        end_session(workspace(), token)
    _send_cookie(None, max_age=0)


def _send_cookie(value: str | None, *, max_age: int) -> None:
    from rwb_app import session_cookie

    ticket = session_cookie.issue(value, max_age)
    if ticket is None:
        st.session_state.pop(_COOKIE_TICKET, None)
    else:
        st.session_state[_COOKIE_TICKET] = ticket


def hand_off_cookie() -> None:
    """Let the browser fetch a cookie this tab set or deleted (the router calls this on
    every run until the browser has it, so a run cut short by another does not lose it)."""
    from rwb_app import session_cookie

    ticket = st.session_state.get(_COOKIE_TICKET)
    if ticket is None:
        return
    if session_cookie.pending(ticket):
        session_cookie.hand_off(ticket)
    else:
        del st.session_state[_COOKIE_TICKET]


def _resume_from_cookie(ws: Workspace) -> None:
    """Sign this tab in from the browser's session cookie (a reload, a typed address, a new
    tab), once per cookie; a cookie whose session ended is deleted, saying why."""
    from rwb_app import session_cookie
    from core.access.users import SessionEnded, session_actor, session_cookie_token

    value = session_cookie.browser_cookie()
    if value is None or st.session_state.get(_COOKIE_SEEN) == value:
        return
    st.session_state[_COOKIE_SEEN] = value
    try:
        token = session_cookie_token(ws, value)
        actor = session_actor(ws, token)
    except SessionEnded as exc:
        flash(SESSION_FLASH, "info", _sentence(exc))
        _send_cookie(None, max_age=0)
        return
    st.session_state["actor"] = actor
    st.session_state["session_token"] = token


def _sentence(exc: Exception) -> str:
    text = str(exc)
    return text[:1].upper() + text[1:]


def _who_acts(ws: Workspace, *, touch: bool) -> "Actor | None":
    """Who acts in this tab now (SessionEnded when its session ended); see acting_user()."""
    from core.access.users import current_user, multi_user, session_actor

    actor = st.session_state.get("actor")
    token = st.session_state.get("session_token")
    if actor is not None and token is not None:
        return session_actor(ws, token, touch=touch)
    if actor is not None:
        return actor  # a session without a token is one that code set up (tests, notebooks)
    return None if multi_user(ws) else current_user(ws)


def acting_user() -> "Actor | None":
    """Who acts in this session: the signed-in user (stored under ``"actor"`` in the session
    state by the sign-in, with its session token under ``"session_token"``, or restored from
    the browser's session cookie), else the local admin of a workspace without users; None
    when the workspace has users and nobody signed in (pages then only read).  The
    workspace's mode and the session are read again on every run: once the session has
    expired or was revoked (sign-out, password or role changed), the user is signed out
    and the reason kept under :data:`SESSION_FLASH`.  ``core`` checks the permission again
    on every call."""
    from core.access.users import SessionEnded, multi_user

    ws = workspace()
    if "actor" not in st.session_state and multi_user(ws):
        _resume_from_cookie(ws)
    try:
        actor = _who_acts(ws, touch=True)
    except SessionEnded as exc:
        for key in ("actor", "session_token"):
            st.session_state.pop(key, None)
        flash(SESSION_FLASH, "info", _sentence(exc))
        _send_cookie(None, max_age=0)
        actor = _who_acts(ws, touch=True)
    else:
        if st.session_state.get("session_token") is not None:
            st.session_state["actor"] = actor
    st.session_state[_WHO_SHOWN] = None if actor is None else str(actor)
    return actor


def who_acts_changed() -> bool:
    """Whether who acts in this tab is no longer who its last run of acting_user() found:
    users were added to a workspace that had none, the session ended or the role changed
    elsewhere.  A look that is not the user's activity (it does not keep the session alive)."""
    from core.access.users import SessionEnded

    if _WHO_SHOWN not in st.session_state:
        return False  # no run has said who acts yet
    try:
        actor = _who_acts(workspace(), touch=False)
    except SessionEnded:
        actor = None
    return (None if actor is None else str(actor)) != st.session_state.get(_WHO_SHOWN)


# --------------------------------------------------------------------------- training and diagnostics
@st.cache_data(show_spinner=False, ttl=30)
def _template_specs(path: str) -> list[str]:
    from core.rewards.views import template_options

    return [o.spec for o in template_options(_workspace(path))]


def template_specs() -> list[str]:
    """Every reward template version a run can train against (``name@N``), newest first."""
    return _template_specs(_session_path())


def refresh_template_specs() -> None:
    """Forget the cached template versions (after this session saved a new one)."""
    _template_specs.clear()


@st.cache_data(show_spinner=False, max_entries=64)
def _run_curves(path: str, run_ids: tuple[str, ...], progress: tuple) -> dict:
    # `progress` (updates and status of each run) changes with every recorded update, so a
    # refresh that finds no new update reuses the curves.
    from core.rl.runs import run_curves

    return run_curves(_workspace(path), list(run_ids))


def run_curves(run_ids: tuple[str, ...]) -> dict:
    """Every metric curve of ``run_ids`` (core.rl.runs.run_curves), recomputed when a run records an update."""
    from core.rl.runs import run_progress

    return _run_curves(_session_path(), tuple(run_ids), run_progress(workspace(), run_ids))


@st.cache_data(show_spinner=False, max_entries=16)
def _diagnosis(path: str, run_id: str, checkpoint: int | None) -> "Diagnosis":
    # Keyed by the run's latest checkpoint: a new checkpoint is a new policy to diagnose.
    from core.rl.doctor import diagnose

    return diagnose(_workspace(path), run_id)


def diagnosis(run_id: str) -> "Diagnosis":
    """The four-step diagnosis of ``run_id`` (core.rl.doctor.diagnose), once per checkpoint."""
    from core.rl.runs import latest_checkpoint

    ckpt = latest_checkpoint(workspace(), run_id)
    return _diagnosis(_session_path(), run_id, None if ckpt is None else ckpt.update_idx)


@st.cache_data(show_spinner=False, max_entries=16)
def _evaluation(path: str, run_id: str, checkpoint: int | None, repeats: int,
                dataset: str | None) -> "EvaluationReport":
    from core.rl.evaluation import evaluate

    return evaluate(_workspace(path), run_id, repeats=repeats, dataset=dataset)


def evaluation(run_id: str, repeats: int = 3, dataset: str | None = None) -> "EvaluationReport":
    """The held-out evaluation of ``run_id`` (core.rl.evaluation.evaluate), once per checkpoint:
    on its own held-out split, or on every episode of another workspace ``dataset``."""
    from core.rl.runs import latest_checkpoint

    ckpt = latest_checkpoint(workspace(), run_id)
    return _evaluation(_session_path(), run_id, None if ckpt is None else ckpt.update_idx, repeats, dataset)


# --------------------------------------------------------------------------- review queue and audit
@st.cache_data(show_spinner=False, ttl=5)
def _review_queue_stats(path: str) -> "ReviewQueueStats":
    from core.guard.review import stats

    return stats(_workspace(path))


def review_queue_stats() -> "ReviewQueueStats":
    """Review-queue statistics (core.guard.review.stats), refreshed every few seconds and after
    every claim or decision (:func:`refresh_review_queue`)."""
    return _review_queue_stats(_session_path())


def refresh_review_queue() -> None:
    """Forget the cached queue statistics (after this session changed the queue)."""
    _review_queue_stats.clear()


@st.cache_data(show_spinner=False, ttl=5)
def _audit_summary(path: str) -> "AuditStats":
    from core.access.audit import stats

    return stats(_workspace(path))


def audit_summary() -> "AuditStats":
    """Counts of the audit trail (core.access.audit.stats), refreshed every few seconds."""
    return _audit_summary(_session_path())


@st.cache_data(show_spinner=False, ttl=5, max_entries=32)
def _audit_records(path: str, episode_id: str | None, policy_version: str | None, since: str | None,
                   until: str | None, final_action: int | str | None, limit: int) -> list[AuditRecord]:
    from core.access.audit import list_records

    return list_records(_workspace(path), episode_id=episode_id, policy_version=policy_version, since=since,
                        until=until, final_action=final_action, limit=limit)


def audit_records(*, episode_id: str | None = None, policy_version: str | None = None, since: str | None = None,
                  until: str | None = None, final_action: int | str | None = None,
                  limit: int = 200) -> list[AuditRecord]:
    """Audit records matching the filters, newest first (core.access.audit.list_records); the trail
    only grows, so a few seconds of caching never shows a changed record."""
    return _audit_records(_session_path(), episode_id, policy_version, since, until, final_action, limit)


# --------------------------------------------------------------------------- tuning
@st.cache_data(show_spinner=False, max_entries=16)
def _tuning_report(path: str, name: str, fingerprint: tuple) -> "StudyReport":
    # `fingerprint` (trial count, storage) changes whenever a worker writes trials, so a
    # refresh without new trials reuses the report (its parameter importances take seconds on a large study).
    from core.tuning import study_report

    return study_report(_workspace(path), name)


def tuning_report(name: str) -> "StudyReport":
    """The Tuning page's report of study ``name`` (recomputed only when trials were added)."""
    from core.tuning import study_fingerprint

    ws = workspace()
    return _tuning_report(_session_path(), name, (*study_fingerprint(ws, name), len(_runs_of(ws, name))))


def _runs_of(ws: Workspace, name: str) -> list:
    from core.tuning import study_runs

    return [(r.id, r.status, r.trials_done) for r in study_runs(ws, name)]


@st.cache_data(show_spinner=False, max_entries=32)
def _space_rows(path: str, template: str, withhold: bool) -> list[dict]:
    from core.tuning import space_rows

    return space_rows(_workspace(path), template, withhold=withhold)


def tuning_space(template: str, withhold: bool = True) -> list[dict]:
    """Default bounds rows of ``template`` for the Tuning page's table."""
    return _space_rows(_session_path(), template, withhold)
