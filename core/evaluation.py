"""Evaluate a trained run on held-out episodes (``rwb evaluate RUN``).

The policy acts greedily (its most likely unmasked action) from the first state of every
held-out episode, once per repeat, in the same recorded-episode simulator it trained in.
It is compared with

* each **logged behaviour** — the template return the recorded episodes of that
  behaviour earned on the same held-out set (what following the log gives), *paired*:
  the policy is also run from the start states of that behaviour's own held-out
  episodes, so both answer the same requests from the same first state (``paired``);
  "beats the best logged behaviour" is decided on that pairing, and
* **random-in-mask** — a uniform choice among the unmasked actions, run exactly like the
  policy.

Held-out episodes are the run's own held-out split of its dataset (default) or an
episodes file (``--episodes HELDOUT``) read with the run's template, mask rules and
action catalog.  Counterfactual outcomes are drawn from every recorded step of the
evaluation data (a held-out evaluation holds out the tasks, not the simulator's world).

Example::

    >>> report = evaluate(ws, "run-20250101-120000-ab12")           # doctest: +SKIP
    >>> report["policy"]["return_mean"], report["best_logged"]      # doctest: +SKIP
    (2.91, {'behaviour': 'expert', 'return_mean': 2.73})
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core.errors import ConflictError, InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.store import Workspace

_KEEP = ("return_mean", "return_std", "success_rate", "off_support_rate", "mask_violations", "episodes", "steps")


def _summarise(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool several passes over the same episodes (means over all finished episodes)."""
    n = sum(p["episodes"] for p in passes)
    steps = sum(p["steps"] for p in passes)

    def wmean(key: str, weight: str) -> float:
        pairs = [(p[key], p[weight]) for p in passes if p[weight] and p[key] is not None and math.isfinite(p[key])]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total else float("nan")

    return {
        "return_mean": wmean("return_mean", "episodes"),
        "return_std_between_passes": float(np.std([p["return_mean"] for p in passes])) if len(passes) > 1 else 0.0,
        "success_rate": wmean("success_rate", "episodes"),
        "off_support_rate": wmean("off_support_rate", "steps"),
        "mask_violations": int(sum(p["mask_violations"] for p in passes)),
        "episodes": int(n), "steps": int(steps), "passes": len(passes),
    }


def evaluate(ws: "Workspace", run_id: str, *, episodes: str | Path | None = None, repeats: int = 3,
             device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Policy (greedy) vs every logged behaviour vs uniform-random-in-mask on held-out episodes.

    ``episodes``: an episodes file of held-out episodes; default the run's own held-out
    split.  ``repeats`` passes over every episode (the simulator's counterfactual draws are
    random).  Returns the policy's and random's return, success, off-support rate and mask
    violations, the logged behaviours' returns, the best of them, and the verdicts
    ``beats_best_logged`` and ``margin_over_random``."""
    from core import ppo
    from core.runs import open_run
    from core.sim import build_sim_tables_from, logged_returns

    if int(repeats) < 1:
        raise InputError("repeats must be at least 1", field="repeats")
    device = ppo.resolve_device(device)
    ctx = open_run(ws, run_id, device=device)
    agent = ctx.agent
    if episodes is None:
        tables = ctx.data.tables
        held = ctx.data.heldout_episodes
        source = f"held-out split of {ctx.data.source} ({ctx.config.heldout_fraction:.0%}, seed {ctx.config.seed})"
    else:
        from core.embed import workspace_embedder
        from core.importers import read_file
        from core.review import with_review_rules

        path = Path(episodes)
        if not path.is_file():
            raise InputError(f"no such episodes file: {path}", file=str(path))
        parsed = read_file(path)
        if not parsed.episodes:
            raise InputError("the held-out file holds no episodes", file=str(path))
        rules = with_review_rules(ctx.data.tables.mask_rules, ws, ctx.data.dataset)
        tables = build_sim_tables_from(parsed.episodes, parsed.tools or list(ctx.data.tables.catalog.tools.values()),
                                       ctx.template, masks=rules, config=ctx.config.sim_config(),
                                       embedder=workspace_embedder(ws))
        run_tokens = [t.name for t in ctx.data.tables.catalog.tokens]
        file_tokens = [t.name for t in tables.catalog.tokens]
        if run_tokens != file_tokens:
            raise ConflictError(
                f"the held-out file's action catalog ({len(file_tokens)} tokens, version {tables.catalog.version}) "
                f"differs from the run's ({len(run_tokens)} tokens, version {ctx.data.tables.catalog.version}): "
                "the policy's actions would mean other calls; evaluate on episodes of the same tools and presets")
        held = torch.arange(tables.n_episodes)
        source = f"file {path}"
    tables = tables.to(device)
    policy, random = [], []
    for r in range(int(repeats)):
        kw = dict(every_episode=True, device=device, seed=seed + 1000 * r, support_episodes="all")
        policy.append(ppo.episode_stats(tables, agent, held, greedy=True, **kw))
        random.append(ppo.episode_stats(tables, None, held, **kw))
    logged = logged_returns(tables, held)
    best = max(logged, key=lambda b: logged[b]) if logged else None
    pol, rnd = _summarise(policy), _summarise(random)
    paired = paired_returns(tables, agent, held, logged, repeats=int(repeats), device=device, seed=seed)
    report = {
        "run_id": run_id, "source": source, "episodes": int(held.numel()), "repeats": int(repeats),
        "checkpoint_update": ctx.checkpoint["update_idx"] if ctx.checkpoint else None,
        "policy": pol, "random_in_mask": rnd, "logged": logged,
        "best_logged": None if best is None else {"behaviour": best, "return_mean": logged[best]},
        "paired": paired,
        "beats_best_logged": None if best is None else bool(paired[best]["policy"] >= paired[best]["logged"]),
        "margin_over_random": pol["return_mean"] - rnd["return_mean"],
        "mask_violations": pol["mask_violations"],
    }
    return report


def paired_returns(tables: Any, agent: Any, held: torch.Tensor, logged: dict[str, float], *, repeats: int,
                   device: str, seed: int) -> dict[str, dict[str, Any]]:
    """Per logged behaviour: the policy's mean return from the start states of that
    behaviour's held-out episodes (greedy, ``repeats`` passes) next to the return the
    behaviour's own logs earned there — the same requests, the same first state."""
    from core import ppo

    labels = [tables.behaviours[i] or "unknown" for i in held.cpu().tolist()]
    out: dict[str, dict[str, Any]] = {}
    for behaviour in sorted(set(labels)):
        starts = held[torch.tensor([x == behaviour for x in labels], dtype=torch.bool, device=held.device)]
        passes = [ppo.episode_stats(tables, agent, starts, greedy=True, every_episode=True, device=device,
                                    seed=seed + 1000 * r, support_episodes="all") for r in range(repeats)]
        policy = _summarise(passes)
        out[behaviour] = {"episodes": int(starts.numel()), "logged": logged.get(behaviour),
                          "policy": policy["return_mean"], "policy_success_rate": policy["success_rate"],
                          "margin": policy["return_mean"] - logged[behaviour] if behaviour in logged else None}
    return out
