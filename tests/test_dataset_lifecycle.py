"""Archiving, restoring and deleting a dataset (core.data.datasets): who may, what is removed,
what refuses it (a run training on it, a study tuning on it, a registered policy trained on
it), the append-only record of each, the old workspaces migrated, and ``rwb datasets
archive|restore|delete``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from core.access.users import LOCAL_ADMIN, Actor, add_user
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.cli import main
from core.data.datasets import (
    DatasetInUse,
    _slug,
    archive_dataset,
    dataset_dependents,
    dataset_events,
    delete_dataset,
    deletion_preview,
    generate_file,
    restore_dataset,
)
from core.data.episode_views import import_upload
from core.data.importers import import_file
from core.records.store import MIGRATIONS, Workspace

#: The tables that hold a dataset's rows (by a ``dataset`` column), besides ``datasets`` itself.
DATASET_TABLES = ("episodes", "tools", "label_events", "preferences", "task_criteria", "imports")


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> Path:
    """20 generated finance episodes (rwb JSON Lines)."""
    path = tmp_path_factory.mktemp("lifecycle") / "small.jsonl"
    generate_file("finance", 20, 7, path)
    return path


@pytest.fixture
def ws(tmp_path, small_file):
    """A workspace without users holding ``small`` and ``other`` (the same episodes twice)."""
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, small_file, dataset="small")
    import_file(ws, small_file, dataset="other")
    yield ws
    ws.close()


def _rows_of(ws: Workspace, dataset: str) -> dict[str, int]:
    counts = {t: ws.conn.execute(f"SELECT COUNT(*) FROM {t} WHERE dataset=?", (dataset,)).fetchone()[0]
              for t in DATASET_TABLES}
    counts["datasets"] = ws.conn.execute("SELECT COUNT(*) FROM datasets WHERE name=?", (dataset,)).fetchone()[0]
    return counts


def _running_run(ws: Workspace, dataset: str) -> str:
    """A run record training on ``dataset`` (status running, no process), as create_run makes it."""
    from core.rewards import load_template
    from core.rl.ppo import PPOConfig
    from core.rl.runs import create_run

    return create_run(ws, LOCAL_ADMIN, template=load_template("finance_risk"), config=PPOConfig(), dataset=dataset)


# --------------------------------------------------------------------------- archive and restore
def test_archive_hides_a_dataset_keeps_its_data_and_restore_brings_it_back(ws):
    episodes = ws.episode_ids("small")
    event = archive_dataset(ws, LOCAL_ADMIN, "small")
    assert (event.dataset, event.event, event.actor, event.role) == ("small", "archived", "local", "admin")
    assert [d.name for d in ws.datasets()] == ["other"]
    listed = {d.name: d for d in ws.datasets(include_archived=True)}
    assert listed["small"].archived and not listed["other"].archived
    assert ws.episode_ids("small") == episodes and ws.has_dataset("small")   # the data stays
    assert archive_dataset(ws, LOCAL_ADMIN, "small") is None                   # already archived

    restored = restore_dataset(ws, LOCAL_ADMIN, "small")
    assert restored is not None and restored.event == "restored"
    assert [d.name for d in ws.datasets()] == ["other", "small"]
    assert restore_dataset(ws, LOCAL_ADMIN, "small") is None                   # not archived
    assert [e.event for e in dataset_events(ws, "small")] == ["archived", "restored"]


def test_an_archived_dataset_takes_no_import_until_restored(ws, small_file, tmp_path):
    archive_dataset(ws, LOCAL_ADMIN, "other")
    copy = tmp_path / "again.jsonl"
    copy.write_bytes(small_file.read_bytes() + b"\n")   # other bytes: not the import already done
    with pytest.raises(InputError, match="archived: restore it first") as err:
        import_file(ws, copy, dataset="other")
    assert err.value.field == "dataset"
    restore_dataset(ws, LOCAL_ADMIN, "other")
    assert import_file(ws, copy, dataset="other").episodes == 20


# --------------------------------------------------------------------------- delete
def test_delete_asks_for_the_name_and_says_what_would_go(ws):
    preview = deletion_preview(ws, "small")
    assert (preview.episodes, preview.imports, preview.blockers) == (20, 1, [])
    assert preview.steps == ws.conn.execute(
        "SELECT COUNT(*) FROM steps JOIN episodes ON uid = episode_uid WHERE dataset='small'").fetchone()[0] > 20
    before = _rows_of(ws, "small")
    for confirm in (None, "other", "SMALL"):
        with pytest.raises(InputError, match=r"would remove 20 episodes, \d+ steps and 1 import records") as err:
            delete_dataset(ws, LOCAL_ADMIN, "small", confirm=confirm)
        assert "add --yes" in str(err.value)
    assert _rows_of(ws, "small") == before and dataset_events(ws) == []
    with pytest.raises(InputError, match="no dataset named 'nope'"):
        delete_dataset(ws, LOCAL_ADMIN, "nope", confirm="nope")


def test_delete_removes_the_rows_and_files_of_that_dataset_only(ws, small_file):
    from core.rewards.labels import add_label
    from core.state.features import _slug as features_slug

    add_label(ws, LOCAL_ADMIN, "small", ws.episode_ids("small")[0], 1, note="looked at it")
    add_label(ws, LOCAL_ADMIN, "other", ws.episode_ids("other")[0], 0)
    upload = import_upload(ws, "mine.jsonl", small_file.read_bytes() + b"\n", dataset="small", actor=LOCAL_ADMIN)
    kept_copy = Path(upload.file)
    # the state features cache of the dataset (what core.state.features names its folder)
    assert _slug("dataset-small") == features_slug("dataset-small")
    features = ws.artifact_dir("states", features_slug("dataset-small"))
    (features / "features-0123.json").write_text("{}")
    bad = small_file.read_text().splitlines()
    bad[3] = "{not json"
    broken = small_file.with_name("broken-small.jsonl")
    broken.write_text("\n".join(bad) + "\n")
    report = Path(import_file(ws, broken, dataset="small", skip_invalid=True).report_path)
    assert report.is_file() and kept_copy.is_file()
    other_before = _rows_of(ws, "other")

    done = delete_dataset(ws, LOCAL_ADMIN, "small", confirm="small")
    assert (done.episodes, done.labels) == (20 + 20 + 19, 1)
    assert set(_rows_of(ws, "small").values()) == {0}
    assert ws.conn.execute("SELECT COUNT(*) FROM steps WHERE episode_uid NOT IN (SELECT uid FROM episodes)"
                           ).fetchone()[0] == 0
    assert not report.exists() and not features.exists() and not kept_copy.exists()
    assert not kept_copy.parent.exists()
    assert _rows_of(ws, "other") == other_before                      # the other dataset is whole
    assert [d.name for d in ws.datasets(include_archived=True)] == ["other"]

    (event,) = dataset_events(ws, "small")
    assert (event.event, event.actor, event.detail["episodes"], event.detail["labels"]) == ("deleted", "local", 59, 1)
    from core.access.audit import security_events

    assert [e.detail["dataset"] for e in security_events(ws, "dataset_deleted")] == ["small"]
    # the same file imports again: nothing of the deleted dataset remembers it
    again = import_file(ws, small_file, dataset="small")
    assert not again.already_imported and again.episodes == 20


def test_the_log_of_dataset_events_is_append_only(ws):
    archive_dataset(ws, LOCAL_ADMIN, "small")
    for sql in ("UPDATE dataset_events SET actor='someone'", "DELETE FROM dataset_events"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            with ws.transaction() as conn:
                conn.execute(sql)
    assert len(dataset_events(ws)) == 1


# --------------------------------------------------------------------------- what refuses it
def test_a_running_run_refuses_archive_and_delete_and_names_itself(ws):
    run_id = _running_run(ws, "small")
    before = _rows_of(ws, "small")
    with pytest.raises(DatasetInUse, match=f"cannot be deleted: run {run_id} is training on it") as err:
        delete_dataset(ws, LOCAL_ADMIN, "small", confirm="small")
    assert isinstance(err.value, ConflictError) and [d.name for d in err.value.dependents] == [run_id]
    with pytest.raises(DatasetInUse, match=f"cannot be archived: run {run_id}"):
        archive_dataset(ws, LOCAL_ADMIN, "small")
    assert _rows_of(ws, "small") == before and not ws.datasets(include_archived=True)[1].archived
    refused = dataset_events(ws, "small")
    assert [e.event for e in refused] == ["delete_refused", "archive_refused"]
    assert run_id in refused[0].detail["reason"] and refused[0].detail["dependents"] == [
        f"run {run_id} is training on it (stop it first)"]
    # the other dataset is free
    assert dataset_dependents(ws, "other") == []


def test_a_registered_policy_refuses_delete_but_not_archive(ws):
    run_id = _running_run(ws, "small")
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET status='finished' WHERE id=?", (run_id,))
        conn.execute("INSERT INTO policy_versions (name, version, bundle_path, bundle_sha256, manifest_digest, "
                     "manifest, run_id, created_by, registered_by, registered_at) VALUES "
                     "('fin-policy', '1.0.0', 'b.zip', 'x', 'y', '{}', ?, 'ana', 'ana', '2026-01-01T00:00:00Z')",
                     (run_id,))
    preview = deletion_preview(ws, "small")
    assert [b.text for b in preview.blockers] == [f"policy fin-policy 1.0.0 was trained on it (run {run_id})"]
    assert preview.runs_kept == [run_id]
    with pytest.raises(DatasetInUse, match="policy fin-policy 1.0.0 was trained on it.*Archive it instead"):
        delete_dataset(ws, LOCAL_ADMIN, "small", confirm="small")
    assert archive_dataset(ws, LOCAL_ADMIN, "small").event == "archived"


def test_a_finished_run_without_a_policy_lets_the_dataset_go(ws):
    run_id = _running_run(ws, "small")
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET status='finished' WHERE id=?", (run_id,))
    assert delete_dataset(ws, LOCAL_ADMIN, "small", confirm="small").episodes == 20
    assert ws.conn.execute("SELECT dataset FROM runs WHERE id=?", (run_id,)).fetchone() == ("small",)


def test_a_running_tuning_study_refuses_both(ws):
    with ws.transaction() as conn:
        conn.execute("INSERT INTO tuning_studies (name, objective, template_name, template_sha256, dataset, "
                     "config, created_by, created_at) VALUES ('st1', 'outcome', 'finance_risk', 'x', 'small', "
                     "'{}', 'ana', '2026-01-01T00:00:00Z')")
        conn.execute("INSERT INTO tuning_runs (study, status, trials_requested, started_by, started_at) "
                     "VALUES ('st1', 'running', 10, 'ana', '2026-01-01T00:00:00Z')")
    with pytest.raises(DatasetInUse, match="study st1 is tuning on it"):
        archive_dataset(ws, LOCAL_ADMIN, "small")
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status='failed' WHERE study='st1'")
    assert dataset_dependents(ws, "small") == []


# --------------------------------------------------------------------------- roles
def test_only_who_may_import_may_archive_restore_or_delete(ws):
    admin = add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-long").actor()
    for name, role in (("ana", "analyst"), ("rae", "reviewer"), ("bob", "approver")):
        add_user(ws, admin, name, role, password=f"{name}-password-long")
    before = _rows_of(ws, "small")
    for who in (Actor("rae", "reviewer"), Actor("bob", "approver")):
        for call in (lambda a: archive_dataset(ws, a, "small"), lambda a: restore_dataset(ws, a, "small"),
                     lambda a: delete_dataset(ws, a, "small", confirm="small")):
            with pytest.raises(PermissionDenied, match="may not import data"):
                call(who)
    assert _rows_of(ws, "small") == before and dataset_events(ws) == []
    with pytest.raises(PermissionDenied, match="local admin is retired"):
        archive_dataset(ws, LOCAL_ADMIN, "small")
    ana = Actor("ana", "analyst")
    assert archive_dataset(ws, ana, "small").actor == "ana"
    assert delete_dataset(ws, ana, "small", confirm="small").episodes == 20
    assert [(e.event, e.actor, e.role) for e in dataset_events(ws)] == [
        ("archived", "ana", "analyst"), ("deleted", "ana", "analyst")]


# --------------------------------------------------------------------------- old workspaces
def test_a_workspace_from_before_archiving_is_migrated_with_its_datasets_in_use(tmp_path):
    root = tmp_path / "old"
    root.mkdir()
    conn = sqlite3.connect(root / "workbench.db", isolation_level=None)
    conn.execute("BEGIN")
    for migration in MIGRATIONS[:9]:
        migration(conn)
    conn.execute("INSERT INTO datasets(name, domain, description, created_at) VALUES ('old', 'finance', NULL, 'then')")
    conn.execute("PRAGMA user_version=9")
    conn.execute("COMMIT")
    conn.close()
    ws = Workspace.open(root)
    assert ws.schema_version() == len(MIGRATIONS) == 10
    (old,) = ws.datasets()
    assert (old.name, old.archived) == ("old", False)
    assert archive_dataset(ws, LOCAL_ADMIN, "old").event == "archived"
    ws.close()


# --------------------------------------------------------------------------- the command line
def test_the_datasets_commands(ws, capsys):
    root = str(ws.root)
    ws.close()
    capsys.readouterr()
    assert main(["--workspace", root, "datasets", "delete", "small"]) == 2
    err = capsys.readouterr().err
    assert "would remove 20 episodes" in err and "add --yes" in err and "Traceback" not in err
    assert main(["--workspace", root, "datasets", "archive", "small"]) == 0
    assert "Archived dataset 'small'" in capsys.readouterr().out
    assert main(["--workspace", root, "datasets", "list", "--json"]) == 0
    assert [d["name"] for d in json.loads(capsys.readouterr().out)["datasets"]] == ["other"]
    assert main(["--workspace", root, "datasets", "list", "--archived"]) == 0
    assert "(archived " in capsys.readouterr().out
    assert main(["--workspace", root, "datasets", "restore", "small"]) == 0
    assert main(["--workspace", root, "datasets", "delete", "small", "--yes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["deleted"], out["episodes"]) == (True, 20)
    run_id = _running_run(Workspace.open(root), "other")
    assert main(["--workspace", root, "datasets", "delete", "other", "--yes"]) == 4
    assert f"run {run_id} is training on it" in capsys.readouterr().err
