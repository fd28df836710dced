"""The pyramid: component matrix → gated level totals → step rewards → episode returns.

Scoring has two stages, so that weight edits are instant: :meth:`Pyramid.compute_matrix`
evaluates every component once into a step matrix and an episode matrix, and
:class:`ScoreResult` combines them with the weights (a matrix product plus gating masks),
which :meth:`ScoreResult.reweight` redoes without calling any component.

Details: docs/rewards.md (## Scoring in two stages, ## Gating and returns).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from core.base.errors import InputError
from core.rewards.cache import ComponentCache
from core.rewards.components import Component, ScoringContext
from core.rewards.frame import StepsFrame
from core.rewards.template import Template, TemplateError, build_component

GATE_TOLERANCE = 1e-9  # level means are sums of products; don't fail a gate on rounding


@dataclass(eq=False)
class ComponentMatrix:
    """Raw component values of one frame under one template's component parameters."""

    step_names: list[str]
    #: [n_step_components, n_steps] float64: one contiguous row per component, so that the
    #: weighted sums are a fast (L+1, C) @ (C, N) product
    step_values: np.ndarray
    episode_names: list[str]
    episode_values: np.ndarray       # [n_episodes, n_episode_terms] float64
    components_hash: str
    computed: list[str] = field(default_factory=list)   # evaluated in this call
    cached: list[str] = field(default_factory=list)     # loaded from the cache
    seconds: dict[str, float] = field(default_factory=dict)
    embed_stats: dict[str, float] = field(default_factory=dict)
    _discount: dict[float, np.ndarray] = field(default_factory=dict, repr=False)
    _segments: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def episode_starts(self, frame: StepsFrame) -> tuple[np.ndarray, np.ndarray]:
        """(mask of episodes with steps, their first step rows): the segments of the return
        sums (memoised: re-weighting does not recompute them)."""
        if self._segments is None:
            has = frame.ep_len > 0
            self._segments = (has, frame.ep_start[has])
        return self._segments

    def discount(self, frame: StepsFrame, gamma: float) -> np.ndarray:
        """γ^t per step (memoised per γ: re-weighting does not recompute powers)."""
        if gamma not in self._discount:
            self._discount[gamma] = np.power(gamma, frame.t.astype(np.float64))
        return self._discount[gamma]


def each_episode_values(comp: Component, frame: StepsFrame, ctx: ScoringContext, scope: str) -> np.ndarray:
    """A component's values with every episode scored on its own frame (its own history)."""
    parts = [np.asarray(comp(frame.take_episodes([e]), ctx), dtype=np.float64) for e in range(frame.n_episodes)]
    return np.concatenate(parts) if parts else np.zeros(frame.n_steps if scope == "step" else 0)


class Pyramid:
    """A template made executable: its component instances, ready to score frames."""

    def __init__(self, template: Template):
        self.template = template
        self.components: dict[str, Component] = {
            spec.name: build_component(spec) for spec in template.all_components}

    def compute_matrix(self, frame: StepsFrame, *, ctx: ScoringContext | None = None,
                       cache: ComponentCache | None = None) -> ComponentMatrix:
        """Evaluate (or load from ``cache``) every component over ``frame``."""
        ctx = ctx or ScoringContext()
        t = self.template
        step_specs, ep_specs = t.step_components, t.episode_terms
        step_values = np.empty((len(step_specs), frame.n_steps), dtype=np.float64)
        ep_values = np.empty((frame.n_episodes, len(ep_specs)), dtype=np.float64)
        matrix = ComponentMatrix([s.name for s in step_specs], step_values,
                                 [s.name for s in ep_specs], ep_values, t.components_hash())
        done, total = 0, len(step_specs) + len(ep_specs)
        for specs, out, size in ((step_specs, step_values, frame.n_steps),
                                 (ep_specs, ep_values.T, frame.n_episodes)):
            for j, spec in enumerate(specs):
                ctx.report("components", done, total, spec.name)
                done += 1
                comp = self.components[spec.name]
                # a history-reading component scored episode by episode is not the cached column
                per_episode = ctx.each_episode and not comp.episode_local and frame.n_episodes > 1
                values = cache.get(frame, comp) if (cache is not None and not per_episode) else None
                if values is None:
                    t0 = time.perf_counter()
                    values = (each_episode_values(comp, frame, ctx, comp.scope) if per_episode
                              else np.asarray(comp(frame, ctx), dtype=np.float64))
                    matrix.seconds[spec.name] = time.perf_counter() - t0
                    if values.shape != (size,):
                        raise RuntimeError(f"component {spec.component} returned shape "
                                           f"{values.shape}, expected ({size},)")
                    if not np.isfinite(values).all():
                        raise RuntimeError(f"component {spec.component} returned NaN/inf values")
                    matrix.computed.append(spec.name)
                    if cache is not None and not per_episode:
                        cache.put(frame, comp, values)
                else:
                    matrix.cached.append(spec.name)
                out[j] = values
        ctx.report("components", done, total)
        matrix.embed_stats = dict(ctx.stats)
        return matrix

    def score(self, frame: StepsFrame, *, ctx: ScoringContext | None = None,
              cache: ComponentCache | None = None) -> "ScoreResult":
        """Component matrix plus weights: the full :class:`ScoreResult`."""
        return ScoreResult(self.template, frame, self.compute_matrix(frame, ctx=ctx, cache=cache))


@dataclass(frozen=True)
class ValueStats:
    """Mean, standard deviation, minimum and maximum of some values (all None when there are none)."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class ComponentSummary:
    """One component's raw values over every step (or, for an episode term, every episode)."""

    #: Level key ("L1" …), "penalty" or "episode"
    level: str
    #: The registered component it computes (core.rewards.components.COMPONENTS)
    component: str
    weight: float
    mean: float | None
    std: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class LevelSummary:
    """One level's gated totals over every step."""

    title: str
    #: The level's gate (None: no gate)
    gate: float | None
    #: Share of steps that pass the gate (None without steps)
    pass_rate: float | None
    mean: float | None
    std: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class ReturnFormula:
    """The return's coefficients: ``a × Σγᵗr + b × R_final``."""

    a: float
    b: float
    gamma: float


@dataclass(frozen=True)
class StepContribution:
    """One entry of the audit schema's ``reward_components``: a component's weighted, gated
    contribution to a step's reward (or an episode term's to R_final)."""

    name: str
    value: float


@dataclass(frozen=True)
class ScoreSummary:
    """What :meth:`ScoreResult.summary` reports: every component's raw values, every level's
    gated totals, penalties, step rewards and returns."""

    #: The template's name
    template: str
    n_episodes: int
    n_steps: int
    #: Component name → its raw values (step components, then episode terms)
    components: dict[str, ComponentSummary]
    #: Level key → its gated totals
    levels: dict[str, LevelSummary]
    penalties: ValueStats
    step_reward: ValueStats
    returns: ValueStats
    return_formula: ReturnFormula


def _stats(values: np.ndarray) -> ValueStats:
    if values.size == 0:
        return ValueStats(mean=None, std=None, min=None, max=None)
    return ValueStats(mean=float(values.mean()), std=float(values.std()),
                      min=float(values.min()), max=float(values.max()))


class ScoreResult:
    """Every step's component values, gated level totals and reward, and every episode's return.

    Built from a :class:`ComponentMatrix` by weights alone; :meth:`reweight` gives a new
    result from the same matrix (no component is called)."""

    def __init__(self, template: Template, frame: StepsFrame, matrix: ComponentMatrix,
                 weights: Mapping[str, float] | None = None):
        if weights is not None:
            template = template.with_weights(weights)
        if matrix.step_names != [c.name for c in template.step_components] or \
                matrix.episode_names != [c.name for c in template.episode_terms]:
            raise TemplateError("the template's components differ from the scored matrix; "
                                "score again with the new template")
        self.template, self.frame, self.matrix = template, frame, matrix
        self._combine()

    # ------------------------------------------------------------------ combination
    def _combine(self) -> None:
        t, frame, M = self.template, self.frame, self.matrix.step_values
        levels = t.levels
        n_levels, n = len(levels), frame.n_steps
        specs = t.step_components
        w = np.array([c.weight for c in specs], dtype=np.float64)
        col_level = np.array([next((i for i, lv in enumerate(levels) if lv.key == c.group), n_levels)
                              for c in specs], dtype=np.int64)
        # one product gives every level's weighted sum and the penalty sum: [L+1, N]
        W = np.zeros((n_levels + 1, len(specs)))
        W[col_level, np.arange(len(specs))] = w
        S = W @ M if len(specs) else np.zeros((n_levels + 1, n))
        wsum = W.sum(axis=1)
        # gate masks only for levels with a gate (None: every step passes); `running` is the
        # AND of the gates below the current level — what gating lets a step earn
        gate_pass: list[np.ndarray | None] = []
        running: np.ndarray | None = None
        reward = S[n_levels].copy()        # penalties are never gated
        for li, lv in enumerate(levels):
            if t.gating and running is not None:
                reward += S[li] * running  # multiply by the mask: branch-free, unlike where=
            else:
                reward += S[li]
            if lv.gate is not None and wsum[li] > 0:
                ok = S[li] >= (lv.gate - GATE_TOLERANCE) * wsum[li]
                gate_pass.append(ok)
                if t.gating:
                    running = ok if running is None else running & ok
            else:
                gate_pass.append(None)
        self._S, self._gate_pass = S, gate_pass
        self.step_reward = reward
        we = np.array([c.weight for c in t.episode_terms], dtype=np.float64)
        self.final = self.matrix.episode_values @ we if we.size else np.zeros(frame.n_episodes)
        disc = self.matrix.discount(frame, t.gamma)
        self.discounted = np.zeros(frame.n_episodes)
        has, starts = self.matrix.episode_starts(frame)
        if starts.size:
            self.discounted[has] = np.add.reduceat(np.multiply(reward, disc), starts)
        self.returns = t.a * self.discounted + t.b * self.final

    @property
    def _passed(self) -> np.ndarray:
        """[n_levels, n_steps] gate results (True where a level has no gate)."""
        if "_passed_cache" not in self.__dict__:
            out = np.ones((len(self.template.levels), self.frame.n_steps), dtype=bool)
            for li, ok in enumerate(self._gate_pass):
                if ok is not None:
                    out[li] = ok
            self._passed_cache = out
        return self._passed_cache

    @property
    def _earn(self) -> np.ndarray:
        """[n_levels, n_steps]: level counts for the step (with gating: all gates below passed)."""
        if "_earn_cache" not in self.__dict__:
            earn = np.ones_like(self._passed)
            if self.template.gating:
                for li in range(1, earn.shape[0]):
                    earn[li] = earn[li - 1] & self._passed[li - 1]
            self._earn_cache = earn
        return self._earn_cache

    @property
    def passed(self) -> np.ndarray:
        """[n_steps, n_levels]: did the step pass each level's gate."""
        return self._passed.T

    @property
    def earn(self) -> np.ndarray:
        """[n_steps, n_levels]: does each level count for the step (all levels below passed)."""
        return self._earn.T

    @property
    def level_totals(self) -> np.ndarray:
        """[n_steps, n_levels]: gated weighted sum of each level's components."""
        if "_level_totals" not in self.__dict__:
            n_levels = len(self.template.levels)
            self._level_totals = np.where(self._earn, self._S[:n_levels], 0.0).T
        return self._level_totals

    @property
    def penalties(self) -> np.ndarray:
        """[n_steps]: weighted sum of the penalties."""
        return self._S[len(self.template.levels)]

    # ------------------------------------------------------------------ re-weighting
    def reweight(self, weights: Mapping[str, float]) -> "ScoreResult":
        """The same scores under new weights: a matrix product, no component is called."""
        return ScoreResult(self.template, self.frame, self.matrix, weights)

    def with_template(self, template: Template) -> "ScoreResult":
        """Apply another template's weights, gating and return coefficients to this matrix.

        Refused when the template's components or parameters differ (score again then)."""
        if template.components_hash() != self.matrix.components_hash:
            raise TemplateError("component parameters changed; score again to recompute them")
        return ScoreResult(template, self.frame, self.matrix)

    # ------------------------------------------------------------------ lookups
    def _row(self, episode_id: str, t: int) -> tuple[int, int]:
        e = self.frame.episode_index().get(episode_id)
        if e is None:
            raise InputError(f"no episode {episode_id!r} in the scored data", field="episode_id")
        if not 0 <= t < int(self.frame.ep_len[e]):
            raise InputError(f"episode {episode_id!r} has no step {t} "
                             f"(it has {int(self.frame.ep_len[e])})", field="t")
        return e, int(self.frame.ep_start[e]) + t

    def contributions(self) -> np.ndarray:
        """Weighted, gated contribution of every step component: [n_steps, n_step_components]."""
        specs = self.template.step_components
        level_of = {lv.key: i for i, lv in enumerate(self.template.levels)}
        out = np.empty((self.frame.n_steps, len(specs)))
        for j, c in enumerate(specs):
            out[:, j] = c.weight * self.matrix.step_values[j]
            if c.group in level_of:
                out[:, j] *= self._earn[level_of[c.group]]
        return out

    def explain(self, episode_id: str, t: int) -> list[StepContribution]:
        """The audit schema's ``reward_components``: ``[{"name", "value"}]`` for one step.

        Values are weighted and gated contributions, so the step components sum to the
        step reward; on an episode's last step the weighted episode terms follow."""
        e, row = self._row(episode_id, t)
        specs = self.template.step_components
        level_of = {lv.key: i for i, lv in enumerate(self.template.levels)}
        out = []
        for j, c in enumerate(specs):
            earn = bool(self._earn[level_of[c.group], row]) if c.group in level_of else True
            out.append(StepContribution(name=c.name, value=float(c.weight * self.matrix.step_values[j, row] * earn)))
        if t == int(self.frame.ep_len[e]) - 1:
            out.extend(self.episode_term_contributions(e))
        return out

    def episode_term_contributions(self, e: int) -> list[StepContribution]:
        """The weighted episode terms of episode number ``e``: what makes up its R_final."""
        return [StepContribution(name=c.name, value=float(c.weight * self.matrix.episode_values[e, k]))
                for k, c in enumerate(self.template.episode_terms)]

    # ------------------------------------------------------------------ tables
    @property
    def episode_returns(self) -> dict[str, float]:
        """Episode id → return."""
        return dict(zip(self.frame.episode_ids.tolist(), self.returns.tolist()))

    def steps_table(self, rows: slice | None = None) -> pd.DataFrame:
        """One row per step (or per step in ``rows``): episode_id, t, action, raw component
        values, gated level totals, penalties, total (the step reward)."""
        f = self.frame
        rows = slice(None) if rows is None else rows
        data: dict[str, Any] = {"episode_id": f.episode_ids[f.episode[rows]], "t": f.t[rows],
                                "action": f.action_labels()[rows]}
        for j, name in enumerate(self.matrix.step_names):
            data[name] = self.matrix.step_values[j, rows]
        for li, lv in enumerate(self.template.levels):
            data[lv.key] = self.level_totals[rows, li]
        data["penalties"] = self.penalties[rows]
        data["total"] = self.step_reward[rows]
        return pd.DataFrame(data)

    def episodes_table(self) -> pd.DataFrame:
        """One row per episode: id, labels, outcome, raw episode terms, Σγ^t r, R_final, return."""
        df = self.frame.episodes_table()
        for k, name in enumerate(self.matrix.episode_names):
            df[name] = self.matrix.episode_values[:, k]
        df["discounted"] = self.discounted
        df["final"] = self.final
        df["return"] = self.returns
        return df

    def episode_steps(self, episode_id: str) -> pd.DataFrame:
        """Drill-down of one episode: per step the action, each component's raw value and
        weighted contribution, the level totals and the step reward."""
        e = self.frame.episode_index().get(episode_id)
        if e is None:
            raise InputError(f"no episode {episode_id!r} in the scored data", field="episode_id")
        rows = slice(int(self.frame.ep_start[e]), int(self.frame.ep_start[e] + self.frame.ep_len[e]))
        table = self.steps_table(rows)
        level_of = {lv.key: i for i, lv in enumerate(self.template.levels)}
        for j, c in enumerate(self.template.step_components):
            value = c.weight * self.matrix.step_values[j, rows]
            if c.group in level_of:
                value = value * self._earn[level_of[c.group], rows]
            table[f"{c.name} (weighted)"] = value
        return table

    def summary(self) -> ScoreSummary:
        """Per-component mean/std/min/max (raw values), level totals, rewards and returns."""
        t = self.template
        comps: dict[str, ComponentSummary] = {}
        for j, c in enumerate(t.step_components):
            comps[c.name] = ComponentSummary(level=c.group, component=c.component, weight=c.weight,
                                             **asdict(_stats(self.matrix.step_values[j])))
        for k, c in enumerate(t.episode_terms):
            comps[c.name] = ComponentSummary(level="episode", component=c.component, weight=c.weight,
                                             **asdict(_stats(self.matrix.episode_values[:, k])))
        return ScoreSummary(
            template=t.name, n_episodes=self.frame.n_episodes, n_steps=self.frame.n_steps,
            components=comps,
            levels={lv.key: LevelSummary(title=lv.title, gate=lv.gate,
                                         pass_rate=float(self._passed[i].mean()) if self.frame.n_steps else None,
                                         **asdict(_stats(self.level_totals[:, i])))
                    for i, lv in enumerate(t.levels)},
            penalties=_stats(self.penalties),
            step_reward=_stats(self.step_reward),
            returns=_stats(self.returns),
            return_formula=ReturnFormula(a=t.a, b=t.b, gamma=t.gamma),
        )

    def write(self, out: str | Path) -> Path:
        """Write the per-step table (with episode returns joined on) to ``.csv`` or ``.parquet``,
        atomically."""
        out = Path(out)
        if out.suffix not in (".csv", ".parquet"):
            raise InputError(f"output file must end in .csv or .parquet, got {out.name!r}",
                             file=str(out))
        table = self.steps_table()
        table["episode_return"] = self.returns[self.frame.episode]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        if out.suffix == ".csv":
            table.to_csv(tmp, index=False)
        else:
            table.to_parquet(tmp, index=False)
        tmp.replace(out)
        return out


__all__ = ["ComponentMatrix", "ComponentSummary", "LevelSummary", "Pyramid", "ReturnFormula", "ScoreResult",
           "ScoreSummary", "StepContribution", "ValueStats"]
