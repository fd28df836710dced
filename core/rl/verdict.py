"""The one verdict of a training run: is it learning, is it better than the logs, how sure.

:func:`judge` reads a run's training curves, its four-step diagnosis (:mod:`core.rl.doctor`) and
its held-out evaluation (:mod:`core.rl.evaluation`) together into one :class:`RunVerdict`; a
policy that does not beat the best logged behaviour is never an all-clear, whatever the four
steps say.  :func:`run_verdict` computes it for a run's latest checkpoint (tens of seconds) and
keeps it as ``artifacts/runs/<id>/verdicts/<update>.json``; :func:`stored_verdict` reads it back
at once and says when the run has a newer checkpoint than the one judged.

Details: docs/training.md (## The run's verdict).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from core.base.errors import ConflictError, InputError
from core.base.results import to_jsonable
from core.rl.doctor import LOW_ENTROPY, Diagnosis, DiagnosisCheck, Verdict, diagnose
from core.rl.runs import latest_checkpoint, run_dir, run_metrics

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace
    from core.rl.evaluation import EvaluationReport

#: Updates needed before the reward curve can show a trend.
MIN_UPDATES = 4
#: Held-out episodes of the best logged behaviour below which the comparison is unsure.
MIN_EPISODES = 30
#: Held-out episodes from which (with an agreeing off-policy check) the comparison is firm.
FIRM_EPISODES = 100
#: Losses that are only missing (None) in a recorded update when they were NaN or infinite.
LOSS_KEYS = ("value_loss", "policy_loss", "grad_norm")
#: The verdict in the pages' and the CLI's words.
OVERALL_WORDS: dict[Verdict, str] = {"ok": "all clear", "warn": "needs a look", "fail": "not ready"}
#: Where the verdicts of a run are kept, under its artifacts folder.
VERDICTS_DIR = "verdicts"

Answer = Literal["yes", "no", "unclear"]
Sureness = Literal["low", "medium", "high"]


@dataclass(frozen=True)
class VerdictLine:
    """One of the verdict's three questions: the short answer and the sentence that says it
    with its figures (``Better than the logs: no — 2.45 vs 2.67 for noisy …``)."""

    #: ``yes`` / ``no`` / ``unclear``; for how sure: ``low`` / ``medium`` / ``high``
    answer: str
    sentence: str


@dataclass(frozen=True)
class RunVerdict:
    """The single verdict of a run's checkpoint (:func:`judge`)."""

    run_id: str
    #: The update whose checkpoint was judged
    checkpoint_update: int | None
    #: When it was computed (ISO 8601 UTC)
    computed_at: str
    #: Is it learning? From the reward curve's trend, NaN losses and exploration
    learning: VerdictLine
    #: Does the policy beat the best logged behaviour on the same held-out requests?
    better_than_logs: VerdictLine
    #: How firm the comparison is: held-out episodes, the simulator's spread, the off-policy check
    how_sure: VerdictLine
    #: ``ok`` only when it learns, beats the logs, is checked firmly enough and passes the four steps
    overall: Verdict
    #: :data:`OVERALL_WORDS` of ``overall``
    plain_overall: str
    #: The verdict in one plain sentence
    headline: str
    #: What to do next, in words
    next_step: str
    #: The greedy policy's mean return from the best logged behaviour's held-out start states
    policy_return: float | None
    #: The logged behaviour with the highest held-out return (None without one)
    best_logged: str | None
    best_logged_return: float | None
    #: Held-out episodes of ``best_logged`` the comparison ran on
    compared_episodes: int
    #: Which episodes were evaluated on (None without an evaluation)
    evaluation_source: str | None
    #: The four-step diagnosis the verdict read (the supporting detail)
    diagnosis: Diagnosis | None

    def to_dict(self) -> dict[str, Any]:
        """The verdict as JSON values (:func:`core.base.results.to_jsonable`)."""
        return cast("dict[str, Any]", to_jsonable(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunVerdict":
        """The verdict :meth:`to_dict` wrote."""
        values = dict(data)
        for name in ("learning", "better_than_logs", "how_sure"):
            values[name] = VerdictLine(**values[name])
        if values.get("diagnosis") is not None:
            d = dict(values["diagnosis"])
            d["steps"] = tuple(DiagnosisCheck(**s) for s in d["steps"])
            values["diagnosis"] = Diagnosis(**d)
        return cls(**values)


@dataclass(frozen=True)
class StoredVerdict:
    """What :func:`stored_verdict` finds: the newest kept verdict of a run and whether it
    judges the run's newest checkpoint."""

    #: The newest kept verdict (None when none was computed yet)
    verdict: RunVerdict | None
    #: The update of the run's newest checkpoint (None without one)
    latest_update: int | None
    #: True when ``verdict`` judges an older checkpoint than the newest
    stale: bool
    #: Says so in words when stale (empty otherwise)
    note: str


def _num(x: float | None) -> str:
    """A figure for a sentence: 3 significant digits, no exponent, a dash for none."""
    if x is None or not math.isfinite(x):
        return "—"
    if x == 0:
        return "0"
    decimals = max(2 - math.floor(math.log10(abs(x))), 0)
    text = f"{x:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _var(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0


def _step(diagnosis: Diagnosis | None, number: int) -> DiagnosisCheck | None:
    return None if diagnosis is None else next((s for s in diagnosis.steps if s.step == number), None)


# --------------------------------------------------------------------------- the three questions
def _broken(history: Sequence[Mapping[str, Any]], diagnosis: Diagnosis | None) -> str | None:
    """Where training recorded NaN or infinite values, in words (None when nowhere): a loss of
    an update (stored as missing) or the step rewards of the diagnosis's rollout."""
    broken = [m["update"] for m in history if any(k in m and m[k] is None for k in LOSS_KEYS)]
    if broken:
        return f"{len(broken)} of {len(history)} updates recorded a NaN or infinite loss"
    rewards = _step(diagnosis, 1)
    if rewards is not None and rewards.details.get("non_finite"):
        return f"{rewards.details['non_finite']} step rewards are NaN or infinite"
    return None


def judge_learning(history: Sequence[Mapping[str, Any]], diagnosis: Diagnosis | None) -> VerdictLine:
    """Is it learning?  ``no`` when a loss went NaN or the rewards hold NaN, or when exploration
    collapsed (step 4 of the diagnosis fails); else from the trend of the average reward per
    episode: the mean of the last quarter of updates against the first quarter, ``yes`` when it
    rose by more than twice the windows' standard error (and 1% of its size), ``no`` when it fell
    as much, ``unclear`` when flat, before :data:`MIN_UPDATES` updates or before any policy update."""
    where = _broken(history, diagnosis)
    if where is not None:
        return VerdictLine("no", f"Learning: no — {where}, so training broke down.")
    exploration = _step(diagnosis, 4)
    entropy = exploration.value if exploration is not None else (history[-1].get("entropy_marginal")
                                                                 if history else None)
    if entropy is not None and math.isfinite(entropy) and entropy < LOW_ENTROPY:
        return VerdictLine("no", f"Learning: no — exploration collapsed: the actions taken have an entropy of "
                                 f"{_num(entropy)} nats (at least {LOW_ENTROPY:g} needed), the policy repeats itself.")
    returns = [float(m["return_mean"]) for m in history
               if m.get("return_mean") is not None and math.isfinite(m["return_mean"])]
    if len(returns) < MIN_UPDATES:
        return VerdictLine("unclear", f"Learning: unclear — only {len(returns)} update"
                                      f"{'' if len(returns) == 1 else 's'} recorded; a trend needs at least "
                                      f"{MIN_UPDATES}.")
    if not any(m.get("policy_trained") for m in history):
        return VerdictLine("unclear", "Learning: unclear — only the warm start (copying the logs) has run; "
                                      "no policy update yet.")
    k = max(2, len(returns) // 4)
    first, last = returns[:k], returns[-k:]
    gain = _mean(last) - _mean(first)
    noise = max(2 * math.sqrt((_var(first) + _var(last)) / k),
                0.01 * max(abs(_mean(first)), abs(_mean(last))))
    trend = (f"the average reward per episode went from {_num(_mean(first))} to {_num(_mean(last))} over "
             f"{len(returns)} updates")
    if gain > noise:
        return VerdictLine("yes", f"Learning: yes — {trend}.")
    if gain < -noise:
        return VerdictLine("no", f"Learning: no — {trend}: it is getting worse.")
    return VerdictLine("unclear", f"Learning: unclear — {trend}: flat, within the update-to-update noise.")


def judge_better(evaluation: EvaluationReport | None, why_missing: str | None = None) -> VerdictLine:
    """Better than the logs?  The greedy policy against the best logged behaviour from that
    behaviour's own held-out start states (the same requests), and every other logged
    behaviour it falls below; ``unclear`` without an evaluation or a logged behaviour."""
    if evaluation is None:
        return VerdictLine("unclear", "Better than the logs: unclear — "
                           + (f"the held-out evaluation could not run: {why_missing}" if why_missing
                              else "not checked against the logs yet") + ".")
    best = evaluation.best_logged
    pair = None if best is None else evaluation.paired.get(best.behaviour)
    if best is None or pair is None or pair.logged is None or not math.isfinite(pair.policy):
        return VerdictLine("unclear", "Better than the logs: unclear — the held-out episodes name no logged "
                                      "behaviour with a return to compare with.")
    same = f"on the same {pair.episodes} held-out request{'' if pair.episodes == 1 else 's'}"
    if pair.policy >= pair.logged:
        return VerdictLine("yes", f"Better than the logs: yes — {_num(pair.policy)} vs {_num(pair.logged)} for "
                                  f"{best.behaviour}, the best logged behaviour, {same}.")
    below = [f"{_num(p.policy)} vs {_num(p.logged)} for {name}" for name, p in sorted(evaluation.paired.items())
             if name != best.behaviour and p.logged is not None and p.policy < p.logged]
    return VerdictLine("no", f"Better than the logs: no — {_num(pair.policy)} vs {_num(pair.logged)} for "
                             f"{best.behaviour}, the best logged behaviour, {same}"
                             + (f"; also below {'; '.join(below)}" if below else "") + ".")


def judge_sureness(evaluation: EvaluationReport | None) -> VerdictLine:
    """How sure?  ``low`` below :data:`MIN_EPISODES` held-out episodes of the best logged
    behaviour, when the gap is within twice the simulator's pass-to-pass spread, or when the
    off-policy estimate on the logged episodes points the other way; ``high`` from
    :data:`FIRM_EPISODES` episodes with a reliable off-policy estimate that agrees;
    ``medium`` otherwise."""
    best = None if evaluation is None else evaluation.best_logged
    pair = None if best is None else evaluation.paired.get(best.behaviour)  # type: ignore[union-attr]
    if evaluation is None or best is None or pair is None or pair.margin is None:
        return VerdictLine("low", "How sure: low — there is no held-out comparison with the logs yet.")
    n, margin = pair.episodes, pair.margin
    spread = evaluation.policy.return_std_between_passes
    ope = evaluation.ope
    figures = f"{n} held-out episode{'' if n == 1 else 's'} of {best.behaviour}'s requests, {evaluation.repeats} " \
              f"pass{'' if evaluation.repeats == 1 else 'es'}"
    agrees = None
    if ope.reliable and ope.policy_return is not None and ope.logged_return is not None:
        agrees = (ope.policy_return >= ope.logged_return) == (margin >= 0)
    check = ("the off-policy check on the logged episodes agrees" if agrees else
             "the off-policy check on the logged episodes points the other way" if agrees is False else
             f"the off-policy check on the logged episodes is not reliable here ({ope.verdict})")
    if n < MIN_EPISODES:
        return VerdictLine("low", f"How sure: low — only {figures} (at least {MIN_EPISODES} needed); {check}.")
    if abs(margin) <= 2 * spread:
        return VerdictLine("low", f"How sure: low — the gap ({_num(margin)}) is within the simulator's "
                                  f"pass-to-pass spread ({_num(spread)}); {figures}; {check}.")
    if agrees is False:
        return VerdictLine("low", f"How sure: low — {check}; {figures}.")
    if n >= FIRM_EPISODES and agrees:
        return VerdictLine("high", f"How sure: high — {figures}; {check}.")
    return VerdictLine("medium", f"How sure: medium — {figures}; {check}.")


# --------------------------------------------------------------------------- the verdict
def judge(run_id: str, history: Sequence[Mapping[str, Any]], diagnosis: Diagnosis | None,
          evaluation: EvaluationReport | None, *, why_missing: str | None = None) -> RunVerdict:
    """The verdict from a run's recorded updates (``history``, :func:`core.rl.runs.run_metrics`),
    its diagnosis and its held-out evaluation (either may be None: it then says what it lacks).

    Overall ``fail`` when the policy does not beat the best logged behaviour, when a step of the
    diagnosis fails or when training broke (NaN); ``ok`` only when it learns, beats the logs,
    passes all four steps and the comparison is not unsure; ``warn`` otherwise."""
    learning = judge_learning(history, diagnosis)
    better = judge_better(evaluation, why_missing)
    sure = judge_sureness(evaluation)
    best = None if evaluation is None else evaluation.best_logged
    pair = None if best is None else evaluation.paired.get(best.behaviour)  # type: ignore[union-attr]
    failing = None if diagnosis is None else next((s for s in diagnosis.steps if s.verdict == "fail"), None)
    warning = None if diagnosis is None else next((s for s in diagnosis.steps if s.verdict == "warn"), None)
    nan = _broken(history, diagnosis) is not None

    overall: Verdict
    if better.answer == "no" or failing is not None or nan:
        overall = "fail"
    elif (better.answer == "yes" and learning.answer == "yes" and sure.answer != "low" and warning is None
          and diagnosis is not None):
        overall = "ok"
    else:
        overall = "warn"

    versus = "" if pair is None or best is None else \
        f"{_num(pair.policy)} vs {_num(pair.logged)} for {best.behaviour}"
    if better.answer == "no" and pair is not None and best is not None:
        headline = (f"Not better than the logs: the policy earns {_num(pair.policy)} per episode where "
                    f"{best.behaviour} earned {_num(pair.logged)} on the same held-out requests.")
    elif failing is not None:
        headline = f"Check {failing.step} of the diagnosis ({failing.name}) fails: {failing.message}."
    elif nan:
        headline = "Training broke down: it recorded NaN or infinite values."
    elif better.answer == "unclear":
        headline = "Not known yet whether it beats the logs: " + better.sentence.split(" — ", 1)[1]
    elif overall == "ok":
        headline = f"Better than the logs ({versus}) and still learning."
    else:
        caveats = [c for c, bad in (("the comparison is unsure", sure.answer == "low"),
                                    ("its learning is unclear", learning.answer == "unclear"),
                                    ("its reward is falling", learning.answer == "no"),
                                    (f"check {warning.step if warning else 0} of the diagnosis needs a look",
                                     warning is not None)) if bad]
        headline = f"Better than the logs ({versus}), but {' and '.join(caveats) or 'not fully checked'}."

    if failing is not None:
        next_step = f"Fix check {failing.step} ({failing.name}) first: {failing.action}"
    elif nan:
        next_step = ("Find the reward component that gives NaN or infinite values on the Reward Pyramid page, "
                     "or lower the learning rate, then train a new run.")
    elif better.answer == "no":
        next_step = ("It is still improving: resume it for more steps, then check again." if learning.answer == "yes"
                     else f"Check that the reward template pays for what {best.behaviour if best else 'the logs'} "
                          "does (Reward Pyramid page: does a higher reward go with a better outcome?), then "
                          "train a new run with more steps.")
    elif better.answer == "unclear":
        next_step = ("Check it against the logs." if evaluation is None and why_missing is None
                     else "Train on a dataset whose episodes name their behaviour (expert, agent…), so that the "
                          "policy can be compared with the logs.")
    elif warning is not None:
        next_step = f"Look at check {warning.step} ({warning.name}): {warning.action}"
    elif sure.answer == "low":
        next_step = ("Evaluate it on more held-out episodes (a larger dataset on the Diagnostics page) before "
                     "relying on it.")
    elif learning.answer != "yes":
        next_step = "It beats the logs; resume it for more steps to see whether it improves further."
    else:
        next_step = "Hand it over: export it as a bundle and register it for approval."
    return RunVerdict(
        run_id=run_id,
        checkpoint_update=(diagnosis.checkpoint_update if diagnosis is not None
                           else None if evaluation is None else evaluation.checkpoint_update),
        computed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        learning=learning, better_than_logs=better, how_sure=sure, overall=overall,
        plain_overall=OVERALL_WORDS[overall], headline=headline, next_step=next_step,
        policy_return=None if pair is None else pair.policy,
        best_logged=None if best is None else best.behaviour,
        best_logged_return=None if pair is None else pair.logged,
        compared_episodes=0 if pair is None else pair.episodes,
        evaluation_source=None if evaluation is None else evaluation.source, diagnosis=diagnosis)


def _verdicts(ws: "Workspace", run_id: str) -> Path:
    return ws.artifacts / "runs" / run_id / VERDICTS_DIR


def _read(path: Path) -> RunVerdict | None:
    # a kept verdict that cannot be read (cut short by a crash) is as if never computed:
    # the next check computes it again and writes it whole
    try:
        return RunVerdict.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _keep(ws: "Workspace", verdict: RunVerdict) -> None:
    """Write the verdict whole (a temporary file renamed over the old one)."""
    folder = run_dir(ws, verdict.run_id) / VERDICTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{verdict.checkpoint_update or 0:06d}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(verdict.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def run_verdict(ws: "Workspace", run_id: str, *, evaluation: EvaluationReport | None = None,
                diagnosis: Diagnosis | None = None, refresh: bool = False) -> RunVerdict:
    """The verdict of ``run_id``'s latest checkpoint: the kept one when it was computed before
    (unless ``refresh``), else computed now from the diagnosis and the held-out evaluation
    (given, or run here: tens of seconds) and kept for next time.

    A given ``evaluation`` must be on the run's own held-out split and of the same checkpoint
    as the diagnosis.  When the evaluation cannot run (no held-out episodes), the verdict says
    so: better than the logs is then ``unclear``.  A derived record, like a cache: any reader
    may compute it, so it takes no acting user."""
    ckpt = latest_checkpoint(ws, run_id)
    if ckpt is None:
        raise ConflictError(f"run {run_id} has no checkpoint yet: there is no policy to judge; wait for its "
                            "first checkpoint or resume it")
    if evaluation is None and diagnosis is None and not refresh:
        kept = _read(_verdicts(ws, run_id) / f"{ckpt.update_idx:06d}.json")
        if kept is not None:
            return kept
    if evaluation is not None and not evaluation.source.startswith("held-out split"):
        raise InputError(f"the verdict compares on the run's own held-out split, not on {evaluation.source}",
                         field="evaluation")
    from core.rl.evaluation import evaluate  # deferred: loads torch, which the pages reading verdicts do not need

    diagnosis = diagnosis or diagnose(ws, run_id)
    why_missing = None
    if evaluation is None:
        try:
            evaluation = evaluate(ws, run_id)
        except (InputError, ConflictError) as exc:
            why_missing = str(exc)
    if evaluation is not None and evaluation.checkpoint_update != diagnosis.checkpoint_update:
        raise InputError(f"the diagnosis is of update {diagnosis.checkpoint_update} and the evaluation of update "
                         f"{evaluation.checkpoint_update}: judge one checkpoint", field="evaluation")
    judged = diagnosis.checkpoint_update
    history = [m for m in run_metrics(ws, run_id) if judged is None or m["update"] <= judged]
    verdict = judge(run_id, history, diagnosis, evaluation, why_missing=why_missing)
    _keep(ws, verdict)
    return verdict


def stored_verdict(ws: "Workspace", run_id: str) -> StoredVerdict:
    """The newest verdict kept for ``run_id`` (instant: nothing is computed), and whether the
    run has a newer checkpoint than the one it judges (then ``note`` says so)."""
    ckpt = latest_checkpoint(ws, run_id)
    latest = None if ckpt is None else ckpt.update_idx
    folder = _verdicts(ws, run_id)
    kept = sorted(folder.glob("*.json")) if folder.is_dir() else []
    verdict = next((v for v in (_read(p) for p in reversed(kept)) if v is not None), None)
    if verdict is None:
        return StoredVerdict(verdict=None, latest_update=latest, stale=False, note="")
    stale = latest is not None and verdict.checkpoint_update != latest
    note = (f"This verdict judges the checkpoint of update {verdict.checkpoint_update}; the run has a newer one "
            f"(update {latest}): check again to judge it." if stale else "")
    return StoredVerdict(verdict=verdict, latest_update=latest, stale=stale, note=note)


__all__ = ["FIRM_EPISODES", "MIN_EPISODES", "MIN_UPDATES", "OVERALL_WORDS", "RunVerdict", "StoredVerdict",
           "VerdictLine", "judge", "judge_better", "judge_learning", "judge_sureness", "run_verdict",
           "stored_verdict"]
