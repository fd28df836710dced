"""Reward components that use a task's own success criteria (:mod:`core.data.task_criteria`).

* :class:`ExpectedCalls` — the share of the task's expected calls the episode made: names match,
  arguments earn partial credit each (numbers and dates normalised, nested values compared
  structurally), made calls assigned one-to-one to expected calls at best;
* :class:`UnexpectedWrites` — writes that match no expected call, and calls of forbidden tools;
* :class:`CommunicatedInfo` — the share of required items the agent said (the exact value in its
  words, else a sentence-embedding match);
* :class:`CallBudget` — calls over the task's budget.

Criteria reach the components through ``ScoringContext.criteria`` (:class:`EpisodeCriteria`,
filled by :func:`core.rewards.api.score` for a dataset's frame).  An episode whose task has no
criteria gets each component's documented neutral value, never a silent zero.

Details: docs/criteria.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from core.data.task_criteria import (criteria_digest, criteria_for, criteria_group_keys, episode_criteria,
                                     episode_task_ids)
from core.rewards.agent_signals import is_write_tool
from core.rewards.components import Component, ScoringContext, _check, register
from core.rewards.frame import FINAL_ANSWER, REPLY, TOOL_CALL, StepsFrame

#: Where :func:`stamp_task_ids` leaves a frame's dataset and task ids (the frame's derived-value cache).
TASK_IDS_KEY = "task_criteria_source"


@dataclass(frozen=True)
class EpisodeCriteria:
    """The task criteria of a dataset's episodes, by episode id."""

    #: Episode id → its task's normalised criteria (episodes without criteria are absent)
    by_episode: dict[str, dict[str, Any]]
    #: Digest of the criteria and their join (part of the component cache key)
    digest: str

    def for_frame(self, frame: StepsFrame) -> list[dict[str, Any] | None]:
        """Per episode of ``frame`` its criteria, None where it has none."""
        return [self.by_episode.get(e) for e in frame.episode_ids.tolist()]


# --------------------------------------------------------------------------- the frame's criteria
def stamp_task_ids(frame: StepsFrame, ws, dataset: str, episodes) -> None:
    """Note on ``frame`` which dataset it is and each episode's task id under every join key
    the dataset's criteria use, so that :func:`frame_criteria` can join criteria imported later."""
    keys = set(criteria_group_keys(criteria_for(ws, dataset))) | {None}
    frame._cache[TASK_IDS_KEY] = (dataset, {k: episode_task_ids(episodes, k) for k in keys})


def _joined(criteria: dict[str, dict[str, Any]], episode_ids: list[str],
            task_ids: dict[str | None, list[str | None]]) -> EpisodeCriteria | None:
    per_episode = episode_criteria(criteria, task_ids)
    by_episode = {e: c for e, c in zip(episode_ids, per_episode) if c is not None}
    if not by_episode:
        return None
    return EpisodeCriteria(by_episode=by_episode, digest=criteria_digest(dict(sorted(by_episode.items()))))


def frame_criteria(ws, frame: StepsFrame) -> EpisodeCriteria | None:
    """The criteria of a frame loaded by :func:`core.rewards.api.load_frame` (None for a frame of
    another origin, or when no episode of it has criteria)."""
    stamp = frame._cache.get(TASK_IDS_KEY)
    if stamp is None or ws is None:
        return None
    dataset, task_ids = stamp
    criteria = criteria_for(ws, dataset)
    return _joined(criteria, frame.episode_ids.tolist(), task_ids) if criteria else None


def episodes_criteria(ws, dataset: str, episodes) -> EpisodeCriteria | None:
    """The criteria of ``dataset``'s ``episodes`` (Episode objects), for callers that build their
    own frame and scoring context (None when no episode has criteria)."""
    criteria = criteria_for(ws, dataset)
    if not criteria:
        return None
    keys = set(criteria_group_keys(criteria)) | {None}
    return _joined(criteria, [ep.episode_id for ep in episodes], {k: episode_task_ids(episodes, k) for k in keys})


# --------------------------------------------------------------------------- value matching
_NUMBER = re.compile(r"^[+-]?[$€£]?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])[+-]?[$€£]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_ISO_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_MONTHS = ("january february march april may june july august september october november december "
           "jan feb mar apr jun jul aug sep sept oct nov dec").split()
_DATE_FORMATS = ("%B %d, %Y", "%B %d %Y", "%d %B %Y", "%d %B, %Y", "%b %d, %Y", "%b %d %Y", "%d %b %Y",
                 "%m/%d/%Y", "%Y/%m/%d")


def parse_number(text: str) -> float | None:
    """``"1,000"``, ``"$1000.00"``, ``"1000"`` → 1000.0; None when the text is not one number."""
    s = text.strip()
    if not _NUMBER.match(s):
        return None
    return float(re.sub(r"[,$€£\s]", "", s))


def parse_date(text: str) -> str | None:
    """``"2024-05-01"``, ``"May 1, 2024"``, ``"1st May 2024"``, ``"05/01/2024"`` → ``"2024-05-01"``;
    None when the text is not a date."""
    s = " ".join(text.strip().split())
    m = _ISO_DATE.match(s)
    if m:
        return s
    if not (("/" in s and s.count("/") == 2) or any(w in s.lower().replace(",", " ").split() for w in _MONTHS)):
        return None
    s = re.sub(r"(\d+)(st|nd|rd|th)\b", r"\1", s, flags=re.IGNORECASE).replace("Sept ", "Sep ")
    for fmt in _DATE_FORMATS:
        try:
            return datetime.strptime(s, fmt).date().isoformat()
        except ValueError:
            continue
    return None


def normalise_scalar(value: Any) -> Any:
    """A comparable form of a scalar: numbers as float, dates as ISO text, booleans as bool,
    other text lower-cased with runs of white space collapsed."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    text = " ".join(str(value).split())
    number = parse_number(text)
    if number is not None:
        return number
    date = parse_date(text)
    if date is not None:
        return ("date", date)
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return low


def _scalar_equal(a: Any, b: Any) -> bool:
    na, nb = normalise_scalar(a), normalise_scalar(b)
    if isinstance(na, float) and isinstance(nb, float):
        return abs(na - nb) <= 1e-9 * max(1.0, abs(na), abs(nb))
    return na == nb


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def value_similarity(expected: Any, made: Any) -> float:
    """How far ``made`` agrees with ``expected``, from 0 to 1: objects score the share of their
    keys (union) whose values agree, lists the best one-to-one pairing of their items over the
    longer length, scalars 1 when equal after :func:`normalise_scalar`."""
    if isinstance(expected, dict) and isinstance(made, dict):
        e, m = _drop_none(expected), _drop_none(made)
        keys = set(e) | set(m)
        if not keys:
            return 1.0
        return sum(value_similarity(e[k], m[k]) for k in keys if k in e and k in m) / len(keys)
    if isinstance(expected, list) and isinstance(made, list):
        if not expected and not made:
            return 1.0
        if not expected or not made:
            return 0.0
        sims = np.array([[value_similarity(a, b) for b in made] for a in expected])
        rows, cols = linear_sum_assignment(-sims)
        return float(sims[rows, cols].sum() / max(len(expected), len(made)))
    if isinstance(expected, (dict, list)) or isinstance(made, (dict, list)):
        return 0.0
    return 1.0 if _scalar_equal(expected, made) else 0.0


@dataclass(frozen=True)
class CallMatch:
    """The best one-to-one assignment of an episode's calls to its task's expected calls."""

    #: Credit of each expected call (0 when no made call was assigned to it)
    credit: np.ndarray
    #: Per made call, the index of the expected call it was assigned to, -1 when none
    assigned: np.ndarray


def match_calls(expected: list[dict[str, Any]], made: list[tuple[str, dict[str, Any]]]) -> CallMatch:
    """Assign made calls ``(name, arguments)`` to expected calls ``{name, arguments}`` one-to-one
    so that the summed credit is highest; a pair of the same tool name earns
    :func:`value_similarity` of the arguments (at least a small positive amount, so that a call
    of the right tool with wrong arguments still counts as the expected call's attempt)."""
    credit = np.zeros(len(expected))
    assigned = np.full(len(made), -1, dtype=np.int64)
    if not expected or not made:
        return CallMatch(credit, assigned)
    score = np.full((len(expected), len(made)), -1.0)
    for i, e in enumerate(expected):
        name = e["name"].lower()
        for j, (tool, args) in enumerate(made):
            if tool.lower() == name:
                score[i, j] = value_similarity(e.get("arguments") or {}, args)
    # same-name pairs always beat no pair: shift them above the -1 of a name mismatch
    rows, cols = linear_sum_assignment(-np.where(score >= 0, score + 1e-6, -1.0))
    for i, j in zip(rows.tolist(), cols.tolist()):
        if score[i, j] >= 0:
            credit[i] = score[i, j]
            assigned[j] = i
    return CallMatch(credit, assigned)


# --------------------------------------------------------------------------- per-episode calls
def _episode_calls(frame: StepsFrame, count_failed: bool, wanted: np.ndarray | None = None
                   ) -> list[list[tuple[str, dict[str, Any], int]]]:
    """Per episode its tool calls as ``(tool, arguments, step row)``, failed calls left out
    unless ``count_failed`` (a call that failed changed nothing); with ``wanted`` (bool per
    episode) only those episodes' calls are parsed, the others' lists stay empty."""
    calls = frame.kind == TOOL_CALL
    if not count_failed:
        calls &= ~frame.tool_error
    if wanted is not None:
        calls &= wanted[frame.episode]
    rows = np.flatnonzero(calls)
    names = frame.tool_name_of()
    out: list[list[tuple[str, dict[str, Any], int]]] = [[] for _ in range(frame.n_episodes)]
    for r in rows.tolist():   # structural matching is per call: a short Python pass over calls only
        text = frame.params_json[r]
        args = json.loads(text) if text else {}
        out[int(frame.episode[r])].append((str(names[r]), args if isinstance(args, dict) else {}, r))
    return out


def _criteria(frame: StepsFrame, ctx: ScoringContext) -> list[dict[str, Any] | None]:
    crit = getattr(ctx, "criteria", None)
    return crit.for_frame(frame) if crit is not None else [None] * frame.n_episodes


def _with_criteria(criteria: list[dict[str, Any] | None]) -> np.ndarray:
    """Bool per episode: its task has criteria."""
    return np.array([c is not None for c in criteria], dtype=bool)


def _expected(crit: dict[str, Any], writes_only: bool) -> list[dict[str, Any]]:
    calls = crit.get("expected_calls") or []
    return [c for c in calls if is_write_tool(c["name"])] if writes_only else list(calls)


class _CriteriaComponent(Component):
    """Shared by the criteria components: episode terms keyed on the criteria in the cache."""

    level = "episode"
    scope = "episode"
    #: The cache key includes the digest of the criteria (core.rewards.cache).
    uses_criteria = True


@register
class ExpectedCalls(_CriteriaComponent):
    """Expected calls: the share of the task's expected calls the episode made (name, then partial credit per argument; numbers, dates and nested values normalised); ``no_criteria_value`` where the task has no criteria."""

    name = "expected_calls"

    def __init__(self, *, writes_only: bool = True, count_failed: bool = False, power: float = 1.0,
                 no_criteria_value: float = 0.5):
        _check(power > 0, "power must be > 0")
        self.writes_only, self.count_failed = bool(writes_only), bool(count_failed)
        self.power, self.no_criteria_value = float(power), float(no_criteria_value)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        out = np.full(frame.n_episodes, self.no_criteria_value)
        criteria = _criteria(frame, ctx)
        calls = _episode_calls(frame, self.count_failed, _with_criteria(criteria))
        for i, crit in enumerate(criteria):
            if crit is None:
                continue
            expected = _expected(crit, self.writes_only)
            if not expected:
                out[i] = 1.0    # nothing to do, and nothing left undone
                continue
            match = match_calls(expected, [(t, a) for t, a, _ in calls[i]])
            out[i] = float(np.mean(match.credit ** self.power))
        return out


@register
class UnexpectedWrites(_CriteriaComponent):
    """Unexpected writes: −per for each call that changes the world and matches no expected call of the task, and for each call of a forbidden tool (capped); 0 where the task has no criteria."""

    name = "unexpected_writes"

    def __init__(self, *, per: float = 0.5, cap: int = 4, count_failed: bool = False,
                 no_criteria_value: float = 0.0):
        _check(per >= 0 and cap >= 1, "need per ≥ 0 and cap ≥ 1")
        self.per, self.cap, self.count_failed = float(per), int(cap), bool(count_failed)
        self.no_criteria_value = float(no_criteria_value)

    def counts(self, frame: StepsFrame, ctx: ScoringContext) -> tuple[np.ndarray, np.ndarray]:
        """(unexpected writes plus forbidden calls, has criteria) per episode."""
        count = np.zeros(frame.n_episodes)
        has = np.zeros(frame.n_episodes, dtype=bool)
        criteria = _criteria(frame, ctx)
        calls = _episode_calls(frame, self.count_failed, _with_criteria(criteria))
        for i, crit in enumerate(criteria):
            if crit is None:
                continue
            has[i] = True
            made = [(t, a) for t, a, _ in calls[i]]
            match = match_calls(list(crit.get("expected_calls") or []), made)
            forbidden = {f.lower() for f in crit.get("forbidden_tools") or []}
            count[i] = sum(1 for (tool, _), j in zip(made, match.assigned.tolist())
                           if tool.lower() in forbidden or (j < 0 and is_write_tool(tool)))
        return count, has

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        count, has = self.counts(frame, ctx)
        return np.where(has, -self.per * np.minimum(count, self.cap), self.no_criteria_value) + 0.0


def _text_numbers(text: str) -> set[float]:
    return {float(re.sub(r"[,$€£+]", "", m)) for m in _NUMBER_IN_TEXT.findall(text)}


def _plain(text: str) -> str:
    return " " + " ".join(re.sub(r"[^\w@.\-/]+", " ", text.lower()).replace(". ", " ").split()) + " "


def said_exactly(item: str, text: str) -> bool:
    """Is ``item`` in ``text`` after normalisation: a number among the text's numbers
    (``"1628"`` in "a refund of $1,628.00"), else the words in order, case and punctuation aside."""
    number = parse_number(item)
    if number is not None:
        return any(abs(number - x) <= 1e-9 * max(1.0, abs(number)) for x in _text_numbers(text))
    needle = _plain(item).strip()
    return bool(needle) and f" {needle} " in _plain(text)


@register
class CommunicatedInfo(_CriteriaComponent):
    """Communicated info: the share of the items the task requires the agent to tell the user that its messages contain (the exact value in its words, else a sentence-embedding match ≥ ``threshold``); ``no_criteria_value`` where the task has no criteria."""

    name = "communicated_info"
    uses_embeddings = True

    def __init__(self, *, threshold: float = 0.8, use_embeddings: bool = True, nothing_to_say_value: float = 1.0,
                 no_criteria_value: float = 0.5, max_chars: int = 500):
        _check(-1.0 <= threshold <= 1.0, "threshold must be in [-1, 1]")
        _check(max_chars >= 16, "max_chars must be ≥ 16")
        self.threshold, self.use_embeddings = float(threshold), bool(use_embeddings)
        self.nothing_to_say_value, self.no_criteria_value = float(nothing_to_say_value), float(no_criteria_value)
        self.max_chars = int(max_chars)

    def found(self, frame: StepsFrame, ctx: ScoringContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(items found, items required, has criteria) per episode."""
        said_rows = np.flatnonzero(np.isin(frame.kind, [REPLY, FINAL_ANSWER]) & (frame.output_len > 0))
        messages: list[list[str]] = [[] for _ in range(frame.n_episodes)]
        for r in said_rows.tolist():
            messages[int(frame.episode[r])].append(str(frame.output_text[r]))
        found = np.zeros(frame.n_episodes)
        need = np.zeros(frame.n_episodes)
        has = np.zeros(frame.n_episodes, dtype=bool)
        pending: list[tuple[int, str]] = []   # (episode, item) left for the sentence model
        for i, crit in enumerate(_criteria(frame, ctx)):
            if crit is None:
                continue
            has[i] = True
            items = crit.get("communicate") or []
            need[i] = len(items)
            words = "\n".join(messages[i])
            for item in items:
                if said_exactly(item, words):
                    found[i] += 1
                elif self.use_embeddings and messages[i]:
                    pending.append((i, item))
        if pending:
            texts = sorted({item[:self.max_chars] for _, item in pending}
                           | {m[:self.max_chars] for i, _ in pending for m in messages[i]})
            index = {t: k for k, t in enumerate(texts)}
            vectors = ctx.encode(texts, what=self.name)
            for i, item in pending:
                item_vec = vectors[index[item[:self.max_chars]]]
                msg_vecs = vectors[[index[m[:self.max_chars]] for m in messages[i]]]
                if float(np.max(msg_vecs @ item_vec)) >= self.threshold:
                    found[i] += 1
        return found, need, has

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        found, need, has = self.found(frame, ctx)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(need > 0, found / np.maximum(need, 1), self.nothing_to_say_value)
        return np.where(has, share, self.no_criteria_value)


@register
class CallBudget(_CriteriaComponent):
    """Call budget: −per for each tool call beyond the task's ``call_budget`` (tasks without a budget, or without criteria, score 0)."""

    name = "call_budget"

    def __init__(self, *, per: float = 0.05, cap: int = 20):
        _check(per >= 0 and cap >= 1, "need per ≥ 0 and cap ≥ 1")
        self.per, self.cap = float(per), int(cap)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        budget = np.array([np.nan if c is None or c.get("call_budget") is None else float(c["call_budget"])
                           for c in _criteria(frame, ctx)], dtype=np.float64)
        n_calls = np.bincount(frame.episode[frame.kind == TOOL_CALL], minlength=frame.n_episodes)
        over = np.minimum(np.maximum(n_calls - np.nan_to_num(budget, nan=np.inf), 0.0), self.cap)
        return np.where(np.isnan(budget), 0.0, -self.per * over) + 0.0


#: Columns of :func:`criteria_features`, in order.
FEATURE_NAMES: tuple[str, ...] = ("expected_calls", "unexpected_writes", "communicated_info", "call_budget",
                                  "has_criteria")


def criteria_features(frame: StepsFrame, ctx: ScoringContext) -> tuple[list[str], np.ndarray]:
    """Per-episode columns for a learned outcome model: the four criteria components (default
    parameters) and ``has_criteria`` (1 where the episode's task has criteria, else 0; the
    components then hold their neutral values)."""
    columns = [ExpectedCalls()(frame, ctx), UnexpectedWrites()(frame, ctx), CommunicatedInfo()(frame, ctx),
               CallBudget()(frame, ctx),
               np.array([c is not None for c in _criteria(frame, ctx)], dtype=np.float64)]
    return list(FEATURE_NAMES), np.column_stack(columns) if frame.n_episodes else np.zeros((0, len(columns)))


__all__ = ["CallBudget", "CallMatch", "CommunicatedInfo", "EpisodeCriteria", "ExpectedCalls", "FEATURE_NAMES",
           "UnexpectedWrites", "criteria_features", "episodes_criteria", "frame_criteria", "match_calls",
           "normalise_scalar", "parse_date", "parse_number", "said_exactly", "stamp_task_ids", "value_similarity"]
