"""Preparing a workspace before the app serves it (core.sample.warmup, ``rwb workspace prepare``):
the samples are imported and scored with every template, so that the Reward Pyramid
page's first visit reads every component column from the workspace; a second call does
nothing; a new template version or an unknown dataset is handled.

The hash embedder stands in for the sentence model (the text components embed through
``core.base.embed.workspace_embedder``), so the tests take seconds, not minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _state_fixtures import HashEmbedder
from core import rewards
from core.cli import main, root
from core.base.errors import InputError
from core.rewards.versions import get_template, save_template
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN
from core.sample.warmup import PrepareProgress, latest_templates, prepare_workspace, sample_datasets
from core.sample.workspace_setup import SAMPLE_DATASETS

TEMPLATES = ["ecommerce_returns@0", "finance_risk@0", "tool_agent@0", "tool_agent_criteria@0"]


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, object, list[PrepareProgress]]:
    """A workspace prepared once from empty, with the progress it reported."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
        path = tmp_path_factory.mktemp("warmup") / "ws"
        ws = Workspace.open(path)
        events: list[PrepareProgress] = []
        report = prepare_workspace(ws, progress=events.append)
        ws.close()
    return path, report, events


def _files(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its modification time (ns)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_an_empty_workspace_gets_the_samples_scored_with_every_template(prepared):
    path, report, events = prepared
    assert sorted(r["dataset"] for r in report.imported) == sorted(SAMPLE_DATASETS.values())
    ws = Workspace.open(path)
    assert sample_datasets(ws) == [d.name for d in ws.datasets()]     # the page's order
    assert latest_templates(ws) == TEMPLATES
    pairs = [(s.dataset, s.template) for s in report.scorings]
    assert pairs == [(d, t) for d in sample_datasets(ws) for t in TEMPLATES]
    assert all(s.error is None for s in report.scorings)
    # the first template on each dataset computed every component of it
    for first in (report.scorings[0], report.scorings[len(TEMPLATES)]):
        template = rewards.as_template(first.template, ws)
        assert sorted(first.computed) == sorted(c.name for c in template.all_components) and not first.cached
    assert report.did_work


def test_the_progress_names_each_step_in_order(prepared):
    _, report, events = prepared
    assert events[0].stage == "workspace"
    scores = [e for e in events if e.stage == "score"]
    n = 2 * len(TEMPLATES)
    assert [(e.done, e.total) for e in scores] == [(i, n) for i in range(n)]
    assert scores[len(TEMPLATES) + 1].text == f"[{len(TEMPLATES) + 2}/{n}] scoring finance-sample with finance_risk@0"
    embedding = [e for e in events if e.stage == "embedding"]
    assert embedding and all(0 < e.texts_done <= e.texts_total for e in embedding)
    assert embedding[0].text.startswith(f"[1/{n}] scoring ecommerce-sample with ecommerce_returns@0: "
                                        "embedding texts ")


def test_the_pages_first_scoring_reads_every_column_from_the_workspace(prepared):
    """What the Reward Pyramid page's first visit does (rwb_app.resources.pyramid_report):
    score a dataset with a template version; nothing is computed any more."""
    path, _, _ = prepared
    ws = Workspace.open(path)
    for dataset in sample_datasets(ws):
        for spec in TEMPLATES:
            template = rewards.as_template(spec, ws)
            result = rewards.score(ws, template, dataset=dataset)
            assert result.matrix.computed == [], (dataset, spec)
            assert sorted(result.matrix.cached) == sorted(c.name for c in template.all_components)


def test_a_second_call_does_nothing(prepared):
    path, _, _ = prepared
    ws = Workspace.open(path)
    before = _files(ws.root / "artifacts")
    n_episodes = ws.conn.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
    again = prepare_workspace(ws)
    assert not again.did_work and again.imported == []
    assert all(s.computed == [] and s.embedded == 0 and s.error is None for s in again.scorings)
    assert len(again.scorings) == 2 * len(TEMPLATES)
    assert _files(ws.root / "artifacts") == before                      # nothing written
    assert ws.conn.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == n_episodes


def test_a_new_template_version_is_prepared_computing_only_what_changed(prepared, tmp_path):
    import shutil

    path, _, _ = prepared
    shutil.copytree(path, tmp_path / "ws")
    ws = Workspace.open(tmp_path / "ws")
    shipped = get_template(ws, "finance_risk", 0).template()
    save_template(ws, LOCAL_ADMIN, "finance_risk", shipped.with_params("latency", {"per": 0.5, "unit_ms": 1000}),
                  0, "latency costs more")
    assert latest_templates(ws) == ["ecommerce_returns@0", "finance_risk@1", "tool_agent@0", "tool_agent_criteria@0"]
    report = prepare_workspace(ws)
    computed = {(s.dataset, s.template): s.computed for s in report.scorings}
    assert computed == {(d, t): (["latency"] if t == "finance_risk@1" else [])
                        for d in sample_datasets(ws) for t in latest_templates(ws)}
    assert report.did_work


def test_an_unknown_dataset_is_refused_before_any_work(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(InputError) as err:
        prepare_workspace(ws, datasets=["nope"])
    assert err.value.field == "dataset" and set(err.value.allowed) == set(SAMPLE_DATASETS.values())
    assert not (ws.root / "artifacts" / "reward_matrix").exists()


def test_cli_prepare_reports_json_and_does_nothing_the_second_time(prepared, tmp_path, capsys):
    import shutil

    path, _, _ = prepared
    shutil.copytree(path, tmp_path / "ws")
    runner = CliRunner()
    r = runner.invoke(root, ["-w", str(tmp_path / "ws"), "workspace", "prepare", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["did_work"] is False and len(out["scorings"]) == 2 * len(TEMPLATES)
    r = runner.invoke(root, ["-w", str(tmp_path / "ws"), "workspace", "prepare",
                             "--dataset", "finance-sample"])
    assert r.exit_code == 0, r.output
    assert f"[{len(TEMPLATES)}/{len(TEMPLATES)}] scoring finance-sample with tool_agent_criteria@0" in r.output
    assert "already prepared" in r.output
    # the console script's entry point turns the InputError into exit code 2 and one line
    code = main(["-w", str(tmp_path / "ws"), "workspace", "prepare", "--dataset", "nope"])
    assert code == 2 and "no dataset named 'nope'" in capsys.readouterr().err


def test_the_server_preloads_the_pages_modules_but_not_torch():
    """rwb_app.preload (the app server's start-up hook): the modules the pages import are
    imported before the first visit; torch, which only actions need, is not."""
    import subprocess
    import sys

    from rwb_app.preload import SKIP, preload_modules

    names = preload_modules()
    assert {"core.rewards.views", "rwb_app.resources", "rwb_app.charts", "pandas"} <= set(names)
    assert not SKIP & set(names)
    code = ("import sys; from rwb_app.preload import preload; n = preload(); "
            "print(len(n), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(names)), "False"]
