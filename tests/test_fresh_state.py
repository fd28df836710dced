"""Fresh state after every action (issue 18): in the same app session, without opening the
page again, the list, table or picker an action changes shows the change, and the action's
outcome is said next to its button.

One test per action: export, register, approve, promote and roll back (Policies); launch
and stop a training run, and a run's progress (Training); start and stop a study, apply its
best weights, add a preference label (Tuning).  Training runs and tuning workers are stood
in for by ``sleep`` children (tests/test_guarded_actions.py's pattern), so the pages see
real, alive processes; exports and approvals are real (a tiny trained run, shared)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import module_hash_embedder, registry_figures, reseal, trained  # noqa: F401
from _tuning_fixtures import FIN_FAST, finance_workspace
from core.govern import registry
from core.govern.policy_folder import promotion_target
from core.rl import runs
from core import tuning
from core.govern.bundle import load_bundle
from core.policies import read_index
from core.rewards.versions import save_template
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, current_user

ROOT = Path(__file__).resolve().parents[1]
POLICIES = str(ROOT / "pages" / "policies.py")
TRAINING = str(ROOT / "pages" / "training.py")
TUNING = str(ROOT / "pages" / "tuning.py")
SMALL = {"total_steps": 4096, "n_envs": 16, "device": "cpu", "seed": 0}


def _tables(at: AppTest) -> list[pd.DataFrame]:
    return [d.value for d in at.dataframe]


def _table_with(at: AppTest, column: str) -> pd.DataFrame:
    return next(t for t in _tables(at) if column in t.columns)


def _ok(at: AppTest) -> None:
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]


# --------------------------------------------------------------------------- policies
#: The registry's held-out return per (name, version) (see _bundle_fixtures.registry_figures).
FIGURES: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    return trained(tmp_path_factory)


@pytest.fixture
def policy_ws(shared_run, tmp_path, monkeypatch):
    """A copy of the shared trained workspace (this test's exports and registrations stay in
    it), its own policies folder, and registry figures that beat the expert."""
    root = tmp_path / "ws"
    shutil.copytree(shared_run.root, root)
    monkeypatch.setenv("RWB_WORKSPACE", str(root))
    monkeypatch.setenv("RWB_POLICIES_DIR", str(tmp_path / "policies"))
    FIGURES.clear()
    registry_figures(monkeypatch, FIGURES)
    ws = Workspace.open(root)
    yield ws, shared_run
    ws.close()


def _policies_as(run, who: str, **state) -> AppTest:
    at = AppTest.from_file(POLICIES, default_timeout=180)
    at.session_state["actor"] = run.actor(who)
    for key, value in state.items():
        at.session_state[key] = value
    return at.run()


def _expert(run) -> float:
    return load_bundle(run.bundle).manifest.evaluation["expert_return"]


def _register(ws, run, tmp_path, version: str, *, name: str = "fresh", margin: float = 1.0) -> None:
    """Register a copy of the shared bundle as ``name`` ``version`` whose held-out return
    beats the expert by ``margin`` (and a production version with a smaller one)."""
    FIGURES[(name, version)] = _expert(run) + margin
    path = reseal(run.bundle, tmp_path / f"{name}-{version}.zip", name=name, version=version,
                  policy_return=_expert(run) + margin)
    registry.register(ws, run.actor("ana"), path)


def test_export_lists_the_bundle_at_once(policy_ws):
    ws, run = policy_ws
    at = _policies_as(run, "ana", policies_tab="Runs & bundles")
    _ok(at)
    assert "None in this workspace yet." in [c.value for c in at.caption]
    at.selectbox(key="policies_export_run").set_value(run.run_id)
    at.text_input(key="policies_export_name").input("fresh")
    at.text_input(key="policies_export_version").input("0.3.0")
    next(b for b in at.button if b.label == "Export bundle").click().run()
    _ok(at)
    assert [s.value for s in at.success] == [
        f"Wrote fresh-0.3.0.zip from {run.run_id}: it is selected in the bundles below, ready to register."]
    assert "None in this workspace yet." not in [c.value for c in at.caption]
    bundles = _table_with(at, "file")
    assert list(bundles["file"]) == ["fresh-0.3.0.zip"] and list(bundles["version"]) == ["0.3.0"]
    assert at.selectbox(key="policies_bundle_file").value == "fresh-0.3.0.zip"
    assert at.session_state["policies_tab"] == "Runs & bundles"            # the tab kept its place


def test_register_shows_the_candidate_in_the_registry(policy_ws, tmp_path):
    ws, run = policy_ws
    exported = ws.root / "artifacts" / "bundles"
    exported.mkdir(parents=True, exist_ok=True)
    reseal(run.bundle, exported / "fresh-0.4.0.zip", name="fresh", version="0.4.0")
    assert "fresh" not in registry.policy_names(ws)  # (the shared run's workspace may hold others)
    at = _policies_as(run, "ana", policies_tab="Runs & bundles")
    _ok(at)
    at.button(key="policies_register").click().run()
    _ok(at)
    assert [s.value for s in at.success] == [
        "Registered fresh-0.4.0.zip: it is a candidate in the Registry tab."]
    assert at.selectbox(key="policies_name").value == "fresh"
    assert at.selectbox(key="policies_version").value == "0.4.0"
    versions = _table_with(at, "stage")
    assert list(zip(versions["version"], versions["stage"])) == [("0.4.0", "candidate")]
    assert [m.value for m in at.metric if m.label == "Candidate"] == ["0.4.0"]
    assert at.session_state["policies_tab"] == "Runs & bundles"


def test_approve_updates_the_stage_and_the_buttons(policy_ws, tmp_path):
    ws, run = policy_ws
    _register(ws, run, tmp_path, "0.1.0")
    at = _policies_as(run, "bob", policies_name="fresh", policies_version="0.1.0")
    at.text_input(key="policies_comment").input("beats the expert on held-out episodes").run()
    at.button(key="policies_approve").click().run()
    _ok(at)
    assert [s.value for s in at.success] == ["Approved fresh 0.1.0: it may now be promoted."]
    versions = _table_with(at, "stage")
    assert list(zip(versions["version"], versions["stage"])) == [("0.1.0", "approved")]
    assert [m.value for m in at.metric if m.label == "Approved"] == ["0.1.0"]
    labels = [b.label for b in at.button]
    assert "Promote" in labels and "Approve" not in labels
    history = _table_with(at, "event")
    assert list(history["event"])[:2] == ["approved", "registered"]


def test_promote_shows_production_and_the_installed_version(policy_ws, tmp_path):
    ws, run = policy_ws
    _register(ws, run, tmp_path, "0.1.0")
    registry.approve(ws, run.actor("bob"), "fresh", "0.1.0", "beats the expert")
    at = _policies_as(run, "bob", policies_name="fresh", policies_version="0.1.0")
    at.button(key="policies_promote").click().run()
    _ok(at)
    assert [s.value for s in at.success] == [
        f"Promoted fresh 0.1.0 into {promotion_target().path}: it is production now."]
    assert read_index().policies["fresh"].active == "0.1.0"
    assert [m.value for m in at.metric if m.label == "Production"] == ["0.1.0"]
    assert any("active 0.1.0" in c.value for c in at.caption)
    assert list(_table_with(at, "stage")["stage"]) == ["production"]


def test_rollback_restores_the_previous_version_on_the_page(policy_ws, tmp_path):
    ws, run = policy_ws
    bob = run.actor("bob")
    for version, margin in (("0.1.0", 1.0), ("0.2.0", 2.0)):
        _register(ws, run, tmp_path, version, margin=margin)
        registry.approve(ws, bob, "fresh", version, "beats the expert")
        registry.promote(ws, bob, "fresh", version)
    at = _policies_as(run, "bob", policies_name="fresh", policies_version="0.2.0")
    assert [m.value for m in at.metric if m.label == "Production"] == ["0.2.0"]
    at.button(key="policies_rollback").click().run()
    _ok(at)
    assert [s.value for s in at.success] == ["Rolled fresh back: 0.1.0 is production again."]
    assert [m.value for m in at.metric if m.label == "Production"] == ["0.1.0"]
    assert any("active 0.1.0" in c.value for c in at.caption)
    assert _table_with(at, "event")["event"].iloc[0] == "rolled_back"


# --------------------------------------------------------------------------- training and tuning
@pytest.fixture
def fin_ws(tmp_path, monkeypatch):
    ws = finance_workspace(tmp_path / "ws", n_episodes=40, seed=2)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "for the fresh-state tests")
    yield ws
    ws.close()


def _end(children: list[subprocess.Popen], i: int = -1) -> None:
    children[i].kill()
    children[i].wait()


def _runs_table(at: AppTest) -> pd.DataFrame:
    return _table_with(at, "steps")


def test_launch_lists_the_run_in_the_table_and_the_picker(fin_ws, children):
    first = runs.launch_run(fin_ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    runs.finish_run(fin_ws, first.run_id, "finished")
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    at.selectbox(key="train_template").set_value("fin_fast@1")
    at.radio(key="train_device").set_value("cpu")
    at.number_input(key="train_steps").set_value(3000)
    at.number_input(key="train_seed").set_value(1).run()
    at.button(key="train_launch").click().run()
    _ok(at)
    new = next(r.id for r in runs.list_runs(fin_ws) if r.id != first.run_id)
    assert any(s.value.startswith(f"Started run {new}") for s in at.success)
    at.run()  # the table's own refresh (every 2 s while a run runs): it settles on what the launch wrote
    assert any(s.value.startswith(f"Started run {new}") for s in at.success)  # the notice stays
    table = _runs_table(at)
    assert list(table["run"]) == [new, first.run_id]
    assert table.set_index("run").loc[new, "status"] == "running"
    assert table.set_index("run").loc[new, "steps"] == "0 of 3,000 planned steps done"
    assert at.selectbox(key="train_run").options == [new, first.run_id]
    assert at.selectbox(key="train_run").value == new
    assert new in at.multiselect(key="train_compare").options


def test_progress_is_the_same_in_the_table_and_the_panel(fin_ws, children):
    started = runs.launch_run(fin_ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    assert _runs_table(at)["steps"].tolist() == ["0 of 4,096 planned steps done"]
    runs.record_update(fin_ws, started.run_id, 3, 3 * 1024, {"return_mean": 0.5})   # the trainer writes
    at.run()
    _ok(at)
    assert _runs_table(at)["steps"].tolist() == ["3,072 of 4,096 planned steps done"]
    assert _runs_table(at)["updates"].tolist() == [3]
    assert any(f"**{started.run_id}** · running · 3,072 of 4,096 planned steps done · 3 updates" in m.value
               for m in at.markdown)
    runs.finish_run(fin_ws, started.run_id, "finished")
    _end(children)
    at.run()
    assert _runs_table(at)["status"].tolist() == ["finished"]
    assert not any(b.label == "Stop" for b in at.button)


def test_stop_of_a_dead_trainer_marks_the_run_stopped_at_once(fin_ws, children):
    started = runs.launch_run(fin_ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    assert _runs_table(at)["status"].tolist() == ["running"]
    _end(children)             # the trainer dies between the page's drawing and the click
    at.button(key=f"train_stop_{started.run_id}").click().run()
    _ok(at)
    assert f"Stopped {started.run_id} (its trainer process was already gone)." in [s.value for s in at.success]
    assert _runs_table(at)["status"].tolist() == ["stopped"]
    assert not any(b.label == "Stop" for b in at.button)


def _study_labels(at: AppTest) -> list[str]:
    return list(at.selectbox(key="tune_name").options)      # as the picker shows them


def test_start_lists_the_study_as_running(fin_ws, children):
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_template"] = "fin_fast@1"
    at.session_state["tune_dataset"] = "fin"
    at.session_state["tune_tab"] = "Start a study"
    at.run()
    assert any("No study yet" in i.value for i in at.info)
    at.text_input(key="tune_study").input("fresh")
    at.button(key="tune_start").click().run()
    _ok(at)
    assert any(s.value.startswith("Started study fresh") for s in at.success)
    assert _study_labels(at) == ["fresh (running)"]
    assert at.session_state["tune_tab"] == "Start a study"
    # the worker dies: the next run of this session says so, and the start notice stays
    _end(children)
    at.run()
    assert _study_labels(at) == ["fresh (stopped unexpectedly)"]
    assert any(s.value.startswith("Started study fresh") for s in at.success)


def test_stop_of_a_dead_worker_updates_the_picker(fin_ws, children):
    tuning.launch_tuning(fin_ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5, study="halt")
    at = AppTest.from_file(TUNING, default_timeout=120).run()
    assert _study_labels(at) == ["halt (running)"]
    _end(children)             # the worker dies between the page's drawing and the click
    at.button(key="tune_stop_halt").click().run()
    assert not at.exception, at.exception
    # the study no longer runs: the picker and the panel say so, with why, and offer no Stop
    assert _study_labels(at) == ["halt (stopped unexpectedly)"]
    assert [e.value for e in at.error] == [
        "This study stopped unexpectedly: its worker process ended without reporting why (killed, or the "
        "machine restarted); the worker log may say more"]
    assert not any(b.label == "Stop" for b in at.button)


def test_apply_says_so_and_the_template_pickers_offer_the_new_version(fin_ws):
    tuning.tune(fin_ws, current_user(fin_ws), "fin_fast", dataset="fin", trials=12, study="apply")
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_name"] = "apply"
    at.run()
    before = at.selectbox(key="tune_template").options                  # now cached for this server
    assert "fin_fast@1" in before and "fin_fast@2" not in before
    at.text_input(key="tune_apply_msg_apply").input("tuned")
    at.button(key="tune_apply_apply").click().run()
    if tuning.apply_check(fin_ws, "apply").worse:     # worse on the held-out tasks: asked first
        at.button(key="tune_apply_force_apply").click().run()
    _ok(at)
    saved = [s.value for s in at.success if s.value.startswith("Saved fin_fast@2")]
    assert len(saved) == 1 and saved[0].endswith("pick it as the reward template to train or tune on.")
    assert "fin_fast@2" in at.selectbox(key="tune_template").options
    at.run()                                                   # still said after another rerun
    assert [s.value for s in at.success if s.value.startswith("Saved fin_fast@2")] == saved


def test_preference_label_is_listed_at_once(fin_ws):
    ids = [e.episode_id for e in fin_ws.episode_summaries("fin")]
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_pref_dataset"] = "fin"
    at.session_state["tune_tab"] = "Preference labels"
    at.run()
    assert "No labels yet in this dataset. The preferences objective needs some." in [c.value for c in at.caption]
    at.selectbox(key="tune_pref_better").select(ids[1])
    at.selectbox(key="tune_pref_worse").select(ids[2])
    next(b for b in at.button if b.label == "Add label").click().run()
    _ok(at)
    labels = _table_with(at, "better")
    assert list(zip(labels["better"], labels["worse"])) == [(ids[1], ids[2])]
