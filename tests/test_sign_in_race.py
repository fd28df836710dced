"""Sign-in under attack (issue 28, attack 11): the back-off cannot be raced, the CLI backs off
per user rather than per machine, and weak passwords are refused.

* 16 wrong passwords sent at once, from threads and from processes each with its own
  connection, reach the password check at most ``BACKOFF_FREE_FAILURES`` times: every
  attempt is counted as a failure in the same write transaction that checks the back-off.
* Five failed CLI sign-ins for one user do not lock out another (the admin included).
* A password needs 12 characters and must not be a common one (zxcvbn's list).
Each refusal is written to the security log.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.access import users
from core.access.audit import security_events, security_log_path
from core.access.users import (BACKOFF_FREE_FAILURES, LOCAL_ADMIN, MIN_PASSWORD_CHARS, Actor,
                               SignInThrottled)
from core.base.errors import InputError, PermissionDenied
from core.cli import main
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
ADMIN_PASSWORD = "ada-admin-password"
ANN_PASSWORD = "ann-analyst-password"
T0 = 1_800_000_000.0
ATTEMPTS = 16


@pytest.fixture
def team_root(tmp_path) -> Path:
    root = tmp_path / "ws"
    ws = Workspace.open(root)
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password=ADMIN_PASSWORD)
    users.add_user(ws, Actor("ada", "admin"), "ann", "analyst", password=ANN_PASSWORD)
    ws.close()
    return root


def _attempt(root: Path, start: threading.Barrier | None, now: float) -> str:
    """One wrong-password sign-in on its own connection: "checked" when the password was
    looked at, "throttled" when the back-off refused it first."""
    ws = Workspace.open(root)
    try:
        if start is not None:
            start.wait()
        users.authenticate(ws, "ann", "a wrong guess!", address="10.6.6.6", now=now)
    except SignInThrottled:
        return "throttled"
    except PermissionDenied:
        return "checked"
    finally:
        ws.close()
    return "signed in"


def _outcomes_and_rows(root: Path, outcomes: list[str]) -> tuple[dict[str, int], int]:
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    ws = Workspace.open(root)
    try:
        rows = ws.conn.execute("SELECT COUNT(*) FROM sign_in_failures").fetchone()[0]
        throttled = len(security_events(ws, "sign_in_throttled"))
    finally:
        ws.close()
    assert throttled == counts.get("throttled", 0)
    return counts, rows


# --------------------------------------------------------------------------- the race
def test_sixteen_parallel_wrong_passwords_from_threads_check_at_most_the_limit(team_root):
    start = threading.Barrier(ATTEMPTS)
    outcomes: list[str] = []
    lock = threading.Lock()

    def run() -> None:
        result = _attempt(team_root, start, T0)
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=run) for _ in range(ATTEMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    counts, rows = _outcomes_and_rows(team_root, outcomes)
    assert counts == {"checked": BACKOFF_FREE_FAILURES, "throttled": ATTEMPTS - BACKOFF_FREE_FAILURES}
    assert rows == BACKOFF_FREE_FAILURES  # refused attempts leave no failure behind


def _process_attempt(root: str, start, results) -> None:
    results.put(_attempt(Path(root), start, T0))


def test_sixteen_parallel_wrong_passwords_from_processes_check_at_most_the_limit(team_root):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(ATTEMPTS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_attempt, args=(str(team_root), start, results))
             for _ in range(ATTEMPTS)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    counts, rows = _outcomes_and_rows(team_root, outcomes)
    assert counts == {"checked": BACKOFF_FREE_FAILURES, "throttled": ATTEMPTS - BACKOFF_FREE_FAILURES}
    assert rows == BACKOFF_FREE_FAILURES


def test_a_success_is_not_counted_as_a_failure(team_root):
    ws = Workspace.open(team_root)
    for i in range(BACKOFF_FREE_FAILURES - 1):
        with pytest.raises(PermissionDenied):
            users.authenticate(ws, "ann", "a wrong guess!", address="10.1.1.1", now=T0 + i)
    # the attempt was recorded as a failure before the check; the success removes it again
    assert users.authenticate(ws, "ann", ANN_PASSWORD, address="10.1.1.1", now=T0 + 5).name == "ann"
    assert ws.conn.execute("SELECT COUNT(*) FROM sign_in_failures").fetchone()[0] == BACKOFF_FREE_FAILURES - 1
    # so the address still has one free failure before it backs off
    with pytest.raises(PermissionDenied) as exc:
        users.authenticate(ws, "ada", "a wrong guess!", address="10.1.1.1", now=T0 + 6)
    assert not isinstance(exc.value, SignInThrottled)
    with pytest.raises(SignInThrottled, match="from this address"):
        users.authenticate(ws, "ada", ADMIN_PASSWORD, address="10.1.1.1", now=T0 + 7)
    ws.close()


# --------------------------------------------------------------------------- CLI: per user
def test_cli_failures_of_one_user_do_not_lock_out_the_admin(team_root, monkeypatch, capsys):
    monkeypatch.setenv("RWB_PASSWORD", "a wrong guess!")
    argv = ["--workspace", str(team_root), "users", "list"]
    for _ in range(BACKOFF_FREE_FAILURES + 2):
        assert main([*argv, "--as", "ann"]) == 3
    assert "too many failed sign-ins for the user name 'ann'" in capsys.readouterr().err
    # the admin, from the same machine, is not locked out ...
    monkeypatch.setenv("RWB_PASSWORD", ADMIN_PASSWORD)
    assert main([*argv, "--as", "ada", "--json"]) == 0
    assert '"ann"' in capsys.readouterr().out
    # ... while ann stays backed off, even with her right password
    monkeypatch.setenv("RWB_PASSWORD", ANN_PASSWORD)
    ws = Workspace.open(team_root)
    with pytest.raises(SignInThrottled, match="for the user name 'ann'"):
        users.resolve_actor(ws, "ann", ANN_PASSWORD)
    assert {e.detail["user"] for e in security_events(ws, "sign_in_throttled")} == {"ann"}
    ws.close()


def test_an_unknown_address_backs_off_per_user_only(team_root):
    """The app behind a proxy that hides the client: no address, so no shared lock-out."""
    ws = Workspace.open(team_root)
    for i in range(BACKOFF_FREE_FAILURES):
        with pytest.raises(PermissionDenied):
            users.authenticate(ws, "ann", "a wrong guess!", address=None, now=T0 + i)
    with pytest.raises(SignInThrottled):
        users.authenticate(ws, "ann", ANN_PASSWORD, address=None, now=T0 + 6)
    assert users.authenticate(ws, "ada", ADMIN_PASSWORD, address=None, now=T0 + 6).name == "ada"
    ws.close()


# --------------------------------------------------------------------------- password policy
@pytest.mark.parametrize("password, why", [
    ("12345678", f"has 8 characters; a password needs at least {MIN_PASSWORD_CHARS} characters"),
    ("password", "has 8 characters"),
    ("password1234", "one of the most common passwords"),
    ("QwertyUiop12", "one of the most common passwords"),
    ("Password2024!", "a common password with digits or symbols added"),
    ("!!trustno1!!", "a common password with digits or symbols added"),
])
def test_weak_passwords_are_refused_with_the_policy(ws, password: str, why: str):
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password=ADMIN_PASSWORD)
    admin = Actor("ada", "admin")
    with pytest.raises(InputError, match=why) as exc:
        users.add_user(ws, admin, "bob", "analyst", password=password)
    assert exc.value.field == "password" and "common password" in str(exc.value)
    with pytest.raises(InputError, match=why):
        users.set_password(ws, admin, "ada", password)
    assert users.authenticate(ws, "ada", ADMIN_PASSWORD).name == "ada"   # unchanged
    events = security_events(ws, "password_refused")
    assert [(e.actor, e.detail["user"]) for e in events] == [("ada", "bob"), ("ada", "ada")]
    assert json.dumps(password) not in security_log_path(ws).read_text(encoding="utf-8")  # never the secret


def test_strong_passwords_are_accepted():
    for password in ("ochre lantern dusk", "ada-admin-password", "Tr4in-the-p0licy!", "correct horse battery"):
        assert users.password_problem(password) is None, password
    assert users.password_problem(" padded password ") == "a password may not start or end with spaces"
    assert "password" in users.common_passwords() and len(users.common_passwords()) >= 10_000


def test_cli_refuses_a_weak_password_with_the_policy(team_root, monkeypatch, capsys):
    monkeypatch.setenv("RWB_PASSWORD", ADMIN_PASSWORD)
    monkeypatch.setattr("sys.stdin", _Stdin("password1234\n"))
    argv = ["--workspace", str(team_root), "users", "add", "bob", "--role", "analyst", "--password-stdin",
            "--as", "ada"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "one of the most common passwords" in err and "at least 12 characters" in err
    assert "Traceback" not in err


class _Stdin:
    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)

    def isatty(self) -> bool:
        return False

    def readline(self) -> str:
        return self.lines.pop(0) if self.lines else ""


# --------------------------------------------------------------------------- the sign-in page
def test_sign_in_page_states_the_policy_and_flags_a_weak_old_password(team_root, monkeypatch):
    ws = Workspace.open(team_root)
    # a password set before the policy (written as the old code would have)
    ws.conn.execute("UPDATE users SET password_hash=? WHERE name='ann'", (users.hash_password("ann12345"),))
    ws.close()
    monkeypatch.setenv("RWB_WORKSPACE", str(team_root))
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    assert not at.exception
    assert any("Password policy: a password needs at least 12 characters" in c.value for c in at.caption)
    at.text_input(key="sign_in_name").input("ann")
    at.text_input(key="sign_in_password").input("ann12345")
    at.button[0].click().run()
    assert not at.exception
    assert at.session_state["actor"] == Actor("ann", "analyst")
    warnings = [w.value for w in at.warning]
    assert any("does not meet the password policy" in w and "has 8 characters" in w for w in warnings), warnings
