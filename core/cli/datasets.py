"""``rwb datasets``: generate synthetic recorded episodes; list, archive, restore and delete the
workspace's datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

app = typer.Typer(help="Generate synthetic recorded episodes (finance, ecommerce); list, archive, restore "
                       "and delete datasets.", no_args_is_help=True)


@app.command("generate")
def generate(
    domain: str = typer.Option(..., "--domain", help="finance | ecommerce"),
    episodes: int = typer.Option(1000, "--episodes", "-n", help="Number of episodes."),
    seed: int = typer.Option(0, "--seed", help="Random seed (same seed → byte-identical file)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output rwb JSONL file."),
    behaviours: str = typer.Option("", "--behaviours",
                                   help="Keep only these behaviours, comma-separated (e.g. noisy,hacker: "
                                        "the logs of an imperfect agent)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object."),
) -> None:
    """Write N generated episodes of a domain (with its tool schemas) as rwb JSONL."""
    from core.data.datasets import generate_file  # deferred: keeps rwb --help fast

    keep = behaviours or None
    if as_json:
        print_json(generate_file(domain, episodes, seed, out, behaviours=keep))
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"Generating {domain} episodes", total=episodes)
        summary = generate_file(domain, episodes, seed, out, behaviours=keep,
                                progress=lambda done, total: bar.update(task, completed=done))
    typer.echo(f"Wrote {summary.episodes} {domain} episodes ({summary.steps} steps, "
               f"{summary.tool_calls} tool calls) to {summary.out} in {summary.seconds} s")
    for behaviour, o in summary.outcome_by_behaviour.items():
        typer.echo(f"  {behaviour:<10} {o.episodes:>7} episodes  final_reward {o.final_reward_mean:+.3f}  "
                   f"business {o.business_metric_mean:.3f}  resolved {o.resolved_rate:.0%}")


@app.command("sample-embeddings")
def sample_embeddings(
    out: Path = typer.Option(None, "--out", help="The datasets folder to write into (default: the "
                                                 "shipped one, datasets/ in a checkout)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON array (no progress)."),
) -> None:
    """Rebuild the embeddings store each sample dataset ships (datasets/<domain>/embeddings/),
    so that a new workspace scores its samples without running the sentence model.  Run it
    after a sample dataset, a shipped template or the sentence model changes."""
    import tempfile

    from core.sample.warmup import PrepareProgress, write_sample_embeddings  # deferred: loads pandas and scipy

    def scoring(event: PrepareProgress) -> None:
        if event.stage == "score":
            typer.echo(event.text, err=True)

    with tempfile.TemporaryDirectory(prefix="rwb-sample-embeddings-") as work:
        if as_json:
            print_json(write_sample_embeddings(out, work_dir=Path(work)))
            return
        for done in write_sample_embeddings(out, work_dir=Path(work), progress=scoring):
            typer.echo(f"{done.domain}: {done.texts} texts in {done.folder}")


@app.command("list")
def list_(
    archived: bool = typer.Option(False, "--archived", help="Also list archived datasets."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the workspace's datasets and the committed sample files."""
    from core.data.datasets import list_datasets  # deferred: keeps rwb --help fast

    ws = open_workspace()
    try:
        listing = list_datasets(ws, include_archived=archived)
    finally:
        ws.close()
    if as_json:
        print_json(listing)
        return
    if not listing.datasets:
        typer.echo(f"No datasets in {listing.workspace} yet; import one with `rwb episodes import FILE`.")
    else:
        typer.echo(f"{'dataset':<28} {'domain':<12} {'episodes':>9} {'steps':>9}  created")
        for d in listing.datasets:
            note = f"  (archived {d.archived_at})" if d.archived_at else ""
            typer.echo(f"{d.name:<28} {d.domain or '-':<12} {d.episodes:>9} {d.steps:>9}  {d.created_at}{note}")
    typer.echo("Sample files: " + ", ".join(s.path for s in listing.samples))


@app.command("archive")
def archive(
    name: str = typer.Argument(..., help="The dataset."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Hide a dataset from every picker and keep its data (restore brings it back).  Refused
    while a run or a tuning study is running on it."""
    from core.data.datasets import archive_dataset  # deferred: keeps rwb --help fast

    ws = open_workspace()
    try:
        event = archive_dataset(ws, acting_user(ws, as_name), name)
    finally:
        ws.close()
    if as_json:
        print_json({"dataset": name, "archived": True, "event": event})
    elif event is None:
        typer.echo(f"Dataset '{name}' was archived already; nothing changed.")
    else:
        typer.echo(f"Archived dataset '{name}': it is hidden from the pickers and keeps its data "
                   f"(`rwb datasets restore {name}` brings it back).")


@app.command("restore")
def restore(
    name: str = typer.Argument(..., help="The dataset."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Bring an archived dataset back into the pickers."""
    from core.data.datasets import restore_dataset  # deferred: keeps rwb --help fast

    ws = open_workspace()
    try:
        event = restore_dataset(ws, acting_user(ws, as_name), name)
    finally:
        ws.close()
    if as_json:
        print_json({"dataset": name, "archived": False, "event": event})
    elif event is None:
        typer.echo(f"Dataset '{name}' is not archived; nothing changed.")
    else:
        typer.echo(f"Restored dataset '{name}'.")


@app.command("delete")
def delete(
    name: str = typer.Argument(..., help="The dataset."),
    yes: bool = typer.Option(False, "--yes", help="Delete it (without this, say what would be deleted "
                                                  "and delete nothing)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Delete a dataset with its episodes, labels and cached files.  Refused while a run or a
    tuning study is running on it or a registered policy was trained on it."""
    from core.data.datasets import delete_dataset, deletion_preview  # deferred: keeps rwb --help fast

    ws = open_workspace()
    try:
        actor = acting_user(ws, as_name)
        if not yes:
            preview = deletion_preview(ws, name)
            if as_json:
                print_json({"deleted": False, "preview": preview})
            for blocker in preview.blockers:
                typer.echo(f"refused now: {blocker.text}", err=True)
            if preview.runs_kept:
                typer.echo(f"runs that used it stay recorded: {', '.join(preview.runs_kept)}", err=True)
        # without --yes core refuses, saying what would be deleted
        result = delete_dataset(ws, actor, name, confirm=name if yes else None)
    finally:
        ws.close()
    if as_json:
        print_json({"deleted": True, **vars(result)})
    else:
        typer.echo(f"Deleted dataset '{name}': {result.episodes:,} episodes, {result.steps:,} steps, "
                   f"{result.labels:,} labels and {len(result.files)} cached files.")
