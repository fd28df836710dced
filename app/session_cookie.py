"""The session cookie: how a browser keeps its sign-in across reloads and typed addresses.

A Streamlit script talks to the browser over a websocket, so it cannot answer an HTTP
request and cannot set an HttpOnly cookie; only a server response can.  Streamlit's
documented ASGI entry point, ``st.App`` (``app/asgi.py``, which ``rwb app`` serves),
takes extra routes next to Streamlit's own; this module holds the one the app adds::

    POST <base url>/rwb/session      body: a one-use hand-off ticket

The hand-off, after a sign-in (or a sign-out):

1. the script makes the cookie value (``core.access.users.session_cookie``: the session token,
   its expiry and an HMAC) and :func:`issue` keeps it in this process's memory under a
   random ticket, for :data:`TICKET_TTL_S`;
2. :func:`hand_off` renders a few lines of JavaScript that post the ticket to the route
   from the page (the page never sees the cookie value itself);
3. the route redeems the ticket once and answers with ``Set-Cookie: rwb_session=…;
   HttpOnly; SameSite=Strict; Path=<base url>; Max-Age=<the session's remaining life>``,
   plus ``Secure`` when the request came over https (directly or, per
   ``X-Forwarded-Proto``, through a proxy).  A sign-out's ticket deletes the cookie.

On every later page load the browser sends the cookie with the websocket handshake;
``st.context.cookies`` reads it (:func:`browser_cookie`) and
``rwb_app.resources.acting_user`` turns it back into the signed-in user, checking it
against the workspace's session table on every run.

The route refuses requests whose ``Origin`` is not the app's own (so another site cannot
sign a browser in or out), and tickets it does not know, has redeemed or let expire.
Served without ``st.App`` (``streamlit run app/main.py``, ``AppTest``) there is no route:
:func:`issue` then returns None and a sign-in lasts as long as the browser tab.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import streamlit as st
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

#: The cookie's name.
COOKIE_NAME = "rwb_session"
#: Seconds a ticket waits to be redeemed.
TICKET_TTL_S = 60.0
_MAX_BODY = 200


@dataclass
class _Ticket:
    value: str | None  # the cookie to set; None deletes it
    max_age: int
    expires_at: float
    redeemed: bool = False


_tickets: dict[str, _Ticket] = {}  # sha256 of the ticket -> what it stands for
_lock = threading.Lock()
_mounted = False


def _key(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def base_path() -> str:
    """The app's URL prefix (``server.baseUrlPath``): ``""`` or ``"/prefix"``."""
    from streamlit import config

    base = (config.get_option("server.baseUrlPath") or "").strip("/")
    return f"/{base}" if base else ""


def route_path() -> str:
    return f"{base_path()}/rwb/session"


def routes() -> list[Route]:
    """The routes ``st.App`` mounts (``app/asgi.py``); from then on :func:`issue` makes tickets."""
    global _mounted
    _mounted = True
    return [Route(route_path(), _redeem, methods=["POST"])]


def issue(value: str | None, max_age: int, *, now: float | None = None) -> str | None:
    """A ticket that sets the cookie to ``value`` for ``max_age`` seconds (``value`` None:
    deletes it); None when this server has no route to redeem it (see the module doc)."""
    if not _mounted:
        return None
    now = time.time() if now is None else now
    ticket = secrets.token_urlsafe(32)
    with _lock:
        for key in [k for k, t in _tickets.items() if t.expires_at <= now]:
            del _tickets[key]
        _tickets[_key(ticket)] = _Ticket(value, max(0, int(max_age)), now + TICKET_TTL_S)
    return ticket


def pending(ticket: str, *, now: float | None = None) -> bool:
    """Whether ``ticket`` still waits for the browser (neither redeemed nor expired)."""
    now = time.time() if now is None else now
    with _lock:
        found = _tickets.get(_key(ticket))
        return found is not None and not found.redeemed and found.expires_at > now


def _take(ticket: str, now: float) -> _Ticket | None:
    with _lock:
        found = _tickets.get(_key(ticket))
        if found is None or found.redeemed or found.expires_at <= now:
            return None
        found.redeemed = True
        return found


def _same_origin(request: Request) -> bool:
    if request.headers.get("sec-fetch-site") == "same-origin":
        return True
    origin = request.headers.get("origin")
    return bool(origin) and urlsplit(origin).netloc == request.headers.get("host")


def _over_https(request: Request) -> bool:
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


async def _redeem(request: Request) -> Response:
    if not _same_origin(request):
        return PlainTextResponse("refused: the request does not come from this app's pages", 403)
    body = (await request.body())[:_MAX_BODY].decode("ascii", "replace").strip()
    ticket = _take(body, time.time())
    if ticket is None:
        return PlainTextResponse("unknown, used or expired ticket", 410)
    response = Response(status_code=204, headers={"Cache-Control": "no-store"})
    cookie = dict(path=base_path() or "/", secure=_over_https(request), httponly=True,
                  samesite="strict")
    if ticket.value is None:
        response.delete_cookie(COOKIE_NAME, **cookie)
    else:
        response.set_cookie(COOKIE_NAME, ticket.value, max_age=ticket.max_age, **cookie)
    return response


def hand_off(ticket: str) -> None:
    """Post ``ticket`` to the route from the browser (an invisible element)."""
    script = (f"<script>fetch({json.dumps(route_path())}, {{method: 'POST', "
              f"credentials: 'same-origin', body: {json.dumps(ticket)}}});</script>")
    st.html(script, unsafe_allow_javascript=True)


def browser_cookie() -> str | None:
    """The session cookie the browser sent when this page was loaded, if any."""
    value = st.context.cookies.get(COOKIE_NAME)
    return value if isinstance(value, str) and value else None
