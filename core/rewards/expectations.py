"""Expectations: reward unit tests and hacking probes that a template carries.

The kinds are ``episode_score``, ``component_range``, ``twins_rank`` and ``rank_auc``, each
selecting episodes or steps with filters; an expectation that matches nothing fails, since it
could not be verified.

Details: docs/rewards.md (## Expectation kinds, ## Expectation filters).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from core.base.errors import RwbError
from core.rewards.frame import KIND_CODE, StepsFrame
from core.rewards.pyramid import ScoreResult
from core.rewards.template import ExpectationSpec

MAX_LISTED = 5  # offenders named in a message


class ExpectationsFailed(RwbError):
    """Some expectations of a template failed (``rwb reward check`` exits 1)."""

    exit_code = 1


@dataclass
class ExpectationResult:
    """Outcome of one expectation, with the numbers behind it."""

    name: str
    kind: str
    passed: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckReport:
    """All expectations of a template on one scored dataset."""

    template: str
    results: list[ExpectationResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[ExpectationResult]:
        return [r for r in self.results if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "passed": self.passed,
                "n_failed": len(self.failed), "results": [r.to_dict() for r in self.results]}


# --------------------------------------------------------------------------- filters
def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def _match(column: np.ndarray, wanted: Any) -> np.ndarray:
    values = _as_list(wanted)
    return pd.Series(column, dtype=object).isin(values).to_numpy()


def episode_mask(frame: StepsFrame, filt: dict[str, Any]) -> np.ndarray:
    """Episodes matching an episode filter."""
    mask = np.ones(frame.n_episodes, dtype=bool)
    for key, wanted in filt.items():
        if key == "episode_id":
            mask &= _match(frame.episode_ids, wanted)
        elif key in ("behaviour", "task_type", "domain"):
            mask &= _match(getattr(frame, key), wanted)
        elif key == "resolved":
            ok = np.zeros(frame.n_episodes, dtype=bool)
            for v in _as_list(wanted):
                ok |= np.isnan(frame.resolved) if v is None else (frame.resolved == float(bool(v)))
            mask &= ok
        elif key.startswith("meta."):
            name = key[5:]
            mask &= _match(np.array([m.get(name) for m in frame.ep_meta], dtype=object), wanted)
        else:  # a step-only key in an episode filter is refused at template validation
            raise KeyError(key)
    return mask


def _contains(texts: np.ndarray, wanted: Any) -> np.ndarray:
    series = pd.Series(texts, dtype=object).fillna("")
    mask = np.zeros(texts.shape[0], dtype=bool)
    for w in _as_list(wanted):
        mask |= series.str.contains(str(w), case=False, regex=False).to_numpy(dtype=bool)
    return mask


def _param_values(frame: StepsFrame, name: str) -> np.ndarray:
    """Value of parameter ``name`` per step (None where the call has no such parameter)."""
    out = np.full(frame.n_steps, None, dtype=object)
    is_num = np.array([k[1] == name for k in frame.num_keys] + [False])[frame.num_key]
    out[frame.num_step[is_num]] = frame.num_value[is_num]
    is_cat = np.array([k[1] == name for k in frame.cat_keys] + [False])[frame.cat_key]
    cat_values = np.array(frame.cat_values + [None], dtype=object)
    out[frame.cat_step[is_cat]] = cat_values[frame.cat_value[is_cat]]
    return out


def step_mask(frame: StepsFrame, filt: dict[str, Any]) -> np.ndarray:
    """Steps matching a step filter (episode keys apply to the step's episode)."""
    ep_keys = {k: v for k, v in filt.items()
               if k in ("episode_id", "behaviour", "task_type", "domain", "resolved")
               or k.startswith("meta.")}
    mask = episode_mask(frame, ep_keys)[frame.episode] if ep_keys else np.ones(frame.n_steps, bool)
    for key, wanted in filt.items():
        if key in ep_keys:
            continue
        if key == "kind":
            mask &= np.isin(frame.kind, [KIND_CODE[k] for k in _as_list(wanted) if k in KIND_CODE])
        elif key == "tool":
            mask &= _match(frame.tool_name_of(), wanted)
        elif key == "t":
            mask &= np.isin(frame.t, _as_list(wanted))
        elif key == "tool_error":
            mask &= frame.tool_error == bool(wanted)
        elif key == "valid":
            mask &= (frame.tool_known & frame.args_ok) == bool(wanted)
        elif key == "last":
            mask &= frame.is_last == bool(wanted)
        elif key == "output_contains":
            mask &= _contains(frame.output_text, wanted)
        elif key == "tool_result_contains":
            mask &= _contains(frame.tool_text, wanted)
        elif key.startswith("param."):
            values = _param_values(frame, key[6:])
            ok = np.zeros(frame.n_steps, dtype=bool)
            for v in _as_list(wanted):
                ok |= np.array([x == v for x in values], dtype=bool) if frame.n_steps else ok
            mask &= ok
        else:
            raise KeyError(key)
    return mask


# --------------------------------------------------------------------------- kinds
def _metric(result: ScoreResult, name: str) -> np.ndarray:
    return {"return": result.returns, "discounted": result.discounted, "final": result.final}[name]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _episode_score(result: ScoreResult, spec: ExpectationSpec) -> ExpectationResult:
    f = spec.fields
    metric = f.get("metric", "return")
    mask = episode_mask(result.frame, f["episodes"])
    values = _metric(result, metric)[mask]
    ids = result.frame.episode_ids[mask]
    if not mask.any():
        return ExpectationResult(spec.name, spec.kind, False,
                                 "no episode matched the filter; the expectation cannot be verified",
                                 {"matched": 0}, spec.description)
    bad = np.zeros(values.shape[0], dtype=bool)
    bounds = []
    if "below" in f:
        bad |= ~(values < f["below"])
        bounds.append(f"< {_fmt(f['below'])}")
    if "above" in f:
        bad |= ~(values > f["above"])
        bounds.append(f"> {_fmt(f['above'])}")
    offenders = [{"episode_id": i, metric: float(v)} for i, v in zip(ids[bad][:MAX_LISTED], values[bad])]
    details = {"matched": int(mask.sum()), "failing": int(bad.sum()), "metric": metric,
               "min": float(values.min()), "max": float(values.max()), "offenders": offenders}
    want = " and ".join(bounds)
    if bad.any():
        listed = ", ".join(f"{o['episode_id']} ({_fmt(o[metric])})" for o in offenders)
        msg = f"{int(bad.sum())} of {int(mask.sum())} episodes not {metric} {want}: {listed}"
    else:
        msg = (f"all {int(mask.sum())} episodes have {metric} {want} "
               f"(range {_fmt(values.min())} … {_fmt(values.max())})")
    return ExpectationResult(spec.name, spec.kind, not bad.any(), msg, details, spec.description)


def _component_range(result: ScoreResult, spec: ExpectationSpec) -> ExpectationResult:
    f = spec.fields
    name = f["component"]
    frame = result.frame
    filt = dict(f.get("steps") or {})
    use = f.get("value", "raw")
    if name in result.matrix.step_names:
        j = result.matrix.step_names.index(name)
        mask = step_mask(frame, filt)
        col = result.contributions()[:, j] if use == "contribution" else result.matrix.step_values[j]
        values = col[mask]
        where = [f"{frame.episode_ids[e]}@t{t}" for e, t in zip(frame.episode[mask], frame.t[mask])]
        unit = "steps"
    else:  # an episode term: the filter applies to each episode's last step
        k = result.matrix.episode_names.index(name)
        last_ok = step_mask(frame, {**filt, "last": True})
        mask = np.zeros(frame.n_episodes, dtype=bool)
        mask[frame.episode[last_ok]] = True
        weight = result.template.component(name).weight if use == "contribution" else 1.0
        values = result.matrix.episode_values[mask, k] * weight
        where = frame.episode_ids[mask].tolist()
        unit = "episodes"
    if values.size == 0:
        return ExpectationResult(spec.name, spec.kind, False,
                                 f"no {unit} matched the filter; the expectation cannot be verified",
                                 {"matched": 0}, spec.description)
    bad = np.zeros(values.shape[0], dtype=bool)
    bounds = []
    if "max" in f:
        bad |= values > f["max"]
        bounds.append(f"≤ {_fmt(f['max'])}")
    if "min" in f:
        bad |= values < f["min"]
        bounds.append(f"≥ {_fmt(f['min'])}")
    idx = np.flatnonzero(bad)[:MAX_LISTED]
    offenders = [{"where": where[i], "value": float(values[i])} for i in idx]
    details = {"matched": int(values.size), "failing": int(bad.sum()), "min": float(values.min()),
               "max": float(values.max()), "mean": float(values.mean()), "offenders": offenders}
    want = " and ".join(bounds)
    if bad.any():
        listed = ", ".join(f"{o['where']} ({_fmt(o['value'])})" for o in offenders)
        msg = f"{name} not {want} on {int(bad.sum())} of {values.size} {unit}: {listed}"
    else:
        msg = (f"{name} {want} on all {values.size} {unit} "
               f"(range {_fmt(values.min())} … {_fmt(values.max())})")
    return ExpectationResult(spec.name, spec.kind, not bad.any(), msg, details, spec.description)


def _twins_rank(result: ScoreResult, spec: ExpectationSpec) -> ExpectationResult:
    f = spec.fields
    frame = result.frame
    metric = f.get("metric", "return")
    key = f.get("twin_key", "twin_of")
    margin = float(f.get("margin", 0.0))
    mask = episode_mask(frame, f.get("episodes") or {"behaviour": "hacker"})
    values = _metric(result, metric)
    index = frame.episode_index()
    rows = np.flatnonzero(mask)
    twin_ids = [frame.ep_meta[i].get(key) for i in rows.tolist()]
    unpaired = [frame.episode_ids[i] for i, tw in zip(rows, twin_ids) if tw not in index]
    pairs = np.array([(i, index[tw]) for i, tw in zip(rows.tolist(), twin_ids) if tw in index],
                     dtype=np.int64).reshape(-1, 2)
    if rows.size == 0:
        return ExpectationResult(spec.name, spec.kind, False,
                                 "no episode matched the filter; the expectation cannot be verified",
                                 {"matched": 0}, spec.description)
    gaps = values[pairs[:, 1]] - values[pairs[:, 0]]  # twin minus probe: must exceed the margin
    bad = ~(gaps > margin)
    order = np.argsort(gaps)
    worst = [{"episode_id": frame.episode_ids[pairs[i, 0]], "twin": frame.episode_ids[pairs[i, 1]],
              "score": float(values[pairs[i, 0]]), "twin_score": float(values[pairs[i, 1]]),
              "gap": float(gaps[i])} for i in order[:MAX_LISTED] if bad[i]]
    details = {"matched": int(rows.size), "pairs": int(pairs.shape[0]), "unpaired": unpaired[:MAX_LISTED],
               "n_unpaired": len(unpaired), "below_twin": int((~bad).sum()), "metric": metric,
               "min_gap": float(gaps.min()) if gaps.size else None,
               "mean_gap": float(gaps.mean()) if gaps.size else None, "worst": worst}
    passed = bool(pairs.shape[0] > 0 and not bad.any() and not unpaired)
    if passed:
        msg = (f"all {pairs.shape[0]} episodes score below their twin by > {_fmt(margin)} "
               f"({metric}; smallest gap {_fmt(gaps.min())}, mean {_fmt(gaps.mean())})")
    else:
        parts = []
        if bad.any():
            listed = ", ".join(f"{w['episode_id']} {_fmt(w['score'])} vs twin {w['twin']} "
                               f"{_fmt(w['twin_score'])}" for w in worst)
            parts.append(f"{int(bad.sum())} of {pairs.shape[0]} do not score below their twin "
                         f"by > {_fmt(margin)}: {listed}")
        if unpaired:
            parts.append(f"{len(unpaired)} have no twin in the data (meta.{key}): "
                         f"{', '.join(map(str, unpaired[:MAX_LISTED]))}")
        msg = "; ".join(parts)
    return ExpectationResult(spec.name, spec.kind, passed, msg, details, spec.description)


def auc(higher: np.ndarray, lower: np.ndarray) -> float:
    """Probability that a random ``higher`` value beats a random ``lower`` one (ties half)."""
    both = np.concatenate([higher, lower])
    ranks = pd.Series(both).rank(method="average").to_numpy()
    n1, n0 = higher.size, lower.size
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def _rank_auc(result: ScoreResult, spec: ExpectationSpec) -> ExpectationResult:
    f = spec.fields
    metric = f.get("metric", "return")
    values = _metric(result, metric)
    hi = episode_mask(result.frame, f["higher"])
    lo = episode_mask(result.frame, f["lower"])
    if not hi.any() or not lo.any():
        return ExpectationResult(spec.name, spec.kind, False,
                                 f"need episodes in both groups (higher: {int(hi.sum())}, lower: "
                                 f"{int(lo.sum())}); the expectation cannot be verified",
                                 {"higher": int(hi.sum()), "lower": int(lo.sum())}, spec.description)
    value = auc(values[hi], values[lo])
    passed = value >= f["min"]
    msg = (f"AUC {value:.3f} {'≥' if passed else '<'} {_fmt(f['min'])} "
           f"({int(hi.sum())} higher vs {int(lo.sum())} lower episodes, {metric})")
    return ExpectationResult(spec.name, spec.kind, bool(passed), msg,
                             {"auc": value, "higher": int(hi.sum()), "lower": int(lo.sum()),
                              "metric": metric}, spec.description)


_KINDS = {"episode_score": _episode_score, "component_range": _component_range,
          "twins_rank": _twins_rank, "rank_auc": _rank_auc}


def evaluate_expectations(result: ScoreResult,
                          expectations: list[ExpectationSpec] | tuple[ExpectationSpec, ...] | None = None
                          ) -> CheckReport:
    """Evaluate the template's expectations (or the given ones) on a scored dataset."""
    specs = result.template.expectations if expectations is None else expectations
    return CheckReport(result.template.name, [_KINDS[s.kind](result, s) for s in specs])
