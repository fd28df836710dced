"""Leave-one-set-out design of the generic ``tool_agent`` pyramid over the labelled real sets.

Every labelled set of real agent logs in ``datasets/real`` (tau2 airline runs of the Whissle
agent, one run per task; tau2 airline and telecom runs of Grok agents; AgentDojo runs of six
LLM agents over 97 tasks) is imported with the project's importer into a temporary workspace.
The outcome is read only to measure. For each candidate signal (a term of the shipped
template, or a term the design considered and the template leaves out) and for the whole
template, per set: AUC over all pairs and within task (a success and a failure of the same
task), each with its 90% interval over tasks and the tasks with both outcomes
(:func:`core.rewards.outcomes.fidelity`), then the sign check: does the term rank successes
first on every set.

Leave-one-set-out: for each set, the template is rebuilt from the candidates whose sign held
on the *other* sets only (all-pairs and within-task, where a set has within-task pairs), and
measured on the set left out; the line says whether that template is the shipped one.

Run (``RWB_EMBEDDING_CACHE`` reuses embeddings across runs)::

    RWB_EMBEDDING_CACHE=/tmp/rwb-embed-cache .venv/bin/python benchmarks/design_tool_agent.py \
        [--template PATH] [--boot 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL = ROOT / "datasets" / "real"
#: labelled real sets: folder -> import options (as datasets/real/README.md says)
DATASETS = {"tau2_whissle": {"reward_key": "outcome", "id_key": "id"},
            "tau2_grok": {"reward_key": "outcome", "id_key": "id"},
            "agentdojo": {"reward_key": "success", "id_key": "eid"}}
#: Terms the design considered and the shipped template leaves out: section -> name -> spec.
EXTRA_TERMS = {
    "penalties": {"writes": {"component": "write_actions", "weight": 1.0, "params": {"per": 0.3}},
                  "repeated_failures": {"weight": 1.0, "params": {"per": 0.2, "cap": 5, "match": "tool"}}},
    "episode_terms": {"gave_up": {"component": "gives_up", "weight": 1.0, "params": {"value": -1.0}}}}
#: The per-step block (levels and the step cost that offsets them): kept as one, measured as
#: the discounted step return.
STEP_BLOCK = ("tool_validity", "param_reasonableness", "output_consistency", "step_cost")
#: Probes of the last words measured for the record (not template terms): a regex each,
#: scored +1 when it matches (the sign says which way it goes on each set).
PROBES = {"ends with a question": r"\?[\s\"'}]*$",
          "claims something done": r"(?:successfully|ha(?:s|ve) been|i (?:have|'ve) )"}


def _load(template: str | None):
    import yaml

    from core import rewards

    source = Path(template) if template else rewards.templates_dir() / "tool_agent.yaml"
    shipped = rewards.load_template(str(source))
    data = yaml.safe_load(source.read_text())
    for section, terms in EXTRA_TERMS.items():
        for name, spec in terms.items():
            data.setdefault(section, {}).setdefault(name, spec)
    candidates = rewards.parse_template(yaml.safe_dump(data, sort_keys=False), file=str(source))
    return shipped, candidates


def _term_values(result) -> dict[str, "object"]:
    """Per episode, what each term adds to the return (before ``b`` / ``a``)."""
    import numpy as np

    frame, out = result.frame, {}
    contributions = result.contributions()
    names = [c.name for c in result.template.step_components]
    for j, name in enumerate(names):
        if name not in STEP_BLOCK:
            out[name] = np.bincount(frame.episode, weights=contributions[:, j], minlength=frame.n_episodes)
    for j, c in enumerate(result.template.episode_terms):
        out[c.name] = result.matrix.episode_values[:, j] * c.weight
    out["step block (discounted)"] = result.discounted
    return out


def _probes(frame) -> dict[str, "object"]:
    import numpy as np
    import pandas as pd

    from core.rewards.agent_signals import last_words_rows
    from core.rewards.frame import TOOL_CALL

    last = last_words_rows(frame)
    words = pd.Series([frame.output_text[i] if i >= 0 else "" for i in last], dtype=object).astype(str)
    words = words.str.lower().str.replace("\u2019", "'", regex=False)
    out = {k: words.str.contains(re.compile(p)).to_numpy(float) for k, p in PROBES.items()}
    calls = frame.kind == TOOL_CALL
    out["more tool calls (count)"] = np.bincount(frame.episode[calls], minlength=frame.n_episodes).astype(float)
    out["fewer steps (count)"] = -frame.ep_len.astype(float)
    return out


def _figure(fid) -> dict:
    def one(f):
        return {"auc": None if f.value != f.value else round(f.value, 4),
                "ci90": [None if x != x else round(x, 4) for x in f.ci90], "n_tasks": f.n_tasks}
    return {"all_pairs": one(fid.all_pairs), "within_task": one(fid.within_task)}


def _holds(fig: dict) -> bool:
    """Never ranks failures first on the set: no defined AUC below 0.5 (a term that is the
    same on every episode of a set, 0.5, tells nothing there and does no harm)."""
    return all(fig[k]["auc"] >= 0.5 for k in ("all_pairs", "within_task") if fig[k]["auc"] is not None)


def design(template: str | None = None, n_boot: int = 200) -> dict:
    from core.data.importers import import_file
    from core.records.store import Workspace
    from core.rewards.api import load_frame, score
    from core.rewards.labels import dataset_outcomes
    from core.rewards.outcomes import fidelity

    shipped, candidates = _load(template)
    optional = [c.name for c in candidates.all_components if c.name not in STEP_BLOCK]
    report: dict = {"template": shipped.name, "sets": {}, "terms": {}, "leave_one_set_out": {}}
    scored = {}
    with tempfile.TemporaryDirectory(prefix="rwb-design-") as tmp:
        ws = Workspace.open(Path(tmp))
        for name, options in DATASETS.items():
            import_file(ws, REAL / name / "episodes.jsonl", dataset=name, **options)
            frame = load_frame(ws, name)
            labels, groups = dataset_outcomes(ws, name)
            result = score(ws, candidates, frame=frame)
            shipped_result = score(ws, shipped, frame=frame)
            scored[name] = (result, labels, groups)
            values = _term_values(result) | _probes(frame)
            report["sets"][name] = {"episodes": int(frame.n_episodes), "success_rate": round(float(labels.mean()), 3),
                                    "template": _figure(fidelity(shipped_result.returns, labels, groups, n_boot=n_boot)),
                                    "by_domain": {}}
            domains = frame.domain.astype(str)
            for domain in sorted(set(domains.tolist())):
                rows = domains == domain
                if len(set(labels[rows].tolist())) == 2:
                    report["sets"][name]["by_domain"][domain] = _figure(fidelity(
                        shipped_result.returns[rows], labels[rows], groups[rows], n_boot=n_boot))
            for term, v in values.items():
                report["terms"].setdefault(term, {})[name] = _figure(fidelity(v, labels, groups, n_boot=n_boot))
    for term, per_set in report["terms"].items():
        per_set["sign_holds_everywhere"] = all(_holds(f) for f in per_set.values() if isinstance(f, dict))
    shipped_names = {c.name for c in shipped.all_components}
    for held_out, (result, labels, groups) in scored.items():
        design_sets = [s for s in scored if s != held_out]
        kept = [t for t in optional if all(_holds(report["terms"][t][s]) for s in design_sets)]
        weights = {t: (c.weight if t in kept else 0.0) for c in candidates.all_components
                   for t in [c.name] if t in optional}
        returns = result.reweight(weights).returns
        same = set(kept) | set(STEP_BLOCK) == shipped_names
        report["leave_one_set_out"][held_out] = {
            "designed_on": design_sets, "kept": kept, "dropped": [t for t in optional if t not in kept],
            "is_the_shipped_template": same, **_figure(fidelity(returns, labels, groups, n_boot=n_boot))}
    return report


def _fmt(fig: dict) -> str:
    def one(f):
        if f["auc"] is None:
            return "—"
        lo, hi = f["ci90"]
        ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
        return f"{f['auc']:.3f}{ci}"
    return f"{one(fig['all_pairs'])} / {one(fig['within_task'])} ({fig['within_task']['n_tasks']} tasks)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", help="template file to measure (default: the shipped tool_agent)")
    ap.add_argument("--boot", type=int, default=200, help="bootstrap draws over tasks")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = design(args.template, args.boot)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    sets = list(report["sets"])
    print("AUC all pairs / within task, 90% interval over tasks; (tasks with both outcomes)")
    for name, s in report["sets"].items():
        print(f"{name:<13} {s['episodes']:>4} episodes, success {s['success_rate']:.2f}:  "
              f"{report['template']} {_fmt(s['template'])}")
        for domain, fig in s["by_domain"].items():
            print(f"    {domain:<30} {_fmt(fig)}")
    print("\nterm (as it enters the return)    " + "".join(f"{s:<50}" for s in sets) + "sign holds")
    for term, per_set in report["terms"].items():
        print(f"{term:<34}" + "".join(f"{_fmt(per_set[s]):<50}" for s in sets)
              + ("yes" if per_set["sign_holds_everywhere"] else "no"))
    print("\nleave one set out: the template from the terms whose sign held on the other sets")
    for held_out, r in report["leave_one_set_out"].items():
        print(f"{held_out:<13} {_fmt(r)}   designed on {', '.join(r['designed_on'])}; "
              f"{'the shipped template' if r['is_the_shipped_template'] else 'differs: kept ' + ', '.join(r['kept'])}")


if __name__ == "__main__":
    main()
