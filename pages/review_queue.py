"""Review Queue: claim a high-risk action, read what the user asked, the call with its arguments, why it
was flagged, its reward components, the steps before it and how similar items were decided, then approve
or reject it; label the outcomes of recorded episodes, the ones the model is least sure of first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import streamlit as st

from rwb_app import choices, fmt, resources
from rwb_app.messages import cli_equivalent, user_message
from core.govern.review_context import review_context
from core.guard import review
from core.rewards import labels

if TYPE_CHECKING:  # pragma: no cover
    from core.govern.review_context import ReviewContext

USER_ERRORS = resources.USER_ERRORS
FLASH = "review_flash"
CURRENT = "review_item_id"
#: A decision in the past tense.
_DONE = {"approve": "approved", "reject": "rejected"}

st.title("Review Queue")
st.caption("Risky actions for a person to check: from training (the same risky action three times in a "
           "row), from the live service (a risky action chosen with low confidence) and steps of recorded "
           "conversations sent from the **Episodes** page. **Approve**: acceptable to try, the step becomes "
           "training data. **Reject**: the action is blocked in states like this one, in training and in the "
           "live service.",
           help="Reject creates a mask rule (core.guard.masking): the action token is masked wherever the "
                "state matches the item's state pattern.")

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
                   else "the action is now blocked in states like this one (a mask rule)")
        resources.flash(FLASH, "success", f"Item #{result.id} {_DONE[result.decision]}: {outcome}.")
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
c1.metric("Waiting", stats.pending, help="Items nobody holds (status: pending).")
c2.metric("Being reviewed", stats.claimed,
          help=f"Items a reviewer holds for five minutes (status: claimed); {stats.expired_claims} hold(s) "
               "ran out and can be taken again.")
c3.metric("Decided", stats.decided, help=f"{stats.approved} approved, {stats.rejected} rejected")
c4.metric("Approved", fmt.number(stats.approve_rate, "share"),
          help="Share of the decided items that were approved (approve rate). Neither high nor low is good "
               "in itself: it says how often the flagged actions turn out acceptable.")
c5.metric("Oldest waiting", "—" if stats.oldest_pending_age_s is None
          else fmt.number(stats.oldest_pending_age_s / 60, "min"),
          help="How long the oldest open item has waited; lower is better.")

# --------------------------------------------------------------------------- the item under review
def _show_context(context: "ReviewContext") -> None:
    """What the reviewer reads before deciding, in the order they need it."""
    item = context.item
    st.markdown("#### What the user asked")
    if context.request:
        st.markdown("\n".join(f"> {line}" for line in context.request.splitlines()))
        st.caption(f"From {context.request_source}.")
    else:
        st.caption("No request was recorded for this conversation.")

    st.markdown("#### What the policy proposes" if context.proposed_by_policy else "#### What the agent wants to do")
    st.code(context.call, language=None, wrap_lines=True)
    if context.arguments:
        st.markdown("**With these arguments**", help="The call's parameters as the agent gave them (JSON).")
        st.code(context.arguments, language="json", wrap_lines=True)
    if context.arguments_note:
        st.caption(context.arguments_note[:1].upper() + context.arguments_note[1:] + ".")

    rule = context.rule
    st.markdown("#### Why it is here")
    st.markdown(f"**{rule.title}.** {rule.why}")
    figures = [(rule.measure[:1].upper() + rule.measure[1:] if rule.measure else "", fmt.number(rule.value, rule.unit),
                f"The value that tripped the rule (rule `{rule.name}`)."),
               ("Threshold", fmt.number(rule.threshold, rule.unit), "Where the rule starts sending items to a person."),
               ("Risk level of the action", rule.risk or "—", "Declared in the tool's schema: low, medium or high.")]
    shown = [f for f, value in zip(figures, (rule.value, rule.threshold, rule.risk)) if value is not None and f[0]]
    for column, (label, value, why) in zip(st.columns(max(len(shown), 1)), shown):
        column.metric(label, value, help=why)

    st.markdown("#### What the reward says about this step",
                help="The reward template's components for this step: each one's weighted part of the "
                     "step reward.")
    if context.components:
        st.table([{"Part of the reward": c.label, "Value": fmt.signed(c.value), "What it measures": c.description}
                  for c in context.components], hide_index=True)
        if context.step_reward is not None:
            st.metric("Step reward", fmt.signed(context.step_reward),
                      help="The sum of the parts above (episode terms, on a last step, count separately). "
                           "Higher is better: a positive value means the template rewards this step.")
    st.caption(context.components_note)

    n_before = context.steps_before_total
    with st.expander(f"Before this step ({n_before} entr{'y' if n_before == 1 else 'ies'})",
                     expanded=0 < n_before <= 6):
        if not context.steps_before:
            st.caption("Nothing: this is the first step of the conversation.")
        else:
            if len(context.steps_before) < n_before:
                st.caption(f"The last {len(context.steps_before)} of {n_before}.")
            st.table([{"Step": s.t, "Who": s.who, "Did": s.tool or s.kind.replace("_", " "), "Details": s.text,
                       "Result": s.result or "", "Step reward": fmt.signed(s.reward)}
                      for s in context.steps_before], hide_index=True)

    st.markdown("#### What the tool returned")
    if context.result:
        st.code(context.result, language="json" if context.result.startswith(("{", "[")) else None,
                wrap_lines=True)
    else:
        st.caption("No result was recorded for this step (the call was not run, or its result was not kept).")

    st.markdown("#### How similar items were decided")
    for group in context.similar:
        if not group.decided:
            st.caption(f"No item with {group.basis} has been decided yet.")
            continue
        st.markdown(f"Items with {group.basis}: **{group.approved} approved**, **{group.rejected} rejected**.")
        st.table([{"Item": f"#{d.item_id}", "Decision": _DONE[d.decision], "By": d.decided_by,
                   "When": d.decided_at[:16].replace("T", " "), "Note": d.comment or "—"} for d in group.last],
                 hide_index=True)

    with st.expander("Technical details"):
        confidence = ("" if item.confidence is None
                      else f" · policy's confidence {fmt.number(item.confidence, 'share')}")
        st.caption(f"Action token `{item.token_name or item.token_id}` (the catalog's name for this action and its "
                   f"argument ranges){confidence} · task type `{item.task_type or '—'}`. "
                   f"Rejecting blocks {context.reject_blocks}.")
        st.dataframe([{"feature": k, "value": str(v)} for k, v in item.state.items()], hide_index=True,
                     width="stretch")
        if item.meta:
            st.json(item.meta, expanded=False)


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
        try:
            with st.spinner("Reading the conversation and scoring the step…"):
                context = review_context(ws, current, actor=actor)
        except USER_ERRORS as exc:
            st.error(f"Item #{current} cannot be shown: {user_message(exc)}")
            context = None
        if context is not None:
            item = context.item
            st.subheader(f"#{item.id}: {item.tool or item.action_label or item.token_name or item.token_id}")
            if item.origin == "serving":
                where = f"the live service, decision `{item.decision_id}`, episode `{item.episode_id}`, step {item.step_t}"
            elif item.run_id is None:
                sender = item.meta.get("sent_by")
                where = (f"dataset `{item.dataset}`, recorded episode `{item.episode_id}`, step {item.step_t}"
                         + (f" (sent by {sender})" if sender else ""))
            else:
                where = f"training run `{item.run_id}`, episode `{item.episode_id}`, step {item.step_t}"
            st.caption(f"From {where}. Yours until {item.claim_expires[11:19]} UTC.")
            _show_context(context)
            cli_equivalent(f"rwb review show {item.id}", "prints the same")
            st.markdown("#### Your decision")
            with st.form("review_decide"):
                comment = st.text_area("Comment", key="review_comment",
                                       placeholder="Why: required to reject, it stays with the block it creates")
                b1, b2 = st.columns(2)
                approve = b1.form_submit_button(
                    "Approve: reasonable exploration",
                    help="The step becomes a labelled training example: acceptable to try.")
                reject = b2.form_submit_button(
                    "Reject: never in this state", type="primary",
                    help="A mask rule: neither training nor the decision engine takes this action in a state "
                         "like this one again.")
            if approve or reject:
                _act("decide", review.decide, ws, actor, item.id, "approve" if approve else "reject", comment)
                st.rerun()
            st.button("Release (back to the queue, undecided)", key="review_release",
                      on_click=lambda: _act("release", review.release, ws, actor, item.id))

# --------------------------------------------------------------------------- the queue
st.subheader("Queue")
_SHOW = {"open": "waiting", "claimed": "being reviewed", "decided": "decided", "all": "all"}
status = st.selectbox("Show", list(_SHOW), key="review_status", format_func=_SHOW.get,
                      help="Waiting: nobody holds the item (pending), or a hold ran out (an expired claim).")
items = review.list_items(ws, status=None if status == "all" else status, limit=500)
if not items:
    st.info("No items here. Items arrive from training runs (**Training** page), from the live service "
            "running a promoted policy, and from **Send to review** on a step of the **Episodes** page — or "
            "check another status.")
    cli_equivalent("rwb serve decide --policy NAME --request JSON", "serves a request")
else:
    _STATUS = {"pending": "waiting", "claimed": "being reviewed", "decided": "decided"}
    st.dataframe([{"id": i.id, "status": "waiting (hold ran out)" if i.claim_expired else _STATUS[i.status],
                   "origin": ("live service" if i.origin == "serving" else "training run" if i.run_id
                              else "recorded episode"),
                   "action": i.action_label or i.token_name, "risk": i.risk,
                   "task type": i.task_type, "why": i.reason, "waiting (min)": fmt.number(i.age_s / 60),
                   "held by": i.claimed_by, "decision": _DONE.get(i.decision or "", "—"), "comment": i.comment}
                  for i in items], hide_index=True, width="stretch",
                 column_config={"risk": st.column_config.TextColumn(help="Declared in the tool's schema"),
                                "action": st.column_config.TextColumn(
                                    help="The action token's label: … stands for arguments it leaves open")})

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
    label_dataset = choices.dataset_select("Dataset", datasets, key="label_dataset", page="review_queue")
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
