"""Guardrails of tuning: data that cannot be tuned is refused before a worker starts; a worker
that fails is recorded as failed with its cause, which the study list, the report and the Tuning
page show at the top (with no Stop button); weights that do worse than the template on held-out
episodes are saved only after a confirmation that names the drop (``force=``, ``--force``, the
page's confirm button), and the saved version keeps the tuned version's text apart from the
changed weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
from streamlit.testing.v1 import AppTest

from core import tuning
from core.access.users import current_user
from core.base.errors import ConflictError, InputError
from core.cli import main
from core.rewards.versions import get_template, list_versions, save_template
from core.tuning.records import now_iso
from _tuning_fixtures import FIN_FAST, finance_workspace

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "tuning.py")
ONE = "tuning needs at least two episodes"
NUMBER = r"-?\d+(\.\d+)?(e-?\d+)?"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A workspace with a 60-episode dataset, a one-episode dataset and fin_fast@1 (built once)."""
    root = tmp_path_factory.mktemp("guard") / "ws"
    ws = finance_workspace(root, n_episodes=60, seed=2)
    finance_workspace(root, n_episodes=1, seed=3, dataset="one")
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "for the guardrails")
    return root


@pytest.fixture
def ws(base, tmp_path, monkeypatch):
    import shutil

    from core.records.store import Workspace

    root = tmp_path / "ws"
    shutil.copytree(base, root)
    monkeypatch.setenv("RWB_WORKSPACE", str(root))
    monkeypatch.delenv("RWB_TUNE_STORAGE", raising=False)
    return Workspace.open(root)


def launched(ws, study: str, dataset: str) -> int:
    """The records ``launch_tuning`` writes before its worker starts (a study and a starting run); the
    run's id, which a worker gets as ``--run-id``."""
    with ws.transaction() as conn:
        conn.execute("INSERT INTO tuning_studies(name, storage, objective, template_name, template_version, "
                     "template_sha256, dataset, episodes_file, config, created_by, created_at) "
                     "VALUES (?, NULL, 'outcome', 'fin_fast', 1, '', ?, NULL, '{}', 'admin', ?)",
                     (study, dataset, now_iso()))
        cur = conn.execute("INSERT INTO tuning_runs(study, status, trials_requested, started_by, started_at) "
                           "VALUES (?, 'starting', 5, 'admin', ?)", (study, now_iso()))
    return int(cur.lastrowid)


def failed_study(ws, study: str = "one-study") -> str:
    """A launched study whose worker failed on a one-episode dataset (what a worker does, in this process)."""
    run_id = launched(ws, study, "one")
    with pytest.raises(InputError, match=ONE):
        tuning.tune(ws, current_user(ws), "fin_fast@1", dataset="one", trials=5, study=study, run_id=run_id)
    return study


def worse_study(ws, study: str = "worse") -> tuple[float, float]:
    """A finished study whose best trial (by the design folds) does worse than the template on the
    held-out tasks: a real trial of the study below the template, its objective value raised so
    it is the best (the over-fitting case).  (trial's held-out AUC, template's)."""
    res = tuning.tune(ws, current_user(ws), "fin_fast@1", dataset="fin", trials=12, study=study,
                      config=tuning.TuneConfig(metric="all_pairs"))
    template_auc = res.baseline["figures"]["held_out"]["auc"]
    st = tuning.load_study(ws, study)
    below = [t for t in st.trials if t.state.is_finished() and t.user_attrs.get("held_out_auc") is not None
             and t.user_attrs["held_out_auc"] < template_auc and all(v <= 0 for v in t.constraints.values())]
    assert below, "some trial of the study does worse than the template on the held-out tasks"
    donor = min(below, key=lambda t: t.user_attrs["held_out_auc"])
    st.add_trial(optuna.trial.create_trial(value=res.best["value"] + 1.0, params=donor.params,
                                           distributions=donor.distributions, user_attrs=donor.user_attrs,
                                           constraints=dict(donor.constraints)))
    return donor.user_attrs["held_out_auc"], template_auc


# --------------------------------------------------------------------------- failed studies
def test_a_dataset_that_cannot_be_tuned_is_refused_before_a_worker_starts(ws):
    assert ONE in tuning.tuning_refusal(ws, "one")
    assert ONE in tuning.tuning_refusal(ws, "one", "policy")
    assert "preference labels" in tuning.tuning_refusal(ws, "fin", "preferences")
    assert tuning.tuning_refusal(ws, "fin") is None
    with pytest.raises(InputError, match=f"not started: {ONE}: one has 1"):
        tuning.launch_tuning(ws, current_user(ws), "fin_fast@1", dataset="one", trials=5)
    assert tuning.list_studies(ws) == []                      # nothing launched, nothing listed


def test_a_failed_worker_is_failed_with_its_cause(ws):
    study = failed_study(ws)
    record = tuning.get_study(ws, study)
    assert record.status == "failed" and not record.running
    assert record.cause.startswith(ONE)
    run = tuning.study_runs(ws, study)[-1]
    assert run.status == "failed" and run.ended_at is not None and run.error == record.cause
    report = tuning.study_report(ws, study)
    assert report.status == "failed" and report.cause == record.cause
    assert not any("preparing" in n for n in report.notes)
    with pytest.raises(ConflictError, match=f"no running worker: it is failed \\({ONE}"):
        tuning.stop_tuning(ws, current_user(ws), study)


def test_a_worker_that_died_without_a_word_is_interrupted_with_that_said(ws):
    run_id = launched(ws, "gone", "fin")
    with ws.transaction() as conn:   # a process id that no process has (the worker was killed)
        conn.execute("UPDATE tuning_runs SET status='running', pid=?, host=? WHERE id=?",
                     (2**22 + 12345, __import__("socket").gethostname(), run_id))
    record = tuning.get_study(ws, "gone")
    assert record.status == "interrupted" and "ended without reporting why" in record.cause


def test_a_run_of_another_process_is_never_marked_failed(ws):
    run_id = launched(ws, "theirs", "fin")
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status='running', pid=1 WHERE id=?", (run_id,))
    tuning.fail_run(ws, run_id, InputError("not mine"))
    assert tuning.study_runs(ws, "theirs")[-1].status == "running"


def test_cli_list_and_show_say_why_a_study_failed(ws, capsys):
    study = failed_study(ws)
    assert main(["tune", "list"]) == 0
    out = capsys.readouterr().out
    assert "failed" in out and f"why: {ONE}" in out
    assert main(["tune", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["studies"][0]["cause"].startswith(ONE)
    assert main(["tune", "show", study]) == 0
    assert f"why it is failed: {ONE}" in capsys.readouterr().out


# --------------------------------------------------------------------------- applying worse weights
def test_apply_refuses_worse_weights_naming_the_drop_until_forced(ws, capsys):
    figure, template = worse_study(ws)
    check = tuning.apply_check(ws, "worse")
    assert check.worse and check.metric == "all_pairs"
    assert (check.template_label, check.new_label) == ("fin_fast@1", "fin_fast@2")
    assert check.drop == pytest.approx(template - figure)
    drop = (f"The tuned weights score {figure:.3f} on held-out episodes (held-out all-pairs AUC), "
            f"{template - figure:.3f} below fin_fast@1's {template:.3f}.")
    assert check.question == drop + " Save them anyway as fin_fast@2?"
    assert check.plain.startswith("Worse than the current template on episodes it was not tuned on")
    assert f"{figure:.3f}" in check.plain and f"{template:.3f}" in check.plain

    with pytest.raises(tuning.WorseThanTemplate) as refused:
        tuning.apply_study(ws, current_user(ws), "worse")
    assert drop in str(refused.value) and refused.value.check == check
    assert [v.version for v in list_versions(ws, "fin_fast")] == [1]

    # the CLI refuses the same way (exit 4, the drop named) and saves with --force
    assert main(["tune", "apply", "worse"]) == 4
    err = capsys.readouterr().err
    assert drop in err and "--force" in err
    assert main(["tune", "apply", "worse", "--force", "--json"]) == 0
    applied = json.loads(capsys.readouterr().out)
    guard = applied["figures"]["guard"]
    assert applied["label"] == "fin_fast@2" and guard["worse"] is True and guard["confirmed"] is True
    assert guard["figures"][0]["key"] == "all_pairs" and guard["figures"][0]["trial"] == pytest.approx(figure)

    # the new version is the tuned version's text with only the changed values rewritten
    old, new = get_template(ws, "fin_fast", 1).yaml.splitlines(), get_template(ws, "fin_fast", 2).yaml.splitlines()
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    assert len(old) == len(new) and 0 < len(changed) <= len(applied["diff"])
    assert all(re.sub(NUMBER, "#", a) == re.sub(NUMBER, "#", b) for a, b in changed)   # numbers only


def test_weights_no_worse_than_the_template_need_no_confirmation(ws):
    tuning.tune(ws, current_user(ws), "fin_fast@1", dataset="fin", trials=6, study="plain",
                config=tuning.TuneConfig(metric="all_pairs"))
    check = tuning.apply_check(ws, "plain")
    if check.worse:   # this small study's best happens to be below: the confirmation is then needed
        with pytest.raises(tuning.WorseThanTemplate):
            tuning.apply_study(ws, current_user(ws), "plain")
        return
    assert check.plain.startswith(("Better than", "As good as"))
    assert tuning.apply_study(ws, current_user(ws), "plain").label == "fin_fast@2"


# --------------------------------------------------------------------------- the page
def open_page(**state) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    for k, v in state.items():
        at.session_state[k] = v
    return at.run()


def test_page_shows_a_failed_study_as_failed_with_its_cause_and_no_stop(ws):
    study = failed_study(ws)
    at = open_page(tune_name=study)
    assert not at.exception, at.exception
    listed = next(d.value for d in at.dataframe if "why" in d.value.columns)
    row = listed[listed["study"] == study].iloc[0]
    assert row["status"] == "failed" and row["why"].startswith(ONE)
    assert at.error and at.error[0].value.startswith(f"This study failed: {ONE}")
    assert not [b for b in at.button if b.label == "Stop"]
    assert not any("preparing" in c.value for c in at.caption)


def test_page_start_says_at_once_that_one_episode_cannot_be_tuned(ws):
    at = open_page(tune_tab="Start a study", tune_dataset="one", tune_template="fin_fast@1")
    assert not at.exception, at.exception
    assert any(w.value.startswith(f"Cannot start: {ONE}") for w in at.warning)
    start = next(b for b in at.button if b.key == "tune_start")
    assert start.disabled


def test_page_asks_to_confirm_worse_weights_naming_the_drop(ws):
    figure, template = worse_study(ws)
    at = open_page(tune_name="worse")
    assert not at.exception, at.exception
    assert any(w.value.startswith("Worse than the current template on episodes it was not tuned on")
               for w in at.warning)
    at.button(key="tune_apply_worse").click()
    at = at.run()
    assert not at.exception, at.exception
    question = (f"The tuned weights score {figure:.3f} on held-out episodes (held-out all-pairs AUC), "
                f"{template - figure:.3f} below fin_fast@1's {template:.3f}. Save them anyway as fin_fast@2?")
    assert any(w.value == question for w in at.warning), [w.value for w in at.warning]
    assert [v.version for v in list_versions(ws, "fin_fast")] == [1]      # nothing saved before the yes
    at.button(key="tune_apply_force_worse").click()
    at = at.run()
    assert not at.exception and any("Saved fin_fast@2" in s.value for s in at.success)
    saved = list_versions(ws, "fin_fast")[-1]
    assert saved.version == 2 and saved.meta["tuning"]["guard"]["confirmed"] is True
