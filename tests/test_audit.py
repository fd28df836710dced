"""The audit trail (core.access.audit): exact schema, append-only, batching without loss, export."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.access import audit
from core.records.catalog import build_catalog
from core.cli import root
from core.records.episodes import Action, Episode, ToolSchema
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.base.results import to_jsonable
from core.records.store import DB_NAME, Workspace
from core.access.users import LOCAL_ADMIN, Actor

ENGINE = Actor.service()
ROOT = Path(__file__).resolve().parents[1]


def _count(ws: Workspace) -> int:
    """Committed records, seen through a separate connection (what another process sees)."""
    con = sqlite3.connect(ws.root / DB_NAME)
    try:
        return con.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
    finally:
        con.close()


def _record(i: int = 0, **kw) -> dict:
    rec = {"rde_action": 3, "rl_candidates": [{"id": 7, "prob": 0.6, "reward_est": 0.42},
                                              {"id": 3, "prob": 0.3, "reward_est": 0.2}],
           "final_action": 7, "reward_components": [{"name": "accuracy", "value": 0.8},
                                                    {"name": "risk", "value": -0.1}],
           "policy_version": "finance_risk@1.0.0", "episode_id": f"s{i % 3}",
           "input_hash": f"h{i}"}
    rec.update(kw)
    return rec


# --------------------------------------------------------------------------- the record
def test_record_has_exactly_the_seed_schema(ws):
    req = {"state": {"hour": 9}, "messages": [{"role": "user", "content": "sell?"}]}
    rec = audit.make_record({**_record(), "input_hash": None}, request=req)
    d = rec.to_dict()
    assert tuple(d) == audit.RECORD_KEYS == (
        "timestamp", "input_hash", "rde_action", "rl_candidates", "final_action",
        "reward_components", "policy_version", "episode_id", "decision_id")
    assert d["input_hash"] == audit.input_hash(req) == audit.input_hash(
        {"messages": req["messages"], "state": {"hour": 9}})  # key order does not matter
    assert d["rl_candidates"][0] == {"id": 7, "prob": 0.6, "reward_est": 0.42}
    assert d["reward_components"][1] == {"name": "risk", "value": -0.1}
    assert d["timestamp"].endswith("Z") and len(d["decision_id"]) == 32
    audit.write_record(ws, ENGINE, rec)
    stored = ws.conn.execute("SELECT record FROM audit").fetchone()[0]
    assert list(json.loads(stored)) == list(to_jsonable(audit.tail(ws, 1)[0])) == list(audit.RECORD_KEYS)


@pytest.mark.parametrize("change, field", [
    ({"surprise": 1}, "surprise"),
    ({"final_action": None}, "final_action"),
    ({"rl_candidates": [{"id": 1, "prob": 1.5, "reward_est": 0}]}, "rl_candidates.0.prob"),
    ({"rl_candidates": [{"id": 1, "prob": 0.5}]}, "rl_candidates.0.reward_est"),
    ({"reward_components": [{"name": "r", "value": float("nan")}]}, "reward_components.0.value"),
    ({"timestamp": "2025-01-01T10:00:00"}, "timestamp"),
    ({"timestamp": "yesterday"}, "timestamp"),
])
def test_invalid_records_are_refused(change, field):
    with pytest.raises(InputError) as err:
        audit.make_record({**_record(), **change})
    assert err.value.field == field


def test_input_hash_must_match_the_request():
    with pytest.raises(InputError, match="input_hash"):
        audit.make_record(_record(input_hash="not-it"), request={"state": {"a": 1}})


# --------------------------------------------------------------------------- append-only
def test_the_database_refuses_to_change_or_delete_records(ws):
    ids = [audit.write_record(ws, ENGINE, _record(i)) for i in range(3)]
    con = sqlite3.connect(ws.root / DB_NAME)  # not through core: the triggers guard the file
    for sql in ("UPDATE audit SET final_action='1'", "DELETE FROM audit WHERE seq=1",
                "DELETE FROM audit",
                f"INSERT OR REPLACE INTO audit(decision_id, timestamp, input_hash, final_action, "
                f"record, written_by) VALUES ('{ids[0]}', 't', 'h', '1', '{{}}', 'x')"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            con.execute(sql)
    con.close()
    assert [r.decision_id for r in audit.tail(ws, 10)] == ids
    assert audit.tail(ws, 10)[0].final_action == 7


def test_rewriting_a_decision(ws):
    rec = audit.make_record(_record())
    audit.write_record(ws, ENGINE, rec)
    audit.write_record(ws, ENGINE, rec)  # the same record again: an idempotent retry
    assert _count(ws) == 1
    with pytest.raises(ConflictError):
        audit.write_record(ws, ENGINE, {**rec.to_dict(), "final_action": 3})
    assert audit.tail(ws)[0].final_action == 7


# --------------------------------------------------------------------------- batching
def test_batch_commits_on_size(ws):
    w = audit.AuditWriter(ws, ENGINE, batch_size=10, flush_interval_s=60)
    for i in range(9):
        w.write(_record(i))
    time.sleep(0.1)
    assert (_count(ws), w.pending) == (0, 9)  # below the batch size, nothing committed
    w.write(_record(9))
    deadline = time.monotonic() + 5
    while _count(ws) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (_count(ws), w.pending) == (10, 0)
    w.close()


def test_batch_commits_on_time(ws):
    w = audit.AuditWriter(ws, ENGINE, batch_size=1000, flush_interval_s=0.2)
    for i in range(3):
        w.write(_record(i))
    assert _count(ws) == 0
    deadline = time.monotonic() + 5
    while _count(ws) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _count(ws) == 3
    w.close()


def test_flush_and_close_commit_everything_from_many_threads(ws):
    w = audit.AuditWriter(ws, ENGINE, batch_size=64, flush_interval_s=0.05)
    written: list[str] = []
    lock = threading.Lock()

    def serve(t: int) -> None:
        for i in range(500):
            did = w.write(_record(t * 1000 + i, input_hash=None), request={"t": t, "i": i},
                          action={"kind": "tool_call", "tool": "sell", "params": {"n": i}})
            with lock:
                written.append(did)

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.write(_record(99999))
    assert w.flush() >= 0 and w.pending == 0
    assert _count(ws) == 2001
    w.close()
    with pytest.raises(audit.AuditUnavailable, match="closed"):
        w.write(_record(1))
    stored = {r[0] for r in ws.conn.execute("SELECT decision_id FROM audit")}
    assert set(written) <= stored and len(stored) == 2001


def test_a_failed_commit_keeps_the_records(ws):
    w = audit.AuditWriter(ws, ENGINE, batch_size=1000, flush_interval_s=60, busy_timeout_s=0.1)
    for i in range(5):
        w.write(_record(i))
    blocker = sqlite3.connect(ws.root / DB_NAME, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        w.flush()
    assert w.pending == 5 and isinstance(w.last_error, sqlite3.OperationalError)
    blocker.execute("ROLLBACK")
    blocker.close()
    w.write(_record(5))
    assert w.flush() == 6
    assert [r.input_hash for r in audit.tail(ws, 10)] == [f"h{i}" for i in range(6)]
    w.close()


def test_synchronous_mode_commits_inside_write(ws):
    w = audit.AuditWriter(ws, ENGINE, synchronous=True)
    w.write(_record())
    assert _count(ws) == 1 and w.pending == 0
    w.close()


def _sync_write_then_die(root: str) -> None:
    w = audit.AuditWriter(Workspace.open(root), ENGINE, synchronous=True)
    w.write({"input_hash": "sync", "final_action": 2})
    os._exit(0)  # no exit handlers, no close(): only what write() committed survives


def test_synchronous_write_survives_a_hard_exit(ws):
    proc = multiprocessing.get_context("fork").Process(target=_sync_write_then_die,
                                                       args=(str(ws.root),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and _count(ws) == 1


def test_exit_handlers_commit_or_spill_and_recover(tmp_path):
    # One real interpreter exit, two writers that never call close():
    # on `ok` the exit handler commits; on `locked` another connection holds the write
    # lock, so the final commit fails and the records are spilled to a file.
    ok, locked = Workspace.open(tmp_path / "ok"), Workspace.open(tmp_path / "locked")
    script = f"""
        import sqlite3
        from core.records.store import Workspace
        from core.access import audit
        from core.access.users import Actor
        ok, locked = Workspace.open({str(ok.root)!r}), Workspace.open({str(locked.root)!r})
        w1 = audit.AuditWriter(ok, Actor.service(), batch_size=1000, flush_interval_s=3600)
        w2 = audit.AuditWriter(locked, Actor.service(), batch_size=1000, flush_interval_s=3600,
                               busy_timeout_s=0.1)
        for i in range(50):
            w1.write({{"input_hash": f"exit{{i}}", "final_action": 1}})
        for i in range(7):
            w2.write({{"input_hash": f"spill{{i}}", "final_action": 3}})
        blocker = sqlite3.connect(locked.root / "workbench.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # still held when the exit handlers run
        """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _count(ok) == 50
    assert "7 record(s) could not be committed" in proc.stderr
    assert _count(locked) == 0
    assert len(list((locked.artifacts / audit.UNFLUSHED_DIR).glob("*.jsonl"))) == 1
    with pytest.raises(PermissionDenied):
        audit.recover_unflushed(locked, Actor("rex", "reviewer"))
    assert audit.recover_unflushed(locked, LOCAL_ADMIN) == {
        "files": 1, "inserted": 7, "already": 0, "conflicts": 0}
    assert [r.input_hash for r in audit.tail(locked, 10)] == [f"spill{i}" for i in range(7)]
    assert not list((locked.artifacts / audit.UNFLUSHED_DIR).glob("*.jsonl"))
    ok.close()
    locked.close()


# --------------------------------------------------------------------------- reading
def test_tail_list_and_stats(ws):
    for i in range(6):
        audit.write_record(ws, ENGINE, _record(i, policy_version="p@1" if i < 4 else "p@2"))
    assert [r.input_hash for r in audit.tail(ws, 2)] == ["h4", "h5"]
    assert [r.input_hash for r in audit.tail(ws, 5, episode_id="s0")] == ["h0", "h3"]
    assert len(audit.list_records(ws, policy_version="p@2")) == 2
    first = audit.list_records(ws, newest_first=False, limit=1)[0]
    assert audit.list_records(ws, since=first.timestamp, until=first.timestamp) == []
    assert len(audit.list_records(ws, final_action=7)) == 6
    with pytest.raises(InputError, match="time zone"):
        audit.list_records(ws, since="2025-01-01T00:00:00")
    s = audit.stats(ws)
    assert (s.records, s.episodes, s.per_policy_version) == (6, 3, {"p@1": 4, "p@2": 2})


# --------------------------------------------------------------------------- export
def _serve(ws: Workspace, n_episodes: int = 3, steps: int = 4) -> list[dict]:
    """Interleaved decisions of several served episodes, with requests and actions."""
    writes = []
    with audit.AuditWriter(ws, ENGINE, batch_size=5) as w:
        for t in range(steps):
            for e in range(n_episodes):
                req = {"episode_id": f"sess-{e}", "task_type": "rebalance", "query": f"q{e}",
                       "domain": "finance", "state": {"hour": 9 + t, "volatility": 0.1 * e}}
                final = {"kind": "final_answer"} if t == steps - 1 else {
                    "kind": "tool_call", "tool": "get_stock_data", "params": {"period": "q3"}}
                rec = {"rde_action": 3, "rl_candidates": [], "final_action": 1 if
                       t == steps - 1 else 5, "episode_id": f"sess-{e}",
                       "policy_version": "finance_risk@1.0.0",
                       "reward_components": [{"name": "accuracy", "value": t / 10}]}
                w.write(rec, request=req, action=final)
                writes.append((e, t))
    return writes


def test_export_records(ws, tmp_path):
    _serve(ws)
    result = audit.export(ws, LOCAL_ADMIN, tmp_path / "out" / "audit.jsonl")
    lines = (tmp_path / "out" / "audit.jsonl").read_text().splitlines()
    assert result.records == len(lines) == 12
    recs = [json.loads(x) for x in lines]
    assert all(list(r) == list(audit.RECORD_KEYS) for r in recs)
    assert [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)


def test_export_as_episodes_validates_and_groups(ws, tmp_path):
    _serve(ws)
    out = tmp_path / "served.jsonl"
    result = audit.export(ws, LOCAL_ADMIN, out, as_episodes=True)
    assert (result.episodes, result.records) == (3, 12)
    episodes = [Episode.model_validate_json(line) for line in out.read_text().splitlines()]
    assert [e.episode_id for e in episodes] == ["sess-0", "sess-1", "sess-2"]  # by start time
    for e, ep in enumerate(episodes):
        assert ep.to_json() == out.read_text().splitlines()[e]  # canonical rwb lines
        assert ep.n_steps == 4 and ep.domain == "finance" and ep.task.task_type == "rebalance"
        assert [s.observation["state"]["hour"] for s in ep.steps] == [9, 10, 11, 12]
        assert [s.action.kind for s in ep.steps] == ["tool_call"] * 3 + ["final_answer"]
        assert ep.steps[0].action.params == {"period": "q3"}
        audit_steps = ep.meta["audit"]
        assert [a["reward_components"][0]["value"] for a in audit_steps] == [0, 0.1, 0.2, 0.3]
        assert [a["timestamp"] for a in audit_steps] == [s.timestamp for s in ep.steps]
        assert ep.behaviour == "finance_risk@1.0.0"
    one = audit.export(ws, LOCAL_ADMIN, tmp_path / "one.jsonl", as_episodes=True,
                       episode_id="sess-1")
    assert one.episodes == 1


def test_export_as_episodes_decodes_tokens_with_the_catalog(ws, tmp_path):
    tool = ToolSchema(name="get_stock_data", parameters={
        "type": "object", "properties": {"period": {"type": "string",
                                                    "enum": ["q1", "q2", "q3", "q4"]}},
        "required": ["period"]})
    catalog = build_catalog([tool])
    q3 = catalog.normalize(
        Action(kind="tool_call", tool="get_stock_data", params={"period": "q3"})).token_id
    audit.write_record(ws, ENGINE, {"input_hash": "a", "final_action": q3, "episode_id": "x"})
    audit.write_record(ws, ENGINE, {"input_hash": "b", "final_action": "F0", "episode_id": "x"})
    with pytest.raises(InputError, match="catalog"):
        audit.export(ws, LOCAL_ADMIN, tmp_path / "e.jsonl", as_episodes=True)
    assert not (tmp_path / "e.jsonl").exists()  # nothing half-written
    audit.export(ws, LOCAL_ADMIN, tmp_path / "e.jsonl", as_episodes=True, catalog=catalog)
    header, line = (tmp_path / "e.jsonl").read_text().splitlines()
    assert json.loads(header)["rwb_header"]["tools"][0]["name"] == "get_stock_data"
    ep = Episode.model_validate_json(line)
    assert ep.steps[0].action.tool == "get_stock_data"
    assert ep.steps[0].action.params == {"period": "q3"}
    assert catalog.normalize(ep.steps[0].action).token_id == q3
    assert ep.steps[1].action.kind == "final_answer"


def test_served_episodes_reimport_round_trip(ws, tmp_path):
    from core.data.importers import import_file

    _serve(ws)
    out = tmp_path / "served.jsonl"
    audit.export(ws, LOCAL_ADMIN, out, as_episodes=True)
    result = import_file(ws, out, dataset="production")
    assert (result.episodes, result.steps) == (3, 12)
    again = ws.load_episodes("production")
    exported = [Episode.model_validate_json(x) for x in out.read_text().splitlines()]
    assert [e.model_dump(exclude={"source"}) for e in again] == [
        e.model_dump(exclude={"source"}) for e in exported]


def test_cli_tail_and_export(ws, tmp_path):
    _serve(ws, n_episodes=2, steps=2)
    runner = CliRunner()
    r = runner.invoke(root, ["-w", str(ws.root), "audit", "tail", "-n", "3", "--json"])
    assert r.exit_code == 0, r.output
    stored = [json.loads(text) for (text,) in ws.conn.execute("SELECT record FROM audit ORDER BY timestamp, seq")]
    assert json.loads(r.output)["records"] == stored[-3:]           # the records as they were written
    out = tmp_path / "cli.jsonl"
    r = runner.invoke(root, ["-w", str(ws.root), "audit", "export", str(out), "--as-episodes",
                             "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["episodes"] == 2
    r = runner.invoke(root, ["-w", str(ws.root), "audit", "stats", "--json"])
    assert json.loads(r.output)["records"] == 4
