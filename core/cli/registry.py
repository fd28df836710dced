"""``rwb registry``: policy versions, four-eyes approval, promotion and rollback (``core.govern.registry``).

Stages: register → candidate → approve → approved → promote → production; ``rollback``
returns production to the previous version.  Every transition is an append-only event.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from core.base.errors import ConflictError
from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

if TYPE_CHECKING:  # pragma: no cover
    from core.govern.registry import PolicyVersion, PolicyVersionDetail

app = typer.Typer(help="Policy registry: list, register, approve, promote (see where: target), roll back, publish "
                       "the index, history.",
                  no_args_is_help=True)


#: Where promote, rollback and publish-index write.
_ROOT_OPTION = typer.Option(None, "--root", help="The policies folder (default: $RWB_POLICIES_DIR or core/policies).")


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def _line(v: "PolicyVersion") -> str:
    approvals = ", ".join(a.by for a in v.approvals) or "-"
    return (f"{v.name:<20} {v.version:<10} {v.stage:<12} return {_fmt(v.return_mean):<8} "
            f"expert {_fmt(v.expert_return):<8} run {v.run_id or '-':<26} by {v.created_by:<10} "
            f"approved by {approvals}")


def _without_manifest(v: "PolicyVersionDetail") -> dict[str, Any]:
    """A version's fields, in order, less its manifest (too long for a line of output)."""
    return {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name != "manifest"}


@app.command("list")
def list_versions(
    name: Optional[str] = typer.Argument(None, help="Only this policy name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List registered versions with their stage, held-out return and approvals."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    versions = registry.list_versions(ws, name)
    if as_json:
        print_json({"versions": versions,
                    "aliases": {n: registry.aliases(ws, n) for n in sorted({v.name for v in versions})}})
        return
    if not versions:
        typer.echo("no registered policies: `rwb bundle export RUN --out F.zip`, then `rwb registry register F.zip`")
    for v in versions:
        typer.echo(_line(v))


@app.command("register")
def register(
    file: Path = typer.Argument(..., help="Bundle zip to register as a candidate."),
    comment: str = typer.Option("", "--comment", "-m", help="Why (kept with the event)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Verify a bundle and register it as a candidate version."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    v = registry.register(ws, acting_user(ws, as_name), file, comment=comment)
    if as_json:
        print_json(_without_manifest(v))
        return
    typer.echo(("already registered: " if v.already_registered else "registered: ") + _line(v))


@app.command("gate")
def gate(
    name: str = typer.Argument(..., help="Policy name."),
    version: str = typer.Argument(..., help="Version to check."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Run the promotion gate without approving: does VERSION beat its baseline on held-out episodes?

    Exits non-zero when it does not."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    result = registry.promotion_gate(open_workspace(), name, version)
    if as_json:
        print_json(result)
    elif result.passed:
        typer.echo("passes: " + result.reason)
    if not result.passed:  # the CLI prints it and exits non-zero
        raise registry.GateFailed(f"promotion gate: {result.reason}")


@app.command("approve")
def approve(
    name: str = typer.Argument(..., help="Policy name."),
    version: str = typer.Argument(..., help="Version to approve."),
    comment: str = typer.Option(..., "--comment", "-m", help="Why you approve (required)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Approve a candidate (approver role, four-eyes, promotion gate)."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    v = registry.approve(ws, acting_user(ws, as_name), name, version, comment)
    if as_json:
        print_json(_without_manifest(v))
        return
    typer.echo("approved: " + _line(v))


@app.command("promote")
def promote(
    name: str = typer.Argument(..., help="Policy name."),
    version: str = typer.Argument(..., help="Approved version to put in production."),
    comment: str = typer.Option("", "--comment", "-m", help="Why (kept with the event)."),
    root: Optional[Path] = _ROOT_OPTION,
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write an approved version into the policies folder (core/policies/NAME/) and make it active.

    Refused, with the reason, when that folder cannot be written (`rwb registry target`)."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    entry = registry.promote(ws, acting_user(ws, as_name), name, version, comment, root=root)
    if as_json:
        print_json(entry)
        return
    typer.echo(f"{name}: {entry.active} is in production (previous: {', '.join(entry.previous) or '-'})")


@app.command("target")
def target(
    root: Optional[Path] = _ROOT_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Where promote and rollback would write, and whether they can: exits non-zero when the
    policies folder cannot be written (promote would be refused)."""
    from core.govern.policy_folder import promotion_target  # deferred: keeps rwb --help fast

    found = promotion_target(root)
    if as_json:
        print_json(found)
    else:
        typer.echo(f"promote copies the approved bundle into {found.path}: the folder production loads from")
    if not found.writable:
        raise ConflictError(f"{found.path} cannot be written ({found.reason}): promote would be refused")


@app.command("rollback")
def rollback(
    name: str = typer.Argument(..., help="Policy name."),
    comment: str = typer.Option("", "--comment", "-m", help="Why (kept with the event)."),
    root: Optional[Path] = _ROOT_OPTION,
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Make the previous production version of NAME active again."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    entry = registry.rollback(ws, acting_user(ws, as_name), name, comment, root=root)
    if as_json:
        print_json(entry)
        return
    typer.echo(f"{name}: rolled back to {entry.active}")


@app.command("publish-index")
def publish_index(
    name: Optional[str] = typer.Argument(None, help="Only this policy name (default: every one in production)."),
    root: Optional[Path] = _ROOT_OPTION,
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write the policies folder's index entries again from the registry's records, signed.

    For an index that was edited, lost, or written unsigned: production serves only an
    index entry a trusted registry signed."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    entries = registry.publish_index(ws, acting_user(ws, as_name), name, root=root)
    if as_json:
        print_json({"entries": entries})
        return
    for e in entries:
        typer.echo(f"{e.name}: {e.active} is in production (index signed at registry event "
                   f"{(e.signed or {}).get('sequence')})")


@app.command("history")
def history(
    name: Optional[str] = typer.Argument(None, help="Only this policy name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every registry event, oldest first: who did what, when and why."""
    from core.govern import registry  # deferred: keeps rwb --help fast

    ws = open_workspace()
    events = registry.history(ws, name)
    unrecorded = {u.event.id: u.reason for u in registry.unrecorded_events(ws, name)}
    if as_json:
        print_json({"events": events, "unrecorded": [{"id": i, "reason": r} for i, r in unrecorded.items()]})
        return
    if not events:
        typer.echo("no registry events yet")
    for e in events:
        detail = {k: v for k, v in e.detail.items() if k in ("from", "bundle_sha256")}
        flag = f" [not the registry's record, counts for nothing: {unrecorded[e.id]}]" if e.id in unrecorded else ""
        typer.echo(f"{e.at} {e.name}@{e.version:<10} {e.event:<12} {e.actor} ({e.role})"
                   f"{': ' + e.comment if e.comment else ''}"
                   f"{' ' + json.dumps(detail) if detail else ''}{flag}")
