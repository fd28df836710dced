"""Review Queue: claim a high-risk action, read its state and reward components, approve or reject it;
label the outcomes of recorded episodes, the ones the model is least sure of first."""

from __future__ import annotations

from typing import Any

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent, user_message
from core.guard import review
from core.rewards import labels

USER_ERRORS = resources.USER_ERRORS
FLASH = "review_flash"
CURRENT = "review_item_id"

st.title("Review Queue")
st.caption("High-risk actions from training (the same risky action three times in a row), from serving "
           "(a high-risk action served with low confidence) and steps of recorded episodes sent from the "
           "**Episodes** page. Approve = reasonable exploration, the step "
           "becomes training data; reject = a mask rule, so neither training nor the decision engine takes "
           "that action in that state again.")

ws = resources.workspace()
actor = resources.acting_user()
can_review = actor is not None and actor.can("review")


def _act(label: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Button callback: call one core function; keep its outcome for the next render."""
    try:
        result = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        resources.flash(FLASH, "error", f"{label}: {user_message(exc)}")
        return
    resources.refresh_review_queue()
    if fn is review.claim:
        if result is None:
            resources.flash(FLASH, "info", "Nothing to claim: the queue has no open items.")
            return
        st.session_state[CURRENT] = result.id
        resources.flash(FLASH, "success", f"Claimed item #{result.id}.")
    elif fn is review.decide:
        st.session_state.pop(CURRENT, None)
        outcome = ("labelled as reasonable exploration (training data)" if result.decision == "approve"
                   else "now a mask rule")
        resources.flash(FLASH, "success", f"Item #{result.id} {result.decision}d: {outcome}.")
    else:
        st.session_state.pop(CURRENT, None)
        resources.flash(FLASH, "success", f"Item #{result.id} is back in the queue.")


if actor is None:
    st.info("This workspace has users: sign in as a reviewer to claim and decide items. The queue can "
            "still be read.")
elif not can_review:
    st.info(f"You act as **{actor.name}** ({actor.role}): only reviewers and admins decide items; the queue "
            "can still be read.")
else:
    st.caption(f"Acting as **{actor.name}** ({actor.role}).")
resources.show_flash(FLASH)

# --------------------------------------------------------------------------- statistics
stats = resources.review_queue_stats()
c1, c2, c3, c4, c5 = st.columns(5)
c1.metric("Pending", stats.pending)
c2.metric("Claimed", stats.claimed, help=f"{stats.expired_claims} claim(s) expired (claimable again)")
c3.metric("Decided", stats.decided, help=f"{stats.approved} approved, {stats.rejected} rejected")
c4.metric("Approve rate", "—" if stats.approve_rate is None else f"{stats.approve_rate:.0%}")
c5.metric("Oldest open", "—" if stats.oldest_pending_age_s is None
          else f"{stats.oldest_pending_age_s / 60:.0f} min")

# --------------------------------------------------------------------------- the item under review
if can_review:
    mine = review.list_items(ws, status="claimed", claimed_by=actor.name)
    current = st.session_state.get(CURRENT)
    if current not in {i.id for i in mine}:
        current = mine[0].id if mine else None
    st.button("Claim next item", type="primary" if current is None else "secondary", key="review_claim",
              on_click=lambda: _act("claim", review.claim, ws, actor))
    if len(mine) > 1:
        current = st.selectbox("Your claimed items", [i.id for i in mine], key="review_pick",
                               index=[i.id for i in mine].index(current), format_func=lambda i: f"#{i}")
    if current is None:
        st.info("You hold no item. **Claim next item** takes the oldest open one for five minutes.")
    else:
        item = review.get_item(ws, current)
        st.subheader(f"#{item.id}: {item.action_label or item.token_name or item.token_id}")
        st.write(f"**Why it is here:** {item.reason}")
        if item.origin == "serving":
            where = f"serving, decision `{item.decision_id}`, episode `{item.episode_id}`, step {item.step_t}"
        elif item.run_id is None:
            where = (f"dataset `{item.dataset}`, recorded episode `{item.episode_id}`, step {item.step_t}"
                     f" (sent by {item.created_by})")
        else:
            where = f"training run `{item.run_id}`, episode `{item.episode_id}`, step {item.step_t}"
        st.caption(f"From {where}. Claimed until {item.claim_expires}.")
        a1, a2, a3, a4 = st.columns(4)
        a1.metric("Action token", item.token_name or str(item.token_id))
        a2.metric("Tool", item.tool or "—")
        a3.metric("Risk", item.risk or "—")
        a4.metric("Confidence", "—" if item.confidence is None else f"{item.confidence:.2f}")
        left, right = st.columns(2)
        with left:
            st.write("**State** (task type "
                     f"`{item.task_type or '—'}`)")
            st.dataframe([{"feature": k, "value": str(v)} for k, v in item.state.items()], hide_index=True,
                         use_container_width=True)
        with right:
            st.write("**Reward components**")
            if item.reward_components:
                st.dataframe(item.reward_components, hide_index=True, use_container_width=True)
            else:
                st.caption("None recorded for this step.")
            if item.meta:
                with st.expander("More context"):
                    st.json(item.meta, expanded=False)
        with st.form("review_decide"):
            comment = st.text_area("Comment", key="review_comment",
                                   placeholder="Why — required to reject: it stays with the mask rule")
            b1, b2 = st.columns(2)
            approve = b1.form_submit_button("Approve: reasonable exploration")
            reject = b2.form_submit_button("Reject: never in this state", type="primary")
        if approve or reject:
            _act("decide", review.decide, ws, actor, item.id, "approve" if approve else "reject", comment)
            st.rerun()
        st.button("Release (back to the queue, undecided)", key="review_release",
                  on_click=lambda: _act("release", review.release, ws, actor, item.id))

# --------------------------------------------------------------------------- the queue
st.subheader("Queue")
status = st.selectbox("Show", ["open", "claimed", "decided", "all"], key="review_status",
                      help="open = pending, or claimed with an expired lease")
items = review.list_items(ws, status=None if status == "all" else status, limit=500)
if not items:
    st.info("No items here. Items arrive from training runs (curriculum level L3, **Training** page), "
            "from the decision engine serving a promoted policy, and from **Send to review** on a step of "
            "the **Episodes** page — or check another status.")
    cli_equivalent("rwb serve decide --policy NAME --request JSON", "serves a request")
else:
    st.dataframe([{"id": i.id, "status": i.status + (" (expired)" if i.claim_expired else ""),
                   "origin": i.origin if i.origin == "serving" or i.run_id else "recorded episode",
                   "action": i.action_label or i.token_name, "risk": i.risk,
                   "task type": i.task_type, "reason": i.reason, "age (min)": round(i.age_s / 60, 1),
                   "claimed by": i.claimed_by, "decision": i.decision, "comment": i.comment}
                  for i in items], hide_index=True, use_container_width=True)

# --------------------------------------------------------------------------- label outcomes
LABEL_FLASH = "label_flash"
st.subheader("Label outcomes")
st.caption("Say whether a recorded episode succeeded: each label feeds calibration, the learned outcome and "
           "tuning (people's labels over the outcomes the logs recorded). The queue proposes the episode the "
           "current model is least sure of, spread over tasks, and never one already labelled.")
can_label = actor is not None and actor.can("label")
datasets = [d.name for d in ws.datasets()]
if not datasets:
    st.info("No dataset yet: import episodes on the **Episodes** page, then label their outcomes here.")
else:
    label_dataset = st.selectbox("Dataset", datasets, key="label_dataset")
    if actor is None:
        st.info("This workspace has users: sign in as an analyst or reviewer to label outcomes. The proposed "
                "episode can still be read.")
    elif not can_label:
        st.info(f"You act as **{actor.name}** ({actor.role}): only analysts, reviewers and admins label "
                "outcomes; the proposed episode can still be read.")
    resources.show_flash(LABEL_FLASH)
    try:
        with st.spinner("Ranking the unlabelled episodes…"):
            proposals = resources.label_proposals(label_dataset)
    except USER_ERRORS as exc:
        st.info(f"Nothing to propose in {label_dataset}: {user_message(exc)}.")
        proposals = None
    if proposals is not None:
        m1, m2, m3, m4 = st.columns(4)
        m1.metric("Labelled by people", proposals.n_labelled)
        m2.metric("Known outcomes", f"{proposals.n_known} of {proposals.n_episodes}",
                  help="Episodes with a label, else an outcome the log recorded")
        m3.metric("Tasks with both outcomes", f"{proposals.n_tasks_with_both} of {proposals.n_tasks}",
                  help="What the within-task AUC compares: a success and a failure of the same task")
        m4.metric("Label set version", proposals.labels_version)
        if not proposals.items:
            st.success("Every episode of this dataset has a label.")
        else:
            item = proposals.items[0]
            st.markdown(f"**Episode `{item.episode_id}`** · task `{item.task}`")
            st.markdown(f"**Request:** {item.request or '—'}")
            with st.expander(f"The conversation's {len(item.steps)} steps"):
                st.text("\n".join(item.steps) or "no steps")
            st.markdown(f"**Last answer:** {item.last_answer or '—'}")
            guess = "—" if item.probability is None else f"{item.probability:.0%} success"
            st.caption(f"Model's guess: {guess}. Why this one: {item.why}. Ranked by {proposals.model_note}.")
            if can_label:
                with st.form("label_outcome", clear_on_submit=True):
                    note = st.text_input("Note (optional)", key="label_note", max_chars=2000)
                    b1, b2 = st.columns(2)
                    success = b1.form_submit_button("Success", type="primary")
                    failure = b2.form_submit_button("Failure")
                if success or failure:
                    word = "success" if success else "failure"
                    try:
                        labels.add_label(ws, actor, label_dataset, item.episode_id, 1 if success else 0, note=note)
                    except USER_ERRORS as exc:
                        resources.flash(LABEL_FLASH, "error", f"label: {user_message(exc)}")
                    else:
                        resources.flash(LABEL_FLASH, "success", f"Episode {item.episode_id} labelled a {word}.")
                    st.rerun()
            if len(proposals.items) > 1:
                st.caption("Next: " + " · ".join(f"`{i.episode_id}` (task {i.task})" for i in proposals.items[1:]))
    cli_equivalent(f"rwb labels next --dataset {label_dataset}", "then rwb labels add EPISODE success|failure")
