"""Policies: export trained runs as bundles, compare their evaluations, approve, promote, roll back."""

from __future__ import annotations

from typing import Any

import streamlit as st

from rwb_app import resources
from rwb_app.fmt import number
from rwb_app.messages import cli_equivalent, user_message
from core.base.results import to_jsonable
from core.govern import registry
from core.govern.bundle import SERVE_PRECISIONS, describe_served, export_bundle, exported_bundle_bytes, list_bundles
from core.govern.policy_folder import promotion_target
from core.policies import read_index
from core.rl.runs import list_runs

USER_ERRORS = resources.USER_ERRORS
#: Where each action's outcome is kept for the next render, shown next to its button.
REGISTRY_FLASH = "policies_registry_flash"
BUNDLES_FLASH = "policies_bundles_flash"

st.title("Policies")
st.caption("A trained run becomes a bundle (weights, catalog, masks, template, evaluation); a candidate "
           "is approved by an approver who neither trained nor exported it and only when it beats "
           "production (or the best logged behaviour: the expert, when the logs have one) on held-out "
           "episodes; promotion ships it inside the `core` package that production imports.")

ws = resources.workspace()
actor = resources.acting_user()


def _can(permission: str) -> bool:
    return actor is not None and actor.can(permission)


def _run_action(flash: str, what: str, done: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Button callback (it runs before the page, so every list below is read after the
    change): call one core function, keep its outcome under ``flash`` for the next render
    (``done`` on success, why it could not ``what`` otherwise), and point the Registry tab's
    pickers at the version it acted on."""
    try:
        result = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        resources.flash(flash, "error", f"Could not {what}: {user_message(exc)}")
        return
    if isinstance(result, registry.PolicyVersion):
        st.session_state["policies_name"] = result.name
        st.session_state["policies_version"] = result.version
    resources.flash(flash, "success", done)


if actor is None:
    st.info("This workspace has users: sign in to export, approve, promote or roll back. "
            "Everything here can still be read.")
else:
    st.caption(f"Acting as **{actor.name}** ({actor.role}).")

# keyed and stateful: the open tab survives every action's rerun
registry_tab, runs_tab, compare_tab, history_tab = st.tabs(["Registry", "Runs & bundles", "Compare", "History"],
                                                           key="policies_tab", on_change="rerun")

# --------------------------------------------------------------------------- registry
with registry_tab:
    names = registry.policy_names(ws)
    if not names:
        st.info("No registered policies yet. Export a finished run under **Runs & bundles**, then register "
                "the bundle there.")
        cli_equivalent("rwb bundle export RUN --out F.zip && rwb registry register F.zip")
    else:
        name = st.selectbox("Policy", names, key="policies_name")
        aliases = registry.aliases(ws, name)
        installed = read_index().policies.get(name)
        target = promotion_target()
        c1, c2, c3 = st.columns(3)
        c1.metric("Production", aliases["production"] or "—", help="The version production serves now.")
        c2.metric("Approved", aliases["approved"] or "—", help="The newest version approved and not yet promoted.")
        c3.metric("Candidate", aliases["candidate"] or "—", help="The newest version waiting for an approval.")
        active, previous = (installed.active, installed.previous) if installed is not None else (None, [])
        st.caption(f"Promote copies the approved bundle into `{target.path}` and makes it the version production "
                   f"loads; roll back writes there too. There now: active {active or '—'}, "
                   f"previous {', '.join(previous) or '—'}.")
        if not target.writable:
            st.warning(f"Promote and roll back are not possible from here: {target.reason}. Promote from a "
                       "checkout this user may write, or start the app with RWB_POLICIES_DIR set to a folder it "
                       "may write.")
        versions = registry.list_versions(ws, name)
        st.dataframe([{"version": v.version, "stage": v.stage, "held-out return": number(v.return_mean),
                       "best logged behaviour": v.best_logged or "—", "held-out episodes": number(v.heldout_episodes),
                       "run": v.run_id, "exported by": v.created_by, "trained by": v.trained_by,
                       "registered": v.registered_at, "approved by": ", ".join(a.by for a in v.approvals) or "—"}
                      for v in versions], hide_index=True,
                     column_config={
                         "held-out return": st.column_config.TextColumn(
                             help="Mean template return of the policy on held-out episodes (never trained on), by "
                                  "the registry's own evaluation: higher is better; to be approved it must beat "
                                  "production, or the best logged behaviour when nothing is in production."),
                         "best logged behaviour": st.column_config.TextColumn(
                             help="The logged behaviour that earned the most on the same held-out episodes, and "
                                  "its mean return: the bar a first version must clear.")})
        version = st.selectbox("Version", [v.version for v in reversed(versions)], key="policies_version")
        chosen = next(v for v in versions if v.version == version)
        st.write(f"**{name} {version}** is *{chosen.stage}* — trained by {chosen.trained_by}, "
                 f"exported by {chosen.created_by}, template {chosen.template}, dataset "
                 f"{chosen.dataset or '—'}.")
        for a in chosen.approvals:
            st.caption(f"Approved by {a.by} at {a.at}: {a.comment}")

        if _can("approve") and chosen.stage in ("candidate", "rolled_back"):
            st.text_input("Why you approve", key="policies_comment",
                          placeholder="e.g. beats production on 50 held-out episodes")
            st.button("Approve", type="primary", key="policies_approve", on_click=lambda: _run_action(
                REGISTRY_FLASH, f"approve {name} {version}", f"Approved {name} {version}: it may now be promoted.",
                registry.approve, ws, actor, name, version, st.session_state.get("policies_comment", "")))
        blocked = None if target.writable else f"Not possible from here: {target.reason}."
        if _can("promote") and chosen.stage == "approved":
            st.button("Promote", type="primary", key="policies_promote", disabled=blocked is not None,
                      help=blocked or f"Copies {name} {version} into {target.path} and makes it production.",
                      on_click=lambda: _run_action(
                          REGISTRY_FLASH, f"promote {name} {version}",
                          f"Promoted {name} {version} into {target.path}: it is production now.",
                          registry.promote, ws, actor, name, version))
        restore = registry.previous_version(ws, name)
        if _can("rollback") and restore is not None:
            st.button("Roll back", key="policies_rollback", disabled=blocked is not None,
                      help=blocked or f"Make {restore} active again",
                      on_click=lambda: _run_action(REGISTRY_FLASH, f"roll {name} back",
                                                   f"Rolled {name} back: {restore} is production again.",
                                                   registry.rollback, ws, actor, name))
        resources.show_flash(REGISTRY_FLASH)
        st.download_button("Download bundle", data=registry.bundle_bytes(ws, name, version),
                           file_name=f"{name}-{version}.zip", mime="application/zip", key="policies_download")
        if st.button("Check the promotion gate", key="policies_gate"):
            with st.spinner("Comparing with the baseline on held-out episodes…"):
                try:
                    gate = registry.promotion_gate(ws, name, version)
                except USER_ERRORS as exc:
                    st.error(user_message(exc))
                else:
                    (st.success if gate.passed else st.warning)(gate.reason)
                    st.json(to_jsonable(gate), expanded=False)

# --------------------------------------------------------------------------- runs and bundles
with runs_tab:
    runs = list_runs(ws)
    if not runs:
        st.info("No training runs yet: train one on the **Training** page.")
        cli_equivalent("rwb train")
    else:
        st.dataframe([{"run": r.id, "status": r.display_status, "dataset": r.dataset,
                       "template": f"{r.template_name} v{r.template_version}", "env steps": number(r.env_steps),
                       "return (last update)": number(r.last.return_mean), "trained by": r.created_by,
                       "created": r.created_at} for r in runs], hide_index=True)
    done = [r.id for r in runs if r.status in ("finished", "stopped")]
    if _can("export_bundle") and done:
        with st.form("policies_export"):
            run_id = st.selectbox("Run to export", done, key="policies_export_run")
            export_name = st.text_input("Policy name", key="policies_export_name",
                                        placeholder="default: the template's name")
            export_version = st.text_input("Version", key="policies_export_version",
                                           placeholder="default: next minor version")
            serve_precision = st.selectbox(
                "Served copy", SERVE_PRECISIONS, key="policies_export_precision",
                help="What production runs: the trained policy (full), or a cheaper copy of it — float16, bfloat16 "
                     "or int8 weights, or a distilled smaller network. A copy is kept only when it makes the "
                     "policy's first choice on at least 99% of the held-out states; the figures go into the "
                     "signed manifest and the registry evaluates the copy.")
            if st.form_submit_button("Export bundle"):
                with st.spinner("Evaluating on held-out episodes and writing the bundle…"):
                    try:
                        path = export_bundle(ws, actor, run_id, name=export_name.strip() or None,
                                             version=export_version.strip() or None, serve_precision=serve_precision)
                    except USER_ERRORS as exc:
                        st.error(user_message(exc))
                    else:
                        st.success(f"Wrote {path.name} from {run_id}: it is selected in the bundles "
                                   "below, ready to register.")
                        st.caption(describe_served(path))
                        st.session_state["policies_bundle_file"] = path.name  # its picker is drawn below
    bundles = list_bundles(ws)  # read after the export above, so a new bundle is listed at once
    st.subheader("Exported bundles")
    if not bundles:
        st.caption("None in this workspace yet.")
    else:
        st.dataframe([{"file": b.file, "name": b.name, "version": b.version, "run": b.run_id,
                       "exported by": b.created_by, "held-out return": number(b.return_mean),
                       "expert's return (logs)": number(b.expert_return), "problem": b.problem or "—"}
                      for b in bundles], hide_index=True)
        file = st.selectbox("Bundle", [b.file for b in bundles], key="policies_bundle_file")
        picked = next(b for b in bundles if b.file == file)
        if _can("export_bundle"):
            st.button("Register as candidate", key="policies_register", on_click=lambda: _run_action(
                BUNDLES_FLASH, f"register {file}", f"Registered {file}: it is a candidate in the Registry tab.",
                registry.register, ws, actor, picked.path))
            resources.show_flash(BUNDLES_FLASH)
        st.download_button("Download this bundle", data=exported_bundle_bytes(ws, file), file_name=file,
                           mime="application/zip", key="policies_download_export")

# --------------------------------------------------------------------------- compare
with compare_tab:
    every = [(v.name, v.version) for v in registry.list_versions(ws)]
    if not every:
        st.info("Register bundles to compare their evaluation reports.")
    else:
        picked_versions = st.multiselect("Versions", every, default=every[-2:], key="policies_compare",
                                         format_func=lambda nv: f"{nv[0]} {nv[1]}")
        if picked_versions:
            st.dataframe([{k: number(v) if isinstance(v, float) else v for k, v in c.row().items()}
                          for c in registry.compare_versions(ws, list(picked_versions))], hide_index=True)
            st.caption("Returns are mean template returns on each bundle's held-out episodes; compare bundles "
                       "evaluated on the same held-out set (same 'held-out set' fingerprint).")

# --------------------------------------------------------------------------- history
with history_tab:
    events = registry.history(ws)
    if not events:
        st.info("No registry events yet.")
    else:
        st.dataframe([{"at": e.at, "policy": f"{e.name} {e.version}", "event": e.event,
                       "by": f"{e.actor} ({e.role})", "why": e.comment} for e in reversed(events)],
                     hide_index=True)
