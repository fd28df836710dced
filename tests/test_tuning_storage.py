"""The tuning storage: the batched writer of the default path against Optuna's journal
and RDB storages (every field read back through optuna.load_study), resuming, one writer
per default-path study, and the migration of a legacy optuna.db."""

from __future__ import annotations

import math
import os

import optuna
import pytest

from core import tuning
from core.base.errors import ConflictError, InputError
from core.tuning import (BatchedTrialWriter, count_trials, describe_url, open_journal, open_rdb,
                         open_storage)
from core.access.users import current_user
from _tuning_fixtures import fin_fast, finance_workspace

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -2, 2)
    n = trial.suggest_int("n", 1, 9)
    lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    kind = trial.suggest_categorical("kind", ["step", "linear", None])
    trial.set_user_attr("held_out", {"auc": x / 3, "nested": [1, "a"]})
    trial.set_constraint("bound", x - 1.0)
    if trial.number % 7 == 3:
        for step, v in enumerate((0.5, float("nan"), float("inf"), -float("inf"))):
            trial.report(v, step)
        raise optuna.TrialPruned()
    if trial.number % 11 == 5:
        raise ValueError("a failing trial")
    return float("inf") if trial.number == 8 else x * x + n + math.log(lr) + (kind == "step")


def _same(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> None:
    assert (a.number, a.state, a.params, a.distributions) == (b.number, b.state, b.params, b.distributions)
    assert a.values == b.values and a.user_attrs == b.user_attrs and a.system_attrs == b.system_attrs
    assert a.constraints == b.constraints
    assert a.datetime_start == b.datetime_start and a.datetime_complete == b.datetime_complete
    assert set(a.intermediate_values) == set(b.intermediate_values)
    for k, v in a.intermediate_values.items():
        w = b.intermediate_values[k]
        assert (math.isnan(v) and math.isnan(w)) or v == w


@pytest.mark.parametrize("backend", ["journal", "sqlite"])
def test_batched_writer_round_trips_every_field(tmp_path, backend):
    memory = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    memory.optimize(_objective, n_trials=40, catch=(ValueError,))
    states = {t.state for t in memory.trials}
    assert {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL} <= states
    if backend == "journal":
        path = tmp_path / "optuna.log"
        storage = open_journal(path)
        fresh = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    else:
        storage = fresh = open_rdb(f"sqlite:///{tmp_path / 'optuna.db'}")
    optuna.create_study(storage=storage, study_name="s", direction="maximize")
    writer = BatchedTrialWriter(storage, "s")
    trials = memory.get_trials(deepcopy=False)
    assert writer.write(trials[:13]) == 13 and writer.write(trials[13:]) == 27
    loaded = optuna.load_study(study_name="s", storage=fresh)     # a storage object of Optuna's own
    assert len(loaded.trials) == 40
    for a, b in zip(memory.trials, loaded.trials):
        _same(a, b)
    assert loaded.best_trial.number == memory.best_trial.number       # feasible best, as in memory
    # a trial out of sequence, or unfinished, is refused
    with pytest.raises(ValueError, match="continue"):
        writer.write(trials[:1])


@pytest.mark.parametrize("backend", ["journal", "sqlite"])
def test_batched_writer_refuses_a_second_writer(tmp_path, backend):
    url = str(tmp_path / "optuna.log") if backend == "journal" else f"sqlite:///{tmp_path / 'optuna.db'}"
    storage = open_storage(url)
    optuna.create_study(storage=storage, study_name="s", direction="maximize")
    memory = optuna.create_study(direction="maximize")
    memory.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=4)
    writer = BatchedTrialWriter(storage, "s")
    other = (optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url)) if backend == "journal"
             else url)                                                  # another process's own storage
    optuna.load_study(study_name="s", storage=other).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(ConflictError, match="another process"):
        writer.write(memory.trials)
    assert count_trials(storage, storage.get_study_id_from_name("s")) == 1      # nothing half-written


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
def test_count_trials_is_the_number_of_trials(n):
    storage = optuna.storages.InMemoryStorage()
    optuna.create_study(storage=storage, study_name="other").optimize(lambda t: t.suggest_float("x", 0, 1),
                                                                      n_trials=5)
    study = optuna.create_study(storage=storage, study_name="c")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=n)
    assert count_trials(storage, storage.get_study_id_from_name("c")) == len(study.trials) == n


def test_a_legacy_optuna_db_is_migrated_to_the_journal(tmp_path):
    ws = finance_workspace(tmp_path, n_episodes=20, seed=1)
    legacy = ws.artifact_dir("tuning") / "optuna.db"
    old = optuna.create_study(storage=f"sqlite:///{legacy}", study_name="old", direction="maximize")
    old.set_user_attr("rwb", {"config": {"objective": "outcome"}})
    old.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=6)
    before, best = old.trials, old.best_trial.number
    study = tuning.load_study(ws, "old")             # the workspace's default storage: its journal
    assert not legacy.exists() and legacy.with_name("optuna.db.migrated").is_file()
    assert study.user_attrs == {"rwb": {"config": {"objective": "outcome"}}}
    assert [(t.number, t.params, t.values) for t in study.trials] == [(t.number, t.params, t.values) for t in before]
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(ws.artifact_dir("tuning") / "optuna.log")))
    assert optuna.load_study(study_name="old", storage=journal).best_trial.number == best


def test_open_storage_tells_a_journal_from_a_database(tmp_path):
    assert isinstance(open_storage(str(tmp_path / "j.log")), optuna.storages.JournalStorage)
    assert isinstance(open_storage(f"sqlite:///{tmp_path / 'r.db'}"), optuna.storages.RDBStorage)
    assert open_journal(tmp_path / "j.log") is open_journal(str(tmp_path / "j.log"))   # one per file
    with pytest.raises(InputError, match="SQLAlchemy URL"):
        open_storage(str(tmp_path / "optuna.db"))


def test_open_rdb_errors_name_the_storage():
    with pytest.raises(InputError, match="SQLAlchemy URL"):
        open_rdb("optuna.db")
    with pytest.raises(InputError, match="cannot open|no database driver"):
        open_rdb("postgresql://rwb:secret@127.0.0.1:1/none")
    assert "secret" not in describe_url("postgresql://rwb:secret@db/x")


def test_default_path_persists_resumes_and_has_one_writer(tmp_path):
    ws = finance_workspace(tmp_path, n_episodes=60, seed=4)
    actor = current_user(ws)
    first = tuning.tune(ws, actor, fin_fast(), dataset="fin", trials=30, study="st", flush_seconds=0.05)
    study = tuning.load_study(ws, "st")
    assert [t.number for t in study.trials] == list(range(30))
    assert study.trials[0].user_attrs.get("baseline") is True        # the template's own weights first
    assert study.best_trial.number == first.best["trial"]
    second = tuning.tune(ws, actor, fin_fast(), dataset="fin", trials=20, study="st")
    study = tuning.load_study(ws, "st")
    assert [t.number for t in study.trials] == list(range(50)) and second.trials_total == 50
    assert second.best["value"] >= first.best["value"]                # the resumed sampler saw the old trials
    runs = tuning.study_runs(ws, "st")
    assert [r.status for r in runs] == ["finished", "finished"] and runs[-1].trials_done == 20
    # a live worker of the same default-path study blocks a second one
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status='running', pid=? WHERE id=?", (os.getppid(), runs[-1].id))
    with pytest.raises(ConflictError, match="being tuned"):
        tuning.tune(ws, actor, fin_fast(), dataset="fin", trials=1, study="st")
    # ... and a study name reused for other settings is refused
    with pytest.raises(ConflictError, match="different"):
        tuning.tune(ws, actor, fin_fast(), dataset="fin", trials=1, study="st", bounds={"tool_validity": "0:3"})
