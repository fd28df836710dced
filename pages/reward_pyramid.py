"""Reward Pyramid: edit a reward template's weights, parameters and gating and see what it does to the data."""

from __future__ import annotations

import streamlit as st

from rwb_app import charts, resources
from rwb_app.choices import dataset_select, template_select
from rwb_app.fmt import number
from rwb_app.messages import cli_equivalent, user_message
from rwb_app.plots import calibration as calibration_plots
from rwb_app.plots import rewards as reward_plots
from core.rewards import Template, views
from core.rewards.template_text import edited_text
from core.rewards.versions import TemplateConflict, diff_versions, save_template, template_text

USER_ERRORS = resources.USER_ERRORS

st.title("Reward Pyramid")
st.caption("Pick a reward template and a dataset, move the weights, change component parameters and "
           "gating, and watch every component, level and episode return change; expectations say "
           "whether hacks still rank below honest work. Save your edit as a new template version.")

ws = resources.workspace()
actor = resources.acting_user()
datasets = [d.name for d in ws.datasets() if d.n_steps > 0]
if not datasets:
    st.info("No dataset with steps yet: import episodes on the **Episodes** page, "
            "then come back to score them.")
    cli_equivalent("rwb episodes import FILE")
    st.stop()
try:
    options = views.template_options(ws)
except USER_ERRORS as exc:
    st.error(user_message(exc))
    st.stop()
if not options:
    st.info("No reward template found: the shipped templates are missing from this installation and "
            "none was saved in this workspace. Reinstall the workbench, or save one from a YAML file.")
    cli_equivalent("rwb reward save NAME FILE --base 0", "saves a template from a YAML file")
    st.stop()

flash = st.session_state.pop("rp_flash", None)
if flash:
    st.success(flash)
# A save or a "load the latest" picks another version before the picker is drawn.
if "rp_select" in st.session_state:
    st.session_state["rp_template"] = st.session_state.pop("rp_select")

# The picker shows the version and whether it is the latest; who saved it, when and why can be
# long, so it goes in a caption that wraps instead of being cut off in the box.
described = {o.spec: o for o in options}
pick_dataset, pick_template = st.columns(2)
dataset = dataset_select("Dataset", datasets, key="rp_dataset", page="reward_pyramid", container=pick_dataset)
spec = template_select("Template version", list(described), key="rp_template", dataset=dataset,
                       container=pick_template,
                       format_func=lambda s: s + (" · latest" if described[s].latest else ""))
pick_template.caption(described[spec].label)

work = st.session_state.get("rp_work")
if work is None or work["spec"] != spec:
    try:
        version = views.open_template(ws, spec)
        loaded = version.template()
    except USER_ERRORS as exc:
        st.error(user_message(exc))
        st.stop()
    # `gen` is part of every editor widget's key: a newly loaded template resets the widgets.
    work = {"spec": spec, "name": version.name, "base_version": version.version,
            "template": loaded, "gen": (work or {}).get("gen", 0) + 1}
    st.session_state["rp_work"] = work
    st.session_state.pop("rp_conflict", None)


def _param_widget(field: views.ParamField, key: str):
    """One parameter field as the widget its kind calls for."""
    if field.kind == "choice":
        return st.selectbox(field.name, field.options, index=list(field.options).index(field.value)
                            if field.value in field.options else 0, key=key, help=field.help or None)
    if field.kind == "flag":
        return st.checkbox(field.name, value=field.value, key=key, help=field.help or None)
    if field.kind == "integer":
        return st.number_input(field.name, value=field.value, step=1, key=key, help=field.help or None)
    if field.kind == "number":
        return st.number_input(field.name, value=field.value, format="%g", key=key,
                               placeholder="none" if field.optional else None, help=field.help or None)
    return st.text_input(field.name, value=field.value or "", key=key, help=field.help or None)


TABS = ["Distributions", "Episodes", "Expectations", "Parameters", "YAML", "Save & versions",
        "Calibration"]


@st.fragment
def pyramid_workbench(work: dict, dataset: str, options: list[views.TemplateOption]) -> None:
    """Editor and results: a weight edit reruns only this part of the page."""
    gen, template = work["gen"], work["template"]
    editor = views.pyramid_editor(template)
    edit_col, view_col = st.columns([1, 2])

    # ------------------------------------------------------------------ weights and gating
    with edit_col:
        st.subheader("Weights")
        weights: dict[str, float] = {}
        groups = [(f"{lv.key} {lv.title}", lv.components) for lv in reversed(editor.levels)]
        groups += [("Penalties", editor.penalties), ("Episode terms (R_final)", editor.episode_terms)]
        for title, comps in groups:
            if not comps:
                continue
            st.markdown(f"**{title}**")
            for c in comps:
                weights[c.name] = st.slider(c.name, 0.0, c.weight_max, c.weight, 0.01,
                                            key=f"rp_w{gen}_{c.name}", help=c.description)
        st.subheader("Gating")
        gating = st.toggle("Levels constrain upward", value=editor.gating, key=f"rp_gating{gen}",
                           help="A step that fails level k's gate earns nothing from the levels above.")
        gates = {lv.key: st.number_input(f"{lv.key} gate", value=lv.gate, step=0.05, format="%g",
                                         placeholder="no gate", key=f"rp_gate{gen}_{lv.key}",
                                         help="The level passes when its weighted mean reaches this.")
                 for lv in editor.levels}
        with st.expander("Episode return: step rewards and end-of-episode terms"):
            a = st.number_input("Weight of the step rewards", value=editor.a, step=0.05, format="%g",
                                key=f"rp_a{gen}", help="a in return = a·Σγᵗr + b·R_final.")
            b = st.number_input("Weight of the end-of-episode terms", value=editor.b, step=0.05, format="%g",
                                key=f"rp_b{gen}", help="b in return = a·Σγᵗr + b·R_final.")
            gamma = st.number_input("Discount per step", value=editor.gamma, min_value=0.01, max_value=1.0,
                                    step=0.01, format="%g", key=f"rp_gamma{gen}",
                                    help="γ: a reward t steps in counts γᵗ times; 1 counts every step alike.")

    try:
        edited = views.apply_edits(template, views.PyramidEdits(weights, gating, gates, a, b, gamma))
        with st.spinner(f"Scoring {dataset} (components are computed once per dataset and parameters)…"):
            report = resources.pyramid_report(dataset, edited)
    except USER_ERRORS as exc:
        view_col.error(user_message(exc))
        return

    # ------------------------------------------------------------------ the pyramid
    with view_col:
        # As wide as each label: a row too narrow wraps to the next line instead of cutting one.
        with st.container(horizontal=True):
            for m in report.metrics:
                shown = m.value if isinstance(m.value, str) else number(m.value, m.unit)
                st.metric(m.label, shown, help=m.help, width="content")
        st.plotly_chart(reward_plots.pyramid_figure(report), width="stretch", key="rp_pyramid")
        st.caption(report.pyramid_note)
        st.caption(f"Components computed for this dataset and parameters: "
                   f"{', '.join(report.computed) or 'none'}; read from the workspace cache: "
                   f"{', '.join(report.cached) or 'none'}. Weight, gating and return edits reuse them.")

    # Only the open tab runs: each holds tables, forms or charts that cost the browser (and the
    # calibration the server) seconds.  Keyed, so the open tab stays open when the page reruns
    # after a save, an applied edit or a version loaded.
    (distributions, episodes, expectations, parameters, yaml_tab, versions,
     calibration) = view_col.tabs(TABS, key="rp_tab", on_change="rerun")
    if distributions.open:
        with distributions:
            distributions_section(report)
    if episodes.open:
        with episodes:
            episodes_section(report)
    if expectations.open:
        with expectations:
            expectations_section(report)
    if parameters.open:
        with parameters:
            parameters_section(work, editor)
    if yaml_tab.open:
        with yaml_tab:
            yaml_section(work, edited)
    if versions.open:
        with versions:
            versions_section(work, edited, options)
    if calibration.open:
        with calibration:
            calibration_section(dataset, edited)


def distributions_section(report: views.PyramidReport) -> None:
    """Each component's contribution, each level's reward and the episode returns."""
    st.plotly_chart(reward_plots.contributions_figure(report), width="stretch", key="rp_components")
    left, right = st.columns(2)
    left.plotly_chart(reward_plots.levels_figure(report), width="stretch", key="rp_levels")
    right.plotly_chart(reward_plots.returns_figure(report), width="stretch", key="rp_returns")


def episodes_section(report: views.PyramidReport) -> None:
    """Every episode's return, and one episode explained step by step."""
    st.dataframe(report.episodes, hide_index=True, width="stretch", key="rp_episodes",
                 column_config={k: st.column_config.NumberColumn(k, help=v) for k, v in views.RETURN_PARTS.items()})
    episode = st.selectbox("Explain one episode", report.episode_ids, key="rp_episode")
    if episode:
        explanation = views.explain_episode(report.result, episode)
        st.caption(explanation.formula)
        st.dataframe(explanation.steps, hide_index=True, width="stretch", key="rp_episode_steps")
        steps = list(range(len(explanation.reward_components)))
        if steps:
            step = st.selectbox("What each component added at step", steps, index=len(steps) - 1,
                                key=f"rp_step_{episode}",
                                help="The step's reward_components as the audit records them: each component's "
                                     "weighted, gated contribution (the end-of-episode terms on the last step).")
            st.dataframe(views.contributions_table(explanation.reward_components[step]), hide_index=True,
                         key=f"rp_step_components_{episode}")


def expectations_section(report: views.PyramidReport) -> None:
    """The template's expectations (reward unit tests and hacking probes) on this dataset."""
    check = report.check
    if not check.results:
        st.info("This template carries no expectations; add some in the YAML tab "
                "(kinds: episode_score, component_range, twins_rank, rank_auc).")
    elif check.passed:
        st.success(f"All {len(check.results)} expectations pass.")
    else:
        st.error(f"{len(check.failed)} of {len(check.results)} expectations fail: "
                 + ", ".join(r.name for r in check.failed))
    if check.results:
        st.dataframe(report.expectations, hide_index=True, width="stretch", key="rp_expectations")


def parameters_section(work: dict, editor: views.PyramidEditor) -> None:
    """Every component's parameters, applied together."""
    gen = work["gen"]
    st.caption("Changing a parameter recomputes that component only (the others come from the cache).")
    with st.form(f"rp_params{gen}"):
        values: dict[str, dict] = {}
        for c in editor.components:
            with st.expander(f"{c.name} ({c.component}, {c.group})"):
                st.caption(c.description)
                values[c.name] = {p.name: _param_widget(p, f"rp_p{gen}_{c.name}_{p.name}")
                                  for p in c.params}
        applied = st.form_submit_button("Apply parameters")
    if applied:
        try:
            work["template"] = views.apply_params(work["template"], values)
        except USER_ERRORS as exc:
            st.error(user_message(exc))
        else:
            st.rerun()


def yaml_section(work: dict, edited: Template) -> None:
    """The whole template as YAML, to edit as text."""
    gen = work["gen"]
    st.caption("The whole template, expectations included, with the comments of the version you opened. "
               "Errors name the key and the line.")
    with st.form(f"rp_yaml{gen}"):
        text = st.text_area("Template YAML", value=edited_yaml(work, edited), height=480)
        use_yaml = st.form_submit_button("Use this YAML")
    if use_yaml:
        try:
            work["template"] = views.apply_yaml(text, name=work["name"])
        except USER_ERRORS as exc:
            st.error(user_message(exc))
        else:
            work["yaml"] = text   # its comments stay through later edits and into the save
            work["gen"] += 1
            st.rerun()


def edited_yaml(work: dict, edited: Template) -> str:
    """The edit as YAML written onto the text it came from: the YAML typed in the YAML tab, else
    the opened version's (comments and key order kept, only changed values rewritten)."""
    if work.get("yaml"):
        return edited_text(work["yaml"], edited)
    return template_text(ws, work["name"], work["base_version"], edited)


def versions_section(work: dict, edited: Template, options: list[views.TemplateOption]) -> None:
    """Save the edit as a new version; the template's versions and what changed between two."""
    gen = work["gen"]
    base = work["base_version"]
    st.caption(f"You are editing {work['name']}@{base}. Saving writes a new version; if someone "
               "saved a newer one meanwhile, the save is refused and you can reload theirs.")
    if actor is None or not actor.can("edit_template"):
        st.info("Saving a version needs the analyst or admin role: sign in as one. "
                "Edits can still be tried out here.")
        save = False
    else:
        with st.form("rp_save"):
            name = st.text_input("Save as template", value=work["name"], key=f"rp_save_name{gen}")
            message = st.text_input("Message", key=f"rp_save_message{gen}",
                                    placeholder="why this change (shown in the version history)")
            save = st.form_submit_button("Save as new version", type="primary")
    if save:
        try:
            same = name == work["name"]
            saved = save_template(ws, actor, name, edited_yaml(work, edited) if same else edited,
                                  base if same else None, message)
        except TemplateConflict as exc:
            st.session_state["rp_conflict"] = {
                "message": user_message(exc), "name": exc.name, "base": exc.base_version,
                "latest": exc.latest.label, "latest_version": exc.latest.version}
        except USER_ERRORS as exc:
            st.error(user_message(exc))
        else:
            st.session_state["rp_flash"] = f"Saved {saved.label}."
            st.session_state["rp_select"] = saved.label
            st.rerun()
    conflict = st.session_state.get("rp_conflict")
    if conflict:
        st.error(conflict["message"])
        if conflict["base"] is not None:
            since = diff_versions(ws, conflict["name"], conflict["base"], conflict["latest_version"])
            st.caption(f"What changed from version {conflict['base']} to {conflict['latest']}:")
            st.dataframe(views.changes_table(since.changes), hide_index=True, key="rp_conflict_diff")
        if st.button(f"Load {conflict['latest']} (drops your edits)", key="rp_conflict_reload"):
            st.session_state.pop("rp_conflict", None)
            st.session_state["rp_select"] = conflict["latest"]
            st.rerun()

    st.subheader("Versions")
    try:
        st.dataframe(views.versions_table(ws, work["name"]), hide_index=True, key="rp_versions")
    except USER_ERRORS as exc:
        st.error(user_message(exc))
        return
    numbers = [o.version for o in options if o.name == work["name"]]   # newest first
    if len(numbers) > 1:
        older, newer = st.columns(2)
        va = older.selectbox("Compare version", numbers, index=1, key="rp_diff_a")
        vb = newer.selectbox("Against version", numbers, index=0, key="rp_diff_b")
        diff = diff_versions(ws, work["name"], va, vb)
        if diff.changes:
            st.dataframe(views.changes_table(diff.changes), hide_index=True, key="rp_diff")
        if diff.unified:
            st.code(diff.unified, language="diff")
        else:
            st.caption("The two versions are identical.")


def calibration_section(dataset: str, template: Template) -> None:
    """What the dataset's recorded outcomes say about the edited template."""
    st.caption("How well each component and the episode return rank the recorded outcomes: AUC "
               "(0.5 is chance) or rank correlation for graded outcomes, with a 90% interval from "
               "resampling whole tasks; the calibration map is fitted with folds grouped by task.")
    try:
        with st.spinner("Calibrating against the recorded outcomes…"):
            cal = resources.calibration(dataset, template)
    except USER_ERRORS as exc:
        st.info(f"No calibration for {dataset}: {user_message(exc)}. Import episodes with their outcome (the "
                "reward key on the Episodes page's import form) to see what the labels teach.")
        return
    first, within, second, third = st.columns(4)
    first.metric("Return ranks successes first" if cal.binary else "Return follows the outcome",
                 number(cal.return_power.value),
                 help=f"{cal.metric.upper()}{' over all pairs' if cal.binary else ''}: 0.5 is chance, 1 is perfect. "
                      f"90% interval {number(cal.return_power.ci90[0])} – {number(cal.return_power.ci90[1])}.")
    w = cal.return_power.within_task
    if w is not None:
        within.metric("Return ranks each task's successes first", number(w.value) if w.n_tasks else "—",
                      help=(f"Within-task AUC: 0.5 is chance, 1 is perfect. 90% interval {number(w.ci90[0])} – "
                            f"{number(w.ci90[1])} over the {w.n_tasks} tasks with both outcomes ({w.n_pairs} pairs "
                            "of a success and a failure of the same task)."
                            if w.n_tasks else "No task has both a success and a failure: label runs of "
                            "tasks that have only one outcome (Review Queue page, Label outcomes)."))
    second.metric("Episodes with a known outcome", f"{number(cal.n_labelled)} of {number(cal.n_episodes)}",
                  help=f"{number(cal.n_tasks)} tasks ({number(cal.tasks_with_both or 0)} have both outcomes); "
                       f"success rate {number(cal.success_rate, 'share')}")
    if cal.heldout_auc is not None:
        third.metric("Outcome model on unseen tasks", number(cal.heldout_auc),
                     help=f"Held-out AUC, folds grouped by task: 0.5 is chance, 1 is perfect. Brier score "
                          f"{number(cal.heldout_brier)} over {cal.folds} folds (lower is better).")
    st.dataframe(charts.calibration_table(cal), hide_index=True, width="stretch", key="rp_calibration")
    if cal.roc:
        roc, bins = st.columns(2)
        roc.plotly_chart(charts.roc_figure(cal), width="stretch", key="rp_roc")
        bins.plotly_chart(charts.deciles_figure(cal), width="stretch", key="rp_calibration_bins")
    if cal.binary:
        learning_curve_section(dataset)


def learning_curve_section(dataset: str) -> None:
    """Held-out AUC against the number of labelled episodes: what more labels buy."""
    try:
        with st.spinner("Fitting the outcome model on growing label sets…"):
            curve = resources.learning_curve(dataset)
    except USER_ERRORS as exc:
        st.info(f"No learning curve for {dataset}: {user_message(exc)}.")
        return
    if not curve.points:
        st.info(f"No learning curve for {dataset} yet: even 10 labelled episodes are more than a training "
                "fold holds. Label more episodes (Review Queue page, Label outcomes).")
        return
    st.plotly_chart(calibration_plots.learning_curve_figure(curve), width="stretch", key="rp_learning_curve")
    models = ", ".join(f"{c.features} features, {c.objective}" for c in curve.configs)
    st.caption(f"Each point: the outcome model ({models}) fitted on that many labelled episodes, drawn task by "
               f"task, scored on held-out tasks ({curve.folds} folds, mean and range over seeds)."
               + (f" Not measured: {', '.join(map(str, curve.skipped))} labelled (more than a training fold "
                  "holds)." if curve.skipped else ""))
    cli_equivalent(f"rwb reward calibrate -t TEMPLATE --dataset {dataset} --learning-curve",
                   "prints the same table")


pyramid_workbench(work, dataset, options)
