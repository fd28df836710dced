"""Defaults that follow the user (core.access.choices): per-user last choices, the newest
dataset as fallback, templates matched to the dataset's domain, and a dataset too small for
the page never the default; the app's pickers (rwb_app.choices) through AppTest."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.access.choices import (
    last_choice,
    pick_dataset,
    pick_template,
    remember_choice,
    template_matches_domain,
)
from core.access.users import LOCAL_ADMIN, Actor, add_user
from core.base.errors import InputError
from core.data.importers.api import import_file
from core.records.episodes import Action, Episode, Outcome, Step, Task
from core.rewards.versions import get_template, save_template

ANA = Actor(name="ana", role="analyst")
BOB = Actor(name="bob", role="analyst")
TEMPLATES = ["ecommerce_returns@0", "finance_risk@2", "finance_risk@1", "finance_risk@0", "tool_agent@0"]


def _episodes(n: int, domain: str, prefix: str) -> list[Episode]:
    return [Episode(
        episode_id=f"{prefix}-{i}", domain=domain, behaviour="expert",
        task=Task(query=f"task {i}", task_type="analysis"),
        steps=[Step(t=0, action=Action(kind="tool_call", tool="get_quote", params={"symbol": "600519"}),
                    tool_result={"price": 1700.0 + i}),
               Step(t=1, action=Action(kind="final_answer"), output_text="hold")],
        outcome=Outcome(resolved=i % 2 == 0)) for i in range(n)]


def _import(ws, tmp_path: Path, name: str, n: int, domain: str, created_at: str) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(ep.to_json() for ep in _episodes(n, domain, name)) + "\n", encoding="utf-8")
    import_file(ws, path, format="rwb", dataset=name, actor=LOCAL_ADMIN)
    with ws.transaction() as conn:  # created_at has whole seconds: set an order without waiting
        conn.execute("UPDATE datasets SET created_at=? WHERE name=?", (created_at, name))


@pytest.fixture
def data_ws(ws, tmp_path):
    """finance (3 episodes), then ecommerce (3), then tiny (1 episode, domain "generic"): newest last."""
    _import(ws, tmp_path, "finance", 3, "finance", "2025-01-01T10:00:00Z")
    _import(ws, tmp_path, "shop", 3, "ecommerce", "2025-01-02T10:00:00Z")
    _import(ws, tmp_path, "tiny", 1, "generic", "2025-01-03T10:00:00Z")
    return ws


def test_remember_and_read_back_per_user(ws):
    assert last_choice(ws, ANA, "dataset") is None  # nobody chose anything: no table yet
    assert remember_choice(ws, ANA, "dataset", "finance", page="training")
    assert remember_choice(ws, BOB, "dataset", "shop")
    assert last_choice(ws, ANA, "dataset") == "finance"
    assert last_choice(ws, "Ana", "dataset") == "finance"  # a user name as given, case-folded
    assert last_choice(ws, BOB, "dataset") == "shop"
    remember_choice(ws, ANA, "dataset", "shop")
    assert last_choice(ws, ANA, "dataset") == "shop"
    remember_choice(ws, ANA, "template", "finance_risk@1", scope="finance")
    assert last_choice(ws, ANA, "template", scope="finance") == "finance_risk@1"
    assert last_choice(ws, ANA, "template", scope="ecommerce") is None
    assert last_choice(ws, ANA, "template") is None


def test_without_users_the_local_admin_chooses_and_a_visitor_keeps_nothing(ws):
    assert remember_choice(ws, None, "dataset", "finance")  # no users: the local admin
    assert last_choice(ws, LOCAL_ADMIN, "dataset") == "finance"
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1")
    assert remember_choice(ws, None, "dataset", "shop") is False  # nobody signed in
    assert last_choice(ws, None, "dataset") is None


def test_bad_choices_are_refused(ws):
    with pytest.raises(InputError, match="kind"):
        remember_choice(ws, ANA, "colour", "red")
    with pytest.raises(InputError):
        remember_choice(ws, ANA, "dataset", "  ")
    with pytest.raises(InputError):
        last_choice(ws, ANA, "colour")


def test_dataset_default_is_the_users_last_else_the_newest_usable(data_ws):
    options = ["finance", "shop", "tiny"]  # alphabetical, as pages list them
    pick = pick_dataset(data_ws, ANA, options, min_episodes=2)
    assert pick.default == "shop" and pick.reason == "the newest dataset"  # tiny is newer but too small
    assert pick.too_small == ("tiny",) and pick.episodes == {"finance": 3, "shop": 3, "tiny": 1}
    assert pick_dataset(data_ws, ANA, options).default == "tiny"  # a page content with one episode
    remember_choice(data_ws, ANA, "dataset", "finance")
    pick = pick_dataset(data_ws, ANA, options, min_episodes=2)
    assert pick.default == "finance" and pick.reason == "the dataset you used last"
    assert pick_dataset(data_ws, BOB, options, min_episodes=2).default == "shop"  # bob's own default
    remember_choice(data_ws, BOB, "dataset", "tiny")
    assert pick_dataset(data_ws, BOB, options, min_episodes=2).default == "shop"  # last used, but too small
    assert pick_dataset(data_ws, ANA, ["tiny"], min_episodes=2).default == "tiny"  # the only one
    assert pick_dataset(data_ws, ANA, []).default is None


def test_template_matches_the_dataset_domain():
    assert template_matches_domain("finance_risk", "finance")
    assert template_matches_domain("finance", "finance")
    assert not template_matches_domain("financial", "finance")
    assert not template_matches_domain("ecommerce_returns", "finance")
    assert not template_matches_domain("tool_agent", None)


def test_template_default_follows_the_domain_and_the_user(data_ws):
    assert pick_template(data_ws, ANA, TEMPLATES, dataset="finance").default == "finance_risk@2"
    assert pick_template(data_ws, ANA, TEMPLATES, dataset="shop").default == "ecommerce_returns@0"
    generic = pick_template(data_ws, ANA, TEMPLATES, dataset="tiny")
    assert generic.default == "tool_agent@0" and generic.domain == "generic"
    remember_choice(data_ws, ANA, "template", "finance_risk@1", scope="finance")
    assert pick_template(data_ws, ANA, TEMPLATES, dataset="finance").default == "finance_risk@1"
    assert pick_template(data_ws, BOB, TEMPLATES, dataset="finance").default == "finance_risk@2"
    assert pick_template(data_ws, ANA, TEMPLATES, dataset="shop").default == "ecommerce_returns@0"
    assert pick_template(data_ws, ANA, ["ecommerce_returns@0"], dataset="finance").default == "ecommerce_returns@0"


def test_template_default_is_the_newest_saved_of_the_domain(data_ws):
    base = get_template(data_ws, "finance_risk")
    save_template(data_ws, LOCAL_ADMIN, "finance_risk", base.yaml, 0, "first")
    time.sleep(1.05)
    save_template(data_ws, LOCAL_ADMIN, "finance_custom", base.yaml.replace("name: finance_risk",
                                                                            "name: finance_custom"), None, "mine")
    options = ["finance_custom@1", "finance_risk@1", "finance_risk@0", "tool_agent@0"]
    pick = pick_template(data_ws, ANA, options, dataset="finance")
    assert pick.default == "finance_custom@1" and "finance" in pick.reason


# --------------------------------------------------------------------------- the app's pickers
PICKER_SCRIPT = '''
import streamlit as st
from rwb_app.choices import dataset_select, template_select

dataset = dataset_select("Dataset", ["finance", "shop", "tiny"], key="t_dataset", page="test", min_episodes=2)
template = template_select("Template", {templates!r}, key="t_template", dataset=dataset)
st.write(f"picked {{dataset}} / {{template}}")
'''


@pytest.fixture
def picker_app(data_ws, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(data_ws.root))
    return AppTest.from_string(PICKER_SCRIPT.format(templates=TEMPLATES), default_timeout=60)


def test_pickers_open_on_the_defaults_and_remember_a_change(picker_app, data_ws):
    at = picker_app.run()
    assert not at.exception
    dataset, template = at.selectbox
    assert dataset.value == "shop" and template.value == "ecommerce_returns@0"
    assert "only 1 episode" in dataset.format_func("tiny")
    assert last_choice(data_ws, LOCAL_ADMIN, "dataset") is None  # opening remembers nothing
    dataset.set_value("finance").run()
    assert at.selectbox[0].value == "finance"
    assert at.selectbox[1].value == "finance_risk@2"  # the template followed the dataset's domain
    assert last_choice(data_ws, LOCAL_ADMIN, "dataset") == "finance"
    at.selectbox[1].set_value("finance_risk@1").run()
    assert last_choice(data_ws, LOCAL_ADMIN, "template", scope="finance") == "finance_risk@1"
    at.run()  # a rerun keeps the user's choices
    assert (at.selectbox[0].value, at.selectbox[1].value) == ("finance", "finance_risk@1")
    fresh = AppTest.from_string(PICKER_SCRIPT.format(templates=TEMPLATES), default_timeout=60).run()
    assert (fresh.selectbox[0].value, fresh.selectbox[1].value) == ("finance", "finance_risk@1")
