"""The one verdict of a run (core.rl.verdict): the rules on hand-made diagnoses and evaluations
(a losing policy is never an all-clear, a winning one says so, a missing evaluation leaves it
unclear), then on the suite's tiny trained run: computed once, kept per checkpoint, said to be
stale when a newer checkpoint comes, and ``rwb runs verdict``."""

from __future__ import annotations

import dataclasses
import json
import shutil
import types

import pytest
from typer.testing import CliRunner

from _bundle_fixtures import hash_embedder, trained_copy
from core.base.errors import ConflictError, InputError
from core.rl import runs, verdict
from core.rl.doctor import Diagnosis, DiagnosisCheck
from core.rl.evaluation import BestLogged, EvaluationReport, PairedReturns, PooledReturns
from core.rl.ope import OffPolicyUnavailable


# --------------------------------------------------------------------------- hand-made inputs
def _check(step: int, v: str = "ok", value: float | None = 2.0, **details) -> DiagnosisCheck:
    return DiagnosisCheck(step=step, name=["reward integrity", "state-encoding fidelity", "gradient flow",
                                           "exploration quality"][step - 1], verdict=v, plain_verdict=v,
                          value=value, figure="f", unit="u", threshold="t", action=f"fix step {step}",
                          message=f"step {step} said {v}", details=details)


def _diagnosis(*verdicts: str, entropy: float = 2.5) -> Diagnosis:
    vs = verdicts or ("ok",) * 4
    steps = tuple(_check(i + 1, v, entropy if i == 3 else 0.1, non_finite=0) for i, v in enumerate(vs))
    worst = max(vs, key=["ok", "warn", "fail"].index)
    return Diagnosis(run_id="r", status="finished", updates=8, checkpoint_update=8, policy_allowed_actions=5.0,
                     steps=steps, verdict=worst, plain_verdict=worst, next_action="n")  # type: ignore[arg-type]


def _pooled(mean: float, spread: float = 0.02, episodes: int = 120) -> PooledReturns:
    return PooledReturns(return_mean=mean, return_std_between_passes=spread, success_rate=0.8,
                         off_support_rate=0.1, mask_violations=0, episodes=episodes, steps=10 * episodes, passes=3)


def _reliable(policy: float, logged: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(reliable=True, policy_return=policy, logged_return=logged, verdict="reliable")


UNRELIABLE = OffPolicyUnavailable(method="m", policy_success=None, logged_success=None, policy_success_ci90=None,
                                  policy_return=None, logged_return=None, support=None,
                                  effective_sample_size=None, episodes=12, tasks=None, reliable=False,
                                  verdict="thin support", note="n")


def _evaluation(policy: dict[str, float], logged: dict[str, float], *, episodes: int = 120,
                spread: float = 0.02, ope=UNRELIABLE) -> EvaluationReport:
    best = max(logged, key=logged.__getitem__)
    paired = {b: PairedReturns(episodes=episodes, logged=logged[b], policy=policy[b], policy_success_rate=0.8,
                               margin=policy[b] - logged[b]) for b in logged}
    return EvaluationReport(
        run_id="r", source="held-out split of dataset finance (20%, seed 0)", episodes=episodes * len(logged),
        repeats=3, checkpoint_update=8, policy=_pooled(sum(policy.values()) / len(policy), spread),
        random_in_mask=_pooled(-2.0), logged=logged, best_logged=BestLogged(best, logged[best]), paired=paired,
        beats_best_logged=policy[best] >= logged[best], margin_over_random=4.0, mask_violations=0,
        catalog_version="c", catalog_coverage={}, ope=ope)


def _history(returns: list[float], *, trained: bool = True, **extra) -> list[dict]:
    return [{"update": i + 1, "env_steps": 512 * (i + 1), "return_mean": r, "policy_trained": trained,
             "value_loss": 0.3, "policy_loss": 0.01, "grad_norm": 0.5, "entropy_marginal": 3.0, **extra}
            for i, r in enumerate(returns)]


RISING = [1.0, 1.1, 1.3, 1.5, 1.8, 2.0, 2.3, 2.5]


# --------------------------------------------------------------------------- the rules
def test_a_losing_policy_is_never_an_all_clear_even_when_all_four_steps_pass():
    ev = _evaluation({"expert": 2.45, "noisy": 2.40}, {"expert": 3.14, "noisy": 2.67})
    v = verdict.judge("r", _history(RISING), _diagnosis(), ev)
    assert v.diagnosis is not None and v.diagnosis.verdict == "ok"          # the four steps pass…
    assert v.overall == "fail" and v.plain_overall == "not ready"           # …and still not an all-clear
    assert v.better_than_logs.answer == "no"
    assert v.better_than_logs.sentence == ("Better than the logs: no — 2.45 vs 3.14 for expert, the best logged "
                                           "behaviour, on the same 120 held-out requests; also below 2.4 vs 2.67 "
                                           "for noisy.")
    assert v.headline.startswith("Not better than the logs: the policy earns 2.45 per episode where expert "
                                 "earned 3.14")
    assert v.learning.answer == "yes" and "resume it for more steps" in v.next_step
    assert "Nothing to fix" not in v.headline + v.next_step
    assert (v.policy_return, v.best_logged, v.best_logged_return, v.compared_episodes) == (2.45, "expert", 3.14, 120)


def test_a_winning_policy_says_so():
    ev = _evaluation({"expert": 3.4, "noisy": 3.3}, {"expert": 3.14, "noisy": 2.67}, ope=_reliable(3.3, 2.9))
    v = verdict.judge("r", _history(RISING), _diagnosis(), ev)
    assert (v.overall, v.plain_overall) == ("ok", "all clear")
    assert v.better_than_logs.answer == "yes" and v.better_than_logs.sentence.startswith(
        "Better than the logs: yes — 3.4 vs 3.14 for expert")
    assert v.how_sure.answer == "high" and "off-policy check on the logged episodes agrees" in v.how_sure.sentence
    assert v.learning.sentence == "Learning: yes — the average reward per episode went from 1.05 to 2.4 over 8 updates."
    assert v.headline == "Better than the logs (3.4 vs 3.14 for expert) and still learning."
    assert v.next_step.startswith("Hand it over")


def test_without_an_evaluation_it_is_unclear_and_not_an_all_clear():
    v = verdict.judge("r", _history(RISING), _diagnosis(), None)
    assert v.better_than_logs.answer == "unclear" and v.how_sure.answer == "low"
    assert v.overall == "warn" and v.next_step == "Check it against the logs."
    assert v.headline == "Not known yet whether it beats the logs: not checked against the logs yet."
    why = verdict.judge("r", _history(RISING), _diagnosis(), None, why_missing="the held-out split is empty")
    assert "could not run: the held-out split is empty" in why.better_than_logs.sentence


def test_a_failing_check_fails_the_verdict_and_comes_first():
    ev = _evaluation({"expert": 3.4}, {"expert": 3.14})
    v = verdict.judge("r", _history(RISING), _diagnosis("ok", "ok", "fail", "ok"), ev)
    assert v.overall == "fail" and v.better_than_logs.answer == "yes"
    assert v.headline.startswith("Check 3 of the diagnosis (gradient flow) fails")
    assert v.next_step == "Fix check 3 (gradient flow) first: fix step 3"
    warned = verdict.judge("r", _history(RISING), _diagnosis("ok", "warn", "ok", "ok"), ev)
    assert warned.overall == "warn" and "check 2 of the diagnosis needs a look" in warned.headline


@pytest.mark.parametrize("history, diagnosis, answer, words", [
    (_history(RISING), _diagnosis(), "yes", "went from 1.05 to 2.4 over 8 updates"),
    (_history(RISING[::-1]), _diagnosis(), "no", "it is getting worse"),
    (_history([2.0, 2.01, 1.99, 2.0, 2.02, 1.98, 2.0, 2.01]), _diagnosis(), "unclear", "flat"),
    (_history([1.0, 1.5, 2.0]), _diagnosis(), "unclear", "only 3 updates recorded"),
    (_history(RISING, trained=False), _diagnosis(), "unclear", "only the warm start"),
    (_history(RISING), _diagnosis(entropy=0.4), "no", "exploration collapsed"),
    (_history(RISING, value_loss=None), _diagnosis(), "no", "8 of 8 updates recorded a NaN or infinite loss"),
])
def test_is_it_learning(history, diagnosis, answer, words):
    line = verdict.judge_learning(history, diagnosis)
    assert line.answer == answer and words in line.sentence and line.sentence.startswith("Learning: ")


def test_broken_training_fails_the_verdict():
    ev = _evaluation({"expert": 3.4}, {"expert": 3.14})
    v = verdict.judge("r", _history(RISING, policy_loss=None), _diagnosis(), ev)
    assert v.overall == "fail" and v.headline.startswith("Training broke down")


@pytest.mark.parametrize("kwargs, answer, words", [
    ({"episodes": 12}, "low", "only 12 held-out episodes of expert's requests, 3 passes (at least 30 needed)"),
    ({"spread": 0.2}, "low", "within the simulator's pass-to-pass spread (0.2)"),
    ({"ope": _reliable(2.0, 2.9)}, "low", "points the other way"),
    ({"episodes": 60}, "medium", "is not reliable here (thin support)"),
    ({"episodes": 60, "ope": _reliable(3.3, 2.9)}, "medium", "agrees"),
    ({"ope": _reliable(3.3, 2.9)}, "high", "120 held-out episodes"),
])
def test_how_sure(kwargs, answer, words):
    line = verdict.judge_sureness(_evaluation({"expert": 3.4}, {"expert": 3.14}, **kwargs))
    assert line.answer == answer and words in line.sentence and line.sentence.startswith(f"How sure: {answer} — ")


def test_the_verdict_survives_json():
    v = verdict.judge("r", _history(RISING), _diagnosis(), _evaluation({"expert": 2.45}, {"expert": 3.14}))
    assert verdict.RunVerdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v


# --------------------------------------------------------------------------- on a trained run
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A copy of the suite's tiny trained run (two warm-start updates: far below the expert)."""
    with pytest.MonkeyPatch.context() as mp:
        hash_embedder(mp)
        yield trained_copy(tmp_path_factory)


@pytest.fixture
def ws(trained, monkeypatch):
    hash_embedder(monkeypatch)
    w = trained.workspace()
    yield w
    w.close()


def test_run_verdict_is_kept_per_checkpoint_and_said_stale_after_a_newer_one(ws, trained, monkeypatch):
    run_id = trained.run_id
    assert verdict.stored_verdict(ws, run_id).verdict is None
    v = verdict.run_verdict(ws, run_id)
    ckpt = runs.latest_checkpoint(ws, run_id)
    assert v.checkpoint_update == ckpt.update_idx and v.diagnosis is not None
    # the tiny run is a losing one: the verdict says so whatever its four checks say
    assert v.better_than_logs.answer == "no" and v.overall == "fail"
    assert v.headline.startswith("Not better than the logs")
    kept = runs.run_dir(ws, run_id) / "verdicts" / f"{ckpt.update_idx:06d}.json"
    assert kept.is_file()
    stored = verdict.stored_verdict(ws, run_id)
    assert stored.verdict == v and not stored.stale and stored.note == ""

    # asked again: the kept one, nothing computed
    def no(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(verdict, "diagnose", no)
    monkeypatch.setattr("core.rl.evaluation.evaluate", no)
    assert verdict.run_verdict(ws, run_id) == v
    monkeypatch.undo()
    hash_embedder(monkeypatch)

    # a newer checkpoint: the kept verdict is said to judge an older one
    newer = ckpt.update_idx + 1
    folder = runs.run_dir(ws, run_id) / "checkpoints" / f"{newer:06d}"
    shutil.copytree(ckpt.path, folder)
    runs.record_checkpoint(ws, run_id, newer, ckpt.env_steps, folder)
    stale = verdict.stored_verdict(ws, run_id)
    assert stale.stale and stale.verdict == v and stale.latest_update == newer
    assert stale.note == (f"This verdict judges the checkpoint of update {ckpt.update_idx}; the run has a newer "
                          f"one (update {newer}): check again to judge it.")
    fresh = verdict.run_verdict(ws, run_id)            # not kept for this checkpoint: computed
    assert fresh.checkpoint_update == newer and not verdict.stored_verdict(ws, run_id).stale


def test_run_verdict_refusals(ws, trained):
    from core.rl.ppo import PPOConfig

    elsewhere = dataclasses.replace(_evaluation({"e": 1.0}, {"e": 2.0}), source="dataset other")
    with pytest.raises(InputError, match="own held-out split"):
        verdict.run_verdict(ws, trained.run_id, evaluation=elsewhere)
    fresh = runs.create_run(ws, trained.actor("ana"), template=runs.run_template(ws, trained.run_id),
                            config=PPOConfig(), dataset="finance")
    with pytest.raises(ConflictError, match="no checkpoint yet"):
        verdict.run_verdict(ws, fresh)
    assert verdict.stored_verdict(ws, fresh) == verdict.StoredVerdict(verdict=None, latest_update=None, stale=False,
                                                                      note="")


def test_cli_runs_verdict(trained, monkeypatch):
    from core.cli import root

    hash_embedder(monkeypatch)
    monkeypatch.setenv("RWB_WORKSPACE", str(trained.root))
    cli = CliRunner()
    res = cli.invoke(root, ["runs", "verdict", trained.run_id, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert list(out)[:10] == ["run_id", "checkpoint_update", "computed_at", "learning", "better_than_logs",
                              "how_sure", "overall", "plain_overall", "headline", "next_step"]
    res = cli.invoke(root, ["runs", "verdict", trained.run_id])
    assert res.exit_code == 0, res.output
    assert "Better than the logs: no — " in res.stdout and res.stdout.startswith(f"{trained.run_id} (checkpoint")
