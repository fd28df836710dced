"""Tuning: Optuna studies over a reward pyramid's weights — start, watch live, apply as a new version."""

from __future__ import annotations

import streamlit as st

from rwb_app import charts, resources
from rwb_app.messages import cli_equivalent, user_message
from rwb_app.plots import tuning as study_plots
from core import tuning
from core.base.errors import ConflictError
from core.base.results import to_jsonable

USER_ERRORS = resources.USER_ERRORS
#: Seconds between refreshes of a running study.
REFRESH_S = 2.0
#: Session key of the last start's outcome, shown under the Start button until the next start.
START_NOTICE = "tune_start_notice"
SHOW = {"success": st.success, "warning": st.warning, "error": st.error}


def show_notice(key: str) -> None:
    """The outcome kept under ``key`` (until the action runs again: a rerun must not wipe it)."""
    if key in st.session_state:
        kind, text = st.session_state[key]
        SHOW[kind](text)

st.title("Tuning")
st.caption("Let Optuna search the pyramid's weights so that its returns rank successful episodes above failed "
           "ones (or follow your preference labels); the template's expectations are constraints, and the best "
           "weights become a new template version.")

ws = resources.workspace()
actor = resources.acting_user()

datasets = [d.name for d in ws.datasets() if d.n_steps > 0]
# keyed and stateful: the open tab survives every rerun (a start, an apply, a refresh)
studies_tab, start_tab, prefs_tab = st.tabs(["Studies", "Start a study", "Preference labels"], key="tune_tab",
                                            on_change="rerun")

# --------------------------------------------------------------------------- start
with start_tab:
    if not datasets:
        st.info("No dataset with steps yet: import episodes on the Episodes page first.")
    elif actor is None or not actor.can("train"):
        st.info("Starting a study needs the analyst or admin role: sign in as one. Studies can still be watched.")
    else:
        c1, c2, c3 = st.columns(3)
        template = c1.selectbox("Reward template", resources.template_specs(), key="tune_template",
                                help="name@N is version N saved in this workspace; @0 is the shipped file.")
        dataset = c2.selectbox("Dataset", datasets, key="tune_dataset")
        objective = c3.selectbox("Objective", tuning.OBJECTIVES, key="tune_objective",
                                 help="outcome: returns rank successful episodes first; preferences: returns "
                                      "agree with your pair labels; policy: a short PPO run per trial (slow).")
        c4, c5, c6, c7 = st.columns(4)
        split_by = c4.selectbox("Split by", tuning.SPLIT_FIELDS, key="tune_split",
                                help="Episodes sharing this value stay on one side of the train/held-out split.")
        trials = c5.number_input("Trials", min_value=1, max_value=1_000_000, value=500, step=100, key="tune_trials")
        metric = c6.selectbox("Metric", tuning.METRICS, key="tune_metric", disabled=objective != "outcome",
                              help="within_task ranks each task's successful runs above its failed ones (what a "
                                   "trainer with a per-task baseline needs; all pairs when under 5 tasks have both "
                                   "outcomes); all_pairs ranks every success above every failure.")
        seed = c7.number_input("Seed", min_value=0, value=0, key="tune_seed")
        withhold = objective != "policy"
        st.caption("Bounds of each weight (untick **tune** to keep a weight as it is; components that read the "
                   "recorded outcome are held while the outcome is withheld from the pyramid).")
        try:
            rows = resources.tuning_space(template, withhold)
        except USER_ERRORS as exc:
            st.error(str(exc))
            rows = []
        edited = st.data_editor(rows, key=f"tune_space_{template}_{withhold}", hide_index=True, width="stretch",
                                disabled=["component", "level", "weight", "reads_outcome"])
        study_name = st.text_input("Study name", key="tune_study", placeholder="default: from the template, "
                                   "data and settings (running again adds trials to it)")
        n_tuned = sum(1 for r in edited if r["tune"])
        shown_name = study_name.strip() or "named from these settings"
        scored_by = f" ({metric})" if objective == "outcome" else ""
        st.markdown(f"Start runs **{int(trials):,}** trials of the **{objective}** objective{scored_by} on "
                    f"**{dataset}**, tuning {n_tuned} of **{template}**'s weights (seed {int(seed)}), as study "
                    f"**{shown_name}**, in a background worker.")
        if st.button("Start", type="primary", key="tune_start", disabled=not rows):
            bounds = {r["component"]: (float(r["low"]), float(r["high"])) for r in edited if r["tune"]}
            fixed = [r["component"] for r in edited if not r["tune"] and not r["reads_outcome"]]
            config = tuning.TuneConfig(objective=objective, split_by=split_by, metric=metric, seed=int(seed))
            try:
                started = tuning.launch_tuning(ws, actor, template, dataset=dataset, config=config,
                                               trials=int(trials), study=study_name.strip() or None,
                                               bounds=bounds, fixed=fixed)
            except ConflictError as exc:
                st.session_state[START_NOTICE] = ("warning", f"Not started: {exc}")
            except USER_ERRORS as exc:
                st.session_state[START_NOTICE] = ("error", f"Could not start: {user_message(exc)}")
            else:
                st.session_state[START_NOTICE] = (
                    "success", f"Started study {started.study} (tuning run {started.run_id}, worker "
                               f"process {started.pid}): watch it in the Studies tab.")
                st.session_state["tune_show"] = started.study
        show_notice(START_NOTICE)

# --------------------------------------------------------------------------- preference labels
with prefs_tab:
    if not datasets:
        st.info("No dataset yet: import episodes on the Episodes page first.")
    else:
        pdataset = st.selectbox("Dataset", datasets, key="tune_pref_dataset")
        if actor is not None and actor.can("edit_template"):
            ids = [e.episode_id for e in ws.episode_summaries(pdataset)]
            with st.form("tune_pref_form", clear_on_submit=True):
                p1, p2 = st.columns(2)
                better = p1.selectbox("This episode is better…", ids, key="tune_pref_better")
                worse = p2.selectbox("…than this one", ids, index=min(1, len(ids) - 1), key="tune_pref_worse")
                comment = st.text_input("Why (optional)", key="tune_pref_comment")
                if st.form_submit_button("Add label"):
                    try:
                        added = tuning.add_preference(ws, actor, pdataset, better, worse, comment)
                    except USER_ERRORS as exc:
                        st.error(str(exc))
                    else:
                        st.success(f"Label #{added.id}: {added.better} better than {added.worse}.")
        else:
            st.info("Adding labels needs the analyst or admin role.")
        prefs = tuning.list_preferences(ws, pdataset)
        if prefs:
            st.dataframe(to_jsonable(prefs), hide_index=True, width="stretch")
        else:
            st.caption("No labels yet in this dataset. The preferences objective needs some.")

# --------------------------------------------------------------------------- studies
with studies_tab:
    studies = tuning.list_studies(ws)
    if not studies:
        st.info("No study yet: start one in the next tab.")
        cli_equivalent("rwb tune --template finance_risk --dataset NAME")
        st.stop()
    names = [s.name for s in studies]
    wanted = st.session_state.pop("tune_show", None)
    if wanted in names:
        st.session_state["tune_name"] = wanted
    #: Each study's status as this page run drew it (in the picker): when one changes, the page reruns.
    drawn = {s.name: s.status for s in studies}
    name = st.selectbox("Study", names, key="tune_name", format_func=lambda n: f"{n} ({drawn[n]})")
    running = drawn[name] == "running"

    @st.fragment(run_every=REFRESH_S if running else None)
    def live_study(name: str) -> None:
        """The study's progress, best vs template weights, constraints and Optuna's figures."""
        if {s.name: s.status for s in tuning.list_studies(ws)} != drawn:
            st.rerun()  # a study started, ended or died: the picker and this report change
        try:
            report = resources.tuning_report(name)
        except USER_ERRORS as exc:
            st.error(str(exc))
            return
        counts = report.counts
        left, right = st.columns([4, 1])
        scored_by = f" ({report.metric})" if report.metric else ""   # none yet while the worker starts
        left.markdown(f"**{report.name}** · {drawn[name]} · objective **{report.objective or '—'}**"
                      f"{scored_by} · template {report.template.get('name')}"
                      f"{'@' + str(report.template['version']) if report.template.get('version') is not None else ''}"
                      f" · {counts.get('complete', 0)} complete, {counts.get('feasible', 0)} feasible, "
                      f"{counts.get('pruned', 0)} pruned · storage `{report.storage}`")
        # an interrupted study (its worker gone) can still be stopped: that records it as ended
        if drawn[name] in ("running", "interrupted") and actor is not None and actor.can("train"):
            if right.button("Stop", key=f"tune_stop_{name}", help="Workers stop after their current trial."):
                try:
                    stopped = tuning.stop_tuning(ws, actor, name)
                except USER_ERRORS as exc:
                    st.error(user_message(exc))
                else:
                    if stopped.status != "running":
                        st.session_state[f"tune_stop_notice_{name}"] = (
                            "success", f"Stopped {name} (its worker process was already gone).")
                        st.rerun()  # it no longer runs: the picker and the refresh change
        show_notice(f"tune_stop_notice_{name}")
        if any(r.stop_requested and r.status in ("starting", "running") and r.process_alive is not False
               for r in tuning.study_runs(ws, name)):
            # shown on every refresh until the workers end, so the request is never silent
            st.info(f"Stop requested for {name}: its workers stop after their current trial.")
        for note in report.notes:
            st.caption(note)
        if report.best is not None:
            b1, b2, b3 = st.columns(3)
            b1.metric(f"Best {report.metric} (training split)", f"{report.best['value']:.4f}",
                      delta=_delta(report.best["value"], report.baseline, "train", report.metric))
            held = report.best.get("held_out")
            b2.metric("Same weights on the held-out split", "–" if held is None else f"{held:.4f}",
                      delta=_delta(held, report.baseline, "held_out", report.metric))
            held_auc = report.best.get("held_out_auc")
            if held_auc is not None:
                b3.metric("Held-out AUC (tasks never tuned on)", f"{held_auc:.4f}",
                          delta=_delta(held_auc, report.baseline, "held_out", "auc"),
                          help="The best trial is chosen by the task-grouped cross-validation of the other "
                               "tasks; its AUC on the held-out tasks is read off, never chosen by.")
        elif counts.get("complete"):
            st.warning("No feasible trial yet: every completed trial breaks an expectation.")
        for warning in report.warnings:
            st.warning(warning)
        if report.held_out:
            held_out_figures(report.held_out)
        st.subheader("Best vs template weights")
        st.dataframe(report.weights, hide_index=True, width="stretch")
        if report.params:
            st.dataframe(report.params, hide_index=True, width="stretch")
        if any(v is not None for v in report.held_out_series.get("held-out AUC", [])):
            st.caption("Objective and held-out AUC per trial (a gap that widens is over-fitting)")
            st.plotly_chart(charts.trial_series_figure(report.held_out_series), width="stretch",
                            key=f"tune_held_out_{name}")
        for key, figure in study_plots.study_figures(report.charts).items():
            st.caption(study_plots.TITLES[key])
            st.plotly_chart(figure, key=f"tune_fig_{key}_{name}")
        st.subheader("Expectations as constraints")
        if report.constraints:
            st.dataframe(report.constraints, hide_index=True, width="stretch")
        else:
            st.caption("The template has no expectation that the weights can change.")
        with st.expander("Recent trials (constraint values ≤ 0 are satisfied)"):
            st.dataframe(report.trials, hide_index=True, width="stretch")
        if report.best is not None and actor is not None and actor.can("edit_template"):
            applied_key = f"tune_apply_notice_{name}"
            try:
                check = tuning.apply_check(ws, name)
            except USER_ERRORS as exc:
                st.error(user_message(exc))
                check = None
            if check is not None and check.worse:
                st.warning(f"The best weights do worse than the template on the tasks they were not tuned on: "
                           f"{check.message}. Applying them needs your confirmation.")
            elif check is not None and check.figure is not None:
                st.caption(f"Apply guard: {check.message}.")
            with st.form(f"tune_apply_{name}"):
                message = st.text_input("Why (kept with the new version)", key=f"tune_apply_msg_{name}")
                confirm = st.checkbox("Apply even if the held-out figure is below the template's own",
                                      key=f"tune_apply_confirm_{name}",
                                      help="Weights that rank the held-out tasks' runs worse than the template "
                                           "are refused unless you confirm; the decision is recorded.")
                if st.form_submit_button("Apply the best weights as a new template version", type="primary"):
                    try:
                        applied = tuning.apply_study(ws, actor, name, message=message or None,
                                                     confirm_worse=confirm)
                    except USER_ERRORS as exc:
                        st.session_state[applied_key] = ("error", f"Not applied: {user_message(exc)}")
                    else:
                        st.session_state[applied_key] = (
                            "success", f"Saved {applied.label} from trial {applied.trial} "
                                       f"({len(applied.diff)} changes): pick it as the reward template "
                                       "to train or tune on.")
                        # the template pickers (here and on Training) list the new version now
                        resources.refresh_template_specs()
                        st.rerun()
            show_notice(applied_key)
        log = tuning.tuning_log(ws, name)
        if log:
            with st.expander("Worker log (tail)"):
                st.code(log, language=None)
        st.caption(f"Open it in optuna-dashboard: `optuna-dashboard {report.storage}`")

    def held_out_figures(held: dict) -> None:
        """The best trial's held-out within-task and all-pairs AUC beside the template's own."""
        st.subheader("Held-out tasks (never tuned on)")
        answers = "within-task" if held["metric"] == "within_task" else "all-pairs"
        st.caption(f"{held['tasks']} held-out tasks ({held['tasks_with_both']} have both a successful and a failed "
                   f"run; {held['episodes']} labelled runs); the study answers to the {answers} AUC, and Apply "
                   "compares it with the template's own.")
        cols = st.columns(len(held["rows"]))
        for col, row in zip(cols, held["rows"]):
            value, before = row["best trial"], row["template"]
            col.metric(f"Held-out {row['figure']}: best trial vs template",
                       "–" if value is None else f"{value:.4f}",
                       delta=None if value is None or before is None else
                       f"{value - before:+.4f} vs the template's {before:.4f}")
        st.dataframe(held["rows"], hide_index=True, width="stretch")

    def _delta(value, baseline, side, metric):
        figures = (baseline or {}).get("figures") or {}
        before = (figures.get(side) or {}).get(metric)
        if value is None or before is None:
            return None
        return f"{value - before:+.4f} vs the template's weights"

    live_study(name)
