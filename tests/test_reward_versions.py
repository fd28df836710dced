"""Template versions in the workspace (core.rewards.versions): every save a new version,
stale bases refused, one winner of a race, diffs, permissions, resolution and the CLI."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest

from core import rewards
from core.cli import main
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.base.results import to_jsonable
from core.rewards.template import TemplateError
from core.rewards.versions import (SHIPPED_BY, TemplateChange, TemplateConflict, diff_templates, diff_versions,
                                   get_template, list_versions, resolve_template, save_template,
                                   sha256_text, template_names)
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor, add_user

from _versions_worker import save_on_base_zero

ALICE = Actor("alice", "analyst")
BOB = Actor("bob", "analyst")
CAROL = Actor("carol", "analyst")


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    w = Workspace.open(tmp_path / "ws")
    yield w
    w.close()


# A template of the tests' own, so that edits of the shipped files do not break them.
MINI = """\
version: 1
name: mini
description: a small pyramid for the version tests
return: {a: 0.7, b: 0.3, gamma: 0.95}
gating: {enabled: true}
levels:
  L1:
    title: base
    gate: 0.5          # failed calls earn nothing above L1
    components:
      tool_validity: {weight: 0.3}
  L2:
    title: process
    components:
      param_reasonableness: {weight: 0.4, params: {window: 1000}}
penalties:
  latency: {component: latency_penalty, weight: 1.0, params: {per: 0.05, unit_ms: 1000}}
  repeated_failures: {weight: 1.0}
episode_terms:
  outcome: {component: terminal_outcome, weight: 1.0}
expectations:
  - {name: resolved first, kind: rank_auc, higher: {resolved: true}, lower: {resolved: false}, min: 0.8}
"""


def shipped_yaml() -> str:
    return (Path(rewards.templates_dir()) / "finance_risk.yaml").read_text(encoding="utf-8")


def shipped_with(**weights: float) -> str:
    """The shipped finance template with some weights changed, as YAML."""
    return rewards.parse_template(shipped_yaml()).with_weights(weights).to_yaml()


def edited(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


# --------------------------------------------------------------------------- versions
def test_shipped_file_is_version_zero_and_each_save_is_a_new_version(ws):
    seed = get_template(ws, "finance_risk")
    assert (seed.version, seed.saved_by, seed.base_version) == (0, SHIPPED_BY, None)
    assert seed.yaml == shipped_yaml() and seed.sha256 == sha256_text(shipped_yaml())
    assert "finance_risk" in template_names(ws)

    text1 = shipped_with(tool_validity=0.5)
    v1 = save_template(ws, ALICE, "finance_risk", text1, 0, "  L1 matters more  ", meta={"auc": 0.81})
    assert (v1.version, v1.base_version, v1.saved_by, v1.message) == (1, 0, "alice", "L1 matters more")
    assert v1.saved_at.endswith("Z") and v1.sha256 == sha256_text(text1)

    # the same text saved again is still a new version: a save never overwrites
    v2 = save_template(ws, BOB, "finance_risk", text1, 1, "again")
    assert v2.version == 2 and v2.base_version == 1 and v2.sha256 == v1.sha256

    assert [v.version for v in list_versions(ws, "finance_risk")] == [0, 1, 2]
    latest = get_template(ws, "finance_risk")
    assert (latest.version, latest.saved_by) == (2, "bob")
    again = get_template(ws, "finance_risk", 1)
    assert again.yaml == text1
    assert dict(again.meta) == {"auc": 0.81}
    assert again.template().component("tool_validity").weight == 0.5
    assert again.template().source == "finance_risk@1"
    with pytest.raises(InputError, match="has no version 7; versions: 0, 1, 2"):
        get_template(ws, "finance_risk", 7)


def test_a_new_template_starts_at_version_one_and_keeps_its_text(ws):
    v1 = save_template(ws, ALICE, "mini", MINI, None, "first")
    assert (v1.version, v1.base_version) == (1, None)
    v2 = save_template(ws, BOB, "mini", edited(MINI, "window: 1000", "window: 500"), 1, "")
    assert get_template(ws, "mini", 1).yaml == MINI          # verbatim, comments included
    assert "# failed calls earn nothing above L1" in get_template(ws, "mini").yaml
    assert [v.version for v in list_versions(ws, "mini")] == [1, 2] and v2.base_version == 1
    assert "mini" in template_names(ws)


def test_a_template_object_is_saved_under_the_given_name(ws):
    t = get_template(ws, "finance_risk").template().with_weights({"latency": 0.5})
    v = save_template(ws, ALICE, "finance_risk_fast", t, None, "a copy that cares less about latency")
    assert (v.version, v.base_version) == (1, None)
    loaded = get_template(ws, "finance_risk_fast").template()
    assert loaded.name == "finance_risk_fast" and loaded.component("latency").weight == 0.5
    assert loaded.with_weights({"latency": 1.0}).to_dict()["levels"] == t.to_dict()["levels"]
    assert [x.version for x in list_versions(ws, "finance_risk_fast")] == [1]
    with pytest.raises(InputError, match="no shipped version 0"):
        get_template(ws, "finance_risk_fast", 0)
    with pytest.raises(TemplateConflict, match="you started a new template"):
        save_template(ws, BOB, "finance_risk_fast", t, None, "")


def test_stale_base_is_refused_naming_who_saved_what(ws):
    text = shipped_yaml()
    save_template(ws, ALICE, "finance_risk", shipped_with(tool_validity=0.5), 0, "more L1")
    with pytest.raises(TemplateConflict) as info:
        save_template(ws, BOB, "finance_risk", shipped_with(latency=0.5), 0, "bob's edit")
    msg = str(info.value)
    assert isinstance(info.value, ConflictError) and info.value.exit_code == 4
    assert msg.startswith("template 'finance_risk' is at version 1 (saved by alice at ")
    assert msg.endswith("); you edited version 0 — reload and re-apply your change")
    assert [v.version for v in list_versions(ws, "finance_risk")] == [0, 1]   # nothing written

    save_template(ws, CAROL, "finance_risk", shipped_with(latency=0.7), 1, "carol")
    with pytest.raises(TemplateConflict) as info:
        save_template(ws, BOB, "finance_risk", text, 0, "bob again")
    msg = str(info.value)
    assert "is at version 2 (saved by carol at " in msg and "; version 1 by alice at " in msg
    assert [v.saved_by for v in info.value.saved_since] == ["alice", "carol"]
    assert info.value.latest.version == 2 and info.value.base_version == 0

    with pytest.raises(InputError, match="has no version 5 to edit"):
        save_template(ws, BOB, "finance_risk", text, 5, "")


def test_saves_are_validated_first(ws):
    bad = edited(MINI, "tool_validity: {weight", "tool_valdity: {weight")
    with pytest.raises(TemplateError) as info:
        save_template(ws, ALICE, "mini", bad, None, "typo")
    assert "unknown component 'tool_valdity' at line 11" in str(info.value)
    assert info.value.line == 11
    with pytest.raises(TemplateError, match="weight of 'latency' at line 17 is negative"):
        save_template(ws, ALICE, "mini", edited(MINI, "weight: 1.0, params: {per", "weight: -1.0, params: {per"),
                      None, "")
    with pytest.raises(TemplateError, match=r"names the template 'mini' at line 2 but it is "
                                            r"saved as 'other'"):
        save_template(ws, ALICE, "other", MINI, None, "")
    with pytest.raises(InputError, match="not usable"):
        save_template(ws, ALICE, "bad/name", MINI, 0, "")
    with pytest.raises(InputError, match="empty"):
        save_template(ws, ALICE, "mini", "  \n", 0, "")
    with pytest.raises(InputError, match="no template named 'mini'"):
        list_versions(ws, "mini")


def test_versions_are_append_only_in_the_database(ws):
    save_template(ws, ALICE, "finance_risk", shipped_yaml(), 0, "")
    for sql in ("UPDATE template_versions SET message='x'", "DELETE FROM template_versions",
                "INSERT OR REPLACE INTO template_versions(name, version, yaml, sha256, saved_by, "
                "saved_at) VALUES ('finance_risk', 1, 'x', 'x', 'eve', 'now')"):
        with pytest.raises(sqlite3.DatabaseError, match="template version"):
            with ws.transaction() as conn:
                conn.execute(sql)
    assert get_template(ws, "finance_risk").saved_by == "alice"


def test_a_save_joins_the_callers_transaction(ws):
    """Callers that record more about a save (rwb tune apply) can make it all-or-nothing."""
    with pytest.raises(RuntimeError):
        with ws.transaction():
            assert save_template(ws, ALICE, "mini", MINI, None, "").version == 1
            raise RuntimeError("the caller's own write failed")
    assert "mini" not in template_names(ws)
    with ws.transaction():
        save_template(ws, ALICE, "mini", MINI, None, "")
    assert get_template(ws, "mini").version == 1


# --------------------------------------------------------------------------- races
def test_threads_racing_on_one_base_make_exactly_one_winner(ws):
    n = 8
    barrier = threading.Barrier(n)
    outcomes: list[object] = [None] * n

    def attempt(i: int) -> None:
        text = shipped_with(latency=0.1 * i)
        barrier.wait()
        try:
            outcomes[i] = save_template(ws, Actor(f"analyst{i}", "analyst"), "finance_risk", text, 0, f"#{i}")
        except ConflictError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    winners = [o for o in outcomes if not isinstance(o, Exception)]
    losers = [o for o in outcomes if isinstance(o, TemplateConflict)]
    assert len(winners) == 1 and len(losers) == n - 1, outcomes
    assert winners[0].version == 1
    assert all("you edited version 0" in str(e) for e in losers)
    assert all(f"saved by {winners[0].saved_by} at" in str(e) for e in losers)
    assert [v.version for v in list_versions(ws, "finance_risk")] == [0, 1]
    assert get_template(ws, "finance_risk").sha256 == winners[0].sha256


def test_processes_racing_on_one_base_make_exactly_one_winner(ws):
    ctx = multiprocessing.get_context("spawn")
    n = 3
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=save_on_base_zero, args=(str(ws.root), i, barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(o[1] for o in outcomes) == ["conflict"] * (n - 1) + ["won"]
    assert [o[2] for o in outcomes if o[1] == "won"] == [1]
    assert [v.version for v in list_versions(ws, "finance_risk")] == [0, 1]


# --------------------------------------------------------------------------- diffs
def test_diff_versions_gives_the_yaml_diff_and_the_structured_changes(ws):
    save_template(ws, ALICE, "mini", MINI, None, "")
    text = edited(MINI, "tool_validity: {weight: 0.3}", "tool_validity: {weight: 0.5}")
    text = edited(text, "window: 1000", "window: 500")
    text = edited(text, "gating: {enabled: true}", "gating: {enabled: false}")
    text = edited(text, "gate: 0.5 ", "gate: 0.6 ")
    save_template(ws, BOB, "mini", text, 1, "")
    d = diff_versions(ws, "mini", 1, 2)
    assert sorted((c.section, c.key, c.a, c.b) for c in d.changes) == sorted([
        ("weight", "tool_validity", 0.3, 0.5),
        ("param", "param_reasonableness.window", 1000, 500),
        ("gating", "enabled", True, False),
        ("gate", "L1", 0.5, 0.6),
    ])
    assert d.unified.startswith("--- mini@1\n+++ mini@2\n")
    assert "-gating: {enabled: true}\n+gating: {enabled: false}\n" in d.unified
    assert "+      param_reasonableness: {weight: 0.4, params: {window: 500}}\n" in d.unified
    same = diff_versions(ws, "mini", 2, 2)
    assert same.changes == [] and same.unified == ""
    assert json.loads(json.dumps(d.to_dict()))["changes"] == to_jsonable(d.changes)
    # the shipped seed diffs like any version
    save_template(ws, ALICE, "finance_risk", shipped_with(tool_validity=0.45), 0, "")
    assert diff_versions(ws, "finance_risk", 0, 1).changes == [
        TemplateChange(section="weight", key="tool_validity", a=rewards.load_template("finance_risk")
                       .component("tool_validity").weight, b=0.45)]


def test_structured_diff_sees_components_expectations_and_return():
    old = rewards.parse_template(MINI)
    text = edited(MINI, "  repeated_failures: {weight: 1.0}\n", "")
    text = edited(text, "return: {a: 0.7, b: 0.3, gamma: 0.95}", "return: {a: 0.6, b: 0.4, gamma: 0.95}")
    text = edited(text, "min: 0.8}", "min: 0.75}")
    text = edited(text, "latency: {component: latency_penalty", "latency: {component: step_cost")
    text = edited(text, "params: {per: 0.05, unit_ms: 1000}", "params: {per: 0.05}")
    new = rewards.parse_template(text)
    changes = {(c.section, c.key): (c.a, c.b) for c in diff_templates(old, new)}
    assert changes.pop(("component", "repeated_failures")) == ("penalty repeated_failures", None)
    assert changes.pop(("component", "latency")) == ("penalty latency_penalty", "penalty step_cost")
    assert changes.pop(("param", "latency")) == ({"per": 0.05, "unit_ms": 1000}, {"per": 0.05})
    assert changes.pop(("return", "a")) == (0.7, 0.6) and changes.pop(("return", "b")) == (0.3, 0.4)
    before, after = changes.pop(("expectation", "resolved first"))
    assert before["min"] == 0.8 and after["min"] == 0.75
    assert changes == {}


# --------------------------------------------------------------------------- permissions
def test_a_reviewer_may_not_save_templates(ws):
    add_user(ws, LOCAL_ADMIN, "ada", "admin", email="ada@example.com")
    add_user(ws, Actor("ada", "admin"), "rita", "reviewer", email="rita@example.com")
    add_user(ws, Actor("ada", "admin"), "ann", "analyst", email="ann@example.com")
    with pytest.raises(PermissionDenied, match="rita \\(reviewer\\) may not edit reward templates"):
        save_template(ws, Actor("rita", "reviewer"), "mini", MINI, None, "")
    # a reviewer claiming to be an analyst is checked against the users table
    with pytest.raises(PermissionDenied):
        save_template(ws, Actor("rita", "analyst"), "mini", MINI, None, "")
    with pytest.raises(PermissionDenied, match="local admin is retired"):
        save_template(ws, LOCAL_ADMIN, "mini", MINI, None, "")
    assert "mini" not in template_names(ws)
    assert save_template(ws, Actor("ann", "analyst"), "mini", MINI, None, "").saved_by == "ann"


# --------------------------------------------------------------------------- resolution
def test_template_references_resolve_workspace_versions(ws):
    shipped = rewards.load_template("finance_risk")
    assert rewards.as_template("finance_risk", ws) == shipped          # no saved version yet
    save_template(ws, ALICE, "finance_risk", shipped.with_weights({"tool_validity": 0.9}), 0, "")
    save_template(ws, ALICE, "finance_risk", shipped.with_weights({"tool_validity": 0.7}), 1, "")
    assert rewards.as_template("finance_risk", ws).component("tool_validity").weight == 0.7
    assert rewards.as_template("finance_risk@1", ws).component("tool_validity").weight == 0.9
    assert rewards.as_template("finance_risk@0", ws) == shipped
    assert rewards.as_template("finance_risk@latest", ws).source == "finance_risk@2"
    assert rewards.as_template("finance_risk") == shipped              # no workspace: shipped
    assert rewards.validate("finance_risk@1", ws).levels[0].components == {"tool_validity": 0.9}
    path = Path(rewards.templates_dir()) / "tool_agent.yaml"
    assert resolve_template(ws, str(path)).name == "tool_agent"          # a file is a file
    with pytest.raises(InputError, match="after '@' comes a version number"):
        resolve_template(ws, "finance_risk@x")
    with pytest.raises(InputError, match="open a workspace"):
        resolve_template(None, "finance_risk@1")
    with pytest.raises(InputError, match="no template named 'nope'"):
        resolve_template(ws, "nope")


# --------------------------------------------------------------------------- CLI
def _json(capsys, argv: list[str], code: int = 0) -> dict:
    capsys.readouterr()
    assert main(argv) == code
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_cli_save_versions_diff_show(tmp_path, capsys):
    root = tmp_path / "cli-ws"
    w = ["--workspace", str(root), "reward"]
    text = rewards.parse_template(shipped_yaml()).with_return(gamma=0.9).to_yaml()
    edited_file = tmp_path / "finance_risk.yaml"
    edited_file.write_text(text, encoding="utf-8")

    saved = _json(capsys, [*w, "save", "finance_risk", str(edited_file), "--base", "0", "-m", "shorter horizon",
                           "--json"])
    assert (saved["label"], saved["base_version"], saved["saved_by"]) == ("finance_risk@1", 0, "local")

    capsys.readouterr()
    assert main([*w, "save", "finance_risk", str(edited_file), "--base", "0"]) == 4
    err = capsys.readouterr().err
    assert "template 'finance_risk' is at version 1 (saved by local at" in err
    assert "you edited version 0 — reload and re-apply your change" in err

    listed = _json(capsys, [*w, "versions", "finance_risk", "--json"])
    assert listed["latest"] == 1
    assert [(v["version"], v["message"]) for v in listed["versions"]] == [
        (0, "shipped with Reward Workbench (finance_risk.yaml)"), (1, "shorter horizon")]

    diff = _json(capsys, [*w, "diff", "finance_risk", "0", "1", "--json"])
    assert diff["changes"] == [{"section": "return", "key": "gamma",
                                "a": rewards.load_template("finance_risk").gamma, "b": 0.9}]
    assert list(diff["changes"][0]) == ["section", "key", "a", "b"]

    capsys.readouterr()
    assert main([*w, "show", "finance_risk@1"]) == 0
    assert capsys.readouterr().out == text
    assert main([*w, "diff", "finance_risk", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "return       gamma" in out and "+  gamma: 0.9\n" in out

    # the engine's commands resolve workspace versions too
    info = _json(capsys, [*w, "validate", "finance_risk@1", "--json"])
    assert info["return"]["gamma"] == 0.9
    bad = tmp_path / "bad.yaml"
    bad.write_text(edited(MINI, "tool_validity: {weight", "tool_valdity: {weight"), encoding="utf-8")
    capsys.readouterr()
    assert main([*w, "save", "mini", str(bad), "--base", "0"]) == 2
    assert "unknown component 'tool_valdity' at line 11" in capsys.readouterr().err
