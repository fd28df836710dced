"""Fast re-weighting: episode returns as a function of the weights over a component matrix
computed once (:class:`ReturnModel`), without building a template per trial.

A weight-only trial is a weighted row sum plus gating and a ``reduceat``; the results are
tested against :class:`~core.rewards.pyramid.ScoreResult`, the slow obvious path.
:func:`matrix_layout` reads the matrix's orientation, so tuning never misreads a matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from core.rewards.frame import StepsFrame
from core.rewards.pyramid import ComponentMatrix, ScoreResult
from core.rewards.template import Template


@dataclass
class Combined:
    """What one set of weights gives: per episode ``returns``, ``discounted`` (Σγ^t r),
    ``final`` (R_final); per step ``step_reward``; ``earn`` [L, N]: level l counts at step i."""

    returns: np.ndarray
    discounted: np.ndarray
    final: np.ndarray
    step_reward: np.ndarray
    earn: np.ndarray


def matrix_layout(matrix: ComponentMatrix, frame: StepsFrame, template: Template
                  ) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """The matrix as ``(M [C, N] component-major step values, E [E, K] episode terms)``,
    plus whether each was stored transposed (to hand matrices back to the pyramid).

    The orientation is read from the shapes; when a square matrix leaves it open (tiny
    data), the one whose returns equal :class:`~core.rewards.pyramid.ScoreResult`'s under
    random weights is taken — tuning never misreads a matrix."""
    C, N = len(matrix.step_names), frame.n_steps
    K, E = len(matrix.episode_names), frame.n_episodes
    M, Ev = matrix.step_values, matrix.episode_values
    step_options = [(m, tr) for m, tr, ok in ((M, False, M.shape == (C, N)), (M.T, True, M.shape == (N, C))) if ok]
    ep_options = [(m, tr) for m, tr, ok in ((Ev, False, Ev.shape == (E, K)), (Ev.T, True, Ev.shape == (K, E))) if ok]
    if not step_options or not ep_options:
        raise ValueError(f"component matrix of shape {M.shape}/{Ev.shape} does not fit {N} steps, "
                         f"{E} episodes, {C}+{K} components")
    if len(step_options) > 1 or len(ep_options) > 1:
        rng = np.random.default_rng(0)
        weights = {c.name: float(rng.uniform(0.5, 1.5)) for c in template.all_components}
        reference = ScoreResult(template, frame, matrix, weights).returns
        model = ReturnModel(template, frame)
        ws, we = model.weight_vectors(weights)
        for m, m_t in step_options:
            for ev, ev_t in ep_options:
                if np.allclose(model.combine(ws, we, np.asarray(m), np.asarray(ev)).returns, reference):
                    return np.ascontiguousarray(m), np.ascontiguousarray(ev), m_t, ev_t
    (m, m_t), (ev, ev_t) = step_options[0], ep_options[0]
    return np.ascontiguousarray(m), np.ascontiguousarray(ev), m_t, ev_t


class ReturnModel:
    """Episode returns as a function of the weights, over a fixed component matrix.

    The same combination as :class:`~core.rewards.pyramid.ScoreResult` (gated level sums,
    penalties, R_final, ``a·Σγ^t r + b·R_final``) without building a template per trial:
    one ``[L+1, C] @ [C, N]`` product, the gates, a ``reduceat``."""

    def __init__(self, template: Template, frame: StepsFrame):
        self.template = template
        levels = template.levels
        self.n_levels = len(levels)
        self.step_names = [c.name for c in template.step_components]
        self.episode_names = [c.name for c in template.episode_terms]
        self.col_level = np.array([next((i for i, lv in enumerate(levels) if lv.key == c.group), self.n_levels)
                                   for c in template.step_components], dtype=np.int64)
        self.gates = [lv.gate for lv in levels]
        self.gating = template.gating
        self.discount = np.power(template.gamma, frame.t.astype(np.float64))
        self.has_steps = frame.ep_len > 0
        self.starts = frame.ep_start[self.has_steps]
        self.n_steps, self.n_episodes = frame.n_steps, frame.n_episodes
        self.a, self.b = template.a, template.b

    def weight_vectors(self, weights: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """(step weights [C], episode-term weights [K]) from a name → weight mapping (names
        not given keep the template's weight)."""
        base = self.template.weights()
        ws = np.array([float(weights.get(n, base[n])) for n in self.step_names], dtype=np.float64)
        we = np.array([float(weights.get(n, base[n])) for n in self.episode_names], dtype=np.float64)
        return ws, we

    def combine(self, w_step: np.ndarray, w_episode: np.ndarray, step_values: np.ndarray,
                episode_values: np.ndarray) -> Combined:
        """Returns under weight vectors ``w_step`` [C], ``w_episode`` [K] and component values
        ``step_values`` [C, N], ``episode_values`` [E, K]."""
        L, C = self.n_levels, w_step.shape[0]
        # S[l] = Σ_{c in level l} w_c·M[c]: a weighted row sum per component.  Not a BLAS
        # matmul: for a [L+1, C] @ [C, N] product with C ≈ 10, a multithreaded BLAS spends
        # far more time waking its threads than computing (10× slower on a busy 2-core box).
        S = np.zeros((L + 1, self.n_steps))
        wsum = np.zeros(L + 1)
        scratch = np.empty(self.n_steps)
        for j in range(C):
            w = w_step[j]
            if w != 0.0:
                lvl = self.col_level[j]
                np.multiply(step_values[j], w, out=scratch)
                S[lvl] += scratch
                wsum[lvl] += w
        earn = np.ones((L, self.n_steps), dtype=bool)
        reward = S[L].copy()                       # penalties are never gated
        running: np.ndarray | None = None          # AND of the gates below the current level
        for li in range(L):
            if self.gating and running is not None:
                earn[li] = running
                np.add(reward, S[li], out=reward, where=running)
            else:
                reward += S[li]
            gate = self.gates[li]
            if gate is not None and wsum[li] > 0 and self.gating:
                ok = S[li] >= (gate - 1e-9) * wsum[li]
                running = ok if running is None else running & ok
        final = episode_values @ w_episode if w_episode.size else np.zeros(self.n_episodes)
        discounted = np.zeros(self.n_episodes)
        if self.starts.size:
            discounted[self.has_steps] = np.add.reduceat(reward * self.discount, self.starts)
        return Combined(returns=self.a * discounted + self.b * final, discounted=discounted, final=final,
                        step_reward=reward, earn=earn)

    def contributions(self, combined: Combined, w_step: np.ndarray, step_values: np.ndarray) -> np.ndarray:
        """Weighted, gated contribution of every step component ``[C, N]`` (penalties ungated)."""
        out: np.ndarray = step_values * w_step[:, None]
        for j, lvl in enumerate(self.col_level.tolist()):
            if lvl < self.n_levels:
                out[j] *= combined.earn[lvl]
        return out
