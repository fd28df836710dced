"""Template numbers are bounded at validation (issue 28, attack 10).

A 60-digit ``window`` used to validate, save as a new version, and then end scoring with an
OverflowError.  Every number in a template now lies within ±``MAX_TEMPLATE_NUMBER`` and
every numeric component parameter within its declared range (``Component.param_ranges``):
a number outside is refused at validation (the CLI's exit 2, the Reward Pyramid page's
error) and at save, before anything is written, with a ``template_refused`` security
event.  Hypothesis then scores templates whose numbers are anywhere within the bounds:
none raises.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from core import rewards
from core.access.audit import security_events
from core.access.users import LOCAL_ADMIN
from core.base import safe_yaml
from core.base.embed import HashEmbedder
from core.cli import main
from core.data.datasets import generate
from core.rewards import COMPONENTS, ScoringContext
from core.rewards.components import MAX_TEMPLATE_NUMBER
from core.rewards.template import TemplateError, TemplateOutOfBounds, _type_ok, parse_template
from core.rewards.versions import list_versions, save_template, shipped_version
from test_reward_page import metric, open_page, page, sample_workspace  # noqa: F401 (fixtures)

WINDOW_60 = "9" * 60
WINDOW_FIELD = "levels.L2.components.param_reasonableness.params.window"


def _finance_yaml() -> str:
    version = shipped_version("finance_risk")
    assert version is not None
    return version.yaml


def _with_window(text: str, window: str) -> str:
    assert text.count("window: 1000,") == 1
    return text.replace("window: 1000,", f"window: {window},")


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# --------------------------------------------------------------------------- the attack
def test_a_60_digit_window_is_refused_at_validation_naming_component_and_field(tmp_path, capsys):
    text = _with_window(_finance_yaml(), WINDOW_60)
    with pytest.raises(TemplateOutOfBounds) as info:
        parse_template(text, file="big.yaml")
    err = info.value
    assert (err.file, err.field, err.line) == ("big.yaml", WINDOW_FIELD, _line_of(text, WINDOW_60))
    assert "parameter 'window' of 'param_reasonableness'" in str(err)
    assert "an integer of 60 digits; it must be between 1 and 10,000,000" in str(err)

    path = tmp_path / "big.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["reward", "validate", str(path)]) == 2
    out = capsys.readouterr()
    assert "window" in out.err and "param_reasonableness" in out.err
    assert "Traceback" not in out.err + out.out


def test_a_60_digit_window_is_not_saved_and_the_refusal_is_logged(ws, tmp_path, capsys):
    text = _with_window(_finance_yaml(), WINDOW_60)
    with pytest.raises(TemplateOutOfBounds, match="window"):
        save_template(ws, LOCAL_ADMIN, "finance_risk", text, 0, "huge window")
    assert [v.version for v in list_versions(ws, "finance_risk")] == [0]
    assert ws.conn.execute("SELECT COUNT(*) FROM template_versions").fetchone()[0] == 0
    [event] = security_events(ws, "template_refused")
    assert (event.actor, event.detail["template"], event.detail["field"]) == ("local", "finance_risk",
                                                                              WINDOW_FIELD)
    assert WINDOW_60 not in str(event.detail)  # names and reasons, not the payload

    # the CLI: exit 2, no version, no traceback
    root = tmp_path / "cli-ws"
    path = tmp_path / "finance_risk.yaml"
    path.write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert main(["--workspace", str(root), "reward", "save", "finance_risk", str(path), "--base", "0"]) == 2
    err = capsys.readouterr().err
    assert "parameter 'window' of 'param_reasonableness'" in err and "Traceback" not in err
    assert main(["--workspace", str(root), "reward", "versions", "finance_risk", "--json"]) == 0
    assert '"latest": 0' in capsys.readouterr().out


# --------------------------------------------------------------------------- every other number
MINI = """\
version: 1
name: mini
return: {a: 0.7, b: 0.3, gamma: 0.95}
levels:
  L1:
    gate: 0.5
    components:
      tool_validity: {weight: 0.3}
penalties:
  latency_penalty: {weight: 1.0, params: {per: 0.05, unit_ms: 1000.0}}
schedules:
  tool_validity: [[0, 0.3], [100, 0.1]]
expectations:
  - name: fine
    kind: episode_score
    episodes: {episode_id: e1}
    below: 5
"""


@pytest.mark.parametrize("old, new, field", [
    ("{weight: 0.3}", "{weight: 1.0e+308}", "levels.L1.components.tool_validity.weight"),
    ("{weight: 0.3}", "{weight: 1.0e+10}", "levels.L1.components.tool_validity.weight"),
    ("gate: 0.5", "gate: -1.0e+300", "levels.L1.gate"),
    ("a: 0.7", "a: 1.0e+308", "return.a"),
    ("[100, 0.1]", "[" + "9" * 40 + ", 0.1]", "schedules.tool_validity.1"),
    ("below: 5", "below: 1.0e+300", "expectations.0.below"),
    ("per: 0.05", "per: 1.0e+308", "penalties.latency_penalty.params.per"),
    ("unit_ms: 1000.0", "unit_ms: 1.0e-300", "penalties.latency_penalty.params.unit_ms"),
    ("episode_id: e1", "episode_id: " + "7" * 30, "expectations.0.episodes.episode_id"),
])
def test_numbers_out_of_range_are_refused_wherever_they_are(ws, old: str, new: str, field: str):
    assert parse_template(MINI).name == "mini"
    assert MINI.count(old) == 1
    text = MINI.replace(old, new)
    with pytest.raises(TemplateOutOfBounds) as info:
        parse_template(text, file="mini.yaml")
    assert info.value.field == field and info.value.line == _line_of(text, new.strip("{}[]"))
    with pytest.raises(TemplateOutOfBounds):
        save_template(ws, LOCAL_ADMIN, "mini", text, None)
    assert ws.conn.execute("SELECT COUNT(*) FROM template_versions").fetchone()[0] == 0
    assert [e.detail["field"] for e in security_events(ws, "template_refused")] == [field]


def test_edits_through_the_api_are_bounded_too():
    """The page and tuning edit a template with ``with_*``: the same rule, and no overflow on
    an integer too large for a float."""
    t = rewards.load_template("finance_risk")
    for edit in (lambda: t.with_weights({"tool_validity": 10 ** 400}),
                 lambda: t.with_weights({"tool_validity": 1e300}),
                 lambda: t.with_return(a=10 ** 400),
                 lambda: t.with_gating(gates={"L1": 1e300}),
                 lambda: t.with_params("param_reasonableness", {"window": 10 ** 5000}),
                 lambda: t.with_params("param_reasonableness", {"window": int(WINDOW_60)}),
                 lambda: t.with_params("param_reasonableness", {"z_ok": 1e300})):
        with pytest.raises(TemplateOutOfBounds, match="at most 1,000,000,000|must be between"):
            edit()
    # within the bounds an edit is an edit
    assert t.with_params("param_reasonableness", {"window": 10_000_000}).component(
        "param_reasonableness").params["window"] == 10_000_000
    assert t.with_weights({"tool_validity": MAX_TEMPLATE_NUMBER}).weights()["tool_validity"] == 1e9


def test_every_numeric_parameter_has_a_range_within_the_rule():
    for name, cls in COMPONENTS.items():
        for param, (annotation, default) in cls.param_specs().items():
            numeric = any(_type_ok(x, annotation) for x in (1.5, [1.5]))
            if not numeric:
                continue
            low, high = cls.param_range(param)
            assert -MAX_TEMPLATE_NUMBER <= low <= high <= MAX_TEMPLATE_NUMBER, (name, param)
            for value in (default if isinstance(default, list) else [default]):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    assert low <= value <= high, f"{name}.{param}: default {value} outside {low}..{high}"


def test_shipped_templates_are_within_the_bounds():
    for path in sorted(rewards.templates_dir().glob("*.yaml")):
        assert rewards.load_template(path).name


# --------------------------------------------------------------------------- scoring within bounds
@pytest.fixture(scope="module")
def frames():
    out = []
    for domain, seed in (("finance", 3), ("ecommerce", 4)):
        ds = generate(domain, 6, seed=seed)
        out.append(rewards.frame_from_episodes(ds.episodes, ds.tools))
    return out


def _numbers(low: float, high: float, integer: bool) -> st.SearchStrategy[Any]:
    """Any number of [low, high], its ends and zero (when inside) drawn often."""
    ends = sorted({low, high} | ({0} if low <= 0 <= high else set()))
    if integer:
        return st.one_of(st.sampled_from([int(x) for x in ends]), st.integers(int(low), int(high)))
    return st.one_of(st.sampled_from([float(x) for x in ends]),
                     st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False))


@st.composite
def bounded_templates(draw: st.DrawFn) -> str:
    """A template of one registered component whose numbers (parameters, weight, gate,
    return) are drawn anywhere within their bounds."""
    name = draw(st.sampled_from(sorted(COMPONENTS)))
    cls = COMPONENTS[name]
    params: dict[str, Any] = {}
    for param, (annotation, _) in cls.param_specs().items():
        real, integer = _type_ok(1.5, annotation), _type_ok(1, annotation) and not _type_ok(1.5, annotation)
        if (real or integer) and draw(st.booleans()):  # scalar numbers; lists keep their defaults
            params[param] = draw(_numbers(*cls.param_range(param), integer))
    bound = float(MAX_TEMPLATE_NUMBER)
    entry = {"weight": draw(_numbers(0.0, bound, False)), "params": params}
    doc: dict[str, Any] = {"version": 1, "name": "bounded",
                           "return": {"a": draw(_numbers(-bound, bound, False)),
                                      "b": draw(_numbers(-bound, bound, False)),
                                      "gamma": draw(st.sampled_from([1.0, 0.95, 1e-9]))}}
    group = {"penalty": "penalties", "episode": "episode_terms"}.get(cls.level)
    if group is None:
        doc["levels"] = {cls.level: {"gate": draw(_numbers(-bound, bound, False)),
                                     "components": {name: entry}}}
    else:
        doc["levels"] = {"L1": {"components": {"tool_validity": {"weight": 1.0}}}}
        doc[group] = {name: entry}
    return safe_yaml.dump(doc, sort_keys=False)


@pytest.mark.timeout(300)
@settings(deadline=None, derandomize=True, database=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(text=bounded_templates())
def test_any_template_within_the_bounds_scores_without_overflow(text: str, frames) -> None:
    try:
        template = parse_template(text)
    except TemplateError as exc:  # a combination the component refuses (e.g. z_ok ≥ z_zero)
        assert not isinstance(exc, TemplateOutOfBounds), exc
        assume(False)
        return
    pyramid = rewards.Pyramid(template)
    for frame in frames:
        result = pyramid.score(frame, ctx=ScoringContext(embedder=HashEmbedder()))
        assert np.isfinite(result.returns).all() and np.isfinite(result.step_reward).all()


# --------------------------------------------------------------------------- the page
def test_the_reward_pyramid_page_shows_the_refusal(page):
    """A 60-digit window typed into the page's YAML box: an error naming the parameter, no
    traceback, and the page keeps its last valid template."""
    at = open_page(tab="YAML")
    before = metric(at, "Mean episode return")
    yaml_box = next(t for t in at.text_area if t.label == "Template YAML")
    # the box holds the template's own text (flow mappings and comments as written)
    assert len(re.findall(r"window: 1000\b", yaml_box.value)) == 1
    yaml_box.set_value(re.sub(r"window: 1000\b", f"window: {WINDOW_60}", yaml_box.value))
    next(b for b in at.button if b.label == "Use this YAML").click().run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert any("parameter 'window' of 'param_reasonableness'" in e and "10,000,000" in e for e in errors), errors
    assert metric(at, "Mean episode return") == before
