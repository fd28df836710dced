"""The HTTP reward service: a pinned reward template (:class:`core.rewards.trajectory.TrajectoryScorer`)
behind FastAPI, for trainers that ask for rewards over HTTP (``rwb reward serve``).

``POST /get_reward`` answers OpenRLHF's remote reward call (decoded transcripts, read with
:func:`core.rewards.markup.transcript_messages`), ``POST /verify`` NeMo Gym's (Responses API items, or
plain chat messages), ``POST /v1/score`` the workbench's own batch shape; ``/healthz``, ``/readyz`` (the
sentence model warm), ``/metrics`` (Prometheus) and ``/openapi.json`` beside them.  The endpoints only
translate: a reward is ``TrajectoryScorer.score_batch`` itself, one scorer per worker process, its
calls serialized by a lock (the sentence model is not known to be thread-safe), its embeddings kept
in memory across requests (:class:`EmbeddingLRU`).  Bodies pass the guard of :mod:`core.serve.http_guard`
(token and size before the body is read, bounded JSON); batches, messages and texts are bounded.
:func:`reward_app` builds the app; :func:`app_from_env` builds it from the environment, which is how
``uvicorn --factory`` starts each of several workers.  Details: docs/export.md.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Summary,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from core.base import bounded_json
from core.base import embed as text_embedding
from core.base.errors import InputError
from core.rewards.markup import transcript_messages
from core.rewards.trajectory import MAX_MESSAGES, MAX_TOOLS, TrajectoryScore, TrajectoryScorer
from core.serve.http_guard import (PARSED_BODY, BearerToken, ErrorOut, GuardedRoute, ParsedRoute, Refused,
                                   RequestGuard, answer, missing_or_wrong_token)

#: Environment variables that carry the settings to every worker process.
ENV_TEMPLATE = "RWB_REWARD_TEMPLATE"
ENV_SHA256 = "RWB_REWARD_SHA256"
ENV_TOKEN = "RWB_REWARD_TOKEN"
ENV_MAX_BATCH = "RWB_REWARD_MAX_BATCH"
ENV_MAX_BODY = "RWB_REWARD_MAX_BODY_BYTES"
ENV_WORKSPACE = "RWB_WORKSPACE"
#: Trajectories (or queries) one request may carry.
MAX_BATCH = 256
#: The largest body read, in bytes: a longer declared ``Content-Length`` is refused (413) unread.
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Characters of one message's text, and of one decoded transcript (OpenRLHF's query).
MAX_TEXT_CHARS = 200_000
MAX_TRANSCRIPT_CHARS = 1_000_000
#: Tool calls in one assistant message; nesting of a body's lists and objects.
MAX_CALLS = 64
MAX_DEPTH = 64
#: Texts whose sentence embeddings are kept between requests (384 float32 each: ~1.5 kB).
EMBEDDING_CACHE_TEXTS = 200_000
#: Request time buckets (seconds): one trajectory to a batch of 256 with new texts.
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The trajectory scored at start-up: it loads the sentence model and runs every component once.
WARM_TRAJECTORY = {"messages": [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "Sunny, 21 degrees"},
    {"role": "assistant", "content": "It is sunny in Paris, 21 degrees."}]}


# =========================================================================== embeddings across requests
class EmbeddingLRU:
    """Sentence embeddings kept in memory across requests, at most ``max_texts`` of them (the
    least recently used go first), in front of ``source`` (default: the sentence model through a
    workspace's cache when ``ws`` is given, else the model alone; the source never stores).
    Same ``encode``/``warm_up``/``stats`` as :class:`core.base.embed.Embedder`; thread-safe."""

    dim = text_embedding.DIM

    def __init__(self, source: Any = None, *, ws: Any = None, max_texts: int = EMBEDDING_CACHE_TEXTS):
        if source is None:
            base = text_embedding.workspace_embedder(ws) if ws is not None else text_embedding.Embedder(cache_dir=None)
            source = base.reader()
        self.source, self.max_texts = source, int(max_texts)
        self._rows: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "encoded": 0}

    def __len__(self) -> int:
        return len(self._rows)

    def warm_up(self) -> None:
        """Load the source's model now (a source without one, such as the hash embedder, has nothing to load)."""
        warm_up = getattr(self.source, "warm_up", None)
        if warm_up is not None:
            warm_up()

    def encode(self, texts: Sequence[str | None]) -> np.ndarray:
        """Embeddings of ``texts`` (float32, one row each): cached rows, the rest from the source."""
        items = ["" if t is None else str(t) for t in texts]
        keys = [text_embedding.text_hash(t) for t in items]
        out = np.zeros((len(items), self.dim), dtype=np.float32)
        missing: dict[str, str] = {}
        with self._lock:
            for i, k in enumerate(keys):
                row = self._rows.get(k)
                if row is None:
                    missing.setdefault(k, items[i])
                else:
                    self._rows.move_to_end(k)
                    out[i] = row
        if missing:
            rows = np.asarray(self.source.encode(list(missing.values())), dtype=np.float32)
            new = {k: row.copy() for k, row in zip(missing, rows)}   # own rows: an evicted batch is freed
            with self._lock:
                self._rows.update(new)
                while len(self._rows) > self.max_texts:
                    self._rows.popitem(last=False)
            for i, k in enumerate(keys):
                if k in new:
                    out[i] = new[k]
        with self._lock:
            self.stats["hits"] += len(items) - len(missing)
            self.stats["encoded"] += len(missing)
        return out


# =========================================================================== the schema
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(max_length=256)
    arguments: dict[str, Any] | str | None = Field(None, description="A JSON object, or its JSON text")


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = Field(None, max_length=256)
    type: str = "function"
    function: FunctionIn


class MessageIn(BaseModel):
    """An OpenAI chat message (other keys pass through to the scorer)."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(max_length=32, description="system, user, assistant or tool")
    content: Text | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_CALLS)
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)


#: Chat messages: documented by :class:`MessageIn`, passed to the scorer as they came (it checks each
#: message and names the field, ``trajectories[i].messages[j].tool_calls[k].function.name``); the
#: service checks the bounds (:func:`_checked_messages`).  Validating them twice cost more than the
#: scoring itself on recorded runs (docs/benchmarks.md, bench_reward_service).
Messages = Annotated[list[MessageIn], SkipValidation, Field(
    description=f"At least 1, at most {MAX_MESSAGES:,} OpenAI chat messages; text at most {MAX_TEXT_CHARS:,} "
                f"characters, at most {MAX_CALLS} tool calls each")]


class TrajectoryIn(BaseModel):
    """One trajectory: chat messages, the tools the agent had (OpenAI tools schema), the task's
    criteria (``expected_calls``, ``communicate``, ``forbidden``, ``call_budget``; or a tau2
    task's ``evaluation_criteria``)."""

    model_config = ConfigDict(extra="forbid")
    messages: Messages
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    task: dict[str, Any] | None = None
    id: str | None = Field(None, max_length=256)
    outcome: dict[str, Any] | None = Field(None, description="resolved, final_reward, business_metric, sentiment")


class ScoreRequest(BaseModel):
    """A batch of trajectories, each scored on its own."""

    model_config = ConfigDict(extra="forbid")
    trajectories: list[TrajectoryIn] = Field(min_length=1, description=f"At most {MAX_BATCH} by default")
    step: int | None = Field(None, ge=0, description="The training step: the template's weight schedules apply")


class StepOut(BaseModel):
    t: int
    kind: str
    tool: str | None
    reward: float
    valid: bool
    invalid_reason: str | None


class TrajectoryScoreOut(BaseModel):
    """``TrajectoryScore.to_dict()``: ``score == Σ weights[c] · components[c] + constant``;
    a component is null where it does not apply (no task criteria)."""

    id: str | None
    score: float
    components: dict[str, float | None]
    weights: dict[str, float]
    constant: float
    levels: dict[str, float]
    steps: list[StepOut]
    template: str
    template_sha256: str


class ScoreOut(BaseModel):
    template: str = Field(description="name@version")
    sha256: str = Field(description="sha256 of the template's YAML text")
    scores: list[TrajectoryScoreOut]


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward call (``--reward.remote_url http://host:port/get_reward``)."""

    query: list[Annotated[str, Field(max_length=MAX_TRANSCRIPT_CHARS)]] = Field(
        min_length=1, description="Decoded prompt + response, with the model's chat template and tool-call markup")
    prompts: list[str] | None = Field(None, description="The prompts (read nowhere: the query holds them)")
    labels: list[Any] | None = Field(None, description="Per query: null, an object or its JSON text: the task's "
                                     "criteria, or {\"task\": {...}, \"tools\": [...], \"outcome\": {...}}")


class RewardOut(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = Field(description="Per component (those that apply to every query), "
                                               "and per level as level/<key>")


class ResponsesParams(BaseModel):
    """The Responses API request NeMo Gym made (``input`` items, ``tools``, ``instructions``)."""

    model_config = ConfigDict(extra="allow")
    input: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    instructions: Text | None = None


class ResponseIn(BaseModel):
    """The model's Responses API answer (``output`` items)."""

    model_config = ConfigDict(extra="allow")
    output: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)


class VerifyRequest(BaseModel):
    """NeMo Gym's verify request (``responses_create_params`` + ``response``; other keys of the
    dataset row come along and are echoed), or plain chat ``messages`` with ``tools``."""

    model_config = ConfigDict(extra="allow")
    responses_create_params: ResponsesParams | None = None
    response: ResponseIn | None = None
    messages: Messages | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    task: dict[str, Any] | None = Field(None, description="The task's criteria")


class VerifyOut(BaseModel):
    """The request echoed, with the reward (NeMo Gym's ``BaseMultiRewardVerifyResponse``); each
    component is also a top-level number (NeMo Gym aggregates top-level numbers)."""

    model_config = ConfigDict(extra="allow")
    reward: float
    reward_components: dict[str, float] = Field(description="The components that apply, before their weights")
    reward_template: str
    reward_template_sha256: str


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    template: str
    sha256: str
    checks: dict[str, bool]
    problems: list[str]


# =========================================================================== request → trajectories
def _text_of(content: Any) -> Any:
    """The text of Responses API content (a string, or parts with ``text`` / ``refusal``)."""
    if not isinstance(content, list):
        return content
    parts = [p.get("text", p.get("refusal")) for p in content if isinstance(p, Mapping)]
    return "".join(p for p in parts if isinstance(p, str))


def responses_messages(items: Sequence[Mapping[str, Any]], *, first_call: int = 0) -> list[dict[str, Any]]:
    """OpenAI chat messages of Responses API items: ``message`` items (or ``{"role", "content"}``),
    ``function_call`` items (joined to the assistant message before them, as one turn's calls) and
    ``function_call_output`` items (tool messages named after their call); reasoning and other
    items are not part of the conversation the reward reads."""
    msgs: list[dict[str, Any]] = []
    names: dict[str, Any] = {}
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            msgs.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call_id = str(item.get("call_id") or item.get("id") or f"call_{first_call + i}")
            names[call_id] = item.get("name")
            call = {"id": call_id, "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = str(item.get("call_id") or "")
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id),
                         "content": output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)})
    return msgs


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI chat tools of a Responses API tools list (``{"type": "function", "name", ...}``);
    chat-shaped entries pass as they are, tools that are not functions are left out."""
    if tools is None:
        return None
    out = []
    for t in tools:
        if "function" in t:
            out.append(dict(t))
        elif t.get("type", "function") == "function" and "name" in t:
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                          if k in t}})
    return out


def _label(value: Any, i: int) -> dict[str, Any]:
    """The trajectory keys an OpenRLHF label carries: None or "" (nothing), an object or its JSON
    text: ``{"task", "tools", "outcome"}`` when it has any of these keys, else the task's criteria."""
    where = f"labels[{i}]"
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        value = bounded_json.loads(value, max_bytes=MAX_TRANSCRIPT_CHARS * 4, max_depth=MAX_DEPTH, field=where)
    if not isinstance(value, Mapping):
        raise InputError(f"a label is an object (or its JSON text) with the task's criteria, not "
                         f"{type(value).__name__}", field=where)
    keys = {"task", "tools", "outcome"}
    if not keys & set(value):
        return {"task": dict(value)} if value else {}
    unknown = sorted(set(value) - keys)
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r}; a label has task, tools, outcome (or is the task's "
                         "criteria itself)", field=f"{where}.{unknown[0]}")
    return {k: value[k] for k in keys if value.get(k) is not None}


def _checked_messages(messages: Any, where: str) -> list[Any]:
    """``messages`` within the service's bounds (a list of 1 to :data:`MAX_MESSAGES` objects, texts
    and calls bounded), else a 422 naming the field."""
    def refuse(field: str, message: str) -> Refused:
        return Refused(422, "invalid_request", ErrorOut(message=f"{field}: {message}", field=field), log=False)

    if not isinstance(messages, list):
        raise refuse(where, f"chat messages are a list, not {type(messages).__name__}")
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise refuse(where, f"{len(messages):,} messages; give 1 to {MAX_MESSAGES:,}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise refuse(f"{where}[{j}]", f"a chat message is an object, not {type(m).__name__}")
        content, calls = m.get("content"), m.get("tool_calls")
        if isinstance(content, str) and len(content) > MAX_TEXT_CHARS:
            raise refuse(f"{where}[{j}].content", f"{len(content):,} characters; at most {MAX_TEXT_CHARS:,}")
        if isinstance(calls, list) and len(calls) > MAX_CALLS:
            raise refuse(f"{where}[{j}].tool_calls", f"{len(calls)} tool calls; at most {MAX_CALLS}")
    return messages


# =========================================================================== settings
@dataclass(frozen=True)
class RewardSettings:
    """What one reward service process serves and how."""

    #: The template: ``name``, ``name@N``, or a YAML file.
    template: str
    #: The sha256 the template must have (None: whatever it has now).
    sha256: str | None = None
    #: The workspace that resolves ``name@N`` (None: none; a shipped template or a file).
    workspace: str | None = None
    #: The bearer token of the reward endpoints (None: open).
    token: str | None = None
    max_batch: int = MAX_BATCH
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.template:
            raise InputError(f"no template to serve: give --template (or {ENV_TEMPLATE})", field="template")
        if self.max_batch < 1:
            raise InputError("max_batch must be at least 1", field="max_batch")
        if self.max_body_bytes < 1024:
            raise InputError("max_body_bytes must be at least 1024", field="max_body_bytes")
        if self.token is not None and not self.token.strip():
            raise InputError(f"{ENV_TOKEN} is set but empty; unset it to serve without a token", field=ENV_TOKEN)

    def to_env(self) -> dict[str, str]:
        """The environment variables :meth:`from_env` reads back (for worker processes)."""
        env = {ENV_TEMPLATE: self.template, ENV_MAX_BATCH: str(self.max_batch), ENV_MAX_BODY: str(self.max_body_bytes)}
        for name, value in ((ENV_SHA256, self.sha256), (ENV_WORKSPACE, self.workspace), (ENV_TOKEN, self.token)):
            if value is not None:
                env[name] = value
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RewardSettings":
        env = os.environ if env is None else env
        try:
            max_batch = int(env.get(ENV_MAX_BATCH) or MAX_BATCH)
            max_body = int(env.get(ENV_MAX_BODY) or MAX_BODY_BYTES)
        except ValueError as exc:
            raise InputError(f"unreadable service settings in the environment: {exc}", field=ENV_MAX_BATCH) from None
        return cls(template=env.get(ENV_TEMPLATE, ""), sha256=env.get(ENV_SHA256) or None,
                   workspace=env.get(ENV_WORKSPACE) or None, token=env.get(ENV_TOKEN), max_batch=max_batch,
                   max_body_bytes=max_body)


def open_scorer(settings: RewardSettings) -> TrajectoryScorer:
    """The scorer ``settings`` describe, its embeddings in an :class:`EmbeddingLRU` (through the
    workspace's cache when there is a workspace)."""
    ws = None
    if settings.workspace is not None:
        from core.records.store import Workspace  # deferred: loads pandas

        ws = Workspace.open(settings.workspace, create=False)
    try:
        return TrajectoryScorer(settings.template, ws=ws, sha256=settings.sha256, embedder=EmbeddingLRU(ws=ws))
    finally:
        if ws is not None:
            ws.close()


# =========================================================================== the service
class _CacheCollector:
    """``rwb_reward_embedding_cache_texts`` and the embedder's hit and embed counts, read when scraped."""

    def __init__(self, embedder: Any):
        self.embedder = embedder

    def collect(self) -> Any:
        stats = getattr(self.embedder, "stats", None) or {}
        if hasattr(self.embedder, "__len__"):
            size = GaugeMetricFamily("rwb_reward_embedding_cache_texts", "Texts whose embeddings are kept in memory.")
            size.add_metric([], float(len(self.embedder)))
            yield size
        for key, text in (("hits", "Texts answered from the embedding cache."),
                          ("encoded", "Texts sent to the sentence model (through the workspace's cache).")):
            if key in stats:
                fam = CounterMetricFamily(f"rwb_reward_embedding_{key}", text)
                fam.add_metric([], float(stats[key]))
                yield fam


class RewardService:
    """The scorer, its lock, the token, readiness and the service's metrics (a registry of its own)."""

    def __init__(self, scorer: TrajectoryScorer, *, token: str | None = None, max_batch: int = MAX_BATCH,
                 max_body_bytes: int = MAX_BODY_BYTES, refusals: Any = None, freeze_gc: bool = False):
        self.scorer, self.max_batch, self.max_body_bytes = scorer, int(max_batch), int(max_body_bytes)
        self.freeze_gc = freeze_gc
        self._token = BearerToken(token)
        self._lock = threading.Lock()
        self._warm = threading.Event()
        self.warm_error: str | None = None
        #: Where refused requests are logged (core.serve.serving.RefusalLog; None: nowhere).
        self.refusals = refusals
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rwb_reward_http_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("rwb_reward_http_errors", "HTTP requests refused or failed, by endpoint and reason "
                              "(invalid_request, unauthorized, too_large, bad_request, internal).",
                              ["endpoint", "reason"], registry=r)
        self.duration = Histogram("rwb_reward_http_request_duration_seconds", "Handler time of the reward endpoints "
                                  "(waiting for the scorer included).", ["endpoint"], buckets=HTTP_BUCKETS, registry=r)
        self.scored = Counter("rwb_reward_trajectories_scored", "Trajectories scored, by endpoint.", ["endpoint"],
                              registry=r)
        self.score_summary = Summary("rwb_reward_score", "Episode returns served (sum/count: the mean).", registry=r)
        self.component_summary = Summary("rwb_reward_component", "Component values served, before their weights "
                                         "(sum/count: the mean; only where the component applies).", ["component"],
                                         registry=r)
        info = Gauge("rwb_reward_template_info", "1 for the template served.", ["template", "sha256"], registry=r)
        info.labels(scorer.label, scorer.sha256).set(1)
        r.register(_CacheCollector(scorer.embedder))

    @property
    def token_required(self) -> bool:
        return self._token.required

    def authorized(self, given: str | None) -> bool:
        return self._token.authorized(given)

    @property
    def ready(self) -> bool:
        return self._warm.is_set()

    def warm(self) -> None:
        """Load the sentence model and run every component once (one tiny trajectory); readiness
        follows.  A failure is kept and shown by the readiness probe."""
        try:
            warm_up = getattr(self.scorer.embedder, "warm_up", None)
            with self._lock:
                if warm_up is not None:
                    warm_up()
                self.scorer.score_batch([WARM_TRAJECTORY])
            if self.freeze_gc:  # what is alive now (libraries, model, template) stays: out of full collections
                gc.collect()
                gc.freeze()
            self._warm.set()
        except Exception as exc:  # the probe shows it; the service keeps answering /healthz
            self.warm_error = f"{type(exc).__name__}: {exc}"

    def score(self, endpoint: str, trajectories: list[dict[str, Any]],
              step: int | None = None) -> list[TrajectoryScore]:
        """Score a batch (serialized with every other scoring of this process) and count it."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                scores = self.scorer.score_batch(trajectories, step=step)
        finally:
            self.duration.labels(endpoint).observe(time.perf_counter() - t0)
        self.scored.labels(endpoint).inc(len(scores))
        for s in scores:
            self.score_summary.observe(s.score)
            for name, value in s.components.items():
                if value is not None:
                    self.component_summary.labels(name).observe(value)
        return scores

    def readiness(self) -> Readiness:
        problems = []
        if self.warm_error is not None:
            problems.append(f"the warm-up failed: {self.warm_error}")
        elif not self.ready:
            problems.append("the sentence model is still loading")
        return Readiness(ready=self.ready, template=self.scorer.label, sha256=self.scorer.sha256,
                         checks={"scorer_warm": self.ready}, problems=problems)

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)


# =========================================================================== errors
def _where(loc: Sequence[Any]) -> str | None:
    """``trajectories[3].messages[2].content`` from a validation error's location (pydantic's
    union-member tags, such as ``str`` or ``list[dict[str,any]]``, are no fields)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and (p.isidentifier() or p.startswith("_")):
            out += f".{p}" if out else p
        else:
            break
    if len(out) > 120:
        out = out[:120] + "…"
    return out or None


def _invalid(exc: RequestValidationError) -> ErrorOut:
    """The 422 body of a request FastAPI refused: the first error's field and reason."""
    raw = list(exc.errors())
    first = raw[0] if raw else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    name = _where(loc)
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        name, msg = None, f"the body is not valid JSON ({msg})"
    detail = [{"loc": [p if isinstance(p, int) or len(str(p)) <= 64 else str(p)[:64] + "…" for p in e.get("loc", ())],
               "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))} for e in raw[:20]]
    return ErrorOut(message=f"{name}: {msg}" if name else msg, field=name, detail=detail)


def _too_large(declared: int | None, cap: int) -> ErrorOut:
    size = f"{declared:,} bytes" if declared is not None else f"more than {cap:,} bytes"
    return ErrorOut(message=f"the body is {size}: the service reads at most {cap:,}; split the batch")


def _unreadable(exc: InputError, depth: int) -> ErrorOut:
    if not exc.field:
        return ErrorOut(message=f"the body is not valid JSON: {exc.reason}")
    return ErrorOut(message=f"{exc.field}: nested deeper than {depth} levels", field=exc.field)


def _renamed(exc: InputError, *, trajectory: str, messages_from: str | None = None, tools: str | None = None,
             task: str | None = None) -> Refused:
    """The 422 of a scorer refusal, its field named in the request's own terms.  The scorer names
    ``trajectories[i].messages[...]``, ``.tools[...]``, ``.task``; in this request trajectory i is
    ``trajectory`` (``query[{i}]``; "" for the one trajectory of /verify), its messages were read from
    ``messages_from`` when they are not the request's own, its tools and task sit at ``tools``, ``task``."""
    field, reason = exc.field or "", exc.reason
    head, _, rest = field.partition("].")
    if field.startswith("trajectories[") and head[len("trajectories["):].isdigit():
        i = int(head[len("trajectories["):])
        base = trajectory.format(i=i)
        if rest.startswith("messages") and messages_from is not None:
            field, reason = messages_from.format(i=i), f"{reason} (at {rest} of the messages read from it)"
        elif rest.startswith("tools") and tools is not None:
            field = tools.format(i=i) + rest[len("tools"):]
        elif rest.startswith("task") and task is not None:
            field = task.format(i=i) + rest[len("task"):]
        else:
            field = f"{base}.{rest}" if base else rest
    return Refused(422, "invalid_request", ErrorOut(message=f"{field}: {reason}" if field else reason,
                                                    field=field or None), log=False)


# =========================================================================== the app
_ENDPOINTS = {"/get_reward": "get_reward", "/verify": "verify", "/v1/score": "score"}


def _guarded_routes(max_body_bytes: int) -> dict[str, GuardedRoute]:
    return {path: GuardedRoute(endpoint, max_body_bytes, MAX_DEPTH, _too_large, _unreadable)
            for path, endpoint in _ENDPOINTS.items()}


def reward_app(scorer: TrajectoryScorer, *, token: str | None = None, max_batch: int = MAX_BATCH,
               max_body_bytes: int = MAX_BODY_BYTES, refusals: Any = None, warm: bool = True,
               freeze_gc: bool = False) -> FastAPI:
    """The reward service's FastAPI app for ``scorer``: the bearer ``token`` (None: open), at most
    ``max_batch`` trajectories per request and ``max_body_bytes`` per body; ``refusals`` logs refused
    requests (a :class:`core.serve.serving.RefusalLog`).  The scorer is warmed in a thread when the
    app starts (``warm``): ``/readyz`` answers 200 once it is; ``freeze_gc`` (a serving process) then
    moves every object alive out of the cyclic collector's reach (``gc.freeze``, process-wide), so that
    a full collection during a request does not walk the libraries and the model."""
    service = RewardService(scorer, token=token, max_batch=max_batch, max_body_bytes=max_body_bytes,
                            refusals=refusals, freeze_gc=freeze_gc)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if warm:
            threading.Thread(target=service.warm, name="rwb-reward-warm-up", daemon=True).start()
        yield

    app = FastAPI(title="Reward Workbench reward service", version=_version(), lifespan=lifespan,
                  description=f"Rewards of the pinned template {scorer.label} (sha256 {scorer.sha256}) for "
                              "trajectories of chat messages: OpenRLHF's /get_reward, NeMo Gym's /verify and "
                              "the batch /v1/score. See docs/export.md.")
    app.state.service = service
    app.router.route_class = ParsedRoute  # the routes below read the body the guard parsed
    app.add_middleware(RequestGuard, service=service, routes=_guarded_routes(max_body_bytes))
    bearer = HTTPBearer(auto_error=False, description=f"The token in {ENV_TOKEN} (when the service has one).")

    def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials if credentials is not None else None
        if not service.authorized(given):  # the guard answers first; this documents the scheme
            raise Refused(401, "unauthorized", missing_or_wrong_token(given))

    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorOut, "description": "No or wrong bearer token (checked before the body is read)"},
        413: {"model": ErrorOut, "description": "The body is larger than the service reads (refused unread)"},
        422: {"model": ErrorOut, "description": "Invalid request (the field is named)"}}

    def endpoint_of(request: Request) -> str:
        return _ENDPOINTS.get(request.url.path, "other")

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(service, endpoint_of(request), 422, _invalid(exc), "invalid_request")

    @app.exception_handler(Refused)
    async def _on_refused(request: Request, exc: Refused) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return answer(service, endpoint_of(request), exc.status, exc.body, exc.reason, headers=headers)

    @app.exception_handler(Exception)
    async def _on_failure(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback; the caller gets no internals
        return answer(service, endpoint_of(request), 500, ErrorOut(message=f"internal error ({type(exc).__name__})"),
                      "internal")

    def check_batch(n: int, field: str) -> None:
        if n > service.max_batch:
            raise Refused(422, "invalid_request", ErrorOut(
                message=f"{field}: a request carries at most {service.max_batch} trajectories, got {n}; split it",
                field=field), log=False)

    def scored(endpoint: str, trajectories: list[dict[str, Any]], step: int | None = None, **names: Any
               ) -> list[TrajectoryScore]:
        try:
            return service.score(endpoint, trajectories, step)
        except InputError as exc:
            raise _renamed(exc, **names) from None

    @app.post("/v1/score", response_model=ScoreOut, responses=errors, dependencies=[Depends(authorize)],
              summary="Score a batch of trajectories")
    def score(batch: ScoreRequest) -> Response:
        """Each trajectory scored on its own: its return, each component before its weight, each
        level's share and every step (``rwb reward score --each`` gives the same)."""
        check_batch(len(batch.trajectories), "trajectories")
        items = [{"messages": _checked_messages(t.messages, f"trajectories[{i}].messages"),
                  **{k: getattr(t, k) for k in ("tools", "task", "id", "outcome") if k in t.model_fields_set}}
                 for i, t in enumerate(batch.trajectories)]
        out = scored("score", items, batch.step, trajectory="trajectories[{i}]")
        service.requests.labels("score", "200").inc()
        return JSONResponse({"template": scorer.label, "sha256": scorer.sha256, "scores": [s.to_dict() for s in out]})

    @app.post("/get_reward", response_model=RewardOut, responses=errors, dependencies=[Depends(authorize)],
              summary="OpenRLHF remote reward")
    def get_reward(body: RewardRequest) -> Response:
        """Each query (a decoded transcript in the model's chat template and tool-call markup)
        read into messages, its label into task criteria and tools, then scored on its own."""
        n = len(body.query)
        check_batch(n, "query")
        for name, values in (("prompts", body.prompts), ("labels", body.labels)):
            if values is not None and len(values) != n:
                raise Refused(422, "invalid_request", ErrorOut(
                    message=f"{name}: {len(values)} given for {n} queries", field=name), log=False)
        items = []
        for i, text in enumerate(body.query):
            try:
                messages = transcript_messages(text)
                label = _label(body.labels[i] if body.labels is not None else None, i)
            except InputError as exc:
                field = exc.field if exc.field and exc.field.startswith("labels") else f"query[{i}]"
                raise Refused(422, "invalid_request", ErrorOut(message=f"{field}: {exc.reason}", field=field),
                              log=False) from None
            items.append({"messages": messages, **label})
        out = scored("get_reward", items, trajectory="query[{i}]", messages_from="query[{i}]",
                     tools="labels[{i}].tools",
                     task="labels[{i}].task")
        every = [name for name in scorer.component_names if all(s.components.get(name) is not None for s in out)]
        logs: dict[str, list[float]] = {name: [float(s.components[name] or 0.0) for s in out] for name in every}
        for key in (out[0].levels if out else {}):
            logs[f"level/{key}"] = [s.levels[key] for s in out]
        rewards = [s.score for s in out]
        service.requests.labels("get_reward", "200").inc()
        return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": logs})

    @app.post("/verify", response_model=VerifyOut, responses=errors, dependencies=[Depends(authorize)],
              summary="NeMo Gym verify")
    def verify(body: VerifyRequest, request: Request) -> Response:
        """One trajectory: NeMo Gym's ``responses_create_params.input`` + ``response.output`` (Responses
        API items) or plain chat ``messages``; ``tools`` and ``task`` (criteria) optional.  The request
        comes back with ``reward``, ``reward_components`` and each component as a top-level number."""
        messages_from: str | None = None   # the request's own messages
        if body.messages is not None:
            messages, tools, tools_field = _checked_messages(body.messages, "messages"), body.tools, "tools"
        elif body.responses_create_params is not None and body.response is not None:
            params = body.responses_create_params
            items = [{"role": "user", "content": params.input}] if isinstance(params.input, str) else params.input
            head = [{"role": "system", "content": params.instructions}] if params.instructions else []
            messages = head + responses_messages([*items, *body.response.output])
            tools = chat_tools(params.tools) if params.tools is not None else chat_tools(body.tools)
            tools_field = "responses_create_params.tools"
            messages_from = "response"
            if not messages:
                raise Refused(422, "invalid_request", ErrorOut(
                    message="response.output: no message, function call or call output to score",
                    field="response.output"), log=False)
        else:
            raise Refused(422, "invalid_request", ErrorOut(
                message="give responses_create_params and response (NeMo Gym), or messages",
                field="responses_create_params" if body.response is not None else "response"
                if body.responses_create_params is not None else "messages"), log=False)
        trajectory: dict[str, Any] = {"messages": messages}
        if tools is not None:
            trajectory["tools"] = tools
        if body.task is not None:
            trajectory["task"] = body.task
        s = scored("verify", [trajectory], trajectory="", messages_from=messages_from, tools=tools_field,
                   task="task")[0]
        components = {k: v for k, v in s.components.items() if v is not None}
        echo = request.scope.get(PARSED_BODY)   # the body as it came (the guard parsed it)
        out: dict[str, Any] = dict(echo) if isinstance(echo, Mapping) else {}
        out.update(reward=s.score, reward_components=components, reward_template=s.template,
                   reward_template_sha256=s.template_sha256)
        for name, value in components.items():
            out.setdefault(name, value)
        service.requests.labels("verify", "200").inc()
        return JSONResponse(out)

    @app.get("/healthz", response_model=Health, summary="Liveness")
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, summary="Readiness")
    def readyz() -> JSONResponse:
        """Ready once the sentence model is loaded and the scorer ran once (503 before)."""
        r = service.readiness()
        status = 200 if r.ready else 503
        service.requests.labels("readyz", str(status)).inc()
        return JSONResponse(r.model_dump(), status_code=status)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        return Response(service.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def app_from_env() -> FastAPI:
    """The app of the settings in this process's environment (:meth:`RewardSettings.from_env`):
    what ``uvicorn --factory core.serve.reward_service:app_from_env`` runs in each worker."""
    settings = RewardSettings.from_env()
    return reward_app(open_scorer(settings), token=settings.token, max_batch=settings.max_batch,
                      max_body_bytes=settings.max_body_bytes, freeze_gc=True)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("reward-workbench")
    except metadata.PackageNotFoundError:
        return "0"


__all__ = ["EmbeddingLRU", "MAX_BATCH", "MAX_BODY_BYTES", "RewardService", "RewardSettings", "app_from_env",
           "chat_tools", "open_scorer", "responses_messages", "reward_app"]
