"""``rwb train``, ``rwb runs list|show|stop|resume|verdict``, ``rwb doctor RUN``, ``rwb evaluate RUN``.

Thin parsers over :func:`core.rl.runs.train` / :func:`core.rl.runs.launch_run`,
:func:`core.rl.runs.list_runs` / :func:`core.rl.runs.get_run` / :func:`core.rl.runs.stop_run` /
:func:`core.rl.runs.resume_run`, :func:`core.rl.verdict.run_verdict`,
:func:`core.rl.doctor.diagnose` and :func:`core.rl.evaluation.evaluate`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from core.cli import open_workspace, print_json, progress_printer
from core.cli.acting import acting_user, as_option
from core.cli.episodes import (
    FORMAT_OPTION,
    ID_KEY_OPTION,
    MESSAGES_KEY_OPTION,
    REWARD_KEY_OPTION,
    SKIP_INVALID_OPTION,
)
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.rl.ope import OffPolicyReport, OffPolicyUnavailable

runs_app = typer.Typer(help="Training runs: list, show, stop, resume, and the verdict of one.",
                        no_args_is_help=True)


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _config(steps: Optional[int], device: str, seed: int, settings: list[str]) -> Any:
    """A PPOConfig from the options and ``--set KEY=VALUE`` pairs (values parsed as JSON)."""
    from core.rl.ppo import PPOConfig  # deferred: loads torch and gymnasium

    values: dict[str, Any] = {"device": device, "seed": seed}
    if steps is not None:
        values["total_steps"] = steps
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set needs KEY=VALUE, got {item!r}", field="set")
        try:
            values[key.strip()] = json.loads(raw)
        except ValueError:
            values[key.strip()] = raw
    return PPOConfig.from_dict(values).validate()


def _progress_printer(quiet: bool):
    """A progress bar of the PPO updates on stderr (plain lines when not a terminal)."""
    if quiet:
        return None, None
    return progress_printer(
        "training", "update", lambda m: (m["update"], m.get("total_updates")),
        lambda m: (f"{m['env_steps']} steps · L{m.get('curriculum_level')} · return {_fmt(m.get('return_mean'))} · "
                   f"KL {_fmt(m.get('kl'), '.4f')} · β {_fmt(m.get('beta'))}"))


def train_cmd(
    template: Optional[str] = typer.Option(None, "--template", "-t", help="Reward template: a shipped name or a YAML file."),
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="Train on an episodes file (any importable format)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Train on a dataset of the workspace."),
    masks: Optional[Path] = typer.Option(None, "--masks", help="Mask rules YAML (default: datasets/<domain>/masks.yaml "
                                         "of the data's domain, when there is one)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Environment steps to train for (default 300000)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu or cuda."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights, simulator and sampling."),
    settings: list[str] = typer.Option([], "--set", help="Any training setting as KEY=VALUE (JSON value), e.g. "
                                       "--set n_envs=256 --set 'encoder={\"gating\": \"off\"}'. Repeatable."),
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue run RUN from its last checkpoint."),
    background: bool = typer.Option(False, "--background", help="Start the run as a detached background process "
                                    "and print its id."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the run id and final metrics."),
) -> None:
    """Train a masked PPO policy against a reward template on recorded episodes."""
    from core.rl import runs  # deferred: keeps rwb --help fast

    ws = open_workspace()
    token = os.environ.get(runs.LAUNCH_TOKEN_ENV)
    if resume is not None and token:
        actor = runs.launched_actor(ws, resume, token)
    else:
        actor = acting_user(ws, as_name)
    if resume is not None:
        if any(x is not None for x in (template, episodes, dataset, masks, steps)) or settings or background:
            raise InputError("--resume continues a run with its own template, data and settings; give only RUN")
        cfg_kwargs: dict[str, Any] = {"resume": resume}
    else:
        cfg_kwargs = {"template": template, "dataset": dataset, "episodes_file": episodes, "masks": masks,
                      "config": _config(steps, device, seed, settings)}
        if template is None:
            raise InputError("give a reward template (--template NAME or FILE)", field="template")
    if background:
        started = runs.launch_run(ws, actor, **{k: v for k, v in cfg_kwargs.items()})
        if as_json:
            print_json(started)
        else:
            typer.echo(f"Started {started.run_id} in the background (pid {started.pid}); log: {started.log}")
            typer.echo(f"Follow it with `rwb runs show {started.run_id}`; stop it with `rwb runs stop "
                       f"{started.run_id}`.")
        return
    progress_fn, bar = _progress_printer(quiet or as_json)
    if bar is not None:
        bar.start()
    try:
        result = runs.train(ws, actor, progress=progress_fn, **cfg_kwargs)
    finally:
        if bar is not None:
            bar.stop()
    if as_json:
        print_json(result)
        return
    m = result.metrics
    typer.echo(f"Run {result.run_id} {result.status} after {m.get('env_steps', '?')} env steps "
               f"({m.get('update', '?')} updates).")
    typer.echo(f"  return {_fmt(m.get('return_mean'))} · greedy on training episodes {_fmt(m.get('eval_return'))} · "
               f"success {_fmt(m.get('success_rate'), '.2f')} · curriculum L{m.get('curriculum_level')}")
    typer.echo(f"  KL {_fmt(m.get('kl'), '.4f')} (std over updates {_fmt(m.get('kl_std'), '.4f')}) · β "
               f"{_fmt(m.get('beta'))} · entropy {_fmt(m.get('entropy_marginal'), '.2f')} nats · mask violations "
               f"{m.get('mask_violations', 0)}")
    typer.echo(f"Judge it with `rwb runs verdict {result.run_id}` (learning? better than the logs? how sure?).")


@runs_app.command("list")
def list_cmd(
    status: Optional[str] = typer.Option(None, "--status", help="Only runs with this status."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Only runs on this dataset."),
    limit: int = typer.Option(50, "--limit", help="At most this many runs (newest first)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List training runs, newest first, with their last metrics."""
    from core.rl.runs import list_runs  # deferred: keeps rwb --help fast

    rows = list_runs(open_workspace(), status=status, dataset=dataset, limit=limit)
    if as_json:
        print_json({"runs": rows})
        return
    if not rows:
        typer.echo("No runs yet: start one with `rwb train --template T --dataset D`.")
        return
    from core.rl.runs import steps_progress  # deferred: keeps rwb --help fast

    for r in rows:
        typer.echo(f"{r.id}  {r.display_status:<11} {r.dataset or 'file'}  {r.template_name}  "
                   f"{steps_progress(r)}  L{_fmt(r.last.curriculum_level, 'd')}  "
                   f"return {_fmt(r.last.return_mean)}  {r.device}")


@runs_app.command("show")
def show_cmd(
    run_id: str = typer.Argument(..., help="The run."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (run, metrics per update, checkpoints)."),
) -> None:
    """Show one run: its record, latest metrics and checkpoints."""
    from core.rl.runs import checkpoints, get_run, run_metrics, steps_progress  # deferred: keeps rwb --help fast

    ws = open_workspace()
    run = get_run(ws, run_id)
    metrics = run_metrics(ws, run_id)
    ckpts = checkpoints(ws, run_id)
    if as_json:
        print_json({"run": run, "metrics": metrics, "checkpoints": ckpts})
        return
    typer.echo(f"{run.id}: {run.display_status} · {run.dataset or run.episodes_file} · template "
               f"{run.template_name} v{run.template_version} · {run.device} · pid {run.pid}")
    typer.echo(f"  {steps_progress(run)}, {run.updates} updates, started "
               f"{run.started_at}, ended {run.ended_at or '—'}")
    if run.interrupted:
        typer.echo(f"  its trainer process is gone: resume with `rwb train --resume {run_id}`")
    if run.error:
        typer.echo(f"  error: {run.error}")
    if metrics:
        m = metrics[-1]
        for key in ("return_mean", "eval_return", "success_rate", "kl", "beta", "clip_fraction", "value_loss",
                    "entropy", "entropy_marginal", "off_support_rate", "mask_violations", "curriculum_level",
                    "env_steps_per_s"):
            typer.echo(f"  {key:<18} {_fmt(m.get(key), '.4g')}")
        unlocked = [f"update {x['update']}: {x['level_unlocked']}" for x in metrics if x.get("level_unlocked")]
        for line in unlocked:
            typer.echo(f"  unlocked {line}")
    typer.echo(f"  checkpoints: {', '.join(str(c.update_idx) for c in ckpts) or 'none'}")


@runs_app.command("stop")
def stop_cmd(
    run_id: str = typer.Argument(..., help="The run to stop."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Ask a running run to stop after its current update (it writes a checkpoint first)."""
    from core.rl.runs import stop_run  # deferred: keeps rwb --help fast

    ws = open_workspace()
    stop = stop_run(ws, acting_user(ws, as_name), run_id)
    if as_json:
        print_json({"run": stop.run})
        return
    typer.echo(f"{run_id}: {'stopped' if stop.run.status == 'stopped' else 'stop requested; it stops after the current update'}")


@runs_app.command("resume")
def resume_cmd(
    run_id: str = typer.Argument(..., help="The stopped, interrupted or failed run to continue."),
    as_name: Optional[str] = as_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Continue a stopped, interrupted or failed run from its last checkpoint, in the background."""
    from core.rl.runs import resume_run  # deferred: keeps rwb --help fast

    ws = open_workspace()
    started = resume_run(ws, acting_user(ws, as_name), run_id)
    if as_json:
        print_json(started)
        return
    typer.echo(f"Resumed {run_id} in the background (pid {started.pid}); log: {started.log}")


@runs_app.command("verdict")
def verdict_cmd(
    run_id: str = typer.Argument(..., help="The run to judge."),
    refresh: bool = typer.Option(False, "--refresh", help="Compute it again even when it was kept for this "
                                 "checkpoint."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The run's one verdict: is it learning, is it better than the logs, how sure (the diagnosis and
    the held-out evaluation together)."""
    from core.rl.verdict import run_verdict  # deferred: loads torch

    v = run_verdict(open_workspace(), run_id, refresh=refresh)
    if as_json:
        print_json(v)
        return
    typer.echo(f"{run_id} (checkpoint of update {v.checkpoint_update}): {v.plain_overall}. {v.headline}")
    for line in (v.learning, v.better_than_logs, v.how_sure):
        typer.echo(f"  {line.sentence}")
    typer.echo(f"Next: {v.next_step}")


def doctor_cmd(
    run_id: str = typer.Argument(..., help="The run to diagnose."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Four-step diagnosis: reward integrity, state-encoding fidelity, gradient flow, exploration."""
    from core.rl.doctor import diagnose  # deferred: loads torch

    report = diagnose(open_workspace(), run_id)
    if as_json:
        print_json(report)
        return
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    typer.echo(f"Diagnosis of {run_id} (checkpoint of update {report.checkpoint_update}): {report.verdict}")
    for s in report.steps:
        typer.echo(f"  {s.step}. {mark[s.verdict]} {s.name:<24} {_fmt(s.value, '.4g')}  {s.message}")
    typer.echo(f"These four checks do not say whether it beats the logs: `rwb runs verdict {run_id}` does.")


def evaluate_cmd(
    run_id: str = typer.Argument(..., help="The run to evaluate."),
    episodes: Optional[Path] = typer.Option(None, "--episodes", help="Evaluate on every episode of this file, "
                                            "mapped onto the run's action catalog (default: the run's held-out "
                                            "split)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Evaluate on every episode of this workspace "
                                          "dataset, mapped onto the run's action catalog."),
    format: str = FORMAT_OPTION,
    messages_key: Optional[str] = MESSAGES_KEY_OPTION,
    reward_key: Optional[str] = REWARD_KEY_OPTION,
    id_key: Optional[str] = ID_KEY_OPTION,
    skip_invalid: bool = SKIP_INVALID_OPTION,
    repeats: int = typer.Option(3, "--repeats", help="Passes over every held-out episode."),
    device: str = typer.Option("cpu", "--device", help="auto, cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Policy return on held-out episodes vs each logged behaviour and vs random-in-mask."""
    from core.rl.evaluation import EpisodeFileOptions, evaluate  # deferred: loads torch

    if episodes is not None and dataset is not None:
        raise InputError("give --episodes FILE or --dataset NAME, not both", field="dataset")
    options = EpisodeFileOptions(format=format, messages_key=messages_key, reward_key=reward_key, id_key=id_key,
                                 skip_invalid=skip_invalid)
    r = evaluate(open_workspace(), run_id, episodes=episodes, dataset=dataset, import_options=options,
                 repeats=repeats, device=device)
    if as_json:
        print_json(r)
        return
    typer.echo(f"{run_id} on {r.episodes} held-out episodes ({r.source}), {r.repeats} passes:")
    cov = r.catalog_coverage
    kinds = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in cov["by_kind"].items() if n)
    typer.echo(f"  run's catalog {r.catalog_version}: {cov['off_catalog']} of {cov['tool_calls']} tool calls "
               f"off-catalog ({_fmt(cov['share_of_tool_calls'], '.1%')} of calls, "
               f"{_fmt(cov['share_of_steps'], '.1%')} of steps){f': {kinds}' if kinds else ''}")
    p, q = r.policy, r.random_in_mask
    typer.echo("  simulator's estimate (a model built from the recorded episodes):")
    typer.echo(f"  policy (greedy)   return {_fmt(p.return_mean)}  success {_fmt(p.success_rate, '.2f')}  "
               f"off-support {_fmt(p.off_support_rate, '.2f')}  mask violations {p.mask_violations}")
    typer.echo(f"  random-in-mask    return {_fmt(q.return_mean)}  success {_fmt(q.success_rate, '.2f')}  "
               f"off-support {_fmt(q.off_support_rate, '.2f')}")
    for name, value in sorted(r.logged.items(), key=lambda kv: -kv[1]):
        pair = r.paired[name]  # every logged behaviour is paired with the policy on its start states
        typer.echo(f"  logged {name:<10} return {_fmt(value)}   policy from the same {pair.episodes} "
                   f"start states {_fmt(pair.policy)}")
    if r.best_logged:
        best = r.paired[r.best_logged.behaviour]
        word = "beats" if r.beats_best_logged else "does not beat"
        typer.echo(f"The policy {word} the best logged behaviour ({r.best_logged.behaviour}) on its own held-out "
                   f"requests: {_fmt(best.policy)} vs {_fmt(best.logged)}; "
                   f"margin over random {_fmt(r.margin_over_random)}.")
    _echo_ope(r.ope)


def _echo_ope(o: "OffPolicyReport | OffPolicyUnavailable") -> None:
    """The off-policy estimate on the logged episodes, and whether it can be trusted."""
    low, high = o.policy_success_ci90 or (None, None)
    typer.echo(f"Off-policy on the logged episodes ({o.method}): success {_fmt(o.policy_success, '.2f')} "
               f"[90% {_fmt(low, '.2f')}–{_fmt(high, '.2f')}, over tasks] vs logged {_fmt(o.logged_success, '.2f')}; "
               f"return {_fmt(o.policy_return)} vs logged {_fmt(o.logged_return)}; "
               f"ESS {_fmt(o.effective_sample_size, '.1f')} of {o.episodes} episodes ({o.tasks} tasks), "
               f"support {_fmt(o.support, '.0%')}")
    if not o.reliable:
        typer.echo(f"  NOT RELIABLE ({o.verdict}): {o.note}")


def register(root: typer.Typer) -> None:
    """Wire the training commands into ``rwb``."""
    root.command("train")(train_cmd)
    root.add_typer(runs_app, name="runs")
    root.command("doctor")(doctor_cmd)
    root.command("evaluate")(evaluate_cmd)
