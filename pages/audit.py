"""Audit: browse and filter the record of every served decision; export records or served episodes."""

from __future__ import annotations

import time
from pathlib import Path

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent, user_message
from core.access import audit
from core.base.results import to_jsonable

USER_ERRORS = resources.USER_ERRORS

st.title("Audit")
st.caption("One append-only record per decision the engine served: the input's hash, the baseline's "
           "action, the policy's candidates with probability and reward estimate, the action served and "
           "its reward components. Export them, or export the served episodes to re-import and retrain.")

ws = resources.workspace()
actor = resources.acting_user()
summary = resources.audit_summary()
if summary.records == 0:
    st.info("No decisions recorded yet. They appear here once a promoted policy serves requests: "
            "promote one on the **Policies** page, then let production decide requests with it "
            "(in-process, or through the HTTP decision service).")
    cli_equivalent("rwb serve decide --policy NAME --request JSON")
    st.stop()

c1, c2, c3 = st.columns([1, 1, 2])
c1.metric("Records", f"{summary.records:,}")
c2.metric("Episodes", f"{summary.episodes:,}")
# times as text, which wraps: a metric's large figure cuts a timestamp in a quarter of the page
c3.markdown(f"**First decision** {(summary.first or '—')[:19].replace('T', ' ')} UTC  \n"
            f"**Last decision** {(summary.last or '—')[:19].replace('T', ' ')} UTC")

# --------------------------------------------------------------------------- filters
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
    st.stop()

if not records:
    st.info("No record matches these filters.")
else:
    st.dataframe([{"time": r.timestamp, "episode": r.episode_id, "policy": r.policy_version,
                   "baseline action": r.rde_action, "final action": r.final_action,
                   "candidates": ", ".join(f"{c.id} (p {c.prob:.2f}, est {c.reward_est:.2f})"
                                           for c in r.rl_candidates) or "—",
                   "reward components": ", ".join(f"{c.name} {c.value:+.3f}" for c in r.reward_components) or "—",
                   "decision": r.decision_id} for r in records], hide_index=True, width="stretch")
    picked = st.selectbox("Record", [r.decision_id for r in records], key="audit_record",
                          format_func=lambda d: next(f"{r.timestamp} · {r.episode_id} · {d}"
                                                     for r in records if r.decision_id == d))
    st.json(to_jsonable(next(r for r in records if r.decision_id == picked)))

# --------------------------------------------------------------------------- export
st.subheader("Export")
if actor is None or not actor.can("export_audit"):
    st.info("Exporting the trail needs an analyst, approver or admin (sign in).")
else:
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
        what = (f"{exported['episodes']} episodes ({exported['records']} decisions)" if exported["as_episodes"]
                else f"{exported['records']} records")
        st.success(f"Exported {what} to `{exported['path']}`.")
        path = Path(exported["path"])
        if path.is_file():
            st.download_button("Download", data=path.read_bytes(), file_name=path.name,
                               mime="application/jsonl", key="audit_download")
