"""``rwb workspace init|info|prepare``: create a workspace (with the sample datasets), describe
it, and prepare its caches so that every page of the app opens at once."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from core.cli import open_workspace, print_json

if TYPE_CHECKING:
    from core.records.store import Workspace
    from core.sample.warmup import PrepareProgress, PrepareReport
    from core.sample.workspace_setup import WorkspaceStatus

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
    from core.sample.workspace_setup import init_workspace  # deferred: loads pandas

    status = init_workspace(open_workspace(), samples=samples)
    print_json(status.to_dict()) if as_json else _print(status)


@app.command("info")
def info(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Show the workspace folder, its schema version and its datasets."""
    from core.sample.workspace_setup import workspace_status  # deferred: loads pandas

    status = workspace_status(open_workspace())
    print_json(status.to_dict()) if as_json else _print(status)


class _ProgressLine:
    """Prints :class:`core.sample.warmup.PrepareProgress` on stderr: on a terminal one line that
    is rewritten as the work goes, elsewhere (a log file) one line per step (texts are
    embedded in chunks of a few hundred, so a log gets a few lines per dataset)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def __call__(self, event: "PrepareProgress") -> None:
        line = f"Preparing the workspace: {event.text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        else:
            typer.echo(line, err=True)
        self.last = line

    def close(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _print_prepared(report: "PrepareReport") -> None:
    for result in report.imported:
        typer.echo(f"  imported {result['episodes']} episodes, {result['steps']} steps "
                   f"into {result['dataset']}", err=True)
    for s in report.scorings:
        if s.error:
            typer.echo(f"  {s.dataset} with {s.template}: not scored: {s.error}", err=True)
        elif s.computed:
            typer.echo(f"  {s.dataset} with {s.template}: {len(s.computed)} components computed "
                       f"({s.embedded} texts embedded), {len(s.cached)} already there", err=True)
    what = "ready" if report.did_work else "already prepared"
    typer.echo(f"Workspace {report.root} {what} ({report.seconds:.1f} s).", err=True)


def prepare_with_progress(ws: "Workspace", datasets: list[str] | None = None) -> "PrepareReport":
    """:func:`core.sample.warmup.prepare_workspace` with its progress on stderr (``rwb app`` at start)."""
    from core.sample.warmup import prepare_workspace  # deferred: loads pandas and scipy

    line = _ProgressLine()
    try:
        report = prepare_workspace(ws, datasets=datasets, progress=line)
    finally:
        line.close()
    _print_prepared(report)
    return report


@app.command("prepare")
def prepare(
    dataset: list[str] = typer.Option(None, "--dataset",
                                      help="Prepare this dataset (repeatable; default: the sample "
                                           "datasets)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (no progress)."),
) -> None:
    """Set the workspace up and score its datasets with every reward template ahead, so that
    the app's pages open at once (what ``rwb app`` does before serving)."""
    from core.sample.warmup import prepare_workspace  # deferred: loads pandas and scipy

    ws = open_workspace()
    datasets = list(dataset) if dataset else None
    if as_json:
        print_json(prepare_workspace(ws, datasets=datasets).to_dict())
    else:
        prepare_with_progress(ws, datasets)
