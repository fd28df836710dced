"""``rwb reward export``: write a template as a reward module for TRL, verifiers, verl or OpenRLHF.

Attached to the ``rwb reward`` group at the end of :mod:`core.cli.reward`.  The command is a thin
parser over :func:`core.rewards.export.write_export`: the module it writes pins the template's
sha256 and exposes the framework's entry point; the README beside it holds the snippet.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.cli import print_json, workspace_for_template

TEMPLATE_HELP = ("Template file, a template name (its latest version saved in the workspace, else the "
                 "shipped file), or NAME@VERSION (tool_agent@3; @0 = shipped).")


def export(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    to: str = typer.Option(..., "--to", help="The framework: trl, verifiers, verl or openrlhf."),
    out: Path = typer.Option(..., "--out", help="Folder to write the module, the template copy and README.md to."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write the template as a reward module for an RL framework (pinned by its sha256)."""
    from core.rewards.export import write_export  # deferred: loads pandas, scipy and the scorer

    result = write_export(template, to, out, ws=workspace_for_template(template))
    if as_json:
        print_json(result.to_dict())
        return
    typer.echo(f"exported {result.template} (sha256 {result.sha256[:12]}) for {to}: "
               f"entry point {result.entry_point}")
    for f in result.files:
        typer.echo(f"  wrote {f}")
    typer.echo(result.snippet)
