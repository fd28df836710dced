"""The state map (core/state/statemap.py) and ``rwb states``: entropy against hand-computed
distributions, t-SNE determinism and transform, fidelity figures, the cached map report."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from core.cli import main as rwb
from core.base.errors import InputError
from core.state.statemap import (
    StepRewards,
    TsneConfig,
    TsneMap,
    action_entropy,
    knn_label_agreement,
    policy_entropy,
    shannon_entropy,
    state_fidelity,
    states_entropy,
    states_map,
    tsne_map,
)
from _state_fixtures import HashEmbedder, dataset_workspace, make_episodes


def _tokens(spec: list[str | None]):
    """Catalog-like tokens: one per entry, with that tool (None = a special token)."""
    return [SimpleNamespace(id=i, name=f"T{i}", kind="tool_call" if t else "reply", tool=t)
            for i, t in enumerate(spec)]


def _blobs(n_per: int = 60, k: int = 3, dim: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 6, (k, dim))
    X = np.concatenate([rng.normal(centres[c], 1.0, (n_per, dim)) for c in range(k)])
    return X, np.repeat(np.arange(k), n_per)


# --------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("k", [1, 2, 5, 217])
def test_entropy_uniform_is_log_k(k):
    assert float(shannon_entropy(np.ones(k))) == pytest.approx(math.log(k))
    assert float(shannon_entropy(np.full(k, 7.0))) == pytest.approx(math.log(k))   # counts


def test_entropy_hand_computed():
    # p = (1/2, 1/4, 1/4, 0): H = 1/2 ln 2 + 2 · 1/4 ln 4 = 1.5 ln 2
    assert float(shannon_entropy([2, 1, 1, 0])) == pytest.approx(1.5 * math.log(2))
    assert float(shannon_entropy([5, 0, 0])) == 0.0
    assert float(shannon_entropy([0, 0])) == 0.0
    rows = shannon_entropy(np.array([[1, 1], [1, 0]]), axis=1)
    np.testing.assert_allclose(rows, [math.log(2), 0.0])


def test_action_entropy_overall_per_tool_per_cluster():
    tokens = _tokens([None, "a", "a", "a", "b"])
    #          reply  a0 a1 a2 b0 ; one INVALID step
    actions = np.array([0, 1, 2, 3, 1, 2, 3, 4, 4, -1])
    clusters = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    rep = action_entropy(actions, tokens, clusters)
    counts = np.array([1, 2, 2, 2, 2])            # INVALID left out
    p = counts / counts.sum()
    assert rep.overall == pytest.approx(float(-(p * np.log(p)).sum()))
    assert rep.n == 9 and rep.n_invalid == 1 and rep.max_overall == pytest.approx(math.log(5))
    tool = {g.group: g for g in rep.per_tool}
    assert tool["a"].entropy == pytest.approx(math.log(3))   # uniform over a's 3 presets
    assert tool["a"].max_entropy == pytest.approx(math.log(3))
    assert tool["b"].entropy == 0.0 and tool["(reply)"].n == 1
    cl = {g.group: g for g in rep.per_cluster}
    assert cl["cluster 0"].entropy == pytest.approx(math.log(4))           # 0,1,2,3 once each
    p1 = np.array([1, 1, 1, 2]) / 5                                        # 1,2,3,4,4
    assert cl["cluster 1"].entropy == pytest.approx(float(-(p1 * np.log(p1)).sum()))
    assert cl["cluster 1"].top_action == "T4"
    assert rep.conditional == pytest.approx((4 * math.log(4) + 5 * cl["cluster 1"].entropy) / 9)


def test_policy_entropy_marginal_vs_per_state():
    tokens = _tokens([None, "a", "a", "b"])
    # two deterministic states choosing different actions: each state 0 nats, marginal ln 2
    probs = np.array([[0, 1, 0, 0], [0, 0, 1, 0]], dtype=float)
    rep = policy_entropy(probs, tokens, clusters=np.array([0, 0]))
    assert rep.mean_state_entropy == 0.0
    assert rep.overall == pytest.approx(math.log(2))
    assert {g.group: g.entropy for g in rep.per_tool}["a"] == pytest.approx(math.log(2))
    uniform = policy_entropy(np.full((3, 4), 0.25), tokens)
    assert uniform.overall == pytest.approx(math.log(4)) and uniform.mean_state_entropy == pytest.approx(math.log(4))
    assert uniform.verdict.startswith("entropy of the policy's actions is 1.39")
    with pytest.raises(InputError, match="sum to 1"):
        policy_entropy(np.full((2, 4), 0.5), tokens)


def test_low_entropy_verdict():
    rep = action_entropy(np.zeros(50, dtype=int), _tokens([None, "a"]))
    assert rep.overall == 0.0 and "narrow" in rep.verdict


# --------------------------------------------------------------------------- t-SNE
def test_tsne_is_deterministic_for_a_seed():
    X, _ = _blobs()
    a = tsne_map(X, TsneConfig(seed=1))
    b = tsne_map(X, TsneConfig(seed=1))
    c = tsne_map(X, TsneConfig(seed=2))
    np.testing.assert_array_equal(a.coords, b.coords)
    assert not np.allclose(a.coords, c.coords)
    assert a.coords.shape == (180, 2)


def test_tsne_big_map_path_is_deterministic_too():
    # the settings a big map gets (approximate neighbours, FFT gradients, two threads),
    # on a short schedule to stay fast
    X, _ = _blobs()
    cfg = TsneConfig(seed=5, neighbors="annoy", negative_gradient_method="fft", n_jobs=2,
                     early_exaggeration_iter=10, n_iter=15)
    np.testing.assert_array_equal(tsne_map(X, cfg).coords, tsne_map(X, cfg).coords)


def test_tsne_separates_blobs_and_transform_places_new_states(tmp_path):
    X, y = _blobs(seed=3)
    fitted = tsne_map(X, TsneConfig(seed=0))
    centres = np.stack([fitted.coords[y == c].mean(0) for c in range(3)])
    X_new, y_new = _blobs(n_per=5, seed=3)           # same centres, fresh noise
    rng = np.random.default_rng(9)
    X_new = X_new + rng.normal(0, 0.1, X_new.shape)
    placed = fitted.transform(X_new)
    nearest = np.argmin(((placed[:, None, :] - centres[None]) ** 2).sum(-1), axis=1)
    assert (nearest == y_new).mean() >= 0.9
    # a map saved by one process places new states the same way in another
    fitted.save(tmp_path / "map")
    again = TsneMap.load(tmp_path / "map").transform(X_new)
    np.testing.assert_allclose(again, placed, atol=1e-6)


def test_tsne_refuses_bad_input():
    with pytest.raises(InputError, match="at least"):
        tsne_map(np.zeros((20, 5)), TsneConfig(perplexity=30))
    X, _ = _blobs()
    X[0, 0] = np.nan
    with pytest.raises(InputError, match="NaN"):
        tsne_map(X)


# --------------------------------------------------------------------------- fidelity
def test_knn_agreement_matches_naive_loop():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 6))
    labels = rng.integers(0, 3, 80)
    groups = np.repeat(np.arange(20), 4)
    fast = knn_label_agreement(X, labels, groups, k=5)
    d = ((X[:, None] - X[None]) ** 2).sum(-1)
    shares = []
    for i in range(80):
        order = [j for j in np.argsort(d[i], kind="stable") if groups[j] != groups[i]][:5]
        shares.append(np.mean(labels[order] == labels[i]))
    assert fast == pytest.approx(float(np.mean(shares)))


def test_knn_agreement_skips_the_same_episode():
    # each episode's steps sit on top of each other, episodes of one label are far apart:
    # only neighbours from other episodes count, and they all carry the other label
    X = np.array([[0.0, 0], [0, 0.01], [10, 0], [10, 0.01]])
    labels = np.array(["a", "a", "b", "b"])
    assert knn_label_agreement(X, labels, np.array([0, 0, 1, 1]), k=1) == 0.0
    assert knn_label_agreement(X, labels, None, k=1) == 1.0


def test_fidelity_verdicts():
    X, y = _blobs()
    good = state_fidelity(X, y.tolist(), X_intent_off=np.random.default_rng(0).normal(size=X.shape))
    assert good.separates is True and "separate well" in good.verdict
    assert good.silhouette > good.silhouette_shuffled + 0.3
    assert good.silhouette_intent_off < good.silhouette
    noise = np.random.default_rng(1).normal(size=X.shape)
    bad = state_fidelity(noise, y.tolist())
    assert bad.separates is False and "check the intent encoder" in bad.verdict
    one = state_fidelity(X, ["x"] * len(X))
    assert one.silhouette is None and "cannot judge" in one.verdict


# --------------------------------------------------------------------------- the pipeline
@pytest.fixture(scope="module")
def fx_ws(tmp_path_factory):
    """A workspace with the fixture dataset; the hash embedder keeps the model out of it."""
    path = tmp_path_factory.mktemp("state-map-ws")
    mp = pytest.MonkeyPatch()
    mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    ws = dataset_workspace(path, make_episodes(60))
    yield ws, path
    mp.undo()


def test_states_map_report_and_cache(fx_ws, tmp_path):
    ws, _ = fx_ws
    from rwb_app.plots.states import map_figure

    out = tmp_path / "map.csv"
    n_steps = ws.conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    rewards = StepRewards(total=np.linspace(-1, 1, n_steps), components={"validity": np.ones(n_steps)})
    rep = states_map(ws, dataset="fx", out=out, max_points=120, rewards=rewards,
                     curriculum_level=np.zeros(n_steps, dtype=int))
    assert len(rep.index) == 120 and rep.coords.shape == (120, 2) and rep.n_steps == n_steps
    # the map's points as data: step, coordinates and every field, one row per point
    points = pd.read_csv(out)
    assert list(points.columns[:3]) == ["step", "x", "y"] and len(points) == 120
    assert points["step"].tolist() == rep.index.tolist()
    np.testing.assert_allclose(points[["x", "y"]].to_numpy(), rep.coords)
    assert points["episode_id"].tolist() == rep.columns["episode_id"] and points["reward:validity"].eq(1.0).all()
    fields = rep.color_fields()
    assert {"task_type", "intent", "behaviour", "reward_total", "reward:validity", "curriculum_level"} <= set(fields)
    assert set(fields) <= set(points.columns)
    assert rep.color_is_numeric("reward_total") and rep.color_is_numeric("reward:validity")
    assert not rep.color_is_numeric("task_type")
    for f in fields:   # the app draws every colouring the report offers
        assert len(map_figure(rep, f).data) >= 1
    hover = map_figure(rep, "task_type").data[0].text[0]
    assert "episode ep" in hover and "action" in hover and "validity" in hover
    assert rep.fidelity.silhouette is not None and rep.fidelity.silhouette_intent_off is not None
    assert rep.entropy.per_cluster and rep.entropy.per_tool
    # the second call reads the workspace artifact: same map, no recomputation
    again = states_map(ws, dataset="fx", max_points=120, rewards=rewards,
                       curriculum_level=np.zeros(n_steps, dtype=int))
    assert again.timings.get("cached") == 1.0
    np.testing.assert_array_equal(again.coords, rep.coords)
    assert again.columns["episode_id"] == rep.columns["episode_id"]
    assert again.fidelity == rep.fidelity
    # a colouring with many values keeps a readable legend
    rep.columns["action"] = [f"a{i % 40}" for i in range(len(rep.index))]
    names = [trace.name for trace in map_figure(rep, "action").data]
    assert len(names) == 24 and "(other)" in names
    with pytest.raises(InputError, match="cannot colour by 'colour'"):
        rep.check_color("colour")
    # only CSV is written, and a wrong file is refused before any work
    with pytest.raises(InputError, match="must end in .csv"):
        states_map(ws, dataset="fx", max_points=120, out=tmp_path / "map.html")
    assert not (tmp_path / "map.html").exists()
    with pytest.raises(InputError, match="per-step rewards"):
        states_map(ws, dataset="fx", rewards=StepRewards(total=np.zeros(3)))


def test_states_map_with_a_reward_template(fx_ws):
    ws, _ = fx_ws
    plain = states_map(ws, dataset="fx", max_points=100)
    rep = states_map(ws, dataset="fx", max_points=100, template="finance_risk")
    fields = rep.color_fields()
    assert {"reward_total", "reward_level", "reward:L1", "reward:L4", "reward:penalties"} <= set(fields)
    assert len(set(rep.columns["reward_level"])) == 3
    assert max(rep.columns["reward_total"]) > min(rep.columns["reward_total"])
    # the pyramid's rewards reach the trace, so the states (and the map) change
    assert not np.array_equal(plain.coords, rep.coords)
    with pytest.raises(InputError, match="not both"):
        states_map(ws, dataset="fx", template="finance_risk", rewards=StepRewards(total=np.zeros(3)))


def test_states_entropy_matches_action_entropy(fx_ws):
    ws, _ = fx_ws
    rep = states_entropy(ws, dataset="fx", clusters=4)
    assert rep.source == "logged" and rep.n_invalid >= 1 and len(rep.per_cluster) == 4
    assert 0 < rep.overall <= rep.max_overall
    assert rep.conditional <= rep.overall + 1e-9     # conditioning never raises entropy


def test_cli_states_map_and_entropy(fx_ws, tmp_path, monkeypatch, capsys):
    _, path = fx_ws
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    out = tmp_path / "m.csv"
    assert rwb(["states", "map", "--dataset", "fx", "--out", str(out), "--max-points", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_points"] == 100 and data["out"] == str(out)
    assert list(data) == ["source", "space", "n_steps", "n_points", "fidelity", "entropy", "timings", "settings",
                          "color_fields", "out"]
    assert len(pd.read_csv(out)) == 100 and "behaviour" in data["color_fields"]
    assert set(data["fidelity"]) >= {"silhouette", "silhouette_shuffled", "knn_agreement", "verdict"}
    assert data["entropy"]["overall"] > 0
    assert rwb(["states", "entropy", "--dataset", "fx", "--clusters", "3", "--json"]) == 0
    ent = json.loads(capsys.readouterr().out)
    assert len(ent["per_cluster"]) == 3
    assert rwb(["states", "entropy", "--dataset", "fx"]) == 0
    assert "per tool" in capsys.readouterr().out
    assert rwb(["states", "map", "--dataset", "nope", "--out", str(out)]) == 2
    assert "no dataset named 'nope'" in capsys.readouterr().err
    assert rwb(["states", "map", "--out", str(out)]) == 2
    capsys.readouterr()
    assert rwb(["states", "map", "--dataset", "fx", "--out", str(tmp_path / "m.html")]) == 2
    assert "must end in .csv" in capsys.readouterr().err


# --------------------------------------------------------------------------- acceptance
def test_finance_task_types_separate_and_need_the_intent_encoder():
    """On generated finance data the encoded states separate by task type: silhouette
    clearly above shuffled labels, and lower with the intent encoder off."""
    from core.records.catalog import build_catalog
    from core.data.datasets import generate
    from core.base.embed import Embedder
    from core.state.features import StateEncoderConfig, encode_states, extract_features

    ds = generate("finance", 150, 3)
    raw = extract_features(ds.episodes, build_catalog(ds.tools, ds.episodes), Embedder())
    labels = [ds.episodes[e].task.task_type for e in raw.step_episode]
    fid = state_fidelity(encode_states(raw), labels, raw.step_episode,
                         X_intent_off=encode_states(raw, StateEncoderConfig(intent="off")))
    assert fid.n_labels >= 5
    assert fid.silhouette > fid.silhouette_shuffled + 0.03
    assert fid.silhouette_shuffled_std < 0.005          # so the margin is many baseline spreads
    assert fid.silhouette_intent_off < fid.silhouette - 0.02
    assert fid.knn_agreement > fid.knn_chance + 0.3
    assert fid.separates is True and fid.verdict.startswith("task types separate well")


def test_cli_states_map_from_an_episodes_file(fx_ws, tmp_path, monkeypatch, capsys):
    from core.data.datasets import generate, write_jsonl

    _, path = fx_ws
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    src = write_jsonl(generate("finance", 40, 1), tmp_path / "fin.jsonl")
    out = tmp_path / "fin.csv"
    assert rwb(["states", "map", "--episodes", str(src), "--out", str(out), "--space", "raw", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["space"] == "raw" and data["source"] == str(src)
    assert pd.read_csv(out)["intent"].nunique() >= 2
    assert data["fidelity"]["n_labels"] >= 4
    assert {"behaviour", "intent"} <= set(data["color_fields"])
    assert rwb(["states", "map", "--episodes", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "no such episodes file" in capsys.readouterr().err
    assert rwb(["states", "map", "--episodes", str(src), "--dataset", "fx", "--out", str(out)]) == 2
