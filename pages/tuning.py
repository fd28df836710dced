"""Tuning: Optuna studies over a reward pyramid's weights — start, watch live, apply as a new version."""

from __future__ import annotations

import streamlit as st

from rwb_app import charts, resources
from rwb_app.choices import dataset_select, template_select
from rwb_app.fmt import number, signed
from rwb_app.messages import app_words, cli_equivalent, user_message
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
#: Plain names of the objectives (the setting's value goes in the tooltip).
OBJECTIVE_NAMES = {"outcome": "Recorded outcomes", "preferences": "Your preference labels",
                   "policy": "A short training run per trial (slow)"}
#: Plain column names of the weights table and of the trials table.
WEIGHT_COLUMNS = {"best": "tuned", "low": "lowest tried", "high": "highest tried"}
TRIAL_COLUMNS = {"value": "objective (training)", "held_out": "objective (held out)", "held_out_auc": "held-out AUC",
                 "cv_auc": "cross-validated AUC", "held_out_within": "held-out within-task AUC",
                 "feasible": "meets every expectation"}
#: Short names of the two held-out ranking figures (metric labels must fit their column).
SHORT = {"within_task": "Within tasks", "all_pairs": "Across all runs"}
#: How each study status reads in the Studies list.
STATUS_NAMES = {"running": "running", "new": "not started", "finished": "finished", "stopped": "stopped",
                "failed": "failed", "interrupted": "stopped unexpectedly"}


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
        # tuning needs two episodes at the least: a one-episode dataset is never the default
        dataset = dataset_select("Dataset", datasets, key="tune_dataset", page="tuning", min_episodes=2,
                                 container=c1)
        template = template_select("Reward template", resources.template_specs(), key="tune_template",
                                   dataset=dataset, container=c2)
        objective = c3.selectbox("Tune towards", tuning.OBJECTIVES, key="tune_objective",
                                 format_func=OBJECTIVE_NAMES.get,
                                 help="Objective. Recorded outcomes: returns rank successful episodes first; "
                                      "your preference labels: returns agree with your pair labels; a short "
                                      "training run per trial: a short PPO run scores each set of weights (slow).")
        c4, c5, c6, c7 = st.columns(4)
        split_by = c4.selectbox("Split by", tuning.SPLIT_FIELDS, key="tune_split",
                                help="Episodes sharing this value stay on one side of the train/held-out split.")
        trials = c5.number_input("Trials", min_value=1, max_value=1_000_000, value=500, step=100, key="tune_trials")
        metric = c6.selectbox("Compare runs", tuning.METRICS, key="tune_metric", disabled=objective != "outcome",
                              format_func=tuning.METRIC_CHOICES.get,
                              help="Metric. Within each task (within_task): each task's successful runs should "
                                   "score above its failed ones (what a trainer with a per-task baseline needs; "
                                   "all pairs when under 5 tasks have both outcomes). Across all runs "
                                   "(all_pairs, soft_auc): every success above every failure.")
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
        scored_by = f" ({tuning.METRIC_CHOICES[metric].lower()})" if objective == "outcome" else ""
        st.markdown(f"Start runs **{int(trials):,}** trials towards **{OBJECTIVE_NAMES[objective].lower()}**"
                    f"{scored_by} on **{dataset}**, tuning {n_tuned} of **{template}**'s weights (seed {int(seed)}), "
                    f"as study **{shown_name}**, in a background worker.")
        refusal = tuning.tuning_refusal(ws, dataset, objective) if dataset else "pick a dataset"
        if refusal is not None:
            st.warning(f"Cannot start: {refusal}.")
        if st.button("Start", type="primary", key="tune_start", disabled=not rows or refusal is not None):
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
        pdataset = dataset_select("Dataset", datasets, key="tune_pref_dataset", page="tuning", min_episodes=2)
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
    records = {s.name: s for s in studies}
    st.dataframe([{"study": s.name, "status": STATUS_NAMES.get(s.status, s.status),
                   "why": "" if not s.cause else app_words(s.cause),
                   "trials": "—" if s.latest_run is None else
                   f"{number(s.latest_run.trials_done)} of {number(s.latest_run.trials_requested)}",
                   "template": s.template_name + ("" if s.template_version is None else f"@{s.template_version}"),
                   "data": s.dataset or s.episodes_file, "started by": s.created_by}
                  for s in studies], hide_index=True, width="stretch", key="tune_studies")
    name = st.selectbox("Study", names, key="tune_name",
                        format_func=lambda n: f"{n} ({STATUS_NAMES.get(drawn[n], drawn[n])})")
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
        record = records[name]
        if record.cause and record.status in ("failed", "interrupted"):
            # the cause first, where the person looks: a study that ended without results says why
            st.error(f"This study {STATUS_NAMES[record.status]}: {app_words(record.cause)}")
        elif record.cause:
            st.info(f"This study was {STATUS_NAMES.get(record.status, record.status)}: {app_words(record.cause)}")
        left, right = st.columns([4, 1])
        figure_label, figure_help = tuning.figure_name(report.metric)
        scored_by = f" (scored by: {figure_label.lower()})" if report.metric else ""   # none until the worker starts
        left.markdown(f"**{report.name}** · {STATUS_NAMES.get(drawn[name], drawn[name])} · tuned towards "
                      f"**{OBJECTIVE_NAMES.get(report.objective, report.objective or '—').lower()}**"
                      f"{scored_by} · template {report.template.get('name')}"
                      f"{'@' + str(report.template['version']) if report.template.get('version') is not None else ''}"
                      f" · {number(counts.get('complete', 0))} trials complete, {number(counts.get('feasible', 0))} "
                      f"meet every expectation, {number(counts.get('pruned', 0))} cut short")
        # only a study that runs can be stopped; one that ended says why above
        if running and actor is not None and actor.can("train"):
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
        if not report.weights:   # the worker never created the study: nothing more to show than why
            log_section(name, record)
            return
        if report.best is not None:
            st.caption(f"Scored by how well the return {figure_label.lower()} (0.5 is chance, 1 is perfect; "
                       "hover a figure for its exact name). The tuned weights are the best trial's.")
            b1, b2, b3 = st.columns(3)
            b1.metric("Tuned weights, training episodes", number(report.best["value"]),
                      delta=_delta(report.best["value"], report.baseline, "train", report.metric),
                      help=f"{figure_help} Measured on the episodes the study tuned on (the best trial, "
                           f"chosen by this figure).")
            held = report.best.get("held_out")
            b2.metric("Tuned weights, held-out episodes", number(held),
                      delta=_delta(held, report.baseline, "held_out", report.metric),
                      help=f"{figure_help} Measured on episodes the study never tuned on: the honest figure. "
                           "Higher than the template's is better.")
            held_auc = report.best.get("held_out_auc")
            if held_auc is not None:
                auc_label, auc_help = tuning.figure_name("auc")
                b3.metric("Exact, on held-out tasks", number(held_auc),
                          delta=_delta(held_auc, report.baseline, "held_out", "auc"),
                          help=f"{auc_label}. {auc_help} The best trial is chosen by the task-grouped cross-validation of the "
                               "other tasks; this figure on the held-out tasks is read off, never chosen by.")
        elif counts.get("complete"):
            st.warning("No feasible trial yet: every completed trial breaks an expectation.")
        for warning in report.warnings:
            st.warning(warning)
        if report.best is not None:
            apply_section(name)
        if report.held_out:
            held_out_figures(report.held_out)
        st.subheader("Tuned vs template weights")
        st.dataframe(_readable(report.weights, WEIGHT_COLUMNS), hide_index=True, width="stretch")
        if report.params:
            st.dataframe(_readable(report.params, {"best": "tuned"}), hide_index=True, width="stretch")
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
        with st.expander("Recent trials (an expectation's value ≤ 0 means it is met)"):
            st.dataframe(_readable(report.trials, TRIAL_COLUMNS), hide_index=True, width="stretch")
        log_section(name, record)
        st.caption(f"Open it in optuna-dashboard: `optuna-dashboard {report.storage}`")

    def log_section(name: str, record) -> None:
        """The end of the latest worker's log (open when it failed without a recorded cause)."""
        log = tuning.tuning_log(ws, name)
        if log:
            with st.expander("Worker log (tail)", expanded=record.status == "failed" and not record.cause):
                st.code(log, language=None)

    def apply_section(name: str) -> None:
        """How the tuned weights compare with the template on episodes they were not tuned on, and
        saving them as a new version (asking first, naming the drop, when they do worse)."""
        try:
            check = tuning.apply_check(ws, name)
        except USER_ERRORS as exc:
            st.error(user_message(exc))
            return
        st.subheader("Apply the tuned weights")
        if check.worse:
            st.warning(check.plain + ".")
        elif check.figure is not None and check.template is not None:
            st.success(check.plain + ".")
        else:
            st.info(check.plain + ".")
        if actor is None or not actor.can("edit_template"):
            st.caption("Saving the weights as a new template version needs the analyst or admin role.")
            return
        applied_key, pending_key = f"tune_apply_notice_{name}", f"tune_apply_pending_{name}"
        message = st.text_input("Why (kept with the new version)", key=f"tune_apply_msg_{name}")
        pending = st.session_state.get(pending_key)
        if pending is None:
            if st.button(f"Save the tuned weights as {check.new_label}", type="primary", key=f"tune_apply_{name}",
                         help="Writes a new version of the template; the version it started from stays."):
                apply_weights(name, message, force=False, applied_key=applied_key, pending_key=pending_key)
        else:
            # the confirmation names the drop; only this button passes force
            st.warning(pending)
            yes, no = st.columns(2)
            if yes.button(f"Yes, save them as {check.new_label}", type="primary", key=f"tune_apply_force_{name}"):
                apply_weights(name, message, force=True, applied_key=applied_key, pending_key=pending_key)
            if no.button("Cancel", key=f"tune_apply_cancel_{name}"):
                st.session_state.pop(pending_key, None)
                st.rerun()
        show_notice(applied_key)

    def apply_weights(name: str, message: str, *, force: bool, applied_key: str, pending_key: str) -> None:
        """Save the study's best weights; weights worse than the template ask to confirm first."""
        try:
            applied = tuning.apply_study(ws, actor, name, message=message or None, force=force)
        except tuning.WorseThanTemplate as exc:
            st.session_state[pending_key] = exc.check.question
            st.session_state.pop(applied_key, None)
        except USER_ERRORS as exc:
            st.session_state[applied_key] = ("error", f"Not saved: {user_message(exc)}")
            st.session_state.pop(pending_key, None)
        else:
            st.session_state.pop(pending_key, None)
            st.session_state[applied_key] = (
                "success", f"Saved {applied.label} from trial {applied.trial} ({len(applied.diff)} changes): "
                           "pick it as the reward template to train or tune on.")
            # the template pickers (here and on Training) list the new version now
            resources.refresh_template_specs()
        st.rerun()

    def held_out_figures(held: dict) -> None:
        """The best trial's held-out within-task and all-pairs AUC beside the template's own."""
        st.subheader("Held-out tasks (never tuned on)")
        answers = tuning.figure_name(held["metric"])[0].lower()
        st.caption(f"{number(held['tasks'])} held-out tasks ({number(held['tasks_with_both'])} have both a "
                   f"successful and a failed run; {number(held['episodes'])} runs with a known outcome). The study "
                   f"answers to how well the return {answers}; saving compares it with the template's own.")
        cols = st.columns(len(held["rows"]))
        for col, row in zip(cols, held["rows"]):
            value, before = row["best trial"], row["template"]
            key = "within_task" if row["figure"].startswith("within") else "all_pairs"
            label, help_text = tuning.figure_name(key)
            col.metric(f"{SHORT[key]}: tuned vs template", number(value),
                       delta=None if value is None or before is None else
                       f"{_change(value - before)} vs the template's {number(before)}", help=f"{label}. {help_text}")
        st.dataframe([{"figure": tuning.figure_name("within_task" if r["figure"].startswith("within")
                                                    else "all_pairs")[0],
                       "tuned weights": number(r["best trial"]), "template": number(r["template"]),
                       "change": "—" if r["best trial"] is None or r["template"] is None else
                       signed(r["best trial"] - r["template"]),
                       "tuned weights, 90% interval": _interval(r["best 90% interval"]),
                       "template, 90% interval": _interval(r["template 90% interval"]),
                       "pairs compared": number(r["pairs"])} for r in held["rows"]],
                     hide_index=True, width="stretch")

    def _readable(rows: list[dict], names: dict[str, str]) -> list[dict]:
        """Table rows with every figure rounded for reading and the columns renamed."""
        return [{names.get(k, k): number(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows]

    def _change(x: float) -> str:
        """A change for ``st.metric``'s delta: its arrow and colour follow a leading ASCII minus."""
        text = signed(x)
        return "-" + text[1:] if text.startswith("−") else text

    def _interval(ci) -> str:
        return "—" if not ci or ci[0] is None or ci[1] is None else f"{number(ci[0])} – {number(ci[1])}"

    def _delta(value, baseline, side, metric):
        figures = (baseline or {}).get("figures") or {}
        before = (figures.get(side) or {}).get(metric)
        if value is None or before is None:
            return None
        return f"{_change(value - before)} vs the template's {number(before)}"

    live_study(name)
