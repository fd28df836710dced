"""Structured state encoding (docs/design.md §6, S000 §3.2).

The state at step ``t`` is built from three parts, intent, tool context and trace, never the
raw token stream.  :func:`extract_features` turns episodes into fixed-size
:class:`RawStateFeatures` (cached per dataset by :func:`raw_features_for_dataset`), step by step
with the one-step functions :func:`result_context`, :func:`step_context`, :func:`trace_arrays`
and :func:`intent_features` that serving calls too; :class:`StateEncoder` is the learned,
gated fusion of the three branches, trained with the policy and saved by :func:`save_encoder`;
:func:`encode_states` encodes raw features.  Trace rewards are gathered at batch time.

Details: docs/state.md (## The three parts of a state, ## Raw features and the encoder,
## Trace rewards in the features).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from core.base.embed import DIM as TEXT_DIM
from core.base import embed as text_embedding
from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError
from core.records.catalog import catalog_for_dataset

#: Bump when the raw feature layout or its meaning changes: cached artifacts of
#: another version are recomputed.
FEATURE_VERSION = 2
#: Steps of history in the trace encoder (S000: the last 3 steps).
TRACE_LEN = 3
#: Token id the catalog gives an invalid call, and the one used for "no step here".
INVALID_TOKEN = -1
PAD_TOKEN = -2

# --------------------------------------------------------------------------- intent rules
# Rules over the request text.  Each table maps a class to words that signal it;
# the class whose word appears first in the text wins (the main verb of
# "reduce exposure and then check the price" is reduce).  English and Chinese,
# since the seed's production data is Chinese.
VERBS: dict[str, tuple[str, ...]] = {
    "reduce": ("reduce", "trim", "cut", "lower", "decrease", "de-risk", "derisk", "scale back",
               "unwind", "offload", "deleverage", "减持", "减仓", "降低"),
    "sell": ("sell", "dump", "exit", "liquidate", "close out", "short", "卖出", "清仓", "抛"),
    "buy": ("buy", "purchase", "acquire", "accumulate", "add to", "increase", "go long", "invest",
            "买入", "增持", "加仓"),
    "rebalance": ("rebalance", "re-balance", "reallocate", "realign", "restore my target",
                  "target allocation", "调仓", "再平衡"),
    "hedge": ("hedge", "protect", "insure", "stop-loss", "stop loss", "对冲", "止损"),
    "arbitrage": ("arbitrage", "arb ", "spread between", "price gap", "mispricing", "premium", "套利"),
    "compare": ("compare", "versus", " vs", "benchmark against", "对比", "比较"),
    "analyse": ("analyse", "analyze", "analysis", "assess", "evaluate", "review", "research",
                "examine", "investigate", "study", "react to", "what does", "what do", "分析", "评估", "研究"),
    "check": ("check", "show", "get ", "look up", "lookup", "what is", "what's", "how much",
              "tell me", "find", "list", "查询", "查看"),
    "refund": ("refund", "return", "money back", "退款", "退货"),
    "cancel": ("cancel", "stop my", "取消"),
    "track": ("track", "where is", "status of", "delivery", "shipping", "跟踪", "物流"),
}
VERB_CLASSES: tuple[str, ...] = (*VERBS, "other")

URGENCY_HIGH: tuple[str, ...] = (
    "urgent", "urgently", "immediately", "asap", "right now", "right away", "emergency", "at once",
    "critical", "before the close", "before close", "before market close", "without delay",
    "紧急", "立即", "马上", "立刻")
URGENCY_MEDIUM: tuple[str, ...] = (
    "soon", "today", "quickly", "promptly", "this week", "by tomorrow", "shortly", "尽快", "今天")
URGENCY_LOW: tuple[str, ...] = (
    "no rush", "when convenient", "whenever", "long-term", "long term", "no hurry", "不急")
#: Urgency score of each level (the gates read this number).
URGENCY_LEVELS: dict[str, float] = {"none": 0.0, "low": 0.0, "medium": 0.5, "high": 1.0}

TARGETS: dict[str, tuple[str, ...]] = {
    "portfolio": ("portfolio", "position", "holding", "exposure", "allocation", "book",
                  "仓位", "持仓", "组合"),
    "stock": ("stock", "share", "equity", "equities", "ticker", "股票", "个股"),
    "bond": ("bond", "treasury", "yield", "债券", "国债"),
    "fund": ("fund", "etf", "基金"),
    "index": ("index", "market", "sector", "指数", "板块", "大盘"),
    "currency": ("currency", "fx", "forex", "usd", "eur", "cny", "汇率", "外汇"),
    "commodity": ("gold", "oil", "commodity", "commodities", "黄金", "原油"),
    "order": ("order", "package", "shipment", "订单", "包裹"),
    "account": ("account", "balance", "password", "账户", "余额"),
    "product": ("product", "item", "subscription", "商品", "产品"),
}
TARGET_KINDS: tuple[str, ...] = (*TARGETS, "other")
#: Buckets for the hashed target string (symbol or target word).
TARGET_BUCKETS = 64

#: Share of a holding said in words ("sell three quarters of my position"), read like a
#: percentage.  Each phrase must be followed by "of" in English, so "half-year" or "all
#: day" are not shares.
FRACTION_WORDS: dict[str, float] = {
    "a quarter of": 0.25, "one quarter of": 0.25, "a fourth of": 0.25,
    "a third of": 1 / 3, "one third of": 1 / 3, "half of": 0.5, "a half of": 0.5, "one half of": 0.5,
    "two thirds of": 2 / 3, "three quarters of": 0.75, "three fourths of": 0.75,
    "all of": 1.0, "the whole of": 1.0,
    "四分之一": 0.25, "三分之一": 1 / 3, "一半": 0.5, "三分之二": 2 / 3, "四分之三": 0.75, "全部": 1.0,
}
_FRACTION_TABLE: dict[str, tuple[str, ...]] = {
    str(v): tuple(w for w, x in FRACTION_WORDS.items() if x == v) for v in set(FRACTION_WORDS.values())}
#: Reporting periods a request names ("Q3 2024 results", "the half-year report").
PERIODS: dict[str, tuple[str, ...]] = {
    "q1": ("q1", "first-quarter", "first quarter", "1q", "一季度", "一季报"),
    "q2": ("q2", "second-quarter", "second quarter", "half-year", "half year", "interim", "2q",
           "二季度", "中报", "半年报"),
    "q3": ("q3", "third-quarter", "third quarter", "3q", "三季度", "三季报"),
    "q4": ("q4", "fourth-quarter", "fourth quarter", "4q", "四季度"),
    "annual": ("annual", "full-year", "full year", "fiscal year", "年报", "全年"),
}
PERIOD_CLASSES: tuple[str, ...] = (*PERIODS, "none")

_SYMBOL_RE = re.compile(r"(?<![\d.])(\d{6}|0\d{4})(?!\d)(?!\.\d)|\$([A-Za-z]{1,5})\b|\b([A-Z]{2,5})(?:\.[A-Z]{1,2})?\b")
_PCT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:%|percent|pct)")
_MONEY_RE = re.compile(r"(?:[$¥€£]\s?|(?:usd|cny|rmb|eur)\s?)(\d[\d,]*(?:\.\d+)?)\s*([kKmM]|million|thousand)?"
                       r"|(\d[\d,]*(?:\.\d+)?)\s*(?:dollars|usd|cny|rmb|yuan|元)", re.IGNORECASE)
# Uppercase words that are not tickers.
_NOT_SYMBOLS = frozenset({"I", "A", "AN", "THE", "AND", "OR", "ASAP", "USD", "EUR", "CNY", "RMB", "ETF",
                          "FX", "OK", "PLEASE", "NOW", "Q1", "Q2", "Q3", "Q4", "YTD", "CEO", "PNL", "P&L"})

#: Layout of the rule part of the intent features (one row per episode).
INTENT_RULE_DIM = len(VERB_CLASSES) + 2 + len(TARGET_KINDS) + TARGET_BUCKETS + 5 + len(PERIOD_CLASSES) + 2


@dataclass(frozen=True)
class IntentRules:
    """What the rules read from a request: the verb, how urgent it is, and its target."""

    verb: str
    urgency: str          # none | low | medium | high
    target_kind: str
    target: str | None    # the symbol or target word, when one was found
    percent: float | None  # a share as a fraction: "20%" and "a fifth of" alike
    amount: float | None
    period: str = "none"   # reporting period named in the request (PERIOD_CLASSES)

    @property
    def urgency_score(self) -> float:
        return URGENCY_LEVELS[self.urgency]


def _first_match(text: str, table: dict[str, tuple[str, ...]]) -> tuple[str | None, str | None]:
    """The class whose cue word occurs earliest in ``text`` (and that word)."""
    best: tuple[int, str, str] | None = None
    for cls, words in table.items():
        for w in words:
            pos = _find_word(text, w)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, cls, w)
    return (best[1], best[2]) if best else (None, None)


def _find_word(text: str, word: str) -> int:
    """Position of ``word`` in ``text`` at a word start (CJK words match anywhere)."""
    if not word.isascii():
        return text.find(word)
    start = 0
    while True:
        pos = text.find(word, start)
        if pos < 0:
            return -1
        if pos == 0 or not text[pos - 1].isalnum():
            return pos
        start = pos + 1


def extract_intent(query: str) -> IntentRules:
    """Verb / urgency / target of a request, by rules over its text.

    >>> r = extract_intent("Urgently reduce my exposure to 600519 by 20%")
    >>> (r.verb, r.urgency, r.target_kind, r.target, r.percent)
    ('reduce', 'high', 'portfolio', '600519', 0.2)
    """
    text = query or ""
    low = text.lower()
    verb, _ = _first_match(low, VERBS)
    if any(_find_word(low, w) >= 0 for w in URGENCY_LOW):
        urgency = "low"   # "no rush" wins over a stray "today"
    elif any(_find_word(low, w) >= 0 for w in URGENCY_HIGH) or text.count("!") >= 2:
        urgency = "high"
    elif any(_find_word(low, w) >= 0 for w in URGENCY_MEDIUM):
        urgency = "medium"
    else:
        urgency = "none"
    target_kind, target_word = _first_match(low, TARGETS)
    symbol = None
    for m in _SYMBOL_RE.finditer(text):
        cand = m.group(1) or m.group(2) or m.group(3)
        if cand and cand.upper() not in _NOT_SYMBOLS:
            symbol = cand.upper()
            break
    if symbol and target_kind is None:
        target_kind = "stock"
    pct = _PCT_RE.search(low)
    percent = float(pct.group(1)) / 100 if pct else None
    if percent is None:
        share, _ = _first_match(low, _FRACTION_TABLE)
        percent = float(share) if share is not None else None
    period, _ = _first_match(low, PERIODS)
    money = _MONEY_RE.search(text)
    amount = None
    if money:
        digits = (money.group(1) or money.group(3) or "").replace(",", "")
        try:
            amount = float(digits)
        except ValueError:
            amount = None
        scale = (money.group(2) or "").lower()
        if amount is not None and scale in ("k", "thousand"):
            amount *= 1e3
        elif amount is not None and scale in ("m", "million"):
            amount *= 1e6
    return IntentRules(verb=verb or "other", urgency=urgency, target_kind=target_kind or "other",
                       target=symbol or target_word, percent=percent, amount=amount,
                       period=period or "none")


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def intent_rule_vector(rules: IntentRules, query: str) -> np.ndarray:
    """The fixed-size numeric form of :class:`IntentRules` (``INTENT_RULE_DIM`` floats).

    Layout: verb one-hot | urgency score, high flag | target-kind one-hot | hashed
    target | percent flag, percent, log-percent, amount flag, log-amount | period one-hot | query
    length (chars, words) — the length lets a truncated query show up on the state map."""
    v = np.zeros(INTENT_RULE_DIM, dtype=np.float32)
    o = 0
    v[o + VERB_CLASSES.index(rules.verb)] = 1.0
    o += len(VERB_CLASSES)
    v[o] = rules.urgency_score
    v[o + 1] = float(rules.urgency == "high")
    o += 2
    v[o + TARGET_KINDS.index(rules.target_kind)] = 1.0
    o += len(TARGET_KINDS)
    if rules.target:
        v[o + _stable_hash("target:" + rules.target.lower()) % TARGET_BUCKETS] = 1.0
    o += TARGET_BUCKETS
    if rules.percent is not None:
        # the log too: a share of a holding is then a sum with the holding's log-scale
        # feature (LOG_SUFFIX), which the networks fit far more easily than a product
        v[o], v[o + 1] = 1.0, min(rules.percent, 1.0)
        v[o + 2] = max(math.log(max(min(rules.percent, 1.0), 1e-4)), -Z_CLIP) / Z_CLIP + 1.0
    if rules.amount is not None:
        v[o + 3], v[o + 4] = 1.0, min(math.log10(1.0 + rules.amount) / 9.0, 1.0)
    o += 5
    v[o + PERIOD_CLASSES.index(rules.period)] = 1.0
    o += len(PERIOD_CLASSES)
    v[o] = math.log1p(len(query)) / math.log1p(2000)
    v[o + 1] = min(len(query.split()) / 100.0, 1.0)
    return v


#: Index of the urgency score inside the intent rule vector (the gates read it).
URGENCY_INDEX = len(VERB_CLASSES)
URGENCY_HIGH_INDEX = URGENCY_INDEX + 1
#: Index of the percent flag and of the first period slot inside the intent rule vector.
PERCENT_INDEX = URGENCY_INDEX + 2 + len(TARGET_KINDS) + TARGET_BUCKETS
PERIOD_INDEX = PERCENT_INDEX + 5

# --------------------------------------------------------------------------- tool context
#: Hash buckets of the tool-result fields (numeric, categorical), of the result's tool
#: name, and of the observation's scalar state (numeric, categorical).
CTX_NUM, CTX_CAT, CTX_TOOL, OBS_NUM, OBS_CAT = 128, 64, 16, 64, 16
CTX_FLAGS = ("has_result", "result_error", "result_not_replayed", "steps_since_result", "step_t")
CONTEXT_DIM = CTX_NUM + CTX_CAT + CTX_TOOL + OBS_NUM + OBS_CAT + len(CTX_FLAGS)
_O_NUM = 0
_O_CAT = _O_NUM + CTX_NUM
_O_TOOL = _O_CAT + CTX_CAT
_O_OBS_NUM = _O_TOOL + CTX_TOOL
_O_OBS_CAT = _O_OBS_NUM + OBS_NUM
_O_FLAGS = _O_OBS_CAT + OBS_CAT
#: A normalised number is clipped to ±Z_CLIP robust standard deviations.
Z_CLIP = 5.0
#: Every number also enters on a log scale, ``sign(x)·log1p(|x|)`` under the key
#: ``<key>#log``: prices, share counts and amounts span orders of magnitude, where a
#: linear z clipped at ±Z_CLIP cannot tell 25 from 45, and products (a share of a
#: holding) become sums.
LOG_SUFFIX = "#log"


def signed_log(x: Any) -> Any:
    """``sign(x)·log1p(|x|)`` of an array, or of one float (plain ``math``: serving calls
    it per value; both give the same float64)."""
    if isinstance(x, float):
        return math.copysign(math.log1p(abs(x)), x)
    return np.sign(x) * np.log1p(np.abs(x))
#: Strings longer than this (or with more words) are free text, not a categorical value.
MAX_CATEGORY_CHARS, MAX_CATEGORY_WORDS = 48, 6
#: A result field is a key field when it is present in at least this share of the
#: tool's results (stable structure, not one-off noise), at most MAX_KEY_FIELDS per tool.
MIN_FIELD_COVERAGE, MAX_KEY_FIELDS = 0.2, 24
_MAX_DEPTH, _MAX_LEAVES = 3, 64
_NUMERIC_STR_RE = re.compile(r"^[+-]?\d+(?:\.\d+)?%?$")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _flatten_result(value: Any, prefix: str, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """Scalar leaves of a JSON-like tool result as ``(path, value)``.

    Lists of numbers become ``len``/``last``/``mean`` (a price series is summarised, not
    spelled out); a list of objects contributes its ``len`` and its first element."""
    if len(out) >= _MAX_LEAVES:
        return
    if isinstance(value, dict):
        if depth >= _MAX_DEPTH:
            return
        for k in sorted(value, key=str):
            _flatten_result(value[k], f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif isinstance(value, list):
        out.append((_join(prefix, "len"), float(len(value))))
        nums = [x for x in value if isinstance(x, (int, float)) and not isinstance(x, bool)]
        if nums and len(nums) == len(value):
            out.append((_join(prefix, "last"), float(nums[-1])))
            out.append((_join(prefix, "mean"), float(sum(nums)) / len(nums)))
        elif value and depth < _MAX_DEPTH:
            _flatten_result(value[0], f"{prefix or 'items'}[0]", out, depth + 1)
    elif isinstance(value, bool):
        out.append((prefix or "value", "true" if value else "false"))
    elif isinstance(value, (int, float)):
        out.append((prefix or "value", float(value)))
    elif isinstance(value, str):
        s = value.strip()
        if _NUMERIC_STR_RE.match(s):
            out.append((prefix or "value", float(s.rstrip("%")) / (100.0 if s.endswith("%") else 1.0)))
        elif len(s) <= MAX_CATEGORY_CHARS and len(s.split()) <= MAX_CATEGORY_WORDS:
            out.append((prefix or "value", s.lower()))
        # longer strings are free text (news bodies, reports): left to the reward's
        # consistency check, not part of the state


def _parse_result(result: Any) -> Any:
    """A tool result as a JSON value (results logged as JSON strings are parsed)."""
    if isinstance(result, str):
        s = result.strip()
        if s[:1] in "{[":
            try:
                return json.loads(s)
            except ValueError:
                return result
    return result


@dataclass
class FeatureStats:
    """What the context encoder learned from a dataset, reused for new steps (serving).

    ``key_fields`` lists each tool's key result fields; ``numeric`` maps a field key
    (``"tool:path"`` or ``"state:name"``) to its robust centre and scale."""

    key_fields: dict[str, list[str]] = field(default_factory=dict)
    numeric: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"key_fields": self.key_fields, "numeric": self.numeric}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FeatureStats":
        return cls(key_fields={k: list(v) for k, v in d.get("key_fields", {}).items()},
                   numeric={k: [float(a), float(b)] for k, (a, b) in d.get("numeric", {}).items()})


def _robust_centre_scale(values: np.ndarray) -> tuple[float, float]:
    """Median and a robust standard deviation (IQR/1.349, else MAD·1.4826, else std, else 1)."""
    med = float(np.median(values))
    q1, q3 = np.percentile(values, [25, 75])
    scale = float(q3 - q1) / 1.349
    if scale <= 1e-12:
        scale = float(np.median(np.abs(values - med))) * 1.4826
    if scale <= 1e-12:
        scale = float(np.std(values))
    return med, scale if scale > 1e-12 else 1.0


def _schema_key_fields(schema: ToolSchema | None) -> list[str] | None:
    """Key result fields declared by a tool schema (``meta.key_fields`` or ``meta.result_fields``)."""
    if schema is None:
        return None
    for name in ("key_fields", "result_fields"):
        declared = schema.meta.get(name)
        if isinstance(declared, list) and declared:
            return [str(x) for x in declared]
        if isinstance(declared, dict) and declared:
            return [str(x) for x in declared]
    return None


def _key_fields_from_data(tool_leaves: dict[str, list[list[tuple[str, Any]]]],
                          schemas: dict[str, ToolSchema]) -> dict[str, list[str]]:
    """Per tool: the schema's declared key fields, else the fields most results carry."""
    out: dict[str, list[str]] = {}
    for tool, results in tool_leaves.items():
        declared = _schema_key_fields(schemas.get(tool))
        if declared is not None:
            out[tool] = declared
            continue
        counts: dict[str, int] = {}
        for leaves in results:
            for path in {p for p, _ in leaves}:
                counts[path] = counts.get(path, 0) + 1
        need = MIN_FIELD_COVERAGE * len(results)
        ranked = sorted((p for p, c in counts.items() if c >= need), key=lambda p: (-counts[p], p))
        out[tool] = sorted(ranked[:MAX_KEY_FIELDS])
    return out


# --------------------------------------------------------------------------- one step's features
# extract_features featurises every logged step with the functions below, and
# core.serve.serving every served step with the same functions: training, evaluation and
# serving read the same numbers for the same step.  They work on one step at a time
# because serving builds one row per request, where plain Python over a dozen values
# avoids array code's per-call overhead, and a batch spends most of its time parsing the
# results anyway.

#: Progress flags count steps as ``log1p(steps) / log1p(PROGRESS_STEPS)`` (1 at that many steps).
PROGRESS_STEPS = 12
_LOG_PROGRESS = math.log1p(PROGRESS_STEPS)
#: Feature keys up to this length have their hash slot remembered: a stream of steps
#: hashes the same few field names again and again; longer keys are free text that
#: rarely comes back, and the bound keeps the memo small.
SLOT_MEMO_KEY_CHARS = 160

# Public names of the context-row layout (core.serve.fast_policy reads the flags).
O_NUM, O_CAT, O_TOOL, O_OBS_NUM, O_OBS_CAT, O_FLAGS = _O_NUM, _O_CAT, _O_TOOL, _O_OBS_NUM, _O_OBS_CAT, _O_FLAGS


def _hash_slot(key: str, buckets: int) -> tuple[int, float]:
    """Bucket and ±1 sign of a feature key (signed feature hashing keeps collisions unbiased)."""
    h = _stable_hash(key)
    return h % buckets, 1.0 if (h >> 40) & 1 else -1.0


_memo_slot = functools.lru_cache(maxsize=16384)(_hash_slot)


def feature_slot(key: str, buckets: int) -> tuple[int, float]:
    """:func:`_hash_slot`, remembered for keys up to :data:`SLOT_MEMO_KEY_CHARS` long."""
    return _memo_slot(key, buckets) if len(key) <= SLOT_MEMO_KEY_CHARS else _hash_slot(key, buckets)


def _hash_slots(keys: Sequence[str], buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`feature_slot` of many keys as arrays: buckets (int64) and signs (float64)."""
    slots = [feature_slot(k, buckets) for k in keys]
    return (np.array([b for b, _ in slots], dtype=np.int64).reshape(-1),
            np.array([s for _, s in slots], dtype=np.float64).reshape(-1))


def scatter_features(row: np.ndarray, items: Sequence[tuple[str, Any]], num_offset: int, num_buckets: int,
                     cat_offset: int, cat_buckets: int, numeric: Mapping[str, Sequence[float]]) -> None:
    """Add one step's ``(key, value)`` features to its float32 ``row``.

    A number adds its robust z under ``numeric`` (the key's learned centre and scale;
    clipped to ±Z_CLIP) at its key's signed hashed slot, and then, after every plain
    number, its :func:`signed_log` under ``key + LOG_SUFFIX``; a key the statistics never
    saw carries no reference and is skipped.  Any other value adds ±1 at the slot of
    ``key=value``."""

    def add_number(key: str, value: float) -> None:
        ref = numeric.get(key)
        if ref is None:
            return
        bucket, sign = feature_slot(key, num_buckets)
        z = min(max((value - ref[0]) / ref[1], -Z_CLIP), Z_CLIP)
        row[num_offset + bucket] += np.float32(sign * z)

    numbers = []
    for key, value in items:
        if isinstance(value, float):
            add_number(key, value)
            numbers.append((key, value))
        else:
            bucket, sign = feature_slot(f"{key}={value}", cat_buckets)
            row[cat_offset + bucket] += np.float32(sign)
    for key, value in numbers:
        add_number(key + LOG_SUFFIX, signed_log(float(value)))


def state_items(state: Any) -> list[tuple[str, Any]]:
    """The features of an observation's scalar state (``observation["state"]``, a served
    request's ``state``): ``("state:<name>", number)``, or the lower-cased text of a
    string or a flag; other values (None, lists) and a state that is not a mapping carry none."""
    if not isinstance(state, Mapping):
        return []
    items: list[tuple[str, Any]] = []
    for k, v in state.items():
        if isinstance(v, (bool, str)):
            items.append((f"state:{k}", str(v).lower()))
        elif isinstance(v, (int, float)):
            items.append((f"state:{k}", float(v)))
    return items


def result_leaves(result: Any) -> list[tuple[str, Any]]:
    """The scalar leaves of a tool result (:func:`_flatten_result`; a JSON string is parsed
    first); none for a missing result."""
    leaves: list[tuple[str, Any]] = []
    if result is not None:
        _flatten_result(_parse_result(result), "", leaves)
    return leaves


def _result_row(tool: str, leaves: Sequence[tuple[str, Any]], failed: bool, replayed: bool,
                stats: FeatureStats) -> np.ndarray:
    """``[CONTEXT_DIM]`` the tool-context part of one result from its flattened ``leaves``."""
    row = np.zeros(CONTEXT_DIM, dtype=np.float32)
    keep = frozenset(stats.key_fields.get(tool, ()))
    scatter_features(row, [(f"{tool}:{path}", value) for path, value in leaves if path in keep],
                     _O_NUM, CTX_NUM, _O_CAT, CTX_CAT, stats.numeric)
    row[_O_TOOL + feature_slot(f"tool:{tool}", CTX_TOOL)[0]] = 1.0
    row[_O_FLAGS + 1] = float(failed)
    row[_O_FLAGS + 2] = float(not replayed)
    return row


def result_context(tool: str, result: Any, error: str | None, stats: FeatureStats, *,
                   replayed: bool = True) -> np.ndarray:
    """``[CONTEXT_DIM]`` the tool-context row of one tool result: the tool's key result
    fields (numbers normalised by ``stats``, other values hashed), the tool's name slot
    and the error / not-replayed flags.  A tool ``stats`` has no key fields for (one the
    training data never called) contributes its name slot and flags only."""
    return _result_row(tool, result_leaves(result), error is not None, replayed, stats)


def set_progress(row: np.ndarray, since: int | None, step_t: int) -> None:
    """Write the progress flags of a context row: steps since the latest result (``since``;
    None: there is none) and the step index, each as log1p over :data:`PROGRESS_STEPS`."""
    row[_O_FLAGS + 3] = (0.0 if since is None else math.log1p(since)) / _LOG_PROGRESS
    row[_O_FLAGS + 4] = math.log1p(step_t) / _LOG_PROGRESS


def step_context(result_row: np.ndarray | None, since: int, step_t: int, state: Any, stats: FeatureStats, *,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``[CONTEXT_DIM]`` the encoder's context input at step ``step_t``: the latest result's
    row (:func:`result_context`, ``since`` steps ago; None: no result yet), the progress
    flags and the observation's scalar state (:func:`state_items`).  Written into ``out``
    when given (a row of a batch), else into a new row."""
    ctx = np.empty(CONTEXT_DIM, dtype=np.float32) if out is None else out
    if result_row is not None:
        ctx[:] = result_row
        ctx[_O_FLAGS + 0] = 1.0
    else:
        ctx[:] = 0.0
    set_progress(ctx, since if result_row is not None else None, step_t)
    scatter_features(ctx, state_items(state), _O_OBS_NUM, OBS_NUM, _O_OBS_CAT, OBS_CAT, stats.numeric)
    return ctx


def trace_arrays(tokens: Sequence[int] | np.ndarray, times: Sequence[float] | np.ndarray,
                 rewards: Sequence[float] | np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trace_action int64, trace_reward float32, trace_dt float32)`` of length TRACE_LEN,
    newest first, from the earlier steps' tokens, times (seconds) and rewards (oldest first)
    and the current step's time: PAD_TOKEN and zeros where there is no step, Δt as log1p
    of the seconds since the step (never negative)."""
    action = np.full(TRACE_LEN, PAD_TOKEN, dtype=np.int64)
    reward = np.zeros(TRACE_LEN, dtype=np.float32)
    dt = np.zeros(TRACE_LEN, dtype=np.float32)
    for k in range(min(len(tokens), TRACE_LEN)):
        i = len(tokens) - 1 - k
        action[k] = tokens[i]
        reward[k] = rewards[i]
        dt[k] = math.log1p(max(float(now) - float(times[i]), 0.0))
    return action, reward, dt


def trace_after(actions: np.ndarray, trace_action: np.ndarray, trace_reward: np.ndarray, trace_dt: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trace right after taking ``actions`` (``[N]``) in states whose traces are the
    ``[N, TRACE_LEN]`` arrays: the action enters as the newest step with reward 0 (not
    known yet) and Δt 0, and the oldest step leaves."""
    first = np.zeros((len(actions), 1), dtype=np.float32)
    return (np.concatenate([np.asarray(actions, dtype=np.int64)[:, None], trace_action[:, :-1]], axis=1),
            np.concatenate([first, trace_reward[:, :-1]], axis=1),
            np.concatenate([first, trace_dt[:, :-1]], axis=1))


def request_rules(query: str) -> np.ndarray:
    """``[INTENT_RULE_DIM]`` the rule part of a request's intent (:func:`extract_intent`)."""
    return intent_rule_vector(extract_intent(query), query)


def intent_features(queries: Sequence[str], embedder: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(intent_emb [E, 384] float32, intent_rules [E, INTENT_RULE_DIM] float32)`` of
    requests: their sentence embeddings by ``embedder`` and their rule vectors."""
    if not queries:
        return np.zeros((0, TEXT_DIM), dtype=np.float32), np.zeros((0, INTENT_RULE_DIM), dtype=np.float32)
    emb = np.asarray(embedder.encode(list(queries)), dtype=np.float32)
    rules: dict[str, np.ndarray] = {}
    for q in queries:
        if q not in rules:
            rules[q] = request_rules(q)
    return emb, np.stack([rules[q] for q in queries]).astype(np.float32, copy=False)


def _learn_numeric(items: Sequence[tuple[str, Any]]) -> dict[str, list[float]]:
    """Robust centre and scale of every numeric feature key in ``items`` (the key and its
    ``LOG_SUFFIX`` twin, as :func:`scatter_features` reads them)."""
    values: dict[str, list[float]] = {}
    for key, value in items:
        if isinstance(value, float):
            values.setdefault(key, []).append(value)
    stats: dict[str, list[float]] = {}
    for key, vals in values.items():
        arr = np.asarray(vals, dtype=np.float64)
        stats[key] = list(_robust_centre_scale(arr))
        stats[key + LOG_SUFFIX] = list(_robust_centre_scale(signed_log(arr)))
    return stats


# --------------------------------------------------------------------------- raw features
def write_atomic(target: Path, write: Callable[[Path], object]) -> Path:
    """Let ``write`` fill a temporary file beside ``target``, then rename it into place:
    readers see the old file or the new one, never half of one.  The temporary name is
    unique per process and thread, so two writers never share it."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


@dataclass
class RawStateFeatures:
    """The encoder's raw inputs for every step of a collection of episodes.

    Steps are flattened in episode order (episode 0 steps 0..n-1, then episode 1 …).
    Per-episode arrays (``intent_*``) are gathered per step by ``step_episode``."""

    episode_ids: list[str]
    #: [N] index of each step's episode, and its ``t``.
    step_episode: np.ndarray
    step_t: np.ndarray
    #: [N] catalog token of the action logged at this step (-1 = INVALID).
    action_token: np.ndarray
    #: [E, 384] sentence embedding of each episode's request; [E, INTENT_RULE_DIM] rules.
    intent_emb: np.ndarray
    intent_rules: np.ndarray
    #: [N, CONTEXT_DIM] tool-context features of the state before each step.
    context: np.ndarray
    #: [N, TRACE_LEN] flat step index of the k-th previous step (-1: none), its token
    #: (PAD_TOKEN when none) and log1p of the seconds from it to this step.
    trace_step: np.ndarray
    trace_action: np.ndarray
    trace_dt: np.ndarray
    n_actions: int
    stats: FeatureStats
    catalog_version: str = ""
    fingerprint: str = ""
    version: int = FEATURE_VERSION

    _ARRAYS = ("step_episode", "step_t", "action_token", "intent_emb", "intent_rules", "context",
               "trace_step", "trace_action", "trace_dt")

    @property
    def n_steps(self) -> int:
        return int(self.step_episode.shape[0])

    def check_rewards(self, rewards: np.ndarray | None) -> np.ndarray:
        """The per-step reward vector for the trace, or zeros when none is given."""
        if rewards is None:
            return np.zeros(self.n_steps, dtype=np.float32)
        r = np.asarray(rewards, dtype=np.float32).reshape(-1)
        if r.shape[0] != self.n_steps:
            raise InputError(f"got {r.shape[0]} per-step rewards for {self.n_steps} steps",
                             field="rewards")
        if not np.isfinite(r).all():
            raise InputError("per-step rewards contain NaN or infinity", field="rewards")
        return r

    def trace_rewards(self, rewards: np.ndarray | None, index: np.ndarray | None = None) -> np.ndarray:
        """[N or B, TRACE_LEN] rewards of the trace steps (0 where there is no step)."""
        r = self.check_rewards(rewards)
        ts = self.trace_step if index is None else self.trace_step[index]
        return np.where(ts >= 0, r[np.maximum(ts, 0)], 0.0).astype(np.float32)

    def step_batch(self, index: np.ndarray | None = None, rewards: np.ndarray | None = None,
                   device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """The encoder's input for steps ``index`` (all steps when None), as tensors.

        The simulator gathers rows of these per environment step; ``rewards`` is the
        per-step reward vector of the whole collection (zeros when None)."""
        idx = np.arange(self.n_steps) if index is None else np.asarray(index, dtype=np.int64)
        ep = self.step_episode[idx]
        batch = {
            "intent_emb": self.intent_emb[ep],
            "intent_rules": self.intent_rules[ep],
            "context": self.context[idx],
            "trace_action": self.trace_action[idx],
            "trace_reward": self.trace_rewards(rewards, idx),
            "trace_dt": self.trace_dt[idx],
        }
        return {k: torch.as_tensor(np.ascontiguousarray(v), device=device) for k, v in batch.items()}

    def raw_matrix(self, rewards: np.ndarray | None = None, *, intent: bool = True,
                   index: np.ndarray | None = None) -> np.ndarray:
        """[N or len(index), D] plain concatenation of the raw features (no learned weights).

        Each block (intent embedding, intent rules, context, trace) is scaled to unit
        mean row norm over the rows returned, so no block dominates by its width; the
        trace's tokens are one-hot.  ``intent=False`` leaves the intent blocks out (the
        ablation)."""
        idx = np.arange(self.n_steps) if index is None else np.asarray(index, dtype=np.int64)
        ep = self.step_episode[idx]
        blocks: list[np.ndarray] = []
        if intent:
            blocks.append(self.intent_emb[ep])
            blocks.append(self.intent_rules[ep])
        blocks.append(self.context[idx])
        onehot = np.zeros((len(idx), TRACE_LEN, self.n_actions + 2), dtype=np.float32)
        np.put_along_axis(onehot, (self.trace_action[idx] + 2)[..., None], 1.0, axis=2)
        trace = np.concatenate([onehot.reshape(len(idx), -1), self.trace_rewards(rewards, idx),
                                self.trace_dt[idx]], axis=1)
        blocks.append(trace)
        scaled = []
        for b in blocks:
            norm = float(np.linalg.norm(b, axis=1).mean())
            scaled.append(b / norm if norm > 0 else b)
        return np.concatenate(scaled, axis=1).astype(np.float32)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write ``<path>.safetensors`` (arrays) and ``<path>.json`` (the rest), atomically."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: np.ascontiguousarray(getattr(self, k)) for k in self._ARRAYS}
        write_atomic(path.with_name(path.name + ".safetensors"), lambda tmp: save_file(tensors, str(tmp)))
        meta = {"version": self.version, "fingerprint": self.fingerprint, "n_actions": self.n_actions,
                "catalog_version": self.catalog_version, "episode_ids": self.episode_ids,
                "stats": self.stats.to_dict()}
        # the JSON is written last: a reader that finds it finds matching arrays
        write_atomic(path.with_name(path.name + ".json"), lambda tmp: tmp.write_text(json.dumps(meta)))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RawStateFeatures":
        """Read what :meth:`save` wrote."""
        from safetensors.numpy import load_file

        path = Path(path)
        meta = json.loads(path.with_name(path.name + ".json").read_text())
        arrays = load_file(str(path.with_name(path.name + ".safetensors")))
        return cls(episode_ids=list(meta["episode_ids"]), n_actions=int(meta["n_actions"]),
                   stats=FeatureStats.from_dict(meta["stats"]), catalog_version=meta["catalog_version"],
                   fingerprint=meta["fingerprint"], version=int(meta["version"]),
                   **{k: arrays[k] for k in cls._ARRAYS})


def _step_clock(episodes: Sequence[Episode], step_episode: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Seconds from each episode's start to each step.

    Timestamps when every step of the episode has a parsable one; otherwise the sum of
    the latencies of the earlier steps (a step starts when the previous one ended);
    otherwise 0 (no timing logged).  Vectorised over steps with pandas/numpy."""
    import pandas as pd

    stamps = [s.timestamp for ep in episodes for s in ep.steps]
    lat = np.array([s.latency_ms if s.latency_ms is not None else 0.0
                    for ep in episodes for s in ep.steps], dtype=np.float64) / 1000.0
    first_row = starts[step_episode]          # each step's episode start (only episodes with steps)
    # latency clock: exclusive cumulative sum within each episode
    csum = np.cumsum(lat) - lat
    lat_clock = csum - csum[first_row]
    ts = pd.to_datetime(pd.Series(stamps, dtype=object), utc=True, errors="coerce", format="ISO8601")
    secs = (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds().to_numpy(dtype=np.float64)
    ok = ~np.isnan(secs)
    ep_all_ok = np.ones(len(episodes), dtype=bool)
    np.logical_and.at(ep_all_ok, step_episode, ok)
    secs = np.where(ok, secs, 0.0)
    return np.where(ep_all_ok[step_episode], secs - secs[first_row], lat_clock)


def extract_features(episodes: Sequence[Episode], catalog: Any, embedder: Any, *,
                     stats: FeatureStats | None = None, fingerprint: str = "") -> RawStateFeatures:
    """Raw state features of every step of ``episodes``.

    ``catalog`` maps logged actions to tokens (``normalize_many``; its ``tools`` give
    the schemas' declared key fields); ``embedder`` embeds the requests
    (:class:`core.base.embed.Embedder`, cached).  ``stats`` from an earlier extraction
    reuses its key fields and normalisation (new steps at serving time); without it
    they are learned from these episodes.

    Parsing tool results walks JSON, once per result; each result's row, each step's
    context and each step's trace are then built by the one-step functions serving uses
    (:func:`result_context`'s kernel, :func:`step_context`, :func:`trace_arrays`)."""
    n_eps = len(episodes)
    lengths = np.array([ep.n_steps for ep in episodes], dtype=np.int64)
    n = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if n_eps else np.zeros(0, np.int64)
    step_episode = np.repeat(np.arange(n_eps, dtype=np.int64), lengths)
    step_t = np.arange(n, dtype=np.int64) - starts[step_episode] if n else np.zeros(0, np.int64)
    steps = [s for ep in episodes for s in ep.steps]

    # --- action tokens of the logged actions
    if n:
        token = np.asarray(catalog.normalize_many([s.action for s in steps]).token_ids, dtype=np.int64)
    else:
        token = np.zeros(0, dtype=np.int64)
    n_actions = len(catalog.tokens)

    # --- intent: one embedding and one rule vector per episode
    intent_emb, intent_rules = intent_features([ep.task.query or "" for ep in episodes], embedder)

    # --- tool results and scalar states: parse once; learn key fields and normalisation
    schemas: dict[str, ToolSchema] = dict(getattr(catalog, "tools", {}) or {})
    has_result = [s.tool_result is not None or s.tool_error is not None for s in steps]
    res_rows = [i for i in range(n) if has_result[i]]
    res_tool = [steps[i].action.tool or steps[i].action.kind for i in res_rows]
    leaves = [result_leaves(steps[i].tool_result) for i in res_rows]
    states = [s.observation.get("state") if isinstance(s.observation, dict) else None for s in steps]
    learn = stats is None
    stats = FeatureStats() if stats is None else FeatureStats(dict(stats.key_fields), dict(stats.numeric))
    if learn:
        by_tool: dict[str, list[list[tuple[str, Any]]]] = {}
        for tool, lv in zip(res_tool, leaves):
            by_tool.setdefault(tool, []).append(lv)
        stats.key_fields = _key_fields_from_data(by_tool, schemas)
        key_sets = {t: frozenset(f) for t, f in stats.key_fields.items()}
        result_items = [(f"{tool}:{path}", value) for tool, lv in zip(res_tool, leaves)
                        for path, value in lv if path in key_sets[tool]]
        stats.numeric = {**dict(sorted(_learn_numeric(result_items).items())),
                         **dict(sorted(_learn_numeric([item for st in states for item in state_items(st)]).items()))}
    result_rows = [_result_row(tool, lv, steps[i].tool_error is not None, steps[i].result_replayed, stats)
                   for i, tool, lv in zip(res_rows, res_tool, leaves)]

    # --- each step's context (the latest result strictly before it in its episode) and trace
    context = np.zeros((n, CONTEXT_DIM), dtype=np.float32)
    trace_action = np.full((n, TRACE_LEN), PAD_TOKEN, dtype=np.int64)
    trace_dt = np.zeros((n, TRACE_LEN), dtype=np.float32)
    clock = _step_clock(episodes, step_episode, starts) if n else np.zeros(0)
    no_rewards = np.zeros(n, dtype=np.float32)   # trace rewards are gathered at batch time (trace_step)
    results = iter(result_rows)
    for e in range(n_eps):
        first = int(starts[e])
        latest: np.ndarray | None = None
        latest_t = 0
        for i in range(first, first + int(lengths[e])):
            t = i - first
            step_context(latest, t - latest_t, t, states[i], stats, out=context[i])
            lo = max(i - TRACE_LEN, first)
            trace_action[i], _, trace_dt[i] = trace_arrays(token[lo:i], clock[lo:i], no_rewards[lo:i], clock[i])
            if has_result[i]:
                latest, latest_t = next(results), t
    k = np.arange(1, TRACE_LEN + 1, dtype=np.int64)
    trace_step = np.arange(n, dtype=np.int64)[:, None] - k[None, :]
    trace_step = np.where(trace_step >= starts[step_episode][:, None], trace_step, -1) if n else \
        np.zeros((0, TRACE_LEN), np.int64)

    return RawStateFeatures(
        episode_ids=[ep.episode_id for ep in episodes], step_episode=step_episode, step_t=step_t,
        action_token=token, intent_emb=intent_emb, intent_rules=intent_rules.astype(np.float32),
        context=context, trace_step=trace_step.astype(np.int64), trace_action=trace_action.astype(np.int64),
        trace_dt=trace_dt, n_actions=n_actions, stats=stats,
        catalog_version=str(getattr(catalog, "version", "")), fingerprint=fingerprint)


# --------------------------------------------------------------------------- caching per dataset
def _slug(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48]
    return f"{clean}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def features_fingerprint(content_hashes: Sequence[str], catalog_version: str) -> str:
    """Identity of a feature extraction: the episodes (in order), the catalog, the layout
    and the text model.  A cached artifact with another fingerprint is recomputed."""
    h = hashlib.sha256()
    h.update(f"v{FEATURE_VERSION}|catalog:{catalog_version}|text:all-MiniLM-L6-v2|".encode())
    for c in content_hashes:
        h.update(c.encode())
        h.update(b"\n")
    return h.hexdigest()


def cached_features(ws: Any, key: str, episodes: Sequence[Episode] | None, catalog: Any, *,
                    content_hashes: Sequence[str] | None = None,
                    load_episodes: Any = None) -> RawStateFeatures:
    """Raw features cached under ``artifacts/states/<key>/``: loaded when the fingerprint
    matches, otherwise extracted (episodes given, or fetched by ``load_episodes()``) and saved."""

    if content_hashes is None:
        if episodes is None:
            raise ValueError("cached_features needs episodes or their content hashes")
        content_hashes = [ep.content_hash() for ep in episodes]
    fp = features_fingerprint(content_hashes, str(getattr(catalog, "version", "")))
    path = ws.artifact_dir("states", _slug(key)) / f"features-{fp[:16]}"
    if path.with_name(path.name + ".json").exists():
        raw = RawStateFeatures.load(path)
        if raw.fingerprint == fp and raw.version == FEATURE_VERSION:
            return raw
    if episodes is None:
        episodes = load_episodes()
    raw = extract_features(episodes, catalog, text_embedding.workspace_embedder(ws), fingerprint=fp)
    raw.save(path)
    # features of an earlier version of the same source are stale now: keep one set per source
    for old in path.parent.glob("features-*"):
        if not old.name.startswith(path.name + "."):
            old.unlink(missing_ok=True)
    return raw


def require_dataset(ws: Any, dataset: str) -> None:
    """Refuse an unknown dataset with an error that lists the known ones."""
    if not ws.has_dataset(dataset):
        known = ", ".join(d.name for d in ws.datasets()) or "none yet"
        raise InputError(f"no dataset named {dataset!r} in the workspace (known: {known}); "
                         "import episodes first with `rwb episodes import FILE`", field="dataset")


def raw_features_for_dataset(ws: Any, dataset: str, catalog: Any = None) -> RawStateFeatures:
    """Raw features of every step of a workspace dataset, computed once and cached.

    The cache is keyed by the episodes' content hashes (read from the database without
    loading the episodes) and the catalog version, so an import into the dataset or a
    catalog change recomputes it."""
    require_dataset(ws, dataset)
    if catalog is None:
        catalog = catalog_for_dataset(ws, dataset)
    hashes = [r[0] for r in ws.conn.execute(
        "SELECT content_hash FROM episodes WHERE dataset=? ORDER BY uid", (dataset,))]
    return cached_features(ws, f"dataset-{dataset}", None, catalog, content_hashes=hashes,
                           load_episodes=lambda: ws.load_episodes(dataset))


# --------------------------------------------------------------------------- the encoder
@dataclass
class StateEncoderConfig:
    """Configuration of :class:`StateEncoder` (saved next to its weights)."""

    #: Size of the encoded state (S000 compressed 12,800 token dims to 512).
    dim: int = 512
    #: "on": gates computed from the state; "off": equal weights 1/3 (the seed's ablation).
    gating: Literal["on", "off"] = "on"
    #: "off" drops the intent branch (and urgency from the gates) to measure what it carries.
    intent: Literal["on", "off"] = "on"
    #: Width of the learned embedding of one trace action token.
    action_embed_dim: int = 32
    #: g_intent at the highest urgency before any training (S000: ≈ 0.7).
    high_urgency_intent_gate: float = 0.7
    #: Least weight of every active branch.  Without a floor the state term of the gates
    #: can saturate in a few hundred optimiser steps and silence a branch for good: behaviour
    #: cloning can drive g_trace to 1, and then the first step (an empty trace) cannot see
    #: the request (docs/state.md, ## The gate floor).
    gate_floor: float = 0.1
    #: Seed of the initial weights (an untrained encoder is reproducible).
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("gating", "intent"):
            if getattr(self, name) not in ("on", "off"):
                raise InputError(f"{name} must be 'on' or 'off', not {getattr(self, name)!r}", field=name)
        if self.dim < 8:
            raise InputError(f"dim must be at least 8, not {self.dim}", field="dim")
        if not 0 <= self.gate_floor < 1 / 3:
            raise InputError("gate_floor must be in [0, 1/3)", field="gate_floor")
        if not 1 / 3 <= self.high_urgency_intent_gate < 1 - 2 * self.gate_floor:
            raise InputError(f"high_urgency_intent_gate must be in [1/3, {1 - 2 * self.gate_floor:g})",
                             field="high_urgency_intent_gate")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StateEncoderConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise InputError(f"unknown encoder settings: {', '.join(sorted(unknown))}", field="encoder")
        return cls(**d)


#: Features the gates read: urgency, high-urgency flag, has-result, result-error, trace fill.
GATE_FEATURES = ("urgency", "urgency_high", "has_result", "result_error", "trace_fill")


def _branch(in_dim: int, dim: int) -> nn.Sequential:
    """Two-layer MLP ending in LayerNorm, so the three branches reach the fusion at the
    same scale and the gates (not the input widths) decide their mix."""
    return nn.Sequential(nn.Linear(in_dim, dim), nn.GELU(), nn.Linear(dim, dim), nn.LayerNorm(dim))


class StateEncoder(nn.Module):
    """Intent, tool-context and trace branches fused by state-dependent gates.

    ``forward(batch)`` returns ``[B, dim]``; :meth:`gates` the ``[B, 3]`` weights
    (intent, context, trace).  ``batch`` is the dict of :meth:`RawStateFeatures.step_batch`:

    ==================  ===================  ==========================================
    ``intent_emb``      float [B, 384]       sentence embedding of the request
    ``intent_rules``    float [B, 54]        verb / urgency / target (:func:`intent_rule_vector`)
    ``context``         float [B, 293]       key fields of the latest tool result + state
    ``trace_action``    long  [B, 3]         tokens of steps t-1..t-3 (-1 INVALID, -2 none)
    ``trace_reward``    float [B, 3]         their rewards (0 where there is no step)
    ``trace_dt``        float [B, 3]         log1p(seconds from that step to this one)
    ==================  ===================  ==========================================

    A simulator that replaces the logged trace (counterfactual actions) writes its own
    ``trace_action`` / ``trace_reward`` rows; everything else is gathered by step index."""

    def __init__(self, config: StateEncoderConfig | None = None, *, n_actions: int):
        super().__init__()
        self.config = config or StateEncoderConfig()
        self.n_actions = int(n_actions)
        c = self.config
        # Seeded initialisation that leaves the caller's global RNG alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            self.intent_net = _branch(TEXT_DIM + INTENT_RULE_DIM, c.dim)
            self.context_net = _branch(CONTEXT_DIM, c.dim)
            # token + 2: index 0 = no step (PAD), 1 = INVALID, 2.. = catalog tokens
            self.action_embed = nn.Embedding(self.n_actions + 2, c.action_embed_dim)
            self.trace_net = _branch(TRACE_LEN * (c.action_embed_dim + 2), c.dim)
            # gate prior over interpretable features + a zero-initialised term over the
            # branch embeddings that training may grow
            self.gate_prior = nn.Linear(len(GATE_FEATURES), 3)
            self.gate_state = nn.Linear(3 * c.dim, 3)
        with torch.no_grad():
            self.gate_prior.weight.zero_()
            self.gate_prior.bias.zero_()
            # g = floor + (1 - 3·floor)·softmax; softmax([w, 0, 0])[0] = s  ⇔  w = log(2s / (1 - s)):
            # urgency 1 → g_intent = high_urgency_intent_gate
            g = (c.high_urgency_intent_gate - c.gate_floor) / (1 - 3 * c.gate_floor)
            self.gate_prior.weight[0, GATE_FEATURES.index("urgency")] = math.log(2 * g / (1 - g))
            self.gate_state.weight.zero_()
            self.gate_state.bias.zero_()

    # ------------------------------------------------------------------ branches
    def _branches(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        intent_in = torch.cat([batch["intent_emb"], batch["intent_rules"]], dim=-1).float()
        e_intent = self.intent_net(intent_in)
        if self.config.intent == "off":
            e_intent = torch.zeros_like(e_intent)
        e_context = self.context_net(batch["context"].float())
        tokens = (batch["trace_action"].long() + 2).clamp(0, self.n_actions + 1)
        a = self.action_embed(tokens)                                   # [B, L, A]
        num = torch.stack([batch["trace_reward"].float().clamp(-Z_CLIP, Z_CLIP),
                           batch["trace_dt"].float()], dim=-1)          # [B, L, 2]
        e_trace = self.trace_net(torch.cat([a, num], dim=-1).flatten(1))
        return e_intent, e_context, e_trace

    def _gate_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rules = batch["intent_rules"].float()
        ctx = batch["context"].float()
        urgency = rules[:, URGENCY_INDEX]
        high = rules[:, URGENCY_HIGH_INDEX]
        if self.config.intent == "off":
            urgency, high = torch.zeros_like(urgency), torch.zeros_like(high)
        fill = (batch["trace_action"] != PAD_TOKEN).float().mean(dim=1)
        return torch.stack([urgency, high, ctx[:, _O_FLAGS], ctx[:, _O_FLAGS + 1], fill], dim=1)

    def _gates(self, batch: dict[str, torch.Tensor], branches: tuple[torch.Tensor, ...]) -> torch.Tensor:
        b = branches[0].shape[0]
        if self.config.gating == "off":
            return torch.full((b, 3), 1.0 / 3.0, device=branches[0].device, dtype=branches[0].dtype)
        logits = self.gate_prior(self._gate_features(batch)) + self.gate_state(torch.cat(branches, dim=-1))
        floor = torch.full_like(logits, self.config.gate_floor)
        if self.config.intent == "off":
            # the intent branch is empty: give its weight to the others
            logits = logits.clone()
            logits[:, 0] = float("-inf")
            floor[:, 0] = 0.0
        return floor + (1.0 - floor.sum(dim=1, keepdim=True)) * torch.softmax(logits, dim=-1)

    # ------------------------------------------------------------------ public
    def gates(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 3] fusion weights (g_intent, g_context, g_trace); rows sum to 1."""
        return self._gates(batch, self._branches(batch))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        branches = self._branches(batch)
        g = self._gates(batch, branches)
        e_intent, e_context, e_trace = branches
        return g[:, 0:1] * e_intent + g[:, 1:2] * e_context + g[:, 2:3] * e_trace

    def config_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this module around saved weights."""
        return {"config": asdict(self.config), "n_actions": self.n_actions,
                "feature_version": FEATURE_VERSION}

    @classmethod
    def from_config_dict(cls, d: dict[str, Any]) -> "StateEncoder":
        if int(d.get("feature_version", -1)) != FEATURE_VERSION:
            raise InputError(f"encoder was built for state features v{d.get('feature_version')}, "
                             f"this Reward Workbench uses v{FEATURE_VERSION}; retrain it",
                             field="feature_version")
        # encoders saved before the gate floor existed ran without one
        config = {"gate_floor": 0.0, **d["config"]}
        return cls(StateEncoderConfig.from_dict(config), n_actions=int(d["n_actions"]))


def save_encoder(encoder: StateEncoder, folder: str | Path, name: str = "encoder") -> tuple[Path, Path]:
    """Write ``<name>.safetensors`` (weights) and ``<name>.json`` (config) into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights, meta = folder / f"{name}.safetensors", folder / f"{name}.json"
    tensors = {k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()}
    write_atomic(weights, lambda tmp: save_file(tensors, str(tmp)))
    write_atomic(meta, lambda tmp: tmp.write_text(json.dumps(encoder.config_dict(), indent=2)))
    return weights, meta


def load_encoder(folder: str | Path, name: str = "encoder", device: str | torch.device = "cpu") -> StateEncoder:
    """Rebuild the encoder :func:`save_encoder` wrote (weights must match the config exactly)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta_file = folder / f"{name}.json"
    if not meta_file.exists():
        raise InputError(f"no encoder config {meta_file}", file=str(meta_file))
    encoder = StateEncoder.from_config_dict(json.loads(meta_file.read_text()))
    encoder.load_state_dict(load_file(str(folder / f"{name}.safetensors"), device=str(device)), strict=True)
    return encoder.to(device)


def encode_states(raw: RawStateFeatures, config: StateEncoderConfig | None = None, *,
                  encoder: StateEncoder | None = None, rewards: np.ndarray | None = None,
                  index: np.ndarray | None = None, batch_size: int = 8192,
                  device: str | torch.device = "cpu") -> np.ndarray:
    """[N, dim] encoded states (no gradients), by ``encoder`` or a fresh seeded one.

    An untrained seeded encoder is a fair fidelity check of the raw features and the
    fusion (random projections keep the structure); a trained one comes from a run."""
    if encoder is None:
        encoder = StateEncoder(config, n_actions=raw.n_actions)
    if encoder.n_actions != raw.n_actions:
        raise InputError(f"the encoder knows {encoder.n_actions} action tokens, the features "
                         f"{raw.n_actions}: they come from different catalogs", field="n_actions")
    idx = np.arange(raw.n_steps) if index is None else np.asarray(index, dtype=np.int64)
    rewards = raw.check_rewards(rewards)
    encoder = encoder.to(device).eval()
    out = np.zeros((len(idx), encoder.config.dim), dtype=np.float32)
    with torch.no_grad():
        for lo in range(0, len(idx), batch_size):
            part = idx[lo:lo + batch_size]
            out[lo:lo + len(part)] = encoder(raw.step_batch(part, rewards, device)).cpu().numpy()
    return out
