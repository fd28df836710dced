"""State Explorer: the t-SNE map of encoded states, the encoder's fidelity verdict, action entropy."""

from __future__ import annotations

import streamlit as st

from rwb_app import fmt, resources
from rwb_app.messages import cli_equivalent, user_message
from rwb_app.plots import states as state_plots

USER_ERRORS = resources.USER_ERRORS

st.title("State Explorer")
st.caption("Where the agent's states lie: a t-SNE map of the encoded states (each point is one step), "
           "whether task types separate — the state encoder's fidelity check — and how varied the "
           "logged actions are (entropy overall, per tool, per state cluster).")

ws = resources.workspace()
datasets = [d.name for d in ws.datasets() if d.n_steps > 0]
if not datasets:
    st.info("No dataset with steps yet: import episodes on the **Episodes** page, "
            "then come back to map their states.")
    cli_equivalent("rwb episodes import FILE")
    st.stop()

# --------------------------------------------------------------------------- what to map
with st.form("states_settings"):
    left, middle, right = st.columns(3)
    dataset = left.selectbox("Dataset", datasets, key="states_dataset")
    template = middle.selectbox(
        "Reward template", ["(none)", *resources.reward_templates()], key="states_template",
        help="Its per-step rewards feed the trace and colour the map (total, level, each pyramid "
             "level); without one the trace rewards are zero.")
    space = right.radio("States", ["encoded", "raw"], horizontal=True, key="states_space",
                        help="encoded: the state encoder's 512-d output (seeded, untrained); "
                             "raw: the concatenated raw features, without learned weights.")
    c1, c2, c3, c4, c5 = st.columns(5)
    gating = c1.radio("Gated fusion", ["on", "off"], horizontal=True, key="states_gating",
                      help="off: intent, tool context and trace get equal weights (the seed's ablation).")
    intent = c2.radio("Intent encoder", ["on", "off"], horizontal=True, key="states_intent",
                      help="off: leave the user's request out of the state.")
    max_points = c3.number_input("Points on the map", min_value=100, max_value=50000, value=20000,
                                 step=1000, key="states_max_points",
                                 help="A seeded random sample of the steps when there are more.")
    clusters = c4.number_input("State clusters", min_value=2, max_value=50, value=8,
                               key="states_clusters", help="k-means clusters for the entropy per cluster.")
    seed = c5.number_input("Seed", min_value=0, value=0, key="states_seed")
    submitted = st.form_submit_button("Map the states", type="primary")

if submitted:
    st.session_state["states_request"] = {
        "dataset": dataset, "space": space, "gating": gating, "intent": intent,
        "max_points": int(max_points), "clusters": int(clusters), "seed": int(seed),
        "template": None if template == "(none)" else template}

request = st.session_state.get("states_request")
if not request:
    st.info("Choose a dataset and press **Map the states**. A big map takes up to half a minute the "
            "first time; after that it is read from the workspace.")
    st.stop()

try:
    with st.spinner(f"Encoding and mapping the states of {request['dataset']}…"):
        report = resources.state_map(**request)
except USER_ERRORS as exc:
    st.error(user_message(exc))
    st.stop()

# --------------------------------------------------------------------------- fidelity
fid = report.fidelity
show = {True: st.success, None: st.warning, False: st.error}[fid.separates]
show(f"**Does the map tell task types apart?** {fid.summary}")
st.caption("How it is judged: hover the sign.", help=f"State-encoder fidelity: {fid.verdict}.")
m1, m2, m3, m4 = st.columns(4)
m1.metric("Task types apart (−1 to 1)", fmt.number(fid.silhouette),
          help="Silhouette score by task type, in the original state space on a sample of the steps: "
               "above the shuffled baseline by 0.03 or more is good.")
m2.metric("Same with task types shuffled", fmt.number(fid.silhouette_shuffled),
          help="Silhouette with the task types shuffled: the figure a map without structure gets.")
m3.metric("Without the request", fmt.number(fid.silhouette_intent_off),
          help="Silhouette with the intent encoder off: the request should add to the first figure.")
m4.metric("Nearest steps of the same task type", fmt.number(fid.knn_agreement, "share"),
          help=f"kNN agreement (k={fid.k}): share of each step's nearest neighbours from other episodes "
               "with the same task type; higher than chance is good"
               + ("" if fid.knn_chance is None else f" (chance: {fmt.number(fid.knn_chance, 'share')})."))

# --------------------------------------------------------------------------- the map
fields = report.color_fields()
color = st.selectbox("Colour by", fields, key="states_color",
                     format_func=lambda f: f.replace("_", " "))
st.plotly_chart(state_plots.map_figure(report, color), width="stretch", key="states_map_chart")
st.caption(f"{fmt.number(len(report.index))} of {fmt.number(report.n_steps)} steps · hover a point for its episode, step, "
           "action and rewards.")

# --------------------------------------------------------------------------- entropy
st.subheader("Variety of actions")
ent = report.entropy
(st.warning if ent.overall < 1.0 else st.info)(ent.summary)
st.caption("How it is judged: hover the sign.", help=f"Action entropy: {ent.verdict}.")
e1, e2, e3 = st.columns(3)
e1.metric("Variety overall (healthy: 1 or more)", fmt.number(ent.overall),
          help=f"Action entropy in nats: 0 when one action is always taken; every action equally often "
               f"would give {fmt.number(ent.max_overall)}. Below 1 exploration is narrow.")
e2.metric("Variety in similar states", fmt.number(ent.conditional),
          help="Conditional entropy H(action | state cluster), in nats: how varied the actions are among "
               "steps whose states lie close together.")
e3.metric("Invalid actions left out", fmt.number(ent.n_invalid))
tool_tab, cluster_tab = st.tabs(["Per tool", "Per group of similar states"])
with tool_tab:
    st.plotly_chart(state_plots.entropy_figure(ent, "tool"), width="stretch", key="states_entropy_tool")
with cluster_tab:
    st.plotly_chart(state_plots.entropy_figure(ent, "cluster"), width="stretch",
                    key="states_entropy_cluster")
