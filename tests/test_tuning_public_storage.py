"""A study made by `rwb tune` is an ordinary Optuna study: plain `optuna.load_study` with
Optuna's own storage classes reads its trials and attributes (the workspace journal and
an SQLite URL), and optuna-dashboard lists it."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import optuna
import pytest

from _tuning_fixtures import fin_fast, finance_workspace, write_template
from core.tuning import CLI

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Two studies made by the `rwb tune` command in a child process: ``journal`` on the
    workspace's default storage, ``rdb`` on an SQLite URL."""
    tmp = tmp_path_factory.mktemp("public")
    ws = finance_workspace(tmp / "ws", n_episodes=60, seed=3)
    template = write_template(fin_fast(), tmp / "fin_fast.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RWB_WORKSPACE": str(ws.root), "HF_HUB_OFFLINE": "1"}
    env.pop("RWB_TUNE_STORAGE", None)
    rdb_url = f"sqlite:///{tmp / 'shared.db'}"
    results = {}
    for study, extra in (("journal", []), ("rdb", ["--storage", rdb_url])):
        proc = subprocess.run([*CLI, "tune", "--template", str(template), "--dataset", "fin", "--study", study,
                               "--trials", "9", "--json", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[study] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"journal_path": ws.root / "artifacts" / "tuning" / "optuna.log", "rdb_url": rdb_url,
            "results": results}


def _check(study: optuna.Study, result: dict) -> None:
    trials = study.trials
    assert [t.number for t in trials] == list(range(9))
    assert all(t.state.is_finished() for t in trials)
    assert trials[0].user_attrs["baseline"] is True                     # the template's own weights first
    attrs = study.user_attrs["rwb"]
    assert attrs["template"]["name"] == "fin_fast" and attrs["config"]["objective"] == "outcome"
    assert set(trials[1].params) <= set(attrs["space"]["weights"])     # the searched weights, by name
    assert study.best_trial.number == result["best"]["trial"]             # the same best (feasible) trial
    assert study.best_value == pytest.approx(result["best"]["value"])


def test_the_workspace_journal_opens_with_plain_optuna(tuned):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = tuned["journal_path"]
    assert path.is_file() and not path.with_name("optuna.db").exists()
    storage = JournalStorage(JournalFileBackend(str(path)))
    _check(optuna.load_study(study_name="journal", storage=storage), tuned["results"]["journal"])
    assert tuned["results"]["journal"]["storage"] == str(path)         # what the page tells optuna-dashboard


def test_an_sqlite_url_study_opens_with_plain_optuna(tuned):
    # the URL's database holds exactly the study `rwb tune --storage URL` made, readable as is
    assert [s.study_name for s in optuna.get_all_study_summaries(tuned["rdb_url"])] == ["rdb"]
    study = optuna.load_study(study_name="rdb", storage=tuned["rdb_url"])
    assert len(study.trials) == 9
    _check(study, tuned["results"]["rdb"])


def test_optuna_dashboard_lists_the_journal_study(tuned):
    # optuna-dashboard's own storage guess from the path given on its command line
    from wsgiref.util import setup_testing_defaults

    import optuna_dashboard
    from optuna_dashboard._storage_url import get_storage

    app = optuna_dashboard.wsgi(get_storage(str(tuned["journal_path"])))
    environ: dict = {}
    setup_testing_defaults(environ)
    environ.update({"PATH_INFO": "/api/studies", "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()})
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status[0].startswith("200")
    assert [s["study_name"] for s in json.loads(body)["study_summaries"]] == ["journal"]
