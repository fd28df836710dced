"""Training: launch runs in the background; the shown run opens on its verdict (is it learning,
is it better than the logs, how sure), with Resume and Stop; the engineering charts and the
comparison of runs below."""

from __future__ import annotations

import streamlit as st

from rwb_app import charts, resources
from rwb_app.choices import dataset_select, template_select
from rwb_app.fmt import number
from rwb_app.messages import cli_equivalent, user_message
from rwb_app.verdicts import show_verdict
from core.rl import runs, verdict
from core.base.errors import ConflictError

USER_ERRORS = resources.USER_ERRORS
#: Seconds between refreshes of the runs table and the live curves while a run is running.
REFRESH_S = 2.0
#: Session key of the last launch's outcome, shown under the Launch button until the next launch.
LAUNCH_NOTICE = "train_launch_notice"
#: Episodes a dataset needs to train on: one to learn from, one held out to check against.
MIN_EPISODES = 2
SHOW = {"success": st.success, "warning": st.warning, "error": st.error, "info": st.info}

st.title("Training")
st.caption("Train a policy against a reward template on a dataset: it trains in the background (it goes on "
           "after this page closes). The run shown below opens on its verdict — is it learning, does it do "
           "better than the logged behaviour on held-out requests, and how sure is that — with the engineering "
           "charts under Details.")

ws = resources.workspace()
actor = resources.acting_user()

datasets = {d.name: d for d in ws.datasets() if d.n_steps > 0 and not d.archived}

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
        # No form: Enter in a field must never launch a run, only the Launch button does.
        c1, c2 = st.columns(2)
        dataset = dataset_select("Dataset", list(datasets), key="train_dataset", page="training",
                                 min_episodes=MIN_EPISODES, container=c1)
        template = template_select("Reward template", resources.template_specs(), key="train_template",
                                   dataset=dataset, container=c2)
        c3, c4, c5 = st.columns(3)
        steps = c3.number_input("Environment steps", min_value=1_000, max_value=100_000_000, value=200_000,
                                step=10_000, key="train_steps",
                                help="Training steps: simulated tool calls the policy makes while it trains. "
                                     "Training runs whole batches, so the last update can go a little past this.")
        device = c4.radio("Device", ["auto", "cpu", "cuda"], horizontal=True, key="train_device",
                          help="auto: the GPU (CUDA) when the server has one, else the CPU.")
        seed = c5.number_input("Seed", min_value=0, value=0, key="train_seed",
                               help="Another seed gives another random start: a second run to compare with.")
        with st.expander("Settings"):
            s1, s2, s3 = st.columns(3)
            n_envs = s1.number_input("Parallel environments", min_value=1, max_value=65_536, value=128,
                                     key="train_n_envs", help="Simulated conversations trained on at once (n_envs).")
            gating = s2.radio("Weigh the inputs per situation", ["on", "off"], index=1, horizontal=True,
                              key="train_gating",
                              help="Encoder gating. off (default): the request, the tool context and the steps "
                                   "so far get equal weights; on: state-dependent gates (it generalised worse "
                                   "to new requests on the finance data).")
            adaptive = s3.radio("Brake on policy changes", ["adaptive", "fixed"], horizontal=True,
                                key="train_adaptive",
                                help="KL penalty β. adaptive: β ×1.5 when KL > 1.5·target, ×0.5 when KL < "
                                     "0.5·target.")
            s4, s5, s6 = st.columns(3)
            curriculum = s4.radio("Training stages", ["on", "off"], horizontal=True, key="train_curriculum",
                                  help="Curriculum: L0 behaviour cloning (copy the logs) → L1 ε-exploration → "
                                       "L2 UCB exploration bonus → L3 review of risky repeats.")
            train_encoder = s5.radio("Keep training how it reads situations", ["yes", "no"], index=1,
                                     horizontal=True, key="train_encoder",
                                     help="Train the state encoder with PPO. no: behaviour cloning trains it, "
                                          "PPO keeps it (much faster on CPU).")
            threads = s6.number_input("CPU threads (0 = default)", min_value=0, max_value=256, value=0,
                                      key="train_threads")
        small = dataset is not None and datasets[dataset].n_episodes < MIN_EPISODES
        if small:
            st.warning(f"{dataset} has only {datasets[dataset].n_episodes} episode: training needs at least "
                       f"{MIN_EPISODES} (one to learn from, one held out to check the policy against).")
        else:
            st.markdown(f"Launch trains **{template}** on **{dataset}** for **{number(int(steps))}** environment "
                        f"steps on **{device}** ({int(n_envs)} parallel environments, seed {int(seed)}), in the "
                        "background.")
        if st.button("Launch", type="primary", key="train_launch", disabled=small or template is None):
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


@st.fragment(run_every=REFRESH_S if "running" in drawn.values() else None)
def runs_table() -> None:
    """The runs with their progress, read again on every refresh while one runs (the same
    record the panel below reads, so the two never disagree)."""
    now = runs.list_runs(ws, limit=200)
    if {r.id: r.display_status for r in now} != drawn:
        st.rerun()  # the pickers, the panel and the comparison change too
    st.dataframe([{"run": r.id, "status": r.display_status, "dataset": r.dataset or "file",
                   "template": f"{r.template_name} {r.template_version}", "steps": runs.steps_progress(r),
                   "updates": r.updates, "reward per episode": number(r.last.return_mean),
                   "by": r.created_by, "created": r.created_at}
                  for r in now], hide_index=True, width="stretch",
                 column_config={"reward per episode": st.column_config.TextColumn(
                     help="Average reward per episode in the last update's training rollout (return_mean).")})


runs_table()

ids = [r.id for r in all_runs]
wanted = st.session_state.pop("train_show", None)
if wanted in ids:
    st.session_state["train_run"] = wanted
run_id = st.selectbox("Run", ids, key="train_run")


def _check(run_id: str) -> None:
    """The button's callback: compute the run's verdict (kept for next time).  A callback runs
    before the page is drawn again, so a refresh of the live panel cannot cut it short."""
    st.session_state.pop(f"train_verdict_error_{run_id}", None)
    try:
        verdict.run_verdict(ws, run_id, refresh=True)
    except USER_ERRORS as exc:
        st.session_state[f"train_verdict_error_{run_id}"] = user_message(exc)


def verdict_panel(run_id: str) -> None:
    """Is it learning? Better than the logs? How sure? — the run's one verdict (the same
    words as the Diagnostics page), or the button that computes it."""
    kept = verdict.stored_verdict(ws, run_id)
    v = kept.verdict
    st.markdown("##### Is it learning? Is it better than the logs? How sure?")
    if kept.latest_update is None:
        st.info("No checkpoint yet: the verdict comes once the run has saved its first policy.")
        return
    show_verdict(kept)
    st.button("Check it against the logs" if v is None else "Check again", key=f"train_check_{run_id}",
              type="primary" if v is None or kept.stale else "secondary", on_click=_check, args=(run_id,),
              help="Runs the four-step diagnosis and the held-out evaluation together.")
    error = st.session_state.get(f"train_verdict_error_{run_id}")
    if error:
        st.error(f"Could not check it: {error}")


def _title(curve: runs.Curve) -> None:
    st.markdown(f"**{curve.title}**", help=f"{curve.technical}. Good: {curve.good}.")


@st.fragment(run_every=REFRESH_S if runs.get_run(ws, run_id).status == "running" else None)
def live_run(run_id: str) -> None:
    """The shown run's status, Stop / Resume and its curves; refreshes itself while it runs.

    Everything shown is read first, then drawn in one go in the same order on every refresh:
    a refresh never leaves the panel empty while it reads."""
    try:
        run = runs.get_run(ws, run_id)
        curves = resources.run_curves((run_id,))
        refusal = runs.resume_refusal(ws, run_id)
        log = runs.run_log(ws, run_id)
        last = runs.last_metrics(ws, run_id)
    except USER_ERRORS as exc:
        st.error(str(exc))
        return
    can_train = actor is not None and actor.can("train")
    left, right = st.columns([4, 1])
    left.markdown(f"**{run_id}** · {run.display_status} · {runs.steps_progress(run)} · {run.updates} updates · "
                  f"{run.device}")
    if run.interrupted:
        st.warning("Its trainer process is gone (killed?). **Resume** continues it from its last checkpoint.")
        cli_equivalent(f"rwb runs resume {run_id}")
    if run.error and run.status == "failed":
        st.error(f"The run failed: {run.error}")
    elif run.error:  # a note on how it ended (e.g. stopped after its trainer was gone), not a failure
        st.info(f"It ended {run.status}: {run.error}.")
    if run.status == "running" and can_train:  # an interrupted run too: Stop then marks it stopped at once
        if right.button("Stop", key=f"train_stop_{run_id}", disabled=run.stop_requested,
                        help="Stops after the current update, with a checkpoint; Resume continues it later."):
            try:
                stopped = runs.stop_run(ws, actor, run_id)
            except USER_ERRORS as exc:
                st.error(user_message(exc))
            else:
                if stopped.run.status == "stopped":
                    st.session_state[f"train_notice_{run_id}"] = (
                        "success", f"Stopped {run_id} (its trainer process was already gone).")
                    st.rerun()  # it no longer runs: the table, the picker and the refresh change
                run = stopped.run
    if refusal is None and can_train:
        if right.button("Resume", key=f"train_resume_{run_id}", type="primary",
                        help="Continues training from its last checkpoint, in the background."):
            try:
                resumed = runs.resume_run(ws, actor, run_id)
            except ConflictError as exc:
                st.session_state[f"train_notice_{run_id}"] = ("warning", f"Not resumed: {exc}")
            except USER_ERRORS as exc:
                st.session_state[f"train_notice_{run_id}"] = ("error", f"Could not resume: {user_message(exc)}")
            else:
                st.session_state[f"train_notice_{run_id}"] = (
                    "success", f"Resumed {run_id} from its last checkpoint (process {resumed.pid}).")
            st.rerun()  # it runs again: the table, the picker and the refresh change
    if f"train_notice_{run_id}" in st.session_state:
        kind, text = st.session_state[f"train_notice_{run_id}"]
        SHOW[kind](text)
    if run.status == "running" and run.stop_requested:
        # shown on every refresh until the trainer ends, so the request is never silent
        st.info(f"Stop requested for {run_id}: it stops after the current update, with a checkpoint.")
    if not curves:
        st.info("No update recorded yet: the first one comes after the warm start (copying the logs).")
        return
    plain = [c for c in runs.CURVES if c.plain and c.metric in curves]
    references = {
        "return_mean": {"best logged behaviour": last.best_logged_return},
        "entropy_marginal": {f"too narrow below {verdict.LOW_ENTROPY:g}": verdict.LOW_ENTROPY},
    }
    for col, curve in zip(st.columns(len(plain)), plain):
        with col:
            _title(curve)
            st.plotly_chart(charts.curve_figure(curves[curve.metric], height=220,
                                                references=references.get(curve.metric)),
                            width="stretch", key=f"train_curve_{curve.metric}")
    rest = [c for c in runs.CURVES + runs.GROUPED_CURVES if not c.plain and c.metric in curves]
    with st.expander("Details: every training curve", key=f"train_details_{run_id}"):
        st.caption("The engineering view: hover a title for its technical name and what good looks like.")
        for row in range(0, len(rest), 3):
            for col, curve in zip(st.columns(3), rest[row:row + 3]):
                with col:
                    _title(curve)
                    st.plotly_chart(charts.curve_figure(curves[curve.metric], height=200), width="stretch",
                                    key=f"train_curve_{curve.metric}")
    if log:
        with st.expander("Trainer log (tail)", key=f"train_log_{run_id}"):
            st.code(log, language=None)


verdict_panel(run_id)
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
        st.dataframe([{k: number(v) if isinstance(v, float) else v for k, v in row.items()} for row in table],
                     hide_index=True, width="stretch")
        titles = {c.metric: c for c in runs.CURVES}
        metrics = [m for m in titles if m in curves]
        if st.session_state.get("train_compare_metric") not in metrics:
            # a choice made before these runs recorded it (or none, while nothing was recorded):
            # show the first metric rather than an empty picker
            st.session_state.pop("train_compare_metric", None)
        metric = st.selectbox("Curve", metrics, format_func=lambda m: titles[m].title, key="train_compare_metric",
                              help="Hover the titles above for each curve's technical name.")
        if metric:
            st.plotly_chart(charts.curve_figure(curves[metric], titles[metric].title), width="stretch",
                            key="train_compare_chart")
