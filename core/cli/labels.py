"""``rwb labels``: people's outcome labels of recorded episodes (``core.rewards.labels``).

``next`` proposes the episodes to label next (most uncertain under the current model,
spread over tasks, never one already labelled); ``add`` labels one episode a success or a
failure, or withdraws its label (``none``); ``list`` prints the current labels and the
label set's version; ``history`` every label event of one episode.  Labels feed
``rwb reward calibrate``, ``learn`` and ``tune``.
"""

from __future__ import annotations

from typing import Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option

app = typer.Typer(help="Outcome labels of recorded episodes: what to label next, add, list, history.",
                  no_args_is_help=True)

DATASET_OPTION = typer.Option(..., "--dataset", help="Workspace dataset the episodes belong to.")


def _word(outcome: int | None) -> str:
    return {1: "success", 0: "failure", None: "withdrawn"}[outcome]


@app.command("next")
def next_(
    dataset: str = DATASET_OPTION,
    n: int = typer.Option(10, "-n", help="How many episodes to propose (1 to 200)."),
    template: Optional[str] = typer.Option(None, "--template", "-t", help="Template whose fitted "
                                           "learned_outcome term (else whose return) ranks the episodes; "
                                           "default: a model fitted on the labels so far, else tool_agent."),
    group_key: Optional[str] = typer.Option(None, "--group-key", help="Dotted key of the task id in each "
                                            "imported record (default: task_id, else the request)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Propose the next episodes to label: the most uncertain, spread over tasks."""
    from core.rewards.label_queue import propose_next  # deferred: loads pandas and scipy

    p = propose_next(open_workspace(), dataset, n, template, group_key=group_key)
    if as_json:
        print_json(p)
        return
    typer.echo(f"{dataset}: {p.n_labelled} labelled by people, {p.n_known} of {p.n_episodes} episodes with a "
               f"known outcome, {p.n_tasks_with_both} of {p.n_tasks} tasks with both outcomes; "
               f"label set version {p.labels_version}")
    typer.echo(f"ranked by {p.model_note}")
    if not p.items:
        typer.echo("nothing left to label: every episode has a label")
    for item in p.items:
        guess = "-" if item.probability is None else f"{item.probability:.2f}"
        typer.echo(f"  {item.episode_id}  task {item.task}  p(success) {guess}")
        typer.echo(f"    request: {item.request[:160]}")
        typer.echo(f"    last answer: {item.last_answer[:160]}")
        typer.echo(f"    why: {item.why}")


@app.command("add")
def add(
    episode_id: str = typer.Argument(..., help="Episode id."),
    outcome: str = typer.Argument(..., help="success, failure, or none (withdraw the label)."),
    dataset: str = DATASET_OPTION,
    note: Optional[str] = typer.Option(None, "--note", help="Why (at most 2,000 characters)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Label one episode a success or a failure, or withdraw its label (none)."""
    from core.rewards.labels import add_label, labels_version, parse_outcome  # deferred: loads numpy

    value = parse_outcome(outcome)
    ws = open_workspace()
    event = add_label(ws, acting_user(ws, as_name), dataset, episode_id, value, note=note)
    version = labels_version(ws, dataset)
    if as_json:
        print_json({"event": event, "labels_version": version})
        return
    typer.echo(f"{event.episode_id}: {_word(event.outcome)} (by {event.created_by}); label set version {version}")


@app.command("list")
def list_labels(
    dataset: str = DATASET_OPTION,
    withdrawn: bool = typer.Option(False, "--withdrawn", help="Also episodes whose label was withdrawn."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The current label of every labelled episode, and the label set's version."""
    from core.rewards.labels import label_events, labels_version  # deferred: loads numpy

    ws = open_workspace()
    events = label_events(ws, dataset, withdrawn=withdrawn)
    version = labels_version(ws, dataset)
    if as_json:
        print_json({"dataset": dataset, "labels_version": version, "labels": events})
        return
    typer.echo(f"{dataset}: {sum(e.outcome is not None for e in events)} labelled episodes, "
               f"label set version {version}")
    for e in events:
        typer.echo(f"  {e.episode_id}  {_word(e.outcome):<9} {e.created_by:<12} {e.created_at}  {e.note or ''}")


@app.command("history")
def history(
    episode_id: str = typer.Argument(..., help="Episode id."),
    dataset: str = DATASET_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every label event of one episode, oldest first."""
    from core.rewards.labels import label_history  # deferred: loads numpy

    events = label_history(open_workspace(), dataset, episode_id)
    if as_json:
        print_json({"dataset": dataset, "episode_id": episode_id, "events": events})
        return
    if not events:
        typer.echo(f"{episode_id}: never labelled")
    for e in events:
        typer.echo(f"  #{e.id}  {_word(e.outcome):<9} {e.created_by:<12} {e.created_at}  {e.note or ''}")
