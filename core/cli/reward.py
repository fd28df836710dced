"""``rwb reward``: validate a reward template, score episodes with it, check its expectations.

``validate`` reads a template (a file or a shipped name such as ``finance_risk``)
and names the key and line of any problem; ``score`` prints per-component
statistics and episode returns (``--out`` writes the per-step table as CSV or
Parquet); ``check`` prints each expectation as PASS/FAIL with the numbers and
exits 1 when one fails; ``calibrate`` measures the template against the recorded
outcomes (components' power, ROC, calibration; grouped by task); ``learn`` fits the
``learned_outcome`` term on labelled episodes and saves it with the template.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import typer

from core.base.results import to_jsonable
from core.cli import open_workspace, print_json, progress_printer
from core.cli.acting import acting_user, as_option

if TYPE_CHECKING:
    from core.rewards import ScoreResult

app = typer.Typer(help="Reward pyramids: validate templates, score episodes, check expectations.",
                  no_args_is_help=True)

TEMPLATE_HELP = ("Template file, a template name (finance_risk: its latest version saved in the "
                 "workspace, else the shipped file), or NAME@VERSION (finance_risk@3; @0 = shipped).")
#: ``--group-key``: where the task id of each episode is (cross-validation never splits a task).
GROUP_KEY_OPTION = typer.Option(None, "--group-key", help="Dotted key of the task id in each imported "
                                "record (default: task_id, else the request).")


def _scoring_progress():
    """A progress bar for scoring on a terminal's stderr: components, then the texts the
    sentence model embeds (the slow part of a first run).  Nothing when stderr is a log."""
    import contextlib

    from rich.console import Console

    if not Console(stderr=True).is_terminal:
        return None, contextlib.nullcontext()
    update, bar = progress_printer("scoring", "item", lambda m: (m["done"], m["total"]),
                                   lambda m: f"{m['stage']} {m['what']}".strip())
    return update, bar


def _workspace_for(template: str):
    """The workspace, so that saved versions (``finance_risk@3``) resolve; none is needed (or
    created) to validate a file."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    if Path(template).is_file():
        return None
    try:
        return open_workspace(create=False)
    except WorkspaceError:
        return None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


@app.command("validate")
def validate(
    template: str = typer.Argument(..., help=TEMPLATE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Validate a template; errors name the key and the line."""
    from core import rewards  # deferred: loads pandas and scipy

    info = rewards.validate(template, ws=_workspace_for(template))
    if as_json:
        print_json(info)
        return
    n = sum(len(lv.components) for lv in info.levels) + len(info.penalties) + len(info.episode_terms)
    typer.echo(f"ok: template {info.name!r} (format version {info.version}): "
               f"{len(info.levels)} levels, {n} components, "
               f"{len(info.expectations)} expectations, gating {'on' if info.gating else 'off'}")
    for lv in info.levels:
        comps = ", ".join(f"{k}={v:g}" for k, v in lv.components.items())
        gate = f" gate {lv.gate:g}" if lv.gate is not None else ""
        typer.echo(f"  {lv.key} {lv.title}{gate}: {comps}")
    if info.penalties:
        typer.echo("  penalties: " + ", ".join(f"{k}={v:g}" for k, v in info.penalties.items()))
    if info.episode_terms:
        typer.echo("  episode terms: " + ", ".join(f"{k}={v:g}" for k, v in info.episode_terms.items()))


def _summary_json(result: ScoreResult) -> dict[str, Any]:
    """The score's summary followed by every episode's return: ``rwb reward score --json``."""
    return {**cast("dict[str, Any]", to_jsonable(result.summary())), "episode_returns": result.episode_returns}


@app.command("score")
def score(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="Episodes file (any importable format)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Workspace dataset name."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the per-step table (.csv or .parquet)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (summary + episode returns)."),
) -> None:
    """Score episodes: per-step component values, gated level totals, rewards, episode returns."""
    from core import rewards  # deferred: loads pandas and scipy

    update, bar = _scoring_progress()
    with bar:
        result = rewards.score(open_workspace(), template, dataset=dataset, episodes=episodes, progress=update)
    written = result.write(out) if out is not None else None
    if as_json:
        body = _summary_json(result)
        if written is not None:
            body["out"] = str(written)
        print_json(body)
        return
    s = result.summary()
    source = f" ({result.template.source})" if result.template.source else ""
    typer.echo(f"template {s.template!r}{source}: {s.n_episodes} episodes, {s.n_steps} steps")
    typer.echo(f"  {'component':<26}{'level':<9}{'weight':>8}{'mean':>10}{'std':>10}{'min':>10}{'max':>10}")
    for name, c in s.components.items():
        typer.echo(f"  {name:<26}{c.level:<9}{c.weight:>8.3g}{_fmt(c.mean):>10}"
                   f"{_fmt(c.std):>10}{_fmt(c.min):>10}{_fmt(c.max):>10}")
    r = s.returns
    typer.echo(f"  episode return: mean {_fmt(r.mean)}, std {_fmt(r.std)}, "
               f"min {_fmt(r.min)}, max {_fmt(r.max)}")
    if written is not None:
        typer.echo(f"wrote {written}")


@app.command("check")
def check(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="Episodes file (any importable format)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Workspace dataset name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Evaluate the template's expectations; exit 1 when one fails."""
    from core import rewards  # deferred: loads pandas and scipy
    from core.rewards.expectations import ExpectationsFailed  # deferred: loads pandas and scipy

    report = rewards.check(open_workspace(), template, dataset=dataset, episodes=episodes)
    if as_json:
        print_json(report.to_dict())
    else:
        for r in report.results:
            typer.echo(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.message}")
        if not report.results:
            typer.echo(f"template {report.template!r} has no expectations")
        else:
            typer.echo(f"{len(report.results) - len(report.failed)} of {len(report.results)} "
                       f"expectations pass")
    if not report.passed:
        names = ", ".join(r.name for r in report.failed)
        raise ExpectationsFailed(f"{len(report.failed)} of {len(report.results)} expectations "
                                 f"failed: {names}")


@app.command("calibrate")
def calibrate(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    dataset: str = typer.Option(..., "--dataset", help="Workspace dataset with recorded outcomes."),
    group_key: Optional[str] = GROUP_KEY_OPTION,
    boot: int = typer.Option(200, "--boot", help="Bootstrap resamples over tasks for the intervals."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What the recorded outcomes say: each component's power, the return's ROC and calibration."""
    from core.rewards.calibration import calibrate as run_calibration  # deferred: loads pandas and scipy

    update, bar = _scoring_progress()
    with bar:
        r = run_calibration(open_workspace(), template, dataset=dataset, group_key=group_key, n_boot=boot,
                            progress=update)
    if as_json:
        print_json(r.to_json())
        return
    typer.echo(f"template {r.template!r} on {dataset}: {r.n_labelled} of {r.n_episodes} episodes labelled, "
               f"{r.n_tasks} tasks, success {r.success_rate:.2f}")
    typer.echo(f"  {'score':<26}{'level':<9}{r.metric:>9}   90% interval (bootstrap over tasks)")
    for p in [r.return_power, *r.components]:
        typer.echo(f"  {p.name:<26}{p.level:<9}{_fmt(p.value):>9}   [{_fmt(p.ci90[0])}, {_fmt(p.ci90[1])}]")
    if r.heldout_auc is not None:
        typer.echo(f"  return → success, {r.folds} folds grouped by task: held-out AUC {_fmt(r.heldout_auc)}, "
                   f"Brier {_fmt(r.heldout_brier)}")


@app.command("learn")
def learn(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    dataset: str = typer.Option(..., "--dataset", help="Workspace dataset with recorded outcomes."),
    group_key: Optional[str] = GROUP_KEY_OPTION,
    embed: str = typer.Option("last_words", "--embed", help="last_words (sentence embedding of the "
                              "agent's last words as features) or none."),
    c: float = typer.Option(1.0, "--C", help="Inverse L2 regularisation strength of the logistic model."),
    save: bool = typer.Option(False, "--save", help="Save the template with the fitted term as its "
                              "next version."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Fit the learned_outcome term on labelled episodes (held-out AUC grouped by task)."""
    from core import rewards  # deferred: loads pandas and scipy
    from core.rewards.calibration import calibrate_result, outcome_columns  # deferred: loads pandas and scipy
    from core.rewards.learned import learn as fit_learned, without_learned_outcome  # deferred: loads pandas and scipy
    from core.rewards.versions import (  # deferred: loads pandas and scipy
        get_template, parse_spec, resolve_template, save_template)

    ws = open_workspace()
    base = resolve_template(ws, template)
    base_version = get_template(ws, *parse_spec(template)).version if save else None
    fitted, fit = fit_learned(ws, base, dataset=dataset, group_key=group_key, embed=embed, c=c)
    labels, groups = outcome_columns(ws.load_episodes(dataset), group_key)
    hand_built = without_learned_outcome(base)   # a term fitted earlier would have seen these labels
    pyramid = calibrate_result(rewards.score(ws, hand_built, dataset=dataset), labels, groups, n_boot=20)
    body: dict[str, Any] = {"template": base.name, "dataset": dataset, "learned_heldout_auc": fit.heldout_auc,
                            "pyramid_heldout_auc": pyramid.heldout_auc, "pyramid_auc": pyramid.return_power.value,
                            "folds": fit.folds, "labelled": fit.n_labelled, "tasks": fit.n_tasks,
                            "features": len(fit.params["features"]), "saved": None}
    if save:
        saved = save_template(ws, acting_user(ws, as_name), base.name, fitted, base_version,
                              f"learned_outcome fitted on {dataset} (held-out AUC {fit.heldout_auc:.3f})")
        body["saved"] = saved.label
    if as_json:
        print_json(body)
        return
    typer.echo(f"learned_outcome on {dataset}: {fit.n_labelled} labelled episodes, {fit.n_tasks} tasks, "
               f"{body['features']} features")
    typer.echo(f"  held-out AUC, {fit.folds} folds grouped by task: learned {_fmt(fit.heldout_auc)}, "
               f"hand-built pyramid {_fmt(pyramid.heldout_auc)} (its return's AUC {_fmt(pyramid.return_power.value)})")
    typer.echo(f"  saved as {body['saved']}" if save else "  not saved (add --save to keep it as a new version)")
