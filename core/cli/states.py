"""``rwb states map|entropy``: the state map (t-SNE), encoding fidelity and action entropy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from core.cli import open_workspace, print_json
from core.base.errors import InputError

if TYPE_CHECKING:
    from core.state.statemap import EntropyReport

app = typer.Typer(help="State map (t-SNE), encoding fidelity and action entropy.", no_args_is_help=True)


def _print_entropy(e: EntropyReport) -> None:
    typer.echo(f"Action entropy ({e.source}, {e.n:.0f} actions, {e.n_invalid} invalid left out): "
               f"{e.overall:.3f} nats of at most {e.max_overall:.3f}")
    if e.conditional is not None:
        typer.echo(f"  within state clusters (H(action | cluster)): {e.conditional:.3f} nats")
    typer.echo(f"  {e.verdict}")
    for title, groups in (("per tool", e.per_tool), ("per state cluster", e.per_cluster)):
        if groups:
            typer.echo(f"  {title}:")
        for g in groups:
            typer.echo(f"    {g.group:<28} {g.entropy:6.3f} / {g.max_entropy:6.3f} nats  "
                       f"n={g.n:<7.0f} top {g.top_action}")


def _source(episodes: Optional[Path], dataset: Optional[str]) -> dict:
    if (episodes is None) == (dataset is None):
        raise InputError("give exactly one of --episodes FILE or --dataset NAME")
    return {"episodes_file": episodes, "dataset": dataset}


@app.command("map")
def map_(
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="An episodes file (rwb JSONL or any importable format)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="A dataset of the workspace."),
    out: Path = typer.Option(..., "--out", help="CSV file to write the map's points to: step, x, y and every "
                             "field a point can be coloured by (task_type, intent, behaviour, action, tool, "
                             "cluster, final_reward, resolved; with --template also reward_total, reward_level "
                             "and reward:L1…). The State Explorer page (rwb app) draws the map."),
    space: str = typer.Option("encoded", "--space", help="'encoded' (the seeded state encoder) or 'raw' "
                              "(concatenated raw features)."),
    gating: str = typer.Option("on", "--gating", help="Gated fusion 'on', or 'off' (equal weights)."),
    intent: str = typer.Option("on", "--intent", help="Intent encoder 'on' or 'off'."),
    max_points: int = typer.Option(20000, "--max-points", help="At most this many steps on the map."),
    clusters: int = typer.Option(8, "--clusters", help="k-means state clusters for the entropy."),
    template: Optional[str] = typer.Option(None, "--template", help="Reward template (file or shipped "
                                           "name) whose per-step rewards feed the trace and the reward "
                                           "colours; without one the trace rewards are zero."),
    seed: int = typer.Option(0, "--seed", help="Seed of the encoder, the sample and the t-SNE."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (fidelity and entropy figures)."),
) -> None:
    """Map the encoded states with t-SNE, check that task types separate, and measure entropy."""
    from core.state.features import StateEncoderConfig  # deferred: loads torch
    from core.state.statemap import TsneConfig, states_map  # deferred: loads torch and pandas

    report = states_map(
        open_workspace(), **_source(episodes, dataset), out=out, space=space,
        encoder=StateEncoderConfig(gating=gating, intent=intent, seed=seed),  # type: ignore[arg-type]
        tsne=TsneConfig(seed=seed), max_points=max_points, clusters=clusters, template=template,
        progress=None if as_json else (lambda msg: typer.echo(f"… {msg}", err=True)))
    if as_json:
        print_json(report.summary(out))
        return
    f = report.fidelity
    typer.echo(f"Wrote the map's points to {out} ({len(report.index)} of {report.n_steps} steps)")
    typer.echo(f"Fidelity: {f.verdict}")
    if f.silhouette_intent_off is not None:
        typer.echo(f"  silhouette with the intent encoder off: {f.silhouette_intent_off:.3f}")
    _print_entropy(report.entropy)


@app.command("entropy")
def entropy(
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="An episodes file."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="A dataset of the workspace."),
    clusters: int = typer.Option(8, "--clusters", help="k-means state clusters."),
    seed: int = typer.Option(0, "--seed", help="Seed of the encoder and the clustering."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Shannon entropy of the logged actions: overall, per tool, per state cluster."""
    from core.state.features import StateEncoderConfig  # deferred: loads torch
    from core.state.statemap import states_entropy  # deferred: loads torch and pandas

    report = states_entropy(open_workspace(), **_source(episodes, dataset), clusters=clusters,
                            encoder=StateEncoderConfig(seed=seed))
    if as_json:
        print_json(report.to_dict())
        return
    _print_entropy(report)
