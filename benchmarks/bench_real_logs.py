"""Real labelled agent logs: how well the rewards track real success, and how fast a first run is.

For every labelled real dataset in ``datasets/real`` (tau2 runs of Grok agents and of the
Whissle production agent; 0/1 outcome per episode, task id in ``task_id``), side by side in
one run:

* **untuned** — AUC of the shipped generic ``tool_agent`` pyramid's episode return against
  the recorded outcome (the outcome withheld from scoring: the template reads none);
* **best single feature** — the best AUC of one tool-use statistic (calls, writes, errors,
  repeats, steps, …), its direction chosen on the same data (an optimistic reference);
* **tuned** — ``rwb tune --objective outcome``: the held-out AUC of the best trial on tasks
  Optuna never saw (task-grouped; no selection on the held-out tasks);
* **learned** — the learned outcome component (``rwb reward learn``): held-out AUC of its
  task-grouped cross-validation;
* **first run** — a fresh process on an empty workspace: import the file and score it with
  ``tool_agent`` (sentence model load and every embedding included), against the
  reference: the same with the previous generic pyramid, which embedded every reply of the
  agent against the tool results before it (``benchmarks/reference_tool_agent_every_reply.yaml``).
  Both scale with the episodes; the target is ≤ 30 s for 600 episodes.

Run::

    .venv/bin/python benchmarks/bench_real_logs.py [--trials 100] [--no-reference] [--json]
"""

from __future__ import annotations

import argparse
import json
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
#: labelled real datasets: folder -> import options (as their README says)
DATASETS = {"tau2_whissle": {"reward_key": "outcome", "id_key": "id"},
            "tau2_grok": {"reward_key": "outcome", "id_key": "id"}}
REFERENCE_TEMPLATE = ROOT / "benchmarks" / "reference_tool_agent_every_reply.yaml"


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
    """Wall time of a first run in a fresh process with an empty workspace."""
    with tempfile.TemporaryDirectory(prefix="rwb-bench-real-") as tmp:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--first-run-child", str(path), template, tmp,
                              json.dumps(options)], capture_output=True, text=True, check=True,
                             env=os.environ | {"HF_HUB_OFFLINE": "1"})
        wall = time.perf_counter() - t0
    body = json.loads(out.stdout.strip().splitlines()[-1])
    return body | {"process_wall_s": round(wall, 2)}


def best_single_feature(frame, labels) -> tuple[str, float]:
    """(name, AUC) of the best single tool-use statistic, its direction chosen on the data."""
    import numpy as np

    from core.rewards.agent_signals import WriteActions
    from core.rewards.learned import STAT_FEATURES, episode_stats
    from core.rewards.outcomes import auc

    keep = ~np.isnan(labels)
    y = labels[keep] > 0.5
    stats = episode_stats(frame)
    writes = -WriteActions(per=1.0)(frame, None)
    columns = dict(zip(STAT_FEATURES, stats.T)) | {
        "writes": np.bincount(frame.episode, weights=writes, minlength=frame.n_episodes)}
    best = ("", 0.5)
    for name, values in columns.items():
        a = auc(values[keep], y)
        for label, value in ((f"more {name}", a), (f"fewer {name}", 1.0 - a)):
            if value > best[1]:
                best = (label, value)
    return best[0], round(float(best[1]), 4)


def measure(name: str, options: dict, trials: int, reference: bool) -> dict:
    import numpy as np

    from core import tuning
    from core.data.importers import import_file
    from core.rewards.api import load_frame, score
    from core.rewards.calibration import calibrate_result, outcome_columns
    from core.rewards.learned import fit_outcome_model
    from core.rewards.components import ScoringContext
    from core.base.embed import workspace_embedder
    from core.base.errors import InputError
    from core.records.store import Workspace
    from core.access.users import current_user

    path = REAL / name / "episodes.jsonl"
    out: dict = {"dataset": name, "first_run": first_run(path, "tool_agent", options)}
    if reference:
        out["first_run_reference"] = first_run(path, str(REFERENCE_TEMPLATE), options)
        out["first_run_speedup"] = round(out["first_run_reference"]["process_wall_s"]
                                         / out["first_run"]["process_wall_s"], 2)
    # scaled to 600 episodes only from a file near that size (a small file is all fixed costs)
    n = out["first_run"]["episodes"]
    out["first_run_per_600_episodes_s"] = (round(out["first_run"]["process_wall_s"] * 600 / n, 1)
                                           if n >= 300 else None)
    with tempfile.TemporaryDirectory(prefix="rwb-bench-real-ws-") as tmp:
        ws = Workspace.open(Path(tmp))
        import_file(ws, path, dataset=name, **options)
        frame = load_frame(ws, name)
        labels, groups = outcome_columns(ws.load_episodes(name), None)
        result = score(ws, "tool_agent", frame=frame)
        report = calibrate_result(result, labels, groups, n_boot=200)
        out["episodes"], out["tasks"] = int(frame.n_episodes), report.n_tasks
        out["success_rate"] = round(report.success_rate, 3)
        out["untuned_auc"] = round(report.return_power.value, 4)
        out["untuned_auc_ci90"] = [round(x, 4) for x in report.return_power.ci90]
        out["best_single_feature"], out["best_single_feature_auc"] = best_single_feature(frame, labels)
        t0 = time.perf_counter()
        tuned = tuning.tune(ws, current_user(ws), "tool_agent", dataset=name, trials=trials,
                            study=f"bench-{name}", config=tuning.TuneConfig(seed=0))
        out["tuned_heldout_auc"] = (tuned.best or {}).get("held_out_auc")
        out["tuned_cv_auc"] = (tuned.best or {}).get("cv_auc")
        out["tuned_trials"], out["tune_s"] = trials, round(time.perf_counter() - t0, 1)
        out["tuned_warnings"] = tuned.warnings
        ctx = ScoringContext(embedder=workspace_embedder(ws))
        try:
            fit = fit_outcome_model(frame, labels, groups, ctx=ctx, embed="last_words", c=1.0)
            out["learned_heldout_auc"] = round(fit.heldout_auc, 4)
            fit_stats = fit_outcome_model(frame, labels, groups, ctx=ctx, embed="none", c=1.0)
            out["learned_stats_only_heldout_auc"] = round(fit_stats.heldout_auc, 4)
        except InputError as exc:  # too few labelled episodes: say so in the output
            out["learned_heldout_auc"] = None
            out["learned_error"] = str(exc)
        if not np.isnan(report.heldout_auc or np.nan):
            out["untuned_return_recalibrated_heldout_auc"] = round(report.heldout_auc, 4)
    return out


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

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = [measure(name, opts, args.trials, not args.no_reference)
               for name, opts in DATASETS.items() if args.only in (None, name)]
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"datasets": results, "load_1min": round(load, 2)}, indent=1))
        return
    print(f"Real labelled logs (load {load:.1f}); AUC of success vs failure, grouped by task where held out")
    print(f"{'dataset':<14}{'eps':>5}{'tasks':>6}{'untuned':>9}{'best feature':>28}{'tuned (held out)':>18}"
          f"{'learned (held out)':>20}{'first run':>11}{'reference':>11}{'ratio':>7}{'per 600 eps':>13}")
    for r in results:
        ref = r.get("first_run_reference", {}).get("process_wall_s")
        tuned = r["tuned_heldout_auc"]
        learned = r["learned_heldout_auc"]
        print(f"{r['dataset']:<14}{r['episodes']:>5}{r['tasks']:>6}{r['untuned_auc']:>9.3f}"
              f"{r['best_single_feature'] + ' ' + format(r['best_single_feature_auc'], '.3f'):>28}"
              f"{'—' if tuned is None else format(tuned, '.3f'):>18}"
              f"{'—' if learned is None else format(learned, '.3f'):>20}"
              f"{r['first_run']['process_wall_s']:>10.1f}s{'—' if ref is None else format(ref, '.1f') + 's':>11}"
              f"{'—' if ref is None else format(r['first_run_speedup'], '.2f'):>7}"
              f"{'—' if r['first_run_per_600_episodes_s'] is None else format(r['first_run_per_600_episodes_s'], '.1f') + 's':>13}")
        for w in r.get("tuned_warnings", []):
            print(f"  {r['dataset']}: tuning warned: {w}")


if __name__ == "__main__":
    main()
