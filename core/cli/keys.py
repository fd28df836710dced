"""``rwb keys``: the workspace's bundle-signing key and the keys it trusts (``core.access.keys``).

``show`` prints the signing key's fingerprint and public key (give the PEM to another
workspace so it can ``trust`` your bundles); ``rotate`` replaces the signing key (the old
public key stays trusted until ``untrust``); ``trust FILE`` / ``untrust FINGERPRINT``
edit the trust store.  The private key never leaves ``<workspace>/keys/signing.key``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

app = typer.Typer(help="Bundle-signing key: show, rotate, trust another workspace's key, untrust.",
                  no_args_is_help=True)


def _print_info(info: Any) -> None:
    typer.echo(f"signing key {info.fingerprint} (ed25519), private key at {info.private_key_path}")
    typer.echo(info.public_key_pem.rstrip())
    typer.echo("trusted: " + ", ".join(f"{t['fingerprint']}{' (this workspace)' if t['own'] else ''}"
                                       for t in info.trusted))


@app.command("show")
def show(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Print the signing key's fingerprint and public key (PEM), and the trusted keys."""
    from core.access import keys  # deferred: keeps rwb --help fast

    info = keys.show(open_workspace())
    if as_json:
        print_json(info.to_dict())
    else:
        _print_info(info)


@app.command("rotate")
def rotate(as_name: Optional[str] = as_option(),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Make a new signing key; bundles signed with the old one still verify until you untrust it."""
    from core.access import keys  # deferred: keeps rwb --help fast

    ws = open_workspace()
    info = keys.rotate(ws, acting_user(ws, as_name))
    if as_json:
        print_json(info.to_dict())
    else:
        _print_info(info)


@app.command("trust")
def trust(file: Path = typer.Argument(..., help="The signer's public key (PEM, as `rwb keys show` prints it)."),
          as_name: Optional[str] = as_option(),
          as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Trust bundles signed by the key in FILE (compare its fingerprint with the signer's first)."""
    from core.access import keys  # deferred: keeps rwb --help fast

    ws = open_workspace()
    fp = keys.trust(ws, acting_user(ws, as_name), file)
    if as_json:
        print_json({"trusted": fp})
    else:
        typer.echo(f"trusted key {fp}")


@app.command("untrust")
def untrust(fingerprint: str = typer.Argument(..., help="Fingerprint of the key (16 hex digits)."),
            as_name: Optional[str] = as_option(),
            as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Stop trusting a key: bundles it signed no longer verify, register or serve here."""
    from core.access import keys  # deferred: keeps rwb --help fast

    ws = open_workspace()
    fp = keys.untrust(ws, acting_user(ws, as_name), fingerprint)
    if as_json:
        print_json({"untrusted": fp})
    else:
        typer.echo(f"no longer trusted: key {fp}")
