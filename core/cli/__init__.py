"""The ``rwb`` command: thin parsers over ``core`` functions of the same name.

Each area lives in its own module (``core/cli/<area>.py``) exposing a ``typer.Typer``
named ``app`` (or top-level commands registered by ``register(root)``); the list
below is the one place that wires them together.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, Optional

import typer

from core.errors import RwbError

root = typer.Typer(
    name="rwb",
    help="Reward Workbench: reward engineering for tool-using agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_STATE: dict[str, Any] = {"workspace": None}


@root.callback()
def _main(
    workspace: Optional[Path] = typer.Option(
        None, "--workspace", "-w", envvar="RWB_WORKSPACE",
        help="Workspace folder (default ./workspace)."),
) -> None:
    _STATE["workspace"] = workspace


def open_workspace(*, create: bool = True):
    """The workspace selected by ``--workspace`` / ``RWB_WORKSPACE`` / ``./workspace``
    (``create=False``: refuse with WorkspaceError when there is none)."""
    from core.store import Workspace

    return Workspace.open(_STATE["workspace"], create=create)


def print_json(obj: Any) -> None:
    """Print one JSON object on stdout (the ``--json`` contract)."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")


def progress_printer(title: str, unit: str, position: Callable[[dict[str, Any]], tuple[int, int | None]],
                     describe: Callable[[dict[str, Any]], str]) -> tuple[Callable[[dict[str, Any]], None], Any]:
    """``(update, bar)`` for a long command's progress on stderr (stdout stays for --json).

    ``update(m)`` moves a rich progress bar to ``position(m)`` = (done, total) with
    ``describe(m)`` beside it; when stderr is not a terminal (a log, a pipe) it writes one
    plain line per call instead: ``<unit> done/total · describe(m)``.  ``bar`` is the rich
    ``Progress`` to start and stop around the work, None for plain lines."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        def line(m: dict[str, Any]) -> None:
            done, total = position(m)
            sys.stderr.write(f"{unit} {done}/{'?' if total is None else total} · {describe(m)}\n")
            sys.stderr.flush()
        return line, None
    bar = Progress(TextColumn(f"[bold]{title}"), BarColumn(), TextColumn(f"{{task.completed}}/{{task.total}} {unit}s"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    task = bar.add_task(title, total=None, info="")

    def update(m: dict[str, Any]) -> None:
        done, total = position(m)
        bar.update(task, total=total, completed=done, info=describe(m))
    return update, bar


# (module, sub-command name or None for top-level commands registered by register(root))
AREAS: list[tuple[str, str | None]] = [
    ("episodes", "episodes"),
    ("datasets", "datasets"),
    ("states", "states"),
    ("app_cmd", None),
    ("workspace_cmd", "workspace"),
    ("review", "review"),
    ("users", "users"),
    ("audit", "audit"),
    ("catalog", "catalog"),
    ("reward", "reward"),
    ("reward_versions", None),
    ("bundle", "bundle"),
    ("registry", "registry"),
    ("tune", "tune"),
    ("train", None),
    ("serve", "serve"),
    ("demo", None),
]


def _wire() -> None:
    for module_name, name in AREAS:
        module = importlib.import_module(f"core.cli.{module_name}")
        if name is None:
            module.register(root)
        else:
            root.add_typer(module.app, name=name)


_wire()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; user errors print a message and exit non-zero."""
    try:
        # With standalone_mode=False click returns a command's exit code (typer.Exit(n))
        # instead of raising SystemExit.
        rv = root(args=argv, standalone_mode=False)
    except RwbError as exc:
        typer.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # typer/click usage errors already printed
        return int(exc.code or 0)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            typer.echo("Aborted.", err=True)
            return 1
        raise
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def console() -> None:  # pragma: no cover - console-script shim
    sys.exit(main())
