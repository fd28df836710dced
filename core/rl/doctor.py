"""The four-step diagnosis of a training run (docs/design.md §8, ``rwb doctor RUN``).

:func:`diagnose` checks, in S000's order, reward integrity (:func:`reward_integrity`),
state-encoding fidelity, gradient flow (:func:`gradient_flow`) and exploration quality
(:func:`exploration_quality`), each with a verdict (``ok``, ``warn`` or ``fail``) and the number
behind it, against the thresholds :data:`MIN_FLOOD_SHARE`, :data:`DEAD_GRAD`,
:data:`EXPLODING_GRAD` and :data:`LOW_ENTROPY`.

Details: docs/training.md (## The doctor's four steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from core.rl.runs import open_run, run_metrics

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from core.records.store import Workspace

#: Share of steps at the minimum reward above which rewards "flood" the floor.
MIN_FLOOD_SHARE = 0.3
#: Mean allowed actions per state at or below which the masks are too strict.
MIN_ALLOWED_ACTIONS = 2.0
#: A layer with a gradient norm below this does not learn.
DEAD_GRAD = 1e-7
#: A layer with a gradient norm above this explodes.
EXPLODING_GRAD = 1e3
#: Entropy (nats) below which exploration is too narrow.
LOW_ENTROPY = 1.0
#: Steps of recorded states the fidelity check encodes at most.
FIDELITY_SAMPLE = 3000


#: A step's verdict, and the diagnosis's (the worst step's).
Verdict = Literal["ok", "warn", "fail"]

#: The plain word for each verdict, as the pages and the CLI say it.
VERDICT_WORDS: dict[Verdict, str] = {"ok": "passes", "warn": "needs a look", "fail": "fails"}


@dataclass(frozen=True)
class DiagnosisCheck:
    """One of the doctor's four steps: its verdict, the figure behind it and what to do next."""

    #: 1 reward integrity, 2 state-encoding fidelity, 3 gradient flow, 4 exploration quality
    step: int
    name: str
    verdict: Verdict
    #: The verdict as the pages and the CLI say it (:data:`VERDICT_WORDS`)
    plain_verdict: str
    #: The figure judged (a count for counts; None when there was nothing to measure)
    value: float | None
    #: What ``value`` measures, in words
    figure: str
    #: ``value``'s unit; ``"share"`` is a fraction shown as a percentage
    unit: str
    #: What ``value`` must be to pass, in words
    threshold: str
    #: What to do next, in words
    action: str
    #: What was found, in one sentence
    message: str
    #: The numbers behind the verdict, by name (the step's own)
    details: dict[str, Any]


@dataclass(frozen=True)
class Diagnosis:
    """The four-step diagnosis of a run (:func:`diagnose`)."""

    run_id: str
    #: The run's status as the run list shows it
    status: str
    #: Updates the run has recorded
    updates: int
    #: The update whose checkpoint was diagnosed (None without a checkpoint)
    checkpoint_update: int | None
    #: Mean actions per state the policy gave any probability in the rollout (NaN without one)
    policy_allowed_actions: float
    #: The four steps, in order
    steps: tuple[DiagnosisCheck, ...]
    #: The worst step's verdict
    verdict: Verdict
    plain_verdict: str
    #: The action of the first failing step, else of the first warning (:func:`_next_action`)
    next_action: str


def _step(number: int, name: str, verdict: Verdict, value: float | None, message: str, *, figure: str,
          unit: str, threshold: str, action: str, **details: Any) -> DiagnosisCheck:
    """One step's result: ``value`` is the figure named ``figure`` in ``unit`` (``"share"`` is a
    fraction shown as a percentage), judged against ``threshold``; ``action`` is what to do next."""
    return DiagnosisCheck(step=number, name=name, verdict=verdict, plain_verdict=VERDICT_WORDS[verdict],
                          value=value, figure=figure, unit=unit, threshold=threshold, action=action,
                          message=message, details=details)


_AT_MIN = {"figure": "steps at the minimum reward", "unit": "share",
           "threshold": f"at most {MIN_FLOOD_SHARE:.0%} of steps"}


def reward_integrity(rewards: np.ndarray, allowed: float, n_actions: int) -> DiagnosisCheck:
    """Step 1 on the rewards ``rewards`` met in a rollout and the mean allowed actions."""
    r = np.asarray(rewards, dtype=np.float64)
    n = int(r.size)
    bad = int((~np.isfinite(r)).sum())
    if n == 0:
        return _step(1, "reward integrity", "fail", None, "the rollout produced no rewards to check",
                     figure="step rewards checked", unit="steps", threshold="at least 1",
                     action="Check that the run's dataset has training episodes with steps, then diagnose again.")
    finite = r[np.isfinite(r)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (float("nan"), float("nan"))
    at_min = float(np.isclose(finite, lo, rtol=0, atol=1e-6).mean()) if finite.size else 0.0
    details: dict[str, Any] = {"steps": n, "non_finite": bad, "min": lo, "max": hi,
                               "mean": float(finite.mean()) if finite.size else None,
                               "share_at_min": at_min, "mean_allowed_actions": allowed, "n_actions": n_actions}
    if bad:
        return _step(1, "reward integrity", "fail", bad, f"{bad} of {n} step rewards are NaN or infinite — check the "
                     "reward template's components", figure="NaN or infinite step rewards", unit="steps",
                     threshold="must be 0",
                     action="Open the run's template on the Reward Pyramid page, find the component that gives NaN "
                            "or infinite values (a division or log on a missing field), fix it, and retrain.",
                     **details)
    if allowed <= MIN_ALLOWED_ACTIONS:
        return _step(1, "reward integrity", "fail", allowed,
                     f"the masks leave {allowed:.1f} of {n_actions} actions per state on average — masks too strict",
                     figure="allowed actions per state (mean)", unit="actions",
                     threshold=f"more than {MIN_ALLOWED_ACTIONS:g}",
                     action="Loosen the run's action masks so that more than "
                            f"{MIN_ALLOWED_ACTIONS:g} actions stay allowed per state, then retrain.", **details)
    if at_min > MIN_FLOOD_SHARE and hi > lo:
        return _step(1, "reward integrity", "warn", at_min,
                     f"{at_min:.0%} of steps earn the minimum reward {lo:.3f} — a flood of the floor: masks too "
                     f"strict or the policy stuck off-support ({allowed:.1f} of {n_actions} actions allowed on "
                     "average)", **_AT_MIN,
                     action=f"Look at which component gives {lo:.3f} on the Reward Pyramid page: lower an "
                            "off-support penalty or loosen the masks, then retrain.", **details)
    return _step(1, "reward integrity", "ok", at_min,
                 f"rewards are finite, from {lo:.3g} to {hi:.3g}; {at_min:.0%} of steps at the minimum", **_AT_MIN,
                 action="Nothing to fix in this check.", **details)


_GRAD_RANGE = (f"above {DEAD_GRAD:.7f} (a layer below it does not learn) and below {EXPLODING_GRAD:,.0f} "
               "(above it, updates blow up)")


def gradient_flow(grad_norms: dict[str, float] | None) -> DiagnosisCheck:
    """Step 3 on the per-layer gradient norms of one update."""
    if not grad_norms:
        return _step(3, "gradient flow", "warn", None, "no policy update with gradient norms recorded yet",
                     figure="smallest layer gradient norm", unit="L2 norm", threshold=_GRAD_RANGE,
                     action="Train the run past its warm start (at least one policy update), then diagnose again.")
    dead = sorted(k for k, v in grad_norms.items() if v is None or not math.isfinite(v) or v < DEAD_GRAD)
    exploding = sorted(k for k, v in grad_norms.items() if v is not None and math.isfinite(v) and v > EXPLODING_GRAD)
    finite = [v for v in grad_norms.values() if v is not None and math.isfinite(v)]
    smallest = min(finite) if finite else None
    details: dict[str, Any] = {"layers": len(grad_norms), "dead": dead, "exploding": exploding,
                               "min": smallest, "max": max(finite) if finite else None, "norms": grad_norms}
    if dead:
        return _step(3, "gradient flow", "fail", len(dead),
                     f"{len(dead)} of {len(grad_norms)} layers have a gradient norm ≈ 0: {', '.join(dead[:6])}"
                     + (" …" if len(dead) > 6 else ""), figure="layers without gradient", unit="layers",
                     threshold=f"must be 0 (a norm below {DEAD_GRAD:g} counts)",
                     action="Check that these layers are used in the forward pass and not frozen (e.g. an intent "
                            "encoder fed empty queries), then retrain.", **details)
    if exploding:
        return _step(3, "gradient flow", "warn", len(exploding),
                     f"{len(exploding)} layers have gradient norms above {EXPLODING_GRAD:g}: {', '.join(exploding[:6])}",
                     figure="layers with exploding gradient", unit="layers",
                     threshold=f"must be 0 (a norm above {EXPLODING_GRAD:g} counts)",
                     action="Lower the learning rate or the reward scale (large reward weights), then retrain.",
                     **details)
    return _step(3, "gradient flow", "ok", smallest,
                 f"all {len(grad_norms)} layers receive gradient (smallest norm {smallest:.3g})",
                 figure="smallest layer gradient norm", unit="L2 norm", threshold=_GRAD_RANGE,
                 action="Nothing to fix in this check.", **details)


_ENTROPY = {"figure": "entropy of the actions taken", "unit": "nats",
            "threshold": f"at least {LOW_ENTROPY:g} nat"}


def exploration_quality(entropy: float | None, per_state: float | None) -> DiagnosisCheck:
    """Step 4 on the entropy of the policy's action distribution over visited states."""
    if entropy is None or not math.isfinite(entropy):
        return _step(4, "exploration quality", "warn", None, "no action distribution measured yet", **_ENTROPY,
                     action="Train the run for at least one update so that it has a policy, then diagnose again.")
    details: dict[str, Any] = {"entropy": entropy, "mean_state_entropy": per_state, "low_entropy": LOW_ENTROPY}
    if entropy < LOW_ENTROPY:
        return _step(4, "exploration quality", "fail", entropy,
                     f"the policy's actions have an entropy of {entropy:.2f} nats (< {LOW_ENTROPY}): exploration "
                     "is too narrow — check the masks and the entropy bonus", **_ENTROPY,
                     action="Raise the entropy bonus (ent_coef) or loosen the masks, then retrain.", **details)
    return _step(4, "exploration quality", "ok", entropy,
                 f"the policy's actions have an entropy of {entropy:.2f} nats (≥ {LOW_ENTROPY})"
                 + ("" if per_state is None else f"; {per_state:.2f} nats per state on average"), **_ENTROPY,
                 action="Nothing to fix in this check.", **details)


def diagnose(ws: "Workspace", run_id: str, *, episodes: int = 512, seed: int = 0) -> Diagnosis:
    """The four-step diagnosis of ``run_id`` (docs/training.md, ## The doctor's four steps).

    Steps 1 and 4 roll the run's latest policy out in its simulator (actions sampled as in
    training, ``episodes`` episodes from its training split); step 2 encodes recorded
    states with its trained encoder; step 3 reads the last policy update's gradient norms.
    Returns a :class:`Diagnosis` whose overall verdict is the worst step's and whose next
    action is the first failing (else warning) step's; each step (:class:`DiagnosisCheck`)
    names its figure, unit and threshold and says what to do."""
    import torch  # deferred: the pages read this module's records without loading torch

    from core.rl.rollouts import episode_stats  # deferred: loads gymnasium
    from core.state.statemap import (  # deferred: loads pandas
        GOOD_SILHOUETTE_MARGIN, POOR_SILHOUETTE_MARGIN, state_fidelity)

    ctx = open_run(ws, run_id, device="cpu")
    tables, agent = ctx.data.tables, ctx.agent
    steps: list[DiagnosisCheck] = []

    # 1 + 4: a rollout of the policy as it trained (sampled actions) on training episodes
    rollout = episode_stats(tables, agent, ctx.data.train_episodes, n_envs=min(256, episodes), seed=seed,
                            min_episodes=episodes, greedy=False, support_episodes=None)
    probs = rollout.probs
    allowed = float(np.mean((probs > 0).sum(axis=1))) if probs is not None and len(probs) else float("nan")
    allowed_exact = _mean_allowed(tables, ctx.data.train_episodes, seed)
    steps.append(reward_integrity(rollout.rewards, allowed_exact, tables.n_actions))

    # 2: fidelity of the trained encoder on recorded states
    rng = np.random.default_rng(seed)
    n = tables.n_steps
    index = np.sort(rng.choice(n, size=min(n, FIDELITY_SAMPLE), replace=False))
    with torch.no_grad():
        X = agent.state(tables.logged_batch(index)).cpu().numpy()
    step_episode = tables.step_episode.cpu().numpy()[index]
    labels = [tables.task_types[e] for e in step_episode]
    fid = state_fidelity(X, labels, step_episode)
    verdicts: dict[bool | None, Verdict] = {True: "ok", None: "warn", False: "fail"}
    verdict = verdicts[fid.separates]
    margin = None if fid.silhouette is None else fid.silhouette - (fid.silhouette_shuffled or 0.0)
    fid_numbers = {k: v for k, v in fid.to_dict().items() if k not in ("verdict", "separates")}
    # the plain summary (no figures) where the state map gives one; the figures are the step's own
    said = (fid.summary.replace("The map", "The trained encoder", 1) if fid.summary
            else f"trained encoder: {fid.verdict}")
    steps.append(_step(2, "state-encoding fidelity", verdict, margin, said,
                       figure="silhouette by task type, above shuffled labels", unit="silhouette",
                       threshold=f"at least {GOOD_SILHOUETTE_MARGIN:g} to pass, below {POOR_SILHOUETTE_MARGIN:g} "
                                 "fails; and a step's nearest neighbours must share its task type more often "
                                 "than by chance (kNN agreement)",
                       action={"ok": "Nothing to fix in this check.",
                               "warn": "Check the intent encoder's input (truncated or empty queries) and train "
                                       "longer; compare on the State Explorer page.",
                               "fail": "Check the intent encoder's input: truncated or empty queries make task "
                                       "types indistinguishable. Look at the State Explorer page, fix, retrain."
                               }[verdict],
                       silhouette_margin=margin, **fid_numbers))

    # 3: gradient flow in the last update that trained the policy
    history = run_metrics(ws, run_id)
    trained = [h for h in history if h.get("policy_trained")]
    last = trained[-1] if trained else (history[-1] if history else {})
    steps.append(gradient_flow(last.get("grad_norms")))

    # 4: entropy of the action distribution over the visited states
    entropy = per_state = None
    if probs is not None and len(probs):
        mass = probs.mean(axis=0)
        entropy = float(-(mass[mass > 0] * np.log(mass[mass > 0])).sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            per_state = float(np.nanmean(-(np.where(probs > 0, probs * np.log(probs), 0.0)).sum(axis=1)))
    steps.append(exploration_quality(entropy, per_state))

    steps.sort(key=lambda s: s.step)
    order: dict[Verdict, int] = {"ok": 0, "warn": 1, "fail": 2}
    overall = max((s.verdict for s in steps), key=lambda v: order[v])
    return Diagnosis(run_id=run_id, status=ctx.run.display_status, updates=ctx.run.updates,
                     checkpoint_update=ctx.checkpoint.update_idx if ctx.checkpoint else None,
                     policy_allowed_actions=allowed, steps=tuple(steps), verdict=overall,
                     plain_verdict=VERDICT_WORDS[overall], next_action=_next_action(steps))


def _next_action(steps: list[DiagnosisCheck]) -> str:
    """What to do first: the action of the first failing step (the order matters: fix rewards
    before the encoder, the encoder before gradients), else of the first warning."""
    for verdict in ("fail", "warn"):
        for s in steps:
            if s.verdict == verdict:
                return f"Step {s.step} ({s.name}): {s.action}"
    return ("All four steps pass: the training machinery is healthy. Whether the policy beats the logs is for "
            "the run's verdict to say, not for these four checks.")


def _mean_allowed(tables: Any, episodes: torch.Tensor, seed: int) -> float:
    """Mean number of actions the masks allow per state, over random-in-mask rollouts."""
    import torch  # deferred: the pages read this module's records without loading torch

    from core.rl.sim import BatchedSim, random_masked_actions  # deferred: loads gymnasium

    sim = BatchedSim(tables, 256, seed=seed, episodes=episodes)
    _, mask = sim.reset()
    counts = []
    for _ in range(int(tables.config.step_cap)):
        counts.append(mask.sum(dim=1).float())
        mask = sim.step(random_masked_actions(mask, sim.generator)).mask
    return float(torch.cat(counts).mean())
