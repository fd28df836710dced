"""Domain-free signals of a tool-using agent's success, as reward components.

These read nothing a particular domain defines: which calls change the world (by the tool's
name), whether a failed call was ever made good, whether the agent's last words agree with
the tool data it last saw, and whether they say it gave up.  The generic ``tool_agent``
pyramid keeps those whose direction held on every labelled real set it was designed on.

* :class:`WriteActions` — every call that changes the world (kept out of ``tool_agent``:
  its direction differs between domains);
* :class:`UnrecoveredErrors` — a failed call no later successful call of the same tool
  made good;
* :class:`AnswerConsistency` — the sentence-embedding agreement of the agent's last words
  with the last tool results before them;
* :class:`GivesUp` — the last words say the agent could not do it and report nothing done.

Details: docs/real_logs.md (## The generic pyramid).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from core.rewards.components import (Component, ScoringContext, _check, consistency_curve, evidence_pairs,
                                     readable, register)
from core.rewards.frame import FINAL_ANSWER, REPLY, TOOL_CALL, StepsFrame

#: Verbs that start the name of a tool that only reads (``get_order``, ``search_flights``,
#: ``listFiles``): every other tool is taken to change the world.
READ_VERBS: tuple[str, ...] = (
    "get", "list", "search", "find", "lookup", "look", "check", "fetch", "read", "query", "calculate",
    "calc", "compute", "view", "show", "describe", "retrieve", "think", "verify", "validate", "count",
    "browse", "inspect", "is", "has", "can", "estimate", "preview", "explain", "summarize", "ls", "cat",
    "grep", "pwd", "whoami", "info", "status", "lookup", "peek", "select", "sort", "filter")
#: Words in a tool's name that make it a hand-off to a person (never counted as a write).
HANDOFF_WORDS: tuple[str, ...] = ("transfer", "escalat", "handoff", "hand_off", "human")

_FIRST_WORD = re.compile(r"^[_\W]*([A-Za-z]+?)(?=[A-Z_\W\d]|$)")


def _first_word(name: str) -> str:
    match = _FIRST_WORD.match(name or "")
    return match.group(1).lower() if match else ""


def is_write_tool(name: str, read_verbs: tuple[str, ...] = READ_VERBS,
                  handoff_words: tuple[str, ...] = HANDOFF_WORDS) -> bool:
    """Does a tool of this name change the world?  Its first word (``get`` in ``get_user``,
    ``getUser`` or ``GetUser``) is not a read verb and the name is not a hand-off."""
    lowered = (name or "").lower()
    if not lowered or any(w in lowered for w in handoff_words):
        return False
    return _first_word(name) not in read_verbs


#: Words whose presence in the agent's last words says it could not do what was asked (matched
#: at a word start, case-insensitive: ``apolog`` covers apologise, apologize, apologies).
GIVE_UP_WORDS: tuple[str, ...] = (
    "unable", "cannot", "can't", "can not", "not able", "couldn't", "could not", "not possible",
    "impossible", "don't have access", "do not have access", "not allowed", "sorry", "apolog",
    "unfortunately", "regret")
#: Words that report something done; last words with one of them are not a give-up.
DONE_WORDS: tuple[str, ...] = ("successfully", "has been", "have been", "i have ", "i've ")


def _word_pattern(words: list[str]) -> str:
    return r"\b(?:" + "|".join(re.escape(w.lower()) for w in words) + ")"


def last_words_rows(frame: StepsFrame) -> np.ndarray:
    """Per episode the step of the agent's last words (reply or final answer with text), -1
    when none."""
    rows = np.flatnonzero(np.isin(frame.kind, [REPLY, FINAL_ANSWER]) & (frame.output_len > 0))
    last = np.full(frame.n_episodes, -1, dtype=np.int64)
    np.maximum.at(last, frame.episode[rows], rows)
    return last


def _per_episode(frame: StepsFrame, rows: np.ndarray) -> np.ndarray:
    return np.bincount(frame.episode[rows], minlength=frame.n_episodes).astype(np.float64)


@register
class WriteActions(Component):
    """Write actions: −per for each call of a tool that changes the world (not a get/list/search…), after the first ``free`` of the episode."""

    name = "write_actions"
    level = "penalty"

    def __init__(self, *, per: float = 0.1, free: int = 0, read_verbs: list[str] | None = None):
        _check(per >= 0 and free >= 0, "need per ≥ 0 and free ≥ 0")
        self.per, self.free = float(per), int(free)
        self.read_verbs = list(read_verbs if read_verbs is not None else READ_VERBS)
        _check(all(isinstance(v, str) and v for v in self.read_verbs), "read_verbs must be words")

    def write_tools(self, tool_names: list[str]) -> np.ndarray:
        """Bool per tool of ``tool_names``: does it write."""
        verbs = tuple(v.lower() for v in self.read_verbs)
        return np.array([is_write_tool(t, verbs) for t in tool_names] + [False], dtype=bool)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        writes = (frame.kind == TOOL_CALL) & self.write_tools(frame.tool_names)[frame.tool]
        rows = np.flatnonzero(writes)
        out = np.zeros(frame.n_steps)
        if rows.size:
            # position of each write among the writes of its episode (rows are in step order)
            first_of_episode = np.searchsorted(frame.episode[rows], frame.episode[rows], side="left")
            nth = np.arange(rows.size) - first_of_episode
            out[rows] = np.where(nth >= self.free, -self.per, 0.0)
        return out + 0.0


@register
class UnrecoveredErrors(Component):
    """Unrecovered errors: −per for each failed tool call that no later successful call of the same tool in the episode made good."""

    name = "unrecovered_errors"
    level = "episode"
    scope = "episode"

    def __init__(self, *, per: float = 0.2, cap: int = 5, count_invalid: bool = True):
        _check(per >= 0 and cap >= 1, "need per ≥ 0 and cap ≥ 1")
        self.per, self.cap, self.count_invalid = float(per), int(cap), bool(count_invalid)

    def unrecovered(self, frame: StepsFrame) -> np.ndarray:
        """Bool per step: a failed call with no later success of the same tool in its episode."""
        call = frame.kind == TOOL_CALL
        failed = frame.tool_error.copy()
        if self.count_invalid:
            failed |= ~(frame.tool_known & frame.args_ok)
        failed &= call
        ok = call & ~failed
        key = frame.episode.astype(np.int64) * (len(frame.tool_names) + 1) + frame.tool.astype(np.int64) + 1
        # the last successful step of every (episode, tool): a failure before it was made good
        last_ok = pd.Series(np.flatnonzero(ok)).groupby(key[ok]).max()
        made_good_before = pd.Series(key[failed]).map(last_ok).to_numpy(dtype=np.float64)
        rows = np.flatnonzero(failed)
        out = np.zeros(frame.n_steps, dtype=bool)
        out[rows] = ~(made_good_before > rows)   # NaN (never succeeded) compares False: unrecovered
        return out

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        count = _per_episode(frame, np.flatnonzero(self.unrecovered(frame)))
        return -self.per * np.minimum(count, self.cap) + 0.0


@register
class AnswerConsistency(Component):
    """Answer consistency: how close (sentence embeddings) the agent's last words are to the last tool results before them; a linear ramp from ``low`` at cosine ``ramp_from`` to ``high`` at ``threshold``."""

    name = "answer_consistency"
    level = "episode"
    scope = "episode"
    uses_embeddings = True

    def __init__(self, *, context_calls: int = 3, threshold: float = 0.6, ramp_from: float = 0.0,
                 high: float = 1.0, low: float = 0.0, no_evidence_value: float = 0.5,
                 max_chars: int = 300):
        _check(context_calls >= 1, "context_calls must be ≥ 1")
        _check(-1.0 <= ramp_from < threshold <= 1.0, "need -1 ≤ ramp_from < threshold ≤ 1")
        _check(max_chars >= 16, "max_chars must be ≥ 16")
        self.context_calls, self.threshold, self.ramp_from = int(context_calls), float(threshold), float(ramp_from)
        self.high, self.low, self.no_evidence_value = float(high), float(low), float(no_evidence_value)
        self.max_chars = int(max_chars)

    def last_words_rows(self, frame: StepsFrame) -> np.ndarray:
        """Per episode the step of the agent's last words (reply or final answer), -1 when none."""
        return last_words_rows(frame)

    def cosines(self, frame: StepsFrame, ctx: ScoringContext) -> tuple[np.ndarray, np.ndarray]:
        """(max cosine of the last words to each of the last tool results before them, has
        evidence) per episode.  Each distinct text is embedded once."""
        last = last_words_rows(frame)
        episodes = np.flatnonzero(last >= 0)
        out_rows = last[episodes]
        ev_rows = np.flatnonzero((frame.kind == TOOL_CALL) & (frame.tool_text_len > 0))
        pair_out, pair_ev, n_pairs = evidence_pairs(frame, out_rows, ev_rows, self.context_calls)
        best = np.zeros(frame.n_episodes)
        has = np.zeros(frame.n_episodes, dtype=bool)
        if pair_out.size:
            used_ev = np.unique(pair_ev)
            evidence = readable(frame.tool_text[ev_rows[used_ev]].tolist())
            answers = frame.output_text[out_rows].tolist()
            codes, uniq = pd.factorize(np.array(answers + evidence, dtype=object))
            vectors = ctx.encode([str(x)[:self.max_chars] for x in uniq], what=self.name)
            answer_vec = vectors[codes[:len(answers)]]
            ev_vec = np.zeros((ev_rows.size, vectors.shape[1]), np.float32)
            ev_vec[used_ev] = vectors[codes[len(answers):]]
            cos = np.einsum("ij,ij->i", answer_vec[pair_out], ev_vec[pair_ev], dtype=np.float64)
            with_pairs = n_pairs > 0
            starts = np.concatenate([[0], np.cumsum(n_pairs)[:-1]])[with_pairs]
            best[episodes[with_pairs]] = np.maximum.reduceat(cos, starts)
            has[episodes[with_pairs]] = True
        return best, has

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        best, has = self.cosines(frame, ctx)
        score = consistency_curve(best, curve="linear", threshold=self.threshold, high=self.high,
                                  low=self.low, ramp_from=self.ramp_from)
        return np.where(has, score, self.no_evidence_value)


@register
class GivesUp(Component):
    """Gives up: ``value`` when the agent's last words say it could not do the task (unable, cannot, sorry, unfortunately…) and report nothing done (successfully, has been…)."""

    name = "gives_up"
    level = "episode"
    scope = "episode"

    def __init__(self, *, value: float = -1.0, give_up_words: list[str] | None = None,
                 done_words: list[str] | None = None):
        self.value = float(value)
        self.give_up_words = list(give_up_words if give_up_words is not None else GIVE_UP_WORDS)
        self.done_words = list(done_words if done_words is not None else DONE_WORDS)
        _check(all(isinstance(w, str) and w.strip() for w in self.give_up_words + self.done_words)
               and bool(self.give_up_words), "give_up_words and done_words must be non-empty words")

    def gave_up(self, frame: StepsFrame) -> np.ndarray:
        """Bool per episode: its last words give up and report nothing done."""
        last = last_words_rows(frame)
        has = last >= 0
        words = pd.Series(frame.output_text[last[has]], dtype=object).fillna("").astype(str)
        words = words.str.lower().str.replace("\u2019", "'", regex=False)
        give = words.str.contains(_word_pattern(self.give_up_words), regex=True).to_numpy(bool)
        done = (words.str.contains(_word_pattern(self.done_words), regex=True).to_numpy(bool)
                if self.done_words else np.zeros(give.shape, dtype=bool))
        out = np.zeros(frame.n_episodes, dtype=bool)
        out[has] = give & ~done
        return out

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        return np.where(self.gave_up(frame), self.value, 0.0) + 0.0
