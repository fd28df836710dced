"""The steps frame: every step of every episode of a dataset as flat numpy columns.

Reward components are pure vectorised functions of this frame, so :func:`build_frame`
walks the Episode objects once per dataset and every component, re-weighting and
expectation then works on the arrays of :class:`StepsFrame`: episode columns ``[E]``,
step columns ``[N]`` (steps of one episode contiguous, ordered by ``t``), and the call
parameters in long format.

Details: docs/rewards.md (## The steps frame, ## Steps frame layout).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import pandas as pd

from core.records.episodes import Action, Episode
from core.base.errors import InputError

#: Action kinds, in the order of the ``kind`` codes.
KINDS: tuple[str, ...] = ("tool_call", "reply", "final_answer", "terminate", "escalate")
KIND_CODE: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
TOOL_CALL, REPLY, FINAL_ANSWER, TERMINATE, ESCALATE = range(len(KINDS))

#: Longest tool-result text kept per step (the sentence model reads ~256 word pieces anyway).
MAX_TOOL_TEXT = 4000


class NormalizerLike(Protocol):
    """What the frame needs from :class:`core.records.catalog.Catalog`."""

    version: str
    reply_id: int
    final_id: int
    escalate_id: int

    def normalize_many(self, actions: Sequence[Action]) -> Any: ...


def canonical_json(value: Any) -> str:
    """Stable text of a JSON-like value (sorted keys, no spaces)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)


def result_text(value: Any) -> str:
    """A tool result as the text an agent (and the sentence model) reads."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else canonical_json(value)
    return text[:MAX_TOOL_TEXT]


def _codes(values: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """Integer codes for hashable values, in first-seen order."""
    table: dict[Any, int] = {}
    codes = np.fromiter((table.setdefault(v, len(table)) for v in values), dtype=np.int64,
                        count=len(values))
    return codes, list(table)


@dataclass(eq=False)
class StepsFrame:
    """Columnar view of all steps of a set of episodes (docs/rewards.md, "Steps frame layout")."""

    # ---- episodes [E]
    episode_ids: np.ndarray
    ep_start: np.ndarray
    ep_len: np.ndarray
    resolved: np.ndarray
    final_reward: np.ndarray
    business_metric: np.ndarray
    sentiment: np.ndarray
    behaviour: np.ndarray
    task_type: np.ndarray
    domain: np.ndarray
    query: np.ndarray
    ep_meta: list[dict[str, Any]]
    # ---- steps [N]
    episode: np.ndarray
    t: np.ndarray
    kind: np.ndarray
    tool: np.ndarray
    token_id: np.ndarray
    tool_known: np.ndarray
    args_ok: np.ndarray
    invalid_reason: np.ndarray
    tool_error: np.ndarray
    result_replayed: np.ndarray
    latency_ms: np.ndarray
    timestamp: np.ndarray
    output_text: np.ndarray
    tool_text: np.ndarray
    output_len: np.ndarray
    tool_text_len: np.ndarray
    params_json: np.ndarray
    call_key: np.ndarray
    time_order: np.ndarray
    tool_names: list[str]
    # ---- parameters, long format
    num_step: np.ndarray
    num_key: np.ndarray
    num_value: np.ndarray
    num_keys: list[tuple[str, str]]
    cat_step: np.ndarray
    cat_key: np.ndarray
    cat_value: np.ndarray
    cat_keys: list[tuple[str, str]]
    cat_values: list[str]
    # ---- identity
    content_hash: str
    catalog_version: str
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ sizes
    @property
    def n_steps(self) -> int:
        return int(self.episode.shape[0])

    @property
    def n_episodes(self) -> int:
        return int(self.episode_ids.shape[0])

    @property
    def ep_last(self) -> np.ndarray:
        """Index of the last step of each episode (-1 for an episode without steps)."""
        return self.ep_start + self.ep_len - 1

    @property
    def is_last(self) -> np.ndarray:
        """True on the last step of its episode."""
        if "is_last" not in self._cache:
            last = np.zeros(self.n_steps, dtype=bool)
            ends = self.ep_last[self.ep_len > 0]
            last[ends] = True
            self._cache["is_last"] = last
        return self._cache["is_last"]

    def tool_name_of(self) -> np.ndarray:
        """Tool name per step (object array; None when the step is not a call)."""
        names = np.array(list(self.tool_names) + [None], dtype=object)
        return names[self.tool]  # tool == -1 picks the trailing None

    def action_labels(self) -> np.ndarray:
        """Readable action per step: the tool name for calls, the kind otherwise."""
        kinds = np.array(KINDS, dtype=object)[self.kind]
        names = self.tool_name_of()
        return np.where(self.tool >= 0, names, kinds)

    def episode_index(self) -> dict[str, int]:
        """episode_id -> row in the episode columns."""
        if "episode_index" not in self._cache:
            self._cache["episode_index"] = {e: i for i, e in enumerate(self.episode_ids.tolist())}
        return self._cache["episode_index"]

    # ------------------------------------------------------------------ slicing
    def take_episodes(self, episodes: np.ndarray | Sequence[int]) -> "StepsFrame":
        """A frame of the given episodes (by index), in the given order.

        Used by tests (batch splitting must not change episode-local components) and
        by callers that score a subset."""
        ep_idx = np.asarray(episodes, dtype=np.int64)
        lens = self.ep_len[ep_idx]
        starts = self.ep_start[ep_idx]
        # step rows of the chosen episodes, concatenated: arange per episode without a loop
        offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
        rows = np.arange(int(lens.sum()), dtype=np.int64) + offsets
        return self._take(ep_idx, rows, lens)

    def _take(self, ep_idx: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> "StepsFrame":
        new_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        remap = np.full(self.n_steps, -1, dtype=np.int64)
        remap[rows] = np.arange(rows.shape[0], dtype=np.int64)
        ep_remap = np.full(self.n_episodes, -1, dtype=np.int64)
        ep_remap[ep_idx] = np.arange(ep_idx.shape[0], dtype=np.int64)

        def sub_params(step: np.ndarray, *cols: np.ndarray) -> list[np.ndarray]:
            keep = remap[step] >= 0
            new_step = remap[step[keep]]
            order = np.argsort(new_step, kind="stable")
            return [new_step[order]] + [c[keep][order] for c in cols]

        num_step, num_key, num_value = sub_params(self.num_step, self.num_key, self.num_value)
        cat_step, cat_key, cat_value = sub_params(self.cat_step, self.cat_key, self.cat_value)
        # time order of the subset: the original global order restricted to the kept rows
        kept_in_time = self.time_order[remap[self.time_order] >= 0]
        sub = replace(
            self,
            episode_ids=self.episode_ids[ep_idx], ep_start=new_start, ep_len=lens.astype(np.int64),
            resolved=self.resolved[ep_idx], final_reward=self.final_reward[ep_idx],
            business_metric=self.business_metric[ep_idx], sentiment=self.sentiment[ep_idx],
            behaviour=self.behaviour[ep_idx], task_type=self.task_type[ep_idx],
            domain=self.domain[ep_idx], query=self.query[ep_idx],
            ep_meta=[self.ep_meta[i] for i in ep_idx.tolist()],
            episode=ep_remap[self.episode[rows]], t=self.t[rows], kind=self.kind[rows],
            tool=self.tool[rows], token_id=self.token_id[rows], tool_known=self.tool_known[rows],
            args_ok=self.args_ok[rows], invalid_reason=self.invalid_reason[rows],
            tool_error=self.tool_error[rows], result_replayed=self.result_replayed[rows],
            latency_ms=self.latency_ms[rows], timestamp=self.timestamp[rows],
            output_text=self.output_text[rows], tool_text=self.tool_text[rows],
            output_len=self.output_len[rows], tool_text_len=self.tool_text_len[rows],
            params_json=self.params_json[rows], call_key=self.call_key[rows],
            time_order=remap[kept_in_time],
            num_step=num_step, num_key=num_key, num_value=num_value,
            cat_step=cat_step, cat_key=cat_key, cat_value=cat_value,
            content_hash=_hash_ids(self.content_hash, ep_idx), _cache={},
        )
        return sub

    def tile(self, copies: int) -> "StepsFrame":
        """``copies`` back-to-back copies of this frame (episode ids suffixed ``#k``).

        The benchmark uses it to reach a million steps from a generated dataset; the
        copies follow each other in time order."""
        n, e = self.n_steps, self.n_episodes
        k = np.arange(copies, dtype=np.int64)

        def rep(a: np.ndarray) -> np.ndarray:
            return np.tile(a, copies)

        def shifted(a: np.ndarray, by: int) -> np.ndarray:
            return (a[None, :] + (k * by)[:, None]).ravel()

        ids = np.array([f"{x}#{c}" for c in range(copies) for x in self.episode_ids.tolist()],
                       dtype=object)
        return replace(
            self,
            episode_ids=ids, ep_start=shifted(self.ep_start, n), ep_len=rep(self.ep_len),
            resolved=rep(self.resolved), final_reward=rep(self.final_reward),
            business_metric=rep(self.business_metric), sentiment=rep(self.sentiment),
            behaviour=rep(self.behaviour), task_type=rep(self.task_type), domain=rep(self.domain),
            query=rep(self.query), ep_meta=self.ep_meta * copies,
            episode=shifted(self.episode, e), t=rep(self.t), kind=rep(self.kind),
            tool=rep(self.tool), token_id=rep(self.token_id), tool_known=rep(self.tool_known),
            args_ok=rep(self.args_ok), invalid_reason=rep(self.invalid_reason),
            tool_error=rep(self.tool_error), result_replayed=rep(self.result_replayed),
            latency_ms=rep(self.latency_ms), timestamp=np.full(n * copies, np.nan),
            output_text=rep(self.output_text), tool_text=rep(self.tool_text),
            output_len=rep(self.output_len), tool_text_len=rep(self.tool_text_len),
            params_json=rep(self.params_json), call_key=rep(self.call_key),
            time_order=shifted(self.time_order, n),
            num_step=shifted(self.num_step, n), num_key=rep(self.num_key),
            num_value=rep(self.num_value),
            cat_step=shifted(self.cat_step, n), cat_key=rep(self.cat_key),
            cat_value=rep(self.cat_value),
            content_hash=hashlib.sha256(f"{self.content_hash}*{copies}".encode()).hexdigest(),
            _cache={},
        )

    # ------------------------------------------------------------------ tables
    def episodes_table(self) -> pd.DataFrame:
        """One row per episode: id, size, outcome, labels (for tables and filters)."""
        resolved = pd.array([None if np.isnan(x) else bool(x) for x in self.resolved],
                            dtype="boolean")
        return pd.DataFrame({
            "episode_id": self.episode_ids, "n_steps": self.ep_len, "resolved": resolved,
            "final_reward": self.final_reward, "business_metric": self.business_metric,
            "sentiment": self.sentiment, "behaviour": self.behaviour, "task_type": self.task_type,
            "domain": self.domain,
        })


def _hash_ids(base: str, idx: np.ndarray) -> str:
    h = hashlib.sha256(base.encode())
    h.update(np.ascontiguousarray(idx, dtype=np.int64).tobytes())
    return h.hexdigest()


def _timestamps(values: list[str | None]) -> np.ndarray:
    """Seconds since the epoch per step (NaN when absent or unparsable)."""
    if not any(values):
        return np.full(len(values), np.nan)
    parsed = pd.to_datetime(pd.Series(values, dtype=object), utc=True, errors="coerce",
                            format="ISO8601")
    secs = (parsed - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    return secs.to_numpy(dtype=np.float64, na_value=np.nan)


def _time_order(episode: np.ndarray, t: np.ndarray, timestamp: np.ndarray) -> np.ndarray:
    """Global time order of the steps.

    When every step carries a timestamp the order is by timestamp (ties: episode, t), so
    the order does not depend on how the episodes were listed; otherwise it is dataset
    order (episodes as imported, steps by t)."""
    n = episode.shape[0]
    if n and not np.isnan(timestamp).any():
        return np.lexsort((t, episode, timestamp)).astype(np.int64)
    return np.arange(n, dtype=np.int64)


def build_frame(episodes: Sequence[Episode], catalog: NormalizerLike) -> StepsFrame:
    """Flatten ``episodes`` into a :class:`StepsFrame`, normalising calls with ``catalog``.

    This is the one pass over Python objects; it costs a few microseconds per step."""
    n_ep = len(episodes)
    ids = [ep.episode_id for ep in episodes]
    if len(set(ids)) != n_ep:
        repeated = sorted(i for i, count in Counter(ids).items() if count > 1)
        raise InputError(f"episode ids must be unique to score them; repeated: {', '.join(repeated[:5])}",
                         field="episode_id")
    ep_len = np.fromiter((len(ep.steps) for ep in episodes), dtype=np.int64, count=n_ep)
    ep_start = np.concatenate([[0], np.cumsum(ep_len)[:-1]]).astype(np.int64) if n_ep else \
        np.zeros(0, dtype=np.int64)
    n = int(ep_len.sum())

    kinds = np.empty(n, dtype=np.int8)
    tool_list: list[str | None] = [None] * n
    tool_error = np.zeros(n, dtype=bool)
    replayed = np.ones(n, dtype=bool)
    latency = np.full(n, np.nan)
    stamps: list[str | None] = [None] * n
    out_text = np.empty(n, dtype=object)
    tool_text = np.empty(n, dtype=object)
    params_json = np.empty(n, dtype=object)
    call_actions: list[Action] = []
    call_rows: list[int] = []
    num_rows: list[int] = []
    num_keys_l: list[tuple[str, str]] = []
    num_vals: list[float] = []
    cat_rows: list[int] = []
    cat_keys_l: list[tuple[str, str]] = []
    cat_vals: list[str] = []

    i = 0
    for ep in episodes:
        for s in ep.steps:
            a = s.action
            kinds[i] = KIND_CODE[a.kind]
            out_text[i] = s.output_text or ""
            stamps[i] = s.timestamp
            if s.latency_ms is not None:
                latency[i] = s.latency_ms
            replayed[i] = s.result_replayed
            pj = canonical_json(a.params) if a.params else ""
            params_json[i] = pj
            if a.kind == "tool_call":
                assert a.tool is not None, "Action's validator: a tool call names its tool"
                tool_list[i] = a.tool
                tool_error[i] = s.tool_error is not None
                tool_text[i] = "" if s.tool_error is not None else result_text(s.tool_result)
                call_actions.append(a)
                call_rows.append(i)
                for name, value in a.params.items():
                    key = (a.tool, name)
                    # bool is an int subclass: a flag is categorical, not a magnitude
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        num_rows.append(i)
                        num_keys_l.append(key)
                        num_vals.append(float(value))
                    elif value is not None:
                        cat_rows.append(i)
                        cat_keys_l.append(key)
                        cat_vals.append(value if isinstance(value, str) else canonical_json(value))
            else:
                tool_text[i] = ""
            i += 1

    episode = np.repeat(np.arange(n_ep, dtype=np.int64), ep_len)
    t = (np.arange(n, dtype=np.int64) - np.repeat(ep_start, ep_len)) if n else np.zeros(0, np.int64)

    # tool names -> codes (-1 for non-calls)
    tool_codes_all, tool_names = _codes([x for x in tool_list if x is not None])
    tool = np.full(n, -1, dtype=np.int32)
    call_idx = np.asarray(call_rows, dtype=np.int64)
    tool[call_idx] = tool_codes_all

    # normaliser: token ids and validity for calls; special tokens for everything else
    token_id = np.full(n, -1, dtype=np.int64)
    token_id[kinds == REPLY] = catalog.reply_id
    token_id[(kinds == FINAL_ANSWER) | (kinds == TERMINATE)] = catalog.final_id
    token_id[kinds == ESCALATE] = catalog.escalate_id
    tool_known = np.ones(n, dtype=bool)
    args_ok = np.ones(n, dtype=bool)
    reasons = np.full(n, None, dtype=object)
    if call_actions:
        batch = catalog.normalize_many(call_actions)
        token_id[call_idx] = np.asarray(batch.token_ids, dtype=np.int64)
        tool_known[call_idx] = np.asarray(batch.tool_known, dtype=bool)
        args_ok[call_idx] = np.asarray(batch.args_ok, dtype=bool)
        reasons[call_idx] = np.array(list(batch.reasons) + [None], dtype=object)[:-1]

    call_key_src = [f"{tool_list[r]}\x00{params_json[r]}" if kinds[r] == TOOL_CALL else
                    f"\x01{KINDS[kinds[r]]}" for r in range(n)]
    call_key, _ = _codes(call_key_src)

    num_key, num_keys = _codes(num_keys_l)
    cat_key, cat_keys = _codes(cat_keys_l)
    cat_value, cat_values = _codes(cat_vals)
    timestamp = _timestamps(stamps)

    def ep_float(get) -> np.ndarray:
        return np.array([np.nan if (v := get(ep)) is None else float(v) for ep in episodes],
                        dtype=np.float64)

    h = hashlib.sha256()
    for ep in episodes:
        h.update(ep.content_hash().encode())
    h.update(f"|{catalog.version}".encode())

    return StepsFrame(
        episode_ids=np.array(ids, dtype=object),
        ep_start=ep_start, ep_len=ep_len,
        resolved=ep_float(lambda ep: ep.outcome.resolved),
        final_reward=ep_float(lambda ep: ep.outcome.final_reward),
        business_metric=ep_float(lambda ep: ep.outcome.business_metric),
        sentiment=ep_float(lambda ep: ep.outcome.sentiment),
        behaviour=np.array([ep.behaviour for ep in episodes], dtype=object),
        task_type=np.array([ep.task.task_type for ep in episodes], dtype=object),
        domain=np.array([ep.domain for ep in episodes], dtype=object),
        query=np.array([ep.task.query for ep in episodes], dtype=object),
        ep_meta=[dict(ep.meta) for ep in episodes],
        episode=episode, t=t, kind=kinds, tool=tool, token_id=token_id, tool_known=tool_known,
        args_ok=args_ok, invalid_reason=reasons, tool_error=tool_error, result_replayed=replayed,
        latency_ms=latency, timestamp=timestamp, output_text=out_text, tool_text=tool_text,
        output_len=np.fromiter(map(len, out_text), dtype=np.int64, count=n),
        tool_text_len=np.fromiter(map(len, tool_text), dtype=np.int64, count=n),
        params_json=params_json, call_key=call_key,
        time_order=_time_order(episode, t, timestamp), tool_names=[str(x) for x in tool_names],
        num_step=np.asarray(num_rows, dtype=np.int64), num_key=num_key,
        num_value=np.asarray(num_vals, dtype=np.float64), num_keys=num_keys,
        cat_step=np.asarray(cat_rows, dtype=np.int64), cat_key=cat_key, cat_value=cat_value,
        cat_keys=cat_keys, cat_values=[str(v) for v in cat_values],
        content_hash=h.hexdigest(), catalog_version=str(catalog.version),
    )

