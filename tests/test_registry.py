"""The policy registry (core.govern.registry), the promoted policies folder (core.policies), the
``rwb registry`` commands and the Policies page.

Roles and four-eyes are checked by calling ``core`` directly as the wrong person; the
promotion gate with registry evaluations that beat, or do not beat, the baseline (the
registry's own evaluation of the run, re-labelled per version by
``_bundle_fixtures.registry_figures``; tests/test_signing.py checks that the registry
computes it and never reads the manifest's); every
promotion and rollback by reading ``index.json``; the event log by trying to change it.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import (  # noqa: F401
    PASSWORDS,
    module_hash_embedder,
    registry_figures,
    reseal,
    workspace_key,
)
from core.govern import registry
from core.govern.bundle import BundleError, load_bundle, verify_bundle
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.policies import load_bundle_for, read_index

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture()
def policies(tmp_path, monkeypatch) -> Path:
    """A policies folder of this test only (never the source tree's core/policies)."""
    root = tmp_path / "policies"
    monkeypatch.setenv("RWB_POLICIES_DIR", str(root))
    return root


#: The registry's held-out return per (name, version) in the current test, and other changes
#: to its evaluation (see registry_figures).
FIGURES: dict[tuple[str, str], float] = {}
CHANGES: dict[tuple[str, str], dict] = {}


@pytest.fixture(autouse=True)
def own_figures(monkeypatch):
    FIGURES.clear()
    CHANGES.clear()
    registry_figures(monkeypatch, FIGURES, CHANGES)


@pytest.fixture()
def ws(run):
    w = run.workspace()
    yield w
    w.close()


def _expert(run) -> float:
    return load_bundle(run.bundle).manifest.evaluation["expert_return"]


def _registered(ws, run, tmp_path, name: str, version: str, policy_return: float) -> str:
    """Register a re-labelled copy of the run's bundle whose held-out return (as the registry
    evaluates it) is ``policy_return``."""
    FIGURES[(name, version)] = policy_return
    path = reseal(run.bundle, tmp_path / f"{name}-{version}.zip", name=name, version=version,
                  policy_return=policy_return)
    registry.register(ws, run.actor("ana"), path)
    return version


# --------------------------------------------------------------------------- register
def test_register_verifies_and_records_a_candidate(ws, run, tmp_path):
    ana = run.actor("ana")
    path = reseal(run.bundle, tmp_path / "reg.zip", name="reg")
    v = registry.register(ws, ana, path, comment="first export")
    assert v.stage == "candidate" and not v.already_registered
    assert v.created_by == "ana" and v.trained_by == "ana" and v.run_id == run.run_id
    assert Path(v.bundle_path).is_file() and verify_bundle(v.bundle_path).ok
    assert v.manifest["name"] == "reg" and v.manifest["digest"] == v.manifest_digest
    again = registry.register(ws, ana, path)                              # same bytes: a no-op
    assert again.already_registered and again.registered_at == v.registered_at
    other = reseal(run.bundle, tmp_path / "reg2.zip", name="reg", policy_return=1.0)
    with pytest.raises(ConflictError, match="already registered with other content"):
        registry.register(ws, ana, other)
    # a tampered bundle is refused and leaves no trace
    bad = tmp_path / "bad.zip"
    raw = bytearray(reseal(run.bundle, tmp_path / "reg3.zip", name="reg", version="0.9.0").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(BundleError):
        registry.register(ws, ana, bad)
    listed = registry.list_versions(ws, "reg")
    assert [x.version for x in listed] == ["0.1.0"]
    best = load_bundle(run.bundle).manifest.evaluation["best_logged"]   # shown on the Policies page
    assert listed[0].best_logged == f"{best['behaviour']} {best['return_mean']:.4g}"
    events = registry.history(ws, "reg")
    assert [(e.event, e.actor, e.comment) for e in events] == [("registered", "ana", "first export")]
    assert events[0].detail["bundle_sha256"] == v.bundle_sha256


def test_register_refuses_a_manifest_that_contradicts_the_run_record(ws, run, tmp_path):
    path = reseal(run.bundle, tmp_path / "liar.zip", name="liar")
    import zipfile

    # re-seal claiming someone else trained the run
    from _bundle_fixtures import members
    from core.govern.bundle import BUNDLE_FILES, write_bundle

    m = json.loads(members(path)["manifest.json"])
    m.pop("digest"), m.pop("files")
    m["trained_by"] = "cy"
    files = members(path)
    key = workspace_key(run.root)
    liar = write_bundle(tmp_path / "liar2.zip", m, {n: files[n] for n in BUNDLE_FILES}, key=key)
    assert zipfile.is_zipfile(liar) and verify_bundle(liar).ok
    with pytest.raises(BundleError, match="trained by 'cy'"):
        registry.register(ws, run.actor("ana"), liar)
    # approvals are given in the registry, never brought along in a manifest
    m["trained_by"] = "ana"
    m["approvals"] = [{"by": "bob", "role": "approver", "at": "2025-01-01T00:00:00Z", "comment": "forged"}]
    forged = write_bundle(tmp_path / "forged.zip", m, {n: files[n] for n in BUNDLE_FILES}, key=key)
    with pytest.raises(BundleError, match="approvals are given in the registry"):
        registry.register(ws, run.actor("ana"), forged)


# --------------------------------------------------------------------------- roles and four-eyes
def test_wrong_roles_are_refused_in_core(ws, run, tmp_path, policies):
    expert = _expert(run)
    _registered(ws, run, tmp_path, "roles", "0.1.0", expert + 1.0)
    with pytest.raises(PermissionDenied, match="export policy bundles"):
        registry.register(ws, run.actor("rae"), run.bundle)                 # a reviewer
    with pytest.raises(PermissionDenied, match="approve policies"):
        registry.approve(ws, run.actor("ana"), "roles", "0.1.0", "looks fine")  # an analyst
    with pytest.raises(PermissionDenied, match="approve policies"):
        registry.approve(ws, run.actor("rae"), "roles", "0.1.0", "looks fine")
    registry.approve(ws, run.actor("bob"), "roles", "0.1.0", "beats the expert")
    with pytest.raises(PermissionDenied, match="promote policies"):
        registry.promote(ws, run.actor("ana"), "roles", "0.1.0")
    with pytest.raises(PermissionDenied, match="roll back policies"):
        registry.rollback(ws, run.actor("rae"), "roles")
    from core.access.users import Actor

    with pytest.raises(PermissionDenied, match="not a user"):                # a made-up approver
        registry.promote(ws, Actor("mallory", "approver"), "roles", "0.1.0")
    with pytest.raises(PermissionDenied, match="retired"):                  # multi-user: no local admin
        from core.access.users import LOCAL_ADMIN

        registry.promote(ws, LOCAL_ADMIN, "roles", "0.1.0")
    assert not policies.exists() or read_index(policies).policies == {}


def test_self_approval_is_refused_four_eyes(ws, run, tmp_path):
    from core.access.users import set_role

    expert = _expert(run)
    # ada (an admin, who may approve) registered this one: she may not approve it, bob may
    FIGURES[("eyes", "0.1.0")] = expert + 1.0
    path = reseal(run.bundle, tmp_path / "eyes.zip", name="eyes")
    registry.register(ws, run.actor("ada"), path)
    with pytest.raises(PermissionDenied, match="four-eyes rule: ada exported this policy"):
        registry.approve(ws, run.actor("ada"), "eyes", "0.1.0", "my own work is great")
    # ana trained the run: even as an approver she may not approve it
    ada = run.actor("ada")
    set_role(ws, ada, "ana", "approver")
    try:
        from core.access.users import Actor

        with pytest.raises(PermissionDenied, match="four-eyes rule: ana (trained|exported)"):
            registry.approve(ws, Actor("ana", "approver"), "eyes", "0.1.0", "my own work is great")
    finally:
        set_role(ws, ada, "ana", "analyst")
    with pytest.raises(InputError, match="comment"):
        registry.approve(ws, run.actor("bob"), "eyes", "0.1.0", "  ")
    approved = registry.approve(ws, run.actor("bob"), "eyes", "0.1.0", "independent check")
    assert approved.stage == "approved"
    assert [(a.by, a.comment) for a in approved.approvals] == [("bob", "independent check")]
    with pytest.raises(ConflictError, match="only a candidate"):
        registry.approve(ws, run.actor("cy"), "eyes", "0.1.0", "again")  # another approver may, not twice


def test_the_embedded_local_admin_cannot_approve_its_own_bundle(run, tmp_path, monkeypatch):
    from core.access import keys
    from core.records.store import Workspace
    from core.access.users import LOCAL_ADMIN

    solo = Workspace.open(tmp_path / "solo")
    path = reseal(run.bundle, tmp_path / "solo.zip", name="solo")
    # another workspace's bundle: refused until its key is trusted, then because the registry
    # cannot evaluate a run it does not have
    with pytest.raises(BundleError, match="does not trust"):
        registry.register(solo, LOCAL_ADMIN, path)
    pem = tmp_path / "run.pem"
    pem.write_text(keys.show(run.workspace()).public_key_pem)
    keys.trust(solo, LOCAL_ADMIN, pem)
    monkeypatch.undo()   # the registry's real own record, not registry_figures
    with pytest.raises(BundleError, match="not in this workspace"):
        registry.register(solo, LOCAL_ADMIN, path)
    assert registry.list_versions(solo) == []
    # a record naming someone else as the trainer: the registering local admin still may not approve
    monkeypatch.setattr(registry, "_own_record", lambda ws, m, members: {"trained_by": "ana", "evaluation": {}})
    registry.register(solo, LOCAL_ADMIN, path)
    with pytest.raises(PermissionDenied, match="four-eyes rule: local exported"):
        registry.approve(solo, LOCAL_ADMIN, "solo", "0.1.0", "trust me")
    solo.close()


# --------------------------------------------------------------------------- the promotion gate
def test_gate_first_version_must_beat_the_logged_expert(ws, run, tmp_path):
    bob = run.actor("bob")
    expert = _expert(run)
    # the real tiny run: a few seconds of PPO do not beat the expert's log
    registry.register(ws, run.actor("ana"), reseal(run.bundle, tmp_path / "real.zip", name="gate-real"))
    gate = registry.promotion_gate(ws, "gate-real", "0.1.0")
    ev = load_bundle(run.bundle).manifest.evaluation
    real = ev["paired"][ev["best_logged"]["behaviour"]]["policy"]      # from the expert's start states
    assert gate.baseline == "logged expert behaviour" and gate.baseline_return == expert
    assert gate.candidate_return == real and gate.passed == (real > expert)
    if not gate.passed:
        with pytest.raises(registry.GateFailed, match="does not beat logged expert behaviour"):
            registry.approve(ws, bob, "gate-real", "0.1.0", "ship it")
    _registered(ws, run, tmp_path, "gate1", "0.1.0", expert - 0.01)
    with pytest.raises(registry.GateFailed, match=f"{expert - 0.01:.4g} vs {expert:.4g}"):
        registry.approve(ws, bob, "gate1", "0.1.0", "close enough")
    assert registry.get_version(ws, "gate1", "0.1.0").stage == "candidate"
    _registered(ws, run, tmp_path, "gate1", "0.2.0", expert + 0.01)
    approved = registry.approve(ws, bob, "gate1", "0.2.0", "beats the expert")
    gate = registry.history(ws, "gate1")[-1].detail["gate"]
    assert approved.stage == "approved" and gate["passed"] and gate["baseline_return"] == expert


def test_gate_later_versions_must_beat_production(ws, run, tmp_path, policies):
    bob = run.actor("bob")
    expert = _expert(run)
    _registered(ws, run, tmp_path, "gate2", "0.1.0", expert + 1.0)
    registry.approve(ws, bob, "gate2", "0.1.0", "beats the expert")
    registry.promote(ws, bob, "gate2", "0.1.0")
    _registered(ws, run, tmp_path, "gate2", "0.2.0", expert + 0.5)   # beats the expert, not production
    gate = registry.promotion_gate(ws, "gate2", "0.2.0")
    assert gate.baseline == "production gate2@0.1.0" and not gate.passed
    assert "same held-out episodes" in gate.baseline_source
    with pytest.raises(registry.GateFailed, match="does not beat production gate2@0.1.0"):
        registry.approve(ws, bob, "gate2", "0.2.0", "newer is better")
    _registered(ws, run, tmp_path, "gate2", "0.3.0", expert + 2.0)
    assert registry.approve(ws, bob, "gate2", "0.3.0", "beats production").stage == "approved"


def test_gate_reruns_production_on_the_candidates_heldout_episodes(ws, run, tmp_path, policies):
    """A production version evaluated on other held-out episodes is re-run on the candidate's."""
    bob = run.actor("bob")
    expert = _expert(run)
    CHANGES[("gate3", "0.1.0")] = {"heldout_fingerprint": "f" * 64}   # "evaluated on another split"
    _registered(ws, run, tmp_path, "gate3", "0.1.0", expert + 5.0)
    registry.approve(ws, bob, "gate3", "0.1.0", "beats the expert")
    registry.promote(ws, bob, "gate3", "0.1.0")
    real = load_bundle(run.bundle).manifest.evaluation["policy"]["return_mean"]
    _registered(ws, run, tmp_path, "gate3", "0.2.0", real + 0.25)
    gate = registry.promotion_gate(ws, "gate3", "0.2.0")
    # the production policy is the run's own agent: re-run, it scores what the run's evaluation says
    assert gate.baseline_source.startswith("the production policy re-run")
    assert gate.baseline_return == pytest.approx(real, abs=1e-5)
    assert gate.passed


# --------------------------------------------------------------------------- promote and roll back
def test_promote_and_rollback_write_the_index(ws, run, tmp_path, policies):
    bob, cy = run.actor("bob"), run.actor("cy")
    expert = _expert(run)
    _registered(ws, run, tmp_path, "prod", "0.1.0", expert + 1.0)
    with pytest.raises(ConflictError, match="only an approved version"):
        registry.promote(ws, bob, "prod", "0.1.0")
    registry.approve(ws, bob, "prod", "0.1.0", "beats the expert on held-out episodes")
    entry = registry.promote(ws, cy, "prod", "0.1.0", "first release")
    index = json.loads((policies / "index.json").read_text())
    assert index["policies"]["prod"]["active"] == "0.1.0" and index["policies"]["prod"]["previous"] == []
    # the file keeps its own form (no typed-only fields such as the entry's name), signed by the registry
    assert set(index) == {"rwb_policies", "policies"}
    assert set(index["policies"]["prod"]) == {"active", "previous", "versions", "updated_at", "signed"}
    assert read_index(policies).policies["prod"] == entry
    assert entry.versions["0.1.0"]["promoted_by"] == "cy" and entry.versions["0.1.0"]["approved_by"] == ["bob"]
    installed = policies / "prod" / "0.1.0"
    assert sorted(p.name for p in installed.iterdir()) == sorted(["manifest.json", "signature.json", *__import__(
        "core.govern.bundle", fromlist=["BUNDLE_FILES"]).BUNDLE_FILES])
    b = load_bundle_for("prod")
    assert b.version == "0.1.0" and [(a.by, a.comment) for a in b.manifest.approvals] == [
        ("bob", "beats the expert on held-out episodes")]

    _registered(ws, run, tmp_path, "prod", "0.2.0", expert + 2.0)
    registry.approve(ws, cy, "prod", "0.2.0", "beats 0.1.0")
    registry.promote(ws, bob, "prod", "0.2.0")
    index = read_index(policies).policies["prod"]
    assert (index.active, index.previous) == ("0.2.0", ["0.1.0"])
    assert load_bundle_for("prod").version == "0.2.0"
    assert registry.aliases(ws, "prod") == {"production": "0.2.0", "approved": "0.1.0", "candidate": None}

    entry = registry.rollback(ws, bob, "prod", "0.2.0 misbehaves in production")
    assert (entry.active, entry.previous) == ("0.1.0", [])
    assert entry.rolled_back[-1]["version"] == "0.2.0"
    assert load_bundle_for("prod").version == "0.1.0"
    stages = {v.version: v.stage for v in registry.list_versions(ws, "prod")}
    assert stages == {"0.1.0": "production", "0.2.0": "rolled_back"}
    with pytest.raises(ConflictError, match="no previous production version"):
        registry.rollback(ws, bob, "prod")
    with pytest.raises(ConflictError, match="only an approved version"):
        registry.promote(ws, bob, "prod", "0.2.0")  # rolled back: it needs a new approval
    events = [(e.event, e.version, e.actor) for e in registry.history(ws, "prod")]
    assert events == [("registered", "0.1.0", "ana"), ("approved", "0.1.0", "bob"), ("promoted", "0.1.0", "cy"),
                      ("registered", "0.2.0", "ana"), ("approved", "0.2.0", "cy"), ("promoted", "0.2.0", "bob"),
                      ("rolled_back", "0.1.0", "bob")]
    assert registry.history(ws, "prod")[-1].detail["from"] == "0.2.0"
    index = json.loads((policies / "index.json").read_text())
    assert [r["version"] for r in index["policies"]["prod"]["rolled_back"]] == ["0.2.0"]
    compared = registry.compare_versions(ws, [("prod", "0.1.0"), ("prod", "0.2.0")])
    assert [(c.policy, c.stage) for c in compared] == [("prod@0.1.0", "production"), ("prod@0.2.0", "rolled_back")]
    assert compared[1].return_policy == expert + 2.0
    assert list(compared[0].row())[:3] == ["policy", "stage", "run"]


def test_rollback_reinstalls_a_damaged_previous_version_and_load_refuses_tampering(ws, run, tmp_path, policies):
    bob = run.actor("bob")
    expert = _expert(run)
    for version, ret in (("0.1.0", expert + 1.0), ("0.2.0", expert + 2.0)):
        _registered(ws, run, tmp_path, "heal", version, ret)
        registry.approve(ws, bob, "heal", version, "beats its baseline")
        registry.promote(ws, bob, "heal", version)
    # someone edits the installed active copy: production refuses to load it
    active = policies / "heal" / "0.2.0" / "masks.yaml"
    active.write_text(active.read_text() + "\n# edited in place\n")
    with pytest.raises(BundleError, match="masks.yaml"):
        load_bundle_for("heal")
    # the previous copy is damaged too: rollback restores it from the registry's copy
    (policies / "heal" / "0.1.0" / "rde.json").unlink()
    entry = registry.rollback(ws, bob, "heal", "bad release")
    assert entry.active == "0.1.0" and registry.history(ws, "heal")[-1].detail["reinstalled"]
    assert load_bundle_for("heal").version == "0.1.0"


def test_events_and_versions_are_append_only(ws, run, tmp_path):
    _registered(ws, run, tmp_path, "log", "0.1.0", 0.0)
    conn = ws.conn
    for sql in ("UPDATE registry_events SET actor='mallory'", "DELETE FROM registry_events",
                "UPDATE policy_versions SET created_by='mallory'", "DELETE FROM policy_versions",
                "INSERT OR REPLACE INTO registry_events (id, name, version, event, actor, role, at) "
                "SELECT id, name, version, 'approved', 'mallory', 'approver', at FROM registry_events LIMIT 1",
                "INSERT OR REPLACE INTO policy_versions SELECT * FROM policy_versions LIMIT 1"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only|never|already"):
            conn.execute(sql)
    assert registry.history(ws, "log")[0].actor == "ana"


def test_fresh_checkout_has_an_index():
    index = read_index(ROOT / "core" / "policies")
    assert index.rwb_policies == 1 and isinstance(index.policies, dict)


def test_an_index_with_a_malformed_entry_is_refused(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"rwb_policies": 1, "policies": {"p": ["0.1.0"]}}))
    with pytest.raises(InputError, match="entry of 'p' is not an object"):
        read_index(tmp_path)


# --------------------------------------------------------------------------- CLI
def test_cli_register_approve_promote_rollback_history(run, tmp_path, policies, monkeypatch, capsys):
    from core.cli import main

    expert = _expert(run)
    FIGURES.update({("cli", "1.0.0"): expert + 1, ("cli", "1.1.0"): expert + 2})
    a = reseal(run.bundle, tmp_path / "cli-a.zip", name="cli", version="1.0.0", policy_return=expert + 1)
    b = reseal(run.bundle, tmp_path / "cli-b.zip", name="cli", version="1.1.0", policy_return=expert + 2)
    w = ["--workspace", str(run.root)]

    def rwb(*args: str, user: str) -> dict:
        monkeypatch.setenv("RWB_PASSWORD", PASSWORDS[user])
        code = main([*w, *args, "--as", user, "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out.strip().splitlines()[-1])

    registered = rwb("registry", "register", str(a), user="ana")
    assert registered["stage"] == "candidate" and registered["already_registered"] is False
    # every field of the version, in order, less the manifest, then already_registered
    assert list(registered) == [f.name for f in dataclasses.fields(registry.PolicyVersion)] + ["already_registered"]
    assert registered["approvals"] == []
    rwb("registry", "register", str(b), user="ana")
    approved = rwb("registry", "approve", "cli", "1.0.0", "-m", "beats the expert", user="bob")
    assert approved["stage"] == "approved" and "manifest" not in approved
    assert [(set(a), a["by"]) for a in approved["approvals"]] == [({"by", "at", "comment"}, "bob")]
    assert rwb("registry", "promote", "cli", "1.0.0", user="cy")["active"] == "1.0.0"
    rwb("registry", "approve", "cli", "1.1.0", "-m", "beats 1.0.0", user="cy")
    assert rwb("registry", "promote", "cli", "1.1.0", user="bob")["previous"] == ["1.0.0"]
    assert rwb("registry", "rollback", "cli", "-m", "latency regression", user="bob")["active"] == "1.0.0"
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ana"])
    assert main([*w, "registry", "approve", "cli", "1.1.0", "-m", "x", "--as", "ana"]) == 3  # PermissionDenied
    assert "may not approve policies" in capsys.readouterr().err
    assert main([*w, "registry", "list", "cli", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {v["version"]: v["stage"] for v in listed["versions"]} == {"1.0.0": "production", "1.1.0": "rolled_back"}
    assert listed["aliases"]["cli"]["production"] == "1.0.0"
    assert main([*w, "registry", "history", "cli", "--json"]) == 0
    logged = json.loads(capsys.readouterr().out)["events"]
    assert list(logged[0]) == ["id", "name", "version", "event", "actor", "role", "at", "comment", "detail"]
    assert [e["event"] for e in logged][-1] == "rolled_back"
    assert main([*w, "registry", "history", "cli"]) == 0
    text = capsys.readouterr().out
    assert "rolled_back" in text and "latency regression" in text and "bob (approver)" in text


# --------------------------------------------------------------------------- production import
def test_a_production_process_loads_the_promoted_policy_without_streamlit(ws, run, tmp_path, policies):
    bob = run.actor("bob")
    _registered(ws, run, tmp_path, "prodproc", "0.1.0", _expert(run) + 1.0)
    registry.approve(ws, bob, "prodproc", "0.1.0", "beats the expert")
    registry.promote(ws, bob, "prodproc", "0.1.0")
    script = textwrap.dedent("""
        import json, sys
        from core.policies import load_bundle_for
        bundle = load_bundle_for("prodproc")
        top, probs = bundle.top_k(bundle.smoke_obs(), bundle.smoke_mask(), k=3)
        print(json.dumps({"version": bundle.policy_version, "n": int(top.shape[0]),
                          "streamlit": "streamlit" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RWB_POLICIES_DIR": str(policies)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"version": "prodproc@0.1.0", "n": out["n"], "streamlit": False} and out["n"] > 0


# --------------------------------------------------------------------------- the Policies page
def _page(run, actor_name: str | None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "pages" / "policies.py"), default_timeout=120)
    if actor_name is not None:
        at.session_state["actor"] = run.actor(actor_name)
    return at


def test_policies_page_shows_buttons_by_role_and_approves(ws, run, tmp_path, policies, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(run.root))
    expert = _expert(run)
    _registered(ws, run, tmp_path, "page", "0.1.0", expert + 1.0)

    at = _page(run, "ana").run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Policies"
    labels = [b.label for b in at.button]
    assert "Approve" not in labels and "Promote" not in labels and "Roll back" not in labels
    assert any(run.run_id in str(df.value) for df in at.dataframe) or any(
        run.run_id in str(o) for s in at.selectbox for o in s.options)

    at = _page(run, "bob").run()
    assert not at.exception, at.exception
    at.selectbox(key="policies_name").set_value("page").run()
    at.selectbox(key="policies_version").set_value("0.1.0").run()
    assert "Approve" in [b.label for b in at.button]
    at.text_input(key="policies_comment").input("beats the expert on held-out episodes").run()
    next(b for b in at.button if b.label == "Approve").click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert registry.get_version(ws, "page", "0.1.0").stage == "approved"
    # where promotion writes, said before the click; a folder it cannot write disables it
    assert any(f"Promote copies the approved bundle into `{policies}`" in c.value for c in at.caption)
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    monkeypatch.setenv("RWB_POLICIES_DIR", str(a_file))
    at.run()
    promote = next(b for b in at.button if b.label == "Promote")
    assert promote.proto.disabled and "is a file, not a folder" in promote.proto.help
    assert any("Promote and roll back are not possible from here" in w.value for w in at.warning)
    monkeypatch.setenv("RWB_POLICIES_DIR", str(policies))
    at.run()
    promote = next(b for b in at.button if b.label == "Promote")
    assert not promote.proto.disabled and str(policies) in promote.proto.help
    promote.click().run()
    assert not at.error, [e.value for e in at.error]
    assert read_index(policies).policies["page"].active == "0.1.0"
    assert any(f"Promoted page 0.1.0 into {policies}" in s.value for s in at.success)


def test_policies_page_empty_workspace_says_what_to_do(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    monkeypatch.setenv("RWB_POLICIES_DIR", str(tmp_path / "policies"))
    at = AppTest.from_file(str(ROOT / "pages" / "policies.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    infos = " ".join(i.value for i in at.info)
    assert "No registered policies yet" in infos and "No training runs yet" in infos
    assert "Acting as **local** (admin)" in " ".join(c.value for c in at.caption)
