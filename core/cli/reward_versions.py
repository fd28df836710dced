"""``rwb reward versions | save | diff | show``: versions of reward templates in the workspace.

Attached to the ``rwb reward`` group (``core.cli.reward``) by :func:`register`.
Every save is a new version; ``save --base N`` names the version the file was
edited from and is refused (exit 4) when someone saved a newer one since.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option
from core.base.errors import InputError
from core.cli.reward import app as reward_app

if TYPE_CHECKING:
    from core.rewards.versions import TemplateVersion


def _short(v: TemplateVersion) -> str:
    base = "-" if v.base_version is None else str(v.base_version)
    return (f"{v.version:>4}  {v.saved_at or 'shipped':<20}  {v.saved_by:<16}  {base:>4}  "
            f"{v.sha256[:12]}  {v.message}")


def versions(
    name: str = typer.Argument(..., help="Template name (e.g. finance_risk)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the versions of a template (version 0 is the shipped file)."""
    from core.rewards import versions as tv  # deferred: loads pandas and scipy

    rows = tv.list_versions(open_workspace(), name)
    if as_json:
        print_json({"name": name, "latest": rows[-1].version, "versions": [v.to_dict() for v in rows]})
        return
    typer.echo(f"template {name!r}: {len(rows)} version(s), latest {rows[-1].label}")
    typer.echo(f"{'ver':>4}  {'saved at':<20}  {'saved by':<16}  {'base':>4}  {'sha256':<12}  message")
    for v in rows:
        typer.echo(_short(v))


def save(
    name: str = typer.Argument(..., help="Template name to save under (the YAML's name: must match)."),
    file: Path = typer.Argument(..., help="YAML file of the edited template."),
    base: int = typer.Option(..., "--base", help="The version you edited (0 = the shipped file; "
                             "0 also for a brand-new template)."),
    message: str = typer.Option("", "--message", "-m", help="Why: shown in `rwb reward versions`."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Save FILE as a new version of template NAME (refused when NAME moved past --base)."""
    from core.rewards import versions as tv  # deferred: loads pandas and scipy

    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the template file: {exc}", file=str(file)) from None
    ws = open_workspace()
    saved = tv.save_template(ws, acting_user(ws, as_name), name, text, base, message)
    if as_json:
        print_json(saved.to_dict())
        return
    typer.echo(f"saved {saved.label} (base {saved.base_version if saved.base_version is not None else '-'}, "
               f"sha256 {saved.sha256[:12]}) by {saved.saved_by}")


def diff(
    name: str = typer.Argument(..., help="Template name."),
    a: int = typer.Argument(..., help="Older version (0 = the shipped file)."),
    b: int = typer.Argument(..., help="Newer version."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What changed between two versions: weights, parameters, gating …, then the YAML diff."""
    from core.rewards import versions as tv  # deferred: loads pandas and scipy

    d = tv.diff_versions(open_workspace(), name, a, b)
    if as_json:
        print_json(d.to_dict())
        return
    if not d.changes and not d.unified:
        typer.echo(f"{name}@{a} and {name}@{b} are identical")
        return
    typer.echo(f"{name}@{a} → {name}@{b}: {len(d.changes)} change(s)")
    for c in d.changes:
        typer.echo(f"  {c.section:<12} {c.key:<36} {c.a!s:>12} → {c.b!s}")
    if d.unified:
        typer.echo("")
        typer.echo(d.unified, nl=False)


def show(
    template: str = typer.Argument(..., help="NAME (latest version) or NAME@VERSION."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (with the YAML)."),
) -> None:
    """Print the YAML of a template version (to edit it and `rwb reward save` it back)."""
    from core.rewards import versions as tv  # deferred: loads pandas and scipy

    name, version = tv.parse_spec(template)
    v = tv.get_template(open_workspace(), name, version)
    if as_json:
        print_json(v.to_dict(with_yaml=True))
        return
    typer.echo(v.yaml, nl=not v.yaml.endswith("\n"))


def register(root: typer.Typer) -> None:
    """Attach the version commands to the ``rwb reward`` group of the reward engine."""
    reward_app.command("versions")(versions)
    reward_app.command("save")(save)
    reward_app.command("diff")(diff)
    reward_app.command("show")(show)
