"""``rwb demo``: the whole loop of the workbench, headless, on a fresh workspace.

:func:`run_demo` walks the path a team takes with a new agent (docs/design.md §1): users,
episodes, reward, state map, training, review, tuning, bundle, registry and serving, each step
with the same ``core`` function the app and the CLI call, acting as the user whose role the
step needs.  The :class:`DemoReport` keeps what each step did and its key figures;
``small=True`` shrinks every size for the test suite.

Details: docs/workspace.md (## The demo).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.base.errors import InputError, PermissionDenied
from core.access import audit
from core.access.users import LOCAL_ADMIN, add_user, authenticate, multi_user
from core.data import datasets
from core.data.importers import import_file
from core.govern import registry
from core.govern.bundle import export_bundle, verify_in_workspace
from core.guard import review
from core.rl import runs
from core.rl.runs import open_run
from core.serve.serving import ServingConfig, load

if TYPE_CHECKING:  # pragma: no cover
    from core.records.episodes import Episode
    from core.records.store import Workspace
    from core.access.users import Actor

#: Marks a workspace the demo created, so ``rwb demo --replace`` may delete it again.
MARKER = "demo.json"
DEMO_DATASET = "demo-finance"
#: The current agent's logs: the generator's ``noisy`` behaviour only (an imperfect agent).
AGENT_DATASET = "demo-agent-logs"
AGENT_BEHAVIOUR = "noisy"
DEMO_TEMPLATE = "finance_risk"
DEMO_POLICY = "finance_risk"

#: The demo's users: name -> (role, password).  Demo passwords, printed on purpose: the
#: workspace is a local sandbox to sign in to the app with.
DEMO_USERS: dict[str, tuple[str, str]] = {
    "ada": ("admin", "ada-demo-pass"),
    "ana": ("analyst", "ana-demo-pass"),
    "rae": ("reviewer", "rae-demo-pass"),
    "bob": ("approver", "bob-demo-pass"),
}


@dataclass(frozen=True)
class DemoSizes:
    """How big each step is (``small`` for the test suite, the default for people)."""

    episodes: int
    train_steps: int
    map_points: int
    tune_trials: int
    serve_episodes: int
    #: width of the policy's hidden layers and PPO passes per batch (the full demo trains
    #: the default 2×256 network; the test suite's a small one)
    hidden: int = 256
    update_epochs: int = 4
    #: episodes generated for the agent's logs, of which the ``noisy`` ones (about 40%) are kept
    agent_generated: int = 2000


FULL = DemoSizes(episodes=400, train_steps=200_704, map_points=2000, tune_trials=150, serve_episodes=6)
SMALL = DemoSizes(episodes=120, train_steps=8192, map_points=500, tune_trials=25, serve_episodes=3,
                  hidden=128, update_epochs=2, agent_generated=150)


@dataclass
class DemoStep:
    """One step of the demo: what ran, how long it took, its key figures, where to look."""

    name: str
    title: str
    seconds: float
    figures: dict[str, Any]
    where: str
    notes: list[str] = field(default_factory=list)


@dataclass
class DemoReport:
    """What :func:`run_demo` did (``rwb demo --json`` prints :meth:`to_dict`)."""

    workspace: str
    policies_dir: str
    users: dict[str, dict[str, str]]
    small: bool
    steps: list[DemoStep] = field(default_factory=list)
    seconds: float = 0.0

    def step(self, name: str) -> DemoStep:
        """The step called ``name`` (KeyError when the demo did not get there)."""
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    def app_command(self) -> str:
        """The command that opens the app on the demo workspace and its policies folder."""
        return f"RWB_POLICIES_DIR={self.policies_dir} rwb --workspace {self.workspace} app"

    def to_dict(self) -> dict[str, Any]:
        return _finite({"workspace": self.workspace, "policies_dir": self.policies_dir, "users": self.users,
                        "small": self.small, "seconds": self.seconds, "app": self.app_command(),
                        "steps": [asdict(s) for s in self.steps]})


def _finite(x: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, numpy scalars plain numbers."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _r(x: Any, digits: int = 3) -> Any:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), digits)


# --------------------------------------------------------------------------- requests from episodes
def requests_from_episode(episode: "Episode", *, episode_id: str | None = None) -> list[dict[str, Any]]:
    """The decision requests a production service would have sent during ``episode``: one
    per step, with the user's query, the task type, the step's state features and the
    result of the previous step's action (``core.serve.serving.DecisionRequest`` fields).

    Replaying recorded episodes this way is how the demo (and notebook 02) exercises the
    decision engine on realistic traffic."""
    key = episode_id or f"replay-{episode.episode_id}"
    out: list[dict[str, Any]] = []
    previous = None
    for step in episode.steps:
        obs = step.observation or {}
        state = {k: v for k, v in (obs.get("state") or {}).items()
                 if isinstance(v, (str, int, float, bool)) and not (isinstance(v, float) and not math.isfinite(v))}
        request: dict[str, Any] = {"episode_id": key, "query": episode.task.query, "state": state}
        if episode.task.task_type:
            request["task_type"] = episode.task.task_type
        if episode.domain:
            request["domain"] = episode.domain
        if previous is not None and previous.action.kind == "tool_call":
            last: dict[str, Any] = {"tool": previous.action.tool}
            if previous.tool_error:
                last["error"] = previous.tool_error
            elif previous.tool_result is not None:
                last["result"] = previous.tool_result
            if previous.latency_ms is not None:
                last["latency_ms"] = float(previous.latency_ms)
            request["last_result"] = last
        out.append(request)
        previous = step
    return out


# --------------------------------------------------------------------------- the demo
def _check_fresh(ws: "Workspace") -> None:
    if multi_user(ws) or ws.datasets(include_archived=True):
        raise InputError(f"the demo needs a fresh workspace, and {ws.root} already has "
                         f"{'users' if multi_user(ws) else 'datasets'}: give another folder "
                         "(rwb demo --dir DIR), or --replace to recreate a previous demo workspace",
                         field="workspace")


def default_policies_dir(ws: "Workspace") -> Path:
    """Where the demo promotes to unless told otherwise: ``<workspace>/policies``."""
    return ws.root / "policies"


def run_demo(ws: "Workspace", *, small: bool = False, log: Callable[[str], None] = print,
             policies_dir: str | Path | None = None, seed: int = 0) -> DemoReport:
    """Run the whole loop on the fresh workspace ``ws`` (docs/workspace.md, ## The demo) and
    return what it did.  ``policies_dir``: where the policy is promoted (default
    ``<workspace>/policies``).  Refuses a workspace that already has users or data."""
    _check_fresh(ws)
    sizes = SMALL if small else FULL
    policies = Path(policies_dir) if policies_dir is not None else default_policies_dir(ws)
    report = DemoReport(workspace=str(ws.root), policies_dir=str(policies), small=small,
                        users={n: {"role": r, "password": p} for n, (r, p) in DEMO_USERS.items()})
    marker = ws.root / MARKER
    tmp = marker.with_name(f".{MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"created_by": "rwb demo", "small": small, "seed": seed}) + "\n")
    os.replace(tmp, marker)
    t_start = time.perf_counter()
    ctx: dict[str, Any] = {"sizes": sizes, "seed": seed, "policies": policies}

    steps: list[tuple[str, str, Callable[..., tuple[dict[str, Any], str, list[str]]]]] = [
        ("users", "Users and roles", _step_users),
        ("episodes", "Generate and import episodes", _step_episodes),
        ("reward", "Score with the reward pyramid", _step_reward),
        ("state_map", "State map and fidelity", _step_state_map),
        ("training", "Train a policy (masked PPO, curriculum)", _step_training),
        ("review", "Review queue", _step_review),
        ("tuning", "Tune the pyramid's weights", _step_tuning),
        ("bundle", "Export and verify a bundle", _step_bundle),
        ("registry", "Approve and promote (four-eyes)", _step_registry),
        ("serving", "Serve decisions with an audit trail", _step_serving),
    ]
    for i, (name, title, fn) in enumerate(steps, 1):
        log(f"[{i}/{len(steps)}] {title} …")
        t0 = time.perf_counter()
        figures, where, notes = fn(ws, ctx, log)
        step = DemoStep(name=name, title=title, seconds=round(time.perf_counter() - t0, 2),
                        figures=_finite(figures), where=where, notes=notes)
        report.steps.append(step)
        for line in _figure_lines(figures):
            log(f"      {line}")
        for note in notes:
            log(f"      · {note}")
        log(f"      ({step.seconds:.1f} s; in the app: {where})")
    report.seconds = round(time.perf_counter() - t_start, 2)
    log("")
    log(f"Done in {report.seconds:.0f} s. Open the app on the demo workspace:")
    log(f"  {report.app_command()}")
    log("and sign in as " + ", ".join(f"{n} ({r}, password {p})" for n, (r, p) in DEMO_USERS.items()) + ".")
    return report


def _figure_lines(figures: Mapping[str, Any]) -> Iterator[str]:
    for key, value in figures.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
            yield f"{key}: {inner}"
        elif isinstance(value, list):
            yield f"{key}: {', '.join(_fmt(v) for v in value)}"
        else:
            yield f"{key}: {_fmt(value)}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def _actor(ctx: Mapping[str, Any], name: str) -> "Actor":
    return ctx["actors"][name]


# --------------------------------------------------------------------------- 1. users
def _step_users(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    admin_name = next(n for n, (r, _) in DEMO_USERS.items() if r == "admin")
    add_user(ws, LOCAL_ADMIN, admin_name, "admin", password=DEMO_USERS[admin_name][1])
    admin = authenticate(ws, admin_name, DEMO_USERS[admin_name][1])
    for name, (role, password) in DEMO_USERS.items():
        if name != admin_name:
            add_user(ws, admin, name, role, password=password)
    # Everyone signs in the way the app's login form does.
    ctx["actors"] = {name: authenticate(ws, name, password) for name, (_, password) in DEMO_USERS.items()}
    figures = {"users": {n: r for n, (r, _) in DEMO_USERS.items()}}
    return figures, "sign in on the login page; Users and roles: `rwb users list --as ada`", [
        "multi-user mode: the local admin is retired, every action is checked against its role"]


# --------------------------------------------------------------------------- 2. episodes
def _step_episodes(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    sizes: DemoSizes = ctx["sizes"]
    folder = ws.artifact_dir("demo")
    out = folder / f"finance-{sizes.episodes}.jsonl"
    summary = datasets.generate_file("finance", sizes.episodes, ctx["seed"] + 2024, out)
    result = import_file(ws, out, dataset=DEMO_DATASET, actor=_actor(ctx, "ana"))
    logs = folder / f"agent-logs-{sizes.agent_generated}.jsonl"
    agent = datasets.generate_file("finance", sizes.agent_generated, ctx["seed"] + 2025, logs,
                                   behaviours=AGENT_BEHAVIOUR)
    agent_result = import_file(ws, logs, dataset=AGENT_DATASET, actor=_actor(ctx, "ana"))
    ctx["dataset"], ctx["train_dataset"] = DEMO_DATASET, AGENT_DATASET
    figures = {"file": str(out), "episodes": result.episodes, "steps": result.steps,
               "tool_calls": result.tool_calls, "invalid_tokens": result.invalid_tokens,
               "behaviours": summary.behaviours,
               "agent_logs": {"file": str(logs), "episodes": agent_result.episodes, "steps": agent_result.steps,
                              "behaviours": agent.behaviours}}
    return figures, f"Episodes page → datasets {DEMO_DATASET} (labelled) and {AGENT_DATASET} (the agent's logs)", [
        f"{DEMO_DATASET}: a labelled reference set to design the reward on; {AGENT_DATASET}: the current "
        f"agent's logs ({AGENT_BEHAVIOUR} behaviour), which the policy trains on and must beat"]


# --------------------------------------------------------------------------- 3. reward
def _step_reward(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    from core import rewards  # deferred: loads pandas and scipy

    result = rewards.score(ws, DEMO_TEMPLATE, dataset=ctx["dataset"])
    check = rewards.check(ws, DEMO_TEMPLATE, result=result)
    table = result.episodes_table()
    by_behaviour = {}
    if "behaviour" in table.columns:
        by_behaviour = {str(k): _r(v) for k, v in table.groupby("behaviour")["return"].mean().items()}
    figures = {"template": DEMO_TEMPLATE, "steps_scored": int(result.frame.n_steps),
               "mean_return_by_behaviour": by_behaviour,
               "expectations_passed": f"{len(check.results) - len(check.failed)} / {len(check.results)}"}
    notes = [f"{'PASS' if r.passed else 'FAIL'} {r.name}: {r.message}" for r in check.results]
    return figures, f"Reward Pyramid page → template {DEMO_TEMPLATE}@0, dataset {ctx['dataset']}", notes


# --------------------------------------------------------------------------- 4. state map
def _step_state_map(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    from core.state.statemap import states_map  # deferred: loads torch and pandas

    sizes: DemoSizes = ctx["sizes"]
    # The map's points as data (x, y and the fields they are coloured by); the State Explorer
    # page draws the map.
    out = ws.artifact_dir("demo") / "state_map.csv"
    rep = states_map(ws, dataset=ctx["dataset"], template=DEMO_TEMPLATE, max_points=sizes.map_points,
                     out=out, progress=lambda msg: log(f"      state map: {msg}"))
    fid, ent = rep.fidelity, rep.entropy
    figures = {"points": int(len(rep.index)),
               "silhouette_by_task_type": _r(fid.silhouette), "silhouette_shuffled": _r(fid.silhouette_shuffled),
               "knn_agreement": _r(fid.knn_agreement), "knn_chance": _r(fid.knn_chance),
               "action_entropy_nats": _r(ent.overall),
               "map": str(out)}
    return figures, "State Explorer page", [v for v in (fid.verdict, ent.verdict) if v]


# --------------------------------------------------------------------------- 5. training
def demo_training_config(sizes: DemoSizes, seed: int = 0):
    """The run's settings: the network and passes of ``sizes`` and quick curriculum
    unlocks, so the run reaches L3 (high-risk review) within the demo's budget.  ``high_risk_repeat`` 1:
    every high-risk action taken at L3 goes to review (the seed: 3 in a row).  A short run
    almost never repeats one now that repeats are charged (``duplicate_calls``), so with 2
    or 3 the demo would often have nothing to review."""
    from core.rl.ppo import PPOConfig  # deferred: loads torch and gymnasium

    return PPOConfig(total_steps=sizes.train_steps, n_envs=64, rollout_len=16, update_epochs=sizes.update_epochs,
                     n_minibatches=2, hidden=sizes.hidden, n_critics=3, bc_epochs=30, eval_every=2,
                     l0_min_updates=1, l0_max_updates=2, l2_progress=0.0, l3_progress=0.0,
                     unlock_patience=1, high_risk_repeat=1, max_review_items=20, checkpoint_every=5,
                     train_encoder=False, device="cpu", threads=1, seed=seed).validate()


def _step_training(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    cfg = demo_training_config(ctx["sizes"], ctx["seed"])
    total_updates = max(1, cfg.total_steps // (cfg.n_envs * cfg.rollout_len))
    last = {"t": 0.0}

    def progress(m: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        if now - last["t"] >= 5 or m.get("update") == total_updates:
            last["t"] = now
            log(f"      update {m.get('update')}/{total_updates} · L{m.get('curriculum_level')} · "
                f"return {_fmt(m.get('return_mean'))} · KL {_fmt(m.get('kl'))} · "
                f"review items {m.get('review_items_total', 0)}")

    out = runs.train(ws, _actor(ctx, "ana"), template=DEMO_TEMPLATE, dataset=ctx["train_dataset"], config=cfg,
                     progress=progress)
    ctx["run_id"] = out.run_id
    m = out.metrics
    figures = {"run": out.run_id, "status": out.status, "env_steps": m.get("env_steps"),
               "curriculum_level": m.get("curriculum_level"), "return_mean": _r(m.get("return_mean")),
               "eval_return": _r(m.get("eval_return")), "best_logged_return": _r(m.get("best_logged_return")),
               "random_return": _r(m.get("random_return")), "kl_std": _r(m.get("kl_std"), 5),
               "mask_violations": m.get("mask_violations"), "review_items": m.get("review_items_total"),
               "env_steps_per_s": _r(m.get("env_steps_per_s"), 0)}
    return figures, f"Training page → run {out.run_id}; Diagnostics page for the four-step diagnosis", []


# --------------------------------------------------------------------------- 6. review
def _step_review(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    reviewer = _actor(ctx, "rae")
    pending = review.list_items(ws, status="open", origin="training")
    if not pending:
        raise RuntimeError(f"run {ctx.get('run_id')} queued no L3 review item; the demo cannot show the "
                           "review step (raise the training steps)")
    decided = []
    for i, item in enumerate(pending[:2]):
        claimed = review.claim(ws, reviewer, item.id)
        assert claimed is not None, "a claim naming its item returns the item or raises"
        if i == 0:
            done = review.decide(ws, reviewer, claimed.id, "approve",
                                 "reasonable exploration: the state supports this trade")
        else:
            done = review.decide(ws, reviewer, claimed.id, "reject",
                                 "too risky in this state: never take this action here")
        decided.append(done)
    stats = review.stats(ws)
    figures = {"queued_by_training": len(pending),
               "decided": [f"#{d.id} {d.action_label or d.token_name} → {d.decision}"
                           for d in decided],
               "review_mask_rules": len(review.review_mask_rules(ws)),
               "queue": {"pending": stats.pending, "decided": stats.decided, "approved": stats.approved,
                         "rejected": stats.rejected}}
    return figures, "Review Queue page (sign in as rae)", [
        "approve → the step becomes labelled 'reasonable exploration' data for the next run; "
        "reject → a mask rule that training and decide() honour"]


# --------------------------------------------------------------------------- 7. tuning
def _step_tuning(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    from core import tuning  # deferred: loads optuna and sklearn

    sizes: DemoSizes = ctx["sizes"]
    analyst = _actor(ctx, "ana")
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial would drown the demo's own
    try:
        result = tuning.tune(ws, analyst, DEMO_TEMPLATE, dataset=ctx["dataset"],
                             config=tuning.TuneConfig(objective="outcome", seed=ctx["seed"]),
                             trials=sizes.tune_trials, study="demo-weights")
    finally:
        optuna.logging.set_verbosity(verbosity)
    figures: dict[str, Any] = {"study": result.study, "metric": result.metric, "trials": result.trials_run,
                               "feasible_trials": result.feasible_trials,
                               "trials_per_min": _r(result.trials_per_min, 0),
                               "auc_template_weights": _aucs((result.baseline or {}).get("figures")),
                               "auc_best_weights": None}
    notes: list[str] = []
    if result.best is not None:
        figures["auc_best_weights"] = _aucs(result.best.get("figures"))
        check = tuning.apply_check(ws, result.study)
        if check.worse:
            # the apply guard: weights that rank held-out tasks worse than the template are not saved
            notes.append(f"not applied: {check.message}")
        elif _keeps_template(result.best, result.baseline or {}):
            notes.append("not applied: the best trial keeps the template's own weights")
        else:
            applied = tuning.apply_study(ws, analyst, result.study, message="rwb demo: tuned weights")
            figures["applied_as"] = applied.label
            notes.append(f"applied: {check.message}; saved as a new template version (nothing overwritten)")
    return figures, "Tuning page → study demo-weights", notes


def _keeps_template(best: Mapping[str, Any], baseline: Mapping[str, Any]) -> bool:
    """Does the best trial hold the template's own weights and parameters (nothing to apply)?"""
    mine, theirs = best.get("weights") or {}, baseline.get("weights") or {}
    return not best.get("params") and set(mine) == set(theirs) and \
        all(abs(float(mine[k]) - float(theirs[k])) <= 1e-12 for k in mine)


def _aucs(figures: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{"train": auc, "held_out": auc}`` from an outcome objective's figures."""
    if not figures:
        return None
    return {side: _r((figures.get(side) or {}).get("auc")) for side in ("train", "held_out")}


# --------------------------------------------------------------------------- 8. bundle
def _step_bundle(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    path = export_bundle(ws, _actor(ctx, "ana"), ctx["run_id"])
    verdict = verify_in_workspace(ws, path)   # signed with the workspace's key, which it trusts
    if not verdict.ok:
        raise RuntimeError(f"the exported bundle does not verify: {verdict.reason}")
    ctx["bundle"] = Path(path)
    m = verdict.manifest or {}
    ev = m.get("evaluation") or {}
    figures = {"bundle": str(path), "name": m.get("name"), "version": m.get("version"),
               "files": len(m.get("files") or []), "verified": verdict.ok, "signer": verdict.signer,
               "heldout_return": _r((ev.get("policy") or {}).get("return_mean")),
               "best_logged": {k: _r(v) if isinstance(v, float) else v
                               for k, v in (ev.get("best_logged") or {}).items()}}
    return figures, "Policies page → bundles", []


# --------------------------------------------------------------------------- 9. registry
def _step_registry(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    analyst, approver = _actor(ctx, "ana"), _actor(ctx, "bob")
    version = registry.register(ws, analyst, ctx["bundle"], comment="rwb demo")
    name, ver = version.name, version.version
    notes = []
    try:  # four-eyes: whoever trained and exported may not approve (an analyst may not anyway)
        registry.approve(ws, analyst, name, ver, "my own run")
    except PermissionDenied as exc:
        notes.append(f"refused as expected: {exc}")
    gate = registry.promotion_gate(ws, name, ver)
    figures = {"policy": name, "version": ver, "gate": gate.reason, "gate_passed": gate.passed,
               "policies_dir": str(ctx["policies"])}
    if gate.passed:
        registry.approve(ws, approver, name, ver, f"rwb demo: {gate.reason}")
        entry = registry.promote(ws, approver, name, ver, "rwb demo", root=ctx["policies"])
        ctx["policy"] = name
        figures.update(approved_by=approver.name, active=entry.active)
    else:
        # The gate holds even for the approver: nothing is promoted, and the demo serves the
        # verified bundle file itself (what a staging service would do).
        try:
            registry.approve(ws, approver, name, ver, "rwb demo")
        except registry.GateFailed as exc:
            notes.append(f"approval refused by the promotion gate: {exc}")
        ctx["policy"] = str(ctx["bundle"])
        figures.update(approved_by=None, active=None, served_from=str(ctx["bundle"]))
    return figures, "Policies page (sign in as bob to approve, promote, roll back)", notes


# --------------------------------------------------------------------------- 10. serving
def _step_serving(ws: "Workspace", ctx: dict[str, Any], log: Callable[[str], None]):
    sizes: DemoSizes = ctx["sizes"]
    before = audit.stats(ws).records
    # Held-out traffic: the run's held-out episodes (it never trained on them) are the
    # closest thing to production requests the demo has.

    data = open_run(ws, ctx["run_id"], need_policy=False).data
    ids = [data.tables.episode_ids[i] for i in data.heldout_episodes.cpu().tolist()[:sizes.serve_episodes]]
    chosen = ws.load_episodes(ctx["train_dataset"], episode_ids=ids)
    sources: Counter[str] = Counter()
    served = boosted = adopted = 0
    # The replay sends an episode's requests back to back, with none of the time between
    # them in which a service embeds a new query in the background: its RL-Boosts wait for
    # the embedding rather than being deferred (ServingConfig.wait_for_intent), and the
    # sentence model runs in this process (no child to start for 36 requests).
    config = ServingConfig(wait_for_intent=True, model_process=False)
    with load(ctx["policy"], ws=ws, root=ctx["policies"], config=config) as engine:
        for ep in chosen:
            for request in requests_from_episode(ep):
                decision = engine.decide(request)
                sources[decision.source] += 1
                boosted += decision.rl_boost
                adopted += decision.adopted
                served += 1
        version = engine.policy_version
        engine.flush()
    after = audit.stats(ws).records
    last = audit.tail(ws, 1)
    figures = {"policy_version": version, "episodes": len(chosen), "decisions": served,
               "by_source": dict(sources), "rl_boost": boosted, "adopted": adopted,
               "audit_records_written": after - before,
               "last_audit_record": {k: getattr(last[0], k) for k in ("timestamp", "rde_action", "final_action")}
               if last else None}
    if after - before != served:
        raise RuntimeError(f"{served} decisions but {after - before} audit records")
    return figures, "Audit page; `rwb audit tail`", []
