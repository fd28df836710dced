"""``rwb reward``: validate a reward template, score episodes with it, check its expectations.

``validate`` reads a template (a file or a shipped name such as ``finance_risk``)
and names the key and line of any problem; ``score`` prints per-component
statistics and episode returns (``--out`` writes the per-step table as CSV or
Parquet); ``check`` prints each expectation as PASS/FAIL with the numbers and
exits 1 when one fails; ``export`` and ``serve`` hand the reward to RL frameworks (docs/export.md);
``calibrate`` measures the template against the recorded
outcomes and people's labels (components' power over all pairs and within tasks, ROC,
calibration, the learning curve; grouped by task); ``learn`` fits the
``learned_outcome`` term on labelled episodes and saves it with the template.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import typer

from core.base.results import to_jsonable
from core.cli import open_workspace, print_json, progress_printer, workspace_for_template
from core.cli.acting import acting_user, as_option
from core.cli.reward_export import export
from core.cli.reward_serve import serve

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


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


@app.command("validate")
def validate(
    template: str = typer.Argument(..., help=TEMPLATE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Validate a template; errors name the key and the line."""
    from core import rewards  # deferred: loads pandas and scipy

    info = rewards.validate(template, ws=workspace_for_template(template))
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
    each: bool = typer.Option(False, "--each", help="Score every episode on its own (its own catalog and "
                              "history), as the exported reward and `rwb reward serve` score a trajectory."),
) -> None:
    """Score episodes: per-step component values, gated level totals, rewards, episode returns."""
    from core import rewards  # deferred: loads pandas and scipy

    update, bar = _scoring_progress()
    with bar:
        result = rewards.score(open_workspace(), template, dataset=dataset, episodes=episodes, progress=update,
                               each=each)
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
    learning_curve: Optional[bool] = typer.Option(None, "--learning-curve/--no-learning-curve", help="The "
                                                  "learning curve: held-out AUC of a model fitted on 10, 20, 40, "
                                                  "80, 160 labelled episodes (default: in --json, not in the text)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What the outcomes say (people's labels over the recorded ones): each component's power over all
    pairs and within tasks, the return's ROC and calibration, and the learning curve."""
    from core.rewards.calibration import calibrate as run_calibration  # deferred: loads pandas and scipy
    from core.rewards.label_queue import dataset_learning_curve  # deferred: loads pandas and scipy

    ws = open_workspace()
    update, bar = _scoring_progress()
    with bar:
        r = run_calibration(ws, template, dataset=dataset, group_key=group_key, n_boot=boot, progress=update)
    wanted = as_json if learning_curve is None else learning_curve
    curve = dataset_learning_curve(ws, dataset, group_key=group_key) if wanted else None
    if as_json:
        print_json({**r.to_json(), "learning_curve": curve})
        return
    typer.echo(f"template {r.template!r} on {dataset}: {r.n_labelled} of {r.n_episodes} episodes labelled, "
               f"{r.n_tasks} tasks" + ("" if r.tasks_with_both is None else f" ({r.tasks_with_both} with both "
                                       "outcomes)") + f", success {r.success_rate:.2f}")
    within = r.binary
    typer.echo(f"  {'score':<26}{'level':<9}{r.metric:>9}   {'90% interval':<18}"
               + (f"{'within-task':>11}   {'90% interval':<18}{'tasks':>6}" if within else "")
               + "   (intervals: bootstrap over tasks)")
    for p in [r.return_power, *r.components]:
        line = f"  {p.name:<26}{p.level:<9}{_fmt(p.value):>9}   {_interval(p.ci90):<18}"
        if within and p.within_task is not None:
            w = p.within_task
            shown = (f"{_fmt(w.value):>11}   {_interval(w.ci90):<18}" if w.n_tasks else f"{'-':>11}   {'':<18}")
            line += f"{shown}{w.n_tasks:>6}"
        typer.echo(line)
    if r.heldout_auc is not None:
        typer.echo(f"  return → success, {r.folds} folds grouped by task: held-out AUC {_fmt(r.heldout_auc)}, "
                   f"Brier {_fmt(r.heldout_brier)}")
    if curve is not None:
        _echo_learning_curve(curve)


def _interval(ci: tuple[float, float]) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _echo_learning_curve(curve: Any) -> None:
    """The learning curve as a table: one row per number of labelled episodes."""
    seeds = curve.points[0].seeds if curve.points else 0
    models = ", ".join(f"{c.features}/{c.objective}/C={c.C:g}" for c in curve.configs)
    typer.echo(f"learning curve: held-out tasks, {curve.folds} folds × {seeds} seeds, model {models}")
    typer.echo(f"  {'labelled':>9}{'all pairs':>11}   {'range over seeds':<18}{'within-task':>12}   range over seeds")
    for p in curve.points:
        typer.echo(f"  {p.labelled:>9}{_fmt(p.all_pairs):>11}   {_interval(p.all_pairs_range):<18}"
                   f"{_fmt(p.within_task):>12}   {_interval(p.within_task_range)}")
    if curve.skipped:
        typer.echo(f"  not measured: {', '.join(map(str, curve.skipped))} labelled (more than a training fold holds)")


@app.command("learn")
def learn(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    dataset: str = typer.Option(..., "--dataset", help="Workspace dataset with recorded outcomes or labels."),
    group_key: Optional[str] = GROUP_KEY_OPTION,
    embed: str = typer.Option("last_words", "--embed", help="last_words (sentence embeddings of the "
                              "request and the last answer among the feature sets) or none."),
    c: Optional[float] = typer.Option(None, "--C", help="Fix the inverse L2 regularisation strength "
                                      "(default: chosen by inner cross-validation)."),
    save: bool = typer.Option(False, "--save", help="Save the template with the fitted term as its "
                              "next version."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Fit the learned_outcome term on labelled episodes (nested CV by task, beside two baselines)."""
    from core import rewards  # deferred: loads pandas and scipy
    from core.rewards.calibration import calibrate_result  # deferred: loads pandas and scipy
    from core.rewards.labels import dataset_outcomes  # deferred: loads pandas and scipy
    from core.rewards.learned import learn as fit_learned, without_learned_outcome  # deferred: loads pandas and scipy
    from core.rewards.versions import (  # deferred: loads pandas and scipy
        get_template, parse_spec, resolve_template, save_template)

    ws = open_workspace()
    base = resolve_template(ws, template)
    base_version = get_template(ws, *parse_spec(template)).version if save else None
    fitted, fit = fit_learned(ws, base, dataset=dataset, group_key=group_key, embed=embed, c=c)
    labels, groups = dataset_outcomes(ws, dataset, group_key)
    hand_built = without_learned_outcome(base)   # a term fitted earlier would have seen these labels
    pyramid = calibrate_result(rewards.score(ws, hand_built, dataset=dataset), labels, groups, n_boot=20)
    h = fit.heldout
    body: dict[str, Any] = {"template": base.name, "dataset": dataset, "learned": h.learned,
                            "baseline_counts": h.baseline_counts, "baseline_counts_embed": h.baseline_counts_embed,
                            "tasks_with_both": h.tasks_with_both, "learned_heldout_auc": fit.heldout_auc,
                            "models": fit.params["models"],
                            "pyramid_heldout_auc": pyramid.heldout_auc, "pyramid_auc": pyramid.return_power.value,
                            "folds": fit.folds, "labelled": fit.n_labelled, "tasks": fit.n_tasks,
                            "features": len(fit.params["features"]), "saved": None}
    if save:
        saved = save_template(ws, acting_user(ws, as_name), base.name, fitted, base_version,
                              f"learned_outcome fitted on {dataset} (held-out AUC {_fmt(fit.heldout_auc)} "
                              f"all pairs, {_fmt(h.learned.within_task.value)} within task)")
        body["saved"] = saved.label
    if as_json:
        print_json(body)
        return
    typer.echo(f"learned_outcome on {dataset}: {fit.n_labelled} labelled episodes, {fit.n_tasks} tasks "
               f"({h.tasks_with_both} with both outcomes), {body['features']} features; "
               f"model: {', '.join(fit.params['models'])}")
    typer.echo(f"  held-out tasks, nested cross-validation ({fit.folds} outer folds grouped by task), "
               "AUC with 90% interval over tasks:")
    typer.echo(f"  {'':<30}{'all pairs':>24}{'within task':>24}")
    for label, fig in (("learned", h.learned), ("baseline: counts", h.baseline_counts),
                       ("baseline: counts + embeddings", h.baseline_counts_embed)):
        cells = [f"{_fmt(f.value)} [{_fmt(f.ci90[0])}, {_fmt(f.ci90[1])}]" for f in (fig.all_pairs, fig.within_task)]
        typer.echo(f"  {label:<30}{cells[0]:>24}{cells[1]:>24}")
    typer.echo(f"  hand-built pyramid: held-out AUC {_fmt(pyramid.heldout_auc)} "
               f"(its return's AUC {_fmt(pyramid.return_power.value)})")
    typer.echo(f"  saved as {body['saved']}" if save else "  not saved (add --save to keep it as a new version)")


# The reward outside the workbench (docs/export.md): each command in its own module.
app.command("export")(export)
app.command("serve")(serve)
