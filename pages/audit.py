"""Audit: who decided what.  The decisions people made in the workbench (template saves,
labels, reviews, registrations, approvals, promotions and rollbacks, refused ones too) beside
the record of every decision production served; export records or served episodes."""

from __future__ import annotations

import time
from datetime import date, timedelta
from pathlib import Path

import streamlit as st

from rwb_app import resources
from rwb_app.fmt import number, signed
from rwb_app.messages import cli_equivalent, user_message
from core.access import audit
from core.base.results import to_jsonable
from core.govern.history import KINDS, governance_history, governance_people

USER_ERRORS = resources.USER_ERRORS
#: The outcome filter's choices and what each asks the history for.
OUTCOME_CHOICES = {"accepted or refused": None, "accepted only": "accepted", "refused only": "refused"}
#: Refused decisions spelled out above the table, newest first.
REFUSALS_SHOWN = 5

st.title("Audit")
st.caption("Who decided what. **Made in the workbench**: every reward template saved, outcome labelled, "
           "review decided and policy registered, approved, promoted or rolled back — and every one of these "
           "the workbench refused, with the reason. **Served in production**: one append-only record per "
           "decision the engine served.")

ws = resources.workspace()
actor = resources.acting_user()
people_tab, served_tab = st.tabs(["Decisions made in the workbench", "Decisions served in production"],
                                 key="audit_tab", on_change="rerun")


def _day(value: date | None, *, after: bool = False) -> str | None:
    """A picked day as the history's time bound (``after``: the day after, so the day is included)."""
    if value is None:
        return None
    return (value + timedelta(days=1) if after else value).isoformat()


def _details(details: dict) -> str:
    return "; ".join(f"{k}: {number(v) if isinstance(v, float) else v}" for k, v in details.items()
                     if v not in (None, "", [])) or "—"


# --------------------------------------------------------------------------- made in the workbench
with people_tab:
    with st.form("audit_history_filter"):
        h1, h2, h3 = st.columns(3)
        kinds = h1.multiselect("What", list(KINDS), format_func=KINDS.__getitem__, key="audit_history_kinds",
                               placeholder="every kind")
        person = h2.selectbox("Who", ["anyone", *governance_people(ws)], key="audit_history_who")
        outcome = h3.selectbox("Outcome", list(OUTCOME_CHOICES), key="audit_history_outcome",
                               help="Refused: the workbench said no (a role without the permission, the four-eyes "
                                    "rule, a policy that does not beat its baseline, a folder it cannot write …); "
                                    "the reason is in the Why column.")
        h4, h5, h6 = st.columns(3)
        day_from = h4.date_input("From (day, UTC)", value=None, key="audit_history_from")
        day_to = h5.date_input("To (day, UTC, included)", value=None, key="audit_history_to")
        about = h6.text_input("About (text in the subject)", key="audit_history_about",
                              placeholder="a template, a policy, a dataset …")
        st.form_submit_button("Show")
    try:
        events = governance_history(ws, kinds=kinds or None, who=None if person == "anyone" else person,
                                    subject=about or None, since=_day(day_from), until=_day(day_to, after=True),
                                    outcome=OUTCOME_CHOICES[outcome])
    except USER_ERRORS as exc:
        st.error(user_message(exc))
        events = []
    refused = sum(e.outcome == "refused" for e in events)
    m1, m2 = st.columns(2)
    m1.metric("Decisions shown", number(len(events)), help="Newest first, at most 500: narrow the filters to see "
                                                           "older ones.")
    m2.metric("Refused", number(refused), help="Decisions the workbench refused, each with its reason.")
    if not events:
        st.info("No decision matches these filters. Saving a reward template, labelling an episode, deciding a "
                "review and approving or promoting a policy each leave a line here.")
    else:
        refusals = [e for e in events if e.outcome == "refused"]
        for e in refusals[:REFUSALS_SHOWN]:  # what went wrong first, in words; every decision is in the table
            st.warning(f"**{e.kind_label} refused** — {e.subject}, asked by {e.who or 'nobody signed in'}"
                       f"{f' ({e.role})' if e.role else ''} on {e.when[:16].replace('T', ' ')} UTC. Why: {e.reason}")
        if len(refusals) > REFUSALS_SHOWN:
            st.caption(f"{number(len(refusals) - REFUSALS_SHOWN)} more refused decisions are in the table.")
        st.dataframe([{"When (UTC)": e.when[:19].replace("T", " "), "Who": e.who or "—",
                       "Role": e.role or "—", "What": e.kind_label, "About": e.subject, "Decision": e.decision,
                       "Outcome": e.outcome, "Why": e.reason or "—", "Details": _details(e.details)}
                      for e in events], hide_index=True, width="stretch",
                     column_config={"Outcome": st.column_config.TextColumn(
                         help="accepted: it happened; refused: the workbench said no, and Why says why")})
    cli_equivalent("rwb audit history --refused")

# --------------------------------------------------------------------------- served in production
def _served_records(summary: audit.AuditStats) -> dict:
    """The counts, the filters and the records they pick; returns the filters (for the export)."""
    c1, c2, c3 = st.columns([1, 1, 2])
    c1.metric("Records", number(summary.records), help="One per decision the engine served.")
    c2.metric("Episodes", number(summary.episodes), help="Served sessions: records sharing an episode id.")
    # times as text, which wraps: a metric's large figure cuts a timestamp in a quarter of the page
    c3.markdown(f"**First decision** {(summary.first or '—')[:19].replace('T', ' ')} UTC  \n"
                f"**Last decision** {(summary.last or '—')[:19].replace('T', ' ')} UTC")
    versions = ["any"] + sorted(summary.per_policy_version)
    with st.form("audit_filter"):
        f1, f2, f3 = st.columns(3)
        version = f1.selectbox("Policy version", versions, key="audit_version")
        episode = f2.text_input("Episode id", key="audit_episode", placeholder="any")
        action = f3.text_input("Final action (token id)", key="audit_action", placeholder="any")
        f4, f5, f6 = st.columns(3)
        since = f4.text_input("From (ISO time, UTC)", key="audit_since", placeholder="2025-03-01T09:00:00Z")
        until = f5.text_input("Before (ISO time, UTC)", key="audit_until", placeholder="any")
        limit = f6.number_input("At most", min_value=10, max_value=5000, value=200, step=50, key="audit_limit")
        st.form_submit_button("Apply")
    final_action: int | str | None = action.strip() or None
    if final_action is not None and final_action.lstrip("-").isdigit():
        final_action = int(final_action)
    filters = {"episode_id": episode.strip() or None, "policy_version": None if version == "any" else version,
               "since": since.strip() or None, "until": until.strip() or None, "final_action": final_action}
    try:
        records = resources.audit_records(**filters, limit=int(limit))
    except USER_ERRORS as exc:
        st.error(user_message(exc))
        return filters
    if not records:
        st.info("No record matches these filters.")
        return filters
    st.dataframe([{"time": r.timestamp, "episode": r.episode_id, "policy": r.policy_version,
                   "baseline action": r.rde_action, "final action": r.final_action,
                   "candidates": ", ".join(f"{c.id} (chance {number(c.prob, 'share')}, "
                                           f"estimated reward {number(c.reward_est)})" for c in r.rl_candidates)
                   or "—",
                   "reward components": ", ".join(f"{c.name} {signed(c.value)}" for c in r.reward_components) or "—",
                   "decision": r.decision_id} for r in records], hide_index=True, width="stretch")
    picked = st.selectbox("Record", [r.decision_id for r in records], key="audit_record",
                          format_func=lambda d: next(f"{r.timestamp} · {r.episode_id} · {d}"
                                                     for r in records if r.decision_id == d))
    with st.expander("The record as stored (exact figures)"):
        st.json(to_jsonable(next(r for r in records if r.decision_id == picked)))
    return filters


def _export(filters: dict) -> None:
    st.subheader("Export")
    if actor is None or not actor.can("export_audit"):
        st.info("Exporting the trail needs an analyst, approver or admin (sign in).")
        return
    as_episodes = st.checkbox("As served episodes (rwb JSONL, ready to import and relabel)", key="audit_as_episodes")
    if st.button("Export with these filters", key="audit_export"):
        kind = "episodes" if as_episodes else "records"
        out = ws.artifact_dir("exports") / f"audit-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        with st.spinner("Writing the export…"):
            try:
                result = audit.export(ws, actor, out, as_episodes=as_episodes, episode_id=filters["episode_id"],
                                      policy_version=filters["policy_version"], since=filters["since"],
                                      until=filters["until"])
            except USER_ERRORS as exc:
                st.error(user_message(exc))
            else:
                st.session_state["audit_exported"] = result.to_dict()
    exported = st.session_state.get("audit_exported")
    if exported:
        what = (f"{number(exported['episodes'])} episodes ({number(exported['records'])} decisions)"
                if exported["as_episodes"] else f"{number(exported['records'])} records")
        st.success(f"Exported {what} to `{exported['path']}`.")
        path = Path(exported["path"])
        if path.is_file():
            st.download_button("Download", data=path.read_bytes(), file_name=path.name,
                               mime="application/jsonl", key="audit_download")


with served_tab:
    summary = resources.audit_summary()
    if summary.records == 0:
        st.info("No served decisions recorded yet. They appear here once a promoted policy serves requests: "
                "promote one on the **Policies** page, then let production decide requests with it "
                "(in-process, or through the HTTP decision service).")
        cli_equivalent("rwb serve decide --policy NAME --request JSON")
    else:
        _export(_served_records(summary))
