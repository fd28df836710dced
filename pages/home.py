"""Home: what the workbench is for, where this workspace stands along the loop, and the next
useful step as a link to the page where it is done."""

from __future__ import annotations

import streamlit as st

from rwb_app import fmt, resources
from rwb_app.choices import dataset_select, template_select
from rwb_app.glossary import help_for
from rwb_app.messages import cli_equivalent
from core.govern.overview import GOOD_FIDELITY, workspace_overview
from core.rewards.views import template_options
from core.sample.workspace_setup import SAMPLE_DATASETS

#: Page address (core.govern.overview.NextStep.page) → the page's file beside this one.
PAGE_FILES = {"episodes": "episodes.py", "rewards": "reward_pyramid.py", "training": "training.py",
              "policies": "policies.py", "review": "review_queue.py", "audit": "audit.py"}
#: A run's status in words.
RUN_STATUS = {"running": "training now", "finished": "finished", "failed": "failed", "stopped": "stopped",
              "interrupted": "interrupted (its trainer stopped)"}

st.title("Home")
st.markdown("**Reward Workbench** turns your agent's recorded conversations into a reward you can check against real "
            "outcomes. It trains a policy on that reward and tells you in plain words whether it does better "
            "than the agent in the logs. Reviewers check risky steps and an approver hands the policy over to "
            "production, with every decision on record.")

ws = resources.workspace()
actor = resources.acting_user()
overview = workspace_overview(ws, actor, samples=SAMPLE_DATASETS.values())
cli_equivalent("rwb workspace status")

# --------------------------------------------------------------------------- the next step
step = overview.next_step
with st.container(border=True):
    st.subheader("Next step")
    st.page_link(f"page_scripts/{PAGE_FILES[step.page]}", label=f"**{step.action}**",
                 icon=":material/arrow_forward:")
    st.write(step.reason)

# --------------------------------------------------------------------------- what you work on
st.subheader("Working on")
usable = [d.name for d in overview.datasets if d.episodes]
if usable:
    left, right = st.columns(2)
    dataset = dataset_select("Dataset", usable, key="home_dataset", page="home", container=left)
    # read afresh (not the app's 30-second cache): a version saved a moment ago is the default
    template = template_select("Reward template", [o.spec for o in template_options(ws)], key="home_template",
                               dataset=dataset, container=right)
    st.caption(f"Working on: **{dataset}** with **{template}**. Every page opens on these until you "
               "choose others.")
else:
    st.info("No dataset with episodes yet: import one on the **Episodes** page.")

# --------------------------------------------------------------------------- the loop
st.subheader("Where this workspace stands")
data, labelled, reward, fidelity = st.columns(4)
own = len(overview.own_datasets)
data.metric("Datasets", fmt.number(len(overview.datasets)),
            help=f"{fmt.number(overview.episodes)} episodes in all; {own} of your own, the rest samples.")
data.caption(f"{fmt.number(overview.episodes)} episodes · {own} of your own")
labelled.metric("Episodes with a known outcome", fmt.number(overview.labelled_share, "share"),
                help=help_for("labelled share"))
labelled.caption(f"{fmt.number(overview.labelled)} of {fmt.number(overview.episodes)} episodes")
reward.metric("Reward versions saved", fmt.number(overview.reward.versions_saved),
              help=help_for("template version"))
reward.caption(f"Latest: {overview.reward.latest} by {overview.reward.latest_saved_by}"
               if overview.reward.latest else "None saved yet: the shipped templates are in use.")
fid = overview.reward.fidelity
fidelity.metric("Reward agrees with outcomes",
                fmt.number(fid.within_task_auc) if fid else fmt.MISSING, help=help_for("within-task AUC"))
if fid is None:
    fidelity.caption("Measured once a reward version is saved.")
elif fid.within_task_auc is None:
    fidelity.caption(f"Not measured: {fid.note}.")
else:
    verdict = "good" if fid.within_task_auc >= GOOD_FIDELITY else "weak"
    interval = ("" if fid.ci90 is None
                else f", 90% interval {fmt.number(fid.ci90[0])}–{fmt.number(fid.ci90[1])}")
    fidelity.caption(f"{overview.reward.latest}: {verdict} (0.5 is chance, 1 perfect, good from "
                     f"{GOOD_FIDELITY}){interval}; {fid.note}.")

runs, queue, production = st.columns(3)
runs.metric("Training runs", fmt.number(overview.runs.count), help=help_for("policy"))
runs.caption(f"Latest: {overview.runs.latest_id}, {RUN_STATUS.get(overview.runs.latest_status or '', '')}"
             if overview.runs.latest_id else "No run yet.")
queue.metric("Waiting for review", fmt.number(overview.review.open), help=help_for("review queue"))
queue.caption(f"{fmt.number(overview.review.decided)} decided so far")
production.metric("Policies in production", fmt.number(len(overview.policies.production)),
                  help=help_for("registry"))
waiting = len(overview.policies.approved) + len(overview.policies.candidates)
production.caption(", ".join(overview.policies.production) if overview.policies.production
                   else "None yet." + (f" {waiting} waiting for approval or promotion." if waiting else ""))
