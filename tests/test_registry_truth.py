"""The registry is the only source of what production serves (issue 28, attacks 1-3 and
Build 1): the policies folder is a cache of the registry, never an authority.

Each attack is replayed as the issue reports it — an edited ``index.json``, a digest
planted in it before a rollback, an approval row inserted with SQL — and must be refused
(or ignored) with an entry in the security log.  Then the signed index a production
workspace (no registry records) serves from: unsigned, edited, untrusted or older than one
already served is refused; ``publish-index`` writes it again.  Then the registry's own
log: a row removed from it, and a signed approval that breaks the rules.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import PASSWORDS, module_hash_embedder, registry_figures, reseal, trained_copy  # noqa: F401
from _state_fixtures import HashEmbedder
from core.access.audit import security_events
from core.access.users import LOCAL_ADMIN, Actor
from core.base.errors import ConflictError
from core.govern import registry
from core.govern.bundle import load_bundle
from core.govern.policy_folder import PolicyIndexRefused, index_high_water
from core.govern.registry_records import RegistryLogBroken
from core.records.store import Workspace
from core.serve.serving import DecisionEngine, load_promoted


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_copy(tmp_path_factory)  # a registry of its own: these tests tamper with it


@pytest.fixture()
def ws(run):
    w = run.workspace()
    yield w
    w.close()


@pytest.fixture()
def policies(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "policies"
    monkeypatch.setenv("RWB_POLICIES_DIR", str(root))
    return root


FIGURES: dict[tuple[str, str], float] = {}


@pytest.fixture(autouse=True)
def own_figures(monkeypatch):
    FIGURES.clear()
    registry_figures(monkeypatch, FIGURES)


def _register(ws, run, tmp_path, name: str, version: str, above_expert: float) -> None:
    expert = load_bundle(run.bundle).manifest.evaluation["expert_return"]
    FIGURES[(name, version)] = expert + above_expert
    registry.register(ws, run.actor("ana"), reseal(run.bundle, tmp_path / f"{name}-{version}.zip", name=name,
                                                   version=version))


def _promote_two(ws, run, tmp_path, name: str, *, rollback: bool) -> None:
    """Promote 0.1.0 then 0.2.0 (each approved by bob), then roll back to 0.1.0 when asked."""
    bob = run.actor("bob")
    for version, above in (("0.1.0", 1.0), ("0.2.0", 2.0)):
        _register(ws, run, tmp_path, name, version, above)
        registry.approve(ws, bob, name, version, "beats its baseline on held-out episodes")
        registry.promote(ws, bob, name, version)
    if rollback:
        registry.rollback(ws, bob, name, "0.2.0 misbehaves")


def _edit_index(policies: Path, name: str, change) -> None:
    doc = json.loads((policies / "index.json").read_text())
    change(doc["policies"][name])
    (policies / "index.json").write_text(json.dumps(doc))


def _production(tmp_path: Path, run) -> Workspace:
    """A production workspace: no registry records, trusting the registry workspace's key."""
    from core.access import keys

    prod = Workspace.open(tmp_path / "prod")
    source = run.workspace()
    pem = tmp_path / "registry.pem"
    pem.write_text(keys.show(source).public_key_pem)
    source.close()
    keys.trust(prod, LOCAL_ADMIN, pem)
    return prod


def _events(ws, event: str, policy: str) -> list:
    return [e for e in security_events(ws, event) if str(e.detail.get("policy", "")).startswith(policy)]


# --------------------------------------------------------------------------- attack 1
def test_serve_decide_serves_the_registrys_version_not_an_edited_index(ws, run, tmp_path, policies, capsys):
    from core.cli import main

    _promote_two(ws, run, tmp_path, "truth1", rollback=True)
    _edit_index(policies, "truth1", lambda e: e.update(active="0.2.0"))          # the rolled-back version
    request = {"episode_id": "t1", "query": "Analyse the Q3 report of Kweichow Moutai 600519 for me",
               "task_type": "analysis", "state": {"hour": 10, "market_open": 1}}
    code = main(["--workspace", str(run.root), "serve", "decide", "--policy", "truth1", "--request",
                 json.dumps(request), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert [d["policy_version"] for d in json.loads(out.out)["decisions"]] == ["truth1@0.1.0"]
    refused = _events(ws, "policy_index_refused", "truth1")[-1]
    assert refused.detail["index_active"] == "0.2.0" and refused.detail["served"] == "0.1.0"
    assert "changed after" in refused.detail["reason"]


def test_a_running_engine_ignores_an_edited_index(ws, run, tmp_path, policies):
    _promote_two(ws, run, tmp_path, "truth1b", rollback=True)
    engine = DecisionEngine.from_policy(ws, "truth1b", embedder=HashEmbedder())
    try:
        _edit_index(policies, "truth1b", lambda e: e.update(active="0.2.0"))
        engine._pick_up_promotion()                                              # as at an episode start
        assert engine.policy_version == "truth1b@0.1.0" and engine.reload_error is None
    finally:
        engine.close()


def test_production_without_the_registry_refuses_an_edited_index(ws, run, tmp_path, policies):
    _promote_two(ws, run, tmp_path, "truth1c", rollback=True)
    prod = _production(tmp_path, run)
    assert load_promoted(prod, "truth1c").policy_version == "truth1c@0.1.0"     # the signed index
    _edit_index(policies, "truth1c", lambda e: e.update(active="0.2.0"))
    with pytest.raises(PolicyIndexRefused, match="publish-index truth1c"):
        load_promoted(prod, "truth1c")
    assert "changed after" in _events(prod, "policy_index_refused", "truth1c")[-1].detail["reason"]
    prod.close()


# --------------------------------------------------------------------------- attack 2
def test_rollback_records_the_registrys_digest_never_the_index(ws, run, tmp_path, policies):
    _promote_two(ws, run, tmp_path, "truth2", rollback=False)
    promoted = next(e for e in registry.history(ws, "truth2") if e.event == "promoted" and e.version == "0.1.0")
    _edit_index(policies, "truth2", lambda e: e["versions"]["0.1.0"].update(manifest_digest="f" * 64))
    entry = registry.rollback(ws, run.actor("bob"), "truth2", "0.2.0 misbehaves")
    last = registry.history(ws, "truth2")[-1]
    assert last.event == "rolled_back" and not last.detail["reinstalled"]
    assert last.detail["manifest_digest"] == promoted.detail["manifest_digest"] != "f" * 64
    assert entry.versions["0.1.0"]["manifest_digest"] == promoted.detail["manifest_digest"]  # the index healed
    assert load_promoted(ws, "truth2").manifest.digest == promoted.detail["manifest_digest"]  # production works
    refused = _events(ws, "policy_index_refused", "truth2")[-1]
    assert refused.detail["rewritten"] is True and "changed after" in refused.detail["reason"]


# --------------------------------------------------------------------------- attack 3
def _insert_event(ws, name: str, version: str, event: str, actor: str, role: str, detail: dict) -> None:
    """A row written with SQL, as anyone with write access to the database file could."""
    ws.conn.execute("INSERT INTO registry_events (name, version, event, actor, role, at, comment, detail) "
                    "VALUES (?,?,?,?,?,?,?,?)", (name, version, event, actor, role, "2026-01-01T00:00:00Z",
                                                 "looks good", json.dumps(detail)))
    ws.conn.commit()


def test_a_hand_inserted_approval_is_not_promoted_nor_listed(ws, run, tmp_path, policies):
    _register(ws, run, tmp_path, "truth3", "0.1.0", 1.0)
    _insert_event(ws, "truth3", "0.1.0", "approved", "ana", "analyst", {"gate": {"passed": True}})
    version = registry.get_version(ws, "truth3", "0.1.0")
    assert version.stage == "candidate" and version.approvals == []
    with pytest.raises(ConflictError, match="only an approved version.*event \\d+ \\(approved by ana\\)"):
        registry.promote(ws, run.actor("bob"), "truth3", "0.1.0")
    refused = _events(ws, "registry_record_refused", "truth3")[-1]
    assert (refused.detail["event_type"], refused.detail["by"]) == ("approved", "ana")
    assert "no registry signature" in refused.detail["reason"]
    assert not (policies / "truth3").exists()
    assert [u.event.actor for u in registry.unrecorded_events(ws, "truth3")] == ["ana"]


def test_a_copied_approval_does_not_approve_a_rolled_back_version(ws, run, tmp_path, policies):
    """The signature covers the row's position: a real approval copied into a new row is not one."""
    _promote_two(ws, run, tmp_path, "truth3b", rollback=True)
    approval = next(e for e in registry.history(ws, "truth3b") if e.event == "approved" and e.version == "0.2.0")
    _insert_event(ws, "truth3b", "0.2.0", "approved", approval.actor, approval.role, approval.detail)
    assert registry.get_version(ws, "truth3b", "0.2.0").stage == "rolled_back"
    with pytest.raises(ConflictError, match="only an approved version"):
        registry.promote(ws, run.actor("bob"), "truth3b", "0.2.0")
    assert "does not verify" in _events(ws, "registry_record_refused", "truth3b")[-1].detail["reason"]


def test_promote_rechecks_a_signed_approval_that_breaks_the_rules(ws, run, tmp_path, policies):
    """An approval the registry signed but that does not hold (written here with the
    workspace's key, as a bug or someone holding the key could): promote re-checks the
    gate, the approver's role and four-eyes from the records, and refuses."""
    _register(ws, run, tmp_path, "truth3c", "0.1.0", 1.0)
    with ws.transaction() as conn:
        registry._event(ws, conn, "truth3c", "0.1.0", "approved", Actor("ana", "analyst"), "mine",
                        {"gate": {"passed": False, "candidate": "truth3c@0.1.0"}})
    with pytest.raises(ConflictError, match="cannot be promoted.*no passing promotion gate.*analyst.*four-eyes"):
        registry.promote(ws, run.actor("bob"), "truth3c", "0.1.0")
    refused = _events(ws, "approval_refused", "truth3c")[-1]
    assert refused.detail["by"] == "ana" and "four-eyes rule: ana registered" in refused.detail["reason"]


# --------------------------------------------------------------------------- the signed index
def test_production_refuses_an_unsigned_or_untrusted_index_and_publish_index_mends_it(ws, run, tmp_path, policies,
                                                                                    monkeypatch, capsys):
    from core.cli import main

    _promote_two(ws, run, tmp_path, "truth4", rollback=False)
    stranger = Workspace.open(tmp_path / "stranger")                  # trusts no registry key
    with pytest.raises(PolicyIndexRefused, match="does not trust"):
        load_promoted(stranger, "truth4")
    assert _events(stranger, "policy_index_refused", "truth4")
    stranger.close()
    prod = _production(tmp_path, run)
    _edit_index(policies, "truth4", lambda e: e.pop("signed"))       # as an older version wrote it
    with pytest.raises(PolicyIndexRefused, match="no registry signed it.*publish-index truth4"):
        load_promoted(prod, "truth4")
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["bob"])
    code = main(["--workspace", str(run.root), "registry", "publish-index", "truth4", "--as", "bob", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    published = json.loads(out.out)["entries"][0]
    assert published["active"] == "0.2.0" and published["signed"]["sequence"] == registry.history(ws, "truth4")[-1].id
    assert load_promoted(prod, "truth4").policy_version == "truth4@0.2.0"
    prod.close()


def test_production_refuses_an_index_older_than_one_it_served(ws, run, tmp_path, policies):
    _register(ws, run, tmp_path, "truth5", "0.1.0", 1.0)
    registry.approve(ws, run.actor("bob"), "truth5", "0.1.0", "beats the expert")
    registry.promote(ws, run.actor("bob"), "truth5", "0.1.0")
    old_index = (policies / "index.json").read_bytes()
    _register(ws, run, tmp_path, "truth5", "0.2.0", 2.0)
    registry.approve(ws, run.actor("bob"), "truth5", "0.2.0", "beats 0.1.0")
    registry.promote(ws, run.actor("bob"), "truth5", "0.2.0")
    prod = _production(tmp_path, run)
    engine = DecisionEngine.from_policy(prod, "truth5", embedder=HashEmbedder())
    try:
        assert engine.policy_version == "truth5@0.2.0"
        seen = index_high_water(prod, "truth5")
        assert seen == registry.history(ws, "truth5")[-1].id
        (policies / "index.json").write_bytes(old_index)            # a validly signed, older index put back
        engine._pick_up_promotion()
        assert engine.policy_version == "truth5@0.2.0" and "older than" in engine.reload_error
    finally:
        engine.close()
    with pytest.raises(PolicyIndexRefused, match="older than event"):
        load_promoted(prod, "truth5")
    stale = _events(prod, "policy_index_stale", "truth5")[-1]
    assert stale.detail["seen"] == seen and stale.detail["sequence"] < seen and stale.detail["active"] == "0.1.0"
    prod.close()


# --------------------------------------------------------------------------- the registry's own log
def _without_guard(ws) -> sqlite3.Connection:
    """The database as someone with write access to its file sees it: the triggers dropped."""
    ws.conn.execute("DROP TRIGGER IF EXISTS registry_events_no_delete")
    ws.conn.commit()
    return ws.conn


def test_a_removed_event_breaks_the_log_and_nothing_acts_on_it(run, tmp_path, policies):
    shutil.copytree(run.root, tmp_path / "ws")                      # a copy: the triggers are dropped here
    w = Workspace.open(tmp_path / "ws")
    try:
        _promote_two(w, run, tmp_path, "truth6", rollback=True)
        approval = next(e for e in registry.history(w, "truth6") if e.event == "approved" and e.version == "0.1.0")
        rolled_back = registry.history(w, "truth6")[-1]
        conn = _without_guard(w)
        # the newest event removed (the rollback undone): the signed index still reflects it
        conn.execute("DELETE FROM registry_events WHERE id=?", (rolled_back.id,))
        conn.commit()
        assert registry.production_version(w, "truth6") == "0.2.0"
        with pytest.raises(RegistryLogBroken, match="removed from the database"):
            load_promoted(w, "truth6")
        # an event in the middle removed: the chain of signed events has a gap
        conn.execute("DELETE FROM registry_events WHERE id=?", (approval.id,))
        conn.commit()
        with pytest.raises(RegistryLogBroken, match="lost events"):
            registry.rollback(w, run.actor("bob"), "truth6")
        with pytest.raises(RegistryLogBroken, match="lost events"):
            load_promoted(w, "truth6")
        assert len(_events(w, "registry_log_broken", "truth6")) >= 3
    finally:
        w.close()


def test_register_refuses_an_oversized_file_by_its_size_before_reading_it(ws, run, tmp_path):
    big = tmp_path / "big.zip"
    with open(big, "wb") as f:  # sparse: 200 MB on paper, nothing on disk
        f.truncate(200 << 20)
    with pytest.raises(registry.BundleError, match="more than a bundle may hold"):
        registry.register(ws, run.actor("ana"), big)
    event = security_events(ws, "bundle_refused")[-1]
    assert event.detail["size"] == 200 << 20 and event.detail["file"] == str(big)
    assert not list(ws.artifact_dir("registry").glob(".incoming-*"))
