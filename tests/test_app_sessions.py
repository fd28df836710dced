"""Sessions that last: the signed session cookie (core.access.users), the route that sets it
(rwb_app.session_cookie) and the app's reading of it (rwb_app.resources, AppTest).

Times are given explicitly (``now=``); nothing sleeps.  The browser's cookie is stood in
for by patching ``rwb_app.session_cookie.browser_cookie`` (AppTest cannot send cookies);
tests/test_browser_sessions.py drives the real thing in Chromium.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import stat
import threading
import time
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from streamlit.testing.v1 import AppTest

from core.access import users
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, SESSION_MAX_S, Actor, SessionEnded
from rwb_app import session_cookie

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "app" / "main.py")
TIMEOUT = 120
T0 = 1_800_000_000.0
PASSWORD = "bob-password-1"


@pytest.fixture
def team(ws):
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1")
    users.add_user(ws, Actor("ada", "admin"), "bob", "approver", password=PASSWORD)
    return Actor("ada", "admin")


def _texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [i.value for i in at.info]
    parts += [e.value for e in at.error] + [s.value for s in at.success]
    return "\n".join(str(p) for p in parts)


# --------------------------------------------------------------------------- the signed cookie (core)
def test_cookie_is_token_expiry_and_hmac_known_answer(ws, team):
    session = users.sign_in(ws, "bob", PASSWORD, now=T0)
    value = users.session_cookie(ws, session)
    token, expires, signature = value.split(".")
    assert token == session.token
    assert int(expires) == int(T0 + SESSION_MAX_S)
    key = ws.root.joinpath(*users.SESSION_COOKIE_KEY).read_bytes()
    mac = hmac.new(key, b"rwb-session-cookie/1\n" + f"{token}.{expires}".encode(), hashlib.sha256).digest()
    assert signature == base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    assert users.session_cookie_token(ws, value, now=T0 + 1) == session.token
    assert users.session_actor(ws, session.token, now=T0 + 1) == Actor("bob", "approver")
    # the workspace keeps only the token's hash, never the cookie or the token
    stored = ws.conn.execute("SELECT token_sha256 FROM sessions").fetchall()
    assert stored == [(hashlib.sha256(token.encode()).hexdigest(),)]


def test_cookie_key_is_private_stable_and_made_once_under_a_race(ws):
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(users._cookie_key(ws))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = ws.root.joinpath(*users.SESSION_COOKIE_KEY)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert path.read_bytes() == keys[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".session_cookie")] == []


@pytest.mark.parametrize("damage", ["token", "expires", "signature", "truncated", "garbage", "empty"])
def test_a_damaged_or_forged_cookie_is_refused(ws, team, damage):
    value = users.session_cookie(ws, users.sign_in(ws, "bob", PASSWORD, now=T0))
    token, expires, signature = value.split(".")
    flip = {"a": "b"}.get(token[0], "a")
    forged = {"token": f"{flip}{token[1:]}.{expires}.{signature}",
              "expires": f"{token}.{int(expires) + 86400}.{signature}",   # a longer life
              "signature": f"{token}.{expires}.{signature[:-1]}{'A' if signature[-1] != 'A' else 'B'}",
              "truncated": f"{token}.{expires}",
              "garbage": "not a cookie",
              "empty": ""}[damage]
    with pytest.raises(SessionEnded, match="not one of this workspace's"):
        users.session_cookie_token(ws, forged, now=T0 + 1)


def test_a_cookie_of_another_workspace_is_refused(ws, team, tmp_path):
    other = Workspace.open(tmp_path / "other")
    try:
        users.add_user(other, LOCAL_ADMIN, "bob", "admin", password=PASSWORD)
        value = users.session_cookie(other, users.sign_in(other, "bob", PASSWORD, now=T0))
    finally:
        other.close()
    with pytest.raises(SessionEnded, match="not one of this workspace's"):
        users.session_cookie_token(ws, value, now=T0 + 1)


def test_cookie_expires_with_the_session(ws, team):
    value = users.session_cookie(ws, users.sign_in(ws, "bob", PASSWORD, now=T0))
    assert users.session_cookie_token(ws, value, now=T0 + SESSION_MAX_S - 1)
    with pytest.raises(SessionEnded, match="expired 7 days after sign-in"):
        users.session_cookie_token(ws, value, now=T0 + SESSION_MAX_S)


@pytest.mark.parametrize("revoke, why", [
    (lambda ws, admin, token: users.end_session(ws, token, now=T0 + 5), "signed out"),
    (lambda ws, admin, token: users.set_password(ws, admin, "bob", "a-new-password"), "password changed"),
    (lambda ws, admin, token: users.set_role(ws, admin, "bob", "analyst"),
     "role changed from approver to analyst"),
])
def test_a_valid_cookie_of_a_revoked_session_signs_nobody_in(ws, team, revoke, why):
    session = users.sign_in(ws, "bob", PASSWORD, now=T0)
    value = users.session_cookie(ws, session)
    revoke(ws, team, session.token)
    token = users.session_cookie_token(ws, value, now=T0 + 10)     # the signature is still good …
    with pytest.raises(SessionEnded, match=f"ended \\({why}\\)"):  # … the session is not
        users.session_actor(ws, token, now=T0 + 10)


def test_a_look_without_touch_does_not_keep_the_session_alive(ws, team):
    session = users.sign_in(ws, "bob", PASSWORD, now=T0)

    def last_seen() -> float:
        return ws.conn.execute("SELECT last_seen FROM sessions").fetchone()[0]

    users.session_actor(ws, session.token, now=T0 + 3600, touch=False)
    assert last_seen() == T0
    users.session_actor(ws, session.token, now=T0 + 3600)
    assert last_seen() == T0 + 3600
    with pytest.raises(SessionEnded, match="without activity"):
        users.session_actor(ws, session.token, now=T0 + 3600 + users.SESSION_IDLE_S, touch=False)


# --------------------------------------------------------------------------- the route that sets it
@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(session_cookie, "_mounted", False)
    monkeypatch.setattr(session_cookie, "_tickets", {})
    assert session_cookie.issue("x", 10) is None          # no route: no ticket
    app = Starlette(routes=session_cookie.routes())
    return TestClient(app, base_url="http://app.test")


SAME_ORIGIN = {"Origin": "http://app.test"}


def test_route_sets_an_httponly_strict_cookie_once(client):
    ticket = session_cookie.issue("tok.123.sig", 3600)
    assert session_cookie.pending(ticket)
    answer = client.post("/rwb/session", content=ticket, headers=SAME_ORIGIN)
    assert answer.status_code == 204
    header = answer.headers["set-cookie"]
    attrs = {a.strip().split("=")[0].lower(): a.strip() for a in header.split(";")}
    assert header.startswith("rwb_session=tok.123.sig;")
    assert attrs["httponly"] == "HttpOnly"
    assert attrs["samesite"].lower() == "samesite=strict"
    assert attrs["path"] == "Path=/"
    assert attrs["max-age"] == "Max-Age=3600"
    assert "secure" not in attrs                             # plain http
    assert answer.headers["cache-control"] == "no-store"
    assert not session_cookie.pending(ticket)
    again = client.post("/rwb/session", content=ticket, headers=SAME_ORIGIN)
    assert again.status_code == 410 and "set-cookie" not in again.headers


def test_route_marks_the_cookie_secure_over_https(client):
    ticket = session_cookie.issue("tok.123.sig", 3600)
    answer = client.post("/rwb/session", content=ticket,
                         headers={**SAME_ORIGIN, "X-Forwarded-Proto": "https"})
    assert answer.status_code == 204
    assert "; secure" in answer.headers["set-cookie"].lower()


def test_route_deletes_the_cookie_for_a_sign_out_ticket(client):
    ticket = session_cookie.issue(None, 0)
    answer = client.post("/rwb/session", content=ticket, headers=SAME_ORIGIN)
    assert answer.status_code == 204
    header = answer.headers["set-cookie"].lower()
    assert header.startswith('rwb_session="";') and "max-age=0" in header and "httponly" in header


def test_route_refuses_other_origins_unknown_and_expired_tickets(client):
    ticket = session_cookie.issue("tok.123.sig", 3600)
    for headers in ({"Origin": "http://evil.test"}, {}):
        refused = client.post("/rwb/session", content=ticket, headers=headers)
        assert refused.status_code == 403 and "set-cookie" not in refused.headers
    assert session_cookie.pending(ticket)                  # a refused request does not use it up
    assert client.post("/rwb/session", content="no-such-ticket", headers=SAME_ORIGIN).status_code == 410
    assert client.get("/rwb/session").status_code == 405
    old = session_cookie.issue("tok.1.sig", 3600, now=time.time() - session_cookie.TICKET_TTL_S - 1)
    assert not session_cookie.pending(old)                 # issued over a minute ago: expired
    assert client.post("/rwb/session", content=old, headers=SAME_ORIGIN).status_code == 410


def test_same_origin_by_fetch_metadata(client):
    ticket = session_cookie.issue("tok.123.sig", 60)
    answer = client.post("/rwb/session", content=ticket, headers={"Sec-Fetch-Site": "same-origin"})
    assert answer.status_code == 204


# --------------------------------------------------------------------------- the app reads it (AppTest)
@pytest.fixture
def users_ws(tmp_path, monkeypatch) -> Path:
    ws = Workspace.open(tmp_path / "ws")
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1")
    users.add_user(ws, Actor("ada", "admin"), "bob", "approver", password=PASSWORD)
    ws.close()
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    return tmp_path / "ws"


def _browser_sends(monkeypatch, value: str | None) -> None:
    monkeypatch.setattr(session_cookie, "browser_cookie", lambda: value)


def _cookie_for(root: Path, name: str, password: str) -> tuple[str, str]:
    ws = Workspace.open(root)
    try:
        session = users.sign_in(ws, name, password)
        return users.session_cookie(ws, session), session.token
    finally:
        ws.close()


def test_a_new_tab_with_the_cookie_is_signed_in(users_ws, monkeypatch):
    value, token = _cookie_for(users_ws, "bob", PASSWORD)
    _browser_sends(monkeypatch, value)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert at.title[0].value != "Sign in"                  # signed in: the root opens the first page
    assert "Acting as **bob** (approver)" in _texts(at)
    assert at.session_state["session_token"] == token
    at.switch_page(str(ROOT / "pages" / "sign_in.py")).run()
    assert "Signed in as **bob** (approver)" in _texts(at)

    # sign out: the tab stays signed out though its page load sent the cookie …
    at.button(key="sign_out").click().run()
    assert not at.exception
    assert "Not signed in" in _texts(at)
    at.run()
    assert "Not signed in" in _texts(at) and "actor" not in at.session_state
    # … and so does a reload, whose browser (here) still sends the ended session's cookie
    again = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert "Not signed in" in _texts(again)
    assert "Your session was ended (signed out); sign in again" in _texts(again)


@pytest.mark.parametrize("cookie, said", [
    ("forged.123.sig", "The session cookie is not one of this workspace's"),
    (None, None),
])
def test_a_bad_or_missing_cookie_signs_nobody_in(users_ws, monkeypatch, cookie, said):
    _browser_sends(monkeypatch, cookie)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert at.title[0].value == "Sign in"
    assert "Not signed in" in _texts(at)
    assert "actor" not in at.session_state
    if said:
        assert said in _texts(at)


def test_sign_in_revoked_elsewhere_signs_the_tab_out(users_ws, monkeypatch):
    _browser_sends(monkeypatch, None)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    at.text_input(key="sign_in_name").input("bob")
    at.text_input(key="sign_in_password").input(PASSWORD)
    at.button[0].click().run()
    assert "Acting as **bob** (approver)" in _texts(at)
    ws = Workspace.open(users_ws)
    try:
        users.set_role(ws, Actor("ada", "admin"), "bob", "reviewer")
    finally:
        ws.close()
    at.run()
    assert not at.exception
    assert "Not signed in" in _texts(at)
    assert "Your session was ended (role changed from approver to reviewer)" in _texts(at)


def test_sidebar_tells_the_truth_after_users_appear(tmp_path, monkeypatch):
    Workspace.open(tmp_path / "ws").close()
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    _browser_sends(monkeypatch, None)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert "Acting as **local** (admin)" in _texts(at)
    ws = Workspace.open(tmp_path / "ws")
    try:
        users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1")
    finally:
        ws.close()
    at.run()
    assert not at.exception
    assert "Not signed in" in _texts(at)
    assert "Acting as" not in _texts(at)


def _who_acts_script() -> None:
    import streamlit as st

    from rwb_app import resources

    if st.session_state.get("look_only"):
        st.write(f"changed={resources.who_acts_changed()}")
    else:
        st.write(f"acting={resources.acting_user()}")


def test_who_acts_changed_sees_users_appear_and_sessions_end(tmp_path, monkeypatch):
    """What the sidebar's periodic re-check (a fragment in app/main.py) asks."""
    Workspace.open(tmp_path / "ws").close()
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    _browser_sends(monkeypatch, None)
    at = AppTest.from_function(_who_acts_script, default_timeout=TIMEOUT)
    at.session_state["look_only"] = True
    at.run()
    assert at.markdown[0].value == "changed=False"         # nothing said yet: nothing changed
    at.session_state["look_only"] = False
    at.run()
    assert at.markdown[0].value == "acting=local (admin)"
    at.session_state["look_only"] = True
    at.run()
    assert at.markdown[0].value == "changed=False"

    ws = Workspace.open(tmp_path / "ws")
    try:
        users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1")
        session = users.sign_in(ws, "ada", "ada-password-1")
    finally:
        ws.close()
    at.run()
    assert at.markdown[0].value == "changed=True"          # users appeared
    at.session_state["look_only"] = False
    at.run()
    assert at.markdown[0].value == "acting=None"

    at.session_state["actor"] = session.actor
    at.session_state["session_token"] = session.token
    at.run()
    assert at.markdown[0].value == "acting=ada (admin)"
    at.session_state["look_only"] = True
    at.run()
    assert at.markdown[0].value == "changed=False"
    ws = Workspace.open(tmp_path / "ws")
    try:
        users.end_session(ws, session.token)                # signed out in another tab
    finally:
        ws.close()
    at.run()
    assert at.markdown[0].value == "changed=True"
