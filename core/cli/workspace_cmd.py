"""``rwb workspace init|info``: create a workspace (with the sample datasets) and describe it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from core.cli import open_workspace, print_json

if TYPE_CHECKING:
    from core.workspace_setup import WorkspaceStatus

app = typer.Typer(help="Create and describe the workspace.", no_args_is_help=True)


def _print(status: WorkspaceStatus) -> None:
    typer.echo(f"Workspace {status.root} (schema version {status.schema_version})")
    for result in status.imported:
        typer.echo(f"  imported {result['episodes']} episodes, {result['steps']} steps "
                   f"into {result['dataset']}")
    if not status.datasets:
        typer.echo("  no datasets yet: import one with `rwb episodes import FILE`")
    for d in status.datasets:
        typer.echo(f"  {d.name:<24} {d.domain or '-':<12} {d.n_episodes:>7} episodes "
                   f"{d.n_steps:>8} steps")


@app.command("init")
def init(
    samples: bool = typer.Option(True, "--samples/--no-samples",
                                 help="Import the sample datasets when the workspace is empty."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Create (or migrate) the workspace and import the sample datasets into an empty one."""
    from core.workspace_setup import init_workspace

    status = init_workspace(open_workspace(), samples=samples)
    print_json(status.to_dict()) if as_json else _print(status)


@app.command("info")
def info(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Show the workspace folder, its schema version and its datasets."""
    from core.workspace_setup import workspace_status

    status = workspace_status(open_workspace())
    print_json(status.to_dict()) if as_json else _print(status)
