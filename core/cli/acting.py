"""Who acts in a CLI call: ``--as NAME`` plus a password, or the local admin.

Shared by the command areas that change something (review, users, audit, …).  In
embedded mode (no users in the workspace) every command runs as the local admin
and ``--as`` is not needed.  In multi-user mode ``--as NAME`` (or ``RWB_USER``)
names the user and the password comes from ``RWB_PASSWORD`` or, when that is not
set, from the first line of stdin (a hidden prompt on a terminal).
"""

from __future__ import annotations

import getpass
import os
import sys
from typing import TYPE_CHECKING, Optional

import typer

from core.base.errors import InputError

if TYPE_CHECKING:
    from core.access.users import Actor

AS_HELP = ("Act as this workspace user (multi-user mode); the password comes from "
           "RWB_PASSWORD or stdin.  Not needed in a workspace without users.")


def as_option() -> Optional[str]:
    """The ``--as`` option (default from ``RWB_USER``)."""
    return typer.Option(None, "--as", envvar="RWB_USER", help=AS_HELP)


def read_secret(prompt: str) -> str:
    """One secret: a hidden prompt on a terminal, else the first line of stdin."""
    if sys.stdin is not None and sys.stdin.isatty():
        return getpass.getpass(prompt)
    line = sys.stdin.readline() if sys.stdin is not None else ""
    if not line:
        raise InputError(f"{prompt.rstrip(': ')}: nothing on stdin")
    return line.rstrip("\r\n")


def acting_user(ws, as_name: Optional[str], *, stdin_free: bool = True) -> Actor:
    """The actor of this CLI call (see the module docstring).

    ``stdin_free=False`` when the command itself reads stdin (e.g. a new password): the
    acting user's password must then come from ``RWB_PASSWORD``."""
    from core.access.users import multi_user, resolve_actor  # deferred: keeps rwb --help fast

    if not multi_user(ws):
        return resolve_actor(ws, as_name, None)
    password = os.environ.get("RWB_PASSWORD")
    if as_name and password is None:
        if not stdin_free:
            raise InputError("this command reads stdin; give the acting user's password in "
                             "RWB_PASSWORD")
        password = read_secret(f"Password for {as_name}: ")
    return resolve_actor(ws, as_name, password)
