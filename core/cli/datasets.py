"""``rwb datasets``: generate synthetic recorded episodes; list the workspace's datasets."""

from __future__ import annotations

from pathlib import Path

import typer

from core.cli import open_workspace, print_json

app = typer.Typer(help="Generate synthetic recorded episodes (finance, ecommerce); list datasets.",
                  no_args_is_help=True)


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
def list_(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the workspace's datasets and the committed sample files."""
    from core.data.datasets import list_datasets  # deferred: keeps rwb --help fast

    ws = open_workspace()
    try:
        listing = list_datasets(ws)
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
            typer.echo(f"{d.name:<28} {d.domain or '-':<12} {d.episodes:>9} {d.steps:>9}  {d.created_at}")
    typer.echo("Sample files: " + ", ".join(s.path for s in listing.samples))
