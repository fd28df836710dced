"""The structured state encoder (core/state/features.py): intent rules, raw features against a slow
reference, the gated fusion, persistence and the per-dataset cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import core.state.features as st_mod
from core.records.catalog import build_catalog
from core.base.errors import InputError
from core.state.features import (
    CONTEXT_DIM,
    INTENT_RULE_DIM,
    PAD_TOKEN,
    TRACE_LEN,
    URGENCY_INDEX,
    RawStateFeatures,
    StateEncoder,
    StateEncoderConfig,
    encode_states,
    extract_features,
    extract_intent,
    load_encoder,
    raw_features_for_dataset,
    save_encoder,
)
from _state_fixtures import TOOLS, HashEmbedder, dataset_workspace, make_episodes


@pytest.fixture(scope="module")
def episodes():
    return make_episodes(45)


@pytest.fixture(scope="module")
def catalog(episodes):
    return build_catalog(TOOLS, episodes)


@pytest.fixture(scope="module")
def raw(episodes, catalog) -> RawStateFeatures:
    return extract_features(episodes, catalog, HashEmbedder())


# --------------------------------------------------------------------------- intent rules
@pytest.mark.parametrize("query, verb, urgency, target_kind, target", [
    ("Urgently reduce my exposure to 600519 by 20%", "reduce", "high", "portfolio", "600519"),
    ("紧急减持 600519", "reduce", "high", "stock", "600519"),
    ("Please analyse Moutai's Q3 report, no rush", "analyse", "low", "other", None),
    ("Sell $AAPL today", "sell", "medium", "stock", "AAPL"),
    ("Rebalance my portfolio", "rebalance", "none", "portfolio", "portfolio"),
    ("check the quote of 02318 right now", "check", "high", "stock", "02318"),
    ("", "other", "none", "other", None),
])
def test_extract_intent(query, verb, urgency, target_kind, target):
    r = extract_intent(query)
    assert (r.verb, r.urgency, r.target_kind, r.target) == (verb, urgency, target_kind, target)


def test_intent_amounts():
    assert extract_intent("trim 12.5% of the book").percent == pytest.approx(0.125)


@pytest.mark.parametrize("query, share, period", [
    ("Urgent: sell three quarters of my Moutai position right now.", 0.75, "none"),
    ("Please urgently trim a quarter of my Ping An stake", 0.25, "none"),
    ("dump half of the position", 0.5, "none"),
    ("Quickly offload all of my 600519 shares", 1.0, "none"),
    ("卖出一半的茅台", 0.5, "none"),
    ("sell 40% of it, and not half of it", 0.4, "none"),            # a number wins over words
    ("What do the half-year 2024 numbers say about BYD?", None, "q2"),  # "half-year" is a period
    ("Analyse the first quarter of 2023 for 600036", None, "q1"),    # no share in "quarter of"
    ("Give me a view on Q3 2024 and the annual report", None, "q3"),  # the first period named
    ("Is the A/H premium wide?", None, "none"),
])
def test_extract_intent_share_words_and_period(query, share, period):
    r = extract_intent(query)
    assert r.percent == (pytest.approx(share) if share is not None else None)
    assert r.period == period
    v = st_mod.intent_rule_vector(r, query)
    assert v.shape == (INTENT_RULE_DIM,)
    assert v[st_mod.PERCENT_INDEX] == float(share is not None)
    assert v[st_mod.PERIOD_INDEX + st_mod.PERIOD_CLASSES.index(period)] == 1.0
    assert v[st_mod.PERIOD_INDEX:st_mod.PERIOD_INDEX + len(st_mod.PERIOD_CLASSES)].sum() == 1.0
    assert extract_intent("invest $2.5m in bonds").amount == pytest.approx(2.5e6)
    assert extract_intent("buy 3000 yuan of 600036").amount == pytest.approx(3000)


# --------------------------------------------------------------------------- raw features
def _naive_context(episodes, catalog, stats) -> np.ndarray:
    """Slow obvious reference of the context block: per step, scan back for the latest
    result, flatten it, and write every key field one by one."""
    out = []
    for ep in episodes:
        for t, step in enumerate(ep.steps):
            row = np.zeros(CONTEXT_DIM, dtype=np.float64)
            j = next((j for j in range(t - 1, -1, -1)
                      if ep.steps[j].tool_result is not None or ep.steps[j].tool_error is not None), None)
            if j is not None:
                prev = ep.steps[j]
                tool = prev.action.tool or prev.action.kind
                leaves: list = []
                if prev.tool_result is not None:
                    st_mod._flatten_result(st_mod._parse_result(prev.tool_result), "", leaves)
                for path, value in leaves:
                    if path not in stats.key_fields.get(tool, []):
                        continue
                    key = f"{tool}:{path}"
                    if isinstance(value, float):
                        _naive_number(row, st_mod._O_NUM, st_mod.CTX_NUM, stats, key, value)
                    else:
                        b, sign = st_mod._hash_slots([f"{key}={value}"], st_mod.CTX_CAT)
                        row[st_mod._O_CAT + b[0]] += sign[0]
                b, _ = st_mod._hash_slots([f"tool:{tool}"], st_mod.CTX_TOOL)
                row[st_mod._O_TOOL + b[0]] = 1
                row[st_mod._O_FLAGS:st_mod._O_FLAGS + 3] = [1, prev.tool_error is not None,
                                                            not prev.result_replayed]
                row[st_mod._O_FLAGS + 3] = math.log1p(t - j) / math.log1p(12)
            row[st_mod._O_FLAGS + 4] = math.log1p(t) / math.log1p(12)
            for k, v in step.observation["state"].items():
                key = f"state:{k}"
                if isinstance(v, str):
                    b, sign = st_mod._hash_slots([f"{key}={v.lower()}"], st_mod.OBS_CAT)
                    row[st_mod._O_OBS_CAT + b[0]] += sign[0]
                else:
                    _naive_number(row, st_mod._O_OBS_NUM, st_mod.OBS_NUM, stats, key, float(v))
            out.append(row)
    return np.array(out)


def _naive_number(row, offset, buckets, stats, key, value) -> None:
    """A number's robust z at its key's slot, and its log-scale twin at ``key#log``'s."""
    for k, x in ((key, value), (key + "#log", math.copysign(math.log1p(abs(value)), value))):
        c, s = stats.numeric[k]
        b, sign = st_mod._hash_slots([k], buckets)
        row[offset + b[0]] += sign[0] * min(max((x - c) / s, -5), 5)


def _naive_stats(episodes):
    """Median and IQR/1.349 per numeric key, by plain Python lists."""
    values: dict[str, list[float]] = {}
    for ep in episodes:
        for s in ep.steps:
            for k, v in s.observation["state"].items():
                if not isinstance(v, str):
                    values.setdefault(f"state:{k}", []).append(float(v))
                    values.setdefault(f"state:{k}#log", []).append(math.copysign(math.log1p(abs(v)), v))
    return {k: (float(np.median(v)), float(np.subtract(*np.percentile(v, [75, 25]))) / 1.349)
            for k, v in values.items()}


def test_context_matches_slow_reference(episodes, catalog, raw):
    np.testing.assert_allclose(raw.context, _naive_context(episodes, catalog, raw.stats), atol=1e-5)
    for key, (c, s) in _naive_stats(episodes).items():
        assert raw.stats.numeric[key] == pytest.approx([c, s])


def test_key_fields_are_schema_aware(raw):
    # free text never becomes a field; list of numbers is summarised
    assert "summary" not in raw.stats.key_fields["get_report"]
    assert {"price", "change_pct", "status", "closes.last", "closes.len"} <= set(raw.stats.key_fields["get_quote"])
    # "1.23%" is read as the number 0.0123
    assert "get_quote:change_pct" in raw.stats.numeric


def test_declared_key_fields_win(episodes):
    tools = [t.model_copy(update={"meta": {"key_fields": ["price"]}}) if t.name == "get_quote" else t
             for t in TOOLS]
    raw = extract_features(episodes[:6], build_catalog(tools, episodes[:6]), HashEmbedder())
    assert raw.stats.key_fields["get_quote"] == ["price"]


def test_trace_matches_slow_reference(episodes, catalog, raw):
    tokens = catalog.normalize_many([s.action for ep in episodes for s in ep.steps]).token_ids
    flat = 0
    for ep in episodes:
        for t in range(ep.n_steps):
            for k in range(TRACE_LEN):
                j = t - k - 1
                if j >= 0:
                    assert raw.trace_step[flat, k] == flat - k - 1
                    assert raw.trace_action[flat, k] == tokens[flat - k - 1]
                else:
                    assert raw.trace_step[flat, k] == -1 and raw.trace_action[flat, k] == PAD_TOKEN
                    assert raw.trace_dt[flat, k] == 0
            flat += 1
    assert flat == raw.n_steps
    assert (raw.action_token == tokens).all()
    assert (raw.action_token == -1).sum() >= 1          # the "teleport" call is INVALID


def test_trace_dt_uses_timestamps_else_latency(episodes, raw):
    # episode 1 has timestamps: dt of its step 1 to step 0 is the timestamp difference
    ep = episodes[1]
    i = int(np.flatnonzero(raw.step_episode == 1)[1])
    import pandas as pd
    secs = (pd.Timestamp(ep.steps[1].timestamp) - pd.Timestamp(ep.steps[0].timestamp)).total_seconds()
    assert raw.trace_dt[i, 0] == pytest.approx(math.log1p(secs), rel=1e-5)
    # episode 0 has none: the previous step's latency
    i0 = int(np.flatnonzero(raw.step_episode == 0)[1])
    assert raw.trace_dt[i0, 0] == pytest.approx(math.log1p(episodes[0].steps[0].latency_ms / 1000), rel=1e-5)


def test_trace_rewards_gathered(raw):
    rewards = np.arange(raw.n_steps, dtype=np.float32)
    tr = raw.trace_rewards(rewards)
    expect = np.where(raw.trace_step >= 0, raw.trace_step, 0).astype(np.float32)
    np.testing.assert_array_equal(tr, expect)
    assert (raw.trace_rewards(None) == 0).all()          # documented: zeros without rewards
    with pytest.raises(InputError, match="per-step rewards"):
        raw.trace_rewards(rewards[:-1])


def test_raw_save_load_roundtrip(raw, tmp_path):
    raw.save(tmp_path / "f")
    back = RawStateFeatures.load(tmp_path / "f")
    for k in RawStateFeatures._ARRAYS:
        np.testing.assert_array_equal(getattr(back, k), getattr(raw, k))
    assert back.stats.to_dict() == raw.stats.to_dict() and back.episode_ids == raw.episode_ids


def test_stats_reused_for_new_steps(episodes, catalog, raw):
    # serving: new episodes are featurised with the dataset's stats, not their own
    new = extract_features(episodes[:3], catalog, HashEmbedder(), stats=raw.stats)
    n = new.n_steps
    np.testing.assert_allclose(new.context, raw.context[:n], atol=1e-6)


# --------------------------------------------------------------------------- the encoder
def _batch(raw, urgency: float):
    b = raw.step_batch(np.arange(8))
    b["intent_rules"][:, URGENCY_INDEX] = urgency
    b["intent_rules"][:, URGENCY_INDEX + 1] = float(urgency == 1.0)
    return b


def test_gates_follow_urgency(raw):
    enc = StateEncoder(n_actions=raw.n_actions)
    g_high = enc.gates(_batch(raw, 1.0))
    g_none = enc.gates(_batch(raw, 0.0))
    assert torch.allclose(g_high[:, 0], torch.full((8,), 0.7), atol=1e-5)
    assert torch.allclose(g_none, torch.full((8, 3), 1 / 3), atol=1e-5)
    assert torch.allclose(g_high.sum(1), torch.ones(8))


def test_gating_off_is_equal_weights(raw):
    enc = StateEncoder(StateEncoderConfig(gating="off"), n_actions=raw.n_actions)
    assert torch.equal(enc.gates(_batch(raw, 1.0)), torch.full((8, 3), 1 / 3))


def test_intent_off_ignores_the_request(raw):
    enc = StateEncoder(StateEncoderConfig(intent="off"), n_actions=raw.n_actions)
    b = raw.step_batch(np.arange(8))
    b2 = {k: v.clone() for k, v in b.items()}
    b2["intent_emb"] = torch.randn_like(b2["intent_emb"])
    b2["intent_rules"][:, URGENCY_INDEX] = 1.0
    with torch.no_grad():
        assert torch.equal(enc(b), enc(b2))
        assert (enc.gates(b)[:, 0] == 0).all()
    on = StateEncoder(n_actions=raw.n_actions)
    with torch.no_grad():
        assert not torch.equal(on(b), on(b2))


def test_encoder_shape_seed_and_gradients(raw):
    a = StateEncoder(StateEncoderConfig(seed=3), n_actions=raw.n_actions)
    b = StateEncoder(StateEncoderConfig(seed=3), n_actions=raw.n_actions)
    c = StateEncoder(StateEncoderConfig(seed=4), n_actions=raw.n_actions)
    batch = raw.step_batch(np.arange(16), rewards=np.ones(raw.n_steps))
    out = a(batch)
    assert out.shape == (16, 512)
    assert torch.equal(out, b(batch)) and not torch.equal(out, c(batch))
    out.pow(2).mean().backward()
    for name in ("intent_net.0.weight", "context_net.0.weight", "trace_net.0.weight", "action_embed.weight",
                 "gate_prior.weight", "gate_state.weight"):
        grad = dict(a.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_encoder_config_is_validated():
    with pytest.raises(InputError, match="gating"):
        StateEncoderConfig(gating="maybe")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="unknown encoder settings"):
        StateEncoderConfig.from_dict({"dim": 64, "colour": 1})


def test_save_load_encoder_safetensors(raw, tmp_path):
    enc = StateEncoder(StateEncoderConfig(dim=64, gating="off", seed=7), n_actions=raw.n_actions)
    weights, meta = save_encoder(enc, tmp_path)
    assert weights.suffix == ".safetensors" and meta.suffix == ".json"
    back = load_encoder(tmp_path)
    assert back.config == enc.config
    np.testing.assert_array_equal(encode_states(raw, encoder=back), encode_states(raw, encoder=enc))
    with pytest.raises(InputError, match="different catalogs"):
        encode_states(raw, encoder=StateEncoder(n_actions=raw.n_actions + 1))


def test_encode_states_batches_match_one_pass(raw):
    enc = StateEncoder(n_actions=raw.n_actions)
    np.testing.assert_allclose(encode_states(raw, encoder=enc, batch_size=7),
                               encode_states(raw, encoder=enc), atol=1e-5)


def test_raw_matrix_blocks(raw):
    full = raw.raw_matrix()
    no_intent = raw.raw_matrix(intent=False)
    assert full.shape[1] - no_intent.shape[1] == 384 + INTENT_RULE_DIM
    assert np.isfinite(full).all()


# --------------------------------------------------------------------------- cache per dataset
def test_dataset_features_are_cached(tmp_path, monkeypatch):
    ws = dataset_workspace(tmp_path, make_episodes(12))
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    first = raw_features_for_dataset(ws, "fx")
    files = sorted(p.name for p in (ws.artifacts / "states").rglob("features-*"))
    assert any(f.endswith(".safetensors") for f in files) and any(f.endswith(".json") for f in files)
    assert not any(f.endswith(".pkl") or f.endswith(".pickle") for f in files)

    def boom(*a, **k):
        raise AssertionError("features were recomputed")
    monkeypatch.setattr(st_mod, "extract_features", boom)
    again = raw_features_for_dataset(ws, "fx")
    np.testing.assert_array_equal(again.context, first.context)
    with pytest.raises(InputError, match="no dataset named 'nope'"):
        raw_features_for_dataset(ws, "nope")


def test_a_changed_dataset_recomputes_and_drops_stale_features(tmp_path, monkeypatch):
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    ws = dataset_workspace(tmp_path, make_episodes(6))
    first = raw_features_for_dataset(ws, "fx")
    with ws.transaction() as conn:
        ws.insert_episodes(conn, "fx", [e.model_copy(update={"episode_id": e.episode_id + "-new"})
                                        for e in make_episodes(2, seed=5)])
    second = raw_features_for_dataset(ws, "fx")
    assert second.n_steps > first.n_steps and second.fingerprint != first.fingerprint
    files = sorted(p.name for p in (ws.artifacts / "states").rglob("features-*"))
    assert files == [f"features-{second.fingerprint[:16]}.json", f"features-{second.fingerprint[:16]}.safetensors"]


def test_flatten_names_top_level_lists_and_scalars():
    out: list = []
    st_mod._flatten_result([1.0, 2.0, 4.0], "", out)
    assert out == [("len", 3.0), ("last", 4.0), ("mean", 7.0 / 3)]
    out = []
    st_mod._flatten_result("OK", "", out)
    assert out == [("value", "ok")]


def test_episodes_without_steps_anywhere(catalog):
    from core.records.episodes import Episode, Task

    eps = make_episodes(3)
    empty = [Episode(episode_id=f"empty{i}", task=Task(query="nothing")) for i in range(2)]
    mixed = [empty[0], eps[0], empty[1], eps[1], eps[2], Episode(episode_id="last")]
    raw = extract_features(mixed, catalog, HashEmbedder())
    ref = extract_features(eps, catalog, HashEmbedder(), stats=raw.stats)
    assert raw.n_steps == ref.n_steps and len(raw.episode_ids) == 6
    np.testing.assert_allclose(raw.context, ref.context, atol=1e-6)
    np.testing.assert_array_equal(raw.trace_dt, ref.trace_dt)
    assert extract_features([], catalog, HashEmbedder()).n_steps == 0


def test_gate_floor_keeps_every_branch_in_view(raw):
    """Saturated gate logits (what unconstrained training drove them to) still leave every
    branch its floor weight; without a floor one branch takes everything."""
    b = raw.step_batch(np.arange(8))
    floored = StateEncoder(n_actions=raw.n_actions)
    bare = StateEncoder(StateEncoderConfig(gate_floor=0.0), n_actions=raw.n_actions)
    for enc in (floored, bare):
        with torch.no_grad():
            enc.gate_state.bias.copy_(torch.tensor([-50.0, -50.0, 50.0]))
    g = floored.gates(b)
    assert torch.allclose(g[:, :2], torch.full((8, 2), 0.1), atol=1e-6)
    assert torch.allclose(g.sum(1), torch.ones(8))
    assert float(bare.gates(b)[:, 0].max().detach()) < 1e-20
    with pytest.raises(InputError, match="gate_floor"):
        StateEncoderConfig(gate_floor=0.4)


def test_encoders_saved_without_a_floor_load_as_they_were(raw, tmp_path):
    enc = StateEncoder(StateEncoderConfig(gate_floor=0.0), n_actions=raw.n_actions)
    d = enc.config_dict()
    d["config"].pop("gate_floor")                      # what an older version wrote
    assert StateEncoder.from_config_dict(d).config.gate_floor == 0.0
