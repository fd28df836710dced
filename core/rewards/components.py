"""Reward components: one small class each, registered by name, vectorised over a steps frame.

Each component takes its parameters in the constructor (from the template's ``params:``)
and maps a :class:`~core.rewards.frame.StepsFrame` to one float per step or per episode,
without a per-step Python loop; ``level`` places it in the pyramid and the first line of
its class docstring is what the analyst reads in the UI.  :func:`register` adds a class to
:data:`COMPONENTS`, where templates find it by name; one shared test checks the contract
on every registered class.

Details: docs/rewards.md (## Component contract).
"""

from __future__ import annotations

import inspect
import re
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import pandas as pd

from core.base.embed import Embedder
from core.rewards.frame import (ESCALATE, FINAL_ANSWER, KIND_CODE, KINDS, REPLY, TERMINATE,
                                TOOL_CALL, StepsFrame)

LEVELS: tuple[str, ...] = ("L1", "L2", "L3", "L4")
LEVEL_TITLES: dict[str, str] = {"L1": "base", "L2": "process", "L3": "result", "L4": "business"}

#: Identity of the sentence model behind text components (part of their cache key).
EMBEDDING_MODEL = "all-MiniLM-L6-v2"

#: The largest magnitude of any number in a template: weights, gates, return coefficients,
#: schedule steps, expectation bounds and parameters alike (core.rewards.template checks
#: it).  Far beyond any meaningful setting, it keeps every integer inside numpy's int64 and
#: the sums of products of a few template numbers finite.
MAX_TEMPLATE_NUMBER = 1_000_000_000
#: The declared range of a parameter that is a reward value a component hands out (a score,
#: a neutral or missing value, a clip bound).
VALUE_RANGE = (-1_000_000.0, 1_000_000.0)
#: … of a count or length a component reads (a window, a cap, a number of calls or characters).
COUNT_RANGE = (0, 1_000_000)
#: … of a non-negative rate or multiplier (``per``: the cost of one unit).
RATE_RANGE = (0.0, 1_000_000.0)


#: Texts sent to the embedder at a time by :meth:`ScoringContext.encode`, so that progress
#: moves while a long list is embedded.
ENCODE_CHUNK = 256


@dataclass
class ScoringContext:
    """What components may use besides the frame: the (cached) sentence embedder, where to
    report progress (``progress(event)``, see :meth:`report`), and the episodes' task criteria."""

    embedder: Any = None
    #: Seconds spent and texts sent to the model by text components in this scoring.
    stats: dict[str, float] = field(default_factory=lambda: {"embed_seconds": 0.0, "encoded": 0})
    progress: Callable[[dict[str, Any]], None] | None = None
    #: The task criteria of the frame's episodes (:class:`core.rewards.criteria.EpisodeCriteria`);
    #: None: no criteria, and the criteria components give their neutral values.
    criteria: Any = None
    #: Score every episode on its own: components that compare with earlier calls
    #: (``episode_local = False``) see only the episode's own history (core.rewards.trajectory).
    each_episode: bool = False

    def get_embedder(self):
        """The embedder to use; an in-memory one when the caller gave none."""
        if self.embedder is None:
            self.embedder = Embedder(cache_dir=None)
        return self.embedder

    def report(self, stage: str, done: int, total: int, what: str = "") -> None:
        """Tell the caller how far a stage is: ``{"stage", "done", "total", "what"}``."""
        if self.progress is not None:
            self.progress({"stage": stage, "done": int(done), "total": int(total), "what": what})

    def encode(self, texts: list[str], what: str = "") -> np.ndarray:
        """Embeddings of ``texts`` (float32, one row each) through the embedder, in chunks
        that report progress; counts the time and the texts the model actually embedded."""
        emb = self.get_embedder()
        before, t0 = emb.stats["encoded"], time.perf_counter()
        parts = []
        for start in range(0, len(texts), ENCODE_CHUNK):
            parts.append(np.asarray(emb.encode(texts[start:start + ENCODE_CHUNK]), dtype=np.float32))
            self.report("embedding", min(start + ENCODE_CHUNK, len(texts)), len(texts), what)
        self.stats["embed_seconds"] += time.perf_counter() - t0
        self.stats["encoded"] += emb.stats["encoded"] - before
        return np.concatenate(parts) if parts else np.asarray(emb.encode([]), dtype=np.float32)


class Component:
    """Base class of reward components (the contract: docs/rewards.md, "Component contract")."""

    name: ClassVar[str] = ""
    level: ClassVar[str] = ""
    scope: ClassVar[Literal["step", "episode"]] = "step"
    episode_local: ClassVar[bool] = True
    uses_embeddings: ClassVar[bool] = False
    #: Bump when the computation changes: cached component columns are keyed by it.
    version: ClassVar[int] = 1
    #: Inclusive (low, high) of each numeric parameter (for a list parameter: of each of its
    #: numbers); one not declared here lies within ±:data:`MAX_TEMPLATE_NUMBER`.
    param_ranges: ClassVar[dict[str, tuple[float, float]]] = {}

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        # The base class computes nothing: every registered component overrides this.
        raise TypeError(f"{type(self).__name__} does not define its computation (__call__)")

    # ------------------------------------------------------------------ introspection
    @classmethod
    def description(cls) -> str:
        """The one-line, analyst-readable description (first docstring line)."""
        return (cls.__doc__ or "").strip().splitlines()[0]

    @classmethod
    def param_specs(cls) -> dict[str, tuple[Any, Any]]:
        """``{param: (annotation, default)}`` from the constructor's keyword-only arguments."""
        sig = inspect.signature(cls.__init__)
        hints = typing.get_type_hints(cls.__init__)
        return {n: (hints.get(n, Any), p.default) for n, p in sig.parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    @classmethod
    def param_range(cls, name: str) -> tuple[float, float]:
        """The inclusive range parameter ``name`` must lie in (:attr:`param_ranges`)."""
        return cls.param_ranges.get(name, (-MAX_TEMPLATE_NUMBER, MAX_TEMPLATE_NUMBER))

    def params(self) -> dict[str, Any]:
        """Current parameter values, defaults included (what the cache key is made of)."""
        return {n: getattr(self, n) for n in self.param_specs()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


COMPONENTS: dict[str, type[Component]] = {}


def register(cls: type[Component]) -> type[Component]:
    """Class decorator: make a component available to templates under ``cls.name``."""
    if not cls.name or cls.level not in (*LEVELS, "penalty", "episode"):
        raise TypeError(f"{cls.__name__} needs a name and a level")
    if (cls.level == "episode") != (cls.scope == "episode"):
        raise TypeError(f"{cls.__name__}: episode terms are exactly the episode-scope components")
    if cls.name in COMPONENTS and COMPONENTS[cls.name] is not cls:
        raise TypeError(f"component name {cls.name!r} is already registered")
    COMPONENTS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class ComponentDescription:
    """One registered component as a template author sees it."""

    #: The name a template's ``component:`` gives
    name: str
    #: The level it belongs to ("L1" …), "penalty" or "episode"
    level: str
    #: "step" or "episode"
    scope: str
    #: One line, analyst-readable (:meth:`Component.description`)
    description: str
    #: Parameter → its default value
    params: dict[str, Any]


def available_components() -> list[ComponentDescription]:
    """Every registered component: name, level, scope, description, parameters with defaults."""
    return [ComponentDescription(name=c.name, level=c.level, scope=c.scope, description=c.description(),
                                 params={k: d for k, (_, d) in c.param_specs().items()})
            for c in COMPONENTS.values()]


# --------------------------------------------------------------------------- helpers
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _kinds(names: list[str]) -> np.ndarray:
    unknown = [k for k in names if k not in KIND_CODE]
    _check(not unknown, f"unknown action kind(s) {unknown}; known: {', '.join(KINDS)}")
    return np.array([KIND_CODE[k] for k in names], dtype=np.int8)


def segment_positions(group_sorted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a sorted group-id array: (start index of each row's group, position in group)."""
    m = group_sorted.shape[0]
    if m == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    new = np.empty(m, dtype=bool)
    new[0] = True
    np.not_equal(group_sorted[1:], group_sorted[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    start_of_row = np.repeat(starts, np.diff(np.append(starts, m)))
    return start_of_row, np.arange(m, dtype=np.int64) - start_of_row


def stable_order(codes: np.ndarray) -> np.ndarray:
    """Stable argsort of small non-negative integer codes (radix sort when they fit 16 bits)."""
    if codes.size and int(codes.max()) < 2 ** 16:
        return np.argsort(codes.astype(np.uint16), kind="stable")
    return np.argsort(codes, kind="stable")


def series_order(key: np.ndarray, when: np.ndarray) -> np.ndarray:
    """Order of entries by ``key`` then ``when`` (time rank).  Entries usually arrive in time
    order already, so this is a stable sort by the small key codes alone."""
    if when.size > 1 and not np.all(when[1:] >= when[:-1]):
        by_time = np.argsort(when, kind="stable")
        return by_time[stable_order(key[by_time])]
    return stable_order(key)


def time_rank(frame: StepsFrame) -> np.ndarray:
    """rank[i] = position of step i in the frame's global time order."""
    rank = np.empty(frame.n_steps, dtype=np.int64)
    rank[frame.time_order] = np.arange(frame.n_steps, dtype=np.int64)
    return rank



# =========================================================================== L1
@register
class ToolValidity(Component):
    """Tool-call validity: a known tool earns the tool part, arguments that check earn the rest; failed or unknown calls earn 0."""

    name = "tool_validity"
    level = "L1"
    param_ranges = {"tool_part": (0.0, 1.0), "args_part": (0.0, 1.0), "error_value": VALUE_RANGE,
                    "not_call_value": VALUE_RANGE}

    def __init__(self, *, tool_part: float = 0.5, args_part: float = 0.5, error_value: float = 0.0,
                 not_call_value: float = 1.0):
        for n, v in {"tool_part": tool_part, "args_part": args_part}.items():
            _check(0.0 <= v <= 1.0, f"{n} must be in [0, 1]")
        self.tool_part, self.args_part = float(tool_part), float(args_part)
        self.error_value, self.not_call_value = float(error_value), float(not_call_value)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        is_call = frame.kind == TOOL_CALL
        value = (self.tool_part * frame.tool_known
                 + self.args_part * (frame.tool_known & frame.args_ok)).astype(np.float64)
        value = np.where(frame.tool_error, self.error_value, value)
        return np.where(is_call, value, self.not_call_value)


# =========================================================================== L2
def reasonableness_curve(z: np.ndarray, z_ok: float, z_zero: float, top: float) -> np.ndarray:
    """``top`` while z ≤ z_ok, then linear decay to 0 at z_zero (S000: z = 3.2 → 0.15)."""
    decay = top * (1.0 - (z - z_ok) / (z_zero - z_ok))
    return np.where(z <= z_ok, top, np.clip(decay, 0.0, top))


@register
class ParamReasonableness(Component):
    """Parameter reasonableness: each call's values against the last W values of the same tool parameter (z-score; rare categories score low)."""

    name = "param_reasonableness"
    level = "L2"
    # max_value > 0: the curve multiplies it by an unbounded slope (0 × ∞ would be NaN)
    param_ranges = {"window": (1, 10_000_000), "z_ok": (0.0, 1_000.0), "z_zero": (0.0, 1_000.0),
                    "max_value": (1e-6, VALUE_RANGE[1]), "min_history": (1, 10_000_000),
                    "min_std": (1e-12, 1e6), "rel_std": (0.0, 1_000.0), "max_distinct_ratio": (0.0, 1.0),
                    "min_freq": (1e-9, 1.0), "neutral": VALUE_RANGE}
    episode_local = False  # compares with the history of earlier calls, across episodes

    def __init__(self, *, window: int = 1000, z_ok: float = 2.0, z_zero: float = 3.48,
                 max_value: float = 0.8, min_history: int = 5, min_std: float = 1e-6,
                 rel_std: float = 0.01,
                 categorical: Literal["low_cardinality", "all", "none"] = "low_cardinality",
                 max_distinct_ratio: float = 0.2, min_freq: float = 0.05,
                 ignore: list[str] | None = None, neutral: float = 0.8):
        _check(window >= 1, "window must be ≥ 1")
        _check(0 <= z_ok < z_zero, "need 0 ≤ z_ok < z_zero")
        _check(min_history >= 1, "min_history must be ≥ 1")
        _check(min_std > 0 and rel_std >= 0, "min_std must be > 0 and rel_std ≥ 0")
        _check(categorical in ("low_cardinality", "all", "none"),
               "categorical must be low_cardinality, all or none")
        _check(0 < min_freq <= 1, "min_freq must be in (0, 1]")
        self.window, self.z_ok, self.z_zero = int(window), float(z_ok), float(z_zero)
        self.max_value, self.min_history = float(max_value), int(min_history)
        self.min_std, self.rel_std = float(min_std), float(rel_std)
        self.categorical, self.max_distinct_ratio = categorical, float(max_distinct_ratio)
        self.min_freq, self.ignore, self.neutral = float(min_freq), list(ignore or []), float(neutral)

    def _ignored(self, keys: list[tuple[str, str]]) -> np.ndarray:
        return np.array([k[1] in self.ignore for k in keys] + [False], dtype=bool)

    def numeric_scores(self, frame: StepsFrame, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step row, score) for every numeric parameter value, via windowed prefix sums."""
        keep = ~self._ignored(frame.num_keys)[frame.num_key]
        step, key, x = frame.num_step[keep], frame.num_key[keep], frame.num_value[keep]
        order = series_order(key, rank[step])       # by (tool, param), then time
        step, key, x = step[order], key[order], x[order]
        start, pos = segment_positions(key)
        # shift each series by its first value so prefix sums stay small (no cancellation)
        xc = x - x[start] if x.size else x
        cs = np.concatenate([[0.0], np.cumsum(xc)])
        cs2 = np.concatenate([[0.0], np.cumsum(xc * xc)])
        idx = np.arange(x.shape[0], dtype=np.int64)
        lo = np.maximum(start, idx - self.window)      # strictly the previous ≤ W values
        cnt = idx - lo
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (cs[idx] - cs[lo]) / cnt
            var = np.maximum((cs2[idx] - cs2[lo]) / cnt - mean * mean, 0.0)
            floor = np.maximum(self.min_std, self.rel_std * np.abs(mean + (x - xc)))  # vs the true mean
            std = np.maximum(np.sqrt(var), floor)
            z = np.abs(xc - mean) / std
        score = reasonableness_curve(np.nan_to_num(z, nan=0.0), self.z_ok, self.z_zero, self.max_value)
        return step, np.where(cnt < self.min_history, self.max_value, score)

    def categorical_scores(self, frame: StepsFrame, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(step row, score) for categorical values: frequency of the same value in the window."""
        empty = (np.zeros(0, np.int64), np.zeros(0))
        if self.categorical == "none" or frame.cat_step.size == 0:
            return empty
        keep = ~self._ignored(frame.cat_keys)[frame.cat_key]
        if self.categorical == "low_cardinality":
            # identifiers and free text (high cardinality) are not judged by rarity
            n_keys, n_vals = len(frame.cat_keys), len(frame.cat_values)
            totals = np.bincount(frame.cat_key, minlength=n_keys)
            pair = frame.cat_key.astype(np.int64) * n_vals + frame.cat_value
            if n_keys * n_vals <= 16_000_000:  # count (param, value) pairs without sorting
                seen = np.bincount(pair, minlength=n_keys * n_vals).reshape(n_keys, n_vals) > 0
                distinct = seen.sum(axis=1)
            else:
                distinct = np.bincount(np.unique(pair) // n_vals, minlength=n_keys)
            ratio = distinct / np.maximum(totals, 1)
            keep &= (ratio <= self.max_distinct_ratio)[frame.cat_key]
        step, key, val = frame.cat_step[keep], frame.cat_key[keep], frame.cat_value[keep]
        if step.size == 0:
            return empty
        order = series_order(key, rank[step])
        step, key, val = step[order], key[order], val[order]
        _, pos = segment_positions(key)
        # rows of one (param, value) series in time order; count same values in the window
        seg, _ = pd.factorize(key.astype(np.int64) * (int(val.max()) + 1) + val)
        by_seg = stable_order(seg)                  # stable: time order kept within a series
        seg_s, pos_s = seg[by_seg], pos[by_seg]
        seg_rank = np.cumsum(np.r_[True, seg_s[1:] != seg_s[:-1]]) - 1
        big = int(pos.max()) + self.window + 2
        composite = seg_rank * big + pos_s
        lo = np.searchsorted(composite, composite - self.window, side="left")
        same = np.empty_like(pos)
        same[by_seg] = np.arange(by_seg.shape[0]) - lo
        history = np.minimum(pos, self.window)
        with np.errstate(invalid="ignore", divide="ignore"):
            freq = np.where(history > 0, same / np.maximum(history, 1), 1.0)
        score = self.max_value * np.minimum(1.0, freq / self.min_freq)
        return step, np.where(history < self.min_history, self.max_value, score)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        rank = time_rank(frame)
        n_step, n_score = self.numeric_scores(frame, rank)
        c_step, c_score = self.categorical_scores(frame, rank)
        out = np.full(frame.n_steps, np.inf)
        # the worst parameter of a call decides its score
        np.minimum.at(out, np.concatenate([n_step, c_step]), np.concatenate([n_score, c_score]))
        is_call = frame.kind == TOOL_CALL
        out = np.where(np.isinf(out), self.max_value, out)
        return np.where(is_call, out, self.neutral)


# =========================================================================== L3
def consistency_curve(cos: np.ndarray, *, curve: str, threshold: float, high: float, low: float,
                      ramp_from: float) -> np.ndarray:
    """Map cosine similarity to a score: ``high`` above ``threshold``; below it ``low`` (step
    curve) or a linear ramp from ``low`` at ``ramp_from`` up to ``high`` at ``threshold``."""
    if curve == "step":
        return np.where(cos > threshold, high, low)
    ramp = low + (high - low) * (cos - ramp_from) / (threshold - ramp_from)
    return np.where(cos > threshold, high, np.clip(ramp, min(low, high), max(low, high)))


_JSON_PUNCT = re.compile(r"[{}\[\]]+")
_SPACES = re.compile(r"\s+")


def readable(texts: list[str]) -> list[str]:
    """Tool data as words for the sentence model: JSON punctuation dropped, ``key: value;``
    pairs kept (``{"avg_cost":24.0,"cash":1}`` → ``avg cost: 24.0; cash: 1``).  Works on cut
    JSON too.  Sentence embeddings of this read far closer to an answer than raw JSON does."""
    out = []
    for t in texts:
        if not t.lstrip().startswith(("{", "[")):
            out.append(t)  # already prose
            continue
        t = _JSON_PUNCT.sub(" ", t.replace('"', "")).replace(",", "; ").replace(":", ": ").replace("_", " ")
        out.append(_SPACES.sub(" ", t).strip())
    return out


def evidence_pairs(frame: StepsFrame, out_rows: np.ndarray, ev_rows: np.ndarray,
                   context_calls: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (output row position, evidence row position) of each output step with the tool
    results before it in its episode (the last ``context_calls`` of them; 0 = all).

    Returns (pair_out, pair_ev, n_pairs per output row) with pairs grouped by output row."""
    hi = np.searchsorted(ev_rows, out_rows, side="left")
    lo = np.searchsorted(ev_rows, frame.ep_start[frame.episode[out_rows]], side="left")
    if context_calls > 0:
        lo = np.maximum(lo, hi - context_calls)
    n_pairs = np.maximum(hi - lo, 0)
    pair_out = np.repeat(np.arange(out_rows.shape[0], dtype=np.int64), n_pairs)
    first = np.concatenate([[0], np.cumsum(n_pairs)[:-1]]).astype(np.int64)
    pair_ev = np.arange(int(n_pairs.sum()), dtype=np.int64) - np.repeat(first - lo, n_pairs)
    return pair_out, pair_ev, n_pairs


@register
class OutputConsistency(Component):
    """Output consistency: sentence-embedding similarity of the agent's words to the tool data before them (> 0.75 → 0.6)."""

    name = "output_consistency"
    level = "L3"
    param_ranges = {"threshold": (-1.0, 1.0), "high": VALUE_RANGE, "low": VALUE_RANGE,
                    "ramp_from": (-1.0, 1.0), "context_calls": COUNT_RANGE,
                    "no_evidence_value": VALUE_RANGE, "neutral": VALUE_RANGE,
                    "max_chars": (16, COUNT_RANGE[1])}
    uses_embeddings = True

    def __init__(self, *, threshold: float = 0.75, high: float = 0.6, low: float = 0.0,
                 curve: Literal["step", "linear"] = "step", ramp_from: float = 0.3,
                 aggregate: Literal["max", "mean"] = "max", context_calls: int = 0,
                 apply_to: list[str] | None = None, no_evidence_value: float = 0.0,
                 neutral: float = 0.0, max_chars: int = 500, readable: bool = True):
        _check(curve in ("step", "linear"), "curve must be step or linear")
        # the model reads at most 256 word pieces; encoding cost grows with length, so texts
        # are cut to their first max_chars characters before embedding
        _check(max_chars >= 16, "max_chars must be ≥ 16")
        self.max_chars, self.readable = int(max_chars), bool(readable)
        _check(aggregate in ("max", "mean"), "aggregate must be max or mean")
        _check(-1.0 <= ramp_from < threshold <= 1.0, "need -1 ≤ ramp_from < threshold ≤ 1")
        _check(context_calls >= 0, "context_calls must be ≥ 0")
        self.threshold, self.high, self.low = float(threshold), float(high), float(low)
        self.curve, self.ramp_from, self.aggregate = curve, float(ramp_from), aggregate
        self.context_calls = int(context_calls)
        self.apply_to = list(apply_to if apply_to is not None else ["reply", "final_answer"])
        _kinds(self.apply_to)
        self.no_evidence_value, self.neutral = float(no_evidence_value), float(neutral)

    def similarities(self, frame: StepsFrame, ctx: ScoringContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output rows, aggregated cosine per output row, n evidence results per output row)."""
        out_rows = np.flatnonzero(np.isin(frame.kind, _kinds(self.apply_to)) & (frame.output_len > 0))
        ev_rows = np.flatnonzero((frame.kind == TOOL_CALL) & (frame.tool_text_len > 0))
        pair_out, pair_ev, n_pairs = evidence_pairs(frame, out_rows, ev_rows, self.context_calls)
        agg = np.zeros(out_rows.shape[0])
        if pair_out.size:
            used_ev = np.unique(pair_ev)
            used_out = np.unique(pair_out)
            evidence = frame.tool_text[ev_rows[used_ev]]
            if self.readable:
                evidence = np.array(readable(evidence.tolist()), dtype=object)
            texts = np.concatenate([frame.output_text[out_rows[used_out]], evidence])
            inverse, uniq = pd.factorize(texts)  # hash-based: no fixed-width copies of long texts
            emb = self._encode([str(x)[:self.max_chars] for x in uniq], ctx)
            out_vec = np.zeros((out_rows.shape[0], emb.shape[1]), np.float32)
            out_vec[used_out] = emb[inverse[:used_out.size]]
            ev_vec = np.zeros((ev_rows.shape[0], emb.shape[1]), np.float32)
            ev_vec[used_ev] = emb[inverse[used_out.size:]]
            cos = np.empty(pair_out.shape[0])
            chunk = 65536  # bounded memory for the [pairs, 384] gathers
            for s in range(0, pair_out.shape[0], chunk):
                a, b = pair_out[s:s + chunk], pair_ev[s:s + chunk]
                cos[s:s + chunk] = np.einsum("ij,ij->i", out_vec[a], ev_vec[b], dtype=np.float64)
            has = n_pairs > 0
            starts = np.concatenate([[0], np.cumsum(n_pairs)[:-1]])[has]
            if self.aggregate == "max":
                agg[has] = np.maximum.reduceat(cos, starts)
            else:
                agg[has] = np.add.reduceat(cos, starts) / n_pairs[has]
        return out_rows, agg, n_pairs

    def _encode(self, texts: list[str], ctx: ScoringContext) -> np.ndarray:
        return ctx.encode(texts, what=self.name)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        out = np.full(frame.n_steps, self.neutral)
        rows, agg, n_pairs = self.similarities(frame, ctx)
        score = consistency_curve(agg, curve=self.curve, threshold=self.threshold, high=self.high,
                                  low=self.low, ramp_from=self.ramp_from)
        out[rows] = np.where(n_pairs > 0, score, self.no_evidence_value)
        return out


def contains_any(texts: np.ndarray, markers: list[str]) -> np.ndarray:
    """Which texts contain any of the markers (exact substrings; C loop via pandas)."""
    series = pd.Series(texts, dtype=object)
    hit = np.zeros(texts.shape[0], dtype=bool)
    for m in markers:
        hit |= series.str.contains(m, regex=False).to_numpy(dtype=bool)
    return hit


@register
class EvidenceReliability(Component):
    """Evidence reliability: an answer built on tool data flagged unreliable (e.g. unverified news) loses its credit."""

    name = "evidence_reliability"
    level = "L3"
    param_ranges = {"high": VALUE_RANGE, "low": VALUE_RANGE, "context_calls": COUNT_RANGE,
                    "no_evidence_value": VALUE_RANGE, "neutral": VALUE_RANGE}

    def __init__(self, *, markers: list[str] | None = None, high: float = 1.0, low: float = 0.0,
                 any_flag: bool = True, context_calls: int = 0, apply_to: list[str] | None = None,
                 no_evidence_value: float = 0.0, neutral: float = 0.0):
        # markers are matched in the canonical JSON of tool results: sorted keys, no spaces
        self.markers = list(markers if markers is not None else ['"verified":false'])
        _check(all(isinstance(m, str) and m for m in self.markers), "markers must be non-empty texts")
        _check(context_calls >= 0, "context_calls must be ≥ 0")
        self.high, self.low, self.any_flag = float(high), float(low), bool(any_flag)
        self.context_calls = int(context_calls)
        self.apply_to = list(apply_to if apply_to is not None else ["reply", "final_answer"])
        _kinds(self.apply_to)
        self.no_evidence_value, self.neutral = float(no_evidence_value), float(neutral)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        out_rows = np.flatnonzero(np.isin(frame.kind, _kinds(self.apply_to)) & (frame.output_len > 0))
        ev_rows = np.flatnonzero((frame.kind == TOOL_CALL) & (frame.tool_text_len > 0))
        flagged = contains_any(frame.tool_text[ev_rows], self.markers).astype(np.float64)
        pair_out, pair_ev, n_pairs = evidence_pairs(frame, out_rows, ev_rows, self.context_calls)
        share = np.zeros(out_rows.shape[0])
        has = n_pairs > 0
        if pair_out.size:
            starts = np.concatenate([[0], np.cumsum(n_pairs)[:-1]])[has]
            share[has] = np.add.reduceat(flagged[pair_ev], starts) / n_pairs[has]
        if self.any_flag:
            share = (share > 0).astype(np.float64)
        out = np.full(frame.n_steps, self.neutral)
        out[out_rows] = np.where(has, self.high - (self.high - self.low) * share, self.no_evidence_value)
        return out


# =========================================================================== L4
OUTCOME_FIELDS = ("business_metric", "final_reward", "resolved", "sentiment")


def outcome_values(frame: StepsFrame, name: str, fallback: str | None = None) -> np.ndarray:
    """Per-episode outcome field (NaN unknown), optionally filled from a second field."""
    values = getattr(frame, name).astype(np.float64)
    if fallback:
        values = np.where(np.isnan(values), getattr(frame, fallback), values)
    return values


@register
class BusinessImpact(Component):
    """Business impact: the episode's outcome (business metric, sandbox estimate) scaled and clipped to 0.1–1.0."""

    name = "business_impact"
    level = "L4"
    param_ranges = {"scale": VALUE_RANGE, "offset": VALUE_RANGE, "low": VALUE_RANGE,
                    "high": VALUE_RANGE, "missing_value": VALUE_RANGE}

    def __init__(self, *, field: Literal["business_metric", "final_reward", "resolved"] = "business_metric",
                 fallback_field: str | None = None, scale: float = 1.0, offset: float = 0.0,
                 low: float = 0.1, high: float = 1.0, missing_value: float = 0.1,
                 on: Literal["all", "last"] = "all"):
        _check(field in OUTCOME_FIELDS, f"field must be one of {', '.join(OUTCOME_FIELDS)}")
        _check(fallback_field is None or fallback_field in OUTCOME_FIELDS,
               f"fallback_field must be one of {', '.join(OUTCOME_FIELDS)}")
        _check(low <= high, "need low ≤ high")
        _check(on in ("all", "last"), "on must be all or last")
        self.field, self.fallback_field = field, fallback_field
        self.scale, self.offset, self.low, self.high = float(scale), float(offset), float(low), float(high)
        self.missing_value, self.on = float(missing_value), on

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        raw = outcome_values(frame, self.field, self.fallback_field)
        ep_value = np.where(np.isnan(raw), self.missing_value,
                            np.clip(self.scale * raw + self.offset, self.low, self.high))
        value = ep_value[frame.episode]
        return value if self.on == "all" else np.where(frame.is_last, value, 0.0)


# =========================================================================== penalties
@register
class LatencyPenalty(Component):
    """Latency penalty: −0.05 per unit of step latency (unit configurable; unknown latency costs nothing)."""

    name = "latency_penalty"
    level = "penalty"
    param_ranges = {"per": RATE_RANGE, "unit_ms": (1e-3, 1e9), "cap_units": (0.0, 1e9)}

    def __init__(self, *, per: float = 0.05, unit_ms: float = 1000.0, cap_units: float | None = None):
        _check(per >= 0 and unit_ms > 0, "need per ≥ 0 and unit_ms > 0")
        _check(cap_units is None or cap_units >= 0, "cap_units must be ≥ 0")
        self.per, self.unit_ms, self.cap_units = float(per), float(unit_ms), cap_units

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        units = np.nan_to_num(frame.latency_ms, nan=0.0) / self.unit_ms
        if self.cap_units is not None:
            units = np.minimum(units, self.cap_units)
        return -self.per * units + 0.0  # + 0.0 turns -0.0 into 0.0 in tables


def action_keys(frame: StepsFrame, key_param: str | None) -> np.ndarray:
    """Per step an action-key code (-1 for non-calls): the tool, or the tool plus the value
    of ``key_param`` when the call carries that parameter (see :func:`action_key_code`)."""
    n_vals = len(frame.cat_values)
    value_code = np.full(frame.n_steps, -1, dtype=np.int64)
    if key_param is not None and frame.cat_step.size:
        is_param = np.array([k[1] == key_param for k in frame.cat_keys] + [False])[frame.cat_key]
        value_code[frame.cat_step[is_param]] = frame.cat_value[is_param]
    return np.where(frame.tool >= 0, frame.tool.astype(np.int64) * (n_vals + 1) + value_code + 1, -1)


def action_key_code(frame: StepsFrame, name: str) -> int | None:
    """The code :func:`action_keys` gives ``tool`` or ``tool:value`` (None if absent here)."""
    tool, _, value = name.partition(":")
    if tool not in frame.tool_names:
        return None
    t = frame.tool_names.index(tool)
    if not value:
        return t * (len(frame.cat_values) + 1)
    if value not in frame.cat_values:
        return None
    return t * (len(frame.cat_values) + 1) + frame.cat_values.index(value) + 1


@register
class ActionSmoothing(Component):
    """Action smoothing: penalise a call that reverses the previous one (an opposite pair such as buy/sell, or A→B→A flip-flopping)."""

    name = "action_smoothing"
    level = "penalty"
    param_ranges = {"per": RATE_RANGE}

    def __init__(self, *, per: float = 0.1, opposites: list[list[str]] | None = None,
                 key_param: str | None = None):
        _check(per >= 0, "per must be ≥ 0")
        pairs = list(opposites or [])
        _check(all(isinstance(p, list) and len(p) == 2 for p in pairs),
               "opposites must be a list of [action, opposite action] pairs")
        self.per, self.opposites, self.key_param = float(per), pairs, key_param

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        key = action_keys(frame, self.key_param)
        out = np.zeros(frame.n_steps)
        if self.opposites:
            coded = [(action_key_code(frame, a), action_key_code(frame, b)) for a, b in self.opposites]
            pairs = [(a, b) for a, b in coded if a is not None and b is not None]
            codes = np.array(sorted({c for p in pairs for c in p}), dtype=np.int64)
            # only actions that have an opposite take part: reads in between don't hide a reversal
            calls = np.flatnonzero((key >= 0) & np.isin(key, codes))
        else:
            calls = np.flatnonzero(key >= 0)
        k, e = key[calls], frame.episode[calls]
        # keys of the previous (taking part) call and of the one before it, same episode
        prev_k = np.full(calls.shape[0], -1, dtype=np.int64)
        prev2_k = np.full(calls.shape[0], -1, dtype=np.int64)
        prev_k[1:] = np.where(e[1:] == e[:-1], k[:-1], -1)
        prev2_k[2:] = np.where(e[2:] == e[:-2], k[:-2], -1)
        if self.opposites:
            # a pair (previous, current) is a reversal when it is an opposite pair either way
            big = int(key.max(initial=0)) + 2
            opposite = np.array([a * big + b for a, b in pairs] + [b * big + a for a, b in pairs],
                                dtype=np.int64)
            flip = (prev_k >= 0) & np.isin(prev_k * big + k, opposite)
        else:
            flip = (prev_k >= 0) & (prev2_k == k) & (prev_k != k)
        out[calls[flip]] = -self.per
        return out


@register
class StepCost(Component):
    """Step cost: a fixed −c for every step (of the chosen kinds), so dragging an episode out does not pay."""

    name = "step_cost"
    level = "penalty"
    param_ranges = {"per": RATE_RANGE}

    def __init__(self, *, per: float = 0.1, kinds: list[str] | None = None):
        _check(per >= 0, "per must be ≥ 0")
        self.per = float(per)
        self.kinds = list(kinds if kinds is not None else KINDS)
        _kinds(self.kinds)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        return np.where(np.isin(frame.kind, _kinds(self.kinds)), -self.per, 0.0) + 0.0


def repeat_penalty(frame: StepsFrame, rows: np.ndarray, key: np.ndarray, per: float, cap: int) -> np.ndarray:
    """−per × (earlier rows of the same episode with the same ``key``, at most ``cap``) on
    ``rows`` (step indices, in order), 0 elsewhere."""
    order = np.lexsort((rows, key, frame.episode[rows]))
    group = frame.episode[rows][order] * (int(key.max(initial=0)) + 1) + key[order]
    _, earlier = segment_positions(group)
    out = np.zeros(frame.n_steps)
    out[rows[order]] = -per * np.minimum(earlier, cap) + 0.0
    return out


@register
class RepeatedFailures(Component):
    """Repeated failing calls: each failed call that repeats an earlier failure in the episode costs more."""

    name = "repeated_failures"
    level = "penalty"
    param_ranges = {"per": RATE_RANGE, "cap": (1, COUNT_RANGE[1])}

    def __init__(self, *, per: float = 0.2, cap: int = 5, match: Literal["call", "tool"] = "call",
                 count_invalid: bool = True):
        _check(per >= 0 and cap >= 1, "need per ≥ 0 and cap ≥ 1")
        _check(match in ("call", "tool"), "match must be call or tool")
        self.per, self.cap, self.match, self.count_invalid = float(per), int(cap), match, bool(count_invalid)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        failed = frame.tool_error.copy()
        if self.count_invalid:
            failed |= ~(frame.tool_known & frame.args_ok)
        failed &= frame.kind == TOOL_CALL
        rows = np.flatnonzero(failed)
        key = (frame.call_key if self.match == "call" else frame.tool.astype(np.int64))[rows]
        return repeat_penalty(frame, rows, key, self.per, self.cap)  # failures of the same call before


@register
class DuplicateCalls(Component):
    """Duplicate calls: a tool call that repeats an earlier one of the episode costs ``per`` for each earlier copy (up to ``cap``), so padding an episode with repeats does not pay. ``match: call`` counts identical calls (same tool and arguments); ``match: tool`` any earlier call of the same tool, except for the tools in ``exempt`` (e.g. the two legs of a trade), which count identical calls only."""

    name = "duplicate_calls"
    level = "penalty"
    param_ranges = {"per": RATE_RANGE, "cap": (1, COUNT_RANGE[1])}
    #: The recorded-episode simulator recomputes this component from an environment's own
    #: history when it leaves the log (core.rl.sim): a counterfactual repeat is a repeat.
    history = "own_calls"

    def __init__(self, *, per: float = 0.5, cap: int = 3, match: Literal["call", "tool"] = "call",
                 exempt: list[str] | tuple[str, ...] = ()):
        _check(per >= 0 and cap >= 1, "need per ≥ 0 and cap ≥ 1")
        _check(match in ("call", "tool"), "match must be call or tool")
        _check(isinstance(exempt, (list, tuple)) and all(isinstance(x, str) for x in exempt),
               "exempt must be a list of tool names")
        self.per, self.cap, self.match, self.exempt = float(per), int(cap), match, tuple(exempt)

    def by_tool(self, tool_names: list[str]) -> np.ndarray:
        """Bool per tool of ``tool_names``: its repeats count whatever the arguments."""
        return np.array([self.match == "tool" and t not in self.exempt for t in tool_names], dtype=bool)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        rows = np.flatnonzero(frame.kind == TOOL_CALL)
        tool = frame.tool[rows].astype(np.int64)
        whole = self.by_tool(frame.tool_names)[tool] if len(frame.tool_names) else np.zeros(len(rows), bool)
        # one key space: a tool code, or (after all tool codes) an identical-call code
        key = np.where(whole, tool, len(frame.tool_names) + frame.call_key[rows].astype(np.int64))
        return repeat_penalty(frame, rows, key, self.per, self.cap)  # repeats before


# =========================================================================== episode terms
def _count_steps(frame: StepsFrame, count: str) -> np.ndarray:
    if count == "steps":
        return frame.ep_len.astype(np.float64)
    kinds = {"tool_calls": [TOOL_CALL], "replies": [REPLY, FINAL_ANSWER]}[count]
    return np.bincount(frame.episode[np.isin(frame.kind, kinds)],
                       minlength=frame.n_episodes).astype(np.float64)


@register
class ResolvedBonus(Component):
    """Resolved bonus (S004): 1.0 when the episode resolved the request, −0.2 when it did not."""

    name = "resolved_bonus"
    level = "episode"
    scope = "episode"
    param_ranges = {"resolved_value": VALUE_RANGE, "unresolved_value": VALUE_RANGE,
                    "missing_value": VALUE_RANGE}

    def __init__(self, *, resolved_value: float = 1.0, unresolved_value: float = -0.2,
                 missing_value: float = 0.0):
        self.resolved_value, self.unresolved_value = float(resolved_value), float(unresolved_value)
        self.missing_value = float(missing_value)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        r = frame.resolved
        return np.where(np.isnan(r), self.missing_value,
                        np.where(r > 0.5, self.resolved_value, self.unresolved_value))


@register
class SentimentBonus(Component):
    """Sentiment bonus (S004): +0.5 × the customer's final sentiment (0–1)."""

    name = "sentiment_bonus"
    level = "episode"
    scope = "episode"
    param_ranges = {"per": VALUE_RANGE, "missing_value": VALUE_RANGE}

    def __init__(self, *, per: float = 0.5, missing_value: float = 0.0):
        self.per, self.missing_value = float(per), float(missing_value)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        s = frame.sentiment
        return np.where(np.isnan(s), self.missing_value, self.per * s)


@register
class LengthPenalty(Component):
    """Length penalty (S004): −0.1 per step of the conversation."""

    name = "length_penalty"
    level = "episode"
    scope = "episode"
    param_ranges = {"per": RATE_RANGE, "free": COUNT_RANGE}

    def __init__(self, *, per: float = 0.1, count: Literal["steps", "tool_calls", "replies"] = "steps",
                 free: int = 0):
        _check(per >= 0 and free >= 0, "need per ≥ 0 and free ≥ 0")
        _check(count in ("steps", "tool_calls", "replies"), "count must be steps, tool_calls or replies")
        self.per, self.count, self.free = float(per), count, int(free)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        return -self.per * np.maximum(_count_steps(frame, self.count) - self.free, 0.0) + 0.0


@register
class TerminalOutcome(Component):
    """Terminal outcome: the episode's final reward (or another outcome field), scaled and clipped."""

    name = "terminal_outcome"
    level = "episode"
    scope = "episode"
    param_ranges = {"scale": VALUE_RANGE, "offset": VALUE_RANGE, "low": VALUE_RANGE,
                    "high": VALUE_RANGE, "missing_value": VALUE_RANGE}

    def __init__(self, *, field: Literal["final_reward", "business_metric", "resolved"] = "final_reward",
                 fallback_field: str | None = None, scale: float = 1.0, offset: float = 0.0,
                 low: float = -1.0, high: float = 1.0, missing_value: float = 0.0):
        _check(field in OUTCOME_FIELDS, f"field must be one of {', '.join(OUTCOME_FIELDS)}")
        _check(fallback_field is None or fallback_field in OUTCOME_FIELDS,
               f"fallback_field must be one of {', '.join(OUTCOME_FIELDS)}")
        _check(low <= high, "need low ≤ high")
        self.field, self.fallback_field = field, fallback_field
        self.scale, self.offset, self.low, self.high = float(scale), float(offset), float(low), float(high)
        self.missing_value = float(missing_value)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        raw = outcome_values(frame, self.field, self.fallback_field)
        return np.where(np.isnan(raw), self.missing_value,
                        np.clip(self.scale * raw + self.offset, self.low, self.high))


@register
class EndsWithAnswer(Component):
    """Ends with an answer: the episode's last step is a final answer or reply with text (not a give-up, escalation or silence)."""

    name = "ends_with_answer"
    level = "episode"
    scope = "episode"
    param_ranges = {"answer_value": VALUE_RANGE, "no_answer_value": VALUE_RANGE,
                    "min_chars": COUNT_RANGE}

    def __init__(self, *, answer_value: float = 1.0, no_answer_value: float = -0.5,
                 min_chars: int = 1):
        _check(min_chars >= 0, "min_chars must be ≥ 0")
        self.answer_value, self.no_answer_value = float(answer_value), float(no_answer_value)
        self.min_chars = int(min_chars)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        out = np.full(frame.n_episodes, self.no_answer_value)
        has = frame.ep_len > 0
        last = frame.ep_last[has]
        answered = np.isin(frame.kind[last], [FINAL_ANSWER, REPLY]) & (frame.output_len[last] >= self.min_chars)
        out[has] = np.where(answered, self.answer_value, self.no_answer_value)
        return out


__all__ = ["COMPONENTS", "Component", "ComponentDescription", "ScoringContext", "register",
           "available_components", "LEVELS", "LEVEL_TITLES", "EMBEDDING_MODEL", "TERMINATE", "ESCALATE"]
