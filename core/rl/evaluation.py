"""Evaluate a trained run on held-out episodes (``rwb evaluate RUN``).

:func:`evaluate` runs the policy greedily from the first state of every held-out episode in the
simulator it trained in, and compares it with each logged behaviour (paired on the same start
states, :func:`paired_returns`) and with random-in-mask.  New logs are mapped onto the run's
own action catalog, its contract; the report's ``catalog_coverage`` counts what it cannot
express.

Details: docs/training.md (## Evaluation on held-out episodes, ## A run's catalog is its contract).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from core.base import embed as text_embedding
from core.base.errors import InputError
from core.base.results import to_jsonable
from core.data.importers import read_file
from core.records.catalog import build_catalog, catalog_coverage, catalog_for_dataset
from core.rl.runs import open_run

if TYPE_CHECKING:  # pragma: no cover
    from core.records.catalog import CatalogCoverage
    from core.rl.ope import OffPolicyReport, OffPolicyUnavailable
    from core.rl.rollouts import RolloutStats
    from core.rl.sim import SimTables
    from core.rl.runs import RunContext
    from core.records.store import Workspace


@dataclass(frozen=True)
class EpisodeFileOptions:
    """How to read an episodes file: the options of ``rwb episodes import`` (see
    :func:`core.data.importers.read_file`)."""

    format: str = "auto"
    messages_key: str | None = None
    reward_key: str | None = None
    id_key: str | None = None
    skip_invalid: bool = False


@dataclass(frozen=True)
class PooledReturns:
    """How one way of acting did over every pass of an evaluation: the greedy policy or
    random-in-mask (:func:`evaluate`), pooled over the passes by :func:`_summarise`."""

    #: Mean return of the finished episodes (NaN when none finished)
    return_mean: float
    #: Spread of the passes' mean returns (0 for one pass): how much the simulator's draws move it
    return_std_between_passes: float
    #: Share of finished episodes that succeeded (NaN when none finished)
    success_rate: float
    #: Share of steps whose action no logged step took in a similar state (NaN without steps)
    off_support_rate: float
    #: Actions taken that the masks forbid, over all passes
    mask_violations: int
    #: Episodes finished, over all passes
    episodes: int
    #: Steps taken, over all passes
    steps: int
    passes: int


@dataclass(frozen=True)
class BestLogged:
    """The logged behaviour whose held-out episodes earned the most."""

    behaviour: str
    #: Its mean logged return on the evaluation episodes
    return_mean: float


@dataclass(frozen=True)
class PairedReturns:
    """One logged behaviour against the policy started from the same states
    (:func:`paired_returns`): that behaviour's evaluation episodes only."""

    #: The behaviour's evaluation episodes (the start states the policy is run from)
    episodes: int
    #: The behaviour's own mean logged return there (None when its episodes earned none)
    logged: float | None
    #: The greedy policy's mean return from the same start states
    policy: float
    policy_success_rate: float
    #: ``policy - logged`` (None when ``logged`` is None)
    margin: float | None


@dataclass(frozen=True)
class EvaluationReport:
    """What :func:`evaluate` finds: the policy against each logged behaviour and against
    random-in-mask on the evaluation episodes, in the simulator, and the off-policy
    estimate on the logged episodes themselves."""

    run_id: str
    #: Which episodes were evaluated on, in words (the run's held-out split, a file, a dataset)
    source: str
    #: Evaluation episodes (each run once per pass)
    episodes: int
    #: Passes over every evaluation episode
    repeats: int
    #: The update whose checkpoint was evaluated (None without a checkpoint)
    checkpoint_update: int | None
    #: The greedy policy's figures
    policy: PooledReturns
    #: Uniformly random actions among those the masks allow
    random_in_mask: PooledReturns
    #: Mean logged return of every logged behaviour on the evaluation episodes
    logged: dict[str, float]
    #: The logged behaviour with the highest return (None when the episodes hold no behaviour)
    best_logged: BestLogged | None
    #: Per logged behaviour: the policy from that behaviour's own start states
    paired: dict[str, PairedReturns]
    #: Whether the policy earns at least the best logged behaviour from its start states
    #: (None without a logged behaviour)
    beats_best_logged: bool | None
    #: The policy's mean return minus random-in-mask's
    margin_over_random: float
    #: The policy's masked actions over all passes (its ``policy.mask_violations``)
    mask_violations: int
    #: Version of the run's action catalog the episodes were mapped onto
    catalog_version: str
    #: :meth:`core.records.catalog.CatalogCoverage.to_dict` of the evaluation episodes under
    #: the run's catalog: the tool calls it cannot express
    catalog_coverage: dict[str, Any]
    #: The off-policy estimate on the logged evaluation episodes
    #: (:func:`core.rl.ope.off_policy_report`), with its own verdict on support; its keys
    #: with no figures when the episodes cannot carry an estimate
    ope: OffPolicyReport | OffPolicyUnavailable

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON values, keyed by its fields (:func:`core.base.results.to_jsonable`):
        what a bundle's manifest and the registry's records store."""
        return cast("dict[str, Any]", to_jsonable(self))


def _summarise(passes: "list[RolloutStats]") -> PooledReturns:
    """Pool several passes (:func:`core.rl.rollouts.episode_stats`) over the same episodes
    (means over all finished episodes)."""
    n = sum(p.episodes for p in passes)
    steps = sum(p.steps for p in passes)

    def wmean(key: str, weight: str) -> float:
        figures = [(getattr(p, key), getattr(p, weight)) for p in passes]
        pairs = [(v, w) for v, w in figures if w and v is not None and math.isfinite(v)]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total else float("nan")

    return PooledReturns(
        return_mean=wmean("return_mean", "episodes"),
        return_std_between_passes=float(np.std([p.return_mean for p in passes])) if len(passes) > 1 else 0.0,
        success_rate=wmean("success_rate", "episodes"),
        off_support_rate=wmean("off_support_rate", "steps"),
        mask_violations=int(sum(p.mask_violations for p in passes)),
        episodes=int(n), steps=int(steps), passes=len(passes),
    )


def evaluate(ws: "Workspace", run_id: str, *, episodes: str | Path | None = None, dataset: str | None = None,
             import_options: EpisodeFileOptions | None = None, repeats: int = 3, device: str = "cpu",
             seed: int = 0, policy: Any = None) -> EvaluationReport:
    """Policy (greedy) vs every logged behaviour vs uniform-random-in-mask on held-out episodes.

    Held-out episodes: the run's own held-out split (default), every episode of an
    ``episodes`` file (read with ``import_options``) or of a workspace ``dataset``, mapped
    onto the run's action catalog.  ``repeats`` passes over every episode (the simulator's
    counterfactual draws are random).  Returns an :class:`EvaluationReport`: the policy's and
    random's return, success, off-support rate and mask violations, the logged behaviours'
    returns, the best of them, the verdicts ``beats_best_logged`` and ``margin_over_random``,
    the run's ``catalog_version`` and the ``catalog_coverage`` of the evaluation episodes
    (:class:`core.records.catalog.CatalogCoverage` as a dict) — all from the simulator — and ``ope``:
    the off-policy estimate of the policy's success and return on the logged evaluation
    episodes themselves (:func:`core.rl.ope.off_policy_report`; intervals over tasks, and
    ``reliable: false`` with a note when the logs do not support the policy enough).

    ``policy`` evaluates another module over the run's inputs and actions in place of its checkpoint
    (a bundle's served copy, core.govern.served_copy), on the same episodes and draws."""
    from core.rl.ppo import resolve_device  # deferred: loads gymnasium
    from core.rl.rollouts import episode_stats  # deferred: loads gymnasium
    from core.rl.sim import logged_returns  # deferred: loads gymnasium

    if int(repeats) < 1:
        raise InputError("repeats must be at least 1", field="repeats")
    if episodes is not None and dataset is not None:
        raise InputError("give at most one of --episodes FILE or --dataset NAME", field="episodes")
    if import_options not in (None, EpisodeFileOptions()) and episodes is None:
        raise InputError("import options (--format, --messages-key, --reward-key, --id-key, --skip-invalid) "
                         "read an episodes file: give --episodes FILE too", field="import_options")
    device = resolve_device(device)
    ctx = open_run(ws, run_id, device=device)
    agent = ctx.agent if policy is None else policy.to(device)
    if episodes is None and dataset is None:
        tables = ctx.data.tables
        held = ctx.data.heldout_episodes
        source = f"held-out split of {ctx.data.source} ({ctx.config.heldout_fraction:.0%}, seed {ctx.config.seed})"
        coverage = _split_coverage(ws, ctx, held)
    else:
        tables, coverage, source = _tables_on_run_catalog(ws, ctx, episodes=episodes, dataset=dataset,
                                                          import_options=import_options or EpisodeFileOptions())
        held = torch.arange(tables.n_episodes)
    tables = tables.to(device)
    policy, random = [], []
    for r in range(int(repeats)):
        kw: dict[str, Any] = dict(every_episode=True, device=device, seed=seed + 1000 * r, support_episodes="all")
        policy.append(episode_stats(tables, agent, held, greedy=True, **kw))
        random.append(episode_stats(tables, None, held, **kw))
    logged = logged_returns(tables, held)
    best = max(logged, key=lambda b: logged[b]) if logged else None
    pol, rnd = _summarise(policy), _summarise(random)
    paired = paired_returns(tables, agent, held, logged, repeats=int(repeats), device=device, seed=seed)
    return EvaluationReport(
        run_id=run_id, source=source, episodes=int(held.numel()), repeats=int(repeats),
        checkpoint_update=ctx.checkpoint.update_idx if ctx.checkpoint else None,
        policy=pol, random_in_mask=rnd, logged=logged,
        best_logged=None if best is None else BestLogged(behaviour=best, return_mean=logged[best]),
        paired=paired,
        beats_best_logged=None if best is None else bool(paired[best].policy >= logged[best]),
        margin_over_random=pol.return_mean - rnd.return_mean,
        mask_violations=pol.mask_violations,
        catalog_version=tables.catalog.version,
        catalog_coverage=coverage.to_dict(),
        # the figures above come from the recorded-episode simulator (a model of the world);
        # this one re-weights the logged episodes themselves, with its own verdict on support
        ope=_off_policy(tables, agent, held, device=device, seed=seed),
    )


def _off_policy(tables: Any, agent: Any, held: torch.Tensor, *, device: str,
                seed: int) -> OffPolicyReport | OffPolicyUnavailable:
    """:func:`core.rl.ope.off_policy_report` over the evaluation episodes, grouped by task; when
    the episodes cannot carry an estimate at all, the same keys with no figures and why."""
    from core.rl.ope import METHOD, OffPolicyUnavailable, off_policy_report  # deferred: loads pandas and scipy

    try:
        return off_policy_report(tables, agent, held, groups=np.array(tables.task_ids, dtype=object),
                                 device=device, seed=seed)
    except InputError as exc:
        return OffPolicyUnavailable(
            method=METHOD, policy_success=None, logged_success=None, policy_success_ci90=None,
            policy_return=None, logged_return=None, support=None, effective_sample_size=None,
            episodes=int(held.numel()), tasks=None, reliable=False, verdict="no estimate", note=exc.reason)


def _split_coverage(ws: "Workspace", ctx: "RunContext", held: torch.Tensor) -> "CatalogCoverage":
    """Catalog coverage of the run's own held-out episodes: only their own invalid calls
    are off-catalog, since the catalog was built from these logs."""
    wanted = {ctx.data.tables.episode_ids[i] for i in held.cpu().tolist()}
    if ctx.data.dataset is not None:
        logged = ws.load_episodes(ctx.data.dataset)
    else:  # the file the run trained on, read as its trainer read it

        assert ctx.run.episodes_file is not None, "a run trains on a dataset or on an episodes file"
        logged = read_file(json.loads(ctx.run.episodes_file)["path"]).episodes
    held_episodes = [ep for ep in logged if ep.episode_id in wanted]
    return catalog_coverage(held_episodes, ctx.data.tables.catalog)


def _tables_on_run_catalog(ws: "Workspace", ctx: "RunContext", *, episodes: str | Path | None, dataset: str | None,
                           import_options: EpisodeFileOptions) -> tuple["SimTables", "CatalogCoverage", str]:
    """Simulator tables of an episodes file or a workspace dataset mapped onto the run's
    catalog, under the run's template and mask rules (which hold its dataset's review
    rules); the coverage of those episodes by the run's catalog; the source's name."""
    from core.rl.sim import build_sim_tables, build_sim_tables_from  # deferred: loads gymnasium

    catalog, rules, sim_config = ctx.data.tables.catalog, ctx.data.tables.mask_rules, ctx.config.sim_config()
    if dataset is not None:
        tables = build_sim_tables(ws, dataset, ctx.template, masks=rules, config=sim_config, catalog=catalog)
        logged = ws.load_episodes(dataset)
        coverage = catalog_coverage(logged, catalog, own_catalog=catalog_for_dataset(ws, dataset))
        return tables, coverage, f"dataset {dataset}"

    path = Path(episodes)  # type: ignore[arg-type]
    if not path.is_file():
        raise InputError(f"no such episodes file: {path}", file=str(path))
    parsed = read_file(path, **asdict(import_options))
    if not parsed.episodes:
        raise InputError("the episodes file holds no episodes", file=str(path))
    tables = build_sim_tables_from(parsed.episodes, None, ctx.template, masks=rules, config=sim_config,
                                   embedder=text_embedding.workspace_embedder(ws), catalog=catalog)
    coverage = catalog_coverage(parsed.episodes, catalog, own_catalog=build_catalog(parsed.tools, parsed.episodes))
    return tables, coverage, f"file {path}"


def paired_returns(tables: Any, agent: Any, held: torch.Tensor, logged: dict[str, float], *, repeats: int,
                   device: str, seed: int) -> dict[str, PairedReturns]:
    """Per logged behaviour: the policy's mean return from the start states of that
    behaviour's held-out episodes (greedy, ``repeats`` passes) next to the return the
    behaviour's own logs earned there — the same requests, the same first state."""
    from core.rl.rollouts import episode_stats  # deferred: loads gymnasium

    labels = [tables.behaviours[i] or "unknown" for i in held.cpu().tolist()]
    out: dict[str, PairedReturns] = {}
    for behaviour in sorted(set(labels)):
        starts = held[torch.tensor([x == behaviour for x in labels], dtype=torch.bool, device=held.device)]
        passes = [episode_stats(tables, agent, starts, greedy=True, every_episode=True, device=device,
                                seed=seed + 1000 * r, support_episodes="all") for r in range(repeats)]
        policy = _summarise(passes)
        own = logged.get(behaviour)
        out[behaviour] = PairedReturns(episodes=int(starts.numel()), logged=own, policy=policy.return_mean,
                                       policy_success_rate=policy.success_rate,
                                       margin=None if own is None else policy.return_mean - own)
    return out
