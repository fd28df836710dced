"""What the HTTP services share: a pure-ASGI guard in front of FastAPI that checks the bearer
token and the body's size from the headers before a byte of the body is read, cuts a body
without a length at the cap, parses it within bounds (:mod:`core.base.bounded_json`) and hands
it on parsed; the error body; the constant-time token compare.

The decision service (:mod:`core.serve.serve_http`, ``rwb serve http``) and the reward service
(:mod:`core.serve.reward_service`, ``rwb reward serve``) each name the routes the guard reads
(:class:`GuardedRoute`: the metrics label, the byte and nesting caps, the wording of a refusal).
Details: docs/http_service.md (## Token) and docs/export.md.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.base import bounded_json
from core.base.errors import InputError

#: Where the guard hands the parsed body (and its route's caps) on, in the request's ASGI scope.
PARSED_BODY = "rwb.parsed_body"
_ROUTE = "rwb.guarded_route"
#: A body read by a guarded route's handler without the guard in front (none in the services).
FALLBACK_MAX_BYTES = 32 * 1024 * 1024
FALLBACK_MAX_DEPTH = 64


class ErrorOut(BaseModel):
    """A refused request: what was wrong and where."""

    message: str
    field: str | None = None
    record: int | None = None
    detail: list[dict[str, Any]] = Field(default_factory=list)


class BearerToken:
    """The bearer token a service may require (None: open); compared in constant time."""

    def __init__(self, token: str | None):
        self._token = token.encode("utf-8") if token else None

    @property
    def required(self) -> bool:
        return self._token is not None

    def authorized(self, given: str | None) -> bool:
        """Whether ``given`` is the token (always, when none is set)."""
        if self._token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode("utf-8"), self._token)


def bearer_credentials(value: str | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header (as HTTPBearer reads it)."""
    scheme, _, credentials = (value or "").partition(" ")
    return (credentials.strip() or None) if scheme.lower() == "bearer" else None


def missing_or_wrong_token(given: str | None) -> ErrorOut:
    """The 401 body."""
    return ErrorOut(message="a bearer token is needed: Authorization: Bearer <the service's token>"
                    if given is None else "the bearer token is not the service's")


class RefusalSink(Protocol):
    """Where refused requests are logged (:class:`core.serve.serving.RefusalLog`)."""

    def admit(self, source: str, reason: str) -> int | None: ...

    def write(self, source: str, reason: str, suppressed: int, **detail: Any) -> None: ...


class GuardedService(Protocol):
    """What the guard needs of a service: its token check, its request and error counters
    (labels ``endpoint, status`` and ``endpoint, reason``) and where refusals are logged
    (None: not logged)."""

    @property
    def requests(self) -> Any: ...

    @property
    def errors(self) -> Any: ...

    @property
    def refusals(self) -> RefusalSink | None: ...

    def authorized(self, given: str | None) -> bool: ...


@dataclass(frozen=True)
class GuardedRoute:
    """A POST route whose body the guard reads."""

    #: The route's label in the metrics and the security log.
    endpoint: str
    #: The largest body read (a larger declared length: 413 unread; a body without one is cut).
    max_bytes: int
    #: The deepest nesting of lists and objects parsed (deeper: 422).
    max_depth: int
    #: The 413 body, from the declared length (None: no length, cut while read) and the cap.
    too_large: Callable[[int | None, int], ErrorOut]
    #: The 422 body of a body that is not JSON or nests too deep (``bounded_json``'s refusal, the
    #: depth cap).
    unreadable: Callable[[InputError, int], ErrorOut]


class RequestGuard:
    """A pure ASGI middleware in front of FastAPI, on the ``routes`` it is given (path → route).

    From the headers alone, before a byte of the body is read: the bearer token (401), then
    the declared ``Content-Length`` against the route's cap (413).  A body without a length is
    counted while it is received and cut when it passes the cap (413).  The body read is parsed
    with :func:`core.base.bounded_json.loads` (size, then nesting measured before the parser
    recurses: 422 from the route's ``unreadable``) and handed on parsed, for FastAPI to validate
    with the pydantic models (:class:`ParsedRoute`).  A refusal before the body was read closes
    the connection, so that the rest of it is never received; each refusal is counted in the
    service's metrics and written to its security log."""

    def __init__(self, app: ASGIApp, service: GuardedService, routes: Mapping[str, GuardedRoute]) -> None:
        self.app, self.service, self.routes = app, service, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client")
        refusal = Refusal(self.service, send, route.endpoint, client[0] if client else None)
        given = bearer_credentials(headers.get("authorization"))
        if not self.service.authorized(given):
            await refusal(401, "unauthorized", missing_or_wrong_token(given),
                          token="missing" if given is None else "wrong")
            return
        if scope["method"] != "POST":  # the router answers 405, reading nothing
            await self.app(scope, receive, send)
            return
        cap, depth = route.max_bytes, route.max_depth
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await refusal(400, "bad_request", ErrorOut(message=f"Content-Length {declared[:40]!r} is not a size"))
                return
            if int(declared) > cap:
                await refusal(413, "too_large", route.too_large(int(declared), cap), size=int(declared))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await refusal(413, "too_large", route.too_large(None, cap), size=size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        scope = {**scope, _ROUTE: route}
        if body:
            try:
                parsed = bounded_json.loads(body, max_bytes=cap, max_depth=depth)
            except InputError as exc:
                # (its size was capped while reading) a nesting refusal names the JSON path as
                # its field; any other is the body's syntax or encoding
                out = route.unreadable(exc, depth)
                await refusal(422, "invalid_request", out, read=True, field=out.field, record=out.record,
                              size=size, error=out.message)
                return
            scope[PARSED_BODY] = parsed
        await self.app(scope, replay(body, receive), send)


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app behind the guard: the body read, then the connection's own
    messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class Refusal:
    """Answers a request the guard refuses: counted, logged (rate-limited), then the error
    body sent; the connection closed unless the body was read."""

    def __init__(self, service: GuardedService, send: Send, endpoint: str, client: str | None):
        self.service, self.send, self.endpoint, self.client = service, send, endpoint, client

    async def __call__(self, status: int, reason: str, body: ErrorOut, *, read: bool = False, **detail: Any) -> None:
        count_refusal(self.service, self.endpoint, status, reason)
        await log_refusal(self.service, reason, endpoint=self.endpoint, client=self.client, status=status, **detail)
        payload = json.dumps(body.model_dump(), ensure_ascii=False).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if not read:
            headers.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": payload})


async def log_refusal(service: GuardedService, reason: str, **detail: Any) -> None:
    """A ``request_refused`` security event (source ``http``) when the service keeps a log and
    its rate limit admits it, written off the event loop (it syncs the log to disk)."""
    if service.refusals is None:
        return
    suppressed = service.refusals.admit("http", reason)
    if suppressed is not None:
        await run_in_threadpool(service.refusals.write, "http", reason, suppressed, **detail)


def count_refusal(service: GuardedService, endpoint: str, status: int, reason: str) -> None:
    service.requests.labels(endpoint, str(status)).inc()
    service.errors.labels(endpoint, reason).inc()


def answer(service: GuardedService, endpoint: str, status: int, body: ErrorOut, reason: str, *,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer from a handler, counted."""
    count_refusal(service, endpoint, status, reason)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class Refused(Exception):
    """A request a service answers with an error status (the exception handler writes the
    body, and a security event when ``log``: a refusal logged elsewhere already is not)."""

    def __init__(self, status: int, reason: str, body: ErrorOut, *, log: bool = True):
        super().__init__(body.message)
        self.status, self.reason, self.body, self.log = status, reason, body, log


class ParsedRequest(Request):
    """A request whose body the guard parsed already: FastAPI reads the parsed value instead
    of running its own (unbounded) JSON parser."""

    async def json(self) -> Any:
        if PARSED_BODY not in self.scope:  # the guard parses every non-empty body of its routes
            route = self.scope.get(_ROUTE)
            self.scope[PARSED_BODY] = bounded_json.loads(
                await self.body(), max_bytes=route.max_bytes if route else FALLBACK_MAX_BYTES,
                max_depth=route.max_depth if route else FALLBACK_MAX_DEPTH)
        return self.scope[PARSED_BODY]


class ParsedRoute(APIRoute):
    """The route class of a guarded app: its handlers get a :class:`ParsedRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed(request: Request) -> Response:
            return await handler(ParsedRequest(request.scope, request.receive))

        return parsed


def client_of(request: Request) -> str | None:
    return request.client.host if request.client else None


def declared_size(request: Request) -> int | None:
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


__all__ = ["BearerToken", "ErrorOut", "GuardedRoute", "GuardedService", "ParsedRoute", "Refused", "RequestGuard",
           "answer", "bearer_credentials", "client_of", "declared_size", "log_refusal"]
