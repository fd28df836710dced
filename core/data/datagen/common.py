"""Shared machinery of the episode generators.

Counter-based random numbers (SplitMix64 over ``(key, counter)``, in numpy bulk), so the
same seed gives a byte-identical file on any machine and a task can be rebuilt from its
``task_seed``; :class:`Draws`, one episode's block of uniforms for the sequential behaviour
code; :func:`check_args`, a call checked against its function schema with the normalizer's
reasons; :func:`plan_episodes`, which behaviour runs which task (honest twins included);
:class:`Recorder`, which writes steps as canonical JSON without a pydantic round trip.

Details: docs/datasets.md (## Reproducible random numbers, ## Shared machinery).
"""

from __future__ import annotations

import functools
import json
import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.records.catalog import json_type_name

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
_TWO_53 = 2.0 ** -53


# --------------------------------------------------------------------------- random numbers

def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on a uint64 array (wrap-around arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def stream_keys(seed: int, stream: str, n: int, start: int = 0) -> np.ndarray:
    """uint64 keys ``start .. start+n-1`` of the named stream of a seed (index i → key i,
    whatever ``start``: a chunk of a stream equals the same slice of the whole stream)."""
    tag = (int(seed) & _MASK64) ^ ((zlib.crc32(stream.encode()) << 32) & _MASK64)
    root = splitmix64(np.array([tag], dtype=np.uint64))
    return splitmix64(root + np.arange(start, start + n, dtype=np.uint64) * _GOLDEN)


def uniforms(keys: np.ndarray, n: int, offset: int = 0) -> np.ndarray:
    """Uniform [0, 1) floats, shape ``[len(keys), n]``: value ``(key, offset + j)``."""
    base = splitmix64(np.asarray(keys, dtype=np.uint64))
    counters = np.arange(offset, offset + n, dtype=np.uint64) * _GOLDEN
    bits = splitmix64(base[:, None] ^ counters[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * _TWO_53


def seeds53(keys: np.ndarray) -> list[int]:
    """Public 53-bit integer seeds (exact in JSON and JavaScript) from uint64 keys."""
    return (splitmix64(keys) >> np.uint64(11)).astype(np.int64).tolist()


class Draws:
    """One episode's stream of uniforms, consumed in order by behaviour code.

    The first block is computed in bulk for all episodes; a long episode that runs
    out extends its own stream deterministically (same key, next counters)."""

    __slots__ = ("_key", "_buf", "_i")

    BLOCK = 96

    def __init__(self, key: int, block: list[float]):
        self._key = key
        self._buf = block
        self._i = 0

    def u(self) -> float:
        """Next uniform in [0, 1)."""
        if self._i >= len(self._buf):
            more = uniforms(np.array([self._key], dtype=np.uint64), self.BLOCK, offset=len(self._buf))
            self._buf = self._buf + more[0].tolist()
        v = self._buf[self._i]
        self._i += 1
        return v

    def chance(self, p: float) -> bool:
        return self.u() < p

    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[int(self.u() * len(seq))]

    def randint(self, lo: int, hi: int) -> int:
        """Integer in [lo, hi] inclusive."""
        return lo + int(self.u() * (hi - lo + 1))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.u()

    def normal(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        """Box–Muller from two uniforms (no hidden generator state)."""
        u1, u2 = self.u(), self.u()
        return mu + sigma * math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)

    def lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(sigma * self.normal())


def episode_draws(seed: int, stream: str, n: int, start: int = 0) -> list[Draws]:
    """One :class:`Draws` per episode ``start .. start+n-1``, first blocks computed in one
    vectorised call."""
    keys = stream_keys(seed, stream, n, start)
    block = uniforms(keys, Draws.BLOCK)
    key_list = keys.tolist()
    return [Draws(k, row) for k, row in zip(key_list, block.tolist())]


def normal_from(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Vectorised Box–Muller."""
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


# --------------------------------------------------------------------------- argument checks

_PY_TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
             "array": "array", "object": "object"}


def _type_ok(expected: str, value: Any) -> bool:
    got = json_type_name(value)
    return got == expected or (expected == "number" and got == "integer")


def check_value(spec: dict[str, Any], value: Any, where: str) -> str | None:
    """Why ``value`` does not fit the JSON-schema ``spec`` of parameter ``where`` (None = fits)."""
    expected = spec.get("type")
    if expected in _PY_TYPES and not _type_ok(expected, value):
        return f"type mismatch: param '{where}' expects {expected}, got {json_type_name(value)}"
    if "enum" in spec and value not in spec["enum"]:
        return f"out-of-range value: param '{where}' = {value!r} is not one of {spec['enum']}"
    if "minimum" in spec and value < spec["minimum"]:
        return f"out-of-range value: param '{where}' = {value!r} is below the minimum {spec['minimum']}"
    if "maximum" in spec and value > spec["maximum"]:
        return f"out-of-range value: param '{where}' = {value!r} is above the maximum {spec['maximum']}"
    if expected == "array" and "items" in spec:
        for i, item in enumerate(value):
            err = check_value(spec["items"], item, f"{where}[{i}]")
            if err:
                return err
    if expected == "object" and "properties" in spec:
        return check_args(spec, value, prefix=f"{where}.")
    return None


def check_args(schema: dict[str, Any], params: dict[str, Any], prefix: str = "") -> str | None:
    """Why a call's arguments do not fit the tool's parameter schema (None = valid)."""
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in params:
            return f"missing required param '{prefix}{name}'"
    for name, value in params.items():
        spec = props.get(name)
        if spec is None:
            if schema.get("additionalProperties", True) is False:
                return f"unexpected param '{prefix}{name}'"
            continue
        err = check_value(spec, value, prefix + name)
        if err:
            return err
    return None


# --------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class Plan:
    """Which behaviour runs which task at which position of the file."""

    position: int
    behaviour: str
    task: int
    #: Position of the honest twin (same task) for a paired behaviour, else None.
    twin: int | None = None


def _counts(n: int, shares: dict[str, float]) -> dict[str, int]:
    """Largest-remainder rounding of ``shares`` to ``n`` (ties broken by listing order)."""
    raw = {b: s * n for b, s in shares.items()}
    counts = {b: int(math.floor(v)) for b, v in raw.items()}
    rest = n - sum(counts.values())
    order = sorted(shares, key=lambda b: (-(raw[b] - counts[b]), list(shares).index(b)))
    for b in order[:rest]:
        counts[b] += 1
    return counts


def plan_episodes(n: int, shares: dict[str, float], pairs: dict[str, str], seed: int) -> list[Plan]:
    """Assign ``n`` episodes to behaviours by ``shares``; every episode of a paired
    behaviour (``pairs = {"hacker": "expert"}``) gets an episode of its partner on the
    same task — its honest twin.  The file order is a seeded shuffle."""
    counts = _counts(n, shares)
    for paired, partner in pairs.items():
        surplus = max(counts[paired] - counts[partner], 0)  # only for odd shares / tiny n
        counts[paired] -= surplus
        counts[partner] += surplus
    rows: list[tuple[str, int, int | None]] = []  # (behaviour, task, local index of twin)
    task = 0
    solo = dict(counts)
    for paired, partner in pairs.items():
        for _ in range(counts[paired]):
            rows.append((partner, task, None))
            rows.append((paired, task, len(rows) - 1))
            task += 1
        solo[paired] -= counts[paired]
        solo[partner] -= counts[paired]
    for behaviour in shares:
        for _ in range(solo[behaviour]):
            rows.append((behaviour, task, None))
            task += 1
    keys = uniforms(stream_keys(seed, "order", 1), len(rows))[0]
    order = np.argsort(keys, kind="stable")
    position_of = np.empty(len(rows), dtype=np.int64)
    position_of[order] = np.arange(len(rows))
    plans = []
    for pos, local in enumerate(order.tolist()):
        behaviour, task_index, twin_local = rows[local]
        twin = None if twin_local is None else int(position_of[twin_local])
        plans.append(Plan(position=pos, behaviour=behaviour, task=task_index, twin=twin))
    return plans


# --------------------------------------------------------------------------- records

def dumps(obj: Any) -> str:
    """Canonical compact JSON (the same settings as ``Episode.to_json``)."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _date(day: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day * 86400))


def iso_local(epoch_local_ms: float, tz: str) -> str:
    """ISO-8601 timestamp with milliseconds for a local wall-clock time in ms."""
    sec, milli = divmod(int(epoch_local_ms), 1000)
    day, rest = divmod(sec, 86400)
    hh, rest = divmod(rest, 3600)
    mm, ss = divmod(rest, 60)
    return f"{_date(day)}T{hh:02d}:{mm:02d}:{ss:02d}.{milli:03d}{tz}"


class Recorder:
    """Collects the steps of one episode as canonical JSON objects."""

    __slots__ = ("steps", "pending", "clock_ms", "tz")

    def __init__(self, start_ms: float, tz: str, first_messages: list[dict[str, Any]]):
        self.steps: list[dict[str, Any]] = []
        #: Messages the agent has seen since its previous step (the next step's observation).
        self.pending: list[dict[str, Any]] = list(first_messages)
        self.clock_ms = start_ms
        self.tz = tz

    def add(self, *, kind: str, state: dict[str, Any], latency_ms: float, tool: str | None = None,
            params: dict[str, Any] | None = None, result: Any = None, error: str | None = None,
            text: str | None = None, raw_arguments: str | None = None) -> None:
        """Record one step; the observation is what arrived since the previous step."""
        t = len(self.steps)
        self.steps.append({
            "t": t,
            "observation": {"messages": self.pending, "state": state},
            "action": {"kind": kind, "tool": tool, "params": params if params is not None else {},
                       "raw_arguments": raw_arguments},
            "tool_result": result,
            "tool_error": error,
            "result_replayed": True,
            "output_text": text,
            "latency_ms": float(latency_ms),
            "timestamp": iso_local(self.clock_ms, self.tz),
        })
        # The tool's answer is this step's tool_result; it is not repeated as a message of the
        # next observation (it would double the file size).
        self.pending = []
        self.clock_ms += latency_ms


def episode_record(*, episode_id: str, domain: str, query: str, task_type: str, intents: list[str],
                   steps: list[dict[str, Any]], outcome: dict[str, Any], behaviour: str,
                   meta: dict[str, Any], record: int) -> dict[str, Any]:
    """The canonical JSON object of one Episode (all fields, as ``model_dump(mode='json')``)."""
    return {
        "episode_id": episode_id,
        "domain": domain,
        "task": {"query": query, "task_type": task_type, "intents": intents},
        "steps": steps,
        "outcome": outcome,
        "source": {"file": None, "format": "generated", "line": None, "record": record, "raw": None},
        "behaviour": behaviour,
        "meta": meta,
    }
