"""The HTTP decision service: the decision engine (:mod:`core.serve.serving`) behind FastAPI, for
callers that are not Python (``rwb serve http``; the ``[http]`` extra).

One engine per process serves every request; the endpoints (``/v1/decide``,
``/v1/decide/batch``, ``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``) only translate,
and a decision is ``DecisionEngine.decide_batch`` itself, audited exactly as in-process.
:func:`create_app` builds the app; with no arguments it reads its settings from the
environment (:class:`ServiceSettings`), which is how ``uvicorn --factory`` starts each of
several workers.

Details: docs/http_service.md (## Endpoints, ## Readiness, ## Token, ## Promotion, rollback:
the hot switch, ## Configuration, ## Workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from core.access.audit import AuditUnavailable
from core.base.errors import InputError, RwbError
from core.serve.http_guard import (BearerToken, ErrorOut, GuardedRoute, ParsedRoute, Refused, RequestGuard,
                                   answer, client_of, declared_size, log_refusal, missing_or_wrong_token)
from core.serve.serving import (MAX_NESTING, REQUEST_NESTING, DecisionEngine, DecisionRequest, LastResult,
                                REFUSAL_TEXT_CHARS, RefusalLog, ServingConfig, _is_bundle_path, error_field, load,
                                load_promoted)
from core.access.keys import trust_store
from core.govern.bundle import load_bundle

#: Environment variables that carry the settings to every worker process.
ENV_POLICY = "RWB_SERVE_POLICY"
ENV_TOKEN = "RWB_SERVE_TOKEN"
ENV_CONFIG = "RWB_SERVE_CONFIG"
ENV_MAX_BATCH = "RWB_SERVE_MAX_BATCH"
ENV_WORKSPACE = "RWB_WORKSPACE"
ENV_POLICIES = "RWB_POLICIES_DIR"
#: Requests one batch call may carry (a bound on the work one HTTP request can ask for).
MAX_BATCH = 256
#: The largest body the decide endpoints read (one request / a batch), in bytes: a longer
#: declared ``Content-Length`` is refused (413) before a byte is read, a body without one is
#: cut when it passes the cap.  One request within the field limits (docs/serving.md,
#: ## Request limits) is under 3.7 MB as compact UTF-8 JSON.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_BATCH_BODY_BYTES = 32 * 1024 * 1024
#: Seconds the readiness probe waits for the database's write lock, and (until it is
#: done once) for the sentence model's warm-up.
AUDIT_PROBE_TIMEOUT_S = 1.0
WARM_PROBE_TIMEOUT_S = 0.25
#: HTTP handler time buckets (seconds): decide()'s own plus the service's share.
HTTP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 1.0, 5.0)


def service_config(**overrides: Any) -> ServingConfig:
    """The engine settings of a long-running service: RL-Boosts on a query not embedded yet
    are deferred (the baseline answers at once), the sentence model runs in a child
    process, one intra-op thread and a 0.5 ms switch interval (see ServingConfig)."""
    base: dict[str, Any] = {"wait_for_intent": False, "model_process": True, "torch_threads": 1,
                            "switch_interval_ms": 0.5}
    return ServingConfig(**{**base, **overrides})


# =========================================================================== settings
@dataclass(frozen=True)
class ServiceSettings:
    """What one service process serves and how."""

    #: A promoted policy name (the policies folder) or a bundle ``.zip`` / promoted folder.
    policy: str
    #: The workspace that keeps the audit trail and the review queue (None: $RWB_WORKSPACE
    #: or ./workspace).
    workspace: str | None = None
    #: The policies folder (None: $RWB_POLICIES_DIR or core/policies).
    policies_root: str | None = None
    #: The bearer token of the decide endpoints (None: open).
    token: str | None = None
    #: Requests one batch call may carry.
    max_batch: int = MAX_BATCH
    #: The engine's settings.
    config: ServingConfig = field(default_factory=service_config)

    def __post_init__(self) -> None:
        if not self.policy:
            raise InputError(f"no policy to serve: give --policy (or {ENV_POLICY})", field="policy")
        if self.max_batch < 1:
            raise InputError("max_batch must be at least 1", field="max_batch")
        if self.token is not None and not self.token.strip():
            raise InputError(f"{ENV_TOKEN} is set but empty; unset it to serve without a token",
                             field=ENV_TOKEN)

    def to_env(self) -> dict[str, str]:
        """The environment variables :meth:`from_env` reads back (for worker processes)."""
        env = {ENV_POLICY: self.policy, ENV_MAX_BATCH: str(self.max_batch),
               ENV_CONFIG: json.dumps(dataclasses.asdict(self.config))}
        for name, value in ((ENV_WORKSPACE, self.workspace), (ENV_POLICIES, self.policies_root),
                            (ENV_TOKEN, self.token)):
            if value is not None:
                env[name] = str(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ServiceSettings":
        """The settings in ``env`` (default: this process's environment)."""
        env = os.environ if env is None else env
        try:
            options = json.loads(env.get(ENV_CONFIG) or "{}")
            max_batch = int(env.get(ENV_MAX_BATCH) or MAX_BATCH)
        except ValueError as exc:
            raise InputError(f"unreadable service settings in the environment: {exc}",
                             field=ENV_CONFIG) from None
        if not isinstance(options, dict) or not set(options) <= {f.name for f in dataclasses.fields(ServingConfig)}:
            raise InputError(f"{ENV_CONFIG} must be a JSON object of ServingConfig fields", field=ENV_CONFIG)
        if "review_risks" in options:
            options["review_risks"] = tuple(options["review_risks"])
        return cls(policy=env.get(ENV_POLICY, ""), workspace=env.get(ENV_WORKSPACE) or None,
                   policies_root=env.get(ENV_POLICIES) or None, token=env.get(ENV_TOKEN),
                   max_batch=max_batch, config=ServingConfig(**options))


def open_engine(settings: ServiceSettings, *, embedder: Any = None) -> DecisionEngine:
    """The engine ``settings`` describe (its policy verified and loaded)."""
    from core.records.store import Workspace  # deferred: loads pandas

    ws = Workspace.open(settings.workspace)
    options: dict[str, Any] = {"config": settings.config}
    if embedder is not None:
        options["embedder"] = embedder
    try:
        return load(settings.policy, ws=ws, root=settings.policies_root, **options)
    except BaseException:
        ws.close()
        raise


# =========================================================================== the schema
class BatchRequest(BaseModel):
    """Several decisions at once: at most one request per episode."""

    model_config = ConfigDict(extra="forbid")
    requests: list[DecisionRequest] = Field(min_length=1)


class CandidateOut(BaseModel):
    """One RL-Boost proposal."""

    id: int
    name: str
    label: str
    prob: float
    reward_est: float


class RewardComponentOut(BaseModel):
    name: str
    value: float


class DecisionOut(BaseModel):
    """What the engine served for one request, and why (``Decision.to_dict()``)."""

    decision_id: str
    episode_id: str
    step_t: int
    policy_version: str
    final_action: int
    final_name: str
    final_label: str
    kind: str
    tool: str | None
    risk: str
    source: str = Field(description='"rde" (the baseline), "policy" (adopted) or "fallback"')
    confidence: float
    rde_action: int | None
    rde_confidence: float
    rl_boost: bool
    rl_boost_reasons: list[str]
    rl_candidates: list[CandidateOut]
    rde_reward_est: float | None
    adopted: bool
    overridden: bool
    timed_out: bool
    intent_pending: bool
    ood: bool
    ood_notes: list[str]
    review_item: int | None
    reward_components: list[RewardComponentOut]
    explanation: str
    latency_ms: float


class BatchOut(BaseModel):
    decisions: list[DecisionOut]


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    """The readiness probe's answer."""

    ready: bool
    #: The version new episodes start on (``name@version``).
    policy_version: str
    checks: dict[str, bool]
    problems: list[str]
    #: Why the last promoted version could not be loaded (the previous one still serves).
    reload_error: str | None = None


# =========================================================================== the service
class _ShareCollector:
    """``rwb_rl_boost_share{policy_version}`` and ``rwb_policy_active{policy_version}``,
    computed when scraped."""

    def __init__(self, service: "DecisionService"):
        self.service = service

    def collect(self) -> Any:
        share = GaugeMetricFamily("rwb_rl_boost_share", "Share of the decisions served since the start on "
                                  "which RL-Boost ran, by policy version.", labels=["policy_version"])
        for version, (n, boosted) in self.service.boost_counts().items():
            share.add_metric([version], boosted / n if n else 0.0)
        active = GaugeMetricFamily("rwb_policy_active", "1 for the policy version new episodes start on.",
                                   labels=["policy_version"])
        active.add_metric([self.service.engine.policy_version], 1.0)
        yield share
        yield active


class DecisionService:
    """The engine, the token and the service's own metrics (registered in the engine's
    registry, so that one scrape has both)."""

    def __init__(self, engine: DecisionEngine, settings: ServiceSettings):
        self.engine = engine
        self.settings = settings
        self._token = BearerToken(settings.token)
        self._warm = False
        self._counts_lock = threading.Lock()
        self._boost: dict[str, list[int]] = {}
        r = engine.metrics.registry
        self.requests = Counter("rwb_http_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        #: Refused requests in the security log (the engine's log: one rate limit for both).
        self.refusals: RefusalLog = engine.refusals
        self.errors = Counter("rwb_http_errors", "HTTP requests refused or failed, by endpoint and reason "
                              "(invalid_request, unauthorized, too_large, bad_request, audit_unavailable, "
                              "unavailable, internal).",
                              ["endpoint", "reason"], registry=r)
        self.duration = Histogram("rwb_http_request_duration_seconds", "Handler time of the decide endpoints "
                                  "(waiting for the engine and decide() included; parsing excluded).",
                                  ["endpoint"], buckets=HTTP_BUCKETS, registry=r)
        r.register(_ShareCollector(self))

    @property
    def token_required(self) -> bool:
        return self._token.required

    def authorized(self, given: str | None) -> bool:
        """Whether ``given`` is the token (always, when none is set); constant-time."""
        return self._token.authorized(given)

    def decide(self, requests: list[DecisionRequest]) -> list[dict[str, Any]]:
        """Decisions as JSON-ready dicts (the engine validates episodes and audits)."""
        decisions = self.engine.decide_batch(requests)
        with self._counts_lock:
            for d in decisions:
                n = self._boost.setdefault(d.policy_version, [0, 0])
                n[0] += 1
                n[1] += d.rl_boost
        return [d.to_dict() for d in decisions]

    def boost_counts(self) -> dict[str, tuple[int, int]]:
        """``{policy_version: (decisions, decisions with RL-Boost)}`` since the start."""
        with self._counts_lock:
            return {v: (n, b) for v, (n, b) in self._boost.items()}

    def readiness(self) -> Readiness:
        """Policy loaded, the sentence model warmed up (waited for briefly, once), and the
        workspace database takes a write lock within :data:`AUDIT_PROBE_TIMEOUT_S`."""
        engine = self.engine
        problems: list[str] = []
        loaded = True
        try:
            if not self._warm:
                self._warm = engine.ready(timeout=WARM_PROBE_TIMEOUT_S)
        except RwbError as exc:  # closed
            loaded = False
            problems.append(str(exc))
        if loaded and not self._warm:
            problems.append("the sentence model is still loading")
        writable = _audit_writable(engine.ws.db_path, problems)
        if engine.audit.pending >= engine.audit.max_pending:
            writable = False
            problems.append(f"{engine.audit.pending} audit records wait for a commit (the backlog is full)")
        checks = {"policy_loaded": loaded, "embedder_warm": self._warm, "audit_writable": writable}
        return Readiness(ready=all(checks.values()), policy_version=engine.policy_version, checks=checks,
                         problems=problems, reload_error=engine.reload_error)

    def close(self) -> None:
        """Log the refusals the rate limit held back, commit the remaining audit records,
        stop the engine and close its workspace."""
        try:
            self.refusals.close()
            self.engine.close()
        finally:
            self.engine.ws.close()


def _audit_writable(db_path: Path, problems: list[str]) -> bool:
    """Whether the audit trail's database takes a write lock now (taken and released at once,
    on a connection of its own: nothing is written)."""
    try:
        conn = sqlite3.connect(db_path, timeout=AUDIT_PROBE_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as exc:
        problems.append(f"the audit trail is not writable: {exc}")
        return False
    return True


# =========================================================================== errors
def _field_of(loc: Sequence[Any], body: Any, missing: bool) -> tuple[str | None, int | None]:
    """The request field (dotted) and batch index of a validation error's location.  The
    path is followed into the body as far as it goes: pydantic's trailing union-member
    tags (``state.hour.str``) are not fields; a missing field is named."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    record = None
    requests = body.get("requests") if isinstance(body, Mapping) else None
    if (len(parts) >= 2 and parts[0] == "requests" and isinstance(parts[1], int) and isinstance(requests, list)
            and 0 <= parts[1] < len(requests)):
        record, parts, body = parts[1], parts[2:], requests[parts[1]]
    return error_field(parts, body, missing), record


_BODY_PATH = re.compile(r"(?:requests\[(\d+)\]\.)?([^.\[…]+)(?:\.([^.\[…]+))?")


def _deep_field(path: str | None) -> tuple[str | None, int | None]:
    """The request field and batch index of a nesting refusal of the body, from the JSON
    path :func:`core.base.bounded_json.loads` names (``requests[2].messages[0].a…``):
    the request's own field (``messages``, ``last_result.result``, ``state.hour``)."""
    m = None if path is None or path == "(top)" else _BODY_PATH.match(path)
    if m is None:
        return None, None
    top, sub = m.group(2), m.group(3)
    name = f"{top}.{sub}" if sub and top in ("last_result", "state") else top
    return (name if len(name) <= 64 else name[:64] + "…"), (int(m.group(1)) if m.group(1) else None)


def _invalid(exc: RequestValidationError) -> tuple[ErrorOut, str | None]:
    """The 422 body of a request FastAPI refused (the first error leads, as parse_request's)."""
    raw = list(exc.errors())
    errors: list[dict[str, Any]] = [  # a long key in a location is cut: an error never echoes a payload
        {"loc": [p if isinstance(p, int) or len(str(p)) <= 64 else str(p)[:64] + "…" for p in e.get("loc", ())],
         "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in raw]
    first: dict[str, Any] = errors[0] if errors else {"loc": [], "msg": "invalid request", "type": ""}
    name, record = _field_of(raw[0].get("loc", ()) if raw else (), getattr(exc, "body", None),
                             first["type"] == "missing")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        name, msg = None, f"the body is not valid JSON ({msg})"
    elif first["type"] == "extra_forbidden":
        msg = (f"unknown field; a request has {', '.join(DecisionRequest.model_fields)} "
               f"(last_result: {', '.join(LastResult.model_fields)})")
    where = "" if record is None else f"request {record}: "
    text = f"{where}invalid decision request: {name}: {msg}" if name else f"{where}{msg}"
    return ErrorOut(message=text, field=name, record=record, detail=errors), name


# =========================================================================== the guard in front
def _too_large(declared: int | None, cap: int, endpoint: str) -> ErrorOut:
    what = "a batch" if endpoint == "batch" else "one request"
    size = f"{declared:,} bytes" if declared is not None else f"more than {cap:,} bytes"
    hint = "; split the batch" if endpoint == "batch" else " (docs/serving.md, ## Request limits)"
    return ErrorOut(message=f"the body is {size}: the service reads at most {cap:,} for {what}{hint}")


def _unreadable(exc: InputError, depth: int) -> ErrorOut:
    """The 422 body of a decide body :func:`core.base.bounded_json.loads` refused: a nesting
    refusal names the request's field (its JSON path); any other is the body's syntax or encoding."""
    name, record = _deep_field(exc.field)
    where = "" if record is None else f"request {record}: "
    text = (f"the body is not valid JSON: {exc.reason}" if not exc.field
            else f"{where}invalid decision request: {name}: nested deeper than {MAX_NESTING} levels"
            if name else f"the body is nested deeper than {depth} levels")
    return ErrorOut(message=text, field=name, record=record)


def _guarded_routes() -> dict[str, GuardedRoute]:
    """The decide endpoints the guard reads: one request, or a batch (``{"requests": [...]}``)."""
    return {"/v1/decide": GuardedRoute("decide", MAX_BODY_BYTES, REQUEST_NESTING,
                                       lambda declared, cap: _too_large(declared, cap, "decide"), _unreadable),
            "/v1/decide/batch": GuardedRoute("batch", MAX_BATCH_BODY_BYTES, REQUEST_NESTING + 2,
                                             lambda declared, cap: _too_large(declared, cap, "batch"), _unreadable)}


# =========================================================================== the app
def create_app(policy: str | None = None, *, workspace: str | Path | None = None,
               root: str | Path | None = None, token: str | None = None, config: ServingConfig | None = None,
               max_batch: int = MAX_BATCH, engine: DecisionEngine | None = None, embedder: Any = None) -> FastAPI:
    """The service's FastAPI app for ``policy`` (a promoted name or a bundle path), the
    ``workspace``, the policies ``root``, the bearer ``token`` and the engine ``config``
    (default :func:`service_config`).  With no ``policy`` every setting comes from the
    environment (:meth:`ServiceSettings.from_env`): what ``uvicorn --factory
    core.serve.serve_http:create_app`` runs in each worker.  See :func:`build_app` for ``engine``
    and ``embedder``."""
    if policy is None:
        settings = ServiceSettings.from_env()
    else:
        settings = ServiceSettings(policy=str(policy), workspace=None if workspace is None else str(workspace),
                                   policies_root=None if root is None else str(root), token=token,
                                   max_batch=max_batch, config=config or service_config())
    return build_app(settings, engine=engine, embedder=embedder)


def build_app(settings: ServiceSettings, *, engine: DecisionEngine | None = None, embedder: Any = None) -> FastAPI:
    """The app serving ``settings``: on ``engine`` when given (it must serve
    ``settings.policy``), else on a new one (``embedder`` replacing the sentence model when
    given).  The engine is closed, and its audit records committed, when the app shuts down."""
    service = DecisionService(engine or open_engine(settings, embedder=embedder), settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="Reward Workbench decision service", version=_version(), lifespan=lifespan,
                  description="Decisions of a promoted policy (rules + decision tree, RL-Boost when unsure), "
                              "one audit record each. See docs/http_service.md.")
    app.state.service = service
    app.router.route_class = ParsedRoute  # the routes below read the body the guard parsed
    app.add_middleware(RequestGuard, service=service, routes=_guarded_routes())
    bearer = HTTPBearer(auto_error=False, description=f"The token in {ENV_TOKEN} (when the service has one).")

    def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials if credentials is not None else None
        if not service.authorized(given):
            raise Refused(401, "unauthorized", missing_or_wrong_token(given))

    error_responses: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorOut, "description": "No or wrong bearer token (checked before the body is read)"},
        413: {"model": ErrorOut, "description": "The body is larger than the service reads (refused unread)"},
        422: {"model": ErrorOut, "description": "Invalid request (the field is named)"},
        503: {"model": ErrorOut, "description": "The decision could not be audited, so it was not served"}}

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body, _ = _invalid(exc)
        endpoint = _endpoint(request)
        await log_refusal(service, "invalid_request", endpoint=endpoint, client=client_of(request), status=422,
                           field=body.field, record=body.record, size=declared_size(request),
                           error=body.message[:REFUSAL_TEXT_CHARS])
        return answer(service, endpoint, 422, body, "invalid_request")

    @app.exception_handler(Refused)
    async def _on_refused(request: Request, exc: Refused) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        endpoint = _endpoint(request)
        if exc.log:
            await log_refusal(service, exc.reason, endpoint=endpoint, client=client_of(request), status=exc.status,
                               field=exc.body.field, record=exc.body.record, size=declared_size(request),
                               error=exc.body.message[:REFUSAL_TEXT_CHARS])
        return answer(service, endpoint, exc.status, exc.body, exc.reason, headers=headers)

    @app.exception_handler(Exception)
    async def _on_failure(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback; the caller gets no internals
        return answer(service, _endpoint(request), 500, ErrorOut(message=f"internal error ({type(exc).__name__})"),
                       "internal")

    def decided(endpoint: str, requests: list[DecisionRequest]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            return service.decide(requests)
        except InputError as exc:  # the engine logged the refusal
            raise Refused(422, "invalid_request", ErrorOut(message=str(exc), field=exc.field,
                                                            record=exc.record), log=False) from None
        except RwbError as exc:  # the audit trail refused the record, or the engine is closed: nothing served
            reason = "audit_unavailable" if isinstance(exc, AuditUnavailable) else "unavailable"
            raise Refused(503, reason, ErrorOut(message=str(exc)), log=False) from None
        finally:
            service.duration.labels(endpoint).observe(time.perf_counter() - t0)

    @app.post("/v1/decide", response_model=DecisionOut, responses=error_responses,
              dependencies=[Depends(authorize)], summary="Decide one request")
    def decide(request: DecisionRequest) -> Response:
        """One decision (the request and the answer of ``rwb serve decide --json``); its audit
        record is written before it is returned."""
        out = decided("decide", [request])[0]
        service.requests.labels("decide", "200").inc()
        return JSONResponse(out)

    @app.post("/v1/decide/batch", response_model=BatchOut, responses=error_responses,
              dependencies=[Depends(authorize)], summary="Decide several requests at once")
    def decide_batch(batch: BatchRequest) -> Response:
        """Decisions for requests of different episodes (masks, tree and policy run once over
        the batch); all are validated before any is decided."""
        if len(batch.requests) > service.settings.max_batch:
            raise Refused(422, "invalid_request", ErrorOut(
                message=f"a batch carries at most {service.settings.max_batch} requests, got "
                        f"{len(batch.requests)}; split it", field="requests"))
        out = decided("batch", batch.requests)
        service.requests.labels("batch", "200").inc()
        return JSONResponse({"decisions": out})

    @app.get("/healthz", response_model=Health, summary="Liveness")
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, summary="Readiness")
    def readyz() -> JSONResponse:
        """Ready to serve: the policy is loaded, the sentence model warm and the audit
        trail writable (503 with the problems otherwise)."""
        r = service.readiness()
        status = 200 if r.ready else 503
        service.requests.labels("readyz", str(status)).inc()
        return JSONResponse(r.model_dump(), status_code=status)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        return Response(service.engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


_ENDPOINTS = {"/v1/decide": "decide", "/v1/decide/batch": "batch"}


def _endpoint(request: Request) -> str:
    return _ENDPOINTS.get(request.url.path, "other")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("reward-workbench")
    except metadata.PackageNotFoundError:
        return "0"


def check_policy(settings: ServiceSettings) -> str:
    """Verify that ``settings.policy`` can be served (signature, registry digest) and return
    its ``name@version``, without starting an engine: what ``rwb serve http --workers N``
    checks once before the workers start."""
    from core.records.store import Workspace  # deferred: loads pandas

    ws = Workspace.open(settings.workspace)
    try:
        if _is_bundle_path(settings.policy):
            if not Path(settings.policy).exists():
                raise InputError(f"no bundle at {settings.policy}", file=settings.policy)
            return load_bundle(settings.policy, trust=trust_store(ws)).policy_version
        return load_promoted(ws, settings.policy, root=settings.policies_root).policy_version
    finally:
        ws.close()


__all__ = ["BatchOut", "BatchRequest", "DecisionOut", "DecisionService", "ErrorOut", "MAX_BATCH", "Readiness",
           "ServiceSettings", "build_app", "check_policy", "create_app", "open_engine", "service_config"]
