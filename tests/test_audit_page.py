"""The Audit page (AppTest): the decisions made in the workbench (refused ones too), filtered;
the served decisions: summary, browse and filter records, read one, export records or
served episodes; export only for the roles that may."""

from __future__ import annotations

import json
from datetime import date, timedelta
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.access import audit
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor, add_user

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "audit.py")


def _record(i: int, version: str) -> tuple[dict, dict]:
    request = {"episode_id": f"sess-{i % 3}", "query": f"reduce my position {i}", "task_type": "urgent_reduce",
               "state": {"hour": 10, "volatility": 0.2 + i / 100}}
    record = {"timestamp": f"2025-03-01T09:{i:02d}:00Z", "rde_action": 3,
              "rl_candidates": [{"id": 7, "prob": 0.6, "reward_est": 0.42}] if i % 2 else [],
              "final_action": 7 if i % 2 else 3,
              "reward_components": [{"name": "state_value", "value": 0.3}] if i % 2 else [],
              "policy_version": version, "episode_id": request["episode_id"]}
    return record, request


@pytest.fixture
def audit_ws(tmp_path, monkeypatch):
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    for i in range(8):
        record, request = _record(i, "finance_risk@0.1.0" if i < 5 else "finance_risk@0.2.0")
        audit.write_record(ws, Actor.service(), record, request=request,
                           action={"kind": "tool_call", "tool": "place_order", "params": {"side": "sell"}})
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    yield ws
    ws.close()


def test_browse_filter_and_export(audit_ws):
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Audit"
    assert {m.label: m.value for m in at.metric}["Records"] == "8"
    table = at.dataframe[0].value
    assert len(table) == 8 and "sess-1" in set(table["episode"])
    assert "decision_id" in str(at.json[0].value)                 # the picked record in full

    at.selectbox(key="audit_version").set_value("finance_risk@0.2.0")
    at.text_input(key="audit_episode").set_value("sess-1")
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert set(table["policy"]) == {"finance_risk@0.2.0"} and set(table["episode"]) == {"sess-1"}
    assert len(table) == 1

    at.checkbox(key="audit_as_episodes").check()
    next(b for b in at.button if b.label == "Export with these filters").click()
    at.run()
    assert not at.exception, at.exception
    assert "1 episodes (1 decisions)" in at.success[0].value
    exported = at.session_state["audit_exported"]
    line = json.loads(Path(exported["path"]).read_text().splitlines()[0])
    assert line["episode_id"] == "sess-1" and line["steps"][0]["action"]["tool"] == "place_order"


def test_bad_filters_are_errors_not_tracebacks(audit_ws):
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    at.text_input(key="audit_since").set_value("yesterday")
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception, at.exception
    assert "ISO-8601" in at.error[0].value


def test_export_only_for_roles_that_may(audit_ws):
    add_user(audit_ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    add_user(audit_ws, Actor("ada", "admin"), "rae", "reviewer", password="rae-password")
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.session_state["actor"] = Actor("rae", "reviewer")
    at.run()
    assert not at.exception, at.exception
    assert "Export with these filters" not in [b.label for b in at.button]
    assert len(at.dataframe[0].value) == 8                           # reading needs no permission


def test_empty_trail_says_how_to_fill_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    assert any("**Policies** page" in i.value for i in at.info)  # the app's way first
    assert any(c.proto.help.startswith("From the command line: `rwb serve decide") for c in at.caption)


def test_page_is_in_the_app_menu(audit_ws):
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    at.switch_page("../pages/audit.py").run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["Audit"]


# --------------------------------------------------------------------------- decisions made in the workbench
@pytest.fixture
def governed_ws(tmp_path, monkeypatch):
    """A workspace where the local admin saved a template and an analyst's approval and a
    promotion into a file were refused (each with core functions)."""
    from core.base.errors import ConflictError, PermissionDenied
    from core.govern import registry
    from core.rewards.versions import get_template, save_template

    path = tmp_path / "gov"
    ws = Workspace.open(path)
    seed = get_template(ws, "finance_risk")
    save_template(ws, LOCAL_ADMIN, "finance_risk", seed.yaml, seed.version, "tighter loss cap")
    with pytest.raises(PermissionDenied):
        registry.approve(ws, Actor("ana", "analyst"), "svc", "0.2.0", "it beats the expert")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConflictError):
        registry.promote(ws, LOCAL_ADMIN, "svc", "0.2.0", root=tmp_path / "a-file")
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    yield ws
    ws.close()


def _history(at: AppTest):
    return next(df.value for df in at.dataframe if "Outcome" in df.value.columns)


def test_decisions_made_in_the_workbench_with_refusals_and_filters(governed_ws):
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    table = _history(at)
    assert list(table["What"]) == ["Promotion", "Approval", "Reward template saved"]     # newest first
    assert list(table["Outcome"]) == ["refused", "refused", "accepted"]
    refused = table.set_index("What").loc["Approval"]
    assert (refused["Who"], refused["About"]) == ("ana", "svc 0.2.0")
    assert "may not approve policies" in refused["Why"]
    assert {m.label: m.value for m in at.metric}["Refused"] == "2"
    assert any("No served decisions recorded yet" in i.value for i in at.info)

    at.selectbox(key="audit_history_outcome").set_value("refused only")
    at.multiselect(key="audit_history_kinds").set_value(["approval"])
    next(b for b in at.button if b.label == "Show").click()
    at.run()
    assert not at.exception, at.exception
    assert list(_history(at)["Who"]) == ["ana"]

    at.multiselect(key="audit_history_kinds").set_value([])
    at.selectbox(key="audit_history_outcome").set_value("accepted or refused")
    at.selectbox(key="audit_history_who").set_value("local")
    at.date_input(key="audit_history_from").set_value(date.today() - timedelta(days=1))
    next(b for b in at.button if b.label == "Show").click()
    at.run()
    assert not at.exception, at.exception
    assert list(_history(at)["What"]) == ["Promotion", "Reward template saved"]

    at.date_input(key="audit_history_from").set_value(date.today() + timedelta(days=2))
    next(b for b in at.button if b.label == "Show").click()
    at.run()
    assert not at.exception, at.exception
    assert not any("Outcome" in df.value.columns for df in at.dataframe)
    assert any("No decision matches these filters" in i.value for i in at.info)
