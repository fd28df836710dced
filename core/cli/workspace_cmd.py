"""``rwb workspace init|info|prepare|status``: create a workspace (with the sample datasets),
describe it, prepare its caches so that every page of the app opens at once, and say where it
stands along the loop with the next useful step."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

import typer

from core.cli import open_workspace, print_json

if TYPE_CHECKING:
    from core.access.users import Actor
    from core.govern.overview import WorkspaceOverview
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


def _print_overview(overview: "WorkspaceOverview") -> None:
    from core.govern.overview import GOOD_FIDELITY  # deferred: loads the scoring code

    share = overview.labelled_share
    typer.echo(f"Data       {len(overview.datasets)} datasets ({len(overview.own_datasets)} your own), "
               f"{overview.episodes:,} episodes; {overview.labelled:,} with a known outcome"
               + (f" ({share:.0%})" if share is not None else ""))
    r = overview.reward
    line = f"Reward     {r.versions_saved} versions saved"
    if r.latest:
        line += f"; latest {r.latest} by {r.latest_saved_by} at {r.latest_saved_at}"
    typer.echo(line)
    fid = r.fidelity
    if fid is not None and fid.within_task_auc is not None:
        verdict = "good" if fid.within_task_auc >= GOOD_FIDELITY else f"weak (good: {GOOD_FIDELITY} or more)"
        interval = "" if fid.ci90 is None else f" (90% {fid.ci90[0]:.3f}–{fid.ci90[1]:.3f})"
        typer.echo(f"           ranks successes above failures of the same task: within-task AUC "
                   f"{fid.within_task_auc:.3f}{interval}, {verdict} ({fid.note})")
    elif fid is not None:
        typer.echo(f"           fidelity not measured: {fid.note}")
    runs = overview.runs
    typer.echo(f"Training   {runs.count} runs" + (f"; latest {runs.latest_id} {runs.latest_status}"
                                                  if runs.latest_id else ""))
    typer.echo(f"Review     {overview.review.open} items waiting, {overview.review.decided} decided")
    p = overview.policies
    typer.echo(f"Policies   in production: {', '.join(p.production) or 'none'}; approved: "
               f"{', '.join(p.approved) or 'none'}; waiting for approval: {', '.join(p.candidates) or 'none'}")
    step = overview.next_step
    typer.echo(f"Next step  {step.action} (app page: {step.page}). {step.reason}")


@app.command("status")
def status(
    for_user: str = typer.Option(None, "--for", help="Suggest the next step for this user's role "
                                                     "(default: the local admin, or anyone's in a workspace with users)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Where the workspace stands along the loop (data, reward, training, review, policies) and
    the next useful step."""
    from core.access.users import current_user, get_user, multi_user  # deferred: loads argon2
    from core.govern.overview import workspace_overview  # deferred: loads the scoring code
    from core.sample.workspace_setup import SAMPLE_DATASETS  # deferred: loads pandas

    ws = open_workspace(create=False)
    actor: "Actor | None" = None  # anyone's next step in a workspace with users
    if for_user:
        actor = get_user(ws, for_user).actor()
    elif not multi_user(ws):
        actor = current_user(ws)
    overview = workspace_overview(ws, actor, samples=SAMPLE_DATASETS.values())
    if as_json:
        print_json({**asdict(overview), "episodes": overview.episodes, "labelled": overview.labelled,
                    "labelled_share": overview.labelled_share})
    else:
        _print_overview(overview)
