"""``rwb episodes``: import recorded episodes (and, with ``--tasks``, their tasks' criteria), list
them, show one, export a dataset.

Thin over ``core.data.importers`` (import/export), the workspace (list) and
``core.data.episode_views`` (show).  Bad input exits with status 2 and a message naming the
file, line or record, and field.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option
from core.cli.tasks import import_and_report
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import OutcomeFigures

app = typer.Typer(help="Recorded episodes: import, list, show, export.", no_args_is_help=True)

#: Files at least this big get a progress bar (on stderr, when it is a terminal).
PROGRESS_MIN_BYTES = 2_000_000


@contextlib.contextmanager
def _workspace_errors() -> Iterator[None]:
    """Workspace look-up failures (no such dataset/episode) are the user's input errors."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    try:
        yield
    except WorkspaceError as exc:
        raise InputError(str(exc)) from None


@contextlib.contextmanager
def _progress(path: Path) -> Iterator[Any]:
    """A rich progress bar on stderr for big files; yields the ``progress(done, total)`` callback."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    try:
        big = path.stat().st_size >= PROGRESS_MIN_BYTES
    except OSError:
        big = False
    if not (big and console.is_terminal):
        yield None
        return
    # done/total count bytes of the file as it is read (records for a file read whole): a share is what to show
    with Progress(TextColumn("importing {task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(path.name, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# How to read an episodes file: shared by every command that reads one (import, evaluate).
FORMAT_OPTION = typer.Option("auto", "--format", "-f", help="openai, openai-legacy, tau2, bfcl, rwb, or auto (detect).")
MESSAGES_KEY_OPTION = typer.Option(None, "--messages-key",
                                   help="Dotted path of the message list in each record (openai).")
REWARD_KEY_OPTION = typer.Option(None, "--reward-key",
                                 help="Dotted path of the outcome: number → reward, bool → resolved.")
ID_KEY_OPTION = typer.Option(None, "--id-key", help="Dotted path of the episode id (default: generated).")
SKIP_INVALID_OPTION = typer.Option(False, "--skip-invalid", help="Read the good records; report the rejected ones.")


@app.command("import")
def import_cmd(
    file: Path = typer.Argument(..., help="File of recorded episodes (JSON, JSON Lines)."),
    format: str = FORMAT_OPTION,
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d",
                                          help="Dataset to import into (default: the file stem)."),
    messages_key: Optional[str] = MESSAGES_KEY_OPTION,
    reward_key: Optional[str] = REWARD_KEY_OPTION,
    id_key: Optional[str] = ID_KEY_OPTION,
    skip_invalid: bool = SKIP_INVALID_OPTION,
    tasks: Optional[Path] = typer.Option(None, "--tasks",
                                         help="Task criteria file to import for the dataset right after "
                                              "(see rwb tasks import)."),
    tasks_format: Optional[str] = typer.Option(None, "--tasks-format",
                                               help="Format of --tasks: rwb, tau2 or tau-bench (default: detect)."),
    group_key: Optional[str] = typer.Option(None, "--group-key",
                                            help="Dotted key of the episodes' task id, for --tasks "
                                                 "(default: task_id)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Import a file into a dataset, all or nothing (re-importing the same file changes nothing);
    with --tasks, the tasks' success criteria too."""
    from core.data.importers import import_file  # deferred: keeps rwb --help fast

    ws = open_workspace()
    actor = acting_user(ws, as_name)
    if tasks is not None:   # a bad criteria file is refused before any episode is imported
        from core.data.task_criteria import parse_criteria  # deferred: keeps rwb --help fast

        parse_criteria(tasks, format=tasks_format)
    with _progress(file) as progress:
        result = import_file(ws, file, format=format, dataset=dataset, messages_key=messages_key,
                             reward_key=reward_key, id_key=id_key, skip_invalid=skip_invalid,
                             progress=progress, actor=actor)
    if as_json:
        if tasks is None:
            print_json(result.to_dict())
            return
        from core.data.task_criteria import import_criteria  # deferred: keeps rwb --help fast

        criteria = import_criteria(ws, actor, tasks, result.dataset, format=tasks_format, group_key=group_key)
        print_json(result.to_dict() | {"criteria": criteria, "criteria_coverage": criteria.coverage_line})
        return
    if result.already_imported:
        typer.echo(f"{file} was already imported into dataset '{result.dataset}' "
                   f"(import #{result.import_id}); " + ("no episode changed." if tasks else "nothing changed."))
    else:
        _report_import(file, result)
    if tasks is not None:
        import_and_report(ws, actor, tasks, result.dataset, tasks_format, group_key, as_json=False)


def _report_import(file: Path, result: Any) -> None:
    typer.echo(f"Imported {result.episodes:,} episodes ({result.steps:,} steps, {result.tool_calls:,} "
               f"tool calls, {result.invalid_tokens:,} invalid tokens) from {file} ({result.format}) "
               f"into dataset '{result.dataset}'.")
    if result.invalid_reasons:
        typer.echo("  invalid: " + ", ".join(f"{r} ×{n}" for r, n in result.invalid_reasons.items()))
    for warning in result.warnings:
        typer.echo(f"  note: {warning}")
    if result.rejected:
        typer.echo(f"  {len(result.rejected)} record(s) rejected; report: {result.report_path}")
        for r in result.rejected[:5]:
            typer.echo(f"    {r['message']}")


def _outcome_text(outcome: "OutcomeFigures") -> str:
    parts = []
    if outcome.resolved is not None:
        parts.append("resolved" if outcome.resolved else "failed")
    if outcome.final_reward is not None:
        parts.append(f"reward {outcome.final_reward:.3g}")
    return ", ".join(parts) or "unknown"


@app.command("list")
def list_cmd(
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Only this dataset."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most this many episodes."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List episodes (id, steps, outcome), in import order."""
    ws = open_workspace()
    with _workspace_errors():
        if dataset is not None:
            ws.require_dataset(dataset)
        rows = ws.episode_summaries(dataset)
    if limit is not None:
        rows = rows[:limit]
    if as_json:
        print_json({"dataset": dataset, "count": len(rows), "episodes": rows})
        return
    if not rows:
        typer.echo("no episodes" + (f" in dataset '{dataset}'" if dataset else "")
                   + "; import some with: rwb episodes import FILE")
        return
    width = max(len(r.episode_id) for r in rows)
    for r in rows:
        query = " ".join((r.query or "").split())[:60]
        typer.echo(f"{r.dataset:<24} {r.episode_id:<{width}} {r.n_steps:>4} steps  "
                   f"{_outcome_text(r.outcome):<22} {query}")


@app.command("show")
def show_cmd(
    episode_id: str = typer.Argument(..., help="Episode id."),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d",
                                          help="Dataset (needed when the id is in several)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show one episode: task, steps (action token, result), outcome."""
    from core.records.catalog import catalog_for_dataset  # deferred: keeps rwb --help fast
    from core.data.episode_views import show_episode  # deferred: loads pandas
    from core.data.importers import find_episode  # deferred: keeps rwb --help fast

    ws = open_workspace()
    with _workspace_errors():
        dataset = find_episode(ws, episode_id, dataset)
        detail = show_episode(ws, dataset, episode_id, catalog_for_dataset(ws, dataset))
        if as_json:
            episode = ws.get_episode(dataset, episode_id)
            print_json({"dataset": dataset, "episode": episode.model_dump(mode="json"),
                        "tokens": [s.token for s in detail.steps],
                        "invalid_reasons": [s.invalid_reason for s in detail.steps]})
            return
    typer.echo(f"{detail.episode_id}  [{detail.dataset}]  {detail.summary_line}")
    typer.echo(f"task: {detail.query}")
    typer.echo("outcome: " + ", ".join(f"{k} {v}" for k, v in detail.outcome_figures))
    for s in detail.steps:
        for m in s.messages:
            typer.echo(f"      {m.role}: {m.text[:200]}")
        typer.echo(f"  t={s.t:<3} {s.token or '':<8} {s.action_label[:100]}  [{s.status}]")
        if s.output_text:
            typer.echo(f"        says: {s.output_text[:200]}")
        if s.tool_error:
            typer.echo(f"        error: {s.tool_error[:200]}")
        elif s.tool_result is not None:
            result = s.tool_result if isinstance(s.tool_result, str) else json.dumps(
                s.tool_result, ensure_ascii=False)
            typer.echo(f"        result: {result[:200]}")


@app.command("export")
def export_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="File to write (workbench JSON Lines)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d",
                                          help="Dataset (needed when there are several)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write a dataset as the workbench's JSON Lines (re-importable, byte-identical round trip)."""
    from core.data.importers import export_episodes, single_dataset  # deferred: keeps rwb --help fast

    ws = open_workspace()
    dataset = dataset or single_dataset(ws)
    n = export_episodes(ws, dataset, out)
    if as_json:
        print_json({"dataset": dataset, "out": str(out), "episodes": n})
        return
    typer.echo(f"Exported {n:,} episodes of dataset '{dataset}' to {out}.")
