"""The governance history (core.govern.history), refused registry actions recorded, where a
promotion writes (core.govern.policy_folder.promotion_target) and ``rwb audit history``.

One workspace (a copy of the suite's tiny trained run) receives real decisions made with
the core functions — a template save, a label, a review decision, registrations,
approvals, promotions, a rollback — and refusals: an analyst approving, the four-eyes
rule, a failing gate, a promotion into a folder that cannot be written.  The tests read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _bundle_fixtures import module_hash_embedder, registry_figures, reseal, trained_copy  # noqa: F401
from core.access.audit import security_events
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.govern import registry
from core.govern.bundle import load_bundle
from core.govern.history import KINDS, governance_history, governance_people
from core.govern.policy_folder import promotion_target


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The workspace after the decisions (see the module docstring); yields (run, policies folder)."""
    from core.guard.review import ReviewRequest, claim, decide, enqueue
    from core.rewards.labels import add_label
    from core.rewards.versions import get_template, save_template

    run = trained_copy(tmp_path_factory)
    policies = tmp_path_factory.mktemp("hist-policies") / "policies"
    scratch = tmp_path_factory.mktemp("hist-bundles")
    ana, bob, ada, rae = (run.actor(n) for n in ("ana", "bob", "ada", "rae"))
    ws = run.workspace()
    expert = load_bundle(run.bundle).manifest.evaluation["expert_return"]
    with pytest.MonkeyPatch.context() as mp:
        registry_figures(mp, {("hist", "0.1.0"): expert + 1, ("hist", "0.2.0"): expert + 2,
                              ("hist", "0.3.0"): expert + 0.5, ("hist", "0.4.0"): expert + 3})
        template = get_template(ws, "finance_risk")
        save_template(ws, ana, "finance_risk", template.yaml, template.version, "tighter loss cap")
        episode = ws.conn.execute("SELECT episode_id FROM episodes WHERE dataset='finance' LIMIT 1").fetchone()[0]
        add_label(ws, ana, "finance", episode, 0, note="the customer complained")
        item = enqueue(ws, ana, ReviewRequest(origin="training", reason="history test", dataset="finance",
                                              task_type="trade", state={"volatility": 0.2}, token_id=1))
        claim(ws, rae, item)
        decide(ws, rae, item, "reject", "never sell on a margin call")
        for version in ("0.1.0", "0.2.0", "0.3.0"):
            registry.register(ws, ana, reseal(run.bundle, scratch / f"hist-{version}.zip", name="hist",
                                              version=version))
        registry.register(ws, ada, reseal(run.bundle, scratch / "hist-0.4.0.zip", name="hist", version="0.4.0"))
        with pytest.raises(PermissionDenied):
            registry.approve(ws, ana, "hist", "0.1.0", "I trained it, it is good")
        registry.approve(ws, bob, "hist", "0.1.0", "beats the expert")
        registry.approve(ws, bob, "hist", "0.2.0", "beats the expert by more")
        registry.promote(ws, bob, "hist", "0.1.0", "first release", root=policies)
        registry.promote(ws, bob, "hist", "0.2.0", root=policies)
        registry.rollback(ws, bob, "hist", "latency regression", root=policies)
        with pytest.raises(registry.GateFailed):
            registry.approve(ws, bob, "hist", "0.3.0", "looks fine")              # below production 0.1.0
        with pytest.raises(PermissionDenied, match="four-eyes"):
            registry.approve(ws, ada, "hist", "0.4.0", "my own bundle")          # ada registered it
        registry.approve(ws, bob, "hist", "0.4.0", "beats production")
        not_a_folder = scratch / "a-file"
        not_a_folder.write_text("not a folder")
        with pytest.raises(ConflictError, match="is a file, not a folder"):
            registry.promote(ws, bob, "hist", "0.4.0", root=not_a_folder / "policies")
    ws.close()
    yield run, policies


@pytest.fixture
def ws(made):
    w = made[0].workspace()
    yield w
    w.close()


def test_every_kind_is_listed_from_the_real_writes(ws):
    events = governance_history(ws)
    kinds = {e.kind for e in events if e.outcome == "accepted"}
    assert kinds >= {"template_save", "label", "review", "registration", "approval", "promotion", "rollback"}
    assert all(e.kind in KINDS for e in events)
    assert [e.when for e in events] == sorted((e.when for e in events), reverse=True)   # newest first
    by_kind = {k: [e for e in events if e.kind == k and e.outcome == "accepted"] for k in KINDS}
    save = by_kind["template_save"][0]
    assert (save.who, save.subject, save.reason) == ("ana", "finance_risk v1", "tighter loss cap")
    label = by_kind["label"][0]
    assert (label.who, label.decision, label.reason) == ("ana", "failure", "the customer complained")
    review = by_kind["review"][0]
    assert review.who == "rae" and review.decision.startswith("rejected") and review.reason == \
        "never sell on a margin call"
    assert {e.subject for e in by_kind["registration"]} == {"hist 0.1.0", "hist 0.2.0", "hist 0.3.0", "hist 0.4.0"}
    assert [(e.who, e.role, e.subject) for e in by_kind["approval"]][-1] == ("bob", "approver", "hist 0.1.0")
    assert "beats" in by_kind["approval"][-1].details["promotion gate"]
    promotions = by_kind["promotion"]
    assert [e.subject for e in promotions] == ["hist 0.2.0", "hist 0.1.0"]
    assert promotions[0].decision == "promoted to production (replacing 0.1.0)"
    assert by_kind["rollback"][0].decision == "rolled back to 0.1.0 from 0.2.0"
    assert by_kind["rollback"][0].reason == "latency regression"


def test_refused_approvals_and_promotions_are_listed_with_their_reason(ws):
    refused = governance_history(ws, outcome="refused")
    approvals = {e.who: e for e in refused if e.kind == "approval"}
    assert "may not approve policies" in approvals["ana"].reason and approvals["ana"].role == "analyst"
    assert approvals["ana"].details["comment"] == "I trained it, it is good"
    assert "four-eyes" in approvals["ada"].reason
    assert "does not beat production hist@0.1.0" in approvals["bob"].reason
    assert all(e.subject.startswith("hist 0.") and e.decision == "approval refused" for e in approvals.values())
    [promotion] = [e for e in refused if e.kind == "promotion"]
    assert promotion.who == "bob" and "is a file, not a folder" in promotion.reason
    # kept where the registry's refusals go, though each call raised
    assert {e.actor for e in security_events(ws, "approve_refused")} >= {"ana", "ada", "bob"}


def test_a_refused_promotion_records_nothing_in_the_registry(ws):
    assert registry.aliases(ws, "hist")["production"] == "0.1.0"
    assert [v.stage for v in registry.list_versions(ws, "hist") if v.version == "0.4.0"] == ["approved"]


def test_filters(ws):
    assert {e.kind for e in governance_history(ws, kinds=["approval", "rollback"])} == {"approval", "rollback"}
    assert {e.who for e in governance_history(ws, who="BOB")} == {"bob"}                # any case
    assert {e.outcome for e in governance_history(ws, outcome="accepted")} == {"accepted"}
    assert {e.subject for e in governance_history(ws, subject="0.4.0")} == {"hist 0.4.0"}
    assert len(governance_history(ws, limit=3)) == 3
    newest = governance_history(ws, limit=1)[0].when
    assert governance_history(ws, since="2999-01-01") == []
    assert governance_history(ws, until="2000-01-01T00:00:00Z") == []
    assert governance_history(ws, since=newest)[0].when == newest                         # since is inclusive
    assert all(e.when < newest for e in governance_history(ws, until=newest))
    assert {"ana", "bob", "ada", "rae"} <= set(governance_people(ws))


@pytest.mark.parametrize("bad, field", [({"kinds": ["approvals"]}, "kind"), ({"outcome": "maybe"}, "outcome"),
                                        ({"since": "yesterday"}, "since"), ({"limit": 0}, "limit")])
def test_bad_filters_name_their_field(ws, bad, field):
    with pytest.raises(InputError) as exc:
        governance_history(ws, **bad)
    assert exc.value.field == field


# --------------------------------------------------------------------------- the promotion target
def test_promotion_target_says_where_and_whether(tmp_path, monkeypatch):
    missing = tmp_path / "not" / "yet"
    found = promotion_target(missing)
    assert (found.path, found.writable, found.reason) == (str(missing), True, None)
    assert not (tmp_path / "not").exists()                                           # asking makes nothing
    monkeypatch.setenv("RWB_POLICIES_DIR", str(tmp_path))
    assert promotion_target().path == str(tmp_path)                                   # the same folder promote uses
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert promotion_target(a_file).reason == f"{a_file} is a file, not a folder"
    assert not promotion_target(a_file / "policies").writable
    assert list(tmp_path.iterdir()) == [a_file]                                        # the check leaves nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_not_a_target(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        found = promotion_target(folder / "policies")
        assert not found.writable and found.reason == f"{folder} is read-only for this user"
    finally:
        folder.chmod(0o755)


def test_a_folder_root_cannot_write_is_not_a_target():
    """As root ``os.access`` says yes to everything: the temp file it tries says no (sysfs)."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys here")
    found = promotion_target("/sys/kernel")
    if found.writable:
        pytest.skip("/sys/kernel is writable here")
    assert "cannot be written" in found.reason or "read-only" in found.reason


# --------------------------------------------------------------------------- the CLI
def test_cli_history_and_a_refused_promotion(made, tmp_path, capsys, monkeypatch):
    from core.cli import main
    from _bundle_fixtures import PASSWORDS

    run, _ = made
    w = ["--workspace", str(run.root)]
    assert main([*w, "audit", "history", "--refused", "--kind", "approval", "--json"]) == 0
    events = json.loads(capsys.readouterr().out)["events"]
    assert {e["who"] for e in events} == {"ana", "ada", "bob"} and {e["outcome"] for e in events} == {"refused"}
    assert main([*w, "audit", "history", "--actor", "rae"]) == 0
    out = capsys.readouterr().out
    assert "review" in out and "never sell on a margin call" in out and "rae" in out
    assert main([*w, "audit", "history", "--kind", "approvals"]) == 2
    assert "no kind of decision named approvals" in capsys.readouterr().err

    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main([*w, "registry", "target", "--root", str(a_file)]) == 4
    captured = capsys.readouterr()
    assert f"into {a_file}" in captured.out and "is a file, not a folder" in captured.err
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["bob"])
    assert main([*w, "registry", "promote", "hist", "0.4.0", "--root", str(a_file), "--as", "bob"]) == 4
    err = capsys.readouterr().err
    assert "cannot be written" in err and "Traceback" not in err
