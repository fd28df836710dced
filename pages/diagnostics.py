"""Diagnostics: the four-step diagnosis of a training run, and its held-out evaluation."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent
from core.rl import runs

USER_ERRORS = resources.USER_ERRORS
SHOW = {"ok": st.success, "warn": st.warning, "fail": st.error}
OWN_SPLIT = "the run's held-out split"

UNITS = {"share": "% of steps"}


def figure(value: object, unit: str) -> str:
    """A step's figure as the analyst reads it: a share as a percentage, a float to 4 digits."""
    if value is None:
        return "—"
    if unit == "share":
        return f"{value:.1%}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


st.title("Diagnostics")
st.caption("When a run does not learn, check four things in order: are the rewards sane (no NaN, no flood "
           "of the minimum value — masks too strict), does the state encoder separate task types, do all "
           "layers get gradient, does the policy still explore (entropy ≥ 1 nat)? Each step gives a verdict "
           "and the number behind it.")

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

# keyed and stateful: the open tab survives the rerun of a button
diagnose_tab, evaluate_tab = st.tabs(["Four-step diagnosis", "Held-out evaluation"], key="diag_tab",
                                     on_change="rerun")

with diagnose_tab:
    if st.button("Diagnose", type="primary", key="diag_go"):
        st.session_state["diag_for"] = run_id
    if st.session_state.get("diag_for") != run_id:
        st.info("Press **Diagnose**: it rolls the run's latest policy out in its simulator and encodes its "
                "recorded states (about half a minute).")
    else:
        try:
            with st.spinner(f"Diagnosing {run_id}…"):
                report = resources.diagnosis(run_id)
        except USER_ERRORS as exc:
            st.error(str(exc))
        else:
            SHOW[report.verdict](f"Overall: **{report.plain_verdict}** · checkpoint of update "
                                 f"{report.checkpoint_update}. Next: {report.next_action}")
            for step in report.steps:
                SHOW[step.verdict](f"**{step.step}. {step.name.capitalize()}** "
                                   f"{step.plain_verdict}: {step.message}")
                st.metric(f"{step.figure} ({UNITS.get(step.unit, step.unit)})",
                          figure(step.value, step.unit), help=f"Threshold: {step.threshold}.")
                st.caption(f"Threshold: {step.threshold}. Next: {step.action}")
                details = {k: v for k, v in step.details.items() if not isinstance(v, dict)}
                if details:
                    with st.expander("The numbers"):
                        st.json(details)

with evaluate_tab:
    on = st.selectbox("Evaluate on", [OWN_SPLIT] + [d.name for d in ws.datasets() if d.n_steps > 0],
                      key="diag_eval_on",
                      help="Another dataset is mapped onto the run's action catalog: calls it cannot express "
                           "count as off-catalog.")
    eval_dataset = None if on == OWN_SPLIT else on
    repeats = st.number_input("Passes over the held-out episodes", min_value=1, max_value=20, value=3,
                              key="diag_repeats")
    if st.button("Evaluate", key="diag_eval"):
        st.session_state["diag_eval_for"] = (run_id, int(repeats), eval_dataset)
    if st.session_state.get("diag_eval_for") != (run_id, int(repeats), eval_dataset):
        st.info("Press **Evaluate**: the greedy policy, random-in-mask and the logged behaviours on the run's "
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
                       f"({cov['share_of_tool_calls']:.1%}) cannot be expressed in the run's action catalog "
                       f"{ev.catalog_version}.")
            best = ev.best_logged
            if best is not None:
                pair = ev.paired[best.behaviour]
                (st.success if ev.beats_best_logged else st.warning)(
                    f"The policy {'beats' if ev.beats_best_logged else 'does not beat'} the best logged "
                    f"behaviour ({best.behaviour}) on its own held-out requests: "
                    f"{pair.policy:.3f} vs {pair.logged:.3f}"
                    f"; over all held-out requests {ev.policy.return_mean:.3f}, random-in-mask "
                    f"{ev.random_in_mask.return_mean:.3f}.")
            if ev.mask_violations:
                st.error(f"{ev.mask_violations} mask violations in the evaluation: masked actions were taken.")
            rows: list[dict[str, object]] = [
                {"who": who, "return_mean": pooled.return_mean, "success_rate": pooled.success_rate,
                 "off_support_rate": pooled.off_support_rate, "episodes": pooled.episodes}
                for who, pooled in (("policy (greedy)", ev.policy), ("random-in-mask", ev.random_in_mask))]
            rows += [{"who": f"logged {name}", "return_mean": value} for name, value in ev.logged.items()]
            st.markdown("**Simulator's estimate** (a model built from the recorded episodes)")
            st.dataframe(rows, hide_index=True, width="stretch")
            st.caption(f"{ev.episodes} held-out episodes ({ev.source}), {ev.repeats} passes.")
            ope = ev.ope
            st.markdown(f"**Off-policy estimate on the logged episodes** ({ope.method})")
            if ope.reliable and ope.policy_success_ci90 is not None:
                low, high = ope.policy_success_ci90
                st.success(f"Success {ope.policy_success:.2f} (90% {low:.2f}–{high:.2f}, over tasks) against "
                           f"the logged agent's {ope.logged_success:.2f}; return {ope.policy_return:.3f} "
                           f"against {ope.logged_return:.3f}. {ope.note}")
            else:
                # no number shown as if it meant something: the verdict and why
                st.warning(f"No trustworthy off-policy figure ({ope.verdict}). {ope.note}")
            st.caption(f"Off-policy: {ope.episodes} logged episodes over {ope.tasks} tasks; support "
                       f"{'—' if ope.support is None else format(ope.support, '.0%')}, effective sample size "
                       f"{'—' if ope.effective_sample_size is None else format(ope.effective_sample_size, '.1f')}.")
