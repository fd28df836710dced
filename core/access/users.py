"""Users, roles and the permission table (docs/design.md §1, §9).

Who may do what is decided here and checked inside every ``core`` function that changes
something (:func:`authorize`, with the :data:`ACTIONS` table); the app and the CLI only reflect it.
A workspace without users has one local admin (:data:`LOCAL_ADMIN`, :func:`current_user`); one
with users needs a sign-in (:func:`authenticate`, :func:`oidc_user`, :func:`sign_in`) with
back-off after failures (:class:`SignInThrottled`), server-side sessions
(:func:`session_actor`) and a signed session cookie (:func:`session_cookie`).  Users are
managed with :func:`add_user`, :func:`set_role`, :func:`set_password` and :func:`disable_user`;
:func:`check_four_eyes` enforces four-eyes approval.  An :class:`Actor` states who acts; it is
not a capability token.

Details: docs/security.md (## Embedded and multi-user workspaces, ## Permissions, ## Four-eyes,
## Roles, ## Sign-in).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import argon2

from core.access import security_log
from core.base.errors import ConflictError, InputError, PermissionDenied

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Roles a person can hold, least to most powerful.
ROLES: tuple[str, ...] = ("analyst", "reviewer", "approver", "admin")
#: The role of a non-human principal (the production decision engine).
SERVICE_ROLE = "service"

#: permission -> roles that hold it (the table in docs/security.md, ## Permissions).
PERMISSIONS: dict[str, frozenset[str]] = {
    "import": frozenset({"analyst", "admin"}),
    "edit_template": frozenset({"analyst", "admin"}),
    "train": frozenset({"analyst", "admin"}),
    "enqueue_review": frozenset({"analyst", "admin", SERVICE_ROLE}),
    "review": frozenset({"reviewer", "admin"}),
    "export_bundle": frozenset({"analyst", "admin"}),
    "approve": frozenset({"approver", "admin"}),
    "promote": frozenset({"approver", "admin"}),
    "rollback": frozenset({"approver", "admin"}),
    "write_audit": frozenset({"admin", SERVICE_ROLE}),
    "export_audit": frozenset({"analyst", "approver", "admin"}),
    "manage_users": frozenset({"admin"}),
    "label": frozenset({"analyst", "reviewer", "admin"}),
}

#: Every core function that changes the workspace -> the permission it checks first.
#: Functions that write on behalf of an action authorised earlier (a run's trainer
#: recording its metrics, a tuning run's heartbeat) and the seeding of an empty workspace
#: with the bundled samples (``core.data.importers.api.seed_file``) take no actor.
ACTIONS: dict[str, str] = {
    "core.data.importers.api.import_file": "import",
    "core.data.episode_views.import_upload": "import",
    "core.data.datasets.archive_dataset": "import",
    "core.data.datasets.restore_dataset": "import",
    "core.data.datasets.delete_dataset": "import",
    "core.rl.runs.resume_run": "train",
    "core.rewards.versions.save_template": "edit_template",
    "core.tuning.apply.apply_study": "edit_template",
    "core.tuning.preferences.add_preference": "edit_template",
    "core.rewards.labels.add_label": "label",
    "core.data.task_criteria.import_criteria": "import",
    "core.tuning.studies.tune": "train",
    "core.tuning.workers.launch_tuning": "train",
    "core.tuning.workers.stop_tuning": "train",
    "core.rl.runs.create_run": "train",
    "core.rl.runs.train": "train",
    "core.rl.runs.launch_run": "train",
    "core.rl.runs.stop_run": "train",
    "core.guard.review.enqueue": "enqueue_review",
    "core.guard.review.enqueue_many": "enqueue_review",
    "core.guard.review.reserve_item_ids": "enqueue_review",
    "core.guard.review.send_step": "enqueue_review",
    "core.guard.review.claim": "review",
    "core.guard.review.release": "review",
    "core.guard.review.decide": "review",
    "core.govern.bundle.export_bundle": "export_bundle",
    "core.govern.registry.register": "export_bundle",
    "core.govern.registry.approve": "approve",
    "core.govern.registry.promote": "promote",
    "core.govern.registry.rollback": "rollback",
    "core.govern.registry.publish_index": "promote",
    "core.access.audit.AuditWriter": "write_audit",
    "core.access.audit.write_record": "write_audit",
    "core.access.audit.recover_unflushed": "write_audit",
    "core.access.audit.export": "export_audit",
    "core.access.users.list_users": "manage_users",
    "core.access.users.add_user": "manage_users",
    "core.access.users.set_role": "manage_users",
    "core.access.users.set_password": "manage_users",
    "core.access.users.disable_user": "manage_users",
    "core.access.keys.rotate": "manage_users",
    "core.access.keys.trust": "manage_users",
    "core.access.keys.untrust": "manage_users",
}

#: Words used in refusals ("… may not <verb>").
_VERBS: dict[str, str] = {
    "import": "import data",
    "edit_template": "edit reward templates",
    "train": "train policies",
    "enqueue_review": "put items on the review queue",
    "review": "review queue items",
    "export_bundle": "export policy bundles",
    "approve": "approve policies",
    "promote": "promote policies",
    "rollback": "roll back policies",
    "write_audit": "write audit records",
    "export_audit": "export the audit trail",
    "manage_users": "manage users",
    "label": "label episode outcomes",
}

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._@+-]{0,63}$")
#: argon2id at the OWASP password-storage parameters (19 MiB, 2 passes, 1 lane); the
#: parameters are stored in each hash, and a hash made with others is re-hashed on sign-in.
_ARGON2 = argon2.PasswordHasher(time_cost=2, memory_cost=19 * 1024, parallelism=1, hash_len=32,
                                salt_len=16, type=argon2.Type.ID)
#: The password policy (:func:`password_problem`): at least this many characters …
MIN_PASSWORD_CHARS = 12
#: … and not a common password: not in zxcvbn's frequency list of the 30,000 passwords
#: seen most often in breaches, case ignored, nor one of them with digits, spaces or
#: punctuation added before or after it (``Password2024!``).
PASSWORD_POLICY = (f"a password needs at least {MIN_PASSWORD_CHARS} characters and must not be "
                   "a common password (nor a common one with digits or symbols added); a few "
                   "unrelated words make a long password that is easy to remember")

#: Failures in a row (each less than BACKOFF_WINDOW_S after the one before) that are free.
BACKOFF_FREE_FAILURES = 5
#: Seconds between failures that still chain them into one run of failures.
BACKOFF_WINDOW_S = 15 * 60.0
#: The wait after BACKOFF_FREE_FAILURES failures; it doubles with each further failure …
BACKOFF_BASE_S = 30.0
#: … up to this many seconds.
BACKOFF_CAP_S = 15 * 60.0
#: Failures older than this are deleted when a new one is recorded.
_FAILURE_MEMORY_S = 24 * 3600.0

#: A session ends after this many seconds without activity …
SESSION_IDLE_S = 8 * 3600.0
#: … and this many seconds after sign-in, whatever the activity.
SESSION_MAX_S = 7 * 24 * 3600.0
#: A session's last activity is written at most this often (not on every page rerun).
_SESSION_TOUCH_S = 60.0

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Actor:
    """Who performs an action: a workspace user, the local admin, or a service."""

    name: str
    role: str
    #: "user" (a row of the users table), "local" (embedded mode) or "service".
    kind: str = "user"
    email: str | None = None

    @classmethod
    def service(cls, name: str = "decision-engine") -> "Actor":
        """A non-human principal (e.g. the production decision engine)."""
        return cls(name=f"service:{name}", role=SERVICE_ROLE, kind="service")

    def can(self, permission: str) -> bool:
        """Whether this actor's role holds ``permission`` (for the UI to show or hide buttons)."""
        if permission not in PERMISSIONS:
            raise KeyError(f"unknown permission {permission!r}; known: {', '.join(PERMISSIONS)}")
        return self.role in PERMISSIONS[permission]

    def __str__(self) -> str:
        return f"{self.name} ({self.role})"


#: The one user of a workspace in embedded mode (no users table rows, no login).
LOCAL_ADMIN = Actor(name="local", role="admin", kind="local")


@dataclass(frozen=True)
class User:
    """A row of the users table, without its password hash."""

    name: str
    role: str
    email: str | None
    oidc_sub: str | None
    has_password: bool
    disabled: bool
    created_at: str
    created_by: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "email": self.email,
                "oidc_sub": self.oidc_sub, "has_password": self.has_password,
                "disabled": self.disabled, "created_at": self.created_at,
                "created_by": self.created_by}

    def actor(self) -> Actor:
        return Actor(name=self.name, role=self.role, kind="user", email=self.email)


# --------------------------------------------------------------------------- checks
def _is_actor(actor: Any) -> bool:
    return isinstance(actor, Actor)


def require_role(actor: Actor, *roles: str, action: str | None = None) -> Actor:
    """Refuse unless ``actor`` holds one of ``roles``; returns the actor.

    Raises :class:`~core.base.errors.PermissionDenied` naming who, what and which roles would do."""
    if not _is_actor(actor):
        raise PermissionDenied(f"no acting user given (got {type(actor).__name__}); "
                               "pass a core.access.users.Actor, e.g. current_user(ws)")
    if actor.role not in roles:
        what = action or "do this"
        raise PermissionDenied(f"{actor} may not {what}: it needs the role "
                               f"{' or '.join(sorted(roles))}")
    return actor


def require(actor: Actor, permission: str) -> Actor:
    """Refuse unless ``actor``'s role holds ``permission`` (see :data:`PERMISSIONS`)."""
    if permission not in PERMISSIONS:
        raise KeyError(f"unknown permission {permission!r}; known: {', '.join(PERMISSIONS)}")
    return require_role(actor, *PERMISSIONS[permission], action=_VERBS[permission])


def authorize(ws: "Workspace", actor: Actor, permission: str) -> Actor:
    """:func:`require` plus, in multi-user mode, a look at the users table: the local admin
    is retired, and a user must still exist, be enabled and hold the permission with the
    role the table gives it *now* (a disabled or demoted user is refused at once, even
    with an Actor obtained before).  Services need no row.  In embedded mode there is no
    table to check: the actor's stated role counts.  Core functions that change the
    workspace call this (:data:`ACTIONS`); every refusal is logged as a warning on the
    ``core.access.users`` logger (who, which permission, why)."""
    try:
        return _authorize(ws, actor, permission)
    except PermissionDenied as exc:
        _log.warning("permission refused: actor=%s permission=%s: %s", actor, permission, exc)
        raise


def _authorize(ws: "Workspace", actor: Actor, permission: str) -> Actor:
    require(actor, permission)
    if actor.kind == "service" or not multi_user(ws):
        return actor
    if actor.kind == "local":
        raise PermissionDenied("this workspace has users (multi-user mode): the local admin is "
                               "retired; sign in as a user")
    row = ws.conn.execute("SELECT role, disabled FROM users WHERE name=?",
                          (actor.name,)).fetchone()
    if row is None:
        raise PermissionDenied(f"{actor.name!r} is not a user of this workspace")
    if row[1]:
        raise PermissionDenied(f"user {actor.name!r} is disabled; ask an admin")
    if row[0] != actor.role:
        require(Actor(actor.name, row[0], actor.kind, actor.email), permission)
    return actor


def check_four_eyes(actor: Actor, created_by: str | None, trained_by: str | None) -> None:
    """Refuse when the approver is the person who exported (``created_by``) or trained
    (``trained_by``) what is being approved.  Names compare case-insensitively; a missing
    name (None) is no conflict.  Services never approve."""
    require(actor, "approve")
    me = actor.name.casefold()
    for who, did in ((created_by, "exported"), (trained_by, "trained")):
        if who is not None and who.casefold() == me:
            raise PermissionDenied(
                f"four-eyes rule: {actor.name} {did} this policy and may not approve it; "
                "another approver must")


# --------------------------------------------------------------------------- passwords
def hash_password(password: str) -> str:
    """argon2id hash with a fresh 16-byte salt, in the PHC string format
    (``$argon2id$v=19$m=19456,t=2,p=1$salt$hash``)."""
    return _ARGON2.hash(password)


def password_needs_rehash(stored: str) -> bool:
    """True for a hash that is not argon2id at today's parameters (an older scrypt hash)."""
    if not stored.startswith("$argon2id$"):
        return True
    try:
        return _ARGON2.check_needs_rehash(stored)
    except argon2.exceptions.InvalidHashError:
        return True


def verify_password(password: str, stored: str) -> bool:
    """Check ``password`` against a :func:`hash_password` string, or against an older
    ``scrypt$n$r$p$salt_hex$hash_hex`` one (both compare in constant time)."""
    if stored.startswith("$argon2"):
        try:
            return _ARGON2.verify(stored, password)
        except argon2.exceptions.VerificationError:  # wrong password or damaged hash
            return False
        except argon2.exceptions.InvalidHashError:
            return False
    try:
        scheme, n, r, p, salt_hex, digest_hex = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = bytes.fromhex(digest_hex)
        digest = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt_hex), n=int(n),
                                r=int(r), p=int(p), dklen=len(expected),
                                maxmem=128 * int(n) * int(r) * 2 + 1024 * 1024)
    except ValueError:
        return False
    return hmac.compare_digest(digest, expected)


# A hash of a random password, compared against when the user does not exist, so that
# "unknown user" and "wrong password" take the same time.
_DUMMY_HASH: str | None = None


def _dummy_hash() -> str:
    global _DUMMY_HASH
    if _DUMMY_HASH is None:
        _DUMMY_HASH = hash_password(secrets.token_hex(16))
    return _DUMMY_HASH


@functools.cache
def common_passwords() -> frozenset[str]:
    """The common-password list of :data:`PASSWORD_POLICY` (lower-case): the "passwords"
    frequency list shipped with zxcvbn (MIT licence), loaded on first use."""
    from zxcvbn.frequency_lists import FREQUENCY_LISTS  # type: ignore[import-untyped]  # 33 ms: only when needed

    return frozenset(word.lower() for word in FREQUENCY_LISTS["passwords"])


#: What is trimmed from both ends of a password before it is looked up a second time.
_PADDING = string.digits + string.punctuation + string.whitespace


def password_problem(password: Any) -> str | None:
    """Why ``password`` breaks :data:`PASSWORD_POLICY`, or None when it meets it.

    >>> password_problem("Password2024!").split(";")[0]
    'this password is a common password with digits or symbols added'
    >>> password_problem("ochre lantern dusk") is None
    True
    """
    if not isinstance(password, str):
        return "a password must be text"
    if len(password) < MIN_PASSWORD_CHARS:
        return (f"this password has {len(password)} characters; {PASSWORD_POLICY}")
    if password != password.strip():
        return "a password may not start or end with spaces"
    lowered = password.lower()
    common = common_passwords()
    if lowered in common:
        return f"this password is one of the most common passwords; {PASSWORD_POLICY}"
    if lowered.strip(_PADDING) in common:
        return (f"this password is a common password with digits or symbols added; "
                f"{PASSWORD_POLICY}")
    return None


def _check_password_text(ws: "Workspace", actor: Actor, name: str, password: str) -> None:
    """Refuse a new password that breaks the policy (:class:`InputError`, field
    ``password``) and write the refusal to the security log (who, for whom, why; never
    the password)."""
    problem = password_problem(password)
    if problem is None:
        return
    security_log.append(ws, "password_refused", actor=actor.name, role=actor.role,
                        detail={"user": name, "reason": problem.split(";")[0]})
    raise InputError(problem, field="password")


# --------------------------------------------------------------------------- users table
_COLUMNS = "name, role, email, oidc_sub, password_hash, disabled, created_at, created_by"


def _row_user(row: tuple[Any, ...]) -> User:
    return User(name=row[0], role=row[1], email=row[2], oidc_sub=row[3],
                has_password=row[4] is not None, disabled=bool(row[5]), created_at=row[6],
                created_by=row[7])


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def normalize_name(name: str) -> str:
    """User names are lower-case: letters, digits and ``. _ @ + -``, at most 64 characters."""
    if not isinstance(name, str):
        raise InputError("a user name must be text", field="name")
    norm = name.strip().lower()
    if not _NAME_RE.match(norm):
        raise InputError(f"invalid user name {name!r}: use lower-case letters, digits and "
                         ". _ @ + - (at most 64 characters, starting with a letter or digit)",
                         field="name")
    if norm == LOCAL_ADMIN.name or norm.startswith("service:"):
        raise InputError(f"the user name {norm!r} is reserved", field="name")
    return norm


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise InputError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}", field="role")
    return role


def multi_user(ws: "Workspace") -> bool:
    """True when the workspace has users (then everyone must sign in)."""
    return ws.conn.execute("SELECT 1 FROM users LIMIT 1").fetchone() is not None


def current_user(ws: "Workspace") -> Actor:
    """The acting user when nobody signs in: the local admin in embedded mode.

    In multi-user mode there is no implicit user: refuses with a message saying how to sign in."""
    if multi_user(ws):
        raise PermissionDenied(
            "this workspace has users (multi-user mode): sign in — in the CLI with "
            "--as NAME and the password in RWB_PASSWORD or on stdin")
    return LOCAL_ADMIN


def get_user(ws: "Workspace", name: str) -> User:
    """One user by name (InputError when unknown)."""
    row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE name=?",
                          (name.strip().lower(),)).fetchone()
    if row is None:
        raise InputError(f"no user named {name!r} in this workspace", field="name")
    return _row_user(row)


def list_users(ws: "Workspace", actor: Actor) -> list[User]:
    """All users (no password hashes), by name.  Needs ``manage_users``."""
    authorize(ws, actor, "manage_users")
    rows = ws.conn.execute(f"SELECT {_COLUMNS} FROM users ORDER BY name").fetchall()
    return [_row_user(r) for r in rows]


def add_user(ws: "Workspace", actor: Actor, name: str, role: str, *, password: str | None = None,
             email: str | None = None, oidc_sub: str | None = None) -> User:
    """Add a user.  Needs ``manage_users``.

    A user signs in with ``password`` or, without one, only through OIDC (then ``email``
    or ``oidc_sub`` is required).  The first user of a workspace must be an admin: adding
    it switches the workspace to multi-user mode and retires the local admin."""
    authorize(ws, actor, "manage_users")
    name = normalize_name(name)
    _check_role(role)
    if email is not None:
        email = email.strip().lower()
        if "@" not in email:
            raise InputError(f"invalid e-mail {email!r}", field="email")
    if password is None and not (email or oidc_sub):
        raise InputError("give a password, or an e-mail / OIDC subject for single sign-on",
                         field="password")
    hashed = None
    if password is not None:
        _check_password_text(ws, actor, name, password)
        hashed = hash_password(password)  # slow on purpose: outside the write lock
    with ws.transaction() as conn:
        n_users = conn.execute("SELECT COUNT(*) FROM users").fetchone()[0]
        if n_users == 0 and role != "admin":
            raise InputError("the first user of a workspace must be an admin (it replaces the "
                             "local admin; without one nobody could manage users)", field="role")
        if n_users > 0 and actor.kind == "local":
            raise PermissionDenied("this workspace is in multi-user mode; the local admin is "
                                   "retired — sign in as an admin")
        clash = conn.execute(
            "SELECT name FROM users WHERE name=? OR (email IS NOT NULL AND email=?) "
            "OR (oidc_sub IS NOT NULL AND oidc_sub=?)", (name, email, oidc_sub)).fetchone()
        if clash is not None:
            raise ConflictError(f"user {clash[0]!r} already has this name, e-mail or OIDC subject")
        conn.execute(
            f"INSERT INTO users({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
            (name, role, email, oidc_sub, hashed, 0, _now_iso(), actor.name))
    return get_user(ws, name)


def _admins_left(conn: Any, excluding: str) -> int:
    return conn.execute("SELECT COUNT(*) FROM users WHERE role='admin' AND disabled=0 AND name<>?",
                        (excluding,)).fetchone()[0]


def set_role(ws: "Workspace", actor: Actor, name: str, role: str) -> User:
    """Change a user's role.  Needs ``manage_users``; the last active admin keeps its role."""
    authorize(ws, actor, "manage_users")
    _check_role(role)
    user = get_user(ws, name)
    with ws.transaction() as conn:
        if user.role == "admin" and role != "admin" and _admins_left(conn, user.name) == 0:
            raise ConflictError(f"{user.name} is the last admin; make another admin first")
        conn.execute("UPDATE users SET role=? WHERE name=?", (role, user.name))
        if role != user.role:
            _end_sessions(conn, user.name, f"role changed from {user.role} to {role}")
    return get_user(ws, user.name)


def set_password(ws: "Workspace", actor: Actor, name: str, password: str) -> None:
    """Set a user's password.  An admin may set anyone's; a user may set their own."""
    user = get_user(ws, name)
    if actor.name != user.name or actor.kind != "user":
        authorize(ws, actor, "manage_users")
    _check_password_text(ws, actor, user.name, password)
    hashed = hash_password(password)
    with ws.transaction() as conn:
        conn.execute("UPDATE users SET password_hash=? WHERE name=?", (hashed, user.name))
        _end_sessions(conn, user.name, "password changed")


def disable_user(ws: "Workspace", actor: Actor, name: str) -> User:
    """Disable a user (kept for the record: their name stays on past decisions).
    Needs ``manage_users``; the last active admin cannot be disabled."""
    authorize(ws, actor, "manage_users")
    user = get_user(ws, name)
    with ws.transaction() as conn:
        if user.role == "admin" and _admins_left(conn, user.name) == 0:
            raise ConflictError(f"{user.name} is the last admin; make another admin first")
        conn.execute("UPDATE users SET disabled=1 WHERE name=?", (user.name,))
        _end_sessions(conn, user.name, "user disabled")
    return get_user(ws, user.name)


# --------------------------------------------------------------------------- signing in
_REFUSED = "unknown user or wrong password"
#: Where a sign-in comes from when the caller cannot tell (the CLI, a script, an app
#: behind a proxy that hides the client address): recorded, but not backed off as an
#: address, since everyone would share it; such sign-ins back off per user name.
LOCAL_ADDRESS = "local"


class SignInThrottled(PermissionDenied):
    """Too many failed sign-ins for a user name or from an address: the attempt was refused
    without looking at the password; ``wait_s`` is how long to wait before the next one."""

    def __init__(self, message: str, wait_s: float):
        super().__init__(message)
        self.wait_s = wait_s


def _span(seconds: float) -> str:
    """A duration for people: ``30 s``, ``4 min``, ``8 h``, ``7 days``."""
    s = math.ceil(seconds)
    if s < 120:
        return f"{s} s"
    if s < 2 * 3600:
        return f"{math.ceil(s / 60)} min"
    if s < 2 * 86400:
        return f"{s / 3600:g} h"
    return f"{s / 86400:g} days"


def backoff_wait(failure_times: list[float], now: float) -> float:
    """Seconds still to wait before the next sign-in attempt, given the times of recorded
    failures (of one user name, or from one address); 0 when an attempt may go ahead.

    Only the latest run of failures counts: walking back from the newest, a failure joins
    the run while it is less than :data:`BACKOFF_WINDOW_S` older than the one after it.
    A run of :data:`BACKOFF_FREE_FAILURES` imposes :data:`BACKOFF_BASE_S` after its last
    failure; each further failure doubles that, up to :data:`BACKOFF_CAP_S`.

    >>> backoff_wait([0.0, 1.0, 2.0, 3.0, 4.0], now=10.0)   # 5 failures: 30 s after t=4
    24.0
    """
    run, after = 0, None
    for at in sorted(failure_times, reverse=True):
        if after is not None and after - at >= BACKOFF_WINDOW_S:
            break
        run, after = run + 1, at
    if run < BACKOFF_FREE_FAILURES:
        return 0.0
    doublings = min(run - BACKOFF_FREE_FAILURES, 32)  # the cap is reached long before
    delay = min(BACKOFF_BASE_S * 2.0**doublings, BACKOFF_CAP_S)
    return max(0.0, max(failure_times) + delay - now)


def _clean_address(address: str | None) -> str:
    text = address.strip()[:200] if isinstance(address, str) else ""
    return text or LOCAL_ADDRESS


def _check_backoff(conn: Any, key: str, address: str, now: float) -> None:
    """Raise :class:`SignInThrottled` while ``key`` or ``address`` is backed off, counting
    the failures recorded in the workspace (attempts still being checked included).

    The address counts only when the caller knows it: :data:`LOCAL_ADDRESS` stands for
    "unknown" (every CLI call, an app behind a proxy that hides the client), and one
    shared key would let anyone's failures lock every user out.  There the back-off is
    per user name alone."""
    since = now - _FAILURE_MEMORY_S
    checks = [("user=? AND user_cleared=0", key, f"for the user name {key!r}")]
    if address != LOCAL_ADDRESS:
        checks.append(("address=?", address, "from this address"))
    for where, value, whose in checks:
        times = [r[0] for r in conn.execute(
            f"SELECT at FROM sign_in_failures WHERE {where} AND at>?", (value, since))]
        wait = backoff_wait(times, now)
        if wait > 0:
            raise SignInThrottled(f"too many failed sign-ins {whose}; wait {_span(wait)} and "
                                  "try again", wait_s=wait)


def _start_attempt(ws: "Workspace", key: str, address: str, now: float) -> int:
    """Check the back-off and record this attempt as a failure, in one write transaction
    (BEGIN IMMEDIATE), before any password is looked at; returns the failure row's id.

    Counting and recording under the write lock is what makes the limit hold against a
    race: of N attempts sent at once, each sees the ones before it as failures, so at most
    :data:`BACKOFF_FREE_FAILURES` reach the password check.  A success deletes the row
    again (:func:`authenticate`); a crash in between leaves it counted, as a failure.
    A refusal writes ``sign_in_throttled`` to the security log."""
    try:
        with ws.transaction() as conn:
            conn.execute("DELETE FROM sign_in_failures WHERE at<?", (now - _FAILURE_MEMORY_S,))
            _check_backoff(conn, key, address, now)
            attempt = conn.execute("INSERT INTO sign_in_failures(user, address, at) VALUES (?,?,?)",
                                   (key, address, now)).lastrowid
            if attempt is None:  # an INSERT into a rowid table always sets it
                raise RuntimeError("the sign-in attempt was not recorded")
            return attempt
    except SignInThrottled as exc:
        _log.warning("sign-in refused, backing off %.0f s: user=%r address=%r",
                     exc.wait_s, key, address)
        security_log.append(ws, "sign_in_throttled", actor=None, role=None,
                            detail={"user": key, "address": address, "wait_s": math.ceil(exc.wait_s),
                                    "reason": str(exc)})
        raise


def authenticate(ws: "Workspace", name: str, password: str, *, address: str | None = None,
                 now: float | None = None) -> Actor:
    """Sign in with a password; returns the user's :class:`Actor`.

    Unknown user, wrong password, disabled user and password-less (OIDC-only) user all
    raise :class:`PermissionDenied`; the first two with the same message and timing.
    Every attempt is first recorded as a failure with the user name, ``address`` (where
    the attempt comes from; :data:`LOCAL_ADDRESS` when unknown) and the time, in the same
    transaction that checks the back-off (:func:`_start_attempt`): while the name or a
    known address is backed off (:func:`backoff_wait`) the attempt is refused with
    :class:`SignInThrottled`, even with the right password, and parallel attempts cannot
    outrun the limit.  A success deletes its own failure row, clears the user's failures
    (not its address's) and re-hashes a password stored with an older scheme (scrypt) as
    argon2id.  ``now`` (POSIX seconds) is for tests; it defaults to the clock."""
    now = time.time() if now is None else now
    key = name.strip().lower() if isinstance(name, str) else ""
    address = _clean_address(address)
    attempt = _start_attempt(ws, key, address, now)
    row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE name=?", (key,)).fetchone()
    stored = row[4] if row is not None and row[4] is not None else _dummy_hash()
    password = password if isinstance(password, str) else ""
    ok = verify_password(password, stored)
    if row is None or row[4] is None or not ok:
        _log.warning("failed sign-in: user=%r address=%r", key, address)
        raise PermissionDenied(_REFUSED)  # the attempt's row stays: it was a failure
    user = _row_user(row)
    if user.disabled:
        with ws.transaction() as conn:  # the right password: not a failure to back off from
            conn.execute("DELETE FROM sign_in_failures WHERE id=?", (attempt,))
        raise PermissionDenied(f"user {user.name!r} is disabled; ask an admin")
    rehashed = hash_password(password) if password_needs_rehash(stored) else None
    with ws.transaction() as conn:
        conn.execute("DELETE FROM sign_in_failures WHERE id=?", (attempt,))
        conn.execute("UPDATE sign_in_failures SET user_cleared=1 WHERE user=?", (user.name,))
        if rehashed is not None:  # only if nobody changed the password meanwhile
            conn.execute("UPDATE users SET password_hash=? WHERE name=? AND password_hash=?",
                         (rehashed, user.name, stored))
    return user.actor()


def oidc_user(ws: "Workspace", identity: Mapping[str, Any]) -> Actor:
    """Map an OIDC identity (e.g. Streamlit's ``st.user``) to a workspace user.

    Matches the identity's ``sub`` against users' ``oidc_sub`` first, then its ``email``
    against users' e-mail, only when the provider vouches for the address
    (``email_verified`` is true; a missing claim is not).  Unknown identities are refused:
    an admin must add them (``rwb users add NAME --role R --email E`` or ``--oidc-sub S``)."""
    if not multi_user(ws):
        raise PermissionDenied("this workspace has no users (embedded mode): single sign-on "
                               "maps identities to workspace users; add users first")
    sub = identity.get("sub")
    email = identity.get("email")
    row = None
    if sub:
        row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE oidc_sub=?",
                              (str(sub),)).fetchone()
    verified = identity.get("email_verified") is True
    if row is None and email and not verified:
        raise PermissionDenied(
            f"{email}: the identity provider did not confirm this e-mail address "
            "(email_verified), so it cannot stand for a workspace user; ask an admin to add "
            f"you by your OIDC subject: `rwb users add NAME --role ROLE --oidc-sub {sub or 'SUB'}`")
    if row is None and email:
        row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE email=?",
                              (str(email).strip().lower(),)).fetchone()
    if row is None:
        who = email or sub or "this identity"
        raise PermissionDenied(f"{who} is not a user of this workspace; ask an admin to run "
                               f"`rwb users add NAME --role ROLE --email {email or 'E-MAIL'}`")
    user = _row_user(row)
    if user.disabled:
        raise PermissionDenied(f"user {user.name!r} is disabled; ask an admin")
    return user.actor()


def resolve_actor(ws: "Workspace", name: str | None, password: str | None) -> Actor:
    """The actor for a CLI call or a script: the local admin in embedded mode (``name``
    must then be None or ``"local"``), else the user ``name`` signed in with ``password``.

    A CLI call has no client address, so its failed sign-ins back off per user name only:
    five wrong passwords for one user do not lock out another (the admin included)."""
    if not multi_user(ws):
        if name not in (None, "", LOCAL_ADMIN.name):
            raise PermissionDenied(f"no user {name!r}: this workspace has no users (embedded "
                                   "mode, everyone is the local admin); drop --as")
        return LOCAL_ADMIN
    if not name:
        return current_user(ws)  # raises with the sign-in hint
    if password is None:
        raise PermissionDenied(f"a password is needed to act as {name!r} (RWB_PASSWORD or stdin)")
    return authenticate(ws, name, password)


# --------------------------------------------------------------------------- app sessions
@dataclass(frozen=True)
class Session:
    """A signed-in app session.  ``token`` is the secret the app keeps for it (the
    workspace stores only its SHA-256); :func:`session_actor` turns it back into the
    acting user while the session lasts."""

    token: str
    actor: Actor
    created_at: float


class SessionEnded(PermissionDenied):
    """The session expired or was ended (sign-out, password or role change): sign in again."""


def _token_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_session(ws: "Workspace", actor: Actor, *, address: str | None = None,
                 method: str = "password", now: float | None = None) -> Session:
    """Start a session for ``actor`` (a user who has just signed in by ``method``)."""
    now = time.time() if now is None else now
    token = secrets.token_urlsafe(32)
    with ws.transaction() as conn:
        conn.execute("INSERT INTO sessions(token_sha256, user, address, method, created_at, "
                     "last_seen) VALUES (?,?,?,?,?,?)",
                     (_token_key(token), actor.name, _clean_address(address), method, now, now))
    return Session(token=token, actor=actor, created_at=now)


def sign_in(ws: "Workspace", name: str, password: str, *, address: str | None = None,
            now: float | None = None) -> Session:
    """:func:`authenticate` (with its back-off) and, on success, a new session."""
    actor = authenticate(ws, name, password, address=address, now=now)
    return open_session(ws, actor, address=address, method="password", now=now)


def sso_sign_in(ws: "Workspace", identity: Mapping[str, Any], *, address: str | None = None,
                now: float | None = None) -> Session:
    """:func:`oidc_user` and, on success, a new session."""
    actor = oidc_user(ws, identity)
    return open_session(ws, actor, address=address, method="oidc", now=now)


def _end_sessions(conn: Any, user: str, why: str, now: float | None = None) -> None:
    """End every open session of ``user`` (inside the caller's transaction)."""
    conn.execute("UPDATE sessions SET ended_at=?, ended_why=? WHERE user=? AND ended_at IS NULL",
                 (time.time() if now is None else now, why, user))


def end_session(ws: "Workspace", token: str, *, why: str = "signed out",
                now: float | None = None) -> None:
    """End one session (sign-out); an unknown or already ended session is left as it is."""
    with ws.transaction() as conn:
        conn.execute("UPDATE sessions SET ended_at=?, ended_why=? WHERE token_sha256=? "
                     "AND ended_at IS NULL",
                     (time.time() if now is None else now, why, _token_key(token)))


def session_actor(ws: "Workspace", token: str, *, now: float | None = None,
                  touch: bool = True) -> Actor:
    """The acting user of a session, read from the users table now.

    Raises :class:`SessionEnded` (saying why) when the session is unknown or was ended,
    has seen no activity for :data:`SESSION_IDLE_S`, began more than
    :data:`SESSION_MAX_S` ago, or its user no longer exists or is disabled; an expired
    session is ended in the table.  Otherwise records the activity (at most every
    minute; not with ``touch=False``, for a look that is no activity of the user's, such
    as the app's periodic re-check of who acts) and returns the user's :class:`Actor`."""
    now = time.time() if now is None else now
    key = _token_key(token) if isinstance(token, str) else ""
    row = ws.conn.execute("SELECT user, created_at, last_seen, ended_at, ended_why FROM sessions "
                          "WHERE token_sha256=?", (key,)).fetchone()
    if row is None:
        raise SessionEnded("this session is not known to the workspace; sign in again")
    name, created_at, last_seen, ended_at, ended_why = row
    if ended_at is not None:
        raise SessionEnded(f"your session was ended ({ended_why}); sign in again")
    user_row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE name=?", (name,)).fetchone()
    why = None
    if now - created_at >= SESSION_MAX_S:
        why = f"expired {_span(SESSION_MAX_S)} after sign-in"
    elif now - last_seen >= SESSION_IDLE_S:
        why = f"expired after {_span(SESSION_IDLE_S)} without activity"
    elif user_row is None:
        why = "user removed"
    elif user_row[5]:
        why = "user disabled"
    if why is not None:
        end_session(ws, token, why=why, now=now)
        said = why if why.startswith("expired") else f"ended ({why})"
        raise SessionEnded(f"your session {said}; sign in again")
    if touch and now - last_seen >= _SESSION_TOUCH_S:
        with ws.transaction() as conn:
            conn.execute("UPDATE sessions SET last_seen=? WHERE token_sha256=?", (now, key))
    return _row_user(user_row).actor()


# --------------------------------------------------------------------------- session cookies
#: Where the key that signs session cookies lives, under the workspace (32 random bytes,
#: file mode 0600).  Deleting the file invalidates every cookie: everyone signs in again.
SESSION_COOKIE_KEY = ("keys", "session_cookie.key")
#: What a cookie's signature covers: this label, then ``token.expires``.
_COOKIE_LABEL = b"rwb-session-cookie/1\n"
_COOKIE_RE = re.compile(r"^([A-Za-z0-9_-]{20,128})\.([0-9]{1,12})\.([A-Za-z0-9_-]{43})$")


def _cookie_key(ws: "Workspace") -> bytes:
    """The workspace's cookie-signing key, made on first need.  Written to a private
    temporary file and linked into place, so that two processes making it at once
    agree on one key and nobody reads a half-written one."""
    path = ws.root.joinpath(*SESSION_COOKIE_KEY)
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            tmp.unlink()
        key = path.read_bytes()
    if len(key) != 32:
        raise PermissionDenied(f"{path} is not a session-cookie key (32 bytes); delete it "
                               "to make a new one (everyone then signs in again)")
    return key


def _cookie_signature(key: bytes, token: str, expires: int) -> str:
    mac = hmac.new(key, _COOKIE_LABEL + f"{token}.{expires}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def session_cookie(ws: "Workspace", session: Session) -> str:
    """The value of the browser cookie that carries ``session``: ``token.expires.signature``,
    where ``expires`` (POSIX seconds) is the session's absolute end (:data:`SESSION_MAX_S`
    after sign-in) and the signature an HMAC-SHA256 with the workspace's cookie key
    (:data:`SESSION_COOKIE_KEY`).  The token is the session's secret (the workspace keeps
    only its SHA-256), so the cookie must travel HTTP-only."""
    expires = int(session.created_at + SESSION_MAX_S)
    return f"{session.token}.{expires}.{_cookie_signature(_cookie_key(ws), session.token, expires)}"


def session_cookie_token(ws: "Workspace", value: str, *, now: float | None = None) -> str:
    """The session token a :func:`session_cookie` value carries, once its signature and
    expiry check out; :func:`session_actor` then checks the session itself.  Raises
    :class:`SessionEnded` for a damaged, forged or foreign cookie (signed with another
    workspace's key) and for one past its expiry."""
    now = time.time() if now is None else now
    match = _COOKIE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise SessionEnded("the session cookie is not one of this workspace's; sign in again")
    token, expires = match[1], int(match[2])
    expected = _cookie_signature(_cookie_key(ws), token, expires)
    if not hmac.compare_digest(expected, match[3]):
        raise SessionEnded("the session cookie is not one of this workspace's; sign in again")
    if now >= expires:
        raise SessionEnded(f"your session expired {_span(SESSION_MAX_S)} after sign-in; "
                           "sign in again")
    return token
