"""The shipped samples show the State Explorer's fidelity check working: each passes the
check the page runs, with the page's default settings, and a verdict short of "well"
names the part of the state (request, tool context, trace) that lacks structure."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from core.state.features import StateEncoderConfig
from core.state.statemap import GOOD_KNN_MARGIN, GOOD_SILHOUETTE_MARGIN, TsneConfig, state_fidelity, states_map
from core.records.store import Workspace
from core.sample.workspace_setup import SAMPLE_DATASETS, ensure_samples


def _page_defaults() -> dict:
    """The settings the State Explorer maps with before anyone changes them (the
    defaults of the app's ``state_map``, which the page's form starts from)."""
    from rwb_app import resources

    params = inspect.signature(resources.state_map).parameters
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


@pytest.fixture(scope="module")
def sample_ws(tmp_path_factory):
    ws = Workspace.open(tmp_path_factory.mktemp("samples") / "ws")
    ensure_samples(ws)            # what `rwb app` does to an empty workspace
    yield ws
    ws.close()


def test_page_defaults_are_the_plain_map():
    assert _page_defaults() == {"space": "encoded", "gating": "on", "intent": "on", "max_points": 20000,
                                "clusters": 8, "seed": 0, "template": None}


@pytest.mark.parametrize("domain", sorted(SAMPLE_DATASETS))
def test_shipped_sample_passes_the_fidelity_check(sample_ws, domain):
    d = _page_defaults()
    # the call the app makes for the page (rwb_app.resources._states_map)
    report = states_map(sample_ws, dataset=SAMPLE_DATASETS[domain], space=d["space"],
                        encoder=StateEncoderConfig(gating=d["gating"], intent=d["intent"], seed=d["seed"]),
                        tsne=TsneConfig(seed=d["seed"]), max_points=d["max_points"], clusters=d["clusters"],
                        template=d["template"], use_cache=False)
    fid = report.fidelity
    assert fid.separates is True, fid.verdict
    assert fid.verdict.startswith("task types separate well"), fid.verdict
    assert fid.silhouette - fid.silhouette_shuffled >= GOOD_SILHOUETTE_MARGIN
    assert fid.knn_agreement - fid.knn_chance >= GOOD_KNN_MARGIN
    assert fid.n_labels >= 6                      # every task type of the domain is on the map


# --------------------------------------------------------------------------- the advice
def _parts(n_per: int = 60, seed: int = 0):
    """Three labels; a request part that separates them, and a tool context and a trace
    that are noise alike for every label."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.array(["a", "b", "c"]), n_per)
    centres = rng.normal(0, 5, (3, 16))
    request = np.concatenate([rng.normal(centres[c], 1.0, (n_per, 16)) for c in range(3)])
    context, trace = rng.normal(0, 1, (3 * n_per, 24)), rng.normal(0, 1, (3 * n_per, 12))
    return labels, {"request": request, "tool_context": context, "trace": trace}


def test_advice_names_the_parts_without_structure():
    labels, parts = _parts()
    X = np.random.default_rng(1).normal(0, 1, (len(labels), 32))    # the fused states show nothing
    fid = state_fidelity(X, labels, parts=lambda rows: {k: v[rows] for k, v in parts.items()})
    assert fid.separates is False
    assert fid.part_margins["request"] > 0.3
    assert fid.part_margins["tool_context"] < 0.01 and fid.part_margins["trace"] < 0.01
    assert "the tool context and the trace carry little task type structure" in fid.verdict
    assert "the tool calls and their results look alike across task types" in fid.verdict
    assert "intent encoder" not in fid.verdict


def test_advice_points_at_the_intent_encoder_when_the_request_lacks_structure():
    labels, parts = _parts()
    parts["request"], parts["tool_context"] = parts["tool_context"], parts["request"]
    X = np.random.default_rng(1).normal(0, 1, (len(labels), 32))
    fid = state_fidelity(X, labels, parts=lambda rows: {k: v[rows] for k, v in parts.items()})
    assert fid.verdict.endswith("check the intent encoder, e.g. truncated or empty queries")
    assert "the request and the trace carry little" in fid.verdict


def test_advice_without_parts_names_both_suspects():
    labels, _ = _parts()
    fid = state_fidelity(np.random.default_rng(1).normal(0, 1, (len(labels), 32)), labels)
    assert fid.part_margins is None
    assert fid.verdict.endswith("check the intent encoder (e.g. truncated or empty queries) and whether the "
                                "tool calls and their results differ across task types")
