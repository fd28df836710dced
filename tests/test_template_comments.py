"""Template saves keep the text they were edited from: comments, key order and layout survive an
edit of weights, parameters, gates and return coefficients (only the changed values are
rewritten), an edit that adds or removes keys keeps the comments, the saved text still validates
and hashes as stored, and text the bounded loader refuses is never handed to the round-trip
writer."""

from __future__ import annotations

import numpy as np
import pytest

from core.access.users import current_user
from core.records.store import Workspace
from core.rewards.template import load_template, parse_template, templates_dir
from core.rewards.template_text import edited_text
from core.rewards.versions import get_template, save_template, sha256_text, template_text

SHIPPED = sorted(p.stem for p in templates_dir().glob("*.yaml"))

COMMENTED = """\
# A small pyramid: the header comment stays.
version: 1
name: commented
return: {a: 0.7, b: 0.3, gamma: 0.95}   # return coefficients
gating: {enabled: true}
levels:
  L1:
    title: base
    gate: 0.5          # the gate's own comment
    components:
      tool_validity:
        weight: 0.3    # why 0.3
  L2:
    title: process
    components:
      param_reasonableness: {weight: 0.4, params: {window: 1000, z_ok: 2.0}}
penalties:
  # penalties are never gated
  latency:
    component: latency_penalty
    weight: 1.0
    params: {per: 0.05, unit_ms: 1000}
expectations:
  - name: failed calls earn nothing above L1
    kind: component_range
    component: tool_validity
    value: contribution
    max: 0.0
    steps: {tool_error: true}
"""


def changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    assert len(a.splitlines()) == len(b.splitlines())
    return [(x, y) for x, y in zip(a.splitlines(), b.splitlines()) if x != y]


def comments(text: str) -> list[str]:
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line and '"#' not in line]


def test_a_weight_edit_rewrites_one_line_and_keeps_every_comment():
    t = parse_template(COMMENTED)
    out = edited_text(COMMENTED, t.with_weights({"tool_validity": 0.35}))
    assert changed_lines(COMMENTED, out) == [("        weight: 0.3    # why 0.3", "        weight: 0.35    # why 0.3")]
    assert comments(out) == comments(COMMENTED)
    assert parse_template(out) == t.with_weights({"tool_validity": 0.35})


def test_values_in_flow_mappings_gates_return_and_params_change_in_place():
    t = parse_template(COMMENTED)
    edited = (t.with_weights({"param_reasonableness": 0.25, "latency": 0.5}).with_return(gamma=0.9)
              .with_gating(gates={"L1": 0.45})
              .with_params("param_reasonableness", {"window": 500, "z_ok": 2.5}))
    out = edited_text(COMMENTED, edited)
    assert changed_lines(COMMENTED, out) == [
        ("return: {a: 0.7, b: 0.3, gamma: 0.95}   # return coefficients",
         "return: {a: 0.7, b: 0.3, gamma: 0.9}   # return coefficients"),
        ("    gate: 0.5          # the gate's own comment", "    gate: 0.45          # the gate's own comment"),
        ("      param_reasonableness: {weight: 0.4, params: {window: 1000, z_ok: 2.0}}",
         "      param_reasonableness: {weight: 0.25, params: {window: 500, z_ok: 2.5}}"),
        ("    weight: 1.0", "    weight: 0.5")]
    assert parse_template(out) == edited


def test_an_edit_that_adds_or_removes_keys_keeps_the_comments_and_the_order():
    t = parse_template(COMMENTED)
    no_gate = t.with_gating(gates={"L1": None})
    out = edited_text(COMMENTED, no_gate)
    assert parse_template(out) == no_gate and "gate:" not in out
    kept = [c for c in comments(COMMENTED) if c != "# the gate's own comment"]
    assert all(c in out for c in kept)
    top = [line.split(":")[0] for line in out.splitlines() if line and line[0].isalpha()]
    assert top == ["version", "name", "return", "gating", "levels", "penalties", "expectations"]


@pytest.mark.parametrize("name", SHIPPED)
def test_random_value_edits_of_every_shipped_template_keep_its_text(name):
    text = (templates_dir() / f"{name}.yaml").read_text(encoding="utf-8")
    t = load_template(name)
    rng = np.random.default_rng(len(name))
    for _ in range(3):
        weights = {c.name: float(np.round(rng.uniform(0, 2), int(rng.integers(1, 4))))
                   for c in t.all_components if rng.random() < 0.5}
        edited = t.with_weights(weights).with_return(a=float(np.round(rng.uniform(0, 1), 2)))
        out = edited_text(text, edited)
        assert parse_template(out) == edited
        assert comments(out) == comments(text)
        assert len(changed_lines(text, out)) <= len(weights) + 1      # one line per changed value at most


def test_text_the_bounded_loader_refuses_is_never_rewritten():
    t = parse_template(COMMENTED)
    bomb = "a: &a [x, x]\nb: [*a, *a]\n"
    assert edited_text(bomb, t) == t.to_yaml()
    assert edited_text(COMMENTED, t) == COMMENTED                      # no change: the text as it was


def test_a_saved_edit_validates_hashes_and_keeps_the_base_text(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    actor = current_user(ws)
    save_template(ws, actor, "commented", COMMENTED, None, "first")
    base = get_template(ws, "commented", 1)
    edited = base.template().with_weights({"latency": 0.25})
    saved = save_template(ws, actor, "commented", edited, 1, "latency matters less")
    assert saved.version == 2 and saved.sha256 == sha256_text(saved.yaml)
    assert get_template(ws, "commented", 2).template() == edited
    assert changed_lines(COMMENTED, saved.yaml) == [("    weight: 1.0", "    weight: 0.25")]
    assert template_text(ws, "commented", 2, edited) == saved.yaml
    # a new name or a base that does not exist: the plain writer
    assert template_text(ws, "fresh", None, edited) == parse_template(edited.to_yaml().replace(
        "name: commented", "name: fresh")).to_yaml()
    assert template_text(ws, "commented", 9, edited) == edited.to_yaml()
    # a shipped seed edited as version 0 keeps the shipped comments
    shipped = load_template("finance_risk").with_weights({"latency": 0.5})
    first = save_template(ws, actor, "finance_risk", shipped, 0, "from the seed")
    assert "# an unknown tool or a failed call earns nothing from L2-L4" in first.yaml
