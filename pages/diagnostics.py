"""Diagnostics: the run's one verdict (the same as on the Training page), the four health checks
behind it, and its held-out evaluation in detail."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.fmt import number
from rwb_app.glossary import help_for
from rwb_app.messages import cli_equivalent, user_message
from rwb_app.verdicts import show_verdict
from core.rl import runs, verdict

USER_ERRORS = resources.USER_ERRORS
SHOW = {"ok": st.success, "warn": st.warning, "fail": st.error}
OWN_SPLIT = "the run's held-out split"

#: Each check's plain name (its technical name goes in the tooltip).
CHECKS = {1: "The rewards are sane", 2: "The policy tells task types apart", 3: "Every layer learns",
          4: "It still tries varied actions"}
#: Each check's figure as the analyst reads it: a plain label with its unit.
FIGURES = {1: None, 2: "Task-type separation (silhouette above shuffled labels, −1 to 1)",
           3: None, 4: "Exploration (entropy, nats)"}
#: Plain words for the units the checks report.
UNITS = {"share": "% of steps", "L2 norm": "gradient size, L2 norm", "nats": "nats"}
PLAIN = {"ok": "passes", "warn": "needs a look", "fail": "fails"}
#: The glossary term each check's figure is (its tooltip explains it).
TERMS = {2: "silhouette", 3: "gradient norm", 4: "entropy"}


def figure_label(step: object) -> str:
    """A check's figure with its unit, in plain words."""
    fixed = FIGURES.get(step.step)  # type: ignore[attr-defined]
    if fixed:
        return fixed
    return f"{step.figure.capitalize()} ({UNITS.get(step.unit, step.unit)})"  # type: ignore[attr-defined]


st.title("Diagnostics")
st.caption("Does the run's policy do better than the logged behaviour, and if not, why? The verdict on top is "
           "the same one the Training page shows. Below it, four health checks in order: are the rewards sane, "
           "does the policy tell task types apart, does every layer learn, does it still try varied actions. "
           "They say whether training works, not whether the result beats the logs.")

ws = resources.workspace()
with_checkpoint = [r for r in runs.list_runs(ws, limit=200) if r.updates > 0]
if not with_checkpoint:
    st.info("No run with a recorded update yet: launch one on the Training page, then diagnose it here.")
    cli_equivalent("rwb train --template NAME --dataset NAME")
    st.stop()

labels = {r.id: f"{r.id} · {r.display_status} · {r.dataset or 'file'} · {r.template_name}"
          for r in with_checkpoint}
# the latest finished run first (runs come newest first); a stopped or failed one only when none finished
finished = [r.id for r in with_checkpoint if r.display_status == "finished"]
ids = list(labels)
run_id = st.selectbox("Run", ids, index=ids.index(finished[0]) if finished else 0, format_func=labels.get,
                      key="diag_run")


def _check(run_id: str) -> None:
    """The button's callback: compute the run's verdict (kept for next time, for both pages)."""
    st.session_state.pop("diag_error", None)
    try:
        verdict.run_verdict(ws, run_id, refresh=True)
    except USER_ERRORS as exc:
        st.session_state["diag_error"] = (run_id, user_message(exc))


# --------------------------------------------------------------------------- the verdict
kept = verdict.stored_verdict(ws, run_id)
v = kept.verdict
show_verdict(kept)
st.button("Check it against the logs" if v is None else "Check again", key="diag_check",
          type="primary" if v is None or kept.stale else "secondary", on_click=_check, args=(run_id,),
          help="Runs the four-step diagnosis and the held-out evaluation together.")
cli_equivalent("rwb runs verdict RUN")
error = st.session_state.get("diag_error")
if error and error[0] == run_id:
    st.error(f"Could not check it: {error[1]}")

# keyed and stateful: the open tab survives the rerun of a button
checks_tab, evaluate_tab = st.tabs(["The four health checks", "Held-out evaluation in detail"], key="diag_tab",
                                   on_change="rerun")

with checks_tab:
    if v is None or v.diagnosis is None:
        st.info("The four checks come with the verdict: press **Check it against the logs** above.")
    else:
        report = v.diagnosis
        st.caption(f"Checkpoint of update {report.checkpoint_update}. Each check: what was measured, what it must "
                   "be, and what to do when it does not pass.")
        for step in report.steps:
            SHOW[step.verdict](f"**{step.step}. {CHECKS[step.step]}** ({step.name}) — {PLAIN[step.verdict]}: "
                               f"{step.message}")
            st.metric(figure_label(step), number(step.value, "share" if step.unit == "share" else None),
                      help=(f"{help_for(TERMS[step.step])} " if step.step in TERMS else "")
                      + f"Measured: {step.figure} ({step.unit}). Must be {step.threshold}.")
            if step.verdict == "ok":
                st.caption(f"Must be {step.threshold}: it is.")
            else:
                st.caption(f"Must be {step.threshold}. Next: {step.action}")
            details = {k: number(val) if isinstance(val, float) else val for k, val in step.details.items()
                       if not isinstance(val, dict)}
            if details:
                with st.expander("The numbers"):
                    st.json(details)

with evaluate_tab:
    on = st.selectbox("Evaluate on", [OWN_SPLIT] + [d.name for d in ws.datasets() if d.n_steps > 0],
                      key="diag_eval_on",
                      help="Another dataset is mapped onto the run's actions: tool calls the run cannot "
                           "make count as off-catalog.")
    eval_dataset = None if on == OWN_SPLIT else on
    repeats = st.number_input("Passes over the held-out episodes", min_value=1, max_value=20, value=3,
                              key="diag_repeats",
                              help="The simulator draws outcomes at random: more passes, a steadier figure.")
    if st.button("Evaluate", key="diag_eval"):
        st.session_state["diag_eval_for"] = (run_id, int(repeats), eval_dataset)
    if st.session_state.get("diag_eval_for") != (run_id, int(repeats), eval_dataset):
        st.info("Press **Evaluate**: the policy, random allowed actions and the logged behaviours on the run's "
                "held-out episodes or on another dataset.")
        cli_equivalent("rwb evaluate RUN [--dataset NAME]", "the same from a terminal")
    else:
        try:
            with st.spinner(f"Evaluating {run_id} on {on}…"):
                ev = resources.evaluation(run_id, int(repeats), eval_dataset)
        except USER_ERRORS as exc:
            st.error(str(exc))
        else:
            cov = ev.catalog_coverage
            st.caption(f"Off-catalog: {cov['off_catalog']} of {cov['tool_calls']} tool calls "
                       f"({number(cov['share_of_tool_calls'], 'share')}) cannot be made by the run's policy "
                       f"(action catalog {ev.catalog_version}).")
            best = ev.best_logged
            if best is not None:
                pair = ev.paired[best.behaviour]
                (st.success if ev.beats_best_logged else st.warning)(
                    f"The policy {'beats' if ev.beats_best_logged else 'does not beat'} the best logged "
                    f"behaviour ({best.behaviour}) on its own held-out requests: {number(pair.policy)} vs "
                    f"{number(pair.logged)} reward per episode; over all held-out requests "
                    f"{number(ev.policy.return_mean)}, random allowed actions (random-in-mask) "
                    f"{number(ev.random_in_mask.return_mean)}.")
            if ev.mask_violations:
                st.error(f"{ev.mask_violations} forbidden actions taken in the evaluation (mask violations): "
                         "they must be 0.")
            rows: list[dict[str, object]] = [
                {"who": who, "reward per episode": number(pooled.return_mean),
                 "success": number(pooled.success_rate, "share"),
                 "actions unlike the logs": number(pooled.off_support_rate, "share"),
                 "episodes": pooled.episodes}
                for who, pooled in (("policy (greedy: its top choice)", ev.policy),
                                    ("random allowed actions (random-in-mask)", ev.random_in_mask))]
            rows += [{"who": f"logged {name}", "reward per episode": number(value)}
                     for name, value in ev.logged.items()]
            st.markdown("**Simulator's estimate** (a model built from the recorded episodes)",
                        help="Reward per episode: the template's return. Actions unlike the logs: the "
                             "off-support rate, where the simulator is least trustworthy.")
            st.dataframe(rows, hide_index=True, width="stretch")
            st.caption(f"{ev.episodes} held-out episodes ({ev.source}), {ev.repeats} passes.")
            ope = ev.ope
            st.markdown(f"**Re-weighting the logged episodes** (off-policy estimate: {ope.method})",
                        help="Estimates the policy's figures from the logged episodes themselves, weighting "
                             "each by how likely the policy was to act as the logger did.")
            if ope.reliable and ope.policy_success_ci90 is not None:
                low, high = ope.policy_success_ci90
                st.success(f"Success {number(ope.policy_success, 'share')} (90% interval "
                           f"{number(low, 'share')}–{number(high, 'share')}, over tasks) against the logged "
                           f"agent's {number(ope.logged_success, 'share')}; reward per episode "
                           f"{number(ope.policy_return)} against {number(ope.logged_return)}. {ope.note}")
            else:
                # no number shown as if it meant something: the verdict and why
                st.warning(f"No trustworthy off-policy figure ({ope.verdict}). {ope.note}")
            st.caption(f"Off-policy: {ope.episodes} logged episodes over {ope.tasks} tasks; support "
                       f"{number(ope.support, 'share')} (share of the policy's choices the logs also made), "
                       f"effective sample size {number(ope.effective_sample_size)} episodes.")
