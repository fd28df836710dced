"""``rwb bundle``: export a trained run as a policy bundle, and verify a bundle (``core.govern.bundle``).

A bundle is a zip a person can open (manifest, safetensors weights, catalog, masks,
template, the RDE tree); ``verify`` checks every hash, the schema, paths and pickle
payloads, and runs the policy on its smoke set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

app = typer.Typer(help="Policy bundles: export a trained run, verify a bundle.", no_args_is_help=True)


@app.command("export")
def export_bundle(
    run_id: str = typer.Argument(..., help="The run to export (finished or stopped)."),
    out: Path = typer.Option(..., "--out", "-o", help="Bundle file to write (FILE.zip)."),
    name: Optional[str] = typer.Option(None, "--name", help="Policy name (default: the template's name)."),
    version: Optional[str] = typer.Option(
        None, "--version", help="Semantic version (default: next minor after the registered ones)."),
    serve_precision: str = typer.Option(
        "full", "--serve-precision",
        help="What serving runs: the trained policy (full), or a cheaper copy of it: float16, bfloat16 or int8 "
             "weights, or a distilled smaller network (refused unless it agrees with the policy on at least 99%% "
             "of the held-out states; the agreement goes into the signed manifest)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write RUN's policy, encoder, catalog, masks, template, evaluation and RDE tree as a bundle zip."""
    from core.govern import bundle  # deferred: keeps rwb --help fast

    ws = open_workspace()
    path = bundle.export_bundle(ws, acting_user(ws, as_name), run_id, out, name=name, version=version,
                                serve_precision=serve_precision)
    report = bundle.verify_in_workspace(ws, path)
    m = report.manifest or {}
    if as_json:
        print_json({"path": str(path), "name": m.get("name"), "version": m.get("version"),
                    "manifest": m, "verified": report.ok, "signer": report.signer})
        return
    ev = m.get("evaluation") or {}
    typer.echo(f"wrote {path}: {m.get('name')} {m.get('version')} from {run_id}, signed by key {report.signer}")
    typer.echo(f"  held-out return {ev.get('policy', {}).get('return_mean')} vs logged expert "
               f"{ev.get('expert_return')} over {ev.get('episodes')} episodes")
    typer.echo(f"  {bundle.served_copy_line(m)}")


@app.command("verify")
def verify(
    file: Path = typer.Argument(..., help="Bundle zip (or a promoted bundle folder)."),
    allow_unsigned: bool = typer.Option(
        False, "--allow-unsigned",
        help="Inspection only: report a missing, invalid or untrusted signature as a warning and exit 0 "
             "(registering and promoting still refuse such a bundle)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check the signature (by a key this workspace trusts), hashes, schema, paths, sizes and nesting
    (zip bombs and deep JSON are refused unread), pickle payloads and a smoke run; exit 2 when
    refused, recorded in the security log.  Then compare what the bundle was built with to this
    environment: another embedding model or feature layout is a WARNING, other versions a note."""
    from core.govern import bundle  # deferred: keeps rwb --help fast

    ws = open_workspace()
    report = bundle.verify_in_workspace(ws, file, allow_unsigned=allow_unsigned)
    if as_json:
        print_json(report.to_dict())
    else:
        for c in report.checks:
            typer.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.check:<9} {c.detail}")
        for w in report.warnings:
            typer.echo(f"warning: {w} (accepted for inspection only: --allow-unsigned)", err=True)
        for e in report.environment:
            if e.level == "warning":
                typer.echo(f"WARNING: {e.message}", err=True)
            elif e.level == "note":
                typer.echo(f"note: {e.message}")
            else:
                typer.echo(f"ok   env       {e.message}")
        if report.ok:
            m = report.manifest or {}
            signer = f"signed by key {report.signer}" if report.signer else "NOT signed by a trusted key"
            typer.echo(f"bundle ok: {m.get('name')} {m.get('version')}, {signer}")
    if not report.ok:  # the CLI prints it and exits 2
        raise bundle.BundleError(f"bundle refused: {report.reason}", file=str(file))
