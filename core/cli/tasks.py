"""``rwb tasks``: import the tasks' success criteria for a dataset, and show how many episodes they cover.

Thin over :mod:`core.data.task_criteria`.  Bad input exits with status 2 and one line naming
the file, line or record, and field (docs/criteria.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.base.errors import InputError
from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

app = typer.Typer(help="Task success criteria: import them for a dataset, list their coverage.",
                  no_args_is_help=True)

CRITERIA_FORMAT_OPTION = typer.Option(None, "--format", "-f",
                                      help="rwb, tau2 or tau-bench (default: detect from the first record).")
GROUP_KEY_OPTION = typer.Option(None, "--group-key",
                                help="Dotted key of the episodes' task id (default: task_id).")


def import_and_report(ws, actor, file: Path, dataset: str, format: Optional[str], group_key: Optional[str],
                      as_json: bool) -> None:
    """Import ``file`` as the criteria of ``dataset`` and print what was read (shared with
    ``rwb episodes import --tasks``)."""
    from core.data.task_criteria import import_criteria  # deferred: keeps rwb --help fast

    result = import_criteria(ws, actor, file, dataset, format=format, group_key=group_key)
    if as_json:
        print_json({"criteria": result, "coverage": result.coverage_line})
        return
    typer.echo(f"Read criteria of {result.tasks_read:,} tasks from {result.file} ({result.format}) for "
               f"dataset '{result.dataset}'; {result.tasks_matched:,} match its episodes"
               + (f", {result.replaced:,} replaced earlier criteria" if result.replaced else "") + ".")
    typer.echo(f"  {result.coverage_line}")
    if result.episodes_without_criteria:
        typer.echo(f"  {result.episodes_without_criteria:,} episodes have no criteria: their criteria terms "
                   "take the neutral value")
    if result.unmatched_task_ids:
        typer.echo("  task ids no episode has: " + ", ".join(result.unmatched_task_ids))


@app.command("import")
def import_cmd(
    file: Path = typer.Argument(..., help="Criteria file: rwb JSON Lines, tau2 tasks.json or tau-bench task records."),
    dataset: str = typer.Option(..., "--dataset", "-d", help="Dataset whose episodes the tasks belong to."),
    format: Optional[str] = CRITERIA_FORMAT_OPTION,
    group_key: Optional[str] = GROUP_KEY_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Import the tasks' success criteria for a dataset (re-importing a task id replaces its criteria)."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    ws = open_workspace()
    actor = acting_user(ws, as_name)
    try:
        import_and_report(ws, actor, file, dataset, format, group_key, as_json)
    except WorkspaceError as exc:
        raise InputError(str(exc), field="dataset") from None


@app.command("list")
def list_cmd(
    dataset: str = typer.Option(..., "--dataset", "-d", help="Dataset to report on."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show how many of a dataset's episodes have task criteria, and the tasks that have them."""
    from core.data.task_criteria import criteria_coverage, criteria_for  # deferred: keeps rwb --help fast
    from core.records.store import WorkspaceError  # deferred: loads pandas

    ws = open_workspace()
    try:
        coverage = criteria_coverage(ws, dataset)
    except WorkspaceError as exc:
        raise InputError(str(exc), field="dataset") from None
    criteria = criteria_for(ws, dataset)
    if as_json:
        print_json({"coverage": coverage, "line": coverage.line, "tasks": criteria})
        return
    typer.echo(f"dataset '{dataset}': {coverage.line} ({coverage.tasks_with_criteria:,} tasks with criteria, "
               f"{coverage.tasks_matched:,} of them in the dataset)")
    if not criteria:
        typer.echo(f"  import some with: rwb tasks import FILE --dataset {dataset}")
    for task_id, crit in criteria.items():
        calls = ", ".join(c["name"] for c in crit.get("expected_calls", [])) or "no calls"
        say = len(crit.get("communicate", []))
        typer.echo(f"  {task_id:<12} {calls[:80]}" + (f"  · tell {say} item(s)" if say else ""))
