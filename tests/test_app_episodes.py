"""The app shell and the Episodes page (AppTest), the core functions behind them, and ``rwb app``.

AppTest cannot drive ``st.file_uploader``, so the upload path is tested in two halves:
the core function the page calls with the uploaded bytes (:func:`import_upload`), and
the page rendering an import result (or error) left in session state by that call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.records.catalog import catalog_for_dataset
from core.cli import main as rwb
from core.data.episode_views import (
    EpisodeFilter,
    import_formats,
    import_summary,
    import_upload,
    list_episodes,
    show_episode,
)
from core.records.episodes import Action, Episode, Outcome, Step, Task
from core.base.errors import InputError
from core.records.store import Workspace
from rwb_app.fmt import number as fmt_number
from core.sample.workspace_setup import SAMPLE_DATASETS, ensure_samples, init_workspace

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "app" / "main.py")
PAGE = str(ROOT / "pages" / "episodes.py")
TIMEOUT = 120


@pytest.fixture(scope="module")
def sample_ws(tmp_path_factory) -> Path:
    """A workspace with the samples imported once for the read-only tests of this module."""
    path = tmp_path_factory.mktemp("sample-ws")
    ws = Workspace.open(path)
    init_workspace(ws)
    ws.close()
    return path


@pytest.fixture
def use_ws(monkeypatch):
    def use(path: Path) -> Path:
        monkeypatch.setenv("RWB_WORKSPACE", str(path))
        return path
    return use


def _app(path: str = MAIN) -> AppTest:
    return AppTest.from_file(path, default_timeout=TIMEOUT)


def _labels(elements) -> list[str]:
    return [e.label for e in elements]


def _small_episodes(n: int = 3) -> list[Episode]:
    return [Episode(
        episode_id=f"up-{i}", domain="finance", behaviour="expert",
        task=Task(query=f"analyse stock {i}", task_type="analysis"),
        steps=[Step(t=0, action=Action(kind="tool_call", tool="get_quote", params={"symbol": "600519"}),
                    tool_result={"price": 1700.0 + i}, latency_ms=12.0),
               Step(t=1, action=Action(kind="final_answer"), output_text="hold")],
        outcome=Outcome(resolved=i % 2 == 0, final_reward=0.5 + i / 10)) for i in range(n)]


def _jsonl(episodes: list[Episode]) -> bytes:
    return ("\n".join(ep.to_json() for ep in episodes) + "\n").encode()


# --------------------------------------------------------------------------- first start
def test_first_start_imports_samples_and_lists_episodes(tmp_path, use_ws):
    path = use_ws(tmp_path / "fresh")
    at = _app().run()                      # the app's first start imports the samples
    assert not at.exception, at.exception

    ws = Workspace.open(path)
    names = {d.name: d for d in ws.datasets()}
    assert set(names) == set(SAMPLE_DATASETS.values())
    assert all(d.n_episodes > 0 and d.n_steps > 0 for d in names.values())

    at = _app(PAGE).run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["Episodes"]
    assert "Recorded agent runs" in at.caption[0].value
    picker = at.selectbox(key="episodes_dataset")
    assert set(picker.options) == {f"{d.name} — {d.domain} · {d.n_episodes:,} episodes, "
                                   f"{d.n_steps:,} steps" for d in names.values()}
    shown = names[picker.value]
    table = at.dataframe[0].value
    assert len(table) == min(shown.n_episodes, 5000)
    assert list(table["episode_id"]) == ws.episode_ids(shown.name)[:len(table)]

    # A second session of the same server neither re-imports nor fails.
    before = ws.conn.execute("SELECT COUNT(*) FROM imports").fetchone()[0]
    again = _app().run()
    assert not again.exception
    assert ws.conn.execute("SELECT COUNT(*) FROM imports").fetchone()[0] == before


def test_ensure_samples_touches_only_an_empty_workspace(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    ws_first = ensure_samples(ws)
    assert sorted(r.dataset for r in ws_first) == sorted(SAMPLE_DATASETS.values())
    assert all(r.episodes > 0 and not r.already_imported for r in ws_first)
    assert ensure_samples(ws) == []

    other = Workspace.open(tmp_path / "other")
    import_upload(other, "mine.jsonl", _jsonl(_small_episodes()))
    assert ensure_samples(other) == []
    assert [d.name for d in other.datasets()] == ["mine"]


def test_samples_are_generated_when_the_checkout_files_are_missing(tmp_path, monkeypatch):
    from core.data import datasets

    committed = {p.parent.name: p for p in datasets.sample_files()}
    monkeypatch.setattr(datasets, "sample_files", lambda: [])
    ws = Workspace.open(tmp_path / "ws")
    results = ensure_samples(ws)
    assert sorted(r.dataset for r in results) == sorted(SAMPLE_DATASETS.values())
    for domain, dataset in SAMPLE_DATASETS.items():
        generated = ws.artifacts / "samples" / domain / "sample.jsonl"
        assert generated.is_file()
        # Same seed, same generator: the same episodes as the committed sample.
        assert generated.read_bytes() == committed[domain].read_bytes()
        assert ws.episode_ids(dataset)


def test_workspace_init_command(tmp_path, capsys):
    path = str(tmp_path / "ws")
    assert rwb(["--workspace", path, "workspace", "init", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert sorted(r["dataset"] for r in first["imported"]) == sorted(SAMPLE_DATASETS.values())
    assert {d["name"] for d in first["datasets"]} == set(SAMPLE_DATASETS.values())
    key = tmp_path / "ws" / "keys" / "signing.key"          # the bundle-signing key, made at init
    assert key.is_file() and key.stat().st_mode & 0o777 == 0o600
    made = key.read_bytes()
    assert rwb(["--workspace", path, "workspace", "init", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["imported"] == []
    assert key.read_bytes() == made                          # a second init keeps it
    assert rwb(["--workspace", path, "workspace", "info"]) == 0
    assert "finance-sample" in capsys.readouterr().out


# --------------------------------------------------------------------------- browsing
def test_filters_narrow_the_table(sample_ws, use_ws):
    use_ws(sample_ws)
    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("finance-sample").run()
    behaviours = at.multiselect(key="episodes_behaviours").options
    assert "hacker" in behaviours
    at.multiselect(key="episodes_behaviours").select("hacker").run()
    assert not at.exception
    table = at.dataframe[0].value
    ws = Workspace.open(sample_ws)
    expected = ws.conn.execute("SELECT COUNT(*) FROM episodes WHERE dataset='finance-sample' "
                               "AND behaviour='hacker'").fetchone()[0]
    assert len(table) == expected > 0
    assert set(table["behaviour"]) == {"hacker"}

    at.selectbox(key="episodes_resolved").set_value("resolved").run()
    assert set(at.dataframe[0].value["resolved"]) <= {True}
    at.text_input(key="episodes_search").input("no-such-episode-anywhere").run()
    assert any("No episode of this dataset matches" in i.value for i in at.info)


def test_list_episodes_matches_a_plain_python_filter(sample_ws):
    ws = Workspace.open(sample_ws)
    everything = ws.episode_summaries("finance-sample")
    task_type = everything[0].task_type
    flt = EpisodeFilter(task_types=[task_type], behaviours=["expert", "noisy"], resolved="failed")
    table = list_episodes(ws, "finance-sample", flt)
    expected = [e.episode_id for e in everything if e.task_type == task_type
                and e.behaviour in ("expert", "noisy") and e.resolved is False]
    assert table.episode_ids == expected
    assert table.total == len(everything) and table.matched == len(expected)
    needle = everything[3].episode_id.upper()
    assert everything[3].episode_id in list_episodes(ws, "finance-sample",
                                                        EpisodeFilter(search=needle)).episode_ids
    with pytest.raises(InputError):
        list_episodes(ws, "finance-sample", EpisodeFilter(resolved="maybe"))  # type: ignore[arg-type]


def test_opening_an_episode_shows_its_steps_and_tokens(sample_ws, use_ws):
    use_ws(sample_ws)
    ws = Workspace.open(sample_ws)
    catalog = catalog_for_dataset(ws, "finance-sample")
    # An episode with an INVALID step when the sample has one, to see the reason shown.
    chosen = None
    for eid in ws.episode_ids("finance-sample"):
        detail = show_episode(ws, "finance-sample", eid, catalog)
        if detail.n_invalid:
            chosen = detail
            break
    chosen = chosen or show_episode(ws, "finance-sample", ws.episode_ids("finance-sample")[0], catalog)

    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("finance-sample").run()
    assert at.selectbox(key="episodes_open").value is None
    at.selectbox(key="episodes_open").set_value(chosen.episode_id).run()
    assert not at.exception, at.exception
    assert at.subheader[0].value == f"Episode {chosen.episode_id}"
    step_labels = [label for label in _labels(at.expander) if label.startswith("t=")]
    assert len(step_labels) == len(chosen.steps) > 0
    for label, step in zip(step_labels, chosen.steps):
        assert label.startswith(f"t={step.t} · {step.action_label} · {step.token}")
    assert [m.label for m in at.metric][:4] == ["Task done", "Logged reward", "Business result",
                                                 "User sentiment"]
    step_table = at.dataframe[1].value
    assert list(step_table["token"]) == [s.token for s in chosen.steps]
    if chosen.n_invalid:
        assert any(w.value.startswith("INVALID: ") for w in at.warning)


def test_show_episode_tokens_match_one_by_one_normalization(sample_ws):
    ws = Workspace.open(sample_ws)
    catalog = catalog_for_dataset(ws, "finance-sample")
    for eid in ws.episode_ids("finance-sample")[:20]:
        episode = ws.get_episode("finance-sample", eid)
        detail = show_episode(ws, "finance-sample", eid, catalog)
        for step, view in zip(episode.steps, detail.steps):
            one = catalog.normalize(step.action)
            if one.valid:
                assert view.token == catalog.tokens[one.token_id].name
                assert view.invalid_reason is None
            else:
                assert (view.token, view.invalid_reason) == ("INVALID", one.reason)
        assert detail.outcome["resolved"] == episode.outcome.resolved
        assert len(detail.step_rows) == episode.n_steps
    plain = show_episode(ws, "finance-sample", ws.episode_ids("finance-sample")[0])
    assert all(s.token is None for s in plain.steps) and plain.catalog_version is None


def test_empty_workspace_says_what_to_do(tmp_path, use_ws):
    use_ws(tmp_path / "empty")
    at = _app(PAGE).run()  # the page alone: the router's first-start import does not run
    assert not at.exception
    assert any("No episodes yet" in i.value and "Import a file" in i.value for i in at.info)
    assert not at.dataframe


# --------------------------------------------------------------------------- importing
def test_import_upload_keeps_the_file_and_names_it(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    result = import_upload(ws, "orders.jsonl", _jsonl(_small_episodes(3)))
    assert (result.dataset, result.episodes, result.steps, result.tool_calls) == ("orders", 3, 6, 3)
    kept = list((ws.artifacts / "uploads").glob("*/orders.jsonl"))
    assert len(kept) == 1 and kept[0].read_bytes() == _jsonl(_small_episodes(3))
    assert Path(ws.conn.execute("SELECT file FROM imports").fetchone()[0]) == kept[0]
    again = import_upload(ws, "orders.jsonl", _jsonl(_small_episodes(3)))
    assert again.already_imported and ws.datasets()[0].n_episodes == 3
    summary = import_summary(again)
    assert "already imported" in summary.headline and summary.already_imported


def test_import_upload_error_names_the_place_and_changes_nothing(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    lines = _jsonl(_small_episodes(3)).decode().splitlines()
    lines[1] = lines[1][:40]  # truncated JSON on line 2
    with pytest.raises(InputError) as err:
        import_upload(ws, "broken.jsonl", ("\n".join(lines) + "\n").encode())
    assert "broken.jsonl" in str(err.value) and err.value.line == 2
    assert ws.datasets() == []
    assert not list((ws.artifacts / "uploads").rglob("*.jsonl"))
    with pytest.raises(InputError):
        import_upload(ws, "empty.jsonl", b"")

    # With skip-invalid the good records go in and the bad one is reported.
    result = import_upload(ws, "broken.jsonl", ("\n".join(lines) + "\n").encode(), skip_invalid=True)
    summary = import_summary(result)
    assert result.episodes == 2 and len(summary.rejected) == 1
    assert summary.rejected[0]["where"] == "line 2" and summary.rejected[0]["reason"]
    assert dict(summary.figures)["records rejected"] == 1


def test_page_renders_an_import_result(sample_ws, use_ws, tmp_path):
    ws = Workspace.open(tmp_path / "scratch")
    lines = _jsonl(_small_episodes(4)).decode().splitlines()
    lines[2] = "{not json"
    result = import_upload(ws, "mixed.jsonl", ("\n".join(lines) + "\n").encode(), skip_invalid=True)

    use_ws(sample_ws)
    at = _app(PAGE)
    at.session_state["episodes_import_outcome"] = ("ok", import_summary(result))
    at.run()
    assert not at.exception
    assert any("Imported 3 episodes from mixed.jsonl" in s.value for s in at.success)
    figures = {m.label: m.value for m in at.metric}
    assert figures["episodes"] == "3" and figures["records rejected"] == "1"
    assert any(len(df.value) == 1 and list(df.value["where"]) == ["line 3"] for df in at.dataframe)

    at = _app(PAGE)
    at.session_state["episodes_import_outcome"] = ("error", "bad.jsonl: line 2: invalid JSON")
    at.run()
    assert [e.value for e in at.error] == ["bad.jsonl: line 2: invalid JSON"]


def test_import_form_offers_every_format_and_the_options(sample_ws, use_ws):
    use_ws(sample_ws)
    at = _app(PAGE).run()
    formats = at.selectbox(key="episodes_format")
    assert formats.options[0].startswith("auto")
    assert {o.split(" — ")[0] for o in formats.options} == set(import_formats())
    assert {"rwb", "openai"} <= set(import_formats())
    for key in ("episodes_messages_key", "episodes_reward_key", "episodes_id_key",
                "episodes_import_dataset"):
        assert at.text_input(key=key) is not None
    assert at.checkbox(key="episodes_skip_invalid").value is False
    # Submitting without a file asks for one instead of failing.
    at.button(key="FormSubmitter:episodes_import-Import").click().run()
    assert any("Choose a file" in w.value for w in at.warning)


# --------------------------------------------------------------------------- rwb app
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamlit_command_line():
    from core.cli.app_cmd import app_entry, streamlit_argv

    assert app_entry() == ROOT / "app" / "main.py"
    argv = streamlit_argv(app_entry(), port=9999, host="127.0.0.1", headless=True)
    assert argv[1:5] == ["-m", "streamlit", "run", MAIN]
    pairs = dict(zip(argv[5::2], argv[6::2]))
    assert pairs == {"--server.port": "9999", "--server.address": "127.0.0.1",
                     "--server.headless": "true", "--browser.gatherUsageStats": "false"}
    config = (ROOT / ".streamlit" / "config.toml").read_text()
    assert "gatherUsageStats = false" in config


def test_rwb_app_serves_the_app(tmp_path):
    port = _free_port()
    workspace = tmp_path / "served"
    # No --headless and no display: the command must notice and not try to open a browser.
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from core.cli import console; console()",
         "--workspace", str(workspace), "app", "--port", str(port),
         "--no-prepare"],  # preparing the samples (minutes): tests/test_browser_pages.py
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    health = r.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert health == "ok", f"no health answer; exit={proc.poll()}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert r.status == 200 and "<html" in r.read().decode().lower()
        assert (workspace / "workbench.db").is_file()  # opened (created) before serving
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert f"workspace {workspace.resolve()}" in out
    assert "No display found: not opening a browser" in out


# --------------------------------------------------------------------------- filters, archive, delete
@pytest.fixture
def own_ws(sample_ws, tmp_path, use_ws) -> Path:
    """A copy of the sample workspace this test may change, used by the page."""
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(sample_ws, copy)
    return use_ws(copy)


def test_filters_start_empty_on_another_dataset(sample_ws, use_ws):
    use_ws(sample_ws)
    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("finance-sample").run()
    at.multiselect(key="episodes_behaviours").select("hacker").run()
    at.selectbox(key="episodes_resolved").set_value("failed").run()
    at.text_input(key="episodes_search").input("no-such-episode-anywhere").run()
    assert any("No episode of this dataset matches" in i.value for i in at.info)

    at.selectbox(key="episodes_dataset").set_value("ecommerce-sample").run()
    assert not at.exception
    assert not any("No episode" in i.value for i in at.info)
    assert at.multiselect(key="episodes_behaviours").value == []
    assert at.selectbox(key="episodes_resolved").value == "any"
    assert at.text_input(key="episodes_search").value == ""
    ws = Workspace.open(sample_ws)
    assert len(at.dataframe[0].value) == ws.conn.execute(
        "SELECT COUNT(*) FROM episodes WHERE dataset='ecommerce-sample'").fetchone()[0]

    # The filters left as they are on the same dataset; "Clear the filters" empties them.
    at.text_input(key="episodes_search").input("no-such-episode-anywhere").run()
    at.button(key="episodes_clear_filters").click().run()
    assert at.text_input(key="episodes_search").value == "" and at.dataframe


def test_plain_labels_and_rounded_figures_on_an_episode(own_ws):
    ws = Workspace.open(own_ws)
    eid = ws.episode_ids("finance-sample")[0]
    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("finance-sample").run()
    assert [at.multiselect(key=k).label for k in ("episodes_task_types", "episodes_behaviours")] == [
        "Task type", "Who acted"]
    assert at.selectbox(key="episodes_resolved").options == ["any", "yes", "no", "not recorded"]
    at.selectbox(key="episodes_open").set_value(eid).run()
    metrics = {m.label: m for m in at.metric}
    assert "(final_reward)" in metrics["Logged reward"].help and "(resolved)" in metrics["Task done"].help
    detail = show_episode(ws, "finance-sample", eid)
    assert metrics["Logged reward"].value == fmt_number(detail.outcome["final_reward"])


def test_for_reading_rounds_every_recorded_figure():
    from core.data.episode_views import for_reading

    assert for_reading({"a": [0.32000000000000006, 1289.1999999999998, 12345.67, 7, "0.1234567"],
                        "b": {"c": -0.000123456}}) == {"a": [0.32, 1289, 12350, 7, "0.1234567"],
                                                       "b": {"c": -0.0001235}}
    assert for_reading(True) is True and for_reading(None) is None


def test_an_episode_for_reading_is_rounded_and_the_exact_one_is_not(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    episode = _small_episodes(1)[0]
    episode.steps[0].action.params["limit"] = 0.32000000000000006
    episode.steps[0].tool_result = {"price": 1289.1999999999998}
    import_upload(ws, "orders.jsonl", _jsonl([episode]))
    shown = show_episode(ws, "orders", "up-0", reading=True)
    assert shown.steps[0].action_label == "get_quote(limit=0.32, symbol=600519)"
    assert shown.steps[0].tool_result == {"price": 1289}
    exact = show_episode(ws, "orders", "up-0")
    assert exact.steps[0].tool_result == {"price": 1289.1999999999998}


def test_archive_hides_the_dataset_and_restore_brings_it_back(own_ws):
    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("ecommerce-sample").run()
    at.button(key="episodes_archive").click().run()
    assert not at.exception
    assert any("Archived dataset 'ecommerce-sample'" in s.value for s in at.success)
    picker = at.selectbox(key="episodes_dataset")
    assert picker.value == "finance-sample" and not any("ecommerce" in o for o in picker.options)

    at.toggle(key="episodes_show_archived").set_value(True).run()
    at.selectbox(key="episodes_dataset").set_value("ecommerce-sample").run()
    assert any("is archived" in i.value for i in at.info)
    at.button(key="episodes_restore").click().run()
    assert any("Restored dataset 'ecommerce-sample'" in s.value for s in at.success)
    assert [d.name for d in Workspace.open(own_ws).datasets()] == ["ecommerce-sample", "finance-sample"]


def test_delete_refused_while_a_run_trains_on_it_says_which(own_ws):
    from core.access.users import LOCAL_ADMIN
    from core.rewards import load_template
    from core.rl.ppo import PPOConfig
    from core.rl.runs import create_run

    ws = Workspace.open(own_ws)
    run_id = create_run(ws, LOCAL_ADMIN, template=load_template("finance_risk"), config=PPOConfig(),
                        dataset="finance-sample")
    at = _app(PAGE).run()
    at.selectbox(key="episodes_dataset").set_value("finance-sample").run()
    assert any(run_id in w.value and "refused" in w.value for w in at.warning)
    assert at.button(key="episodes_delete").disabled          # the name is not typed yet
    at.text_input(key="episodes_delete_confirm").input("finance-sample").run()
    at.button(key="episodes_delete").click().run()
    assert not at.exception
    assert any(f"run {run_id} is training on it" in e.value and "cannot be deleted" in e.value for e in at.error)
    assert ws.has_dataset("finance-sample")
    assert ws.conn.execute("SELECT event FROM dataset_events").fetchall() == [("delete_refused",)]

    # a dataset nothing depends on goes, and the page moves to another one
    at.selectbox(key="episodes_dataset").set_value("ecommerce-sample").run()
    at.text_input(key="episodes_delete_confirm").input("ecommerce-sample").run()
    at.button(key="episodes_delete").click().run()
    assert any("Deleted dataset 'ecommerce-sample'" in s.value for s in at.success)
    assert at.selectbox(key="episodes_dataset").value == "finance-sample"
    assert not ws.has_dataset("ecommerce-sample")


def test_archive_and_delete_need_the_role(own_ws):
    from core.access.users import LOCAL_ADMIN, Actor, add_user

    ws = Workspace.open(own_ws)
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-long")
    at = _app(PAGE)
    at.session_state["actor"] = Actor("rae", "reviewer")
    at.run()
    assert not at.exception
    assert at.button(key="episodes_archive").disabled and at.button(key="episodes_delete").disabled
    assert at.text_input(key="episodes_delete_confirm").disabled
    assert any("needs the analyst or admin role" in c.value for c in at.caption)
