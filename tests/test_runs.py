"""Training runs (core.rl.runs): records, metrics, checkpoints, stop, background launch, resume
after ``kill -9``; the ``rwb train / runs / doctor / evaluate`` commands; the diagnosis and the
held-out evaluation.

One small workspace (a slice of the finance sample, hash embedder instead of the sentence
model) is shared by the module; every run is tiny.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _state_fixtures import HashEmbedder
from core.rl import runs
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.rl.ppo import PPOConfig
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
N_EPISODES = 80


def tiny(**kw) -> PPOConfig:
    base = dict(total_steps=2048, n_envs=32, rollout_len=16, update_epochs=2, n_minibatches=2, bc_epochs=5,
                hidden=64, n_critics=2, encoder={"dim": 64}, device="cpu", threads=1, eval_every=2,
                eval_episodes=32, checkpoint_every=1, seed=0)
    base.update(kw)
    return PPOConfig(**base)


@pytest.fixture(scope="module")
def ws_root(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    from core.data.importers import import_file

    root = tmp_path_factory.mktemp("runs-ws")
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    subset = root / "finance.jsonl"
    subset.write_text("\n".join(lines[:N_EPISODES + 1]) + "\n", encoding="utf-8")
    ws = Workspace.open(root / "ws")
    import_file(ws, subset, dataset="finance")
    ws.close()
    yield root / "ws"
    mp.undo()


@pytest.fixture
def ws(ws_root, monkeypatch):
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    w = Workspace.open(ws_root)
    yield w
    w.close()


@pytest.fixture(scope="module")
def finished(ws_root):
    """One finished run (4 updates, a checkpoint after each) shared by the read-only tests."""
    mp = pytest.MonkeyPatch()
    mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    w = Workspace.open(ws_root)
    seen = []
    result = runs.train(w, LOCAL_ADMIN, template="finance_risk", dataset="finance", config=tiny(),
                        progress=seen.append)
    w.close()
    mp.undo()
    assert [m["update"] for m in seen] == [1, 2, 3, 4]
    assert isinstance(result, runs.RunResult) and result.status == "finished" and result.metrics["update"] == 4
    return result.run_id


# --------------------------------------------------------------------------- records
def test_a_finished_run_is_recorded(ws, finished):
    run = runs.get_run(ws, finished)
    assert run.status == "finished" and run.display_status == "finished"
    assert run.env_steps == 2048 and run.updates == 4 and run.total_steps == 2048
    assert run.template_name == "finance_risk" and len(run.template_hash) == 64
    assert run.template_version == "@0" and run.masks_source.endswith("finance/masks.yaml")
    assert run.device == "cpu" and run.pid == os.getpid() and run.ended_at
    assert PPOConfig.from_dict(run.config) == tiny()
    metrics = runs.run_metrics(ws, finished)
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["mask_violations"] == 0 for m in metrics)
    assert {"return_mean", "success_rate", "kl", "beta", "clip_fraction", "value_loss", "entropy",
            "entropy_per_tool", "grad_norms", "off_support_rate", "curriculum_level", "env_steps_per_s",
            "reward_components"} <= set(metrics[-1])
    # checkpoints: one per update, only the newest KEEP_CHECKPOINTS kept (rows and folders)
    kept = runs.checkpoints(ws, finished)
    assert [c.update_idx for c in kept] == [3, 4]
    assert kept[-1] == runs.latest_checkpoint(ws, finished) and Path(kept[-1].path).name == "000004"
    folders = sorted(p.name for p in (runs.run_dir(ws, finished) / "checkpoints").iterdir())
    assert folders == ["000003", "000004"]
    assert runs.run_template(ws, finished).name == "finance_risk"
    listed = runs.list_runs(ws)
    assert listed[0].id == finished and listed[0].last.mask_violations == 0
    # a listed run is its record plus the last update's figures, field for field
    assert {f.name: getattr(listed[0], f.name) for f in dataclasses.fields(runs.RunRecord)} == dataclasses.asdict(run)


def test_runs_created_in_the_same_second_list_newest_first(tmp_path, monkeypatch):
    """Creation times have one-second resolution: ties are broken by insertion order, never by
    the id's random suffix (the Training page's table and picker read this order)."""
    from core.data.importers import import_file

    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    subset = tmp_path / "finance.jsonl"
    subset.write_text("\n".join(lines[:6]) + "\n", encoding="utf-8")
    w = Workspace.open(tmp_path / "ws")
    try:
        import_file(w, subset, dataset="finance")
        template, _ = runs.resolve_run_template(w, "finance_risk")
        monkeypatch.setattr(runs, "_now_iso", lambda: "2026-12-03T12:00:00Z")
        created = [runs.create_run(w, LOCAL_ADMIN, template=template, config=tiny(seed=seed), dataset="finance")
                   for seed in range(6)]
        assert [r.id for r in runs.list_runs(w)] == created[::-1]
    finally:
        w.close()


def test_curves_and_comparison(ws, finished):
    curves = runs.run_curves(ws, [finished])
    assert list(curves["return_mean"].columns) == [finished]
    assert list(curves["return_mean"].index) == [512, 1024, 1536, 2048]
    assert "tool_validity" in curves["reward_components"].columns
    table = runs.compare_runs(ws, [finished, finished])
    assert table[0]["run"] == finished and table[0]["mask violations"] == 0
    assert runs.run_progress(ws, [finished]) == ((finished, 4, "finished"),)


def test_refusals(ws, finished):
    with pytest.raises(InputError, match="no run 'nope'"):
        runs.get_run(ws, "nope")
    with pytest.raises(ConflictError, match="finished"):
        runs.stop_run(ws, LOCAL_ADMIN, finished)
    with pytest.raises(ConflictError, match="finished"):
        runs.train(ws, LOCAL_ADMIN, resume=finished)
    with pytest.raises(InputError, match="exactly one"):
        runs.train(ws, LOCAL_ADMIN, template="finance_risk", config=tiny())
    with pytest.raises(PermissionDenied):
        runs.train(ws, Actor("rae", "reviewer"), template="finance_risk", dataset="finance", config=tiny())


def test_stop_request_ends_the_run_after_the_update(ws):
    """A stop asked for while the run trains (here from its progress callback, right after
    update 2 was recorded) ends it after the update under way (3), with a checkpoint and
    status ``stopped``; it can be resumed."""
    def stop_at_two(m):
        if m["update"] == 2:
            requested.append(runs.stop_run(ws, LOCAL_ADMIN, runs.list_runs(ws, limit=1)[0].id))

    requested: list[runs.StopResult] = []
    result = runs.train(ws, LOCAL_ADMIN, template="finance_risk", dataset="finance",
                        config=tiny(total_steps=4096), progress=stop_at_two)
    # the trainer was alive: the request waits for it, the run still runs
    [stop] = requested
    assert not stop.stopped_now and stop.run.status == "running" and stop.run.stop_requested is True
    run = runs.get_run(ws, result.run_id)
    assert result.status == run.status == "stopped" and run.updates == 3
    assert runs.latest_checkpoint(ws, result.run_id).update_idx == 3
    resumed = runs.train(ws, LOCAL_ADMIN, resume=result.run_id)
    assert resumed.status == "finished"
    assert [m["update"] for m in runs.run_metrics(ws, result.run_id)] == list(range(1, 9))


def _wait(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_background_run_killed_with_sigkill_resumes_and_finishes(ws, finished):
    """``launch_run`` starts ``rwb train --resume RUN`` detached; ``kill -9`` it after its
    first checkpoints; the run then says interrupted, and ``--resume`` finishes it from
    its last checkpoint with the metrics of every update exactly once."""
    started = runs.launch_run(ws, LOCAL_ADMIN, template="finance_risk", dataset="finance",
                              config=tiny(total_steps=16384, checkpoint_every=1))
    run_id, pid = started.run_id, started.pid
    try:
        ckpt = _wait(lambda: (c := runs.latest_checkpoint(ws, run_id)) and c.update_idx >= 2 and c,
                     240, f"two checkpoints of the background run (log: {runs.run_log(ws, run_id)[-2000:]})")
        assert runs.get_run(ws, run_id).process_alive is True
    finally:
        os.kill(pid, signal.SIGKILL)
    _wait(lambda: runs.get_run(ws, run_id).process_alive is False, 30, "the killed process to be gone")
    os.waitpid(pid, 0)
    run = runs.get_run(ws, run_id)
    assert run.status == "running" and run.interrupted and run.display_status == "interrupted"
    assert run.updates >= ckpt.update_idx
    assert runs.get_run(ws, run_id).status == "running"
    result = runs.train(ws, LOCAL_ADMIN, resume=run_id)
    assert result.status == "finished"
    run = runs.get_run(ws, run_id)
    assert run.status == "finished" and run.env_steps == 16384 and run.pid == os.getpid()
    updates = [m["update"] for m in runs.run_metrics(ws, run_id)]
    assert updates == list(range(1, 33))
    assert "train.log" in started.log and Path(started.log).is_file()


def test_resume_run_in_the_background_and_its_refusals(ws, finished, children):
    """Resume (the Training page's button, ``rwb runs resume``) starts the background trainer of a
    stopped run with a checkpoint; it refuses a finished run, a run that trains, a failed run
    without a checkpoint, a run whose resume is starting, and a role that may not train."""
    import shutil

    assert runs.resume_refusal(ws, finished) == (f"run {finished} has finished its planned steps; start a new run "
                                                 "to train further")
    with pytest.raises(ConflictError, match="has finished"):
        runs.resume_run(ws, LOCAL_ADMIN, finished)
    template = runs.run_template(ws, finished)
    failed = runs.create_run(ws, LOCAL_ADMIN, template=template, config=tiny(seed=7), dataset="finance")
    runs.finish_run(ws, failed, "failed", error="RuntimeError: boom")
    with pytest.raises(ConflictError, match="failed before its first checkpoint"):
        runs.resume_run(ws, LOCAL_ADMIN, failed)
    stopped = runs.create_run(ws, LOCAL_ADMIN, template=template, config=tiny(seed=8), dataset="finance")
    ckpt = runs.latest_checkpoint(ws, finished)
    folder = runs.run_dir(ws, stopped) / "checkpoints" / f"{ckpt.update_idx:06d}"
    shutil.copytree(ckpt.path, folder)
    runs.record_checkpoint(ws, stopped, ckpt.update_idx, ckpt.env_steps, folder)
    runs.finish_run(ws, stopped, "stopped", error="stopped on request")
    assert runs.resume_refusal(ws, stopped) is None
    with pytest.raises(PermissionDenied):
        runs.resume_run(ws, Actor("rae", "reviewer"), stopped)
    started = runs.resume_run(ws, LOCAL_ADMIN, stopped)
    run = runs.get_run(ws, stopped)
    assert started.pid == children[0].pid == run.pid and started.run_id == stopped
    assert run.status == "running" and run.error is None and run.ended_at is None and not run.interrupted
    with pytest.raises(ConflictError, match="is training now"):
        runs.resume_run(ws, LOCAL_ADMIN, stopped)
    # a resume whose trainer is not recorded yet (the moment between the claim and the spawn)
    with ws.transaction() as conn:
        conn.execute("UPDATE runs SET pid=NULL, heartbeat_at=? WHERE id=?", (time.time(), stopped))
    with pytest.raises(ConflictError, match="being resumed already"):
        runs.resume_run(ws, LOCAL_ADMIN, stopped)
    runs.finish_run(ws, stopped, "stopped")


def test_steps_progress_says_done_against_planned(ws, finished):
    assert runs.steps_progress(runs.get_run(ws, finished)) == "2,048 steps done (planned 2,048)"
    over = dataclasses.replace(runs.get_run(ws, finished), env_steps=40_960, total_steps=40_000)
    assert runs.steps_progress(over) == "40,960 steps done (planned 40,000; the last update runs whole batches)"


# --------------------------------------------------------------------------- diagnosis and evaluation
def test_doctor_four_steps(ws, finished):
    from core.base.results import to_jsonable
    from core.rl.doctor import VERDICT_WORDS, diagnose, exploration_quality, gradient_flow, reward_integrity

    report = diagnose(ws, finished, episodes=64)
    assert [s.step for s in report.steps] == [1, 2, 3, 4]
    assert [s.name for s in report.steps] == ["reward integrity", "state-encoding fidelity", "gradient flow",
                                              "exploration quality"]
    assert all(s.verdict in ("ok", "warn", "fail") for s in report.steps)
    assert report.steps[0].details["non_finite"] == 0
    assert report.steps[1].details["silhouette"] is not None
    # the overall verdict is the worst step's; the next action names the first step to fix
    worst = max((s.verdict for s in report.steps), key=["ok", "warn", "fail"].index)
    assert report.verdict == worst and report.plain_verdict == VERDICT_WORDS[worst]
    first = next((s for s in report.steps if s.verdict == worst and worst != "ok"), None)
    assert report.next_action == ("All four steps pass: the training machinery is healthy. Whether the policy beats "
                                  "the logs is for the run's verdict to say, not for these four checks."
                                  if first is None else
                                  f"Step {first.step} ({first.name}): {first.action}")
    # --json keeps the dict's keys and order: the report's fields, each step's fields
    as_json = to_jsonable(report)
    assert list(as_json) == ["run_id", "status", "updates", "checkpoint_update", "policy_allowed_actions", "steps",
                             "verdict", "plain_verdict", "next_action"]
    assert list(as_json["steps"][0]) == ["step", "name", "verdict", "plain_verdict", "value", "figure", "unit",
                                         "threshold", "action", "message", "details"]
    # the verdict rules on hand-made numbers
    assert reward_integrity([0.1, float("nan")], 5.0, 10).verdict == "fail"
    assert reward_integrity([-0.5] * 8 + [0.2, 0.4], 5.0, 10).verdict == "warn"
    assert reward_integrity([0.1, 0.2, 0.3], 1.5, 10).verdict == "fail"
    assert reward_integrity([0.1, 0.2, 0.3, 0.4], 5.0, 10).verdict == "ok"
    assert gradient_flow({"actor.0": 0.1, "encoder.intent_net.0": 0.0}).verdict == "fail"
    assert gradient_flow({"actor.0": 0.1, "critic.0": 5e3}).verdict == "warn"
    assert gradient_flow({"actor.0": 0.1}).verdict == "ok"
    assert exploration_quality(0.4, 0.1).verdict == "fail"
    assert exploration_quality(2.4, 0.5).verdict == "ok"


def test_evaluate_on_the_heldout_split_and_a_file(ws, finished, tmp_path):
    from core.base.results import dumps
    from core.rl.evaluation import evaluate

    r = evaluate(ws, finished, repeats=2)
    assert r.episodes > 0 and r.repeats == 2
    assert r.policy.episodes == r.random_in_mask.episodes == 2 * r.episodes
    assert r.policy.passes == r.random_in_mask.passes == 2
    assert r.mask_violations == 0 and r.random_in_mask.mask_violations == 0
    assert set(r.logged) == {"expert", "noisy", "hacker"}
    assert r.best_logged is not None and r.best_logged.behaviour == max(r.logged, key=r.logged.__getitem__)
    assert r.best_logged.return_mean == r.logged[r.best_logged.behaviour]
    assert r.margin_over_random == pytest.approx(r.policy.return_mean - r.random_in_mask.return_mean)
    assert r.margin_over_random > 0.5
    # --json and the stored record keep the dict's keys and order
    stored = r.to_dict()
    assert list(stored) == ["run_id", "source", "episodes", "repeats", "checkpoint_update", "policy",
                            "random_in_mask", "logged", "best_logged", "paired", "beats_best_logged",
                            "margin_over_random", "mask_violations", "catalog_version", "catalog_coverage", "ope"]
    assert list(stored["policy"]) == ["return_mean", "return_std_between_passes", "success_rate",
                                      "off_support_rate", "mask_violations", "episodes", "steps", "passes"]
    assert stored["best_logged"] == {"behaviour": r.best_logged.behaviour, "return_mean": r.best_logged.return_mean}
    assert list(stored["paired"]["expert"]) == ["episodes", "logged", "policy", "policy_success_rate", "margin"]
    assert dumps(r) == dumps(stored)
    # paired: per behaviour, the policy from that behaviour's own held-out start states
    from core.rl.runs import open_run

    data = open_run(ws, finished, need_policy=False).data
    labels = [data.tables.behaviours[i] for i in data.heldout_episodes.tolist()]
    assert set(r.paired) == set(r.logged)
    for behaviour, pair in r.paired.items():
        assert pair.episodes == labels.count(behaviour)
        assert pair.logged == r.logged[behaviour]
        assert pair.margin == pytest.approx(pair.policy - pair.logged)
    best = r.paired[r.best_logged.behaviour]
    assert best.logged is not None and r.beats_best_logged == (best.policy >= best.logged)
    # the episodes of all behaviours together are the whole held-out set, run the same way
    assert sum(p.episodes for p in r.paired.values()) == r.episodes
    # a held-out file of the same tools: other episodes of the sample
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join([lines[0], *lines[N_EPISODES + 1:N_EPISODES + 41]]) + "\n", encoding="utf-8")
    f = evaluate(ws, finished, episodes=held, repeats=1)  # mapped onto the run's catalog, never refused
    assert f.episodes == 40 and f.mask_violations == 0
    assert f.catalog_version == r.catalog_version == data.tables.catalog.version


# --------------------------------------------------------------------------- CLI
#: The keys of a run in the ``--json`` output of ``rwb runs show|stop`` (``runs list`` adds ``last``), in order.
RUN_JSON_KEYS = ["id", "status", "dataset", "episodes_file", "template_name", "template_version", "template_hash",
                 "masks_source", "device", "config", "total_steps", "env_steps", "updates", "curriculum_level", "pid",
                 "host", "stop_requested", "created_by", "created_at", "started_at", "ended_at", "heartbeat_at",
                 "error", "final_metrics", "log_path", "process_alive", "interrupted", "display_status"]


def test_cli_train_runs_doctor_evaluate(ws_root, finished, monkeypatch):
    from core.cli import main, root

    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    monkeypatch.setenv("RWB_WORKSPACE", str(ws_root))
    cli = CliRunner()
    res = cli.invoke(root, ["train", "--template", "finance_risk", "--dataset", "finance", "--steps", "1024",
                            "--device", "cpu", "--set", "n_envs=32", "--set", "rollout_len=16",
                            "--set", "n_minibatches=2", "--set", 'encoder={"dim": 64}', "--set", "hidden=64",
                            "--set", "bc_epochs=2", "--set", "threads=1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(out) == ["run_id", "status", "metrics"]
    assert out["status"] == "finished" and out["metrics"]["env_steps"] == 1024
    run_id = out["run_id"]
    res = cli.invoke(root, ["runs", "list", "--json"])
    listed = json.loads(res.stdout)["runs"]
    assert run_id in [r["id"] for r in listed]
    assert list(listed[0]) == [*RUN_JSON_KEYS, "last"]
    assert list(listed[0]["last"]) == ["return_mean", "success_rate", "kl", "beta", "entropy", "curriculum_level",
                                       "env_steps_per_s", "mask_violations", "best_logged_return"]
    res = cli.invoke(root, ["runs", "show", run_id, "--json"])
    shown = json.loads(res.stdout)
    assert shown["run"]["status"] == "finished" and len(shown["metrics"]) == 2
    assert list(shown) == ["run", "metrics", "checkpoints"] and list(shown["run"]) == RUN_JSON_KEYS
    assert shown["checkpoints"] and all(list(c) == ["update_idx", "env_steps", "path", "at"]
                                        for c in shown["checkpoints"])
    res = cli.invoke(root, ["runs", "show", run_id])
    assert res.exit_code == 0 and "mask_violations" in res.stdout
    res = cli.invoke(root, ["doctor", finished, "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["steps"]) == 4
    res = cli.invoke(root, ["evaluate", finished, "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["policy"]["mask_violations"] == 0
    # user errors exit 2 with a message
    assert main(["runs", "show", "run-nope"]) == 2
    assert main(["train", "--dataset", "finance"]) == 2
    assert main(["runs", "stop", finished]) == ConflictError.exit_code
    assert main(["runs", "resume", finished]) == ConflictError.exit_code
