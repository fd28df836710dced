"""Episodes: import recorded agent runs, browse them, read one step by step."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.choices import dataset_select
from rwb_app.fmt import number
from rwb_app.messages import cli_equivalent, user_message
from core.guard import review
from core.data.datasets import (
    DATASET_PERMISSION,
    archive_dataset,
    delete_dataset,
    deletion_preview,
    restore_dataset,
)
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
DATASET_FLASH = "episodes_dataset_flash"
#: The filter widgets: they start empty again whenever another dataset is shown.
FILTER_KEYS = ("episodes_task_types", "episodes_behaviours", "episodes_resolved", "episodes_search",
               "episodes_open")
#: The dataset the filters were set on.
FILTERS_FOR = "episodes_filters_for"
#: Resolved filter value -> what the picker says.
RESOLVED_WORDS = {"any": "any", "resolved": "yes", "failed": "no", "unknown": "not recorded"}


def clear_filters() -> None:
    """Empty every filter (a button's callback, so it runs before the widgets are drawn)."""
    for key in FILTER_KEYS:
        st.session_state.pop(key, None)

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
                                       help="Key of the episode outcome. A key holding 0/1 or true/false "
                                            "(such as success) also says whether each task was done.")
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
            column.metric(label, number(value))
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
    c_pick, c_archived = st.columns([4, 1], vertical_alignment="bottom")
    show_archived = c_archived.toggle(
        "Show archived", key="episodes_show_archived",
        help="Archived datasets are hidden from every picker and keep their data; show them here to "
             "read or restore one.")
    datasets = {d.name: d for d in ws.datasets(include_archived=show_archived)}
    if not datasets:
        st.info("No episodes yet. Import a log file in the **Import a file** tab."
                if not ws.datasets(include_archived=True) else
                "Every dataset is archived: turn on **Show archived** to read or restore one.")
        cli_equivalent("rwb workspace init", "imports the sample datasets")
        st.stop()

    goto = st.session_state.pop("episodes_goto_dataset", None)
    if goto in datasets:
        st.session_state["episodes_dataset"] = goto
    dataset = dataset_select("Dataset", list(datasets), key="episodes_dataset", page="episodes",
                             container=c_pick, format_func=lambda name: dataset_label(datasets[name]) + (
                                 " (archived)" if datasets[name].archived else ""))
    if dataset is None:
        st.stop()
    if st.session_state.get(FILTERS_FOR) != dataset:
        clear_filters()  # filters of the dataset shown before mean nothing here
        st.session_state[FILTERS_FOR] = dataset

    # ----------------------------------------------------------------- archive, restore, delete
    info = datasets[dataset]
    if info.archived:
        st.info(f"Dataset '{dataset}' is archived: no picker offers it, and its data is kept. "
                "Restore it below to use it again.")
    outcome_kept = DATASET_FLASH in st.session_state  # what the last click did: shown next to its button
    with st.expander("Archive or delete this dataset", expanded=info.archived or outcome_kept):
        resources.show_flash(DATASET_FLASH)
        can_manage = actor is not None and actor.can(DATASET_PERMISSION)
        why_not = None if can_manage else "Archiving and deleting datasets needs the analyst or admin role."
        if why_not:
            st.caption(why_not)
        if info.archived:
            put_away = st.button("Restore", key="episodes_restore", disabled=not can_manage,
                                 help=why_not or "Bring this dataset back into every picker.")
        else:
            put_away = st.button("Archive", key="episodes_archive", disabled=not can_manage,
                                 help=why_not or "Hide this dataset from every picker and keep its data; "
                                                 "restore it any time. Refused while a run or a tuning "
                                                 "study is running on it.")
        cli_equivalent(f"rwb datasets {'restore' if info.archived else 'archive'} {dataset}")
        preview = deletion_preview(ws, dataset)
        st.markdown(f"**Delete** removes {preview.removes}. It cannot be undone.")
        if preview.runs_kept:
            st.caption(f"{len(preview.runs_kept):,} training run(s) used it: their records stay, "
                       "but they can no longer be resumed.")
        if preview.blockers:
            st.warning("Deleting it is refused while: " + "; ".join(b.text for b in preview.blockers) + ".")
        typed = st.text_input("Type the dataset's name to delete it", key="episodes_delete_confirm",
                              disabled=not can_manage, placeholder=dataset,
                              help=why_not or "Deleting asks for the name, so that a click alone never "
                                              "deletes data.")
        delete = st.button("Delete…", key="episodes_delete", disabled=not can_manage or typed != dataset,
                           help=why_not or "Type the dataset's name above first.")
        cli_equivalent(f"rwb datasets delete {dataset} --yes")
    if put_away or delete:
        verb = "Restored" if info.archived and put_away else "Archived" if put_away else "Deleted"
        try:
            if delete:
                delete_dataset(ws, actor, dataset, confirm=typed)
            elif info.archived:
                restore_dataset(ws, actor, dataset)
            else:
                archive_dataset(ws, actor, dataset)
        except USER_ERRORS as exc:
            resources.flash(DATASET_FLASH, "error", user_message(exc))
        else:
            resources.flash(DATASET_FLASH, "success", f"{verb} dataset '{dataset}'." + (
                "" if verb == "Restored" else " Another dataset is shown now."))
            st.session_state.pop("episodes_delete_confirm", None)
        st.rerun()

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
                                    placeholder="all",
                                    help="What each task was about, as the log says (task_type); a log "
                                         "without one gives its task id.")
    behaviours = c_behaviour.multiselect("Who acted", choices.behaviours, key="episodes_behaviours",
                                         placeholder="all",
                                         help="The agent or behaviour the log names for each episode "
                                              "(behaviour): expert, noisy…")
    resolved = c_resolved.selectbox("Task done", list(RESOLVED_WORDS), key="episodes_resolved",
                                    format_func=RESOLVED_WORDS.get,
                                    help="Whether the log says the task was resolved (resolved); a 0/1 "
                                         "success key sets it at import.")
    search = c_search.text_input("Search id or request", key="episodes_search")

    table = list_episodes(ws, dataset, EpisodeFilter(task_types=task_types, behaviours=behaviours,
                                                      resolved=resolved, search=search))
    if not table.rows:
        st.info("No episode of this dataset matches these filters.")
        st.button("Clear the filters", key="episodes_clear_filters", on_click=clear_filters)
        st.stop()
    shown = (f"{table.matched:,} of {table.total:,} episodes" if table.matched == len(table.rows)
             else f"first {len(table.rows):,} of {table.matched:,} matching episodes — narrow the filters")
    st.caption(shown)
    st.dataframe(
        table.rows, hide_index=True,
        column_config={
            "episode_id": st.column_config.TextColumn("episode"),
            "task_type": st.column_config.TextColumn("task type", help="task_type"),
            "behaviour": st.column_config.TextColumn("who acted", help="behaviour"),
            "steps": st.column_config.NumberColumn("steps"),
            "resolved": st.column_config.CheckboxColumn("task done", help="resolved: empty when the log "
                                                                          "does not say"),
            "final_reward": st.column_config.NumberColumn("logged reward", format="%.3g",
                                                          help="final_reward: the log's own reward for the "
                                                               "episode, higher is better"),
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
    detail = show_episode(ws, dataset, episode_id, catalog, reading=True)

    st.subheader(f"Episode {detail.episode_id}")
    st.caption(detail.summary_line)
    if detail.query:
        st.text(detail.query)
    for column, figure in zip(st.columns(len(detail.outcome_rows)), detail.outcome_rows):
        column.metric(figure.label, number(figure.value), help=figure.meaning)
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
                 column_config={"token": st.column_config.TextColumn("catalog action", help="The action "
                                                                     "token the catalog maps the call to"),
                                "latency_ms": st.column_config.NumberColumn("latency (ms)", format="%.0f")})

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
                    st.caption(f"catalog action {step.token} — {step.token_label} · risk {step.risk}")
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
