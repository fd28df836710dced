"""The Home page (AppTest through the app's router) and what it renders: core.govern.overview's
state along the loop and its next step, on a fresh sample workspace and on a used one (a saved
reward version, a trained run registered and approved, reviews decided and waiting); and
``rwb workspace status``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from _bundle_fixtures import module_hash_embedder, registry_figures, trained_copy  # noqa: F401  (a module fixture)
from core.access.users import LOCAL_ADMIN, Actor
from core.cli import main as rwb
from core.govern import registry
from core.govern.bundle import load_bundle
from core.govern.overview import NextStep, workspace_overview
from core.guard import review
from core.records.store import Workspace
from core.rewards.versions import get_template, save_template
from core.rl.runs import create_run, finish_run
from core.sample.workspace_setup import SAMPLE_DATASETS, init_workspace, queue_sample_reviews

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "app" / "main.py")
SAMPLES = list(SAMPLE_DATASETS.values())


@pytest.fixture(scope="module")
def sample_root(tmp_path_factory) -> Path:
    """A fresh workspace with the samples, as the app's first start leaves it (never written to)."""
    path = tmp_path_factory.mktemp("home-fresh") / "ws"
    ws = Workspace.open(path)
    init_workspace(ws)
    ws.close()
    return path


@pytest.fixture(scope="module")
def used(tmp_path_factory):
    """The suite's tiny trained run in a workspace of its own, used along the loop: ana saved
    finance_risk@1 and registered the run's bundle, bob approved it (not promoted), rae decided
    one review item and three wait."""
    run = trained_copy(tmp_path_factory)
    ws = run.workspace()
    ana, bob, rae = run.actor("ana"), run.actor("bob"), run.actor("rae")
    save_template(ws, ana, "finance_risk", get_template(ws, "finance_risk").yaml, 0, "checked against outcomes")
    expert = load_bundle(run.bundle).manifest.evaluation["expert_return"]
    with pytest.MonkeyPatch.context() as mp:  # the tiny run does not beat the logs: say it does
        registry_figures(mp, {("finance_risk", "0.1.0"): expert + 1.0})
        registry.register(ws, ana, run.bundle)
        registry.approve(ws, bob, "finance_risk", "0.1.0", "beats the logs on held-out episodes")
    queue_sample_reviews(ws, ["finance"])
    item = review.claim(ws, rae)
    assert item is not None
    review.decide(ws, rae, item.id, "approve", "acceptable")
    ws.close()
    return run


def _home(root: Path, monkeypatch, actor: Actor | None = None) -> AppTest:
    monkeypatch.setenv("RWB_WORKSPACE", str(root))
    at = AppTest.from_file(MAIN, default_timeout=120)
    if actor is not None:
        at.session_state["actor"] = actor  # signed in (a session set up by code has no token)
    return at.run()


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _next_link(at: AppTest) -> tuple[str, str]:
    """(label, page address) of the page's next-step link."""
    link = at.get("page_link")[0].proto
    return link.label, link.page


# --------------------------------------------------------------------------- fresh
def test_fresh_sample_workspace_opens_on_home_and_says_import_your_own(sample_root, monkeypatch):
    at = _home(sample_root, monkeypatch)
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["Home"]
    assert "check against real outcomes" in at.markdown[0].value
    metrics = _metrics(at)
    assert metrics["Datasets"] == "2"
    assert metrics["Episodes with a known outcome"] == "100%"
    assert metrics["Reward versions saved"] == "0"
    assert metrics["Training runs"] == "0"
    assert metrics["Waiting for review"] == "6"  # the samples' queued steps
    assert metrics["Policies in production"] == "0"
    captions = " ".join(c.value for c in at.caption)
    assert "430 episodes · 0 of your own" in captions
    assert _next_link(at) == ("**Import your own agent logs**", "episodes")
    assert "only the sample datasets" in " ".join(m.value for m in at.markdown)
    picked = {s.label: s.value for s in at.selectbox}
    assert picked == {"Dataset": "finance-sample", "Reward template": "finance_risk@0"}


def test_fresh_overview_in_core(sample_root):
    ws = Workspace.open(sample_root)
    overview = workspace_overview(ws, LOCAL_ADMIN, samples=SAMPLES)
    assert [d.name for d in overview.datasets] == ["finance-sample", "ecommerce-sample"]  # newest first
    assert overview.episodes == 430 and overview.labelled_share == 1.0 and overview.own_datasets == ()
    assert overview.reward.versions_saved == 0 and overview.reward.fidelity is None
    assert overview.runs.count == 0 and overview.review.open == 6
    assert overview.next_step.page == "episodes"
    # nobody signed in, or a reviewer: the samples' waiting reviews come first for a reviewer
    assert workspace_overview(ws, Actor("rae", "reviewer"), samples=SAMPLES).next_step.page == "review"
    # without naming the samples every dataset counts as own data: next is the reward
    assert workspace_overview(ws, LOCAL_ADMIN).next_step.stage == "reward"
    ws.close()


def test_an_empty_workspace_says_import(ws):
    step = workspace_overview(ws, LOCAL_ADMIN).next_step
    assert step == NextStep("data", "episodes", "Import your agent logs", "The workspace holds no episodes yet.")
    assert workspace_overview(ws).labelled_share is None


# --------------------------------------------------------------------------- used
def test_used_workspace_shows_its_state_and_the_approvers_next_step(used, monkeypatch):
    at = _home(used.root, monkeypatch, used.actor("bob"))
    assert not at.exception, at.exception
    metrics = _metrics(at)
    assert metrics["Datasets"] == "1"
    assert metrics["Reward versions saved"] == "1"
    assert metrics["Training runs"] == "1"
    assert metrics["Waiting for review"] == str(len(review.list_items(used.workspace(), status="pending")))
    assert metrics["Policies in production"] == "0"
    fidelity = metrics["Reward agrees with outcomes"]
    assert fidelity != "—" and 0.5 <= float(fidelity) <= 1
    captions = " ".join(c.value for c in at.caption)
    assert "Latest: finance_risk@1 by ana" in captions
    assert f"Latest: {used.run_id}, finished" in captions
    assert "1 decided so far" in captions and "1 waiting for approval or promotion" in captions
    assert _next_link(at) == ("**Promote finance_risk@0.1.0 to production**", "policies")


def test_used_workspace_next_step_follows_the_role(used):
    ws = used.workspace()
    overview = workspace_overview(ws, used.actor("bob"))
    assert overview.reward.latest == "finance_risk@1"
    assert overview.reward.fidelity is not None and overview.reward.fidelity.dataset == "finance"
    fid = overview.reward.fidelity
    # measured on the data the version is made for: said not to be held out, with its interval
    if fid.within_task_auc is not None:
        assert not fid.held_out and "not a held-out figure" in fid.note
        assert fid.ci90 is not None and fid.ci90[0] <= fid.within_task_auc <= fid.ci90[1]
    assert overview.runs.latest_status == "finished" and overview.runs.finished_unregistered == ()
    assert overview.policies.approved == ("finance_risk@0.1.0",) and overview.policies.production == ()
    assert workspace_overview(ws, used.actor("rae")).next_step.page == "review"
    analyst = workspace_overview(ws, used.actor("ana")).next_step
    assert analyst.page == "review" and "does not do this step" in analyst.reason  # nothing left for ana
    ws.close()


def test_runs_and_candidates_lead_to_their_pages(sample_root, tmp_path):
    from core.rl.ppo import PPOConfig
    import shutil

    root = tmp_path / "ws"
    shutil.copytree(sample_root, root)
    ws = Workspace.open(root)
    save_template(ws, LOCAL_ADMIN, "finance_risk", get_template(ws, "finance_risk").yaml, 0, "checked")
    assert workspace_overview(ws, LOCAL_ADMIN, samples=SAMPLES).next_step.page == "training"
    template = get_template(ws, "finance_risk").template()
    run_id = create_run(ws, LOCAL_ADMIN, template=template, config=PPOConfig(), dataset="finance-sample")
    finish_run(ws, run_id, "failed", error="out of memory")
    step = workspace_overview(ws, LOCAL_ADMIN, samples=SAMPLES).next_step
    assert (step.page, step.reason) == ("training", "The latest run is failed.")
    run_id = create_run(ws, LOCAL_ADMIN, template=template, config=PPOConfig(), dataset="finance-sample")
    finish_run(ws, run_id, "finished")
    step = workspace_overview(ws, LOCAL_ADMIN, samples=SAMPLES).next_step
    assert (step.stage, step.page) == ("register", "policies") and run_id in step.action
    ws.close()


def test_archived_datasets_are_left_out(sample_root, tmp_path):
    import shutil

    from core.data.datasets import archive_dataset

    root = tmp_path / "ws"
    shutil.copytree(sample_root, root)
    ws = Workspace.open(root)
    archive_dataset(ws, LOCAL_ADMIN, "ecommerce-sample")
    overview = workspace_overview(ws, LOCAL_ADMIN, samples=SAMPLES)
    assert [d.name for d in overview.datasets] == ["finance-sample"] and overview.episodes == 250
    ws.close()


# --------------------------------------------------------------------------- the command
def test_rwb_workspace_status(sample_root, used, capsys):
    assert rwb(["--workspace", str(sample_root), "workspace", "status"]) == 0
    out = capsys.readouterr().out
    assert "2 datasets (0 your own), 430 episodes; 430 with a known outcome (100%)" in out
    assert "Next step  Import your own agent logs (app page: episodes)" in out
    assert rwb(["--workspace", str(used.root), "workspace", "status", "--for", "bob", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["next_step"]["page"] == "policies" and data["policies"]["approved"] == ["finance_risk@0.1.0"]
    assert data["reward"]["latest"] == "finance_risk@1" and data["episodes"] == 150
    # a workspace with users and nobody named: anyone's next step, the first of the loop still to do
    assert rwb(["--workspace", str(used.root), "workspace", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["next_step"]["page"] == "review"
    assert rwb(["--workspace", str(used.root), "workspace", "status", "--for", "nobody"]) == 2
    assert "nobody" in capsys.readouterr().err


# --------------------------------------------------------------------------- the glossary
GLOSSARY_PAGE = str(ROOT / "pages" / "glossary.py")
#: Terms the pages and the training curves show (issue 30: each needs a plain explanation).
SHOWN_TERMS = ("AUC", "within-task AUC", "KL divergence", "entropy", "nats", "PPO", "advantage", "value loss",
               "clip fraction", "silhouette", "t-SNE", "off-policy estimate", "effective sample size",
               "held-out split", "calibration", "curriculum", "UCB bonus", "mask", "behaviour cloning",
               "return Σγᵗr", "Brier score", "explained variance", "soft AUC", "kNN agreement")


def test_the_glossary_explains_every_term_shown():
    from rwb_app.glossary import TERMS, help_for

    for term in SHOWN_TERMS:
        text = help_for(term.upper() if term.isascii() else term)  # any case finds it
        assert text.startswith(term) and len(text) > len(term) + 20
    assert "Good: Below about 0.2" in help_for("clip fraction")
    assert all(entry.label and entry.meaning.endswith((".", ")")) for entry in TERMS.values())
    with pytest.raises(KeyError):
        help_for("flux capacitor")


def test_glossary_page_lists_alphabetically_and_searches():
    from rwb_app.glossary import TERMS

    at = AppTest.from_file(GLOSSARY_PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    names = [m.value.split("**")[1] for m in at.markdown if m.value.startswith("**")]
    assert len(names) == len(TERMS)
    assert names == sorted(names, key=lambda n: n.casefold().replace("ε", "e"))
    at.text_input(key="glossary_query").set_value("nats").run()
    names = [m.value.split("**")[1] for m in at.markdown if m.value.startswith("**")]
    assert names[:2] == ["entropy", "KL divergence"] and "nats" in names
    at.text_input(key="glossary_query").set_value("flux capacitor").run()
    assert at.info and "No term matches" in at.info[0].value
