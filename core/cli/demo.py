"""``rwb demo``: the whole loop, headless, on a fresh demo workspace (:func:`core.sample.demo.run_demo`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

import typer

from core.cli import _STATE, print_json
from core.base.errors import InputError

DEFAULT_DIR = "demo-workspace"


def _demo_root(directory: Optional[Path]) -> Path:
    """``--dir``, else ``--workspace`` / ``RWB_WORKSPACE``, else ./demo-workspace (never the
    default ./workspace: the demo switches its workspace to multi-user mode)."""
    chosen = directory or _STATE.get("workspace") or Path(DEFAULT_DIR)
    return Path(chosen).resolve()


def _replace(root: Path) -> None:
    from core.sample.demo import MARKER  # deferred: keeps rwb --help fast

    if not root.exists():
        return
    if not (root / MARKER).is_file():
        raise InputError(f"{root} was not created by `rwb demo` (no {MARKER} in it); --replace only "
                         "deletes demo workspaces: choose another --dir", field="dir")
    shutil.rmtree(root)


def demo(
    directory: Optional[Path] = typer.Option(
        None, "--dir", help="Folder of the demo workspace (default: --workspace, else ./demo-workspace)."),
    small: bool = typer.Option(False, "--small", help="Small sizes (what the test suite runs)."),
    replace: bool = typer.Option(False, "--replace",
                                 help="Delete a previous demo workspace in that folder first."),
    policies_dir: Optional[Path] = typer.Option(
        None, "--policies-dir",
        help="Where to promote the policy (default: <demo workspace>/policies; core/policies only if you ask)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated episodes, training and tuning."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object (progress on stderr)."),
) -> None:
    """Run the whole loop headless on a fresh workspace, and say where to look in the app.

    Users and roles, import, reward pyramid, state map, training, review, tuning, bundle,
    four-eyes approval and promotion, serving with an audit trail."""
    from core.sample.demo import run_demo  # deferred: keeps rwb --help fast
    from core.records.store import Workspace  # deferred: loads pandas

    root = _demo_root(directory)
    if replace:
        _replace(root)
    ws = Workspace.open(root)
    try:
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if as_json else \
            (lambda line: print(line, flush=True))
        report = run_demo(ws, small=small, log=log, policies_dir=policies_dir, seed=seed)
    finally:
        ws.close()
    if as_json:
        print_json(report.to_dict())


def register(root: typer.Typer) -> None:
    root.command("demo")(demo)
