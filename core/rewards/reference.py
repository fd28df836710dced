"""Slow, obvious per-step implementations of the components, for tests and the benchmark.

Each function walks the steps one by one in plain Python, the way one would
write the component without numpy.  The vectorised classes in
:mod:`core.rewards.components` must agree with them (tests) and beat them by a
wide margin (``benchmarks/bench_rewards.py``).  Not used when scoring.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict, deque

import numpy as np

from core.rewards.components import (ActionSmoothing, BusinessImpact, DuplicateCalls, EndsWithAnswer,
                                     EvidenceReliability, LatencyPenalty, LengthPenalty,
                                     OutputConsistency, ParamReasonableness, RepeatedFailures,
                                     ResolvedBonus, SentimentBonus, StepCost, TerminalOutcome,
                                     ToolValidity,
                                     readable)
from core.rewards.frame import KINDS, StepsFrame
from core.rewards.agent_signals import AnswerConsistency, GivesUp, UnrecoveredErrors, WriteActions, is_write_tool
from core.rewards.learned import LearnedOutcome
from core.rewards.criteria import (CallBudget, CommunicatedInfo, ExpectedCalls, UnexpectedWrites, said_exactly,
                                   value_similarity)


def _steps(frame: StepsFrame):
    """Plain per-step records: what a hand-written scorer would loop over."""
    names = frame.tool_names
    num: defaultdict[int, dict[tuple[str, str], float]] = defaultdict(dict)
    for s, k, v in zip(frame.num_step.tolist(), frame.num_key.tolist(), frame.num_value.tolist()):
        num[s][frame.num_keys[k]] = v
    cat: defaultdict[int, dict[tuple[str, str], str]] = defaultdict(dict)
    for s, k, v in zip(frame.cat_step.tolist(), frame.cat_key.tolist(), frame.cat_value.tolist()):
        cat[s][frame.cat_keys[k]] = frame.cat_values[v]
    for i in range(frame.n_steps):
        tool = int(frame.tool[i])
        yield {
            "i": i, "episode": int(frame.episode[i]), "t": int(frame.t[i]),
            "kind": KINDS[frame.kind[i]], "tool": names[tool] if tool >= 0 else None,
            "known": bool(frame.tool_known[i]), "args_ok": bool(frame.args_ok[i]),
            "error": bool(frame.tool_error[i]), "latency": float(frame.latency_ms[i]),
            "output": frame.output_text[i], "result": frame.tool_text[i],
            "call": frame.call_key[i], "num": num.get(i, {}), "cat": cat.get(i, {}),
        }


def tool_validity(frame: StepsFrame, c: ToolValidity) -> np.ndarray:
    out = []
    for s in _steps(frame):
        if s["kind"] != "tool_call":
            out.append(c.not_call_value)
        elif s["error"]:
            out.append(c.error_value)
        else:
            v = c.tool_part if s["known"] else 0.0
            v += c.args_part if (s["known"] and s["args_ok"]) else 0.0
            out.append(v)
    return np.array(out, dtype=np.float64)


def param_reasonableness(frame: StepsFrame, c: ParamReasonableness) -> np.ndarray:
    steps = list(_steps(frame))
    by_time = [steps[i] for i in frame.time_order.tolist()]
    # which categorical parameters are judged (low cardinality over the whole data)
    seen_values: dict[tuple, set] = defaultdict(set)
    counts: dict[tuple, int] = defaultdict(int)
    for s in steps:
        for k, v in s["cat"].items():
            seen_values[k].add(v)
            counts[k] += 1
    judged = {k for k in counts if c.categorical == "all" or (
        c.categorical == "low_cardinality" and len(seen_values[k]) / counts[k] <= c.max_distinct_ratio)}
    history: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=c.window))
    out = np.zeros(frame.n_steps)
    for s in by_time:
        if s["kind"] != "tool_call":
            out[s["i"]] = c.neutral
            continue
        scores = []
        for k, x in s["num"].items():
            if k[1] in c.ignore:
                continue
            window = list(history[("num",) + k])
            if len(window) < c.min_history:
                scores.append(c.max_value)
            else:
                mean = sum(window) / len(window)
                std = math.sqrt(sum((w - mean) ** 2 for w in window) / len(window))
                std = max(std, c.min_std, c.rel_std * abs(mean))
                z = abs(x - mean) / std
                if z <= c.z_ok:
                    scores.append(c.max_value)
                else:
                    scores.append(min(max(c.max_value * (1 - (z - c.z_ok) / (c.z_zero - c.z_ok)), 0.0),
                                      c.max_value))
        for k, v in s["cat"].items():
            if k[1] in c.ignore or k not in judged or c.categorical == "none":
                continue
            window = list(history[("cat",) + k])
            if len(window) < c.min_history:
                scores.append(c.max_value)
            else:
                freq = window.count(v) / len(window)
                scores.append(c.max_value * min(1.0, freq / c.min_freq))
        out[s["i"]] = min(scores) if scores else c.max_value
        for k, x in s["num"].items():
            history[("num",) + k].append(x)
        for k, v in s["cat"].items():
            history[("cat",) + k].append(v)
    return out


def _evidence_before(frame: StepsFrame, c) -> dict[int, list[int]]:
    """For each output step row: rows of earlier tool results in its episode (last N)."""
    out: dict[int, list[int]] = {}
    evidence: dict[int, list[int]] = defaultdict(list)
    for s in _steps(frame):
        if s["kind"] in c.apply_to and s["output"]:
            rows = list(evidence[s["episode"]])
            out[s["i"]] = rows[-c.context_calls:] if c.context_calls else rows
        if s["kind"] == "tool_call" and s["result"]:
            evidence[s["episode"]].append(s["i"])
    return out


def output_consistency(frame: StepsFrame, c: OutputConsistency, embedder) -> np.ndarray:
    out = np.full(frame.n_steps, c.neutral)
    for row, ev in _evidence_before(frame, c).items():
        if not ev:
            out[row] = c.no_evidence_value
            continue
        a = embedder.encode([frame.output_text[row][:c.max_chars]])[0].astype(np.float64)
        sims = []
        for j in ev:
            text = readable([frame.tool_text[j]])[0] if c.readable else frame.tool_text[j]
            sims.append(float(np.dot(a, embedder.encode([text[:c.max_chars]])[0].astype(np.float64))))
        cos = max(sims) if c.aggregate == "max" else sum(sims) / len(sims)
        if c.curve == "step" or cos > c.threshold:
            out[row] = c.high if cos > c.threshold else c.low
        else:
            ramp = c.low + (c.high - c.low) * (cos - c.ramp_from) / (c.threshold - c.ramp_from)
            out[row] = min(max(ramp, min(c.low, c.high)), max(c.low, c.high))
    return out


def evidence_reliability(frame: StepsFrame, c: EvidenceReliability) -> np.ndarray:
    out = np.full(frame.n_steps, c.neutral)
    for row, ev in _evidence_before(frame, c).items():
        if not ev:
            out[row] = c.no_evidence_value
            continue
        flagged = [any(m in frame.tool_text[j] for m in c.markers) for j in ev]
        share = sum(flagged) / len(flagged)
        out[row] = c.high - (c.high - c.low) * (1.0 if (c.any_flag and share > 0) else share)
    return out


def business_impact(frame: StepsFrame, c: BusinessImpact) -> np.ndarray:
    out = []
    last = {int(e): int(s + n - 1) for e, (s, n) in enumerate(zip(frame.ep_start, frame.ep_len))}
    for s in _steps(frame):
        x = getattr(frame, c.field)[s["episode"]]
        if math.isnan(x) and c.fallback_field:
            x = getattr(frame, c.fallback_field)[s["episode"]]
        v = c.missing_value if math.isnan(x) else min(max(c.scale * x + c.offset, c.low), c.high)
        out.append(v if c.on == "all" or s["i"] == last[s["episode"]] else 0.0)
    return np.array(out, dtype=np.float64)


def latency_penalty(frame: StepsFrame, c: LatencyPenalty) -> np.ndarray:
    out = []
    for s in _steps(frame):
        units = 0.0 if math.isnan(s["latency"]) else s["latency"] / c.unit_ms
        if c.cap_units is not None:
            units = min(units, c.cap_units)
        out.append(-c.per * units + 0.0)
    return np.array(out, dtype=np.float64)


def action_smoothing(frame: StepsFrame, c: ActionSmoothing) -> np.ndarray:
    out = np.zeros(frame.n_steps)
    calls_so_far: dict[int, list[str]] = defaultdict(list)
    opposite = {(a, b) for a, b in c.opposites} | {(b, a) for a, b in c.opposites}
    for s in _steps(frame):
        if s["kind"] != "tool_call":
            continue
        key = s["tool"]
        if c.key_param is not None:
            for (tool, param), v in s["cat"].items():
                if param == c.key_param:
                    key = f"{tool}:{v}"
        past = calls_so_far[s["episode"]]
        if c.opposites and not any(key == x for pair in opposite for x in pair):
            continue  # actions without an opposite do not take part
        if c.opposites:
            if past and (key, past[-1]) in opposite:
                out[s["i"]] = -c.per
        elif len(past) >= 2 and past[-2] == key and past[-1] != key:
            out[s["i"]] = -c.per
        past.append(key)
    return out


def step_cost(frame: StepsFrame, c: StepCost) -> np.ndarray:
    return np.array([-c.per + 0.0 if s["kind"] in c.kinds else 0.0 for s in _steps(frame)], dtype=np.float64)


def _repeats(frame: StepsFrame, per: float, cap: int, key_of) -> np.ndarray:
    """−per × (earlier tool calls of the episode with the same key, at most cap); a call
    whose ``key_of`` is None is neither charged nor counted."""
    out = np.zeros(frame.n_steps)
    seen: dict[tuple, int] = defaultdict(int)
    for s in _steps(frame):
        key = key_of(s) if s["kind"] == "tool_call" else None
        if key is None:
            continue
        out[s["i"]] = -per * min(seen[(s["episode"], *key)], cap) + 0.0
        seen[(s["episode"], *key)] += 1
    return out


def repeated_failures(frame: StepsFrame, c: RepeatedFailures) -> np.ndarray:
    def key_of(s):
        failed = s["error"] or (c.count_invalid and not (s["known"] and s["args_ok"]))
        return (s["call"] if c.match == "call" else s["tool"],) if failed else None
    return _repeats(frame, c.per, c.cap, key_of)


def duplicate_calls(frame: StepsFrame, c: DuplicateCalls) -> np.ndarray:
    def key_of(s):
        whole = c.match == "tool" and s["tool"] not in c.exempt
        return ("tool", s["tool"]) if whole else ("call", s["call"])
    return _repeats(frame, c.per, c.cap, key_of)


def _episode_values(frame: StepsFrame, fn) -> np.ndarray:
    return np.array([fn(e) for e in range(frame.n_episodes)], dtype=np.float64)


def resolved_bonus(frame: StepsFrame, c: ResolvedBonus) -> np.ndarray:
    def one(e):
        r = frame.resolved[e]
        return c.missing_value if math.isnan(r) else c.resolved_value if r else c.unresolved_value
    return _episode_values(frame, one)


def sentiment_bonus(frame: StepsFrame, c: SentimentBonus) -> np.ndarray:
    return _episode_values(frame, lambda e: c.missing_value if math.isnan(frame.sentiment[e])
                           else c.per * frame.sentiment[e])


def length_penalty(frame: StepsFrame, c: LengthPenalty) -> np.ndarray:
    def one(e):
        kinds = [KINDS[k] for k in frame.kind[frame.episode == e]]
        n = {"steps": len(kinds), "tool_calls": kinds.count("tool_call"),
             "replies": kinds.count("reply") + kinds.count("final_answer")}[c.count]
        return -c.per * max(n - c.free, 0) + 0.0
    return _episode_values(frame, one)


def terminal_outcome(frame: StepsFrame, c: TerminalOutcome) -> np.ndarray:
    def one(e):
        x = getattr(frame, c.field)[e]
        if math.isnan(x) and c.fallback_field:
            x = getattr(frame, c.fallback_field)[e]
        return c.missing_value if math.isnan(x) else min(max(c.scale * x + c.offset, c.low), c.high)
    return _episode_values(frame, one)


def ends_with_answer(frame: StepsFrame, c: EndsWithAnswer) -> np.ndarray:
    def one(e):
        n = frame.ep_len[e]
        if n == 0:
            return c.no_answer_value
        last = frame.ep_start[e] + n - 1
        ok = KINDS[frame.kind[last]] in ("final_answer", "reply") and len(frame.output_text[last]) >= c.min_chars
        return c.answer_value if ok else c.no_answer_value
    return _episode_values(frame, one)


def learned_outcome(frame: StepsFrame, c: LearnedOutcome, embedder) -> np.ndarray:
    if not c.features:
        return np.full(frame.n_episodes, (c.low + c.high) / 2)
    steps = list(_steps(frame))
    last_text = {}
    for i in range(frame.n_steps):
        if len(frame.output_text[i]) > 0:
            last_text[int(frame.episode[i])] = str(frame.output_text[i])
    vectors = (np.asarray(embedder.encode([last_text.get(e, "") for e in range(frame.n_episodes)]))
               if c.embed == "last_words" else np.zeros((frame.n_episodes, 0)))
    writes = np.bincount(frame.episode, weights=-write_actions(frame, WriteActions(per=1.0)),
                         minlength=frame.n_episodes)
    unrecovered = -unrecovered_errors(frame, UnrecoveredErrors(per=1.0, cap=10 ** 9))
    cosines = answer_cosines(frame, AnswerConsistency(), embedder) if c.embed == "last_words" else None
    out = np.empty(frame.n_episodes)
    for e in range(frame.n_episodes):
        mine = [s for s in steps if s["episode"] == e]
        calls = [s for s in mine if s["kind"] == "tool_call"]
        n_calls = len(calls)
        errors = sum(s["error"] for s in calls)
        repeats = n_calls - len({int(frame.call_key[s["i"]]) for s in calls})
        last = mine[-1] if mine else None
        answered = bool(last and last["kind"] in ("reply", "final_answer") and len(frame.output_text[last["i"]]) > 0)
        x = [len(mine), n_calls, errors, sum(not (s["known"] and s["args_ok"]) for s in calls),
             len({s["tool"] for s in calls}), repeats,
             sum(s["kind"] in ("reply", "final_answer") for s in mine), float(answered),
             errors / n_calls if n_calls else 0.0, repeats / n_calls if n_calls else 0.0,
             writes[e], unrecovered[e],
             *([] if cosines is None else [cosines[e] or 0.0, float(cosines[e] is not None)]),
             *vectors[e].tolist()]
        z = c.intercept + sum((v - m) / sc * w for v, m, sc, w in zip(x, c.mean, c.scale, c.coef))
        out[e] = c.low + (c.high - c.low) / (1.0 + math.exp(-min(max(z, -50.0), 50.0)))
    return out


def write_actions(frame: StepsFrame, c: WriteActions) -> np.ndarray:
    out: list[float] = []
    writes_so_far: defaultdict[int, int] = defaultdict(int)
    for s in _steps(frame):
        writes = s["kind"] == "tool_call" and is_write_tool(s["tool"], tuple(v.lower() for v in c.read_verbs))
        if writes:
            writes_so_far[s["episode"]] += 1
        out.append(-c.per if writes and writes_so_far[s["episode"]] > c.free else 0.0)
    return np.array(out, dtype=np.float64) + 0.0


def unrecovered_errors(frame: StepsFrame, c: UnrecoveredErrors) -> np.ndarray:
    steps = list(_steps(frame))

    def one(e):
        mine = [s for s in steps if s["episode"] == e and s["kind"] == "tool_call"]
        n = 0
        for i, s in enumerate(mine):
            failed = s["error"] or (c.count_invalid and not (s["known"] and s["args_ok"]))
            later_ok = any(x["tool"] == s["tool"] and not x["error"]
                           and (not c.count_invalid or (x["known"] and x["args_ok"])) for x in mine[i + 1:])
            n += failed and not later_ok
        return -c.per * min(n, c.cap) + 0.0
    return _episode_values(frame, one)


def answer_cosines(frame: StepsFrame, c: AnswerConsistency, embedder) -> list[float | None]:
    """Per episode the best cosine of the last words to the last tool results (None: no evidence)."""
    steps = list(_steps(frame))
    out: list[float | None] = []
    for e in range(frame.n_episodes):
        mine = [s for s in steps if s["episode"] == e]
        said = [s for s in mine if s["kind"] in ("reply", "final_answer") and len(s["output"]) > 0]
        last = said[-1] if said else None
        evidence = [s for s in mine if last is not None and s["kind"] == "tool_call" and len(s["result"]) > 0
                    and s["i"] < last["i"]][-c.context_calls:]
        if not evidence or last is None:  # evidence is only gathered with a last answer
            out.append(None)
            continue
        texts = [str(last["output"])[:c.max_chars]] + [readable([str(s["result"])])[0][:c.max_chars] for s in evidence]
        vectors = np.asarray(embedder.encode(texts), dtype=np.float32).astype(np.float64)
        out.append(max(float(np.dot(vectors[0], v)) for v in vectors[1:]))
    return out


def answer_consistency(frame: StepsFrame, c: AnswerConsistency, embedder) -> np.ndarray:
    out = np.full(frame.n_episodes, c.no_evidence_value)
    for e, cos in enumerate(answer_cosines(frame, c, embedder)):
        if cos is None:
            continue
        if cos > c.threshold:
            out[e] = c.high
        else:
            ramp = c.low + (c.high - c.low) * (cos - c.ramp_from) / (c.threshold - c.ramp_from)
            out[e] = min(max(ramp, min(c.low, c.high)), max(c.low, c.high))
    return out



def gives_up(frame: StepsFrame, c: GivesUp) -> np.ndarray:
    last: dict[int, str] = {}
    for s in _steps(frame):
        if s["kind"] in ("reply", "final_answer") and s["output"]:
            last[s["episode"]] = str(s["output"]).lower().replace("\u2019", "'")
    out = np.zeros(frame.n_episodes)
    for e, words in last.items():
        says = [w.lower() for w in c.give_up_words if re.search(r"\b" + re.escape(w.lower()), words)]
        done = [w.lower() for w in c.done_words if re.search(r"\b" + re.escape(w.lower()), words)]
        if says and not done:
            out[e] = c.value
    return out


# --------------------------------------------------------------------------- task criteria
def _calls_of(frame: StepsFrame, e: int, count_failed: bool) -> list[tuple[str, dict]]:
    return [(s["tool"], json.loads(frame.params_json[s["i"]]) if frame.params_json[s["i"]] else {})
            for s in _steps(frame) if s["episode"] == e and s["kind"] == "tool_call"
            and (count_failed or not s["error"])]


def _best_assignment(expected: list[dict], made: list[tuple[str, dict]]) -> tuple[list[float], list[int]]:
    """Every way of pairing expected calls with distinct made calls of the same name (brute
    force): the credits and, per made call, its expected call (-1: none) of the best one."""
    best: tuple[float, int, list[float], list[int]] = (-1.0, -1, [], [])

    def walk(i: int, used: list[int], credits: list[float]) -> None:
        nonlocal best
        if i == len(expected):
            key = (sum(credits), sum(1 for u in used if u >= 0))
            if key > best[:2]:
                assigned = [-1] * len(made)
                for k, j in enumerate(used):
                    if j >= 0:
                        assigned[j] = k
                best = (key[0], key[1], list(credits), assigned)
            return
        walk(i + 1, used + [-1], credits + [0.0])
        for j, (tool, args) in enumerate(made):
            if j not in used and tool.lower() == expected[i]["name"].lower():
                walk(i + 1, used + [j], credits + [value_similarity(expected[i]["arguments"], args)])

    walk(0, [], [])
    return best[2], best[3]


def expected_calls(frame: StepsFrame, c: ExpectedCalls, criteria: list | None = None) -> np.ndarray:
    out = []
    for e in range(frame.n_episodes):
        crit = criteria[e] if criteria else None
        if crit is None:
            out.append(c.no_criteria_value)
            continue
        expected = [x for x in crit["expected_calls"] if not c.writes_only or is_write_tool(x["name"])]
        if not expected:
            out.append(1.0)
            continue
        credits, _ = _best_assignment(expected, _calls_of(frame, e, c.count_failed))
        out.append(sum(x ** c.power for x in credits) / len(expected))
    return np.array(out, dtype=np.float64)


def unexpected_writes(frame: StepsFrame, c: UnexpectedWrites, criteria: list | None = None) -> np.ndarray:
    out = []
    for e in range(frame.n_episodes):
        crit = criteria[e] if criteria else None
        if crit is None:
            out.append(c.no_criteria_value)
            continue
        made = _calls_of(frame, e, c.count_failed)
        _, assigned = _best_assignment(crit["expected_calls"], made)
        forbidden = [f.lower() for f in crit.get("forbidden_tools", [])]
        n = sum(1 for (tool, _), j in zip(made, assigned)
                if tool.lower() in forbidden or (j < 0 and is_write_tool(tool)))
        out.append(-c.per * min(n, c.cap) + 0.0)
    return np.array(out, dtype=np.float64)


def communicated_info(frame: StepsFrame, c: CommunicatedInfo, embedder, criteria: list | None = None) -> np.ndarray:
    steps = list(_steps(frame))
    out = []
    for e in range(frame.n_episodes):
        crit = criteria[e] if criteria else None
        if crit is None:
            out.append(c.no_criteria_value)
            continue
        said = [str(s["output"]) for s in steps if s["episode"] == e and s["kind"] in ("reply", "final_answer")
                and len(s["output"]) > 0]
        found = 0
        for item in crit["communicate"]:
            if said_exactly(item, "\n".join(said)):
                found += 1
            elif c.use_embeddings and said:
                vectors = np.asarray(embedder.encode([item[:c.max_chars]] + [m[:c.max_chars] for m in said]),
                                     dtype=np.float64)
                found += max(float(np.dot(vectors[0], v)) for v in vectors[1:]) >= c.threshold
        out.append(found / len(crit["communicate"]) if crit["communicate"] else c.nothing_to_say_value)
    return np.array(out, dtype=np.float64)


def call_budget(frame: StepsFrame, c: CallBudget, criteria: list | None = None) -> np.ndarray:
    steps = list(_steps(frame))
    out = []
    for e in range(frame.n_episodes):
        crit = criteria[e] if criteria else None
        if crit is None or crit.get("call_budget") is None:
            out.append(0.0)
            continue
        n = sum(1 for s in steps if s["episode"] == e and s["kind"] == "tool_call")
        out.append(-c.per * min(max(n - crit["call_budget"], 0), c.cap) + 0.0)
    return np.array(out, dtype=np.float64)


#: component name -> reference function (text components also take the embedder).
REFERENCES = {
    "tool_validity": tool_validity, "param_reasonableness": param_reasonableness,
    "output_consistency": output_consistency, "evidence_reliability": evidence_reliability,
    "business_impact": business_impact, "latency_penalty": latency_penalty,
    "action_smoothing": action_smoothing, "repeated_failures": repeated_failures, "step_cost": step_cost,
    "duplicate_calls": duplicate_calls,
    "resolved_bonus": resolved_bonus, "sentiment_bonus": sentiment_bonus,
    "length_penalty": length_penalty, "terminal_outcome": terminal_outcome,
    "ends_with_answer": ends_with_answer, "learned_outcome": learned_outcome,
    "write_actions": write_actions, "unrecovered_errors": unrecovered_errors,
    "answer_consistency": answer_consistency, "gives_up": gives_up,
    "expected_calls": expected_calls, "unexpected_writes": unexpected_writes,
    "communicated_info": communicated_info, "call_budget": call_budget,
}
