"""``rwb review``: work the review queue of high-risk actions (``core.guard.review``).

``send`` puts a step of a recorded episode on the queue; ``show`` prints what a
reviewer reads about an item (``core.govern.review_context``); ``claim`` takes the
oldest open item (or the one named) for a lease; ``decide`` approves it
("reasonable exploration": it becomes training data) or rejects it (it becomes a
mask rule), exactly once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

import typer

from core.cli import open_workspace, print_json
from core.cli.acting import acting_user, as_option
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.govern.review_context import ReviewContext
    from core.guard.review import ReviewItem

app = typer.Typer(help="The review queue of high-risk actions: list, send, claim, decide, stats.",
                  no_args_is_help=True)


def _line(item: "ReviewItem") -> str:
    status = item.status + (" (expired)" if item.claim_expired else "")
    who = item.decided_by or item.claimed_by or "-"
    what = item.action_label or item.token_name or f"token {item.token_id}"
    return (f"#{item.id:<6} {status:<18} {item.origin:<9} {item.dataset or '-':<18} "
            f"{item.task_type or '-':<16} {what:<32} {who:<12} {item.reason}")


def _decided(decision: str) -> str:
    """The past tense of a decision: "approved", "rejected"."""
    return {"approve": "approved", "reject": "rejected"}.get(decision, decision)


def _show(item: "ReviewItem") -> None:
    typer.echo(_line(item))
    typer.echo(f"  state: {json.dumps(item.state, ensure_ascii=False)}")
    comps = ", ".join(f"{c['name']}={c['value']:.3g}" for c in item.reward_components)
    typer.echo(f"  reward components: {comps or '-'}")
    if item.claim_expires and item.status == "claimed":
        typer.echo(f"  claimed by {item.claimed_by} until {item.claim_expires}")
    if item.decision:
        typer.echo(f"  {_decided(item.decision)} by {item.decided_by} at {item.decided_at}: "
                   f"{item.comment or ''}")


@app.command("list")
def list_items(
    status: Optional[str] = typer.Option(
        None, "--status", help="pending, claimed, decided, or open (pending or claim expired)."),
    origin: Optional[str] = typer.Option(None, "--origin", help="training or serving."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Only this dataset."),
    limit: int = typer.Option(100, "--limit", help="At most this many items."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List review items, oldest first."""
    from core.guard import review  # deferred: keeps rwb --help fast

    ws = open_workspace()
    items = review.list_items(ws, status=status, origin=origin, dataset=dataset, limit=limit)
    if as_json:
        print_json({"items": items})
        return
    if not items:
        typer.echo("no review items" + (f" with status {status}" if status else ""))
    for item in items:
        typer.echo(_line(item))


@app.command("show")
def show(
    item_id: int = typer.Argument(..., help="Review item id."),
    template: Optional[str] = typer.Option(
        None, "--template", help="Score the step's reward components with this template (name or "
                                 "name@N; default: the dataset's, see docs/governance.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show what a reviewer reads about one item: the request, the call with its arguments,
    the rule that flagged it, the reward components, the steps before it, the tool's result,
    how similar items were decided, and the item's event log."""
    from core.govern.review_context import review_context  # deferred: keeps rwb --help fast

    ws = open_workspace()
    context = review_context(ws, item_id, template=template)
    if as_json:
        print_json(context)
        return
    _show_context(context)


def _figure(x: float, unit: str | None) -> str:
    if unit == "share":
        return f"{x:.0%}"
    return f"{x:.3g}" + (f" {unit}" if unit else "")


def _block(title: str, text: str | None) -> None:
    typer.echo(f"{title}:")
    for line in (text or "-").splitlines() or ["-"]:
        typer.echo(f"  {line}")


def _show_context(c: "ReviewContext") -> None:
    item = c.item
    typer.echo(_line(item))
    _block(f"request ({c.request_source})" if c.request_source else "request", c.request)
    _block("call", c.call)
    if c.arguments:
        _block("arguments", c.arguments)
    if c.arguments_note:
        typer.echo(f"  ({c.arguments_note})")
    threshold = "" if c.rule.threshold is None else f"  threshold {_figure(c.rule.threshold, c.rule.unit)}"
    value = "" if c.rule.value is None else f"  value {_figure(c.rule.value, c.rule.unit)}"
    _block(f"why it is here: {c.rule.title}", c.rule.why + (f"\n({c.rule.measure}:{value}{threshold})"
                                                             if c.rule.measure else ""))
    typer.echo("reward components:")
    for comp in c.components:
        typer.echo(f"  {comp.label:<28} {comp.value:+.3g}")
    if c.step_reward is not None:
        typer.echo(f"  {'step reward':<28} {c.step_reward:+.3g}")
    typer.echo(f"  ({c.components_note})")
    shown = len(c.steps_before)
    more = f", the last {shown}" if shown < c.steps_before_total else ""
    typer.echo(f"before it ({c.steps_before_total} entries{more}):")
    for s in c.steps_before:
        what = s.tool or s.kind
        reward = "" if s.reward is None else f"  reward {s.reward:+.3g}"
        typer.echo(f"  t={s.t:<3} {s.who:<5} {what:<22} {s.text}{reward}")
        if s.result:
            typer.echo(f"  {'':<34}→ {s.result}")
    _block("tool result", c.result)
    for group in c.similar:
        typer.echo(f"decided before, with {group.basis}: {group.approved} approved, "
                   f"{group.rejected} rejected")
        for d in group.last:
            typer.echo(f"  #{d.item_id} {d.decision} by {d.decided_by} at {d.decided_at}: "
                       f"{d.comment or '(no note)'}")
    typer.echo(f"rejecting blocks: {c.reject_blocks}")
    if item.claim_expires and item.status == "claimed":
        typer.echo(f"claimed by {item.claimed_by} until {item.claim_expires}")
    if item.decision:
        typer.echo(f"{_decided(item.decision)} by {item.decided_by} at {item.decided_at}: "
                   f"{item.comment or ''}")
    typer.echo("events:")
    for e in item.events:
        typer.echo(f"  {e.at} {e.event:<9} {e.actor}")


@app.command("send")
def send(
    dataset: str = typer.Argument(..., help="Dataset of the recorded episode."),
    episode_id: str = typer.Argument(..., help="Episode id."),
    step: int = typer.Argument(..., help="Step number (t) within the episode."),
    reason: str = typer.Option("", "--reason", "-m",
                               help="What the reviewer should look at (at most 500 characters)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Send one step of a recorded episode to the review queue."""
    from core.guard import review  # deferred: keeps rwb --help fast

    ws = open_workspace()
    item = review.send_step(ws, acting_user(ws, as_name), dataset, episode_id, step, reason)
    if as_json:
        print_json(item)
    else:
        typer.echo(f"sent to review as item #{item.id}")
        _show(item)


@app.command("claim")
def claim(
    item_id: Optional[int] = typer.Argument(None, help="Item to claim (default: oldest open)."),
    lease: Optional[float] = typer.Option(None, "--lease",
                                          help="Seconds the claim lasts (default 300)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Only from this dataset."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Claim an item to decide it (atomic; the claim expires after --lease seconds)."""
    from core.guard import review  # deferred: keeps rwb --help fast

    ws = open_workspace()
    item = review.claim(ws, acting_user(ws, as_name), item_id,
                        review.DEFAULT_LEASE_SECONDS if lease is None else lease, dataset=dataset)
    if as_json:
        print_json({"item": item})
    elif item is None:
        typer.echo("nothing to claim: the queue has no open items")
    else:
        _show(item)


@app.command("decide")
def decide(
    item_id: int = typer.Argument(..., help="The claimed item."),
    decision: str = typer.Argument(..., help="approve or reject."),
    comment: str = typer.Option("", "--comment", "-m",
                                help="Why (required to reject: it stays with the mask rule)."),
    pattern: Optional[str] = typer.Option(
        None, "--pattern", help="Reject only: the state pattern to mask, as a JSON mask "
                                "condition (default: the item's state, numbers ±10%)."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Decide a claimed item once: approve (training data) or reject (mask rule)."""
    from core.guard import review  # deferred: keeps rwb --help fast

    ws = open_workspace()
    when = None
    if pattern is not None:
        try:
            when = json.loads(pattern)
        except ValueError as exc:
            raise InputError(f"--pattern is not JSON: {exc}", field="pattern") from exc
    item = review.decide(ws, acting_user(ws, as_name), item_id, decision, comment,
                         pattern=when)
    if as_json:
        print_json(item)
    else:
        outcome = ("labelled as reasonable exploration" if decision == "approve"
                   else "now a mask rule")
        typer.echo(f"#{item.id} {_decided(str(item.decision))} by {item.decided_by}: {outcome}")


@app.command("release")
def release(
    item_id: int = typer.Argument(..., help="The claimed item."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Give a claimed item back to the queue undecided."""
    from core.guard import review  # deferred: keeps rwb --help fast

    ws = open_workspace()
    item = review.release(ws, acting_user(ws, as_name), item_id)
    print_json(item) if as_json else typer.echo(f"#{item.id} is back in the queue")


@app.command("stats")
def stats(
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Only this dataset."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Queue statistics: pending, claimed, decided, oldest open age, approve rate."""
    from core.guard import review  # deferred: keeps rwb --help fast

    s = review.stats(open_workspace(), dataset)
    if as_json:
        print_json(s)
        return
    rate = "-" if s.approve_rate is None else f"{s.approve_rate:.0%}"
    age = "-" if s.oldest_pending_age_s is None else f"{s.oldest_pending_age_s:.0f}s"
    typer.echo(f"pending {s.pending}  claimed {s.claimed}  expired claims "
               f"{s.expired_claims}  decided {s.decided} (approved {s.approved}, "
               f"rejected {s.rejected}, approve rate {rate})  oldest open {age}")
