"""Users, roles and the permission table (DESIGN.md §1, §9).

Who may do what is decided here and checked inside every ``core`` function
that changes something; the app and the CLI only *reflect* it (they hide a
button the role cannot use, but the refusal itself comes from ``core``).

Two modes
---------
* **Embedded (default)**: the workspace has no users.  Everyone who can open
  the workspace is the one local admin (:data:`LOCAL_ADMIN`); there is no login.
  :func:`current_user` returns it.
* **Multi-user**: as soon as the workspace holds one user (``rwb users add``),
  the local admin is gone and every actor must sign in: with a password
  (:func:`authenticate`, scrypt with a per-user salt, constant-time compare) or
  through the app's OIDC login (:func:`oidc_user` maps the identity provider's
  ``sub``/e-mail to a workspace user).  The first user added must be an admin,
  so the workspace can never lock its owner out.

Roles and permissions
---------------------
==================  ==================================================  =========================
permission          what it allows                                      roles
==================  ==================================================  =========================
``import``          import episode files into a dataset                 analyst, admin
``edit_template``   create and edit reward templates, expectations      analyst, admin
``train``           launch training and weight tuning                   analyst, admin
``enqueue_review``  put high-risk steps on the review queue             analyst, admin, *service*
``review``          claim, release and decide review items              reviewer, admin
``export_bundle``   export a trained run as a policy bundle             analyst, admin
``approve``         approve a bundle for promotion (four-eyes applies)  approver, admin
``promote``         promote an approved bundle to production            approver, admin
``rollback``        roll production back to the previous version        approver, admin
``write_audit``     append audit records for served decisions           admin, *service*
``export_audit``    export the audit trail (records, served episodes)   analyst, approver, admin
``manage_users``    add users, change roles and passwords, disable      admin
==================  ==================================================  =========================

Reading (datasets, runs, the review queue, audit records) needs no permission:
whoever can open the workspace file can read it anyway.

*service* is not a role a person can hold: it is the principal of a process
that has no person behind it (the production decision engine).  Build one with
:meth:`Actor.service`; it holds only the machine permissions above.

**Four-eyes**: approving a bundle also needs a person other than the one who
trained the run and the one who exported the bundle (:func:`check_four_eyes`);
an admin is no exception, and neither is the embedded local admin (a one-person
workspace cannot approve its own policies: switch on multi-user mode).

An :class:`Actor` is a plain value passed explicitly to ``core`` functions, which
check it with :func:`authorize`: the role must hold the permission and, in
multi-user mode, the users table is read again (a user disabled or demoted since
signing in is refused at once; the retired local admin is refused).  An actor
is a statement of who acts, not a capability token: code running in the same
Python process can build any actor, so the checks protect against mistakes and
against people working through the app and the CLI, not against code that is
already trusted with the workspace file.

Example::

    >>> ws = Workspace.open("/tmp/ws-users")                       # doctest: +SKIP
    >>> current_user(ws)                                           # doctest: +SKIP
    Actor(name='local', role='admin', kind='local', email=None)
    >>> add_user(ws, current_user(ws), "ada", "admin", password="s3cret-pass")  # doctest: +SKIP
    >>> authenticate(ws, "ada", "s3cret-pass").role                # doctest: +SKIP
    'admin'
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.errors import ConflictError, InputError, PermissionDenied

if TYPE_CHECKING:  # pragma: no cover
    from core.store import Workspace

#: Roles a person can hold, least to most powerful.
ROLES: tuple[str, ...] = ("analyst", "reviewer", "approver", "admin")
#: The role of a non-human principal (the production decision engine).
SERVICE_ROLE = "service"

#: permission -> roles that hold it (the table in the module docstring).
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
}

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._@+-]{0,63}$")
#: scrypt cost: 16 MiB of memory and ~50 ms per hash; stored with each hash so it can grow later.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P, _SCRYPT_DKLEN = 2**14, 8, 1, 32
MIN_PASSWORD_CHARS = 8


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

    Raises :class:`~core.errors.PermissionDenied` naming who, what and which roles would do."""
    if not _is_actor(actor):
        raise PermissionDenied(f"no acting user given (got {type(actor).__name__}); "
                               "pass a core.users.Actor, e.g. current_user(ws)")
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
    workspace call this."""
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
    """scrypt hash with a fresh 16-byte salt: ``scrypt$n$r$p$salt_hex$hash_hex``."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R,
                            p=_SCRYPT_P, dklen=_SCRYPT_DKLEN)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    """Constant-time check of ``password`` against a :func:`hash_password` string."""
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


def _check_password_text(password: str) -> None:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_CHARS:
        raise InputError(f"a password needs at least {MIN_PASSWORD_CHARS} characters",
                         field="password")
    if password != password.strip():
        raise InputError("a password may not start or end with spaces", field="password")


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


def list_users(ws: "Workspace", actor: Actor) -> list[dict[str, Any]]:
    """All users (no password hashes), by name.  Needs ``manage_users``."""
    authorize(ws, actor, "manage_users")
    rows = ws.conn.execute(f"SELECT {_COLUMNS} FROM users ORDER BY name").fetchall()
    return [_row_user(r).to_dict() for r in rows]


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
        _check_password_text(password)
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
    return get_user(ws, user.name)


def set_password(ws: "Workspace", actor: Actor, name: str, password: str) -> None:
    """Set a user's password.  An admin may set anyone's; a user may set their own."""
    user = get_user(ws, name)
    if actor.name != user.name or actor.kind != "user":
        authorize(ws, actor, "manage_users")
    _check_password_text(password)
    hashed = hash_password(password)
    with ws.transaction() as conn:
        conn.execute("UPDATE users SET password_hash=? WHERE name=?", (hashed, user.name))


def disable_user(ws: "Workspace", actor: Actor, name: str) -> User:
    """Disable a user (kept for the record: their name stays on past decisions).
    Needs ``manage_users``; the last active admin cannot be disabled."""
    authorize(ws, actor, "manage_users")
    user = get_user(ws, name)
    with ws.transaction() as conn:
        if user.role == "admin" and _admins_left(conn, user.name) == 0:
            raise ConflictError(f"{user.name} is the last admin; make another admin first")
        conn.execute("UPDATE users SET disabled=1 WHERE name=?", (user.name,))
    return get_user(ws, user.name)


# --------------------------------------------------------------------------- signing in
_REFUSED = "unknown user or wrong password"


def authenticate(ws: "Workspace", name: str, password: str) -> Actor:
    """Sign in with a password; returns the user's :class:`Actor`.

    Unknown user, wrong password, disabled user and password-less (OIDC-only) user all
    raise :class:`PermissionDenied`; the first two with the same message and timing."""
    key = name.strip().lower() if isinstance(name, str) else ""
    row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE name=?", (key,)).fetchone()
    stored = row[4] if row is not None and row[4] is not None else _dummy_hash()
    ok = verify_password(password if isinstance(password, str) else "", stored)
    if row is None or row[4] is None or not ok:
        raise PermissionDenied(_REFUSED)
    user = _row_user(row)
    if user.disabled:
        raise PermissionDenied(f"user {user.name!r} is disabled; ask an admin")
    return user.actor()


def oidc_user(ws: "Workspace", identity: Mapping[str, Any]) -> Actor:
    """Map an OIDC identity (e.g. Streamlit's ``st.user``) to a workspace user.

    Matches the identity's ``sub`` against users' ``oidc_sub`` first, then its ``email``
    against users' e-mail (only when the provider did not mark it unverified).  Unknown
    identities are refused: an admin must add them (``rwb users add NAME --role R
    --email E``)."""
    if not multi_user(ws):
        raise PermissionDenied("this workspace has no users (embedded mode): single sign-on "
                               "maps identities to workspace users; add users first")
    sub = identity.get("sub")
    email = identity.get("email")
    row = None
    if sub:
        row = ws.conn.execute(f"SELECT {_COLUMNS} FROM users WHERE oidc_sub=?",
                              (str(sub),)).fetchone()
    if row is None and email and identity.get("email_verified", True) is not False:
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
    must then be None or ``"local"``), else the user ``name`` signed in with ``password``."""
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
