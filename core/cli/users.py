"""``rwb users``: add and list workspace users (multi-user mode), change roles.

The first user added must be an admin; from then on every command needs
``--as NAME`` and a password (see ``core.access.users`` for roles, permissions and the
password policy).  Failed sign-ins back off per user name: one user's typos never lock
out another.
"""

from __future__ import annotations

from typing import Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option, read_secret

app = typer.Typer(help="Workspace users and their roles (analyst, reviewer, approver, admin).",
                  no_args_is_help=True)


@app.command("add")
def add(
    name: str = typer.Argument(..., help="User name (lower-case)."),
    role: str = typer.Option(..., "--role", help="analyst, reviewer, approver or admin."),
    password_stdin: bool = typer.Option(
        False, "--password-stdin", help="Read the new user's password from stdin's first line."),
    email: Optional[str] = typer.Option(None, "--email",
                                        help="E-mail for single sign-on (OIDC)."),
    oidc_sub: Optional[str] = typer.Option(None, "--oidc-sub",
                                           help="OIDC subject for single sign-on."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Add a user.  Without --password-stdin and without --email/--oidc-sub you are asked
    for the password: at least 12 characters, and not a common password."""
    from core.access import users  # deferred: keeps rwb --help fast

    ws = open_workspace()
    actor = acting_user(ws, as_name, stdin_free=not password_stdin)
    password = None
    if password_stdin:
        password = read_secret("New password: ")
    elif not (email or oidc_sub):
        password = typer.prompt(f"Password for {name}", hide_input=True,
                                confirmation_prompt=True)
    user = users.add_user(ws, actor, name, role, password=password, email=email,
                          oidc_sub=oidc_sub)
    if as_json:
        print_json(user.to_dict())
    else:
        typer.echo(f"added {user.name} ({user.role})")


@app.command("list")
def list_(
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List users and their roles."""
    from core.access import users  # deferred: keeps rwb --help fast

    ws = open_workspace()
    rows = users.list_users(ws, acting_user(ws, as_name))
    if as_json:
        print_json({"multi_user": users.multi_user(ws), "users": rows})
        return
    if not rows:
        typer.echo("no users: embedded mode (everyone is the local admin); "
                   "add the first admin with `rwb users add NAME --role admin`")
    for u in rows:
        flags = " (disabled)" if u.disabled else ""
        typer.echo(f"{u.name:<24} {u.role:<9} {u.email or '-':<28}{flags}")


@app.command("set-role")
def set_role(
    name: str = typer.Argument(..., help="User name."),
    role: str = typer.Argument(..., help="analyst, reviewer, approver or admin."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Change a user's role."""
    from core.access import users  # deferred: keeps rwb --help fast

    ws = open_workspace()
    user = users.set_role(ws, acting_user(ws, as_name), name, role)
    print_json(user.to_dict()) if as_json else typer.echo(f"{user.name} is now {user.role}")


@app.command("disable")
def disable(
    name: str = typer.Argument(..., help="User name."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Disable a user (their name stays on past decisions)."""
    from core.access import users  # deferred: keeps rwb --help fast

    ws = open_workspace()
    user = users.disable_user(ws, acting_user(ws, as_name), name)
    print_json(user.to_dict()) if as_json else typer.echo(f"{user.name} is disabled")


@app.command("passwd")
def passwd(
    name: str = typer.Argument(..., help="User name."),
    password_stdin: bool = typer.Option(
        False, "--password-stdin", help="Read the new password from stdin's first line."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Set a user's password (your own, or anyone's as an admin): at least 12 characters,
    and not a common password."""
    from core.access import users  # deferred: keeps rwb --help fast

    ws = open_workspace()
    actor = acting_user(ws, as_name, stdin_free=not password_stdin)
    password = (read_secret("New password: ") if password_stdin else
                 typer.prompt(f"New password for {name}", hide_input=True,
                              confirmation_prompt=True))
    users.set_password(ws, actor, name, password)
    if as_json:
        print_json({"user": name, "password_changed": True})
    else:
        typer.echo(f"password of {name} changed")
