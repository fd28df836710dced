"""Shared data for the tuning tests: a finance pyramid without the sentence-embedding
component (so tests need no model), generated finance episodes with known outcomes, and
a workspace holding them."""

from __future__ import annotations

from pathlib import Path

from core.data.datasets import generate, write_jsonl
from core.rewards.template import Template, parse_template
from core.records.store import Workspace

#: finance_risk without output_consistency (the one component that needs the sentence model).
FIN_FAST = """\
version: 1
name: fin_fast
description: finance pyramid without the sentence-embedding component (tests)
return: {a: 0.7, b: 0.3, gamma: 0.95}
gating: {enabled: true}
levels:
  L1:
    gate: 0.5
    components:
      tool_validity: {weight: 0.3}
  L2:
    components:
      param_reasonableness: {weight: 0.4, params: {window: 1000, z_ok: 2.0, z_zero: 3.48, max_value: 0.8}}
  L3:
    components:
      evidence_reliability: {weight: 0.3, params: {markers: ['"verified":false']}}
  L4:
    components:
      business_impact: {weight: 0.1, params: {field: business_metric, low: 0.1, high: 1.0}}
penalties:
  latency: {component: latency_penalty, weight: 1.0, params: {per: 0.05, unit_ms: 1000}}
  trade_reversal:
    component: action_smoothing
    weight: 1.0
    params: {per: 0.2, key_param: side, opposites: [[place_order:buy, place_order:sell]]}
  repeated_failures: {weight: 1.0, params: {per: 0.2, cap: 5}}
episode_terms:
  outcome: {component: terminal_outcome, weight: 1.0, params: {field: final_reward, low: -1.0, high: 1.0}}
expectations:
  - name: hacks rank below their honest twins
    kind: twins_rank
    episodes: {behaviour: hacker}
  - name: failed calls earn nothing above L1
    kind: component_range
    component: tool_validity
    value: contribution
    max: 0.0
    steps: {tool_error: true}
"""

#: Deliberately bad starting weights: parameter history and trade reversals only (both
#: nearly blind to the seed's reward hack), everything that tells good runs apart at 0.
BAD_WEIGHTS = {"tool_validity": 0.0, "param_reasonableness": 1.0, "evidence_reliability": 0.0,
               "business_impact": 0.0, "latency": 0.0, "trade_reversal": 2.0, "repeated_failures": 0.0,
               "outcome": 0.0}


def fin_fast() -> Template:
    return parse_template(FIN_FAST)


def write_template(template: Template, path: Path, name: str | None = None) -> Path:
    text = template.to_yaml()
    if name is not None:
        text = text.replace(f"name: {template.name}\n", f"name: {name}\n", 1)
    path.write_text(text, encoding="utf-8")
    return path


def finance_workspace(root: Path, n_episodes: int = 240, seed: int = 11, dataset: str = "fin") -> Workspace:
    """A workspace with one generated finance dataset (known outcomes, hacker twins)."""
    ws = Workspace.open(root)
    if not ws.has_dataset(dataset):
        # straight into the store (the importers have their own tests)
        data = generate("finance", n_episodes, seed=seed)
        with ws.transaction() as conn:
            ws.ensure_dataset(conn, dataset, "finance")
            ws.upsert_tools(conn, dataset, data.tools)
            ws.insert_episodes(conn, dataset, data.episodes)
    return ws


def finance_file(path: Path, n_episodes: int = 60, seed: int = 5) -> Path:
    """Generated finance episodes as an rwb JSONL file."""
    return write_jsonl(generate("finance", n_episodes, seed=seed), path)
