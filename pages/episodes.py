"""Episodes: import recorded agent runs, browse them, read one step by step."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent, user_message
from core.guard import review
from core.data.task_criteria import FORMATS as CRITERIA_FORMATS, criteria_coverage, import_criteria
from core.data.episode_views import (
    EpisodeFilter,
    dataset_label,
    episode_filter_choices,
    import_formats,
    import_summary,
    import_upload,
    list_episodes,
    show_episode,
)

USER_ERRORS = resources.USER_ERRORS
SEND_FLASH = "episodes_review_flash"
#: Field -> label of the send-to-review form's inputs, for the app's wording of its errors.
SEND_LABELS = {"reason": "Reason for the reviewer", "step": "Step", "episode": "Open episode"}
#: Field -> label of the import form's inputs, for the app's wording of import errors.
IMPORT_LABELS = {"format": "Format", "dataset": "Dataset name", "messages_key": "Messages key",
                 "reward_key": "Reward key", "id_key": "Id key", "skip_invalid": "Skip invalid records"}
#: Field -> label of the task-criteria form's inputs.
CRITERIA_LABELS = {"format": "Criteria format", "group_key": "Task id key", "dataset": "Dataset"}
CRITERIA_OUTCOME = "episodes_criteria_outcome"

st.title("Episodes")
st.caption("Recorded agent runs: import a log file, browse its episodes, and read one step by step — "
           "what the agent saw, the action it took (and its catalog token), what the tool answered, "
           "and how the episode ended.")

ws = resources.workspace()
actor = resources.acting_user()
browse_tab, import_tab = st.tabs(["Browse", "Import a file"])


# --------------------------------------------------------------------------- import
with import_tab:
    st.write("Upload a log file: the workbench's own JSONL, OpenAI chat-completions logs "
             "(new `tool_calls` or legacy `function_call`), tau2-bench tasks or BFCL questions.")
    if actor is None or not actor.can("import"):
        st.info("Importing needs the analyst or admin role: sign in as one (an import by anyone "
                "else is refused). Browsing needs no sign-in.")
    with st.form("episodes_import", clear_on_submit=False):
        upload = st.file_uploader("Log file", key="episodes_upload",
                                  help="JSON or JSONL; one episode per record.")
        formats = import_formats()
        fmt = st.selectbox("Format", list(formats), key="episodes_format",
                           format_func=lambda name: f"{name} — {formats[name]}")
        with st.expander("Options"):
            dataset_name = st.text_input("Dataset name", key="episodes_import_dataset",
                                         placeholder="default: the file name without extension")
            messages_key = st.text_input("Messages key", key="episodes_messages_key",
                                         placeholder="messages",
                                         help="Key of the message list in each record.")
            reward_key = st.text_input("Reward key", key="episodes_reward_key",
                                       placeholder="reward / success",
                                       help="Key of the episode outcome.")
            id_key = st.text_input("Id key", key="episodes_id_key", placeholder="generated",
                                   help="Key of the episode id; repeated ids are renamed "
                                        "and reported, never merged.")
            skip_invalid = st.checkbox(
                "Skip invalid records", key="episodes_skip_invalid",
                help="Import the good records and report the rejected ones. Off: one bad record "
                     "stops the import and nothing is imported.")
        submitted = st.form_submit_button("Import", type="primary")
    cli_equivalent("rwb episodes import FILE --format FORMAT --dataset NAME --messages-key KEY "
                   "--reward-key KEY --id-key KEY --skip-invalid")

    if submitted:
        if upload is None:
            st.warning("Choose a file to import first.")
        else:
            bar = st.progress(0.0, text=f"Importing {upload.name}…")
            try:
                result = import_upload(
                    ws, upload.name, upload, format=fmt, dataset=dataset_name,
                    messages_key=messages_key, reward_key=reward_key, id_key=id_key,
                    skip_invalid=skip_invalid, actor=actor,
                    progress=lambda done, total: bar.progress(done / max(total, 1),
                                                              text=f"Importing {upload.name}…"))
            except USER_ERRORS as exc:
                bar.empty()
                st.session_state["episodes_import_outcome"] = ("error", user_message(exc, IMPORT_LABELS))
            else:
                st.session_state["episodes_import_outcome"] = ("ok", import_summary(result))
                # Show the imported dataset in Browse (applied before its picker is drawn).
                st.session_state["episodes_goto_dataset"] = result.dataset
                st.rerun()

    outcome = st.session_state.get("episodes_import_outcome")
    if outcome and outcome[0] == "error":
        st.error(outcome[1])
    elif outcome:
        summary = outcome[1]
        (st.info if summary.already_imported else st.success)(summary.headline)
        for column, (label, value) in zip(st.columns(len(summary.figures)), summary.figures):
            column.metric(label, f"{value:,}")
        for warning in summary.warnings:
            st.warning(warning)
        if summary.invalid_reasons:
            st.write("Why tool calls map to INVALID:")
            st.dataframe(summary.invalid_reasons, hide_index=True)
        if summary.rejected:
            st.write("Rejected records (not imported):")
            st.dataframe(summary.rejected, hide_index=True)
        if summary.report_path:
            st.caption(f"Report of the rejected records: {summary.report_path}")
        if summary.duplicate_ids:
            st.write("Repeated episode ids, renamed so that no episode was dropped or merged:")
            st.dataframe([{"episode_id": i} for i in summary.duplicate_ids], hide_index=True)


# --------------------------------------------------------------------------- browse
with browse_tab:
    datasets = {d.name: d for d in ws.datasets()}
    if not datasets:
        st.info("No episodes yet. Import a log file in the **Import a file** tab.")
        cli_equivalent("rwb workspace init", "imports the sample datasets")
        st.stop()

    goto = st.session_state.pop("episodes_goto_dataset", None)
    if goto in datasets:
        st.session_state["episodes_dataset"] = goto
    dataset = st.selectbox("Dataset", list(datasets), key="episodes_dataset",
                           format_func=lambda name: dataset_label(datasets[name]))

    # ----------------------------------------------------------------- task criteria
    try:
        coverage = criteria_coverage(ws, dataset)
    except USER_ERRORS as exc:
        st.error(user_message(exc, CRITERIA_LABELS))
        coverage = None
    if coverage is not None:
        st.caption(f"Task criteria: {coverage.line}" + (
            "" if coverage.episodes_with_criteria else " — upload the tasks' success criteria below "
            "so that rewards can use them"))
    outcome = st.session_state.pop(CRITERIA_OUTCOME, None)
    if outcome and outcome[0] == "error":
        st.error(outcome[1])
    elif outcome:
        st.success(outcome[1])
    with st.expander("Task criteria (expected calls, what to tell the user)"):
        can_import = actor is not None and actor.can("import")
        with st.form("episodes_criteria"):
            criteria_upload = st.file_uploader(
                "Criteria file", key="episodes_criteria_upload",
                help="tau2 tasks.json, tau-bench task records (JSON Lines) or the workbench's own JSON Lines; "
                     "joined to this dataset's episodes by task id. Re-importing a task id replaces its criteria.")
            criteria_format = st.selectbox("Criteria format", ["auto", *CRITERIA_FORMATS],
                                           key="episodes_criteria_format",
                                           format_func=lambda n: "auto — detect from the first record" if n == "auto"
                                           else f"{n} — {CRITERIA_FORMATS[n]}")
            group_key = st.text_input("Task id key", key="episodes_criteria_group_key", placeholder="task_id",
                                      help="Dotted key of each episode's task id in its imported record.")
            why_not = None if can_import else "Importing criteria needs the analyst or admin role."
            import_criteria_clicked = st.form_submit_button("Import criteria", disabled=why_not is not None,
                                                            help=why_not)
            if why_not:
                st.caption(why_not)
        cli_equivalent(f"rwb tasks import FILE --dataset {dataset}")
    if import_criteria_clicked:
        if criteria_upload is None:
            st.warning("Choose a criteria file first.")
        else:
            try:
                imported = import_criteria(ws, actor, criteria_upload.name, dataset,
                                           format=None if criteria_format == "auto" else criteria_format,
                                           group_key=group_key or None, data=criteria_upload.getvalue())
            except USER_ERRORS as exc:
                st.session_state[CRITERIA_OUTCOME] = ("error", user_message(exc, CRITERIA_LABELS))
            else:
                st.session_state[CRITERIA_OUTCOME] = (
                    "ok", f"Read the criteria of {imported.tasks_read:,} tasks ({imported.format}); "
                          f"{imported.tasks_matched:,} match this dataset: {imported.coverage_line}.")
            st.rerun()

    choices = episode_filter_choices(ws, dataset)
    c_task, c_behaviour, c_resolved, c_search = st.columns([3, 3, 2, 3])
    task_types = c_task.multiselect("Task type", choices.task_types, key="episodes_task_types",
                                    placeholder="all")
    behaviours = c_behaviour.multiselect("Behaviour", choices.behaviours, key="episodes_behaviours",
                                         placeholder="all")
    resolved = c_resolved.selectbox("Resolved", ["any", "resolved", "failed", "unknown"],
                                    key="episodes_resolved")
    search = c_search.text_input("Search id or request", key="episodes_search")

    table = list_episodes(ws, dataset, EpisodeFilter(task_types=task_types, behaviours=behaviours,
                                                      resolved=resolved, search=search))
    if not table.rows:
        st.info("No episode matches these filters; clear some of them.")
        st.stop()
    shown = (f"{table.matched:,} of {table.total:,} episodes" if table.matched == len(table.rows)
             else f"first {len(table.rows):,} of {table.matched:,} matching episodes — narrow the filters")
    st.caption(shown)
    st.dataframe(
        table.rows, hide_index=True,
        column_config={
            "episode_id": st.column_config.TextColumn("episode"),
            "task_type": st.column_config.TextColumn("task type"),
            "behaviour": st.column_config.TextColumn("behaviour"),
            "steps": st.column_config.NumberColumn("steps"),
            "resolved": st.column_config.CheckboxColumn("resolved"),
            "final_reward": st.column_config.NumberColumn("final reward", format="%.3f"),
            "query": st.column_config.TextColumn("request", width="large"),
        })

    episode_id = st.selectbox("Open episode", table.episode_ids, index=None, key="episodes_open",
                              placeholder="Choose an episode to read its steps")
    if episode_id is None:
        st.stop()

    try:
        catalog = resources.catalog(dataset)
    except USER_ERRORS as exc:
        catalog = None
        st.error(f"No action catalog for dataset '{dataset}', so steps are shown without "
                 f"tokens: {exc}")
    detail = show_episode(ws, dataset, episode_id, catalog)

    st.subheader(f"Episode {detail.episode_id}")
    st.caption(detail.summary_line)
    if detail.query:
        st.text(detail.query)
    for column, (label, value) in zip(st.columns(len(detail.outcome_figures)), detail.outcome_figures):
        column.metric(label, value)
    if detail.outcome_extra:
        st.caption("Other outcome fields")
        st.json(detail.outcome_extra, expanded=1)
    if detail.meta:
        with st.expander("Episode metadata"):
            st.json(detail.meta)

    if not detail.steps:
        st.info("This episode has no steps.")
        st.stop()
    st.dataframe(detail.step_rows, hide_index=True,
                 column_config={"latency_ms": st.column_config.NumberColumn("latency (ms)")})

    # ----------------------------------------------------------------- send a step to review
    resources.show_flash(SEND_FLASH)
    can_send = actor is not None and actor.can("enqueue_review")
    sendable = [step for step in detail.steps if step.token != "INVALID"]
    with st.form("episodes_send_review"):
        st.markdown("**Send a step to review**")
        picked = st.selectbox(
            "Step", [step.t for step in sendable], key="episodes_review_step",
            format_func=lambda t: next(f"t={s.t} · {s.action_label}" + (f" · risk {s.risk}" if s.risk else "")
                                       for s in sendable if s.t == t),
            help="A reviewer approves the action (it becomes training data) or rejects it (it becomes "
                 "a mask rule). Steps whose action is INVALID have no action token to review.")
        reason = st.text_input("Reason for the reviewer", key="episodes_review_reason",
                               max_chars=review.MAX_REASON_CHARS,
                               placeholder="What should the reviewer look at?")
        why_not = None
        if actor is None:
            why_not = "Sign in as an analyst or admin to send steps to review."
        elif not can_send:
            why_not = (f"You act as {actor.name} ({actor.role}): only analysts and admins send steps "
                       "to review.")
        elif not sendable:
            why_not = "No step of this episode maps to an action token."
        send = st.form_submit_button("Send to review", disabled=why_not is not None, help=why_not)
        if why_not:
            st.caption(why_not)
    cli_equivalent("rwb review send DATASET EPISODE STEP --reason TEXT")
    if send and picked is not None:
        try:
            item = review.send_step(ws, actor, dataset, detail.episode_id, picked, reason, catalog=catalog)
        except USER_ERRORS as exc:
            resources.flash(SEND_FLASH, "error", f"Not sent: {user_message(exc, SEND_LABELS)}")
        else:
            resources.refresh_review_queue()
            resources.flash(SEND_FLASH, "success", f"Step t={picked} is on the Review Queue as item "
                                                   f"#{item.id}.")
        st.rerun()

    for step in detail.steps:
        token = f" · {step.token}" if step.token else ""
        with st.expander(f"t={step.t} · {step.action_label}{token} · {step.status}",
                         expanded=step.token == "INVALID"):
            seen, did = st.columns(2)
            with seen:
                st.markdown("**Observation**")
                if not (step.messages or step.state or step.observation_extra is not None):
                    st.caption("nothing recorded")
                for line in step.messages:
                    st.text(f"{line.role}: {line.text}")
                if step.state:
                    st.caption("State")
                    st.json(step.state, expanded=1)
                if step.observation_extra is not None:
                    st.caption("Other observation fields")
                    st.json(step.observation_extra, expanded=1)
            with did:
                st.markdown("**Action**")
                st.code(step.action_label, language=None, wrap_lines=True)
                if step.token == "INVALID":
                    st.warning(f"INVALID: {step.invalid_reason}")
                elif step.token:
                    st.caption(f"token {step.token} — {step.token_label} · risk {step.risk}")
                st.markdown("**Tool result**")
                if step.tool_error:
                    st.warning(f"Tool error: {step.tool_error}")
                if not step.result_replayed:
                    st.caption("result not replayed (the tool writes; its result was not recorded)")
                if step.tool_result is None:
                    st.caption("none")
                elif isinstance(step.tool_result, (dict, list)):
                    st.json(step.tool_result, expanded=2)
                else:
                    st.text(str(step.tool_result))
                if step.output_text:
                    st.markdown("**Agent output**")
                    st.text(step.output_text)
                timing = [f"{step.latency_ms:,.0f} ms" if step.latency_ms is not None else None,
                          step.timestamp]
                st.caption(" · ".join(t for t in timing if t) or "no timing recorded")
