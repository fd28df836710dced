"""``rwb audit``: read and export the audit trail of served decisions (``core.access.audit``),
and the governance history of decisions people made in the workbench (``history``,
``core.govern.history``).

``export --as-episodes`` writes served episodes in the workbench's JSONL, ready
for ``rwb`` import, relabelling and training (S001's continuous-training loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option
from core.base.errors import InputError
from core.base.results import dumps

app = typer.Typer(help="The audit trail of served decisions (tail, export, stats, recover) and the governance "
                       "history of people's decisions (history).",
                  no_args_is_help=True)


@app.command("tail")
def tail(
    n: int = typer.Option(20, "-n", "--lines", help="How many records."),
    episode: Optional[str] = typer.Option(None, "--episode", help="Only this episode id."),
    policy: Optional[str] = typer.Option(None, "--policy", help="Only this policy version."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The last records, oldest first (one JSON record per line)."""
    from core.access import audit  # deferred: keeps rwb --help fast

    records = audit.tail(open_workspace(), n, episode_id=episode, policy_version=policy)
    if as_json:
        print_json({"records": records})
        return

    for r in records:
        typer.echo(dumps(r))


def _load_catalog(path: Path):
    from core.records.catalog import Catalog  # only when asked: the catalog decodes action tokens

    try:
        return Catalog.from_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read the catalog: {exc}", file=str(path)) from exc


@app.command("export")
def export(
    out: Path = typer.Argument(..., help="Output JSONL file."),
    as_episodes: bool = typer.Option(
        False, "--as-episodes", help="Write served episodes (rwb JSONL) instead of records."),
    episode: Optional[str] = typer.Option(None, "--episode", help="Only this episode id."),
    policy: Optional[str] = typer.Option(None, "--policy", help="Only this policy version."),
    since: Optional[str] = typer.Option(None, "--since", help="From this ISO time (UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="Before this ISO time (UTC)."),
    catalog: Optional[Path] = typer.Option(
        None, "--catalog", help="catalog.json decoding action tokens of records stored "
                                "without their action (and giving the header's tools)."),
    domain: Optional[str] = typer.Option(None, "--domain",
                                         help="Episode domain when requests name none."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Export records (or served episodes) to a JSONL file."""
    from core.access import audit  # deferred: keeps rwb --help fast

    ws = open_workspace()
    result = audit.export(ws, acting_user(ws, as_name), out, as_episodes=as_episodes,
                          episode_id=episode, policy_version=policy, since=since, until=until,
                          catalog=_load_catalog(catalog) if catalog else None, domain=domain)
    if as_json:
        print_json(result.to_dict())
    elif as_episodes:
        typer.echo(f"wrote {result.episodes} episodes ({result.records} decisions) to "
                   f"{result.path}")
    else:
        typer.echo(f"wrote {result.records} records to {result.path}")


@app.command("stats")
def stats(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """How many records and episodes, first and last time, records per policy version."""
    from core.access import audit  # deferred: keeps rwb --help fast

    s = audit.stats(open_workspace())
    if as_json:
        print_json(s)
        return
    typer.echo(f"{s.records} records, {s.episodes} episodes, {s.first or '-'} .. {s.last or '-'}")
    for version, count in s.per_policy_version.items():
        typer.echo(f"  {version:<32} {count}")


@app.command("recover")
def recover(
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Re-insert records a writer could not commit at exit (artifacts/audit_unflushed/)."""
    from core.access import audit  # deferred: keeps rwb --help fast

    ws = open_workspace()
    result = audit.recover_unflushed(ws, acting_user(ws, as_name))
    if as_json:
        print_json(result)
    else:
        typer.echo(f"{result['inserted']} records recovered from {result['files']} files "
                   f"({result['already']} already recorded, {result['conflicts']} conflicts)")


@app.command("history")
def history(
    kind: Optional[List[str]] = typer.Option(
        None, "--kind", help="Only this kind (repeatable): template_save, label, review, registration, approval, "
                             "promotion, rollback."),
    actor: Optional[str] = typer.Option(None, "--actor", help="Only what this person did."),
    subject: Optional[str] = typer.Option(None, "--subject", help="Only subjects containing this text."),
    since: Optional[str] = typer.Option(None, "--since", help="From this date or ISO time (UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="Before this date or ISO time (UTC)."),
    refused: bool = typer.Option(False, "--refused", help="Only refused decisions."),
    accepted: bool = typer.Option(False, "--accepted", help="Only accepted decisions."),
    limit: int = typer.Option(500, "--limit", help="At most this many, newest first."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Decisions people made in the workbench, newest first: template saves, outcome labels,
    review decisions, registrations, approvals, promotions and rollbacks, refused ones too."""
    from core.govern.history import governance_history  # deferred: keeps rwb --help fast

    if refused and accepted:
        raise InputError("give --refused or --accepted, not both", field="outcome")
    events = governance_history(open_workspace(), kinds=kind or None, who=actor, subject=subject, since=since,
                                until=until, outcome="refused" if refused else "accepted" if accepted else None,
                                limit=limit)
    if as_json:
        print_json({"events": events})
        return
    if not events:
        typer.echo("no decision matches")
    for e in events:
        who = f"{e.who or '-'}" + (f" ({e.role})" if e.role else "")
        why = f": {e.reason}" if e.reason else ""
        typer.echo(f"{e.when[:19].replace('T', ' ')}  {who:<22} {e.kind:<13} {e.subject}  "
                   f"{e.outcome.upper() if e.outcome == 'refused' else e.decision}{why}")
