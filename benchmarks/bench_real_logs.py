"""Real labelled agent logs: how well each reward tracks real success on tasks it never saw.

For every labelled real set in ``datasets/real`` (tau2 airline runs of the Whissle agent, one
per task; tau2 airline and telecom runs of Grok agents; AgentDojo runs of six LLM agents),
side by side in one run, each figure as AUC over all (success, failure) pairs and **within
task** (pairs of the same task: the primary figure), with its 90% interval over tasks and the
tasks that have both outcomes:

* **untuned** — the shipped generic ``tool_agent`` pyramid (no labels read), and its
  **leave-one-set-out** figure: the template rebuilt from the terms whose sign held on the
  other sets only (``benchmarks/design_tool_agent.py``), measured on the set left out;
* **criteria** — ``tool_agent_criteria`` on the episodes whose task carries criteria (the
  tau2 airline ``tasks.json``), with the coverage;
* **baselines** — logistic regression on eight counts, and the same plus task-relative counts
  and MiniLM embeddings of the request and the last answer, on held-out tasks;
* **learned** — the learned outcome model (nested cross-validation grouped by task; criteria
  among its features where present), on the same held-out tasks, with the interval it
  reports for new tasks;
* **tuned** — ``rwb tune --objective outcome`` on half the tasks: the best trial and the
  template's own weights on the other half;
* **learning curve** — the learned model's held-out AUC with 10/20/40/80/160 labels;
* **interval check** — the learned model fitted on one half of the tasks: does the interval it
  reports for new tasks cover what the other half gives (each half in turn);
* **first run** — a fresh process on an empty workspace, no embedding store: import the file
  and score it with ``tool_agent``, against the previous generic pyramid that embedded every
  reply against the tool results before it (``benchmarks/reference_tool_agent_every_reply.yaml``).

Run::

    .venv/bin/python benchmarks/bench_real_logs.py [--trials 100] [--no-reference] [--only SET] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL = ROOT / "datasets" / "real"
AIRLINE_TASKS = REAL / "tau2" / "airline" / "tasks.json"
#: labelled real sets: folder -> import options (as datasets/real/README.md says) and the task
#: criteria file, where the tasks carry criteria
DATASETS = {"tau2_whissle": ({"reward_key": "outcome", "id_key": "id"}, AIRLINE_TASKS),
            "tau2_grok": ({"reward_key": "outcome", "id_key": "id"}, AIRLINE_TASKS),
            "agentdojo": ({"reward_key": "success", "id_key": "eid"}, None)}
REFERENCE_TEMPLATE = ROOT / "benchmarks" / "reference_tool_agent_every_reply.yaml"
CURVE_SIZES = (10, 20, 40, 80, 160)


def first_run_child(path: str, template: str, workspace: str, options: str) -> None:
    """In a fresh process: import ``path`` into an empty workspace and score it (prints JSON)."""
    t0 = time.perf_counter()
    from core.data.importers import import_file
    from core.rewards import score
    from core.records.store import Workspace

    ws = Workspace.open(Path(workspace))
    t_import = time.perf_counter()
    imported = import_file(ws, path, dataset="bench", **json.loads(options))
    t_score = time.perf_counter()
    result = score(ws, template, dataset="bench")
    done = time.perf_counter()
    print(json.dumps({"episodes": imported.episodes, "steps": imported.steps,
                      "start_s": round(t_import - t0, 2), "import_s": round(t_score - t_import, 2),
                      "score_s": round(done - t_score, 2), "total_s": round(done - t0, 2),
                      "encoded": int(result.matrix.embed_stats.get("encoded", 0))}))


def first_run(path: Path, template: str, options: dict) -> dict:
    """Wall time of a first run in a fresh process with an empty workspace (no shared
    embedding store: every text goes through the model)."""
    env = {k: v for k, v in os.environ.items() if k != "RWB_EMBEDDING_CACHE"} | {"HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="rwb-bench-real-") as tmp:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--first-run-child", str(path), template, tmp,
                              json.dumps(options)], capture_output=True, text=True, check=True, env=env)
        wall = time.perf_counter() - t0
    body = json.loads(out.stdout.strip().splitlines()[-1])
    return body | {"process_wall_s": round(wall, 2)}


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def figure(fid) -> dict:
    """A :class:`~core.rewards.outcomes.Fidelity` as JSON: both figures, intervals, counts."""
    def one(f):
        return {"value": _num(f.value), "ci90": [_num(v) for v in f.ci90], "n_tasks": int(f.n_tasks),
                "n_pairs": int(f.n_pairs)}
    return {"all_pairs": one(fid.all_pairs), "within_task": one(fid.within_task)}


def measure(name: str, options: dict, tasks: Path | None, trials: int, reference: bool,
            leave_one_out: dict | None) -> dict:
    import numpy as np

    from core import tuning
    from core.access.users import current_user
    from core.base.embed import workspace_embedder
    from core.base.errors import InputError
    from core.data.importers import import_file
    from core.data.task_criteria import import_criteria
    from core.records.store import Workspace
    from core.rewards.api import load_frame, score
    from core.rewards.components import ScoringContext
    from core.rewards.criteria import frame_criteria
    from core.rewards.labels import dataset_outcomes
    from core.rewards.learned import fit_outcome_model
    from core.rewards.outcome_model import learning_curve
    from core.rewards.outcomes import fidelity

    path = REAL / name / "episodes.jsonl"
    out: dict = {"dataset": name, "first_run": first_run(path, "tool_agent", options)}
    if reference:
        out["first_run_reference"] = first_run(path, str(REFERENCE_TEMPLATE), options)
        out["first_run_speedup"] = round(out["first_run_reference"]["process_wall_s"]
                                         / out["first_run"]["process_wall_s"], 2)
    with tempfile.TemporaryDirectory(prefix="rwb-bench-real-ws-") as tmp:
        ws = Workspace.open(Path(tmp))
        actor = current_user(ws)
        import_file(ws, path, dataset=name, **options)
        if tasks is not None:
            import_criteria(ws, actor, tasks, name)
        frame = load_frame(ws, name)
        labels, groups = dataset_outcomes(ws, name)
        keep = ~np.isnan(labels)
        out["episodes"], out["tasks"] = int(frame.n_episodes), int(np.unique(groups[keep].astype(str)).size)
        out["success_rate"] = round(float((labels[keep] > 0.5).mean()), 3)

        untuned = score(ws, "tool_agent", frame=frame)
        out["untuned"] = figure(fidelity(untuned.returns, labels, groups))
        out["untuned_leave_one_set_out"] = leave_one_out
        ctx = ScoringContext(embedder=workspace_embedder(ws), criteria=frame_criteria(ws, frame))
        if ctx.criteria is not None:
            has = np.array([e in ctx.criteria.by_episode for e in frame.episode_ids.tolist()])
            crit = score(ws, "tool_agent_criteria", frame=frame)
            out["criteria_coverage"] = f"criteria for {int(has.sum())} of {frame.n_episodes} episodes"
            out["criteria"] = figure(fidelity(crit.returns[has], labels[has], groups[has]))
        try:
            fit = fit_outcome_model(frame, labels, groups, ctx=ctx)
            out["baseline_counts"] = figure(fit.heldout.baseline_counts)
            out["baseline_counts_embed"] = figure(fit.heldout.baseline_counts_embed)
            out["learned"] = figure(fit.heldout.learned)
            out["learned_tasks_with_both"] = int(fit.heldout.tasks_with_both)
            curve = learning_curve(frame, labels, groups, ctx, sizes=CURVE_SIZES, config=fit.configs)
            out["learning_curve"] = [{"labelled": p.labelled, "all_pairs": _num(p.all_pairs),
                                      "within_task": _num(p.within_task)} for p in curve.points]
            out["learning_curve_skipped"] = list(curve.skipped)
            try:
                out["interval_check"] = half_split_check(frame, labels, groups, ctx)
            except InputError as exc:   # a half too small to fit on: say so, keep the figures above
                out["interval_check_error"] = str(exc)
        except InputError as exc:   # too few labelled episodes: say so in the output
            out["learned_error"] = str(exc)
        t0 = time.perf_counter()
        tuned = tuning.tune(ws, actor, "tool_agent", dataset=name, trials=trials, study=f"bench-{name}",
                            config=tuning.TuneConfig(seed=0))
        out["tune_s"], out["tuned_trials"] = round(time.perf_counter() - t0, 1), trials
        report = tuned.held_out_report or {}
        out["tuned"], out["tuned_template"] = report.get("best"), report.get("template")
        out["tuned_metric"], out["tuned_warnings"] = report.get("metric"), tuned.warnings
    return out


def half_split_check(frame, labels, groups, ctx, seed: int = 0) -> list[dict]:
    """Fit the learned model on one half of the labelled tasks, then score the other half with
    the fitted model: does the interval the fit reports for new tasks cover that figure?
    Each half in turn."""
    import numpy as np

    from core.rewards.learned import LearnedOutcome, fit_outcome_model
    from core.rewards.outcomes import fidelity

    tasks = np.unique(groups[~np.isnan(labels)].astype(str))
    half = set(np.random.default_rng(seed).permutation(tasks)[: tasks.size // 2].tolist())
    first = np.array([g in half for g in groups.astype(str)])
    checks = []
    for fit_on in (first, ~first):
        fit = fit_outcome_model(frame, np.where(fit_on, labels, np.nan), groups, ctx=ctx)
        prob = LearnedOutcome(**fit.params).predict(frame, ctx, groups.astype(str))
        new = fidelity(prob[~fit_on], labels[~fit_on], groups[~fit_on])
        for key in ("all_pairs", "within_task"):
            reported, got = getattr(fit.heldout.learned, key), getattr(new, key)
            if math.isnan(got.value) or math.isnan(reported.ci90[0]):
                continue
            checks.append({"figure": key, "reported": _num(reported.value),
                           "ci90": [_num(v) for v in reported.ci90], "new_tasks": _num(got.value),
                           "covered": bool(reported.ci90[0] <= got.value <= reported.ci90[1])})
    return checks


def _cell(fig: dict | None, key: str) -> str:
    if not fig or fig.get(key, {}).get("value") is None:
        return "—"
    f = fig[key]
    lo, hi = f["ci90"]
    ci = f" [{lo:.2f},{hi:.2f}]" if lo is not None and hi is not None else ""
    return f"{f['value']:.3f}{ci}"


def print_table(results: list[dict], load: float) -> None:
    print(f"Real labelled logs (load {load:.1f}): AUC all pairs | within task, 90% interval over tasks; "
          "held-out tasks where fitted or tuned")
    rows = [("untuned tool_agent", "untuned"), ("  leave-one-set-out", "untuned_leave_one_set_out"),
            ("criteria template", "criteria"), ("baseline: counts", "baseline_counts"),
            ("baseline: +task-norm +emb", "baseline_counts_embed"), ("learned (nested CV)", "learned"),
            ("tuned: best trial", "tuned"), ("tuned: template weights", "tuned_template")]
    for r in results:
        print(f"\n{r['dataset']}: {r['episodes']} episodes, {r['tasks']} tasks, success {r['success_rate']:.2f}"
              + (f"; {r['criteria_coverage']}" if "criteria_coverage" in r else ""))
        for label, key in rows:
            print(f"  {label:<28}{_cell(r.get(key), 'all_pairs'):>22} | {_cell(r.get(key), 'within_task'):<22}")
        if "learning_curve" in r:
            curve = "  ".join(f"{p['labelled']}: {p['all_pairs'] or float('nan'):.2f}|"
                              f"{p['within_task'] if p['within_task'] is not None else float('nan'):.2f}"
                              for p in r["learning_curve"])
            print(f"  learning curve (labels: all|within)  {curve}")
        for c in r.get("interval_check", []):
            lo, hi = c["ci90"]
            print(f"  interval check ({c['figure']}): fitted on half the tasks, reported {c['reported']:.3f} "
                  f"[{lo:.2f}, {hi:.2f}], the other half gave {c['new_tasks']:.3f}: "
                  + ("covered" if c["covered"] else "NOT covered"))
        if "interval_check_error" in r:
            print(f"  interval check: not possible ({r['interval_check_error']})")
        if "learned_error" in r:
            print(f"  learned: {r['learned_error']}")
        fr, ref = r["first_run"], r.get("first_run_reference")
        print(f"  first run: {fr['episodes']} episodes, import {fr['import_s']:.1f} s + score {fr['score_s']:.1f} s, "
              f"process {fr['process_wall_s']:.1f} s" + ("" if ref is None else
                                                          f"; reference {ref['process_wall_s']:.1f} s: "
                                                          f"{r['first_run_speedup']:.2f}x"))
        for w in r.get("tuned_warnings", []):
            print(f"  tuning warned: {w}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--first-run-child":
        first_run_child(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100, help="Optuna trials of the tuned pyramid")
    ap.add_argument("--no-reference", action="store_true", help="skip the previous pyramid's first run")
    ap.add_argument("--only", choices=sorted(DATASETS), help="one dataset")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import optuna

    from benchmarks.design_tool_agent import design

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    loso = design()["leave_one_set_out"]
    results = []
    for name, (options, tasks) in DATASETS.items():
        if args.only in (None, name):
            held = loso.get(name)
            fig = None if held is None else {k: {"value": held[k]["auc"], "ci90": held[k]["ci90"],
                                                 "n_tasks": held[k]["n_tasks"]} for k in ("all_pairs", "within_task")}
            results.append(measure(name, options, tasks, args.trials, not args.no_reference, fig))
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"datasets": results, "load_1min": round(load, 2)}, indent=1))
        return
    print_table(results, load)


if __name__ == "__main__":
    main()
