"""Users, roles and permissions (core.access.users): every refusal comes from core."""

from __future__ import annotations

import json

import sqlite3

import pytest
from typer.testing import CliRunner

from core.access import audit
from core.guard import review
from core.access import users
from core.cli import main, root
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.access.users import LOCAL_ADMIN, PERMISSIONS, ROLES, Actor

PASSWORD = "correct horse battery"


@pytest.fixture
def team(ws):
    """A multi-user workspace: one user per role (the admin first)."""
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password=PASSWORD)
    admin = users.authenticate(ws, "ada", PASSWORD)
    for name, role in (("ann", "analyst"), ("rex", "reviewer"), ("abe", "approver")):
        users.add_user(ws, admin, name, role, password=PASSWORD + name)
    return admin


# --------------------------------------------------------------------------- modes
def test_embedded_mode_is_one_local_admin_without_login(ws):
    assert not users.multi_user(ws)
    assert users.current_user(ws) == LOCAL_ADMIN
    assert users.resolve_actor(ws, None, None) == LOCAL_ADMIN
    with pytest.raises(PermissionDenied, match="embedded"):
        users.resolve_actor(ws, "bob", "whatever")


def test_first_user_must_be_admin_and_retires_the_local_admin(ws):
    with pytest.raises(InputError, match="first user"):
        users.add_user(ws, LOCAL_ADMIN, "ann", "analyst", password=PASSWORD)
    users.add_user(ws, LOCAL_ADMIN, "ada", "admin", password=PASSWORD)
    assert users.multi_user(ws)
    with pytest.raises(PermissionDenied, match="sign in"):
        users.current_user(ws)
    with pytest.raises(PermissionDenied, match="retired"):
        users.add_user(ws, LOCAL_ADMIN, "bob", "analyst", password=PASSWORD)
    with pytest.raises(PermissionDenied, match="sign in"):
        users.resolve_actor(ws, None, None)
    assert users.resolve_actor(ws, "ada", PASSWORD) == Actor("ada", "admin", "user")


# --------------------------------------------------------------------------- passwords
def test_passwords_are_argon2id_hashed_with_their_own_salt(ws, team):
    users.add_user(ws, team, "bea", "analyst", password=PASSWORD)  # same password as ada
    hashes = dict(ws.conn.execute("SELECT name, password_hash FROM users"))
    # OWASP's argon2id parameters: 19 MiB, 2 passes, 1 lane
    assert all(h.startswith("$argon2id$v=19$m=19456,t=2,p=1$") for h in hashes.values())
    assert PASSWORD not in "".join(hashes.values())
    assert hashes["ada"].split("$")[4] != hashes["bea"].split("$")[4]  # salts differ
    assert hashes["ada"] != hashes["bea"]
    assert users.verify_password(PASSWORD, hashes["bea"])
    assert not users.verify_password(PASSWORD + "x", hashes["bea"])
    assert not users.verify_password(PASSWORD, "garbage")


def test_authenticate_refuses_unknown_wrong_and_disabled_alike(ws, team):
    assert users.authenticate(ws, "Ann", PASSWORD + "ann").role == "analyst"
    with pytest.raises(PermissionDenied) as wrong:
        users.authenticate(ws, "ann", "not the password")
    with pytest.raises(PermissionDenied) as unknown:
        users.authenticate(ws, "nobody", "not the password")
    assert str(wrong.value) == str(unknown.value) == "unknown user or wrong password"
    users.disable_user(ws, team, "ann")
    with pytest.raises(PermissionDenied, match="disabled"):
        users.authenticate(ws, "ann", PASSWORD + "ann")


def test_user_input_is_checked(ws, team):
    with pytest.raises(InputError, match="at least"):
        users.add_user(ws, team, "bob", "analyst", password="short")
    with pytest.raises(InputError, match="unknown role"):
        users.add_user(ws, team, "bob", "superuser", password=PASSWORD)
    with pytest.raises(InputError, match="invalid user name"):
        users.add_user(ws, team, "Bob Smith", "analyst", password=PASSWORD)
    with pytest.raises(InputError, match="reserved"):
        users.add_user(ws, team, "local", "analyst", password=PASSWORD)
    with pytest.raises(InputError, match="password"):
        users.add_user(ws, team, "bob", "analyst")
    with pytest.raises(ConflictError):
        users.add_user(ws, team, "ann", "analyst", password=PASSWORD)


def test_last_admin_keeps_the_role(ws, team):
    with pytest.raises(ConflictError, match="last admin"):
        users.set_role(ws, team, "ada", "analyst")
    with pytest.raises(ConflictError, match="last admin"):
        users.disable_user(ws, team, "ada")
    users.set_role(ws, team, "abe", "admin")
    assert users.set_role(ws, team, "ada", "analyst").role == "analyst"


def test_set_password_own_or_as_admin(ws, team):
    ann = users.authenticate(ws, "ann", PASSWORD + "ann")
    users.set_password(ws, ann, "ann", "a brand new one")
    assert users.authenticate(ws, "ann", "a brand new one").name == "ann"
    with pytest.raises(PermissionDenied):
        users.set_password(ws, ann, "rex", "taking over rex")
    users.set_password(ws, team, "rex", "reset by admin")
    assert users.authenticate(ws, "rex", "reset by admin").role == "reviewer"


# --------------------------------------------------------------------------- permissions
@pytest.mark.parametrize("permission", sorted(PERMISSIONS))
@pytest.mark.parametrize("role", [*ROLES, users.SERVICE_ROLE])
def test_permission_table(permission, role):
    actor = Actor("someone", role)
    allowed = role in PERMISSIONS[permission]
    assert actor.can(permission) is allowed
    if allowed:
        assert users.require(actor, permission) is actor
    else:
        with pytest.raises(PermissionDenied, match="may not"):
            users.require(actor, permission)


def test_table_shape():
    assert PERMISSIONS["manage_users"] == {"admin"}
    assert PERMISSIONS["review"] == {"reviewer", "admin"}
    assert {"approve", "promote", "rollback"} <= {p for p, r in PERMISSIONS.items()
                                                  if "approver" in r}
    assert not any(users.SERVICE_ROLE in PERMISSIONS[p] for p in ("approve", "review",
                                                                   "manage_users", "train"))
    with pytest.raises(PermissionDenied, match="no acting user"):
        users.require("ada", "review")  # type: ignore[arg-type]


def _request() -> review.ReviewRequest:
    return review.ReviewRequest(origin="serving", reason="high risk", state={"hour": 3},
                                token_id=1, decision_id="d1")


def test_core_functions_refuse_the_wrong_role(ws, tmp_path):
    analyst, reviewer, approver = (Actor("ann", "analyst"), Actor("rex", "reviewer"),
                                   Actor("abe", "approver"))
    service = Actor.service()
    refused = [
        lambda: users.add_user(ws, analyst, "bob", "admin", password=PASSWORD),
        lambda: users.list_users(ws, reviewer),
        lambda: users.set_role(ws, approver, "x", "admin"),
        lambda: review.enqueue(ws, reviewer, _request()),
        lambda: review.enqueue(ws, approver, _request()),
        lambda: review.claim(ws, analyst),
        lambda: review.claim(ws, approver),
        lambda: review.claim(ws, service),
        lambda: review.decide(ws, analyst, 1, "approve"),
        lambda: review.release(ws, approver, 1),
        lambda: audit.AuditWriter(ws, reviewer),
        lambda: audit.AuditWriter(ws, analyst),
        lambda: audit.write_record(ws, approver, {"input_hash": "h", "final_action": 1}),
        lambda: audit.export(ws, reviewer, tmp_path / "a.jsonl"),
        lambda: audit.export(ws, service, tmp_path / "a.jsonl"),
        lambda: audit.recover_unflushed(ws, analyst),
    ]
    for call in refused:
        with pytest.raises(PermissionDenied):
            call()
    # nothing was written by the refused calls
    assert ws.conn.execute("SELECT COUNT(*) FROM review_items").fetchone()[0] == 0
    assert ws.conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 0
    assert not (tmp_path / "a.jsonl").exists()
    # and the right roles pass
    item_id = review.enqueue(ws, service, _request())
    assert review.claim(ws, reviewer).id == item_id
    assert review.decide(ws, reviewer, item_id, "approve").decision == "approve"


def test_multi_user_mode_reads_the_users_table_again(ws, team):
    rex = users.authenticate(ws, "rex", PASSWORD + "rex")
    item_id = review.enqueue(ws, Actor.service(), _request())
    assert review.claim(ws, rex).id == item_id
    review.release(ws, rex, item_id)
    with pytest.raises(PermissionDenied, match="retired"):
        review.claim(ws, LOCAL_ADMIN)
    with pytest.raises(PermissionDenied, match="not a user"):
        review.claim(ws, Actor("mallory", "reviewer"))
    with pytest.raises(PermissionDenied, match="not a user"):
        users.list_users(ws, Actor("mallory", "admin"))
    users.set_role(ws, team, "rex", "analyst")  # demoted after signing in
    with pytest.raises(PermissionDenied, match="analyst.*may not review"):
        review.claim(ws, rex)
    users.set_role(ws, team, "rex", "reviewer")
    users.disable_user(ws, team, "rex")
    with pytest.raises(PermissionDenied, match="disabled"):
        review.claim(ws, rex)
    assert review.stats(ws).claimed == 0


def test_four_eyes():
    abe, amy = Actor("abe", "approver"), Actor("amy", "approver")
    with pytest.raises(PermissionDenied, match="four-eyes.*trained"):
        users.check_four_eyes(abe, created_by="ann", trained_by="abe")
    with pytest.raises(PermissionDenied, match="four-eyes.*exported"):
        users.check_four_eyes(abe, created_by="ABE", trained_by=None)
    users.check_four_eyes(amy, created_by="ann", trained_by="abe")
    users.check_four_eyes(Actor("ada", "admin"), created_by="ann", trained_by=None)
    with pytest.raises(PermissionDenied, match="four-eyes"):
        users.check_four_eyes(LOCAL_ADMIN, created_by="local", trained_by="local")
    with pytest.raises(PermissionDenied, match="may not approve"):
        users.check_four_eyes(Actor("rex", "reviewer"), created_by="ann", trained_by="ann")


# --------------------------------------------------------------------------- OIDC
def test_oidc_identity_maps_to_a_workspace_user(ws, team):
    with pytest.raises(PermissionDenied):
        users.oidc_user(ws, {"email": "x@example.com"})
    users.add_user(ws, team, "olga", "reviewer", email="Olga@Example.com")
    users.add_user(ws, team, "otto", "approver", oidc_sub="google|123")
    assert users.oidc_user(ws, {"email": "olga@example.com", "sub": "s-9",
                                "email_verified": True}) == Actor(
        "olga", "reviewer", "user", "olga@example.com")
    assert users.oidc_user(ws, {"sub": "google|123", "email": "other@x.org"}).name == "otto"
    with pytest.raises(PermissionDenied, match="not a user"):
        users.oidc_user(ws, {"email": "stranger@example.com", "email_verified": True})
    with pytest.raises(PermissionDenied, match="unknown user or wrong password"):
        users.authenticate(ws, "olga", "")  # an SSO-only user has no password
    users.disable_user(ws, team, "olga")
    with pytest.raises(PermissionDenied, match="disabled"):
        users.oidc_user(ws, {"email": "olga@example.com", "email_verified": True})


def test_oidc_in_embedded_mode_is_refused(ws):
    with pytest.raises(PermissionDenied, match="embedded"):
        users.oidc_user(ws, {"email": "a@b.c"})


# --------------------------------------------------------------------------- CLI
def test_cli_users_add_and_list(tmp_path, monkeypatch):
    monkeypatch.delenv("RWB_PASSWORD", raising=False)
    monkeypatch.delenv("RWB_USER", raising=False)
    wsdir = str(tmp_path / "cli")
    runner = CliRunner()
    r = runner.invoke(root, ["-w", wsdir, "users", "add", "ada", "--role", "admin",
                             "--password-stdin"], input=PASSWORD + "\n")
    assert r.exit_code == 0, r.output
    # multi-user now: the acting admin signs in (password from stdin), the new user's
    # password from stdin needs RWB_PASSWORD for the admin
    r = runner.invoke(root, ["-w", wsdir, "users", "add", "rex", "--role", "reviewer",
                             "--password-stdin", "--as", "ada"], input="rex password\n",
                      env={"RWB_PASSWORD": PASSWORD})
    assert r.exit_code == 0, r.output
    r = runner.invoke(root, ["-w", wsdir, "users", "list", "--json", "--as", "ada"],
                      input=PASSWORD + "\n")
    assert r.exit_code == 0, r.output
    assert '"multi_user": true' in r.output and '"rex"' in r.output
    assert "password_hash" not in r.output and "scrypt" not in r.output
    # an admin resets rex's password; --json says so as one object
    r = runner.invoke(root, ["-w", wsdir, "users", "passwd", "rex", "--password-stdin", "--as", "ada", "--json"],
                      input="rex has a new one\n", env={"RWB_PASSWORD": PASSWORD})
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1]) == {"user": "rex", "password_changed": True}
    r = runner.invoke(root, ["-w", wsdir, "users", "passwd", "rex", "--password-stdin", "--as", "ada"],
                      input="rex password\n", env={"RWB_PASSWORD": PASSWORD})
    assert r.exit_code == 0 and "password of rex changed" in r.output, r.output
    # wrong role and wrong password are refused with the exit code of PermissionDenied
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("rex password\n"))
    assert main(["-w", wsdir, "users", "list", "--as", "rex"]) == PermissionDenied.exit_code
    monkeypatch.setenv("RWB_PASSWORD", "wrong password!")
    assert main(["-w", wsdir, "users", "list", "--as", "ada"]) == PermissionDenied.exit_code
    con = sqlite3.connect(f"{wsdir}/workbench.db")
    assert {r[0] for r in con.execute("SELECT name FROM users")} == {"ada", "rex"}
