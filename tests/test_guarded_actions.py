"""Guarded actions (issue 18): a training run or tuning study identical to one in flight is
refused with a ConflictError naming it, and the Training and Tuning pages launch only on an
explicit button click (an input change alone starts nothing), acknowledge what they started or
stopped, and show a refused duplicate as a warning naming the running one.

The background processes are stood in for by ``sleep`` children (real, alive processes the
guard can see), so no trainer or tuning worker runs here: the real processes are tested in
tests/test_runs.py and tests/test_tuning_page.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from _tuning_fixtures import FIN_FAST, finance_workspace
from core.rl import runs
from core import tuning
from core.base.errors import ConflictError
from core.rewards.versions import save_template
from core.access.users import LOCAL_ADMIN, current_user

ROOT = Path(__file__).resolve().parents[1]
TRAINING = str(ROOT / "pages" / "training.py")
TUNING = str(ROOT / "pages" / "tuning.py")
SMALL = {"total_steps": 2048, "n_envs": 16, "device": "cpu", "seed": 0}


@pytest.fixture
def ws(tmp_path, monkeypatch):
    ws = finance_workspace(tmp_path / "ws", n_episodes=40, seed=2)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "for the guard tests")
    yield ws
    ws.close()


# --------------------------------------------------------------------------- core: training runs
def test_identical_run_in_flight_is_refused_naming_it(ws, children):
    first = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    assert runs.get_run(ws, first.run_id).process_alive is True
    with pytest.raises(ConflictError) as refused:
        runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=dict(SMALL))
    assert f"run {first.run_id} is already training fin_fast @1" in str(refused.value)
    assert [r.id for r in runs.list_runs(ws)] == [first.run_id]
    assert len(children) == 1                                  # nothing was spawned for the refused one


def test_a_run_that_differs_is_not_a_duplicate(ws, children):
    first = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    other_seed = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config={**SMALL, "seed": 1})
    more_steps = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin",
                                 config={**SMALL, "total_steps": 4096})
    ids = {first.run_id, other_seed.run_id, more_steps.run_id}
    assert len(ids) == 3 and {r.id for r in runs.list_runs(ws)} == ids


def test_ended_or_dead_runs_do_not_block_a_relaunch(ws, children):
    first = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    runs.finish_run(ws, first.run_id, "stopped")
    second = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    # its process killed (the run still says running): interrupted, not in flight
    children[-1].kill()
    children[-1].wait()
    assert runs.get_run(ws, second.run_id).interrupted is True
    third = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    assert len({first.run_id, second.run_id, third.run_id}) == 3


def test_a_run_launched_but_not_yet_recorded_counts_as_queued(ws, children):
    """Between its row and its process (a launch racing another), a run is in flight for
    LAUNCH_GRACE_S seconds; after that a row without a process no longer blocks."""
    first = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET pid=NULL WHERE id=?", (first.run_id,))
    with pytest.raises(ConflictError, match=first.run_id):
        runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET created_at='2000-01-01T00:00:00Z' WHERE id=?", (first.run_id,))
    runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    assert len(runs.list_runs(ws)) == 2


# --------------------------------------------------------------------------- core: tuning studies
def test_study_already_running_is_refused_naming_its_run(ws, children):
    first = tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5)
    with pytest.raises(ConflictError) as refused:
        tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5)
    assert f"study {first.study!r} is already running (tuning run {first.run_id}" in str(refused.value)
    with pytest.raises(ConflictError, match=f"tuning run {first.run_id}"):   # same name given explicitly
        tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=50, study=first.study)
    assert [len(tuning.study_runs(ws, s.name)) for s in tuning.list_studies(ws)] == [1]
    # other settings make another study, which may run beside it
    other = tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5,
                                 config=tuning.TuneConfig(seed=1))
    assert other.study != first.study and len(tuning.list_studies(ws)) == 2


def test_a_study_whose_worker_died_can_be_started_again(ws, children):
    first = tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5, study="s")
    children[-1].kill()
    children[-1].wait()
    again = tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5, study="s")
    assert again.run_id != first.run_id and len(tuning.study_runs(ws, "s")) == 2


def test_cli_background_study_prints_its_worker(ws, children, capsys):
    from core.cli import main

    assert main(["tune", "--template", "fin_fast@1", "--dataset", "fin", "--trials", "5", "--study", "bg",
                 "--background", "--json"]) == 0
    started = json.loads(capsys.readouterr().out)
    assert list(started) == ["study", "run_id", "pid", "log"]
    assert started["study"] == "bg" and started["pid"] == children[-1].pid
    assert started["run_id"] == tuning.study_runs(ws, "bg")[0].id


# --------------------------------------------------------------------------- pages
def test_training_page_launches_only_on_the_button(ws, children):
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    assert not at.exception, at.exception
    at.selectbox(key="train_template").set_value("fin_fast@1")
    at.radio(key="train_device").set_value("cpu")
    at.number_input(key="train_steps").set_value(5000).run()      # what Enter in the field does
    assert not at.exception, at.exception
    assert runs.list_runs(ws) == [] and not children
    summary = " ".join(m.value for m in at.markdown)
    assert "**fin_fast@1** on **fin** for **5,000** environment steps on **cpu**" in summary
    at.button(key="train_launch").click().run()
    assert not at.exception, at.exception
    launched = runs.list_runs(ws)
    assert len(launched) == 1 and launched[0].total_steps == 5000
    run_id = launched[0].id
    assert [s.value for s in at.success if s.value.startswith("Started run")] == [
        f"Started run {run_id} (process {children[0].pid}): it is shown below, its curves fill in as it trains."]
    assert at.selectbox(key="train_run").value == run_id
    at.button(key="train_launch").click().run()                   # the second click a moment later
    assert not at.exception, at.exception
    assert len(runs.list_runs(ws)) == 1
    warnings = [w.value for w in at.warning]
    assert any(w.startswith(f"Not launched: run {run_id} is already training") for w in warnings), warnings


def test_training_page_stop_is_acknowledged(ws, children):
    started = runs.launch_run(ws, LOCAL_ADMIN, template="fin_fast@1", dataset="fin", config=SMALL)
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    at.button(key=f"train_stop_{started.run_id}").click().run()
    assert not at.exception, at.exception
    assert runs.get_run(ws, started.run_id).stop_requested is True
    ack = f"Stop requested for {started.run_id}: it stops after the current update, with a checkpoint."
    assert ack in [i.value for i in at.info]
    at = AppTest.from_file(TRAINING, default_timeout=120).run()  # still said on a later visit
    assert ack in [i.value for i in at.info]


def test_tuning_page_starts_only_on_the_button(ws, children):
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_template"] = "fin_fast@1"
    at.session_state["tune_dataset"] = "fin"
    at.run()
    at.number_input(key="tune_trials").set_value(7).run()
    at.text_input(key="tune_study").input("guarded").run()      # Enter in the name field
    assert not at.exception, at.exception
    assert tuning.list_studies(ws) == [] and not children
    assert any("Start runs **7** trials" in m.value and "**guarded**" in m.value for m in at.markdown)
    at.button(key="tune_start").click().run()
    assert not at.exception, at.exception
    run_id = tuning.study_runs(ws, "guarded")[0].id
    assert any(s.value.startswith(f"Started study guarded (tuning run {run_id}, worker process") for s in at.success)
    at.button(key="tune_start").click().run()
    assert [len(tuning.study_runs(ws, s.name)) for s in tuning.list_studies(ws)] == [1]
    warnings = [w.value for w in at.warning]
    assert any(w.startswith(f"Not started: study 'guarded' is already running (tuning run {run_id}")
               for w in warnings), warnings


def test_tuning_page_stop_is_acknowledged(ws, children):
    started = tuning.launch_tuning(ws, LOCAL_ADMIN, "fin_fast@1", dataset="fin", trials=5, study="halt")
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_name"] = "halt"
    at.run()
    at.button(key="tune_stop_halt").click().run()
    assert not at.exception, at.exception
    assert tuning.study_runs(ws, "halt")[0].stop_requested is True
    ack = "Stop requested for halt: its workers stop after their current trial."
    assert ack in [i.value for i in at.info]
    # its worker gone, a stop ends the run at once and says so
    children[0].kill()
    children[0].wait()
    at = AppTest.from_file(TUNING, default_timeout=120)
    at.session_state["tune_name"] = "halt"
    at.run()
    assert ack not in [i.value for i in at.info] and started.run_id == tuning.study_runs(ws, "halt")[0].id
