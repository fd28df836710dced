"""Export reward: hand a pinned template version to TRL, verifiers, verl or OpenRLHF as a small module."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent, user_message
from core.rewards import views
from core.rewards.export import FRAMEWORKS, export_archive

USER_ERRORS = resources.USER_ERRORS
#: How each framework is named on screen.
FRAMEWORK_TITLES = {"trl": "TRL (GRPOTrainer)", "verifiers": "verifiers", "verl": "verl", "openrlhf": "OpenRLHF"}
#: Port of ``rwb reward serve`` unless told otherwise.
SERVE_PORT = 8600

st.title("Export reward")
st.caption("Pick a template version and the RL framework your team trains with: the workbench writes a "
           "small Python module that scores rollouts with exactly this version (pinned by its sha256) and "
           "exposes the framework's entry point. Download it, or run the same export or an HTTP reward "
           "service from a terminal.")

ws = resources.workspace()
try:
    options = views.template_options(ws)
except USER_ERRORS as exc:
    st.error(user_message(exc))
    st.stop()
if not options:
    st.info("No reward template found: the shipped templates are missing from this installation and "
            "none was saved in this workspace. Reinstall the workbench, or save one on the Reward Pyramid page.")
    st.stop()

described = {o.spec: o for o in options}
pick_template, pick_framework = st.columns(2)
spec = pick_template.selectbox("Template version", list(described),
                               format_func=lambda s: s + (" · latest" if described[s].latest else ""),
                               key="rx_template",
                               help="@0 is the template shipped with the workbench; every save in this "
                                    "workspace is a new version. The export pins the version you pick.")
pick_template.caption(described[spec].label)
framework = pick_framework.selectbox("Framework", FRAMEWORKS, format_func=FRAMEWORK_TITLES.get,
                                     key="rx_framework")


try:
    export = export_archive(spec, framework, ws=ws)
except USER_ERRORS as exc:
    st.error(user_message(exc))
    st.stop()

st.subheader(f"{export.template} for {FRAMEWORK_TITLES[framework]}")
label_col, digest_col = st.columns([1, 3])
label_col.metric("Pinned template", export.template)
digest_col.markdown(f"**sha256** `{export.sha256}`")
digest_col.caption(f"Entry point `{export.entry_point}`. The module refuses a template copy whose sha256 "
                   "differs, so a trainer scores with exactly this version or not at all.")

st.markdown("**Use it in training** (also in the README inside the download)")
st.code(export.snippet, language="bash" if framework in ("verl", "openrlhf") else "python")
st.download_button(f"Download {export.folder}.zip", data=export.data, file_name=f"{export.folder}.zip", mime="application/zip",
                   help="The module, the template's YAML and a README. The module imports `core`: install "
                        "Reward Workbench where the trainer runs.", key="rx_download")
st.caption("Files: " + ", ".join(f"`{name}`" for name in export.names))

cli_equivalent(f"rwb reward export --template {export.template} --to {framework} --out {export.folder}",
               "writes the same folder")
cli_equivalent(f"rwb reward serve --template {export.template} --port {SERVE_PORT}",
               "serves this version over HTTP: /get_reward for OpenRLHF, /verify for NeMo Gym, /v1/score "
               "for batches")
