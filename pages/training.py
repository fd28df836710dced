"""Training: launch PPO runs in the background, stop them, watch every metric live, compare runs."""

from __future__ import annotations

import streamlit as st

from rwb_app import charts, resources
from rwb_app.messages import cli_equivalent, user_message
from core.rl import runs
from core.base.errors import ConflictError

USER_ERRORS = resources.USER_ERRORS
#: Seconds between refreshes of the runs table and the live curves while a run is running.
REFRESH_S = 2.0
#: Session key of the last launch's outcome, shown under the Launch button until the next launch.
LAUNCH_NOTICE = "train_launch_notice"
SHOW = {"success": st.success, "warning": st.warning, "error": st.error}

st.title("Training")
st.caption("Train a masked PPO policy against a reward template on a dataset: the run goes on in a "
           "background process (it survives closing this page), its curves update live, and runs can be "
           "compared side by side.")

ws = resources.workspace()
actor = resources.acting_user()

datasets = [d.name for d in ws.datasets() if d.n_steps > 0]

# --------------------------------------------------------------------------- launch
# Open at first in a workspace without runs; decided once per session and keyed, so the panel
# does not fold away (hiding the launch outcome in it) when the first launch adds a run.
open_at_first = st.session_state.setdefault("train_launch_open", not runs.list_runs(ws, limit=1))
with st.expander("Launch a run", expanded=open_at_first, key="train_launch_panel", on_change="rerun"):
    if not datasets:
        st.info("No dataset with steps yet: import episodes on the Episodes page, then come back to train on them.")
        cli_equivalent("rwb episodes import FILE")
    elif actor is None or not actor.can("train"):
        st.info("Launching needs the analyst or admin role: sign in as one. Runs can still be watched.")
    else:
        templates = resources.template_specs()
        # No form: Enter in a field must never launch a run, only the Launch button does.
        c1, c2 = st.columns(2)
        template = c1.selectbox("Reward template", templates, key="train_template",
                                help="name@N is version N saved in this workspace; @0 is the shipped file.")
        dataset = c2.selectbox("Dataset", datasets, key="train_dataset")
        c3, c4, c5 = st.columns(3)
        steps = c3.number_input("Environment steps", min_value=1_000, max_value=100_000_000, value=200_000,
                                step=10_000, key="train_steps")
        device = c4.radio("Device", ["auto", "cpu", "cuda"], horizontal=True, key="train_device",
                          help="auto: CUDA when the server has a GPU, else CPU.")
        seed = c5.number_input("Seed", min_value=0, value=0, key="train_seed")
        with st.expander("Settings"):
            s1, s2, s3 = st.columns(3)
            n_envs = s1.number_input("Parallel environments", min_value=1, max_value=65_536, value=128,
                                     key="train_n_envs")
            gating = s2.radio("Encoder gating", ["on", "off"], index=1, horizontal=True, key="train_gating",
                              help="off (default): intent, tool context and trace get equal weights; on: "
                                   "state-dependent gates (it generalised worse to new requests on the "
                                   "finance data).")
            adaptive = s3.radio("KL penalty β", ["adaptive", "fixed"], horizontal=True, key="train_adaptive",
                                help="adaptive: β ×1.5 when KL > 1.5·target, ×0.5 when KL < 0.5·target.")
            s4, s5, s6 = st.columns(3)
            curriculum = s4.radio("Curriculum", ["on", "off"], horizontal=True, key="train_curriculum",
                                  help="L0 behaviour cloning → L1 ε-exploration → L2 UCB → L3 review.")
            train_encoder = s5.radio("Train the encoder with PPO", ["yes", "no"], index=1, horizontal=True,
                                     key="train_encoder",
                                     help="no: behaviour cloning trains it, PPO keeps it (much faster on CPU).")
            threads = s6.number_input("CPU threads (0 = default)", min_value=0, max_value=256, value=0,
                                      key="train_threads")
        st.markdown(f"Launch trains **{template}** on **{dataset}** for **{int(steps):,}** environment steps "
                    f"on **{device}** ({int(n_envs)} parallel environments, seed {int(seed)}), in the background.")
        if st.button("Launch", type="primary", key="train_launch"):
            settings = {"total_steps": int(steps), "device": device, "seed": int(seed), "n_envs": int(n_envs),
                        "encoder": {"gating": gating}, "adaptive_kl": adaptive == "adaptive",
                        "curriculum": curriculum == "on", "train_encoder": train_encoder == "yes",
                        "threads": int(threads)}
            try:
                started = runs.launch_run(ws, actor, template=template, dataset=dataset, config=settings)
            except ConflictError as exc:
                st.session_state[LAUNCH_NOTICE] = ("warning", f"Not launched: {exc}")
            except USER_ERRORS as exc:
                st.session_state[LAUNCH_NOTICE] = ("error", f"Could not launch: {user_message(exc)}")
            else:
                st.session_state[LAUNCH_NOTICE] = (
                    "success", f"Started run {started.run_id} (process {started.pid}): it is shown below, "
                               "its curves fill in as it trains.")
                st.session_state["train_show"] = started.run_id
        # kept until the next launch: a rerun of the page (a run ending) must not wipe it
        if LAUNCH_NOTICE in st.session_state:
            kind, text = st.session_state[LAUNCH_NOTICE]
            SHOW[kind](text)

# --------------------------------------------------------------------------- runs
all_runs = runs.list_runs(ws, limit=200)
if not all_runs:
    st.info("No runs yet: launch one above with **Launch**.")
    cli_equivalent("rwb train --template finance_risk --dataset NAME")
    st.stop()

st.subheader("Runs")
#: What the rest of this page was drawn from: when a run starts, ends or dies, the page reruns.
drawn = {r.id: r.display_status for r in all_runs}


def _steps(r: runs.RunRecord) -> str:
    return f"{r.env_steps:,} / {r.total_steps:,}"


@st.fragment(run_every=REFRESH_S if "running" in drawn.values() else None)
def runs_table() -> None:
    """The runs with their progress, read again on every refresh while one runs (the same
    record the panel below reads, so the two never disagree)."""
    now = runs.list_runs(ws, limit=200)
    if {r.id: r.display_status for r in now} != drawn:
        st.rerun()  # the pickers, the panel and the comparison change too
    st.dataframe([{"run": r.id, "status": r.display_status, "dataset": r.dataset or "file",
                   "template": f"{r.template_name} {r.template_version}", "device": r.device,
                   "env steps": _steps(r), "updates": r.updates, "level": r.last.curriculum_level,
                   "return": r.last.return_mean, "by": r.created_by, "created": r.created_at}
                  for r in now], hide_index=True, width="stretch")


runs_table()

ids = [r.id for r in all_runs]
wanted = st.session_state.pop("train_show", None)
if wanted in ids:
    st.session_state["train_run"] = wanted
run_id = st.selectbox("Run", ids, key="train_run")


@st.fragment(run_every=REFRESH_S if runs.get_run(ws, run_id).status == "running" else None)
def live_run(run_id: str) -> None:
    """The shown run's status, stop button and every curve; refreshes itself while it runs."""
    try:
        run = runs.get_run(ws, run_id)
        curves = resources.run_curves((run_id,))
    except USER_ERRORS as exc:
        st.error(str(exc))
        return
    status = run.display_status
    left, right = st.columns([4, 1])
    left.markdown(f"**{run_id}** · {status} · {_steps(run)} env steps · "
                  f"{run.updates} updates · {run.device}")
    if run.interrupted:
        st.warning("Its trainer process is gone (killed?). It resumes from its last checkpoint with the "
                   "command below.")
        cli_equivalent(f"rwb train --resume {run_id}")
    if run.error and run.status == "failed":
        st.error(f"The run failed: {run.error}")
    elif run.error:  # a note on how it ended (e.g. stopped after its trainer was gone), not a failure
        st.info(f"It ended {run.status}: {run.error}.")
    if run.status == "running" and actor is not None and actor.can("train"):
        if right.button("Stop", key=f"train_stop_{run_id}", disabled=run.stop_requested,
                        help="Stops after the current update, with a checkpoint."):
            try:
                stopped = runs.stop_run(ws, actor, run_id)
            except USER_ERRORS as exc:
                st.error(user_message(exc))
            else:
                if stopped.run.status == "stopped":
                    st.session_state[f"train_stop_notice_{run_id}"] = (
                        "success", f"Stopped {run_id} (its trainer process was already gone).")
                    st.rerun()  # it no longer runs: the table, the picker and the refresh change
                run = stopped.run
    if f"train_stop_notice_{run_id}" in st.session_state:
        kind, text = st.session_state[f"train_stop_notice_{run_id}"]
        SHOW[kind](text)
    if run.status == "running" and run.stop_requested:
        # shown on every refresh until the trainer ends, so the request is never silent
        st.info(f"Stop requested for {run_id}: it stops after the current update, with a checkpoint.")
    if not curves:
        st.info("No update recorded yet: the first one comes after the warm start (behaviour cloning).")
        return
    titles = dict(runs.CURVES + runs.GROUPED_CURVES)
    shown = [m for m in titles if m in curves]
    for row in range(0, len(shown), 3):
        cols = st.columns(3)
        for col, metric in zip(cols, shown[row:row + 3]):
            col.caption(titles[metric])
            col.plotly_chart(charts.curve_figure(curves[metric], height=200), width="stretch",
                             key=f"train_curve_{metric}")
    log = runs.run_log(ws, run_id)
    if log:
        with st.expander("Trainer log (tail)"):
            st.code(log, language=None)


live_run(run_id)

# --------------------------------------------------------------------------- compare
st.subheader("Compare runs")
picked = st.multiselect("Runs side by side", ids, default=ids[:2] if len(ids) > 1 else ids, key="train_compare")
if len(picked) >= 1:
    try:
        table = runs.compare_runs(ws, picked)
        curves = resources.run_curves(tuple(picked))
    except USER_ERRORS as exc:
        st.error(str(exc))
    else:
        st.dataframe(table, hide_index=True, width="stretch")
        titles = dict(runs.CURVES)
        metrics = [m for m in titles if m in curves]
        if st.session_state.get("train_compare_metric") not in metrics:
            # a choice made before these runs recorded it (or none, while nothing was recorded):
            # show the first metric rather than an empty picker
            st.session_state.pop("train_compare_metric", None)
        metric = st.selectbox("Metric", metrics, format_func=titles.get, key="train_compare_metric")
        if metric:
            st.plotly_chart(charts.curve_figure(curves[metric], titles[metric]), width="stretch",
                            key="train_compare_chart")
