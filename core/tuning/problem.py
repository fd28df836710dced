"""The fixed parts of a study (:class:`TuningProblem`): template, frame, component matrix,
held-out split, search space, return model and compiled constraints, with the one per-trial
computation the objectives share (:meth:`TuningProblem.trial_state`).

A trial that changes a component's parameters recomputes that one column (memoised per
parameter value, :data:`COLUMN_MEMO` at most); the rest of the matrix is reused.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from core.base.errors import InputError
from core.rewards.components import ScoringContext
from core.rewards.frame import StepsFrame
from core.rewards.pyramid import ComponentMatrix
from core.rewards.template import Template, build_component
from core.tuning.config import SearchSpace
from core.tuning.constraints import ExpectationConstraints, ScoredTrial
from core.tuning.reweighting import ReturnModel, matrix_layout

#: Component columns kept in memory for trials that tune parameters (most recent).
COLUMN_MEMO = 32


class TuningProblem:
    """The data and the fixed parts of a study: template, frame(s), component matrix,
    split, search space, return model and compiled constraints.

    :meth:`trial_state` is the one per-trial computation shared by the objectives."""

    def __init__(self, template: Template, frame: StepsFrame, matrix: ComponentMatrix,
                 space: SearchSpace, held_out: np.ndarray, *, ctx: Any = None,
                 label_frame: StepsFrame | None = None):
        self.template, self.frame, self.matrix, self.space = template, frame, matrix, space
        #: the same episodes with their recorded outcomes: what expectation filters such as
        #: ``{resolved: true}`` select on, even while the components see the outcome withheld
        self.label_frame = label_frame if label_frame is not None else frame
        if self.label_frame.content_hash != frame.content_hash and \
                not np.array_equal(self.label_frame.ep_len, frame.ep_len):
            raise ValueError("label_frame must hold the same episodes as frame")
        self.held_out = held_out
        self.train_idx = np.flatnonzero(~held_out)
        self.held_idx = np.flatnonzero(held_out)
        self.model = ReturnModel(template, frame)
        #: step values [C, N] and episode terms [E, K] (see matrix_layout)
        self.M, self.E, self._m_transposed, self._e_transposed = matrix_layout(matrix, frame, template)
        self.ctx = ctx
        # columns of components under trial parameters, most recent last (bounded: a
        # continuous parameter gives every trial a new column)
        self._columns: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        #: components evaluated because a trial changed their parameters (the rest is reused)
        self.recomputed: list[str] = []
        tuned = {k.split(".", 1)[0] for k in space.params}
        self.constraints = ExpectationConstraints(template, self.label_frame, self.train_idx, tuned)
        baseline = self.trial_state(template.weights(), {})
        self.constraints.check_constant(baseline)

    def _column(self, name: str, params: Mapping[str, Any]) -> tuple[np.ndarray, bool]:
        """Values of component ``name`` under ``params`` (memoised; ``True`` = episode term)."""
        spec = self.template.component(name)
        merged = {**dict(spec.params), **dict(params)}
        key = (name, json.dumps(merged, sort_keys=True, default=str))
        scope_episode = spec.group == "episode"
        if key in self._columns:
            self._columns.move_to_end(key)
            return self._columns[key], scope_episode
        # Not through the workspace's component cache: a continuous parameter would leave
        # one column file per trial on disk.  The sentence embeddings stay cached (ctx).
        comp = build_component(replace(spec, params=merged))
        values = np.asarray(comp(self.frame, self.ctx or ScoringContext()), dtype=np.float64)
        if values.shape != ((self.frame.n_episodes,) if scope_episode else (self.frame.n_steps,)) \
                or not np.isfinite(values).all():
            raise InputError(f"component {name!r} with parameters {merged} gave unusable values",
                             field="bounds")
        self.recomputed.append(name)
        self._columns[key] = values
        if len(self._columns) > COLUMN_MEMO:
            self._columns.popitem(last=False)
        return values, scope_episode

    def trial_state(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]) -> ScoredTrial:
        """Everything a trial's weights and parameters give (returns, gates, values)."""
        M, E = self.M, self.E
        if params:
            M, E = M.copy(), E.copy()
            for name, p in params.items():
                values, is_episode = self._column(name, p)
                if is_episode:
                    E[:, self.model.episode_names.index(name)] = values
                else:
                    M[self.model.step_names.index(name)] = values
        ws, we = self.model.weight_vectors(weights)
        combined = self.model.combine(ws, we, M, E)
        return ScoredTrial(combined=combined, w_step=ws, w_episode=we, step_values=M, episode_values=E,
                      model=self.model)

    def pyramid_matrix(self, template: Template, step_values: np.ndarray, episode_values: np.ndarray,
                       episodes: np.ndarray | None = None) -> ComponentMatrix:
        """A :class:`~core.rewards.pyramid.ComponentMatrix` in the pyramid's own layout, of
        all episodes or of ``episodes`` only (their steps, in order)."""
        M, E = step_values, episode_values
        if episodes is not None:
            f = self.frame
            lens, starts = f.ep_len[episodes], f.ep_start[episodes]
            rows = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(
                starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
            M, E = M[:, rows], E[episodes]
        return ComponentMatrix(self.matrix.step_names, np.ascontiguousarray(M.T if self._m_transposed else M),
                               self.matrix.episode_names,
                               np.ascontiguousarray(E.T if self._e_transposed else E),
                               template.components_hash())

    def template_for(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]) -> Template:
        """The template with a trial's weights and parameters written in."""
        t = self.template.with_weights({k: float(v) for k, v in weights.items()})
        for name, p in params.items():
            t = t.with_params(name, {**dict(t.component(name).params), **dict(p)})
        return t
