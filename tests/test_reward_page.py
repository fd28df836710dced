"""The Reward Pyramid page (AppTest) on the finance sample dataset: totals follow the weights
without recomputing a component, parameter edits recompute only that component, template
errors and save conflicts are shown as errors, saves create versions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from _state_fixtures import HashEmbedder
from core import rewards
from core.rewards.pyramid import Pyramid
from core.rewards.versions import get_template, list_versions, save_template
from core.rewards.views import round_figures
from rwb_app.fmt import number
from core.records.store import Workspace
from core.access.users import Actor

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "reward_pyramid.py")
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
DATASET = "finance-sample"


@pytest.fixture(scope="module")
def sample_workspace(tmp_path_factory) -> Path:
    """The finance sample imported and scored once (the component cache is filled), copied per test."""
    from core.data.importers import import_file

    path = tmp_path_factory.mktemp("reward-page") / "seed"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
        ws = Workspace.open(path)
        import_file(ws, SAMPLE, dataset=DATASET)
        rewards.score(ws, "finance_risk", dataset=DATASET)
        ws.close()
    return path


@pytest.fixture
def page(sample_workspace, tmp_path, monkeypatch):
    """A fresh copy of the sample workspace and a counter of component evaluations."""
    path = tmp_path / "ws"
    shutil.copytree(sample_workspace, path)
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    # The hash embedder stands in for the sentence model (loaded elsewhere in the suite).
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    computed: list[list[str]] = []
    original = Pyramid.compute_matrix

    def counting(self, frame, **kw):
        matrix = original(self, frame, **kw)
        computed.append(list(matrix.computed))
        return matrix

    monkeypatch.setattr(Pyramid, "compute_matrix", counting)
    return path, computed


def open_page(template: str = "finance_risk@0", tab: str = "Distributions") -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["rp_dataset"] = DATASET
    at.session_state["rp_template"] = template
    at.session_state["rp_tab"] = tab
    return at.run()


def show(at: AppTest, tab: str) -> AppTest:
    """Open another tab of the results (only the open one runs)."""
    at.session_state["rp_tab"] = tab
    return at.run()


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def slider(at: AppTest, label: str):
    return next(s for s in at.slider if s.label == label)


def episodes_table(at: AppTest):
    return next(d.value for d in at.dataframe if "rank" in d.value.columns)


def test_empty_workspace_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Reward Pyramid"]
    assert "import episodes" in at.info[0].value


def test_weight_edits_change_the_totals_without_recomputing(page):
    path, computed = page
    at = open_page()
    assert not at.exception, at.exception
    assert not at.error
    ws = Workspace.open(path)
    shipped = rewards.load_template("finance_risk")
    expected = rewards.score(ws, shipped, dataset=DATASET)
    assert metric(at, "Mean episode return") == number(expected.returns.mean())
    assert metric(at, "Expectations passing").endswith(f"/ {len(shipped.expectations)}")
    assert len(at.get("plotly_chart")) == 4          # pyramid, components, levels, returns
    show(at, "Episodes")
    assert len(at.get("plotly_chart")) == 1          # the Distributions tab's charts run only there
    before = episodes_table(at)
    assert len(before) == expected.frame.n_episodes
    n_scorings = len(computed)

    widget = slider(at, "tool_validity")
    new = float(widget.max)                          # at least twice the shipped weight
    assert widget.value == shipped.component("tool_validity").weight < new
    widget.set_value(new).run()
    assert not at.exception and not at.error
    after = episodes_table(at)
    reweighted = expected.reweight({"tool_validity": new})
    assert metric(at, "Mean episode return") == number(reweighted.returns.mean())
    assert metric(at, "Mean episode return") != number(expected.returns.mean())
    assert (after["return"] > before["return"]).sum() > 0.9 * len(after)
    assert list(after["return"]) == pytest.approx(round_figures(reweighted.returns).tolist())
    # gating off: another matrix product, still no component evaluated
    at.toggle[0].set_value(False).run()
    assert not at.exception
    gated_off = reweighted.with_template(reweighted.template.with_gating(False))
    assert metric(at, "Mean episode return") == number(gated_off.returns.mean())
    assert len(computed) == n_scorings, "a weight or gating edit must not compute components"

    # drill-down: one episode's per-step explanation sums to its step rewards
    episode = at.selectbox(key="rp_episode").value
    steps = next(d.value for d in at.dataframe if "step reward" in d.value.columns)
    components = [c for c in steps.columns if c in gated_off.matrix.step_names]
    # (each figure rounded to 3 significant digits for reading: the sum agrees to rounding)
    assert steps[components].sum(axis=1).tolist() == pytest.approx(steps["step reward"].tolist(), abs=0.05)
    shown = next(d.value for d in at.dataframe if "contribution" in d.value.columns)
    assert "tool_validity" in shown["component"].tolist()
    assert all(v == round_figures(np.array([v]))[0] for v in shown["contribution"])   # no 0.32000000000000006
    assert episode == gated_off.frame.episode_ids[0]


def pyramid_spec(at: AppTest) -> dict:
    """The drawn pyramid figure (plotly JSON)."""
    return json.loads(next(c.proto.spec for c in at.get("plotly_chart")
                           if "block widths follow the weights" in c.proto.spec))


def pyramid_widths(at: AppTest) -> dict[str, float]:
    """Each level's block width in the drawn pyramid (the sum of its components' bars), by level key."""
    spec = pyramid_spec(at)
    widths: dict[str, float] = {}
    for trace in spec["data"]:
        if trace.get("marker", {}).get("color") == "rgba(0,0,0,0)":
            continue   # the outline of a level that weighs nothing
        key = trace["y"][0].split()[0]
        widths[key] = widths.get(key, 0.0) + trace["x"][0]
    return widths


def test_pyramid_blocks_are_sized_by_weight_and_follow_an_edit(page):
    at = open_page()
    shipped = rewards.load_template("finance_risk")
    totals = {lv.key: sum(abs(c.weight) for c in lv.components) for lv in shipped.levels}
    widths = pyramid_widths(at)
    heaviest = max(totals.values())
    assert widths == pytest.approx({k: v / heaviest for k, v in totals.items()})
    labels = [t["y"][0] for t in pyramid_spec(at)["data"]]
    assert all("Σ" not in label and "weight " in label for label in labels)    # plain label, rounded numbers
    # the L4 weight raised live: its block grows, the others keep their share of the heaviest level
    slider(at, "business_impact").set_value(0.6).run()
    assert not at.exception
    after = pyramid_widths(at)
    totals["L4"] = 0.6
    heaviest = max(totals.values())
    assert after == pytest.approx({k: v / heaviest for k, v in totals.items()})
    assert after["L4"] > widths["L4"]


def test_parameter_edit_recomputes_only_that_component(page):
    _, computed = page
    at = open_page(tab="Parameters")
    before = metric(at, "Mean episode return")
    computed.clear()
    at.number_input(key="rp_p1_latency_per").set_value(0.5)
    next(b for b in at.button if b.label == "Apply parameters").click().run()
    assert not at.exception and not at.error
    assert computed == [["latency"]]                 # the other components came from the cache
    assert metric(at, "Mean episode return") != before
    caption = " ".join(c.value for c in at.caption)
    assert "Components computed for this dataset and parameters: latency;" in caption


def test_template_errors_are_shown_not_raised(page):
    at = open_page(tab="YAML")
    yaml_box = next(t for t in at.text_area if t.label == "Template YAML")
    text = yaml_box.value
    assert "tool_validity:" in text
    yaml_box.set_value(text.replace("tool_validity:", "tool_valdity:", 1))
    next(b for b in at.button if b.label == "Use this YAML").click().run()
    assert not at.exception
    messages = [e.value for e in at.error]
    assert any("unknown component 'tool_valdity' at line" in m for m in messages), messages
    # a bad parameter value is an error too, and the page keeps working
    show(at, "Parameters")
    at.text_input(key="rp_p1_trade_reversal_opposites").set_value("[[a, b")
    next(b for b in at.button if b.label == "Apply parameters").click().run()
    assert not at.exception
    assert any("parameter 'opposites' of 'trade_reversal' is not valid YAML" in e.value for e in at.error)
    assert metric(at, "Mean episode return")


def test_the_alias_bomb_in_the_yaml_box_is_refused_at_once(page):
    """Issue 17's alias bomb typed into the page: refused with the line and key, and the page
    keeps its last valid state (that the loader stops at the first anchor, whatever the
    bomb would grow to, is counted node by node in test_fuzz_inputs)."""
    from test_fuzz_inputs import ALIAS_BOMB

    at = open_page(tab="YAML")
    before = metric(at, "Mean episode return")
    yaml_box = next(t for t in at.text_area if t.label == "Template YAML")
    yaml_box.set_value(ALIAS_BOMB)
    next(b for b in at.button if b.label == "Use this YAML").click().run()
    assert not at.exception
    assert any("anchors (&a) are not allowed" in e.value and "line 3" in e.value for e in at.error), \
        [e.value for e in at.error]
    assert metric(at, "Mean episode return") == before


def test_save_creates_a_version_and_a_stale_save_shows_the_conflict(page):
    path, _ = page
    at = open_page(tab="Save & versions")
    slider(at, "latency").set_value(0.5).run()
    at.text_input(key="rp_save_message1").set_value("latency matters less")
    next(b for b in at.button if b.label == "Save as new version").click().run()
    assert not at.exception and not at.error
    assert "Saved finance_risk@1." in [s.value for s in at.success]
    assert at.selectbox(key="rp_template").value == "finance_risk@1"
    ws = Workspace.open(path)
    v1 = get_template(ws, "finance_risk")
    assert (v1.version, v1.base_version, v1.saved_by, v1.message) == (1, 0, "local", "latency matters less")
    assert v1.template().component("latency").weight == 0.5
    # the saved text is the shipped one with the edited weight: its comments and key order kept
    shipped_text = get_template(ws, "finance_risk", 0).yaml
    assert "# an unknown tool or a failed call earns nothing from L2-L4" in v1.yaml
    assert [(a, b) for a, b in zip(shipped_text.splitlines(), v1.yaml.splitlines()) if a != b] == [
        ("    weight: 1.0", "    weight: 0.5")] and len(shipped_text.splitlines()) == len(v1.yaml.splitlines())
    assert slider(at, "latency").value == 0.5       # the page now edits version 1
    assert at.session_state["rp_tab"] == "Save & versions"   # the save kept the tab open

    # someone else saves version 2 meanwhile; this page still edits version 1
    other = v1.template().with_weights({"tool_validity": 0.9})
    save_template(ws, Actor("bob", "analyst"), "finance_risk", other, 1, "bob's change")
    slider(at, "latency").set_value(0.4).run()
    next(b for b in at.button if b.label == "Save as new version").click().run()
    assert not at.exception
    messages = [e.value for e in at.error]
    assert any(m.startswith("template 'finance_risk' is at version 2 (saved by bob at ")
               and m.endswith("you edited version 1 — reload and re-apply your change") for m in messages), messages
    assert [v.version for v in list_versions(ws, "finance_risk")] == [0, 1, 2]
    diff = next(d.value for d in at.dataframe if "before" in d.value.columns and len(d.value) == 1)
    assert diff.iloc[0].to_dict() == {"section": "weight", "key": "tool_validity",
                                      "before": str(v1.template().component("tool_validity").weight),
                                      "after": "0.9"}
    next(b for b in at.button if b.label.startswith("Load finance_risk@2")).click().run()
    assert not at.exception and not at.error
    assert at.selectbox(key="rp_template").value == "finance_risk@2"
    assert slider(at, "tool_validity").value == 0.9


def test_calibration_tab_shows_power_and_roc_for_a_labelled_dataset(page):
    at = open_page(tab="Calibration")                # the tab runs only while it is open
    assert not at.exception
    table = next(d.value for d in at.dataframe if "90% low" in d.value.columns)
    assert table["score"].iloc[0] == "return"
    assert {"tool_validity", "evidence_reliability"} <= set(table["score"])
    assert table["auc"].between(0, 1).all()
    labelled = metric(at, "Episodes with a known outcome")
    assert labelled.endswith(f"of {labelled.split(' of ')[1]}") and int(labelled.split()[0]) > 0
    assert 0.0 <= float(metric(at, "Outcome model on unseen tasks")) <= 1.0
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("ROC of the episode return" in t for t in titles)
    assert any("Success rate per return decile" in t for t in titles)
    # within-task AUC beside the all-pairs one, and the learning curve
    assert any(m.label == "Return ranks each task's successes first" for m in at.metric)
    table = next(d.value for d in at.dataframe if "within-task AUC" in d.value.columns)
    assert table["tasks with both"].iloc[0] == table["tasks with both"].max()
    assert any("Held-out AUC against labelled episodes" in t for t in titles)
