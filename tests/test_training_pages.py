"""The Training and Diagnostics pages (AppTest): empty states, the run table, the plain summary
and the curves under Details, launching a run from the form, the stop and resume buttons, the
comparison, the one verdict both pages show alike, the four health checks and the held-out
evaluation."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from _state_fixtures import HashEmbedder
from core.rl import runs, verdict
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN

ROOT = Path(__file__).resolve().parents[1]
TRAINING = str(ROOT / "pages" / "training.py")
DIAGNOSTICS = str(ROOT / "pages" / "diagnostics.py")
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"


def tiny():
    from core.rl.ppo import PPOConfig

    return PPOConfig(total_steps=1024, n_envs=32, rollout_len=16, update_epochs=2, n_minibatches=2, bc_epochs=3,
                     hidden=64, n_critics=2, encoder={"dim": 64}, device="cpu", threads=1, eval_every=1,
                     eval_episodes=32, checkpoint_every=1)


@pytest.fixture(scope="module")
def trained_ws(tmp_path_factory):
    """A workspace with the finance sample's first 60 episodes and one finished tiny run."""
    mp = pytest.MonkeyPatch()
    mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    from core.data.importers import import_file

    root = tmp_path_factory.mktemp("pages-ws")
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    subset = root / "finance.jsonl"
    subset.write_text("\n".join(lines[:61]) + "\n", encoding="utf-8")
    ws = Workspace.open(root / "ws")
    import_file(ws, subset, dataset="finance")
    run_id = runs.train(ws, LOCAL_ADMIN, template="finance_risk", dataset="finance", config=tiny()).run_id
    ws.close()
    mp.undo()
    return root / "ws", run_id


@pytest.fixture
def page_env(trained_ws, monkeypatch):
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    monkeypatch.setenv("RWB_WORKSPACE", str(trained_ws[0]))
    return trained_ws


def test_training_page_empty_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(TRAINING, default_timeout=60).run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Training"]
    infos = " ".join(i.value for i in at.info)
    assert "import episodes" in infos and "No runs yet" in infos


def test_diagnostics_page_empty_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(DIAGNOSTICS, default_timeout=60).run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Diagnostics"]
    assert "Training page" in at.info[0].value


def test_training_page_shows_runs_curves_and_comparison(page_env):
    _, run_id = page_env
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="train_run").value == run_id
    assert any(run_id in str(df.value) for df in at.dataframe)
    md = " ".join(m.value for m in at.markdown)
    assert f"**{run_id}** · finished · 1,024 steps done (planned 1,024) · 2 updates" in md
    # the plain summary first: not judged yet, and the button that judges it
    assert any(i.value.startswith("Not checked against the logs yet.") for i in at.info)
    assert at.button(key=f"train_check_{run_id}").label == "Check it against the logs"
    charts = at.get("plotly_chart")
    assert len(charts) >= 10                    # every recorded metric has a curve (+ the comparison)
    titles = [m.value for m in at.markdown if m.value.startswith("**") and m.value.endswith("**")]
    plain = [c.title for c in runs.CURVES if c.plain]
    assert titles[:len(plain)] == [f"**{t}**" for t in plain]      # first, before the Details
    for title in ("Brake on policy changes", "Forbidden actions taken (must stay 0)", "Training stage",
                  "Choice spread per tool (nats)", "Update size per layer"):
        assert f"**{title}**" in titles
    # each title's tooltip names the technical term and what good looks like
    helps = {m.value: m.help for m in at.markdown if m.value in titles}
    assert helps["**Brake on policy changes**"].startswith("KL penalty β") and "Good: " in helps[
        "**Brake on policy changes**"]
    assert not [b for b in at.button if b.label in ("Stop", "Resume")]      # a finished run has neither
    assert at.multiselect(key="train_compare").value == [run_id]


def test_steps_are_said_done_against_planned():
    def run(done: int, planned: int, status: str = "finished"):
        return types.SimpleNamespace(env_steps=done, total_steps=planned, status=status)

    assert runs.steps_progress(run(40_960, 40_000)) == (
        "40,960 steps done (planned 40,000; the last update runs whole batches)")
    assert runs.steps_progress(run(40_000, 40_000)) == "40,000 steps done (planned 40,000)"
    assert runs.steps_progress(run(12_288, 40_000, "running")) == "12,288 of 40,000 planned steps done"


def test_launch_from_the_form_starts_a_background_run(page_env, monkeypatch):
    """The Launch button hands the form's settings to core.rl.runs.launch_run (spied here: the
    background process itself is tested in tests/test_runs.py)."""
    calls = []
    real_create = runs.create_run

    def spy(ws, actor, *, template, dataset=None, episodes_file=None, config=None, masks=None):
        calls.append({"template": template, "dataset": dataset, "config": dict(config)})
        from core.rl.ppo import PPOConfig

        tmpl, label = runs.resolve_run_template(ws, template)
        run_id = real_create(ws, actor, template=tmpl, config=PPOConfig.from_dict(config), dataset=dataset,
                             template_version=label)
        return runs.LaunchedRun(run_id=run_id, pid=0, log="")

    monkeypatch.setattr(runs, "launch_run", spy)
    at = AppTest.from_file(TRAINING, default_timeout=120).run()
    at.selectbox(key="train_template").set_value("finance_risk@0")
    at.number_input(key="train_steps").set_value(5000)
    at.radio(key="train_device").set_value("cpu")
    assert at.radio(key="train_gating").value == "off"        # the trainer's default
    at.radio(key="train_gating").set_value("on")
    at.radio(key="train_adaptive").set_value("fixed")
    next(b for b in at.button if b.label == "Launch").click()
    at.run()
    assert not at.exception, at.exception
    assert len(calls) == 1
    c = calls[0]
    assert c["dataset"] == "finance" and c["template"] == "finance_risk@0"
    assert c["config"]["total_steps"] == 5000 and c["config"]["device"] == "cpu"
    assert c["config"]["encoder"] == {"gating": "on"} and c["config"]["adaptive_kl"] is False
    assert any(s.value.startswith("Started run run-") for s in at.success)
    # the new run is shown (its "process" never existed: interrupted)
    new_id = at.selectbox(key="train_run").value
    assert new_id != page_env[1]
    assert "interrupted" in " ".join(m.value for m in at.markdown)


def test_stop_button_asks_a_running_run_to_stop(page_env):
    ws_path, _ = page_env
    ws = Workspace.open(ws_path)
    try:
        run_id = runs.create_run(ws, LOCAL_ADMIN, template=runs.run_template(ws, page_env[1]), config=tiny(),
                                 dataset="finance")
        runs.mark_started(ws, run_id, device="cpu")          # "trained" by this (alive) process
        assert runs.get_run(ws, run_id).process_alive is True
        at = AppTest.from_file(TRAINING, default_timeout=120).run()
        at.selectbox(key="train_run").set_value(run_id)
        at.run()
        stop = [b for b in at.button if b.label == "Stop"]
        assert stop, [b.label for b in at.button]
        stop[0].click()
        at.run()
        assert not at.exception, at.exception
        assert runs.get_run(ws, run_id).stop_requested is True
    finally:
        runs.finish_run(ws, run_id, "stopped")
        ws.close()


def _verdict_texts(at: AppTest) -> list[str]:
    """What a page says of the run's verdict: the coloured line, the three answers, the next step."""
    coloured = [e.value for e in (*at.success, *at.warning, *at.error) if e.value.startswith("**")
                and " · " in e.value]
    lines = [m.value for m in at.markdown if m.value.startswith(("- Learning: ", "**Next:** "))]
    return coloured + lines


def test_diagnostics_page_checks_and_evaluates(page_env):
    _, run_id = page_env
    # a newer run stopped after one update: the picker still opens on the latest finished run
    ws = Workspace.open(page_env[0])
    stopped = runs.create_run(ws, LOCAL_ADMIN, template=runs.run_template(ws, run_id), config=tiny(),
                              dataset="finance")
    runs.record_update(ws, stopped, 1, 512, {"return_mean": 0.1})
    runs.finish_run(ws, stopped, "stopped")
    assert [r.id for r in runs.list_runs(ws) if r.updates > 0][0] == stopped
    ws.close()
    at = AppTest.from_file(DIAGNOSTICS, default_timeout=180).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="diag_run").value == run_id
    assert "Not checked against the logs yet" in at.info[0].value
    at.button(key="diag_check").click().run()
    assert not at.exception, at.exception
    said = _verdict_texts(at)
    assert len(said) == 3, said
    assert said[1].startswith("- Learning: ") and "\n- Better than the logs: " in said[1] \
        and "\n- How sure: " in said[1]
    verdicts = [e.value for e in (*at.success, *at.warning, *at.error)]
    for name in ("1. The rewards are sane** (reward integrity)", "2. The policy tells task types apart**",
                 "3. Every layer learns** (gradient flow)", "4. It still tries varied actions**"):
        assert any(name in v for v in verdicts), verdicts
    assert not any("Overall: " in v or "Nothing to fix here" in v for v in verdicts)
    # every figure is named in plain words with its unit; the technical term and threshold in its tooltip
    assert len(at.metric) == 4
    assert at.metric[3].label == "Exploration (entropy, nats)"
    for metric in at.metric:
        assert metric.label.endswith(")") and "Must be " in metric.help, (metric.label, metric.help)
        assert len(metric.value.replace(",", "").replace(".", "").rstrip("%").lstrip("0-")) <= 4, metric.value
    musts = [c.value for c in at.caption if c.value.startswith("Must be ")]
    assert len(musts) == 4 and all(c.endswith(": it is.") or "Next: " in c for c in musts), musts
    # the held-out evaluation in detail, rounded
    next(b for b in at.button if b.label == "Evaluate").click()
    at.run()
    assert not at.exception, at.exception
    messages = " ".join(e.value for e in (*at.success, *at.warning))
    assert "best logged behaviour" in messages and "random-in-mask" in messages
    assert any("policy (greedy: its top choice)" in str(df.value) for df in at.dataframe)
    assert any(c.value.startswith("Off-catalog: ") for c in at.caption)
    assert any(c.value.startswith("Off-policy: ") for c in at.caption)
    from core.rl.evaluation import evaluate

    ws = Workspace.open(page_env[0])
    ev = evaluate(ws, run_id, repeats=3)
    ws.close()
    verdicts = " ".join(e.value for e in (*at.success, *at.warning))
    if ev.ope.reliable:
        assert "against the logged agent's" in verdicts
    else:
        assert f"No trustworthy off-policy figure ({ev.ope.verdict})" in verdicts
    # On a whole workspace dataset, mapped onto the run's catalog: the off-catalog line
    # counts what the run's normalizer maps to INVALID.
    from core.records.catalog import catalog_for_dataset
    from rwb_app.fmt import number

    ws = Workspace.open(page_env[0])
    catalog = catalog_for_dataset(ws, "finance")
    actions = [s.action for ep in ws.load_episodes("finance") for s in ep.steps]
    ws.close()
    off = sum(catalog.normalize(a).token_id < 0 for a in actions)
    calls = sum(a.kind == "tool_call" for a in actions)
    at.selectbox(key="diag_eval_on").set_value("finance")
    next(b for b in at.button if b.label == "Evaluate").click()
    at.run()
    assert not at.exception, at.exception
    captions = " ".join(c.value for c in at.caption)
    assert f"Off-catalog: {off} of {calls} tool calls ({number(off / calls, 'share')})" in captions
    assert "60 held-out episodes (dataset finance)" in captions


def test_training_and_diagnostics_show_the_same_verdict(page_env):
    """Judged once (here on the Training page), the verdict is kept: Diagnostics shows the very
    same words at once, and a losing run is never an all-clear on either page."""
    _, run_id = page_env
    at = AppTest.from_file(TRAINING, default_timeout=180).run()
    at.selectbox(key="train_run").set_value(run_id).run()
    at.button(key=f"train_check_{run_id}").click().run()
    assert not at.exception, at.exception
    on_training = _verdict_texts(at)
    assert len(on_training) == 3, on_training
    assert at.button(key=f"train_check_{run_id}").label == "Check again"
    diag = AppTest.from_file(DIAGNOSTICS, default_timeout=60).run()
    assert not diag.exception, diag.exception
    diag.selectbox(key="diag_run").set_value(run_id).run()
    assert _verdict_texts(diag) == on_training
    ws = Workspace.open(page_env[0])
    kept = verdict.stored_verdict(ws, run_id).verdict
    ws.close()
    assert on_training[0] == f"**{kept.plain_overall.capitalize()}** · {kept.headline}"
    if kept.better_than_logs.answer != "yes":
        assert kept.overall != "ok" and not on_training[0].startswith("**All clear**")


def test_resume_button_continues_a_stopped_run(page_env, children):
    """A stopped run with a checkpoint has a Resume button; it starts the background trainer
    (a cheap child here) and the run runs again; a finished run has none."""
    ws_path, run_id = page_env
    ws = Workspace.open(ws_path)
    try:
        stopped = runs.create_run(ws, LOCAL_ADMIN, template=runs.run_template(ws, run_id), config=tiny(),
                                  dataset="finance")
        ckpt = runs.latest_checkpoint(ws, run_id)
        runs.record_update(ws, stopped, ckpt.update_idx, ckpt.env_steps, {"return_mean": 0.1})
        runs.record_checkpoint(ws, stopped, ckpt.update_idx, ckpt.env_steps, Path(ckpt.path))
        runs.finish_run(ws, stopped, "stopped")
        at = AppTest.from_file(TRAINING, default_timeout=120).run()
        at.selectbox(key="train_run").set_value(stopped).run()
        at.button(key=f"train_resume_{stopped}").click().run()
        assert not at.exception, at.exception
        run = runs.get_run(ws, stopped)
        assert run.status == "running" and run.pid == children[0].pid
        assert f"Resumed {stopped} from its last checkpoint (process {children[0].pid})." in [
            s.value for s in at.success]
        assert f"train_resume_{stopped}" not in [b.key for b in at.button]    # it runs: Stop instead
        assert any(b.label == "Stop" for b in at.button)
    finally:
        runs.finish_run(ws, stopped, "stopped")
        ws.close()


def test_doctor_steps_name_their_figure_threshold_and_next_action():
    from core.rl.doctor import exploration_quality, gradient_flow, reward_integrity

    flood = reward_integrity([-0.5] * 8 + [0.2, 0.4], 5.0, 10)
    assert (flood.value, flood.figure, flood.unit, flood.threshold) == (
        0.8, "steps at the minimum reward", "share", "at most 30% of steps")
    assert flood.plain_verdict == "needs a look" and "-0.500" in flood.action
    dead = gradient_flow({"actor.0": 0.1, "encoder.intent_net.0": 0.0})
    assert (dead.value, dead.unit, dead.plain_verdict) == (1, "layers", "fails")
    assert dead.details["dead"] == ["encoder.intent_net.0"]
    low = exploration_quality(0.4, 0.1)
    assert (low.unit, low.threshold) == ("nats", "at least 1 nat") and "ent_coef" in low.action
    assert exploration_quality(2.4, 0.5).action == "Nothing to fix in this check."


def test_pages_show_user_errors(page_env, monkeypatch):
    """A core error reaches the page as st.error, not a traceback."""
    from core.base.errors import InputError

    def broken(*a, **k):
        raise InputError("the held-out file is gone")

    monkeypatch.setattr("core.rl.evaluation.evaluate", broken)
    at = AppTest.from_file(DIAGNOSTICS, default_timeout=120).run()
    at.selectbox(key="diag_run").set_value(page_env[1])
    at.number_input(key="diag_repeats").set_value(2)
    next(b for b in at.button if b.label == "Evaluate").click()
    at.run()
    assert not at.exception
    assert any("the held-out file is gone" in e.value for e in at.error)
    assert os.environ["RWB_WORKSPACE"] == str(page_env[0])
