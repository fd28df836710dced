"""The State Explorer page (AppTest): empty state, the map with its colouring choices,
the fidelity verdict, the entropy charts, and errors shown with st.error."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from _state_fixtures import HashEmbedder, dataset_workspace, make_episodes

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "state_explorer.py")


@pytest.fixture
def page_ws(tmp_path, monkeypatch):
    # The hash embedder stands in for the sentence model (loaded elsewhere in the suite).
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())

    def make(episodes=None) -> Path:
        path = tmp_path / "ws"
        dataset_workspace(path, make_episodes(45) if episodes is None else episodes).close()
        monkeypatch.setenv("RWB_WORKSPACE", str(path))
        return path
    return make


def _submit(at: AppTest, **values) -> AppTest:
    for key, value in values.items():
        if key in ("states_max_points", "states_clusters"):
            at.number_input(key=key).set_value(value)
        elif key == "states_template":
            at.selectbox(key=key).set_value(value)
        else:
            at.radio(key=key).set_value(value)
    next(b for b in at.button if b.label == "Map the states").click()
    return at.run()


def test_empty_workspace_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception
    assert [t.value for t in at.title] == ["State Explorer"]
    assert "import episodes" in at.info[0].value


def test_map_verdict_and_entropy(page_ws):
    page_ws()
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    assert "Map the states" in at.info[0].value          # nothing computed before asking
    at = _submit(at, states_max_points=150, states_clusters=4, states_template="finance_risk")
    assert not at.exception, at.exception
    verdict = [e.value for e in (*at.success, *at.warning, *at.error)]
    assert any(v.startswith("**Does the map tell task types apart?** The map tells task types apart")
               for v in verdict), verdict
    labels = [m.label for m in at.metric]
    assert {"Task types apart (−1 to 1)", "Same with task types shuffled", "Without the request",
            "Variety overall (healthy: 1 or more)"} <= set(labels)
    # the figures are rounded for reading; the technical verdict is in the caption's tooltip
    assert all(len(m.value.replace("−", "").replace("-", "").replace(".", "").lstrip("0")) <= 4
               for m in at.metric if m.value not in ("—",) and "%" not in m.value), [m.value for m in at.metric]
    assert any("silhouette" in (c.help or "") for c in at.caption)
    colour = at.selectbox(key="states_color")
    assert {"task type", "intent", "behaviour", "action", "cluster", "reward total", "reward level",
            "reward:L1"} <= set(colour.options)
    charts = at.get("plotly_chart")
    assert len(charts) == 3                            # map + entropy per tool + per cluster
    # changing the colour re-renders from the cached report
    colour.set_value("behaviour")
    at = at.run()
    assert not at.exception
    assert '"name":"expert"' in at.get("plotly_chart")[0].proto.spec.replace(" ", "")


def test_errors_are_shown_not_raised(page_ws):
    from core.records.episodes import Action, Episode, Step, Task

    tiny = [Episode(episode_id="only", task=Task(query="check 600519", task_type="analysis"),
                    steps=[Step(t=0, action=Action(kind="final_answer"))])]
    page_ws(tiny)
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    at = _submit(at, states_clusters=2)
    assert not at.exception
    assert at.error and "needs at least 8 states" in at.error[0].value


def test_page_is_in_the_app_menu(page_ws):
    page_ws()
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    at.switch_page("../pages/state_explorer.py").run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["State Explorer"]
