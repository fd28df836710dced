"""``rwb tune``: Optuna studies over a reward pyramid's weights (``core.tuning``).

``rwb tune --template T --dataset D`` runs a study in this process (``--background``
starts it as a detached worker instead); ``rwb tune apply STUDY`` writes the best
feasible weights as a new template version; ``prefer`` / ``preferences`` manage the
analysts' pairwise labels; ``list``, ``show`` and ``stop`` watch and end studies.

Several machines tune one study with a shared storage::

    rwb tune --template finance_risk --dataset finance --storage postgresql://u@db/optuna --study fin-1
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from core.cli import open_workspace, print_json, progress_printer
from core.cli.acting import acting_user, as_option
from core.base.errors import InputError

app = typer.Typer(help="Tune a reward pyramid's weights with Optuna: run studies, apply results, label preferences.",
                  invoke_without_command=True, no_args_is_help=False)

STORAGE_HELP = ("SQLAlchemy URL of a shared Optuna storage (postgresql://…) or an Optuna journal file (….log); "
                "workers on one storage and study share the study. Default: the workspace's "
                "artifacts/tuning/optuna.log.")


def _fmt(x: Any) -> str:
    return "-" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))


def _tuning() -> Any:
    """``core.tuning``, imported when a tuning command runs (optuna and the numpy stacks stay out
    of ``rwb --help``), with optuna's INFO lines off: one per trial at ~1,000 trials/min would
    drown the output and the worker logs."""
    import optuna

    from core import tuning  # deferred: loads optuna and sklearn

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return tuning


@app.callback()
def tune(
    ctx: typer.Context,
    template: Optional[str] = typer.Option(None, "--template", "-t",
                                           help="Template: file, shipped or workspace name, or name@VERSION."),
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="Episodes file (any importable format)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Workspace dataset name."),
    objective: str = typer.Option("outcome", "--objective", help="outcome | preferences | policy."),
    split_by: str = typer.Option("task", "--split-by",
                                 help="Keep episodes with the same value on one side of the train/held-out "
                                      "split: task, episode, task_type, domain, behaviour or meta.KEY."),
    heldout: float = typer.Option(0.5, "--heldout", help="Share of the episodes held out for reporting (whole "
                                                        "tasks; the outcome objective never sees them)."),
    group_key: Optional[str] = typer.Option(None, "--group-key",
                                            help="Dotted key of the imported record holding the task id "
                                                 "(default: task_id, else the user's request); split-by task."),
    folds: int = typer.Option(5, "--folds", help="Outcome objective: task-grouped folds of the design tasks."),
    label: str = typer.Option("success", "--label",
                              help="Outcome label: success, resolved, final_reward, business_metric, sentiment."),
    threshold: float = typer.Option(0.0, "--threshold", help="A numeric label counts as success above this."),
    metric: str = typer.Option("within_task", "--metric",
                               help="Outcome objective: within_task (smooth AUC over a success and a failure of "
                                    "the same task; all pairs when under 5 design tasks have both outcomes), "
                                    "all_pairs (smooth AUC over every pair; soft_auc is its older name), auc or "
                                    "kendall."),
    withhold: Optional[bool] = typer.Option(None, "--withhold-outcome/--show-outcome",
                                            help="Hide the recorded outcome from the components (default: "
                                                 "hidden, except for the policy objective)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split and the sampler."),
    sampler: str = typer.Option("tpe", "--sampler", help="tpe (multivariate TPE) or random."),
    trials: int = typer.Option(100, "--trials", help="Trials to run (per worker)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop after this many seconds."),
    storage: Optional[str] = typer.Option(None, "--storage", envvar="RWB_TUNE_STORAGE", help=STORAGE_HELP),
    study: Optional[str] = typer.Option(None, "--study", help="Study name (default: derived from the template, "
                                                              "objective, data and settings)."),
    bound: list[str] = typer.Option([], "--bound", help="NAME=LOW:HIGH for a weight or COMP.PARAM=LOW:HIGH / "
                                                        "COMP.PARAM=a,b,c for a component parameter (repeat)."),
    fix: list[str] = typer.Option([], "--fix", help="Keep this component's weight as in the template (repeat)."),
    policy_config: Optional[str] = typer.Option(None, "--policy-config",
                                                help='PPO settings of one policy trial as JSON, e.g. '
                                                     '\'{"total_steps": 8192}\'.'),
    background: bool = typer.Option(False, "--background", help="Start a detached worker and return at once."),
    run_id: Optional[int] = typer.Option(None, "--run-id", hidden=True),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: best value, best weights, train "
                                                       "and held-out figures."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar / per-trial lines on stderr."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Run a study: tune the template's weights on the data (see `rwb tune --help`)."""
    if ctx.invoked_subcommand is not None:
        return  # the subcommand loads core.tuning itself, once its own options have parsed
    tuning = _tuning()
    if template is None:
        typer.echo(ctx.get_help())
        raise InputError("give a template to tune (--template NAME or FILE)", field="template")
    ws = open_workspace()
    try:
        policy = {}
        if policy_config:
            try:
                policy = json.loads(policy_config)
            except json.JSONDecodeError as exc:
                raise InputError(f"--policy-config is not JSON: {exc}", field="policy_config") from None
            if not isinstance(policy, dict):
                raise InputError("--policy-config must be a JSON object", field="policy_config")
        config = tuning.TuneConfig(objective=objective, split_by=split_by, heldout_fraction=heldout, label=label,
                                   success_threshold=threshold, metric=metric, withhold_outcome=withhold,
                                   seed=seed, sampler=sampler, policy=policy, group_key=group_key, cv_folds=folds)
        actor = acting_user(ws, as_name)
        bounds = tuning.parse_bounds(bound)
    except Exception as exc:
        if run_id is not None:  # a launched worker refused its settings: the Studies list shows why
            tuning.fail_run(ws, run_id, exc)
        raise
    if background:
        started = tuning.launch_tuning(ws, actor, template, dataset=dataset, episodes=episodes, config=config,
                                       trials=trials, storage=storage, study=study, bounds=bounds, fixed=fix)
        if as_json:
            print_json(started)
        else:
            typer.echo(f"study {started.study}: worker {started.pid} started (log {started.log})")
        return
    update, bar = (None, None) if quiet or as_json else _trial_progress()
    if bar is not None:
        bar.start()
    try:
        result = tuning.tune(ws, actor, template, dataset=dataset, episodes=episodes, config=config, trials=trials,
                             storage=storage, study=study, bounds=bounds, fixed=fix, timeout=timeout, run_id=run_id,
                             progress=update)
    finally:
        if bar is not None:
            bar.stop()
    if as_json:
        print_json(result.to_dict())
        return
    d = result.to_dict()
    for warning in d["warnings"]:
        typer.echo(f"warning: {warning}")
    typer.echo(f"study {d['study']} ({d['storage']}): {d['trials_run']} trials in {d['seconds']:.1f} s "
               f"({d['trials_per_min']:.0f}/min), {d['trials_total']} in the study, {d['feasible_trials']} feasible")
    base = (d["baseline"] or {}).get("figures") or {}
    if d["best"] is None:
        typer.echo("no feasible trial yet: every completed trial breaks an expectation")
    else:
        best = d["best"].get("figures") or {"train": {d["metric"]: d["best"]["value"]},
                                             "held_out": {d["metric"]: d["best"]["held_out_value"]}}
        for side in ("train", "held_out"):
            figs = ", ".join(f"{k} {_fmt(v)} (was {_fmt((base.get(side) or {}).get(k))})"
                             for k, v in best[side].items() if isinstance(v, float) or v is None)
            typer.echo(f"  {side:<9} {figs}")
        if d["best"].get("held_out_auc") is not None:
            typer.echo(f"  best trial {d['best']['trial']}: held-out AUC {_fmt(d['best']['held_out_auc'])} on "
                       f"{len(d['split'].get('held_out_groups', []))} held-out "
                       f"{'tasks' if d['split']['by'] == 'task' else 'groups'} (chosen by the "
                       f"{d['split'].get('folds_used')}-fold task-grouped CV of the others)")
        for line in held_out_lines(d.get("held_out_report")):
            typer.echo(line)
        typer.echo("  best weights: " + ", ".join(f"{k}={v:.3g}" for k, v in d["best"]["weights"].items()))
    for s in d["skipped_expectations"]:
        typer.echo(f"  expectation {s['name']!r}: {s['reason']}")
    typer.echo(f"apply with: rwb tune apply {d['study']}")


def _figure(f: dict[str, Any] | None) -> str:
    """``0.712 [0.650, 0.770]`` of an AucFigure as JSON."""
    if not f or f.get("value") is None:
        return "-"
    lo, hi = f.get("ci90") or (None, None)
    return f"{f['value']:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")


def held_out_lines(report: dict[str, Any] | None) -> list[str]:
    """The held-out report as text: both AUCs of the best trial and of the template, with 90% intervals."""
    if not report:
        return []
    primary = "within-task" if report["metric"] == "within_task" else "all-pairs"
    lines = [f"  held-out tasks (never tuned on): {report['tasks']} tasks, {report['tasks_with_both']} with both "
             f"outcomes, {report['episodes']} labelled episodes; the study answers to the {primary} AUC"]
    for key, name in (("within_task", "within-task"), ("all_pairs", "all pairs")):
        best = (report.get("best") or {}).get(key)
        tmpl = (report.get("template") or {}).get(key)
        arrow = ""
        if best and tmpl and best.get("value") is not None and tmpl.get("value") is not None:
            arrow = " ↑" if best["value"] > tmpl["value"] else (" ↓" if best["value"] < tmpl["value"] else " =")
        lines.append(f"    {name:<12} best trial {_figure(best)}{arrow}   template {_figure(tmpl)}   "
                     f"({(tmpl or {}).get('n_pairs', 0)} pairs)")
    return lines


def _trial_progress():
    """The progress printer of a study: one step per trial, with its value and held-out AUC."""
    def describe(m: dict[str, Any]) -> str:
        row = m["trial"]
        text = f"trial {row.trial} {row.state} · value {_fmt(row.value)}"
        if row.cv_auc is not None or row.held_out_auc is not None:
            text += f" · CV AUC {_fmt(row.cv_auc)} · held-out AUC {_fmt(row.held_out_auc)}"
        elif row.held_out is not None:
            text += f" · held out {_fmt(row.held_out)}"
        return text + f" · best {_fmt(m['best_value'])}"

    return progress_printer("tuning", "trial", lambda m: (m["trials_done"], m["trials"]), describe)


@app.command("apply")
def apply(
    study: str = typer.Argument(..., help="Study name."),
    storage: Optional[str] = typer.Option(None, "--storage", envvar="RWB_TUNE_STORAGE", help=STORAGE_HELP),
    trial: Optional[int] = typer.Option(None, "--trial", help="Apply this trial instead of the best feasible one."),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="Why (kept with the new version)."),
    force: bool = typer.Option(False, "--force", "--confirm-worse",
                               help="Save even when a held-out figure of the weights is below the template's "
                                    "own on the same held-out tasks (refused otherwise, naming the drop)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Write the study's best weights as a new version of its template (never overwrites); weights
    that do worse than the template on the held-out tasks need --force."""
    tuning = _tuning()
    ws = open_workspace()
    out = tuning.apply_study(ws, acting_user(ws, as_name), study, storage=storage, trial=trial, message=message,
                             force=force)
    if as_json:
        print_json(out)
        return
    typer.echo(f"saved {out.label} from trial {out.trial} of {out.study}: {out.message}")
    guard = out.figures.get("guard") or {}
    typer.echo(f"  {guard.get('label', 'held-out figure')}: trial {_fmt(guard.get('trial'))}, template "
               f"{_fmt(guard.get('template'))} ({guard.get('decision', '')})")
    for c in out.diff:
        typer.echo(f"  {c['section']} {c['key']}: {_fmt(c['a'])} -> {_fmt(c['b'])}")


@app.command("prefer")
def prefer(
    better: str = typer.Argument(..., help="Id of the better episode."),
    worse: str = typer.Argument(..., help="Id of the worse episode."),
    dataset: str = typer.Option(..., "--dataset", help="Workspace dataset of both episodes."),
    comment: Optional[str] = typer.Option(None, "--comment", help="Why it is better."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Label one episode as better than another (the preferences objective)."""
    tuning = _tuning()
    ws = open_workspace()
    out = tuning.add_preference(ws, acting_user(ws, as_name), dataset, better, worse, comment)
    if as_json:
        print_json(out)
    else:
        typer.echo(f"preference #{out.id}: {out.better} better than {out.worse} ({out.dataset})")


@app.command("preferences")
def preferences(
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Only this dataset."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the preference labels."""
    tuning = _tuning()
    prefs = tuning.list_preferences(open_workspace(), dataset)
    if as_json:
        print_json({"preferences": prefs})
        return
    if not prefs:
        typer.echo("no preference labels" + (f" in {dataset}" if dataset else ""))
    for p in prefs:
        typer.echo(f"#{p.id:<5} {p.dataset:<16} {p.better} > {p.worse}  ({p.created_by}"
                   f"{', ' + p.comment if p.comment else ''})")


@app.command("list")
def list_studies(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Studies started from this workspace, newest first."""
    tuning = _tuning()
    studies = tuning.list_studies(open_workspace())
    if as_json:
        print_json({"studies": studies})
        return
    if not studies:
        typer.echo("no tuning studies yet (rwb tune --template T --dataset D)")
    for s in studies:
        run = s.latest_run
        done, requested, best = (None, None, None) if run is None else (run.trials_done, run.trials_requested,
                                                                        run.best_value)
        typer.echo(f"{s.name:<48} {s.status:<12} {s.objective:<12} {s.template_name:<20} "
                   f"trials {_fmt(done)}/{_fmt(requested)} best {_fmt(best)}")
        if s.cause:
            typer.echo(f"    why: {s.cause}")


@app.command("show")
def show(
    study: str = typer.Argument(..., help="Study name."),
    storage: Optional[str] = typer.Option(None, "--storage", envvar="RWB_TUNE_STORAGE", help=STORAGE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """A study's trials, best vs template weights and the status of each expectation."""
    tuning = _tuning()
    report = tuning.study_report(open_workspace(), study, storage)
    body = {k: v for k, v in report.__dict__.items() if k != "charts"}  # the page's chart data
    if as_json:
        print_json(body)
        return
    typer.echo(f"study {report.name} ({report.storage}): {report.status}, objective {report.objective} "
               f"({report.metric}); trials {report.counts}")
    if report.cause:
        typer.echo(f"  why it is {report.status}: {report.cause}")
    if report.best:
        typer.echo(f"  best trial {report.best['trial']}: {_fmt(report.best['value'])} train, "
                   f"{_fmt(report.best['held_out'])} held out")
    if report.held_out:
        h = report.held_out
        typer.echo(f"  held-out tasks: {h['tasks']} ({h['tasks_with_both']} with both outcomes); the study answers "
                   f"to the {'within-task' if h['metric'] == 'within_task' else 'all-pairs'} AUC")
        for row in h["rows"]:
            typer.echo(f"    {row['figure']:<16} best trial {_fmt(row['best trial'])}  template "
                       f"{_fmt(row['template'])}  {row['change'] or ''}")
    for w in report.weights:
        typer.echo(f"  {w['component']:<26} template {_fmt(w['template']):>8}  best {_fmt(w['best']):>8}"
                   + (f"  bounds {_fmt(w['low'])}–{_fmt(w['high'])}" if w["tuned"] else "  (fixed)"))
    for c in report.constraints:
        typer.echo(f"  expectation {c['expectation']!r}: satisfied in {c['satisfied']}, violated in {c['violated']}")
    for note in report.notes:
        typer.echo(f"  note: {note}")


@app.command("stop")
def stop(
    study: str = typer.Argument(..., help="Study name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    as_name: Optional[str] = as_option(),
) -> None:
    """Ask the study's running workers to stop after their current trial."""
    tuning = _tuning()
    ws = open_workspace()
    out = tuning.stop_tuning(ws, acting_user(ws, as_name), study)
    if as_json:
        print_json(out)
    else:
        typer.echo(f"stop requested for study {study} ({out.status})")
