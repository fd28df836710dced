"""Sign-in hardening (core.access.users): back-off after failed sign-ins, argon2id with re-hash of
older scrypt hashes, session expiry and revocation, and SSO that trusts only verified
e-mail addresses.  Every time is given explicitly (``now=``): nothing sleeps."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.access import users
from core.base.errors import PermissionDenied
from core.records.store import Workspace
from core.access.users import (BACKOFF_BASE_S, BACKOFF_CAP_S, BACKOFF_FREE_FAILURES, BACKOFF_WINDOW_S,
                               LOCAL_ADMIN, SESSION_IDLE_S, SESSION_MAX_S, Actor, SessionEnded,
                               SignInThrottled)

PASSWORD = "correct horse battery"
T0 = 1_800_000_000.0  # a fixed clock reading (2027-01-15)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def team(ws):
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password=PASSWORD)
    admin = Actor("ada", "admin")
    users.add_user(ws, admin, "ann", "analyst", password=PASSWORD + "ann")
    users.add_user(ws, admin, "rex", "reviewer", password=PASSWORD + "rex")
    return admin


def _fail(ws, name: str, address: str, now: float) -> None:
    with pytest.raises(PermissionDenied, match="^unknown user or wrong password$"):
        users.authenticate(ws, name, "not the password", address=address, now=now)


# --------------------------------------------------------------------------- back-off rule
def test_backoff_wait_known_answers():
    free = BACKOFF_FREE_FAILURES
    assert (free, BACKOFF_BASE_S, BACKOFF_CAP_S, BACKOFF_WINDOW_S) == (5, 30.0, 900.0, 900.0)
    assert users.backoff_wait([], now=T0) == 0.0
    assert users.backoff_wait([T0 + i for i in range(free - 1)], now=T0 + 10) == 0.0
    five = [T0 + i for i in range(free)]                         # last one at T0+4
    assert users.backoff_wait(five, now=T0 + 4) == 30.0
    assert users.backoff_wait(five, now=T0 + 10) == 24.0
    assert users.backoff_wait(five, now=T0 + 34) == 0.0
    assert users.backoff_wait(five + [T0 + 40], now=T0 + 40) == 60.0     # doubles
    assert users.backoff_wait(five + [T0 + 40, T0 + 100], now=T0 + 100) == 120.0
    ten = [T0 + 60 * i for i in range(10)]                       # 30 * 2**5 = 960 > cap
    assert users.backoff_wait(ten, now=ten[-1]) == 900.0
    # a gap of a full window breaks the run: four old failures and three new ones are free
    split = [T0 + i for i in range(4)] + [T0 + 3 + BACKOFF_WINDOW_S + i for i in range(3)]
    assert users.backoff_wait(split, now=split[-1]) == 0.0
    # ... a gap just under the window does not
    chained = [T0 + i for i in range(4)] + [T0 + 3 + BACKOFF_WINDOW_S - 1]
    assert users.backoff_wait(chained, now=chained[-1]) == 30.0


def _naive_wait(times: list[float], now: float) -> float:
    """The rule spelled out: find the run by scanning pairs forwards in time order."""
    times = sorted(times)
    start = 0
    for i in range(1, len(times)):
        if times[i] - times[i - 1] >= BACKOFF_WINDOW_S:
            start = i
    run = len(times) - start
    if run < BACKOFF_FREE_FAILURES:
        return 0.0
    delay = BACKOFF_BASE_S
    for _ in range(run - BACKOFF_FREE_FAILURES):
        delay = min(2 * delay, BACKOFF_CAP_S)
    return max(0.0, times[-1] + delay - now)


def test_backoff_wait_matches_the_naive_rule():
    rng = secrets.SystemRandom(7)
    for _ in range(300):
        gaps = [rng.choice([1.0, 30.0, 400.0, BACKOFF_WINDOW_S - 1, BACKOFF_WINDOW_S, 2000.0])
                for _ in range(rng.randint(0, 14))]
        times = [T0 + sum(gaps[:i + 1]) for i in range(len(gaps))]
        now = (times[-1] if times else T0) + rng.choice([0.0, 5.0, 29.0, 31.0, 200.0, 1000.0])
        assert users.backoff_wait(times, now) == _naive_wait(times, now)


# --------------------------------------------------------------------------- brute force
def test_brute_force_backs_off_per_user_and_per_address(ws, team, tmp_path):
    for i in range(BACKOFF_FREE_FAILURES):                      # failures at T0 .. T0+4
        _fail(ws, "ann", "10.0.0.1", T0 + i)
    # the right password is refused too, with the time to wait, from any address
    with pytest.raises(SignInThrottled, match=r"for the user name 'ann'; wait 29 s") as exc:
        users.authenticate(ws, "ann", PASSWORD + "ann", address="10.0.0.1", now=T0 + 5)
    assert exc.value.wait_s == 29.0
    with pytest.raises(SignInThrottled, match="wait 20 s"):
        users.authenticate(ws, "ANN ", PASSWORD + "ann", address="10.0.0.2", now=T0 + 14)
    # the address is backed off too: another user from it is refused ...
    with pytest.raises(SignInThrottled, match="from this address; wait 24 s"):
        users.authenticate(ws, "rex", PASSWORD + "rex", address="10.0.0.1", now=T0 + 10)
    # ... but not from elsewhere
    assert users.authenticate(ws, "rex", PASSWORD + "rex", address="10.0.0.3",
                              now=T0 + 10).name == "rex"
    # refused attempts are not failures: they neither lengthen the wait nor count
    assert ws.conn.execute("SELECT COUNT(*) FROM sign_in_failures").fetchone()[0] == 5

    # the back-off lives in the workspace: a new connection (another app process) sees it
    again = Workspace.open(tmp_path / "ws")
    with pytest.raises(SignInThrottled):
        users.authenticate(again, "ann", PASSWORD + "ann", address="10.0.0.9", now=T0 + 30)
    again.close()

    # after the wait, one more failure doubles it (60 s after T0+34)
    _fail(ws, "ann", "10.0.0.2", T0 + 34)
    with pytest.raises(SignInThrottled, match="wait 59 s"):
        users.authenticate(ws, "ann", PASSWORD + "ann", address="10.0.0.2", now=T0 + 35)
    assert users.authenticate(ws, "ann", PASSWORD + "ann", address="10.0.0.2",
                              now=T0 + 94).name == "ann"
    # a success clears the user's failures (not the address's)
    assert ws.conn.execute("SELECT COUNT(*) FROM sign_in_failures WHERE user='ann' "
                           "AND user_cleared=0").fetchone()[0] == 0
    _fail(ws, "ann", "10.0.0.2", T0 + 95)                       # a typo is just a typo again
    assert users.authenticate(ws, "ann", PASSWORD + "ann", address="10.0.0.2",
                              now=T0 + 96).name == "ann"
    with pytest.raises(SignInThrottled, match="from this address"):
        users.authenticate(ws, "rex", PASSWORD + "rex", address="10.0.0.1", now=T0 + 20)


def test_unknown_names_back_off_like_known_ones(ws, team):
    """The back-off must not tell an attacker which names exist."""
    for name in ("ann", "nobody"):
        for i in range(BACKOFF_FREE_FAILURES):
            _fail(ws, name, f"addr-{name}-{i}", T0 + i)
    refusals = []
    for name in ("ann", "nobody"):
        with pytest.raises(SignInThrottled) as exc:
            users.authenticate(ws, name, "anything at all", address="elsewhere", now=T0 + 10)
        refusals.append(str(exc.value).replace(name, "NAME"))
    assert refusals[0] == refusals[1]


def test_cli_sign_in_backs_off_from_the_local_address(ws, team):
    """resolve_actor (the CLI's --as) goes through the same back-off, as the local address."""
    for i in range(BACKOFF_FREE_FAILURES):
        with pytest.raises(PermissionDenied):
            users.resolve_actor(ws, "ada", f"wrong guess {i}")
    with pytest.raises(SignInThrottled, match="wait"):
        users.resolve_actor(ws, "ada", PASSWORD)
    assert {r[0] for r in ws.conn.execute("SELECT address FROM sign_in_failures")} == {"local"}


# --------------------------------------------------------------------------- hashes
def _legacy_scrypt_hash(password: str) -> str:
    """A hash as the previous version of core.access.users stored it (scrypt, N=2**14)."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)
    return f"scrypt${2**14}$8$1${salt.hex()}${digest.hex()}"


def test_scrypt_hash_is_rehashed_as_argon2id_on_sign_in(ws, team):
    legacy = _legacy_scrypt_hash(PASSWORD + "ann")
    assert users.verify_password(PASSWORD + "ann", legacy)
    assert not users.verify_password(PASSWORD, legacy)
    assert users.password_needs_rehash(legacy)
    with ws.transaction() as conn:
        conn.execute("UPDATE users SET password_hash=? WHERE name='ann'", (legacy,))

    _fail(ws, "ann", "10.0.0.1", T0)                            # a failure changes nothing
    stored = ws.conn.execute("SELECT password_hash FROM users WHERE name='ann'").fetchone()[0]
    assert stored == legacy

    assert users.authenticate(ws, "ann", PASSWORD + "ann", now=T0 + 1).name == "ann"
    stored = ws.conn.execute("SELECT password_hash FROM users WHERE name='ann'").fetchone()[0]
    assert stored.startswith("$argon2id$v=19$m=19456,t=2,p=1$")
    assert not users.password_needs_rehash(stored)
    assert users.verify_password(PASSWORD + "ann", stored)
    assert not users.verify_password(PASSWORD, stored)
    # and it keeps working, without another re-hash
    assert users.authenticate(ws, "ann", PASSWORD + "ann", now=T0 + 2).name == "ann"
    assert ws.conn.execute("SELECT password_hash FROM users WHERE name='ann'"
                           ).fetchone()[0] == stored


def test_argon2id_hash_with_weaker_parameters_is_rehashed(ws, team):
    import argon2

    weak = argon2.PasswordHasher(time_cost=1, memory_cost=8 * 1024, parallelism=1).hash(
        PASSWORD + "rex")
    assert users.verify_password(PASSWORD + "rex", weak) and users.password_needs_rehash(weak)
    with ws.transaction() as conn:
        conn.execute("UPDATE users SET password_hash=? WHERE name='rex'", (weak,))
    users.authenticate(ws, "rex", PASSWORD + "rex", now=T0)
    stored = ws.conn.execute("SELECT password_hash FROM users WHERE name='rex'").fetchone()[0]
    assert stored.startswith("$argon2id$v=19$m=19456,t=2,p=1$")
    for damaged in ("$argon2id$v=19$m=19456,t=2,p=1$xx", "", "scrypt$x"):
        assert not users.verify_password(PASSWORD, damaged)


# --------------------------------------------------------------------------- sessions
def test_session_idle_expiry(ws, team):
    session = users.sign_in(ws, "ann", PASSWORD + "ann", address="10.0.0.1", now=T0)
    assert session.actor == Actor("ann", "analyst")
    # activity keeps it alive: each check is less than the idle limit after the one before
    t = T0
    for _ in range(3):
        t += SESSION_IDLE_S - 1
        assert users.session_actor(ws, session.token, now=t) == Actor("ann", "analyst")
    with pytest.raises(SessionEnded, match="expired after 8 h without activity"):
        users.session_actor(ws, session.token, now=t + SESSION_IDLE_S)
    with pytest.raises(SessionEnded, match=r"was ended \(expired after 8 h"):
        users.session_actor(ws, session.token, now=t + SESSION_IDLE_S + 1)
    # the token itself is not stored
    assert session.token not in str(ws.conn.execute("SELECT * FROM sessions").fetchall())


def test_session_absolute_expiry(ws, team):
    session = users.sign_in(ws, "ann", PASSWORD + "ann", now=T0)
    t = T0
    while t + 3600 < T0 + SESSION_MAX_S:
        t += 3600                                            # active every hour
        users.session_actor(ws, session.token, now=t)
    with pytest.raises(SessionEnded, match="expired 7 days after sign-in"):
        users.session_actor(ws, session.token, now=T0 + SESSION_MAX_S)
    # signing in again starts a fresh session
    fresh = users.sign_in(ws, "ann", PASSWORD + "ann", now=T0 + SESSION_MAX_S)
    assert users.session_actor(ws, fresh.token, now=T0 + SESSION_MAX_S + 1).name == "ann"


def test_sessions_are_revoked_on_password_change(ws, team):
    ann = users.sign_in(ws, "ann", PASSWORD + "ann", now=T0)
    rex = users.sign_in(ws, "rex", PASSWORD + "rex", now=T0)
    users.set_password(ws, ann.actor, "ann", "a brand new one")
    with pytest.raises(SessionEnded, match=r"ended \(password changed\)"):
        users.session_actor(ws, ann.token, now=T0 + 1)
    assert users.session_actor(ws, rex.token, now=T0 + 1).name == "rex"   # others keep theirs
    users.set_password(ws, team, "rex", "reset by admin!")
    with pytest.raises(SessionEnded, match="password changed"):
        users.session_actor(ws, rex.token, now=T0 + 2)
    again = users.sign_in(ws, "ann", "a brand new one", now=T0 + 3)
    assert users.session_actor(ws, again.token, now=T0 + 4).name == "ann"


def test_sessions_are_revoked_on_role_change_and_disable(ws, team):
    rex = users.sign_in(ws, "rex", PASSWORD + "rex", now=T0)
    users.set_role(ws, team, "rex", "reviewer")                 # no change: session stays
    assert users.session_actor(ws, rex.token, now=T0 + 1).role == "reviewer"
    users.set_role(ws, team, "rex", "analyst")
    with pytest.raises(SessionEnded, match=r"role changed from reviewer to analyst"):
        users.session_actor(ws, rex.token, now=T0 + 2)
    again = users.sign_in(ws, "rex", PASSWORD + "rex", now=T0 + 3)
    assert users.session_actor(ws, again.token, now=T0 + 4) == Actor("rex", "analyst")
    users.disable_user(ws, team, "rex")
    with pytest.raises(SessionEnded, match="user disabled"):
        users.session_actor(ws, again.token, now=T0 + 5)


def test_sign_out_and_unknown_tokens(ws, team):
    session = users.sign_in(ws, "ann", PASSWORD + "ann", now=T0)
    users.end_session(ws, session.token, now=T0 + 1)
    with pytest.raises(SessionEnded, match=r"ended \(signed out\)"):
        users.session_actor(ws, session.token, now=T0 + 2)
    with pytest.raises(SessionEnded, match="not known"):
        users.session_actor(ws, secrets.token_urlsafe(32), now=T0)
    row = ws.conn.execute("SELECT user, address, method, created_at, ended_at FROM sessions"
                          ).fetchone()
    assert row == ("ann", "local", "password", T0, T0 + 1)


# --------------------------------------------------------------------------- SSO
def test_sso_needs_a_verified_email(ws, team):
    users.add_user(ws, team, "olga", "reviewer", email="olga@example.com")
    users.add_user(ws, team, "otto", "approver", oidc_sub="idp|123")
    for claims in ({}, {"email_verified": False}, {"email_verified": "true"},
                   {"email_verified": 1}):
        with pytest.raises(PermissionDenied, match="did not confirm this e-mail"):
            users.oidc_user(ws, {"email": "olga@example.com", "sub": "idp|9", **claims})
    assert users.oidc_user(ws, {"email": "olga@example.com", "sub": "idp|9",
                                "email_verified": True}).name == "olga"
    # the subject is the provider's own account id: it needs no verified e-mail
    assert users.oidc_user(ws, {"sub": "idp|123", "email": "x@y.org"}).name == "otto"
    session = users.sso_sign_in(ws, {"sub": "idp|123"}, address="10.1.1.1", now=T0)
    assert users.session_actor(ws, session.token, now=T0 + 1).name == "otto"
    assert ws.conn.execute("SELECT method FROM sessions").fetchone()[0] == "oidc"


# --------------------------------------------------------------------------- the app
def test_app_signs_out_a_revoked_session(tmp_path, monkeypatch):
    ws = Workspace.open(tmp_path / "ws")
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    users.add_user(ws, Actor("ada", "admin"), "bob", "approver", password="bob-password")
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    at.text_input(key="sign_in_name").input("bob")
    at.text_input(key="sign_in_password").input("bob-password")
    at.button[0].click().run()
    assert not at.exception
    assert at.session_state["actor"] == Actor("bob", "approver")
    assert ws.conn.execute("SELECT COUNT(*) FROM sessions WHERE user='bob' AND ended_at IS NULL"
                           ).fetchone()[0] == 1

    users.set_role(ws, Actor("ada", "admin"), "bob", "reviewer")
    at.run()
    assert not at.exception
    assert "actor" not in at.session_state and "session_token" not in at.session_state
    assert any("role changed from approver to reviewer" in i.value for i in at.info)

    # five wrong passwords from this browser: the sixth attempt is told to wait
    for _ in range(BACKOFF_FREE_FAILURES + 1):
        at.text_input(key="sign_in_name").input("bob")
        at.text_input(key="sign_in_password").input("not bob's password")
        at.button[0].click().run()
    assert not at.exception
    assert any("too many failed sign-ins" in e.value and "wait" in e.value for e in at.error)
    ws.close()
