"""Weight tuning speed on 100k steps, side by side (target ≥ 1,000 trials/min on 2 cores).

(a) ``core.tuning.studies.tune`` exactly as ``rwb tune`` runs it by default: outcome objective,
    multivariate TPE, the template's expectations as constraints, trials kept in
    Optuna's in-memory storage and written to the workspace's Optuna journal in batches
    every second — trials/min over the whole study, flushes included;
(b) the same study on Optuna's RDB storage used directly (``--storage sqlite:///…``,
    what distributed workers do): every trial written as it happens;
(c) the naive reference: the same Optuna loop, but every trial re-scores the data from
    scratch (``Pyramid(template with the trial's weights).score(frame)``: every
    component recomputed; sentence embeddings come from the warm cache, so the model
    itself is not counted against it).

The 100k steps are a generated finance dataset tiled with ``StepsFrame.tile``.  The
first run computes the sentence embeddings of the texts once (minutes on a busy CPU);
keep ``--workspace`` to reuse them.  The machine may be shared, so both wall-clock and
process-CPU rates are printed.  Run::

    .venv/bin/python benchmarks/bench_tune.py [--steps 100000] [--trials 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from core import rewards  # noqa: E402
from core import tuning
from core.data.datasets import generate  # noqa: E402
from core.rewards import ComponentCache, Pyramid, ScoringContext  # noqa: E402
from core.records.store import Workspace  # noqa: E402
from core.access.users import current_user  # noqa: E402


def rate(n: int, wall: float, cpu: float) -> dict[str, float]:
    return {"trials": n, "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "trials_per_min": round(n / wall * 60, 1), "trials_per_cpu_min": round(n / cpu * 60, 1) if cpu else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--episodes", type=int, default=400, help="generated episodes before tiling")
    ap.add_argument("--trials", type=int, default=1000, help="trials of the default path (a)")
    ap.add_argument("--rdb-trials", type=int, default=300, help="trials on the direct RDB storage (b)")
    ap.add_argument("--naive-trials", type=int, default=3, help="trials of the naive reference (c)")
    ap.add_argument("--template", default="finance_risk")
    ap.add_argument("--workspace", default=str(Path(tempfile.gettempdir()) / "rwb-bench-tune"),
                    help="kept between runs: the embedding and component caches live there")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    ws = Workspace.open(args.workspace)
    actor = current_user(ws)
    ds = generate("finance", args.episodes, seed=7)
    base = rewards.frame_from_episodes(ds.episodes, ds.tools)
    frame = base.tile(-(-args.steps // base.n_steps))
    template = rewards.as_template(args.template)
    out: dict = {"steps": frame.n_steps, "episodes": frame.n_episodes, "template": template.name,
                 "cores": os.cpu_count(), "optuna": optuna.__version__}

    # one scoring fills the embedding and component caches (not part of any figure)
    t0 = time.perf_counter()
    from core.base.embed import workspace_embedder

    ctx = ScoringContext(embedder=workspace_embedder(ws))
    Pyramid(template).compute_matrix(tuning.withhold_outcomes(frame), ctx=ctx,
                                     cache=ComponentCache.for_workspace(ws))
    out["matrix_seconds_first"] = round(time.perf_counter() - t0, 1)

    # (a) the default path
    study = f"bench-default-{int(time.time())}"
    c0, w0 = time.process_time(), time.perf_counter()
    res = tuning.tune(ws, actor, template, frame=frame, trials=args.trials, study=study)
    setup_wall, setup_cpu = time.perf_counter() - w0, time.process_time() - c0
    out["default"] = {"trials_per_min": round(res.trials_per_min, 1), "trials": res.trials_run,
                      "seconds": round(res.seconds, 2), "cpu_seconds": round(res.cpu_seconds, 2),
                      "trials_per_cpu_min": round(res.trials_run / res.cpu_seconds * 60, 1),
                      "setup_and_report_seconds": round(setup_wall - res.seconds, 2),
                      "process_cpu_seconds_total": round(setup_cpu, 2),
                      "feasible": res.feasible_trials, "best_train": res.best_value,
                      "best_held_out": res.best and res.best["held_out_value"],
                      "baseline": res.baseline["figures"],
                      "recomputed_components": res.recomputed_components}
    persisted = tuning.load_study(ws, study)
    out["default"]["persisted_trials"] = len(persisted.trials)

    # (b) Optuna's RDB storage, every trial written as it happens
    db = Path(args.workspace) / f"rdb-{int(time.time())}.db"
    c0, w0 = time.process_time(), time.perf_counter()
    res_b = tuning.tune(ws, actor, template, frame=frame, trials=args.rdb_trials, storage=f"sqlite:///{db}",
                        study="bench-rdb")
    out["rdb_direct"] = {"trials_per_min": round(res_b.trials_per_min, 1), "trials": res_b.trials_run,
                         "seconds": round(res_b.seconds, 2),
                         "trials_per_cpu_min": round(res_b.trials_run / res_b.cpu_seconds * 60, 1)}

    # (c) naive reference: re-score from scratch per trial, same sampler and objective
    problem_labels = tuning.outcome_labels(frame)
    held = tuning.split_episodes(tuning.split_keys(frame, "task"), problem_labels.success, 0.5, 0)
    train = (~held) & problem_labels.known
    scoring = tuning.withhold_outcomes(frame)
    space = tuning.SearchSpace.for_template(template, exclude=[c.name for c in template.all_components
                                                               if c.component in tuning.OUTCOME_COMPONENTS])

    def naive(trial: optuna.Trial) -> float:
        weights, _ = space.suggest(trial)
        result = Pyramid(template.with_weights(weights)).score(scoring, ctx=ctx)   # every component again
        report = rewards.evaluate_expectations(result)
        for r in report.results:
            trial.set_constraint(r.name, 0.0 if r.passed else 1.0)
        return tuning.auc(result.returns[train], problem_labels.success[train])

    naive_study = optuna.create_study(direction="maximize", sampler=tuning.make_sampler(tuning.TuneConfig(),
                                                                                           distributed=False))
    c0, w0 = time.process_time(), time.perf_counter()
    naive_study.optimize(naive, n_trials=args.naive_trials)
    out["naive"] = rate(args.naive_trials, time.perf_counter() - w0, time.process_time() - c0)
    out["speedup_default_vs_naive"] = round(out["default"]["trials_per_min"] / out["naive"]["trials_per_min"], 1)
    out["target_trials_per_min"] = 1000
    out["target_met"] = out["default"]["trials_per_min"] >= 1000
    try:
        out["load_average"] = os.getloadavg()
    except OSError:
        pass
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['steps']} steps, {out['episodes']} episodes, template {out['template']}, {out['cores']} cores, "
          f"load {out.get('load_average')}")
    print(f"  component matrix once: {out['matrix_seconds_first']} s (cached after the first run)")
    d = out["default"]
    print(f"  (a) default path (in-memory + batched journal): {d['trials_per_min']:.0f} trials/min wall, "
          f"{d['trials_per_cpu_min']:.0f} per CPU-minute ({d['trials']} trials in {d['seconds']} s; "
          f"{d['persisted_trials']} persisted; setup+report {d['setup_and_report_seconds']} s)")
    b = out["rdb_direct"]
    print(f"  (b) direct RDB storage (sqlite):               {b['trials_per_min']:.0f} trials/min wall, "
          f"{b['trials_per_cpu_min']:.0f} per CPU-minute")
    n = out["naive"]
    print(f"  (c) naive re-scoring per trial:                {n['trials_per_min']:.1f} trials/min wall, "
          f"{n['trials_per_cpu_min']:.1f} per CPU-minute ({n['trials']} trials in {n['seconds']} s)")
    print(f"  speed-up (a)/(c): {out['speedup_default_vs_naive']}x; target ≥ 1,000 trials/min: "
          f"{'met' if out['target_met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
