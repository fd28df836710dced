"""``rwb catalog show|masks``: the action tokens of a dataset or tools file, and mask-rule checks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.cli import open_workspace, print_json

app = typer.Typer(help="Action catalog (tool × parameter-preset tokens) and mask rules.",
                  no_args_is_help=True)

_DATASET = typer.Option(None, "--dataset", "-d", help="Dataset in the workspace.")
_TOOLS = typer.Option(None, "--tools", help="Tool schemas: JSON list of OpenAI tools, or rwb JSONL.")
_JSON = typer.Option(False, "--json", help="Print one JSON object.")


def _workspace(dataset: str | None):
    return open_workspace() if dataset is not None else None


@app.command("show")
def show(dataset: Optional[str] = _DATASET, tools: Optional[Path] = _TOOLS, as_json: bool = _JSON) -> None:
    """List the tokens (A12T3 …) with their labels and risk, and the catalog version."""
    from core.records.catalog import show_catalog  # deferred: keeps rwb --help fast

    summary = show_catalog(_workspace(dataset), dataset=dataset, tools_file=tools)
    if as_json:
        print_json(summary)
        return
    typer.echo(f"Catalog {summary.version} of {summary.source}: {summary.n_tools} tools, "
               f"{summary.n_tokens} tokens"
               + (" (tools inferred from logged calls)" if summary.inferred_tools else ""))
    typer.echo(f"{'id':>5}  {'name':<8} {'risk':<6} label")
    for t in summary.tokens:
        typer.echo(f"{t.id:>5}  {t.name:<8} {t.risk:<6} {t.label}")


@app.command("masks")
def masks(file: Path = typer.Argument(..., help="Mask rules YAML."), dataset: Optional[str] = _DATASET,
          tools: Optional[Path] = _TOOLS, as_json: bool = _JSON) -> None:
    """Check a mask-rules file against a catalog: what each rule targets and needs."""
    from core.guard.masking import MaskCheckOnDataset, check_masks  # deferred: keeps rwb --help fast

    report = check_masks(file, _workspace(dataset), dataset=dataset, tools_file=tools)
    if as_json:
        print_json(report)
        return
    typer.echo(f"{len(report.rules)} rules in {report.file} compile against catalog "
               f"{report.catalog_version} ({report.n_tokens} tokens)")
    typer.echo(f"state features needed: {', '.join(report.required_features) or 'none'}")
    for r in report.rules:
        typer.echo(f"  {r.name:<40} {r.kind:<12} targets {r.n_targets:>4} tokens"
                   + (f"  (line {r.line})" if r.line else ""))
    if isinstance(report, MaskCheckOnDataset):
        logged = report.logged
        typer.echo(f"on the {logged.steps} logged steps of {dataset}: {logged.blocked} actions "
                   f"would be blocked, {logged.fallback_states} states left with no action")
        for behaviour, b in logged.by_behaviour.items():
            typer.echo(f"  {behaviour:<16} {b.blocked:>6} of {b.valid_actions:>7} valid actions blocked")
        for name, n in sorted(logged.by_rule.items(), key=lambda kv: -kv[1]):
            typer.echo(f"  {n:>6} × {name}")
