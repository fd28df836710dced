"""The decision engine (docs/design.md §9, S000 §2.2): rules + decision tree first, the RL policy
when they are unsure, arbitration between them, and one audit record per decision.

Entry points: :func:`load` (a promoted policy by name, or a bundle zip or folder) returns a
:class:`DecisionEngine`, whose :meth:`DecisionEngine.decide` / :meth:`DecisionEngine.decide_batch`
take a :class:`DecisionRequest` and return a :class:`Decision`;
:meth:`DecisionEngine.report_outcome` reports a served action's result and
:meth:`DecisionEngine.metrics_text` the Prometheus metrics; :func:`alert_rules` reads
``core/serve/serving_alerts.yaml``.  The engine owns per-episode state, masks, the RDE
baseline, RL-Boost, arbitration, review pushes and the audit record of each decision.

Details: docs/serving.md (## The request, ## Episode state, ## RL-Boost, ## Arbitration,
## The audit record of a decision, ## Metrics and alert rules, ## Latency).
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import itertools
import json
import math
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.guard import review
from core.base import bounded_json
from core.base.bounded_json import depth_of, max_depth_of
from core.base.errors import InputError, RwbError
from core.access.users import Actor
from core.access.audit import AuditWriter, security_event, token_action
from core.access.keys import trust_store
from core.govern.bundle import BundleError, load_bundle
from core.govern.policy_folder import INDEX, ActivePolicy, load_copy, resolve_active
from core.govern.policy_folder import policies_root as policies_folder  # the engine's parameter is policies_root
from core.serve.idle_gc import IdleCollector
import core.base.embed

if TYPE_CHECKING:  # pragma: no cover
    from core.access.audit import AuditWriter
    from core.govern.bundle import LoadedBundle
    from core.records.episodes import Action
    from core.guard.masking import CompiledMasks
    from core.records.store import Workspace

#: The example Prometheus alert rules shipped with the package.
ALERT_RULES_FILE = Path(__file__).with_name("serving_alerts.yaml")
#: Decision-latency histogram buckets (seconds): the 2 ms target sits in the middle.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 1.0, 5.0)
#: Distinct query texts whose intent (embedding + rules) is kept in memory.
INTENT_CACHE_SIZE = 4096
#: Review item ids an engine reserves at once (core.guard.review.reserve_item_ids).  The
#: first block is reserved by the first push; the review thread reserves the next one when
#: fewer than half are left, so a request reserves again only after a burst of this many.
REVIEW_ID_BLOCK = 64
#: Seconds between checks of the workspace for review mask rules another process added
#: (this process's own are picked up at the next decision).
MASK_RULES_CHECK_S = 0.1
#: Mask rows remembered per policy version (PolicyRuntime.mask).
MASK_MEMORY = 4096
#: Served decisions remembered for report_outcome (most recent first out).
OUTCOME_MEMORY = 100_000
#: RL-Boost runs on the calling thread (no hand-off to the worker) when each of the policy's
#: last ``INLINE_WINDOW`` runs took less than ``INLINE_SHARE`` of the time budget and the
#: rows' query embeddings are at hand: then it cannot overrun the budget but by a stall.
INLINE_WINDOW = 16
INLINE_SHARE = 0.1
#: No previous action (the first step), as the RDE tree and the encoder's trace read it.
NO_PREVIOUS = -2


# =========================================================================== configuration
@dataclass(frozen=True)
class ServingConfig:
    """How the engine decides.  Every number has the seed's default (S000 §2.2)."""

    #: RDE confidence below which RL-Boost runs.
    confidence_threshold: float = 0.7
    #: The policy's pick is adopted when its reward estimate beats the baseline's by more.
    adopt_margin: float = 0.1
    #: Wall-clock budget of candidate generation; over it the baseline decides alone.
    time_budget_ms: float = 300.0
    #: Always serve the baseline's action (candidates are still computed and audited).
    force_rde_override: bool = False
    #: Candidates the policy proposes.
    top_k: int = 3
    #: An episode without a request for this long is dropped (S000: 15 min).
    episode_ttl_s: float = 900.0
    #: Out-of-distribution threshold in robust standard deviations (core.state.features.Z_CLIP).
    ood_z: float = 5.0
    #: Served actions of these risk levels with confidence below ``review_confidence``
    #: go to the review queue.
    review_risks: tuple[str, ...] = ("high",)
    review_confidence: float = 0.7
    #: Embed a new episode's query on a background thread after its first decision (when
    #: that decision did not need it), so that its later RL-Boosts do not wait for the
    #: sentence model.
    prefetch_intent: bool = True
    #: An RL-Boost whose query has no sentence embedding yet (a new query, its embedding
    #: not done): False — the baseline decides alone at once (``intent_pending``) while the
    #: query is embedded in the background for the episode's next requests, which keeps
    #: the sentence model's forward pass off every request's path; True — the
    #: request waits for the embedding within ``time_budget_ms``.  A request whose tree has
    #: no allowed action always waits: the policy is then its only proposal.
    wait_for_intent: bool = False
    #: Where the engine's default embedder runs the sentence model: True — in a child
    #: process (:class:`core.base.embed.ModelProcess`, one torch thread, started in the
    #: background when the engine starts and stopped by ``close()``), so that its forward
    #: pass, which holds the interpreter lock between operations, never delays a request
    #: running beside it; False — on the engine's intent thread (no child, a faster start:
    #: what a one-shot run uses).  An ``embedder=`` given to the engine is used as it is.
    model_process: bool = True
    #: Intra-op threads for the policy: torch's (``torch.set_num_threads``) and numpy's
    #: BLAS (``threadpoolctl``), process-wide; None leaves the libraries' defaults.  1 suits
    #: a serving process: the policy runs on a few rows, where more threads only add
    #: synchronisation — and spinning BLAS threads take the core the sentence model needs.
    torch_threads: int | None = None
    #: The interpreter's thread switch interval in ms (``sys.setswitchinterval``,
    #: process-wide); None leaves Python's 5 ms.  A request thread that wants the GIL while
    #: a background thread (the sentence model, audit commits) runs Python may wait a whole
    #: interval: 0.5 suits a serving process.
    switch_interval_ms: float | None = None
    #: Once the engine is built, collect and then move every object alive (the bundle, the
    #: catalog, the loaded libraries) out of the cyclic garbage collector's reach
    #: (``gc.freeze``, process-wide), so that a full collection during a request does not
    #: walk them: what a serving process wants after loading.  False leaves the collector
    #: as it is (a process that builds many engines, like a test run).
    freeze_gc: bool = False
    #: Run the cyclic garbage collector between requests instead of inside them
    #: (:class:`core.serve.idle_gc.IdleCollector`: the automatic collector off, process-wide,
    #: while the engine is open; the same collections on a background thread right after the
    #: request that made one due).  What a serving process wants; False leaves the collector
    #: as it is.
    idle_gc: bool = False
    #: AuditWriter settings: records per commit, seconds before a partial batch commits,
    #: and commit-per-record (durable before decide() returns, slower).
    audit_batch_size: int = 256
    audit_flush_interval_s: float = 0.5
    audit_synchronous: bool = False

    def __post_init__(self) -> None:
        checks = {
            "confidence_threshold": 0.0 <= self.confidence_threshold <= 1.0,
            "adopt_margin": math.isfinite(self.adopt_margin) and self.adopt_margin >= 0,
            "time_budget_ms": self.time_budget_ms > 0,
            "top_k": self.top_k >= 1,
            "episode_ttl_s": self.episode_ttl_s > 0,
            "ood_z": self.ood_z > 0,
            "review_confidence": 0.0 <= self.review_confidence <= 1.0,
            "torch_threads": self.torch_threads is None or self.torch_threads >= 1,
            "switch_interval_ms": self.switch_interval_ms is None or 0 < self.switch_interval_ms <= 100,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise InputError(f"invalid serving setting(s): {', '.join(bad)} (confidence values in [0, 1], "
                             "a positive budget, TTL and ood_z, top_k ≥ 1, adopt_margin ≥ 0)", field=bad[0])


# =========================================================================== the request
Scalar = str | int | float | bool | None

# Bounds of a request (docs/serving.md, ## Request limits): far above what an agent sends,
# the same in-process (parse_request) and over HTTP (the service validates with these models).
MAX_EPISODE_ID_CHARS = 512
MAX_QUERY_CHARS = 20_000
#: ``task_type`` and ``domain``.
MAX_NAME_CHARS = 128
MAX_STATE_KEYS = 256
MAX_STATE_KEY_CHARS = 128
#: A text value of ``state``.
MAX_STATE_TEXT_CHARS = 1_024
MAX_MESSAGES = 1_000
#: One message, and all of them, as compact UTF-8 JSON (what the audit trail keeps).
MAX_MESSAGE_BYTES = 256 * 1024
MAX_MESSAGES_BYTES = 1024 * 1024
MAX_TOOL_CHARS = 256
MAX_ERROR_CHARS = 32_768
#: ``last_result.result`` as compact UTF-8 JSON (a string result: its text).
MAX_RESULT_BYTES = 512 * 1024
#: Nesting of lists and objects in one message and in ``last_result.result`` (a result
#: given as JSON text: in the JSON it holds), measured before anything recurses into it.
MAX_NESTING = 32


def _short(text: str, n: int = 40) -> str:
    """A name from a request, cut for an error message (the message never echoes a payload)."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"… ({len(text):,} characters)"


#: Above this interpreter recursion limit the C JSON encoder's own guard no longer keeps a
#: deep value off the C stack, so the depth is counted without recursion first.
ENCODER_SAFE_RECURSION = 10_000


def _json_bytes(value: Any, what: str, limit: int) -> int:
    """Size of ``value`` as compact UTF-8 JSON, refused (ValueError naming ``what``) when it is
    nested deeper than :data:`MAX_NESTING`, is not plain JSON or is longer than ``limit``.

    Encoded once (needed for the size): the C encoder stops at the interpreter's recursion
    limit with a RecursionError, and the depth is then read off the text by the vectorised
    scan.  A node-by-node ``depth_of`` walk first would cost seconds for a wide value (4
    million list items); it runs only when the recursion limit was raised past
    :data:`ENCODER_SAFE_RECURSION`."""
    too_deep = f"{what} is nested deeper than {MAX_NESTING} levels"
    if sys.getrecursionlimit() > ENCODER_SAFE_RECURSION and depth_of(value, MAX_NESTING) > MAX_NESTING:
        raise ValueError(too_deep)
    try:
        raw = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except RecursionError:
        raise ValueError(too_deep) from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not plain JSON ({exc})") from None
    if len(raw) > limit:
        raise ValueError(f"{what} is {len(raw):,} bytes as JSON; at most {limit:,} are accepted")
    if max_depth_of(raw) > MAX_NESTING:
        raise ValueError(too_deep)
    return len(raw)


def _bounded_messages(v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if v is not None:
        total = 0
        for i, message in enumerate(v):
            total += _json_bytes(message, f"message {i}", MAX_MESSAGE_BYTES)
            if total > MAX_MESSAGES_BYTES:
                raise ValueError(f"the messages up to message {i} are {total:,} bytes as JSON; at most "
                                 f"{MAX_MESSAGES_BYTES:,} are accepted in all")
    return v


def _bounded_result(v: Any) -> Any:
    # a result given as JSON text is parsed by the feature extraction (core.state.features)
    text = v.lstrip() if isinstance(v, str) else ""
    if text[:1] in ("{", "[") and max_depth_of(text.encode("utf-8", "replace")) > MAX_NESTING:
        raise ValueError(f"the result's JSON text is nested deeper than {MAX_NESTING} levels")
    _json_bytes(v, "the result", MAX_RESULT_BYTES)
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LastResult(_Strict):
    """The outcome of the action served last in this episode, as the tool returned it."""

    tool: str | None = Field(default=None, min_length=1, max_length=MAX_TOOL_CHARS)
    result: Annotated[Any, AfterValidator(_bounded_result)] = None
    error: str | None = Field(default=None, max_length=MAX_ERROR_CHARS)
    latency_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class DecisionRequest(_Strict):
    """One decision to make (the schema and its limits: docs/serving.md, ## The request)."""

    episode_id: str = Field(min_length=1, max_length=MAX_EPISODE_ID_CHARS)
    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    task_type: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    state: dict[str, Scalar] = Field(default_factory=dict)
    last_result: LastResult | None = None
    messages: Annotated[list[dict[str, Any]] | None, Field(max_length=MAX_MESSAGES),
                        AfterValidator(_bounded_messages)] = None
    domain: str | None = Field(default=None, max_length=MAX_NAME_CHARS)

    @field_validator("state", mode="before")
    @classmethod
    def _bounded_state(cls, v: Any) -> Any:
        """Key count first (before pydantic copies the mapping), then each key's and text
        value's length, and finite numbers."""
        if isinstance(v, Mapping):
            if len(v) > MAX_STATE_KEYS:
                raise ValueError(f"{len(v):,} state features; at most {MAX_STATE_KEYS} are accepted")
            for k, x in v.items():
                if isinstance(k, str) and not 0 < len(k) <= MAX_STATE_KEY_CHARS:
                    raise ValueError(f"state feature name {_short(k)} must have 1 to {MAX_STATE_KEY_CHARS} "
                                     "characters")
                if isinstance(x, str) and len(x) > MAX_STATE_TEXT_CHARS:
                    raise ValueError(f"state feature {_short(str(k))} has {len(x):,} characters; at most "
                                     f"{MAX_STATE_TEXT_CHARS:,} are accepted")
                if isinstance(x, float) and not math.isfinite(x):
                    raise ValueError(f"state feature {_short(str(k))} is {x}; features must be finite")
        return v

    def to_json_dict(self) -> dict[str, Any]:
        """The canonical JSON form (unset fields left out): what ``input_hash`` hashes and
        what the audit trail keeps."""
        return self.model_dump(mode="json", exclude_none=True)


#: A request's own nesting over the fields' (request, then ``messages`` or ``last_result``).
REQUEST_NESTING = MAX_NESTING + 2


def error_field(loc: Sequence[Any], data: Any, missing: bool = False) -> str | None:
    """The dotted request field of a validation error's location.  The path is followed
    into ``data`` as far as it goes: pydantic's trailing union-member tags
    (``state.hour.str``) are no fields; a missing field is named; a long key is cut (an
    error never echoes a payload)."""
    path: list[Any] = []
    node = data
    for p in loc:
        if isinstance(node, Mapping) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        else:
            if missing:
                path.append(p)
            break
        path.append(p)
    return ".".join(str(p) if len(str(p)) <= 64 else str(p)[:64] + "…" for p in path) or None


def parse_request(request: Mapping[str, Any] | DecisionRequest, *, index: int | None = None) -> DecisionRequest:
    """Validate one request within its limits (:data:`MAX_NESTING` and the others above);
    :class:`InputError` names the field (and the request's index in a batch)."""
    if isinstance(request, DecisionRequest):
        return request
    where = "" if index is None else f"request {index}: "
    if not isinstance(request, Mapping):
        raise InputError(f"{where}a request is a JSON object, not {type(request).__name__}", record=index)
    try:
        return DecisionRequest.model_validate(request)
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        loc = error_field(err["loc"], request, err["type"] == "missing")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = (f"unknown field; a request has {', '.join(DecisionRequest.model_fields)} "
                   f"(last_result: {', '.join(LastResult.model_fields)})")
        raise InputError(f"{where}invalid decision request: {loc}: {msg}", field=loc,
                         record=index) from None


#: Refusals written to the security log per source and reason: a burst of this many, and
#: this many again every REFUSAL_LOG_WINDOW_S seconds (RefusalLog).
REFUSAL_LOG_BURST = 30
REFUSAL_LOG_WINDOW_S = 60.0
#: The longest error text a security event keeps of a refusal.
REFUSAL_TEXT_CHARS = 200


class RefusalLog:
    """``request_refused`` security events of refused requests (the engine's and the HTTP
    service's), rate-limited so that a flood of bad or unauthenticated requests can neither
    fill the disk nor cost an fsync each: per (source, reason) a token bucket lets
    :data:`REFUSAL_LOG_BURST` events through at once and as many every
    :data:`REFUSAL_LOG_WINDOW_S` seconds.  A refusal past the limit is counted, not written;
    the next event written for its (source, reason) carries that count as ``suppressed``,
    and :meth:`close` writes what is left as ``request_refusals_suppressed``.  An event names
    the reason, field, record, sizes and the client's address: never the request's content
    (an error text is cut to :data:`REFUSAL_TEXT_CHARS`)."""

    def __init__(self, ws: "Workspace", actor: Actor | None, *, burst: int = REFUSAL_LOG_BURST,
                 window_s: float = REFUSAL_LOG_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.ws, self.actor, self.burst, self.clock = ws, actor, burst, clock
        self.refill_per_s = burst / window_s
        self._lock = threading.Lock()
        #: (source, reason) -> [tokens left, when last refilled]
        self._buckets: dict[tuple[str, str], list[float]] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def admit(self, source: str, reason: str) -> int | None:
        """Whether a refusal of ``reason`` from ``source`` is written now: None when over the
        limit (then it is counted), else how many were suppressed since the last one written."""
        key, now = (source, reason), self.clock()
        with self._lock:
            bucket = self._buckets.setdefault(key, [float(self.burst), now])
            bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.refill_per_s)
            bucket[1] = now
            if bucket[0] < 1.0:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return None
            bucket[0] -= 1.0
            return self._suppressed.pop(key, 0)

    def write(self, source: str, reason: str, suppressed: int, **detail: Any) -> None:
        """Write one admitted refusal (``detail``: names and sizes only; None values left out)."""
        fields = {k: v for k, v in detail.items() if v is not None}
        if suppressed:
            fields["suppressed"] = suppressed
        try:
            security_event(self.ws, self.actor, "request_refused", source=source, reason=reason, **fields)
        except OSError as exc:  # the refusal stands; a full or read-only log must not turn it into a crash
            sys.stderr.write(f"rwb serve: the security log could not record a refused request ({exc})\n")

    def refused(self, source: str, reason: str, **detail: Any) -> bool:
        """Log one refusal (when the limit allows); whether it was written."""
        suppressed = self.admit(source, reason)
        if suppressed is None:
            return False
        self.write(source, reason, suppressed, **detail)
        return True

    def refused_input(self, exc: InputError, *, source: str, **detail: Any) -> bool:
        """Log a request refused with ``exc`` (its field, record and cut message)."""
        return self.refused(source, "invalid_request", field=exc.field, record=exc.record,
                            error=str(exc)[:REFUSAL_TEXT_CHARS], **detail)

    def close(self) -> None:
        """Write the refusals still counted but not logged, one event per (source, reason)."""
        with self._lock:
            left, self._suppressed = self._suppressed, {}
        for (source, reason), n in left.items():
            try:
                security_event(self.ws, self.actor, "request_refusals_suppressed", source=source, reason=reason,
                               suppressed=n)
            except OSError as exc:
                sys.stderr.write(f"rwb serve: the security log could not record {n} refused requests ({exc})\n")


# =========================================================================== the decision
@dataclass(frozen=True)
class Candidate:
    """One RL-Boost proposal: action token, policy probability, reward estimate."""

    id: int
    name: str
    label: str
    prob: float
    reward_est: float

    def audit(self) -> dict[str, Any]:
        return {"id": self.id, "prob": self.prob, "reward_est": self.reward_est}


@dataclass(frozen=True)
class Decision:
    """What the engine served for one request, and why."""

    decision_id: str
    episode_id: str
    step_t: int
    policy_version: str
    #: The served action token (catalog id), its name, label, kind, tool and risk.
    final_action: int
    final_name: str
    final_label: str
    kind: str
    tool: str | None
    risk: str
    #: Who chose it: "rde" (the baseline), "policy" (adopted), "fallback" (no proposal).
    source: str
    confidence: float
    rde_action: int | None
    rde_confidence: float
    rl_boost: bool
    #: Why RL-Boost ran: "low_confidence", "out_of_distribution", "no_rde_action".
    rl_boost_reasons: tuple[str, ...]
    rl_candidates: tuple[Candidate, ...]
    rde_reward_est: float | None
    adopted: bool
    overridden: bool
    timed_out: bool
    #: RL-Boost was due but deferred: the query's embedding was not ready (see
    #: ``ServingConfig.wait_for_intent``); the baseline decided alone.
    intent_pending: bool
    ood: bool
    ood_notes: tuple[str, ...]
    review_item: int | None
    reward_components: tuple[dict[str, Any], ...]
    #: Human-readable account of the arbitration.
    explanation: str
    latency_ms: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (candidates as dicts)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["rl_candidates"] = [c.__dict__ for c in self.rl_candidates]
        d["reward_components"] = [dict(c) for c in self.reward_components]
        d["rl_boost_reasons"] = list(self.rl_boost_reasons)
        d["ood_notes"] = list(self.ood_notes)
        return d


# =========================================================================== metrics
class ServingMetrics:
    """The engine's Prometheus metrics, in their own registry (engines never collide)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("rwb_decisions", "Decisions served, by who chose the action.",
                                 ["policy_version", "source"], registry=r)
        self.rl_boost = Counter("rwb_rl_boost_activations", "RL-Boost activations, by reason.",
                                ["policy_version", "reason"], registry=r)
        self.adoptions = Counter("rwb_rl_boost_adoptions", "Decisions that adopted the policy's pick.",
                                 ["policy_version"], registry=r)
        self.timeouts = Counter("rwb_rl_boost_timeouts", "RL-Boost runs over the time budget "
                                "(the baseline decided alone).", ["policy_version"], registry=r)
        self.deferred = Counter("rwb_rl_boost_deferred", "RL-Boosts deferred because the query's "
                                "sentence embedding was not ready (the baseline decided alone).",
                                ["policy_version"], registry=r)
        self.embed_failures = Counter("rwb_intent_embedding_failures", "Sentence-embedding calls that "
                                      "failed (their queries are retried by their next RL-Boost).",
                                      registry=r)
        self.overrides = Counter("rwb_rde_overrides", "Decisions where force_rde_override kept the "
                                 "baseline although arbitration would have adopted the policy.",
                                 ["policy_version"], registry=r)
        self.ood = Counter("rwb_out_of_distribution", "Requests unlike the training data.",
                           ["policy_version"], registry=r)
        self.review_pushes = Counter("rwb_review_queue_pushes", "Served actions put on the review queue.",
                                     ["policy_version"], registry=r)
        self.review_write_failures = Counter("rwb_review_write_failures", "Writes of queued review items "
                                             "that failed (the items stay pending and are retried).",
                                             registry=r)
        self.outcomes = Counter("rwb_action_outcomes", "Reported outcomes of served actions.",
                                ["policy_version", "result"], registry=r)
        self.failures = Counter("rwb_action_failures", "Served actions reported as failed.",
                                ["policy_version"], registry=r)
        self.reloads = Counter("rwb_policy_reloads", "Promoted versions picked up, by result.",
                               ["result"], registry=r)
        self.episodes = Gauge("rwb_episodes_active", "Episodes held in memory.", registry=r)
        self.latency = Histogram("rwb_decision_latency_seconds", "decide() latency per request "
                                 "(a batch counts once per request, at its mean).",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def text(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode("utf-8")


def alert_rules() -> str:
    """The example Prometheus alert rules for the engine's metrics (YAML text)."""
    return ALERT_RULES_FILE.read_text(encoding="utf-8")


# =========================================================================== the policy's forward
_COMPILED: "weakref.WeakKeyDictionary[Any, tuple[Callable[[Mapping[str, Any]], tuple[Any, Any]], bool]]" = \
    weakref.WeakKeyDictionary()
#: Encoder inputs in the order of the compiled policy's arguments (core.rl.sim.OBS_KEYS).
_OBS_KEYS = ("intent_emb", "intent_rules", "context", "trace_action", "trace_reward", "trace_dt")


def _compile_policy(bundle: "LoadedBundle") -> tuple[Callable[[Mapping[str, Any]], tuple[Any, Any]], bool]:
    """``(forward, compiled)``: ``forward(obs) -> (logits [B, A], values [B, K])`` of the
    bundle's served actor-critic (its served copy when it has one), as a frozen
    TorchScript trace when possible.

    Serving runs the policy on one to a few rows, where the eager module spends most of its
    time in Python dispatch; the trace does the same arithmetic in about half the CPU time.
    It is checked against the eager module on the bundle's smoke states (one row and all of
    them) and used only when both agree to 1e-5; otherwise — or when the policy is not a
    plain ``torch.nn.Module`` — the eager module serves (``compiled`` False)."""
    import warnings

    import torch

    agent = bundle.served_policy

    def eager(obs: Mapping[str, Any]) -> tuple[Any, Any]:
        return agent.heads(agent.state(obs))

    if not isinstance(agent, torch.nn.Module):
        return eager, False
    if agent in _COMPILED:  # engines over the same loaded bundle share one trace
        return _COMPILED[agent]

    class _Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.agent = agent

        def forward(self, *inputs: Any) -> tuple[Any, Any]:
            return self.agent.heads(self.agent.state(dict(zip(_OBS_KEYS, inputs))))

    smoke = bundle.smoke_obs()
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer notes about Python values; checked below
            traced = torch.jit.freeze(torch.jit.trace(_Flat().eval(), tuple(smoke[k][:2] for k in _OBS_KEYS),
                                                      check_trace=False))
            for n in (1, len(smoke["context"])):
                probe = {k: v[:n] for k, v in smoke.items()}
                got, want = traced(*(probe[k] for k in _OBS_KEYS)), eager(probe)
                if not all(torch.allclose(g, w, atol=1e-5, rtol=1e-5) for g, w in zip(got, want)):
                    return eager, False
    except (RuntimeError, TypeError, ValueError):  # an operation the tracer cannot record
        return eager, False

    def compiled(obs: Mapping[str, Any]) -> tuple[Any, Any]:
        return traced(*(obs[k] for k in _OBS_KEYS))

    _COMPILED[agent] = (compiled, True)
    return compiled, True


_FAST: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _numpy_policy(bundle: "LoadedBundle") -> Any:
    """The bundle's served policy (its served copy when it has one) as a
    :class:`core.serve.fast_policy.NumpyPolicy`, or None when it is not the architecture it
    knows or does not reproduce the module (then the module serves).  Shared by the
    engines over the same loaded bundle."""
    from core.serve.fast_policy import numpy_policy  # deferred: loads torch and scipy

    agent = bundle.served_policy
    try:
        if agent in _FAST:
            return _FAST[agent]
    except TypeError:  # not weak-referenceable: built each time
        return numpy_policy(agent, bundle.smoke_obs())
    _FAST[agent] = fast = numpy_policy(agent, bundle.smoke_obs())
    return fast


def _top_k(logits: np.ndarray, mask: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, k], probabilities [B, k])`` of the ``k`` most probable allowed actions
    under the masked softmax (:class:`core.rl.common.MaskedCategorical`: a masked action's
    probability is exactly 0), most probable first; a slot with no allowed action left
    is token -1 with probability 0."""
    if not mask.any(axis=1).all():
        raise ValueError("a mask row allows no action; masks must keep terminate/escalate")
    z = np.where(mask, logits.astype(np.float64), -np.inf)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    probs = z / z.sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    p = np.take_along_axis(probs, top, axis=1)
    return np.where(p > 0, top, -1), p


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


# =========================================================================== per-version runtime
class PolicyRuntime:
    """One loaded policy version and what the engine derives from it once: compiled masks
    (re-compiled when reviews add rules), token tables, the out-of-distribution
    reference and decoded actions."""

    def __init__(self, bundle: "LoadedBundle"):
        self.bundle = bundle
        self.version = bundle.policy_version
        #: ``full`` (the trained module serves) or the precision of the bundle's served copy
        self.serve_precision = bundle.serve_precision
        cat = bundle.catalog
        self.catalog = cat
        self.n_actions = len(cat.tokens)
        self.names = [t.name for t in cat.tokens]
        self.labels = [t.label for t in cat.tokens]
        self.kinds = [t.kind for t in cat.tokens]
        self.tools = [t.tool for t in cat.tokens]
        self.risks = [t.risk for t in cat.tokens]
        self.escalate_id, self.final_id = cat.escalate_id, cat.final_id
        num = bundle.feature_stats.numeric
        #: (state feature, robust centre, robust scale) of every numeric training feature.
        self.ood_reference = [(k.removeprefix("state:"), float(num[k][0]), float(num[k][1]))
                              for k in sorted(num) if k.startswith("state:")]
        self.task_types = frozenset(bundle.rde.task_types)
        self.dataset = bundle.manifest.dataset
        self.masks: "CompiledMasks" = bundle.masks
        self._review_signature: tuple[Any, ...] | None = None
        self._rules_added, self._rules_checked = -1, -math.inf
        #: Mask rows by (task type, the values the rules read, action counts): see mask().
        self._mask_memo: collections.OrderedDict[tuple[Any, ...], np.ndarray] = collections.OrderedDict()
        self._actions: dict[int, "Action"] = {}
        #: The numpy forward (core.serve.fast_policy) of the served module (the bundle's served
        #: copy, else its policy) when it reproduces that module; else the module itself.
        self.fast = _numpy_policy(bundle)
        self.forward: Callable[[Mapping[str, Any]], tuple[Any, Any]] | None
        self.forward, self.compiled = _compile_policy(bundle) if self.fast is None else (None, False)

    # ------------------------------------------------------------------ masks
    def refresh_masks(self, ws: "Workspace") -> None:
        """Re-compile the masks when the workspace's review-born rules changed: checked at
        once after this process committed one (:func:`core.guard.review.rules_added`), else at
        most every :data:`MASK_RULES_CHECK_S` seconds (one indexed query; the compile only
        when a review was decided)."""
        added, now = review.rules_added(), time.monotonic()
        if added == self._rules_added and now - self._rules_checked < MASK_RULES_CHECK_S:
            return
        self._rules_added, self._rules_checked = added, now
        sig = tuple(ws.conn.execute("SELECT COUNT(*), MAX(id) FROM mask_rules_from_reviews").fetchone())
        if sig == self._review_signature:
            return
        rules = review.with_review_rules(self.bundle.mask_rules, ws, self.dataset)
        self.masks = rules.compile(self.catalog)
        self._mask_memo.clear()
        self._review_signature = sig

    def mask(self, states: Sequence[Mapping[str, Any]], task_types: Sequence[str | None],
             counts: np.ndarray) -> np.ndarray:
        """``[B, A]`` allowed actions under the bundle's and the review-born rules.

        Only the features the rules read are passed, as plain value lists (missing =
        unknown); the masks validate and encode them.  A row is a function of those
        values and the counts of the actions the limits count, so rows are remembered (an
        LRU of :data:`MASK_MEMORY`, emptied when the rules change): an episode whose state
        the rules read did not change since its last step is not evaluated again, unless
        it took a limited action meanwhile."""
        masks = self.masks
        names = [f for f in masks.required_features if f != "task_type"]
        counted = counts[:, masks.counted_tokens]
        # the type is part of the key: True == 1 for a dict, not necessarily for a rule
        keys = [(t, tuple((type(v), v) for v in (s.get(f) for f in names)), c.tobytes())
                for s, t, c in zip(states, task_types, counted)]
        memo = self._mask_memo
        out = np.empty((len(keys), self.n_actions), dtype=bool)
        misses = []
        for b, key in enumerate(keys):
            row = memo.get(key)
            if row is None:
                misses.append(b)
            else:
                out[b] = row
                memo.move_to_end(key)
        if misses:
            feats: dict[str, Any] = {}
            for f in masks.required_features:
                feats[f] = ([task_types[b] for b in misses] if f == "task_type"
                            else [states[b].get(f) for b in misses])
            rows = np.asarray(masks.evaluate(feats, counts[misses]).mask, dtype=bool)
            out[misses] = rows
            for b, row in zip(misses, rows):
                memo[keys[b]] = row.copy()
            while len(memo) > MASK_MEMORY:
                memo.popitem(last=False)
        return out

    # ------------------------------------------------------------------ distribution check
    def out_of_distribution(self, state: Mapping[str, Any], task_type: str | None, ood_z: float
                            ) -> list[str]:
        """Why the request is unlike the training data (empty list: it is not)."""
        notes = []
        if task_type is not None and task_type not in self.task_types:
            notes.append(f"task type {task_type!r} never seen in training")
        # one row: a plain loop beats array calls; a missing or non-numeric value is no evidence
        for key, centre, scale in self.ood_reference:
            x = _number(state.get(key))
            z = abs(x - centre) / scale
            if z > ood_z:  # False for NaN
                notes.append(f"{key} = {x:g} is {z:.1f} robust SDs from its training centre {centre:g}")
        return notes

    # ------------------------------------------------------------------ actions
    def action(self, token: int) -> "Action":
        """The decoded action of a token (what the audit keeps for export)."""
        act = self._actions.get(token)
        if act is None:
            # core.access.audit's own decoder: exported episodes read the same as `--catalog` decoding

            act = self._actions[token] = token_action(self.catalog, token)
        return act


_SERIALS = itertools.count()


@dataclass
class EpisodeState:
    """One served episode, in memory."""

    episode_id: str
    runtime: PolicyRuntime
    started_at: float
    last_seen: float
    #: Tells apart two episodes under the same id (one expired, then a new one).
    serial: int = field(default_factory=lambda: next(_SERIALS))
    step_t: int = 0
    #: Served tokens, decision times and (reported) rewards, oldest first (last TRACE_LEN).
    trace_tokens: list[int] = field(default_factory=list)
    trace_times: list[float] = field(default_factory=list)
    trace_rewards: list[float] = field(default_factory=list)
    #: Step index of each trace entry (to apply a reported reward to the right one).
    trace_steps: list[int] = field(default_factory=list)
    #: How often each action token was served (business limits count them); a dict, not a
    #: catalog-wide array, so that an idle episode costs a few hundred bytes.
    counts: dict[int, int] = field(default_factory=dict)
    #: The latest tool result (tool, result, error) and the step whose action produced it.
    result: tuple[str, Any, str | None] | None = None
    result_step: int = -1
    #: The latest result's context row (:func:`core.state.features.result_context`), kept once RL-Boost built
    #: it: the row only changes when a new result arrives.
    result_row: np.ndarray | None = None
    #: ``(query, sentence embedding, rule vector)`` kept once RL-Boost needed them: the
    #: episode's later requests with the same query never look the embedding up again.
    intent: tuple[str, np.ndarray, np.ndarray] | None = None
    #: The policy's intent branch of that query (the numpy forward's; None until computed).
    intent_state: np.ndarray | None = None

    @property
    def prev_token(self) -> int:
        return self.trace_tokens[-1] if self.trace_tokens else NO_PREVIOUS


@dataclass
class _Row:
    """Everything one request needs on its way through a batch."""

    index: int
    request: DecisionRequest
    episode: EpisodeState
    new_episode: bool
    state: dict[str, Any]
    #: The latest tool result as (tool, result, error), or None before the first one.
    result: tuple[str, Any, str | None] | None
    #: The step index of this request, and how many steps ago the latest result came.
    step_t: int
    since: int
    ood_notes: list[str]
    #: The decision time (the trace's Δt is measured to it).
    now: float
    #: The request brought a new tool result (the episode keeps it at commit).
    new_result: bool = False
    #: The result's context row and the query's ``(embedding, rule vector)`` when known:
    #: taken from the episode, or built by RL-Boost (the episode keeps them at commit).
    result_row: np.ndarray | None = None
    intent: tuple[np.ndarray, np.ndarray] | None = None
    #: The policy's intent branch of the query (numpy forward), like ``intent``.
    intent_state: np.ndarray | None = None
    #: RL-Boost was due but deferred: the query's embedding is not ready.
    intent_pending: bool = False
    decision_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def context(self, stats: Any) -> np.ndarray:
        """The encoder's context input (only the policy needs it: computed on RL-Boost;
        the result's part once per result), by the functions extract_features builds a
        logged step's with."""
        from core.state.features import result_context, step_context  # deferred: loads torch

        if self.result is not None and self.result_row is None:
            self.result_row = result_context(*self.result, stats)
        return step_context(self.result_row, self.since, self.step_t, self.state, stats)

    def trace(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The encoder's trace input (RL-Boost only).  While a decision holds the engine's
        lock the episode's trace lists are only replaced, never changed in place (only
        report_outcome does that, under the same lock), so this reads them as they were
        when the request came."""
        from core.state.features import trace_arrays  # deferred: loads torch

        ep = self.episode
        return trace_arrays(ep.trace_tokens, ep.trace_times, ep.trace_rewards, self.now)


@dataclass
class _Boost:
    """What the policy proposed for the rows of a batch that needed it."""

    top: np.ndarray           # [B, k] token ids (-1 = none)
    prob: np.ndarray          # [B, k]
    est: np.ndarray           # [B, k] reward estimates of the candidates
    rde_est: np.ndarray       # [B] reward estimate of the baseline's action (nan = none)
    state_value: np.ndarray   # [B] critic value of the current state


@dataclass
class _Outcome:
    """One request's decision, made but not served yet (DecisionEngine._serve serves a
    batch's outcomes together, or none of them)."""

    row: _Row
    #: The :class:`Decision`'s fields but the latency (``review_item`` set once served).
    fields: dict[str, Any]
    #: Its audit record and decoded final action.
    record: dict[str, Any]
    action: "Action"
    #: The review item to queue once it is served (None: no review).
    review: "review.ReviewRequest | None"


# =========================================================================== arbitration
@dataclass(frozen=True)
class Verdict:
    """The outcome of arbitration for one request."""

    final: int
    #: "rde" (the baseline), "policy" (its pick adopted) or "fallback" (no proposal).
    source: str
    confidence: float
    adopted: bool
    overridden: bool
    explanation: str


def arbitrate(rt: PolicyRuntime, rde: int, rde_conf: float, rde_est: float | None,
              candidates: Sequence[Candidate], allowed: np.ndarray, config: ServingConfig, *,
              boosted: bool, timed_out: bool, intent_pending: bool = False,
              intent_error: str | None = None) -> Verdict:
    """Choose between the baseline's action ``rde`` (-1: the tree has none allowed) and the
    policy's ``candidates`` (most probable first; empty when RL-Boost did not run, ran
    out of time, or was deferred because the query's embedding was not ready:
    ``intent_pending``).

    The policy's pick is adopted when the mask allows it and its reward estimate beats the
    baseline action's by more than ``adopt_margin`` — or when there is no baseline action.
    ``force_rde_override`` never adopts (an adoption it prevents is an *override*).
    Without either proposal: escalate (``E0``), else the final answer (``F0``), else the
    first allowed action."""
    names = rt.names
    pick = candidates[0] if candidates else None
    beats = pick is not None and bool(allowed[pick.id]) and (
        rde < 0 or (rde_est is not None and pick.reward_est - rde_est > config.adopt_margin))
    overridden = beats and config.force_rde_override
    if beats and not overridden and pick is not None:
        why = (f"adopted the policy's pick {pick.name}: reward estimate {pick.reward_est:.3f} beats the "
               f"baseline's {rde_est:.3f} by more than {config.adopt_margin}" if rde >= 0 else
               f"adopted the policy's pick {pick.name}: the baseline has no allowed action")
        return Verdict(pick.id, "policy", pick.prob, True, False, why)
    if rde >= 0:
        if not boosted:
            why = f"baseline {names[rde]} with confidence {rde_conf:.2f}"
        elif overridden and pick is not None:  # overridden: the pick beat the baseline
            why = f"force_rde_override kept the baseline {names[rde]} (the policy's {pick.name} would have won)"
        elif timed_out:
            why = (f"candidate generation exceeded its {config.time_budget_ms:g} ms budget: the baseline "
                   f"{names[rde]} decided alone")
        elif intent_pending and intent_error:
            why = (f"RL-Boost deferred: the sentence model failed on this query ({intent_error}; retried in "
                   f"the background); the baseline {names[rde]} decided alone")
        elif intent_pending:
            why = (f"RL-Boost deferred: the query's sentence embedding is still being computed (ready for "
                   f"the episode's next request); the baseline {names[rde]} decided alone")
        elif pick is None:
            why = f"the policy proposed no allowed action: baseline {names[rde]}"
        else:
            gap = "n/a" if rde_est is None else f"{pick.reward_est - rde_est:+.3f}"
            why = (f"kept the baseline {names[rde]}: the policy's {pick.name} does not beat it by more than "
                   f"{config.adopt_margin} (reward estimate gap {gap})")
        return Verdict(rde, "rde", rde_conf, False, overridden, why)
    final = next((a for a in (rt.escalate_id, rt.final_id) if allowed[a]), int(np.flatnonzero(allowed)[0]))
    cause = ("force_rde_override" if overridden else "candidate generation timed out" if timed_out
             else "the policy proposed none")
    return Verdict(final, "fallback", 0.0, False, overridden,
                   f"no proposal (the tree has no allowed action; {cause}): {names[final]}")


# =========================================================================== the engine
def _index_stat(root: str | Path | None) -> tuple[int, int, int] | None:
    """Identity of the policies index file (changes when a promotion replaces it)."""
    try:
        st = os.stat(policies_folder(root) / INDEX)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class DecisionEngine:
    """Serves decisions for one policy (a bundle, or a promoted policy that may be
    re-promoted while the engine runs).  Thread-safe: decisions are made one batch at a
    time.  Build it with :func:`load` (or :meth:`from_bundle` / :meth:`from_policy`);
    :meth:`close` it (or use ``with``) to commit the last audit records."""

    def __init__(self, ws: "Workspace", bundle: "LoadedBundle", *, config: ServingConfig | None = None,
                 actor: Actor | None = None, policy_name: str | None = None,
                 policies_root: str | Path | None = None, embedder: Any = None,
                 clock: Callable[[], float] = time.monotonic, audit_writer: "AuditWriter | None" = None,
                 metrics: ServingMetrics | None = None):
        self.ws = ws
        self.config = config or ServingConfig()
        if self.config.torch_threads is not None:
            import torch
            from threadpoolctl import threadpool_limits

            torch.set_num_threads(self.config.torch_threads)
            threadpool_limits(self.config.torch_threads, user_api="blas")  # the numpy policy's
        if self.config.switch_interval_ms is not None:
            sys.setswitchinterval(self.config.switch_interval_ms / 1000.0)
        self.actor = actor or Actor.service("decision-engine")
        self.refusals = RefusalLog(ws, self.actor)
        self.clock = clock
        self.metrics = metrics or ServingMetrics()
        self._policy_name = policy_name
        self._policies_root = policies_root
        self._index_stat: tuple[int, int, int] | None = None
        self.runtime = PolicyRuntime(bundle)
        self.reload_error: str | None = None
        if policy_name is not None:
            self._index_stat = _index_stat(self._policies_root)
        #: The engine made its embedder (then close() closes it).
        self._own_embedder = embedder is None
        if embedder is None:
            # the workspace's cache read-only: the engine keeps its own bounded cache of intents
            base = core.base.embed.workspace_embedder(ws)
            embedder = base.reader(process=self.config.model_process) if hasattr(base, "reader") else base
        self.embedder = embedder
        c = self.config
        self.audit = audit_writer or AuditWriter(ws, self.actor, batch_size=c.audit_batch_size,
                                                 flush_interval_s=c.audit_flush_interval_s,
                                                 synchronous=c.audit_synchronous)
        self._own_audit = audit_writer is None
        self._episodes: collections.OrderedDict[str, EpisodeState] = collections.OrderedDict()
        #: decision id -> (episode id, episode serial, step, policy version)
        self._served: collections.OrderedDict[str, tuple[str, int, int, str]] = collections.OrderedDict()
        self._intents: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        #: The numpy policy's intent branch of a query, by (policy version, query): computed
        #: with the query's embedding, off the request's path (under ``_intent_lock`` too).
        self._intent_branches: collections.OrderedDict[tuple[str, str], np.ndarray] = collections.OrderedDict()
        #: Embeddings under way (query -> the job computing it), and the lock of both maps.
        self._intent_jobs: dict[str, concurrent.futures.Future] = {}
        #: The latest embedding failure per query (until it embeds), named by deferrals.
        self._intent_errors: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._intent_lock = threading.Lock()
        self._lock = threading.RLock()
        # One worker: candidate generation runs beside the request so its budget can be
        # enforced; a run that overruns finishes in the background and is ignored.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rwb-rl-boost")
        #: Wall ms of the policy's latest runs (embedding waits excluded): whether it may run inline.
        self._boost_ms: collections.deque[float] = collections.deque(maxlen=INLINE_WINDOW)
        # The sentence embedding of a new episode's query is started when the episode starts,
        # beside the decision, so that a later RL-Boost finds it ready.
        self._intent_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rwb-intent")
        # Load the sentence model there now, so the first new queries are not deferred while it loads.
        warm_up = getattr(self.embedder, "warm_up", None)
        if callable(warm_up):
            self._intent_pool.submit(warm_up)
        # Review items are written off the request's path: the decision carries an id reserved
        # beforehand, and this thread writes the item right after (flush() waits for it).
        self._review_ids: collections.deque[int] = collections.deque()
        #: Items accepted and not written yet: (their reserved ids, requests, queued at), oldest first.
        self._review_pending: list[tuple[list[int], list[review.ReviewRequest], float]] = []
        self._review_lock = threading.Lock()          # guards the two above
        self._review_write_lock = threading.Lock()    # one writer of pending items at a time
        self._review_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rwb-review")
        #: The latest failure to write review items (they stay pending), None after a success.
        self.review_error: BaseException | None = None
        self._closed = False
        if self.config.freeze_gc:
            gc.collect()
            gc.freeze()
        #: Runs the collector between requests (ServingConfig.idle_gc), else None.
        self.collector = IdleCollector(self._lock) if self.config.idle_gc else None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_bundle(cls, ws: "Workspace", path: str | Path, **options: Any) -> "DecisionEngine":
        """An engine serving the bundle at ``path`` (zip or promoted folder; verified, its
        signature by a key ``ws`` trusts)."""
        return cls(ws, load_bundle(path, trust=trust_store(ws)), **options)

    @classmethod
    def from_policy(cls, ws: "Workspace", name: str, *, root: str | Path | None = None,
                    **options: Any) -> "DecisionEngine":
        """An engine serving the promoted policy ``name`` (``core/policies`` or
        ``$RWB_POLICIES_DIR`` or ``root``) in the version the registry's records say
        (:func:`load_promoted`); newly promoted versions are picked up at the next episode
        start."""
        seen = _index_stat(root)  # taken before loading: a promotion meanwhile is picked up later
        engine = cls(ws, load_promoted(ws, name, root=root, actor=options.get("actor")), policy_name=name,
                     policies_root=root, **options)
        engine._index_stat = seen
        return engine

    @property
    def policy_version(self) -> str:
        """The version new episodes start on (``name@version``)."""
        return self.runtime.version

    # ------------------------------------------------------------------ hot reload
    def _pick_up_promotion(self) -> None:
        """At an episode start, when the index changed (the registry rewrites it after each
        promotion and rollback): resolve the active version again (the registry's records,
        or the signed index) and load it when it is another copy than the one new episodes
        start on.  A version that cannot be resolved or loaded is not served: the engine
        keeps the current one, counts the failure (``rwb_policy_reloads{result="failed"}``),
        keeps the reason in ``reload_error`` and tries again when the index changes next."""
        if self._policy_name is None:
            return
        stat = _index_stat(self._policies_root)
        if stat == self._index_stat:
            return
        self._index_stat = stat

        try:
            active = resolve_active(self.ws, self._policy_name, root=self._policies_root, actor=self.actor)
            current = self.runtime.bundle.manifest
            if (active.policy_version, active.manifest_digest) == (self.runtime.version, current.digest):
                return
            self.runtime = PolicyRuntime(load_promoted(self.ws, self._policy_name, root=self._policies_root,
                                                       actor=self.actor, active=active))
        except RwbError as exc:
            self.reload_error = str(exc)
            self.metrics.reloads.labels("failed").inc()
            return
        self.reload_error = None
        self.metrics.reloads.labels("loaded").inc()

    # ------------------------------------------------------------------ episodes
    def _expire(self, now: float) -> None:
        ttl = self.config.episode_ttl_s
        while self._episodes:
            eid, ep = next(iter(self._episodes.items()))
            if now - ep.last_seen <= ttl:
                break
            del self._episodes[eid]

    def _episode(self, episode_id: str, now: float) -> tuple[EpisodeState, bool]:
        ep = self._episodes.get(episode_id)
        if ep is not None:
            return ep, False
        self._pick_up_promotion()
        rt = self.runtime
        ep = EpisodeState(episode_id=episode_id, runtime=rt, started_at=now, last_seen=now)
        return ep, True

    def episode(self, episode_id: str) -> EpisodeState | None:
        """The in-memory state of an episode (None when unknown or expired)."""
        with self._lock:
            self._expire(self.clock())
            return self._episodes.get(episode_id)

    @property
    def active_episodes(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._episodes)

    # ------------------------------------------------------------------ deciding
    def decide(self, request: Mapping[str, Any] | DecisionRequest) -> Decision:
        """Decide one request (docs/serving.md).  Raises :class:`InputError` for
        an invalid request and :class:`core.access.audit.AuditUnavailable` when the decision
        cannot be audited (then nothing was served)."""
        return self.decide_batch([request])[0]

    def decide_batch(self, requests: Sequence[Mapping[str, Any] | DecisionRequest]) -> list[Decision]:
        """Decide many requests at once (at most one per episode): masks, tree, policy
        and critic each run once over the batch.

        A batch is atomic.  Every request is validated (fields and their limits, one request
        per episode, its tool result) before anything is decided; then either every decision
        is served, audited (the batch's records accepted at once, one transaction) and its
        episode advanced, or none is: an :class:`InputError`, a failure while deciding or the
        audit trail's refusal leaves every episode as it was and no record written.  A
        refused request writes a ``request_refused`` security event (:class:`RefusalLog`)."""
        t0 = time.perf_counter()
        try:
            return self._decide_all(requests, t0)
        except InputError as exc:
            self.refusals.refused_input(exc, source="engine")
            raise

    def _decide_all(self, requests: Sequence[Mapping[str, Any] | DecisionRequest], t0: float) -> list[Decision]:
        """:meth:`decide_batch` but the logging of a refusal."""
        parsed = [parse_request(r, index=i if len(requests) > 1 else None) for i, r in enumerate(requests)]
        seen: set[str] = set()
        for i, r in enumerate(parsed):
            if r.episode_id in seen:
                raise InputError(f"request {i}: episode {_short(r.episode_id)} appears twice in one batch; its "
                                 "steps depend on each other — decide them one after the other",
                                 field="episode_id", record=i)
            seen.add(r.episode_id)
        if not parsed:
            return []
        with self._lock:
            if self._closed:
                raise RwbError("this decision engine is closed")
            now = self.clock()
            self._expire(now)
            rows = [self._prepare(i, r, now) for i, r in enumerate(parsed)]
            groups: dict[int, list[_Row]] = {}
            for row in rows:  # episodes may run on different policy versions
                groups.setdefault(id(row.episode.runtime), []).append(row)
            outcomes: list[_Outcome] = []
            for group in groups.values():
                outcomes += self._decide_group(group[0].episode.runtime, group, now, t0)
            self._serve(outcomes, now)
            made = [o.fields for o in sorted(outcomes, key=lambda o: o.row.index)]
            # After the decisions, so that a request does not share the CPU with its own
            # query's embedding when the baseline answered it alone: the deferred RL-Boosts'
            # queries, and (prefetch_intent) every new episode's.
            wanted = [r.request.query for r in rows if r.intent is None
                      and (r.intent_pending or (self.config.prefetch_intent and r.new_episode))]
            if wanted:
                self._prefetch_intents(wanted)
            self.metrics.episodes.set(len(self._episodes))
            per = (time.perf_counter() - t0) / len(rows)
            for _ in rows:
                self.metrics.latency.observe(per)
            decisions = [Decision(**fields, latency_ms=per * 1000.0) for fields in made]
            if self.collector is not None:  # it collects once this lock is released
                self.collector.after_request()
            return decisions

    def _prepare(self, index: int, req: DecisionRequest, now: float) -> _Row:
        """Episode state, latest result and trace of one request (nothing is changed yet:
        the episode is updated only once its decision is audited)."""
        ep, new = self._episode(req.episode_id, now)
        rt = ep.runtime
        result, result_step = ep.result, ep.result_step
        new_result = False
        if req.last_result is not None:
            lr = req.last_result
            prev = ep.prev_token
            tool = lr.tool or (None if prev < 0 else (rt.tools[prev] or rt.kinds[prev]))
            if tool is None:
                raise InputError(f"request {index}: last_result needs its tool (the episode has no served "
                                 "action it could belong to)", field="last_result.tool", record=index)
            if lr.result is not None or lr.error is not None:
                # a call that returned nothing is no result, as for a logged step (extract_features)
                result, result_step, new_result = (tool, lr.result, lr.error), ep.step_t - 1, True
        state = dict(req.state)
        notes = rt.out_of_distribution(state, req.task_type, self.config.ood_z)
        intent = ep.intent if ep.intent is not None and ep.intent[0] == req.query else None
        return _Row(index=index, request=req, episode=ep, new_episode=new, state=state, result=result,
                    step_t=ep.step_t, since=ep.step_t - result_step if result else 0, ood_notes=notes,
                    now=now, new_result=new_result, result_row=None if new_result else ep.result_row,
                    intent=None if intent is None else intent[1:],
                    intent_state=None if intent is None else ep.intent_state)

    def _decide_group(self, rt: PolicyRuntime, rows: list[_Row], now: float, t0: float
                      ) -> list["_Outcome"]:
        """Masks, tree, RL-Boost and arbitration for rows on one policy version; returns
        each row's outcome (its decision's fields but the latency and review item, its audit
        record and review request), which :meth:`_serve` serves: nothing is audited, queued
        or changed in an episode here."""
        cfg, v = self.config, rt.version
        B = len(rows)
        rt.refresh_masks(self.ws)
        states = [r.state for r in rows]
        task_types = [r.request.task_type for r in rows]
        counts = np.zeros((B, rt.n_actions), dtype=np.int64)
        for b, r in enumerate(rows):
            for token, n in r.episode.counts.items():
                counts[b, token] = n
        mask = rt.mask(states, task_types, counts)
        step_t = np.array([r.step_t for r in rows], dtype=np.int64)
        prev = np.array([r.episode.prev_token for r in rows], dtype=np.int64)
        X = rt.bundle.rde.featurize(states, task_types, step_t, prev)
        rde_tok, rde_conf = rt.bundle.rde.predict(X, mask)

        reasons: list[list[str]] = [[] for _ in rows]
        for b, r in enumerate(rows):
            if rde_tok[b] < 0:
                reasons[b].append("no_rde_action")
            elif rde_conf[b] < cfg.confidence_threshold:
                reasons[b].append("low_confidence")
            if r.ood_notes:
                reasons[b].append("out_of_distribution")
        boost_rows = [b for b in range(B) if reasons[b]]
        if boost_rows and not cfg.wait_for_intent:
            for b in boost_rows:  # the tree has an action: it answers while the query is embedded
                rows[b].intent_pending = bool(rde_tok[b] >= 0) and not self._intent_ready(rows[b])
            boost_rows = [b for b in boost_rows if not rows[b].intent_pending]
        boost: _Boost | None = None
        timed_out = False
        if boost_rows:
            sub, budget_s = [rows[b] for b in boost_rows], cfg.time_budget_ms / 1000.0
            recent = list(self._boost_ms)
            if (len(recent) == INLINE_WINDOW and max(recent) < INLINE_SHARE * cfg.time_budget_ms
                    and all(self._intent_ready(r) for r in sub)):
                # fast and nothing to wait for: here, sparing two thread wake-ups; a run that
                # stalled past the budget anyway is discarded like one that timed out
                boost = self._propose(rt, sub, mask[boost_rows], rde_tok[boost_rows])
                if time.perf_counter() - t0 > budget_s:
                    boost, timed_out = None, True
            else:
                future = self._pool.submit(self._propose, rt, sub, mask[boost_rows], rde_tok[boost_rows])
                try:
                    boost = future.result(timeout=max(budget_s - (time.perf_counter() - t0), 0.0))
                except concurrent.futures.TimeoutError:
                    timed_out = True
        where = {b: j for j, b in enumerate(boost_rows)}

        # ---------------------------------------------------------------- arbitration
        out: list[dict[str, Any]] = []
        for b, r in enumerate(rows):
            j = where.get(b)
            cands: list[Candidate] = []
            rde_est = state_value = None
            if boost is not None and j is not None:
                cands = [Candidate(int(tok), rt.names[tok], rt.labels[tok], float(p), float(e))
                         for tok, p, e in zip(boost.top[j], boost.prob[j], boost.est[j]) if tok >= 0]
                rde_est = None if math.isnan(boost.rde_est[j]) else float(boost.rde_est[j])
                state_value = float(boost.state_value[j])
            verdict = arbitrate(rt, int(rde_tok[b]), float(rde_conf[b]), rde_est, cands, mask[b], cfg,
                                boosted=bool(reasons[b]), timed_out=timed_out and j is not None,
                                intent_pending=r.intent_pending,
                                intent_error=self._intent_errors.get(r.request.query) if r.intent_pending else None)
            components: tuple[dict[str, Any], ...] = ()
            value = cands[0].reward_est if verdict.adopted else rde_est if verdict.source == "rde" else None
            if state_value is not None and value is not None:
                components = ({"name": "state_value", "value": state_value},
                              {"name": "action_advantage", "value": value - state_value})
            out.append({"final": verdict.final, "source": verdict.source, "conf": verdict.confidence,
                        "cands": cands, "rde_est": rde_est, "adopted": verdict.adopted,
                        "overridden": verdict.overridden, "timed_out": timed_out and j is not None,
                        "why": verdict.explanation, "components": components})

        # ---------------------------------------------------------------- the outcomes (_serve serves them)
        outcomes = []
        for b, (r, o) in enumerate(zip(rows, out)):
            rde, final = int(rde_tok[b]), o["final"]
            record = {"input_hash": None, "rde_action": rde if rde >= 0 else None,
                      "rl_candidates": [c.audit() for c in o["cands"]], "final_action": final,
                      "reward_components": list(o["components"]), "policy_version": v,
                      "episode_id": r.request.episode_id, "decision_id": r.decision_id}
            to_review = rt.risks[final] in cfg.review_risks and o["conf"] < cfg.review_confidence
            fields = dict(
                decision_id=r.decision_id, episode_id=r.request.episode_id, step_t=r.step_t,
                policy_version=v, final_action=final, final_name=rt.names[final],
                final_label=rt.labels[final], kind=rt.kinds[final], tool=rt.tools[final],
                risk=rt.risks[final], source=o["source"], confidence=o["conf"],
                rde_action=rde if rde >= 0 else None, rde_confidence=float(rde_conf[b]),
                rl_boost=bool(reasons[b]), rl_boost_reasons=tuple(reasons[b]), rl_candidates=tuple(o["cands"]),
                rde_reward_est=o["rde_est"], adopted=o["adopted"], overridden=o["overridden"],
                timed_out=o["timed_out"], intent_pending=r.intent_pending, ood=bool(r.ood_notes),
                ood_notes=tuple(r.ood_notes),
                review_item=None, reward_components=o["components"], explanation=o["why"])
            outcomes.append(_Outcome(row=r, fields=fields, record=record, action=rt.action(final),
                                     review=self._review_request(rt, r, o, reasons[b]) if to_review else None))
        return outcomes

    def _serve(self, outcomes: list[_Outcome], now: float) -> None:
        """Serve a batch's decisions, all or none: the review item ids are reserved and every
        audit record is accepted at once (one transaction) before anything changes; only then
        are the episodes advanced, the metrics counted and the review items queued (nothing
        after the audit refuses).  A refusal before leaves the episodes as they were and gives
        the reserved ids back."""
        reviewed = [o for o in outcomes if o.review is not None]
        ids = self._reserve_review_ids(len(reviewed)) if reviewed else []
        try:
            self.audit.write_batch([(o.record, o.row.request.to_json_dict(), o.action) for o in outcomes])
        except BaseException:
            if ids:
                with self._review_lock:
                    self._review_ids.extendleft(reversed(ids))
            raise
        m = self.metrics
        for o in outcomes:
            r, f, v = o.row, o.fields, o.fields["policy_version"]
            self._commit(r, f["final_action"], now)
            m.decisions.labels(v, f["source"]).inc()
            for reason in f["rl_boost_reasons"]:
                m.rl_boost.labels(v, reason).inc()
            for flag, counter in ((f["ood"], m.ood), (f["adopted"], m.adoptions), (f["timed_out"], m.timeouts),
                                  (f["intent_pending"], m.deferred), (f["overridden"], m.overrides),
                                  (o.review is not None, m.review_pushes)):
                if flag:
                    counter.labels(v).inc()
        if reviewed:
            for o, item in zip(reviewed, ids):
                o.fields["review_item"] = item
            self._push_reviews(ids, [o.review for o in reviewed if o.review is not None])

    def _commit(self, r: _Row, token: int, now: float) -> None:
        """Record a served (and audited) action in its episode."""
        from core.state.features import TRACE_LEN  # deferred: loads torch

        ep = r.episode
        if r.new_result:
            ep.result, ep.result_step, ep.result_row = r.result, r.step_t - 1, r.result_row
        elif r.result_row is not None:
            ep.result_row = r.result_row
        if r.intent is not None:
            ep.intent, ep.intent_state = (r.request.query, *r.intent), r.intent_state
        ep.trace_tokens = (ep.trace_tokens + [token])[-TRACE_LEN:]
        ep.trace_times = (ep.trace_times + [now])[-TRACE_LEN:]
        ep.trace_rewards = (ep.trace_rewards + [0.0])[-TRACE_LEN:]
        ep.trace_steps = (ep.trace_steps + [ep.step_t])[-TRACE_LEN:]
        ep.counts[token] = ep.counts.get(token, 0) + 1
        ep.step_t += 1
        ep.last_seen = now
        self._episodes[ep.episode_id] = ep
        self._episodes.move_to_end(ep.episode_id)
        self._served[r.decision_id] = (ep.episode_id, ep.serial, ep.step_t - 1, ep.runtime.version)
        if len(self._served) > OUTCOME_MEMORY:
            self._served.popitem(last=False)

    def _review_request(self, rt: PolicyRuntime, r: _Row, o: Mapping[str, Any], reasons: list[str]
                        ) -> "review.ReviewRequest":
        tok = o["final"]
        why = (f"{rt.risks[tok]}-risk action served with confidence {o['conf']:.2f} (below "
               f"{self.config.review_confidence}) by the {o['source']}")
        if reasons:
            why += f"; RL-Boost: {', '.join(reasons)}"
        return review.ReviewRequest(
            origin="serving", reason=why, state=r.state, token_id=tok, token_name=rt.names[tok],
            action_label=rt.labels[tok], tool=rt.tools[tok], risk=rt.risks[tok],
            reward_components=list(o["components"]), task_type=r.request.task_type, dataset=rt.dataset,
            confidence=o["conf"], episode_id=r.request.episode_id, step_t=r.step_t,
            decision_id=r.decision_id,
            meta={"policy_version": rt.version, "explanation": o["why"], "query": r.request.query,
                  "rl_candidates": [c.audit() for c in o["cands"]]})

    def _reserve_review_ids(self, n: int) -> list[int]:
        """``n`` review item ids for a batch's pushes, taken before its decisions are served
        (a new block of ids is reserved here when the engine's are used up)."""
        with self._review_lock:
            if len(self._review_ids) < n:
                self._review_ids.extend(review.reserve_item_ids(self.ws, self.actor, max(REVIEW_ID_BLOCK, n)))
            return [self._review_ids.popleft() for _ in range(n)]

    def _push_reviews(self, ids: list[int], reqs: list["review.ReviewRequest"]) -> None:
        """Queue the items of served decisions under their reserved ``ids``: the review
        thread writes them right after the request."""
        with self._review_lock:
            self._review_pending.append((ids, reqs, time.time()))
        self._review_pool.submit(self._write_reviews)

    def _write_reviews(self) -> int:
        """Write every pending review item, oldest first, each push in its own transaction;
        returns how many were written.  A push that fails stays pending with those after it
        (the next push or flush() retries them), its error in ``review_error``, and is raised."""
        with self._review_write_lock:
            with self._review_lock:
                pushes, self._review_pending = self._review_pending, []
            written = 0
            for k, (ids, reqs, at) in enumerate(pushes):
                try:
                    review.enqueue_many(self.ws, self.actor, reqs, ids=ids, created_at=at)
                except Exception as exc:
                    with self._review_lock:
                        self._review_pending[:0] = pushes[k:]
                    self.review_error = exc
                    self.metrics.review_write_failures.inc()
                    raise
                written += len(ids)
            if pushes:
                self.review_error = None
                with self._review_lock:
                    low = len(self._review_ids) < REVIEW_ID_BLOCK // 2
                if low:  # the next block, here rather than on a request's path
                    try:
                        more = review.reserve_item_ids(self.ws, self.actor, REVIEW_ID_BLOCK)
                    except Exception:  # the items are written; a request reserves when the ids run out
                        more = []
                    with self._review_lock:
                        self._review_ids.extend(more)
            return written

    # ------------------------------------------------------------------ RL-Boost
    def _intent_ready(self, row: _Row) -> bool:
        """Whether ``row``'s query has its intent at hand (the episode's, or the engine's
        cache, which then fills ``row.intent``) — never waits."""
        if row.intent is None:
            with self._intent_lock:
                row.intent = self._intents.get(row.request.query)
                if row.intent is not None:
                    self._intents.move_to_end(row.request.query)
        return row.intent is not None

    def _prefetch_intents(self, queries: Sequence[str]) -> None:
        """Start embedding, on the intent thread, the queries that are neither cached nor
        under way (one job), so that a later RL-Boost finds them ready."""
        with self._intent_lock:
            new = [q for q in dict.fromkeys(queries) if q not in self._intents and q not in self._intent_jobs]
            if not new:
                return
            job: concurrent.futures.Future = concurrent.futures.Future()
            for q in new:
                self._intent_jobs[q] = job
        self._intent_pool.submit(self._run_prefetch, new, job)

    def _run_prefetch(self, queries: list[str], job: concurrent.futures.Future) -> None:
        """The intent thread's job: embed, unless an RL-Boost took the job over (cancelled
        it) while it waited in the queue."""
        if job.set_running_or_notify_cancel():
            self._embed_into(queries, job)

    def _embed_into(self, queries: list[str], job: concurrent.futures.Future) -> None:
        """Embed ``queries`` (registered under the running ``job``), cache their intents
        and resolve ``job`` with them (or with the embedder's error); then drop the
        registration.  The registration goes after the result, so a query is always
        cached or under way while its embedding runs: nobody embeds it twice."""
        try:
            job.set_result(self._embed(queries))
        except BaseException as exc:  # handed to whoever waits on the job, and remembered
            self.metrics.embed_failures.inc()
            with self._intent_lock:
                for q in queries:
                    self._intent_errors[q] = f"{type(exc).__name__}: {exc}"
                    self._intent_errors.move_to_end(q)
                while len(self._intent_errors) > INTENT_CACHE_SIZE:
                    self._intent_errors.popitem(last=False)
            job.set_exception(exc)
        finally:
            with self._intent_lock:
                for q in queries:
                    if self._intent_jobs.get(q) is job:
                        del self._intent_jobs[q]

    def _embed(self, queries: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Sentence embedding and rule vector of each query (:func:`core.state.features.intent_features`,
        as extract_features computes a logged request's), kept in the cache and returned."""
        from core.state.features import intent_features  # deferred: loads torch

        emb, rules = intent_features(queries, self.embedder)
        out = {q: (e, r) for q, e, r in zip(queries, emb, rules)}
        rt = self.runtime  # the version new episodes start on: its policy's intent branch now, not on a request
        branches = None if rt.fast is None else rt.fast.intent(emb, rules)
        with self._intent_lock:
            for q, value in out.items():
                self._intents[q] = value
                self._intents.move_to_end(q)
                self._intent_errors.pop(q, None)
            while len(self._intents) > INTENT_CACHE_SIZE:
                self._intents.popitem(last=False)
            if branches is not None:
                self._keep_branches(rt.version, list(out), branches)
        return out

    def _keep_branches(self, version: str, queries: list[str], branches: np.ndarray) -> None:
        """Remember the intent branches of ``queries`` under ``version`` (caller holds ``_intent_lock``)."""
        for q, e in zip(queries, branches):
            self._intent_branches[(version, q)] = e
            self._intent_branches.move_to_end((version, q))
        while len(self._intent_branches) > INTENT_CACHE_SIZE:
            self._intent_branches.popitem(last=False)

    def _intent(self, queries: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{query: (embedding, rule vector)}``: from the cache, from an embedding that is
        running (waited for), or embedded here — also a prefetch still waiting in the
        queue behind others, which is taken over (with its other queries) rather than
        waited for.  What is embedded here is registered like a prefetch, so that nobody
        else embeds it meanwhile.  Raises what the embedder raised."""
        own: concurrent.futures.Future = concurrent.futures.Future()
        own.set_running_or_notify_cancel()  # running from the start: nobody can take it over
        with self._intent_lock:
            got = {q: self._intents[q] for q in queries if q in self._intents}
            for q in got:
                self._intents.move_to_end(q)
            needed = [q for q in dict.fromkeys(queries) if q not in got]
            queued = {self._intent_jobs[q] for q in needed if q in self._intent_jobs}
            taken = {job for job in queued if job.cancel()}
            mine = [q for q, job in self._intent_jobs.items() if job in taken]
            mine += [q for q in needed if q not in self._intent_jobs]
            waits = queued - taken
            for q in mine:
                self._intent_jobs[q] = own
        if mine:
            self._embed_into(mine, own)
            waits.add(own)
        for job in waits:
            try:
                got.update(job.result())
            except concurrent.futures.CancelledError:  # another RL-Boost took it over: ask again
                pass
        missing = [q for q in needed if q not in got]
        return {**got, **self._intent(missing)} if missing else got

    def _intents_of(self, rows: list[_Row]) -> tuple[np.ndarray, np.ndarray]:
        """``(intent_emb [B, 384], intent_rules [B, D])`` of the rows; a row whose episode
        has no intent for its query yet gets one (kept by the episode at commit)."""
        missing = [r.request.query for r in rows if r.intent is None]
        found = self._intent(missing) if missing else {}
        intents = []
        for r in rows:
            if r.intent is None:
                r.intent = found[r.request.query]
            intents.append(r.intent)
        return np.stack([i[0] for i in intents]), np.stack([i[1] for i in intents])

    def _propose(self, rt: PolicyRuntime, rows: list[_Row], mask: np.ndarray, rde_tok: np.ndarray) -> _Boost:
        """The policy's top-k allowed actions and the critic's reward estimates: of each
        candidate (and of the baseline's action), the critic's value of the state after it."""
        from core.state.features import set_progress, trace_after  # deferred: loads torch

        k = min(self.config.top_k, rt.n_actions)
        B = len(rows)
        emb, rules = self._intents_of(rows)
        t0 = time.perf_counter()
        context = np.stack([r.context(rt.bundle.feature_stats) for r in rows])
        t_act, t_rew, t_dt = (np.stack(parts) for parts in zip(*(r.trace() for r in rows)))
        # The state one step later, whatever the action: a result exists → it is one step older.
        nxt_ctx = context.copy()
        for row, r in zip(nxt_ctx, rows):
            set_progress(row, r.since + 1 if r.result is not None else None, r.step_t + 1)

        def shifted(acts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            """Row of each (request, action) pair and its trace after the action (a missing
            candidate, token -1, is valued as token 0 and its estimate dropped)."""
            idx = np.repeat(np.arange(B), acts.shape[1])
            return (idx, *trace_after(np.maximum(acts.reshape(-1), 0), t_act[idx], t_rew[idx], t_dt[idx]))

        fast = rt.fast
        if fast is not None:  # numpy, sharing the intent (per episode) and the next context
            missing = [b for b, r in enumerate(rows) if r.intent_state is None]
            if missing:  # computed with the embedding, unless the query was embedded for another version
                with self._intent_lock:
                    for b in missing:
                        rows[b].intent_state = self._intent_branches.get((rt.version, rows[b].request.query))
                missing = [b for b in missing if rows[b].intent_state is None]
            if missing:
                branches = fast.intent(emb[missing], rules[missing])
                with self._intent_lock:
                    self._keep_branches(rt.version, [rows[b].request.query for b in missing], branches)
                for b, e in zip(missing, branches):
                    rows[b].intent_state = e
            intent_states = []
            for r in rows:
                assert r.intent_state is not None, "every missing intent state was filled just above"
                intent_states.append(r.intent_state)
            e_int = np.stack(intent_states)
            e_ctx = fast.context(np.concatenate([context, nxt_ctx]))          # both contexts in one pass
            current = fast.state(e_int, rules, context, e_ctx[:B], t_act, t_rew, t_dt)
            top, p = _top_k(fast.logits(current), mask, k)
            acts = np.concatenate([top, rde_tok[:, None]], axis=1)             # [B, k+1]: column k = baseline
            idx, n_act, n_rew, n_dt = shifted(acts)
            after = fast.state(e_int[idx], rules[idx], nxt_ctx[idx], e_ctx[B:][idx], n_act, n_rew, n_dt)
            critic = fast.values(np.concatenate([current, after]))           # the critic once, on every row
            values, est = critic[:B], critic[B:]
        else:  # the module (TorchScript when it traces)
            import torch

            forward = rt.forward
            assert forward is not None, "a runtime without the numpy forward holds the module's"

            def run(*inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                with torch.inference_mode():
                    lg, val = forward(dict(zip(_OBS_KEYS, map(torch.from_numpy, inputs))))
                    return lg.numpy(), val.numpy()

            logits, values = run(emb, rules, context, t_act, t_rew, t_dt)
            top, p = _top_k(logits, mask, k)
            acts = np.concatenate([top, rde_tok[:, None]], axis=1)
            idx, n_act, n_rew, n_dt = shifted(acts)
            est = run(emb[idx], rules[idx], nxt_ctx[idx], n_act, n_rew, n_dt)[1]
        est = np.where(acts >= 0, est.mean(-1).reshape(B, k + 1).astype(np.float64), np.nan)
        self._boost_ms.append((time.perf_counter() - t0) * 1000.0)
        return _Boost(top=top, prob=p.astype(np.float64), est=est[:, :k], rde_est=est[:, k],
                      state_value=values.mean(-1).astype(np.float64))

    # ------------------------------------------------------------------ outcomes
    def report_outcome(self, decision_id: str, ok: bool, *, reward: float | None = None) -> bool:
        """Report whether a served action succeeded (the ``rwb_action_outcomes`` /
        ``rwb_action_failures`` metrics the alert rules read), and optionally its reward
        (the template's per-step reward), which enters the episode's trace for the
        encoder.  Returns True when the decision is still in memory (its reward was
        applied); the outcome is counted either way."""
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise InputError("reward must be a finite number", field="reward")
        with self._lock:
            served = self._served.get(decision_id)
            version = served[3] if served else "unknown"
            self.metrics.outcomes.labels(version, "ok" if ok else "failed").inc()
            if not ok:
                self.metrics.failures.labels(version).inc()
            if served is None:
                return False
            self._expire(self.clock())
            ep = self._episodes.get(served[0])
            if ep is None or ep.serial != served[1]:
                return False
            if reward is not None and served[2] in ep.trace_steps:
                ep.trace_rewards[ep.trace_steps.index(served[2])] = float(reward)
            return True

    # ------------------------------------------------------------------ metrics and closing
    def metrics_text(self) -> str:
        """The Prometheus text exposition of this engine's metrics."""
        with self._lock:
            self.metrics.episodes.set(len(self._episodes))
        return self.metrics.text()

    def flush(self) -> int:
        """Write the review items queued so far and commit every audit record written so far
        (returns how many audit records this call committed); raises when either cannot be
        written (the items and records stay pending)."""
        self._write_reviews()
        return self.audit.flush()

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the background embedding work queued so far — the sentence model's
        warm-up at start, query embeddings under way — is done (a service's readiness
        probe); False when ``timeout`` seconds passed first."""
        if self._closed:
            raise RwbError("this decision engine is closed")
        try:
            self._intent_pool.submit(lambda: None).result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Write the queued review items, commit the remaining audit records and stop the
        workers (a failed write is raised once the audit records are committed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._intent_pool.shutdown(wait=True)
        self._review_pool.shutdown(wait=True)
        if self.collector is not None:
            self.collector.close()
        try:
            self._write_reviews()  # what a failed write left pending
        finally:
            close_embedder = getattr(self.embedder, "close", None)
            if self._own_embedder and callable(close_embedder):
                close_embedder()
            if self._own_audit:
                self.audit.close()
            else:
                self.audit.flush()

    def __enter__(self) -> "DecisionEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# =========================================================================== entry points
def load_promoted(ws: "Workspace", name: str, *, root: str | Path | None = None, actor: Actor | None = None,
                  active: ActivePolicy | None = None) -> "LoadedBundle":
    """The promoted policy ``name`` in the version production serves, verified for ``ws``.

    Which version, and the manifest digest its copy must have, come from ``ws``'s registry
    when it holds ``name`` (its signed, append-only events), else from the folder's index
    entry only when a registry whose key ``ws`` trusts signed it and it is not older than
    one ``ws`` served (:func:`core.govern.policy_folder.resolve_active`; ``active`` when
    already resolved).  The copy is then checked whole: every hash, a signature by a key
    ``ws`` trusts, and that digest.  Every refusal is written to the security log
    (``policy_index_refused``, ``policy_index_stale``, ``registry_log_broken``,
    ``promoted_copy_refused``) and raised."""
    active = active or resolve_active(ws, name, root=root, actor=actor)
    base = policies_folder(root)
    try:
        return load_copy(base, name, active.version, active.manifest_digest, trust=trust_store(ws),
                         authority=active.authority)
    except BundleError as exc:
        security_event(ws, actor, "promoted_copy_refused", policy=active.policy_version,
                       path=str(base / name / active.version), reason=str(exc), source=active.source)
        raise


def _is_bundle_path(policy: str | Path) -> bool:
    p = Path(policy)
    return p.suffix.lower() == ".zip" or (p.is_dir() and (p / "manifest.json").is_file())


def load(policy: str | Path, *, ws: "Workspace | None" = None, root: str | Path | None = None,
         **options: Any) -> DecisionEngine:
    """The production entry point: an engine for the promoted policy named ``policy``
    (from ``root``, ``$RWB_POLICIES_DIR`` or ``core/policies``), or for the bundle at the
    path ``policy`` (a ``.zip`` or a promoted folder).  ``ws`` is the workspace that keeps
    the audit trail and the review queue (default: ``$RWB_WORKSPACE`` or ./workspace).
    ``options`` go to :class:`DecisionEngine` (``config=ServingConfig(...)``, ``actor``,
    ``embedder``, ``clock``)."""
    if ws is None:
        from core.records.store import Workspace  # deferred: loads pandas

        ws = Workspace.open()
    if _is_bundle_path(policy):
        if not Path(policy).exists():
            raise InputError(f"no bundle at {policy}", file=str(policy))
        return DecisionEngine.from_bundle(ws, policy, **options)
    return DecisionEngine.from_policy(ws, str(policy), root=root, **options)


#: The most JSON text ``rwb serve decide`` reads at once (its requests are served in order).
MAX_REQUESTS_TEXT_BYTES = 64 * 1024 * 1024


def read_requests(text: str, *, file: str | None = None) -> list[dict[str, Any]]:
    """Requests from JSON text: one object, a list of objects, or JSON lines.  At most
    :data:`MAX_REQUESTS_TEXT_BYTES`, parsed by :func:`core.base.bounded_json.loads` (the
    nesting a request's fields allow, measured before the parser recurses); each request's
    fields are checked against their limits when it is served (:func:`parse_request`)."""
    s = text.strip()
    if not s:
        raise InputError("no request given", file=file)
    raw = s.encode("utf-8", "surrogatepass")
    cap, depth = MAX_REQUESTS_TEXT_BYTES, REQUEST_NESTING + 1  # + 1: a list of requests
    if len(raw) > cap or max_depth_of(raw) > depth:
        bounded_json.loads(raw, max_bytes=cap, max_depth=depth, file=file)  # refuses, naming the size or the path
    try:
        data = bounded_json.loads(raw, max_bytes=cap, max_depth=depth, file=file)
        items = data if isinstance(data, list) else [data]
    except InputError:  # not one JSON document: JSON lines
        items = []
        for n, line in enumerate(s.splitlines(), 1):
            if line.strip():
                try:
                    items.append(bounded_json.loads(line, max_bytes=cap, max_depth=REQUEST_NESTING, file=file))
                except InputError as exc:
                    raise InputError(f"not JSON: {exc.reason}", file=file, line=n, field=exc.field) from None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(f"request {i} is not a JSON object", file=file, record=i)
    return items


def serve_requests(ws: "Workspace", policy: str | Path, requests: Sequence[Mapping[str, Any]], *,
                   config: ServingConfig | None = None, root: str | Path | None = None
                   ) -> tuple[list[Decision], str]:
    """Serve ``requests`` in order with a fresh engine for ``policy`` (name or bundle path),
    commit their audit records, and return the decisions and the engine's metrics text
    (what ``rwb serve decide`` and ``rwb serve metrics`` print).  The default ``config``
    waits for query embeddings (``wait_for_intent``) with the sentence model in this
    process (``model_process=False``): a one-shot run has no later request that a
    background embedding would serve, and no time to start a child."""
    parsed = [parse_request(r, index=i if len(requests) > 1 else None) for i, r in enumerate(requests)]
    config = config or ServingConfig(wait_for_intent=True, model_process=False)
    with load(policy, ws=ws, root=root, config=config) as engine:
        decisions = [engine.decide(r) for r in parsed]
        engine.flush()
        return decisions, engine.metrics_text()


__all__ = ["ALERT_RULES_FILE", "Candidate", "Decision", "DecisionEngine", "DecisionRequest", "EpisodeState",
           "LastResult", "PolicyRuntime", "ServingConfig", "ServingMetrics", "Verdict", "alert_rules", "arbitrate",
           "load", "parse_request", "read_requests", "serve_requests"]
