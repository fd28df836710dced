"""A run's one verdict (:mod:`core.rl.verdict`) as the Training and Diagnostics pages show
it: the same words on both, so the two pages never disagree about a run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import streamlit as st

if TYPE_CHECKING:  # pragma: no cover
    from core.rl.verdict import StoredVerdict

#: How each overall verdict is drawn: all clear, needs a look, not ready.
SHOW = {"ok": st.success, "warn": st.warning, "fail": st.error}
#: What a page says before the run was checked against the logs.
NOT_CHECKED = ("Not checked against the logs yet. **Check it against the logs** runs the four health checks and "
               "plays the policy on held-out requests next to the logged behaviour (about half a minute).")


def show_verdict(kept: "StoredVerdict") -> None:
    """The kept verdict: overall and headline, the three answers (learning? better than the
    logs? how sure?), the next step, and whether it judges the run's latest checkpoint."""
    v = kept.verdict
    if v is None:
        st.info(NOT_CHECKED)
        return
    SHOW[v.overall](f"**{v.plain_overall.capitalize()}** · {v.headline}")
    st.markdown("\n".join(f"- {line.sentence}" for line in (v.learning, v.better_than_logs, v.how_sure)))
    st.markdown(f"**Next:** {v.next_step}")
    if kept.stale:
        st.warning(kept.note)
    else:
        st.caption(f"Judged on the checkpoint of update {v.checkpoint_update}, {v.computed_at}.")
