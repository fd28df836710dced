"""The ``rwb`` command: thin parsers over ``core`` functions of the same name.

Each area lives in its own module (``core/cli/<area>.py``) exposing a ``typer.Typer``
named ``app`` (or top-level commands registered by ``register(root)``); the list
below is the one place that wires them together.

The modules import only the standard library, typer, ``core.base.errors``, ``core.base.results``
and one another at the top; each command imports the ``core`` function it calls (and with it
torch, pandas, sentence models …) when it runs, so that ``rwb --help``, ``rwb --version`` and
a usage error answer at once.  :func:`main` turns every error into one line on stderr (a JSON object
under ``--json``) and an exit code: 2 for a usage error, ``RwbError.exit_code`` otherwise.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from core.base.errors import RwbError
from core.base.results import dumps

root = typer.Typer(
    name="rwb",
    help="Reward Workbench: reward engineering for tool-using agents.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion
    pretty_exceptions_enable=False,
)

#: The distribution whose version ``rwb --version`` prints.
DISTRIBUTION = "reward-workbench"

_STATE: dict[str, Any] = {"workspace": None}


def version() -> str:
    """The installed distribution's version (its metadata, written from pyproject.toml at
    install time); a source tree run without installing reads the checkout's pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"  # only in a checkout
        if not pyproject.is_file():
            return "unknown (not installed)"
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rwb {version()}")
        raise typer.Exit()


@root.callback()
def _main(
    workspace: Optional[Path] = typer.Option(
        None, "--workspace", "-w", envvar="RWB_WORKSPACE",
        help="Workspace folder (default ./workspace)."),
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="Print the version of Reward Workbench and exit."),
) -> None:
    _STATE["workspace"] = workspace


def open_workspace(*, create: bool = True):
    """The workspace selected by ``--workspace`` / ``RWB_WORKSPACE`` / ``./workspace``
    (``create=False``: refuse with WorkspaceError when there is none)."""
    from core.records.store import Workspace  # deferred: loads pandas

    return Workspace.open(_STATE["workspace"], create=create)


def workspace_for_template(template: str):
    """The workspace, so that saved template versions (``finance_risk@3``) resolve; None for a
    template file, or when there is no workspace (none is created): shipped names still resolve."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    if Path(template).is_file():
        return None
    try:
        return open_workspace(create=False)
    except WorkspaceError:
        return None


def print_json(obj: Any) -> None:
    """Print one JSON object on stdout (the ``--json`` contract), written by
    :func:`core.base.results.dumps`: dataclass results, paths, numpy values and the like
    become JSON the same way in every command."""
    sys.stdout.write(dumps(obj) + "\n")


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
    ("tasks", "tasks"),
    ("datasets", "datasets"),
    ("states", "states"),
    ("app_cmd", None),
    ("workspace_cmd", "workspace"),
    ("review", "review"),
    ("users", "users"),
    ("audit", "audit"),
    ("catalog", "catalog"),
    ("reward", "reward"),
    ("labels", "labels"),
    ("reward_versions", None),
    ("bundle", "bundle"),
    ("registry", "registry"),
    ("keys", "keys"),
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


def _has_json_option(command: Any) -> bool:
    return any("--json" in getattr(p, "opts", ()) for p in getattr(command, "params", ()))


def _json_requested(args: list[str]) -> bool:
    """``--json`` among the options (not after a ``--``)."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def _usage_line(exc: Any) -> str:
    """One line: what was wrong, and the ``rwb … --help`` to read."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    command = exc.ctx.command_path if exc.ctx is not None else "rwb"
    return f"{message}. See '{command} --help'."


def _usage_field(exc: Any) -> str | None:
    """The option or argument a usage error is about, when it names one."""
    if getattr(exc, "param", None) is not None:
        return exc.param.name
    return getattr(exc, "option_name", None)


def _fail(exc: BaseException, message: str, exit_code: int, as_json: bool, *,
          kind: str | None = None, field: str | None = None) -> int:
    """Report an error on stderr, as ``Error: message`` or, under ``--json``, as
    ``{"error": {type, message, file, line, record, field}}``; returns the exit code."""
    if as_json:
        error = {"type": kind or type(exc).__name__, "message": message,
                 "file": getattr(exc, "file", None), "line": getattr(exc, "line", None),
                 "record": getattr(exc, "record", None), "field": getattr(exc, "field", None) or field}

        sys.stderr.write(dumps({"error": error}) + "\n")
    else:
        sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: runs ``rwb ARGV`` and returns its exit code.

    A usage error (unknown command or option, missing argument, bad value) exits 2, an
    ``RwbError`` with its ``exit_code``; neither prints a traceback."""
    from typer._click import exceptions as usage

    args = sys.argv[1:] if argv is None else list(argv)
    as_json = _json_requested(args)
    try:
        # With standalone_mode=False the command's exit code (typer.Exit(n)) is returned
        # and errors are raised here instead of printed and exited on.
        rv = root(args=args, prog_name="rwb", standalone_mode=False)
    except RwbError as exc:
        return _fail(exc, str(exc), exc.exit_code, as_json)
    except usage.NoArgsIsHelpError as exc:  # a group without its command: its help, on stdout
        if exc.message.strip():  # typer's rich help has printed itself already
            typer.echo(exc.message)
        return exc.exit_code
    except usage.UsageError as exc:
        return _fail(exc, _usage_line(exc), exc.exit_code, as_json and _has_json_option(exc.cmd),
                     kind="UsageError", field=_usage_field(exc))
    except usage.ClickException as exc:
        return _fail(exc, exc.format_message(), exc.exit_code, as_json)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort as exc:
        return _fail(exc, "Aborted.", 1, as_json)
    except SystemExit as exc:  # shell completion and --install-completion exit on their own
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def console() -> None:  # pragma: no cover - console-script shim
    sys.exit(main())
