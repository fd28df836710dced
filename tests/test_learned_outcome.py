"""The learned outcome (core.rewards.learned, core.rewards.outcome_model): nested CV by task,
the within-task objective, the plain baselines, the learning curve, honest intervals, and the
fitted term saved in a template."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from _real_logs import REAL, rwb_import_labelled
from core.base.errors import InputError
from core.data.importers import read_file
from core.rewards import outcome_model as om
from core.rewards.api import frame_from_episodes, score
from core.rewards.calibration import outcome_columns
from core.rewards.components import ScoringContext
from core.rewards.learned import (STAT_FEATURES, LearnedOutcome, episode_stats, fit_outcome_model,
                                  with_learned_outcome, without_learned_outcome)
from core.rewards.outcomes import auc, fidelity, within_task_auc
from core.rewards.template import parse_template

TINY = """\
version: 1
name: tiny
levels:
  L1:
    components:
      tool_validity: {weight: 1.0}
"""


# --------------------------------------------------------------------------- synthetic tables
def table_of(blocks: dict[str, np.ndarray]) -> om.FeatureTable:
    """A feature table whose blocks are the given matrices (names made up per column)."""
    names, parts, columns = [], [], {}
    for b in om.BLOCKS:
        if b in blocks:
            m = blocks[b]
            columns[b] = np.arange(len(names), len(names) + m.shape[1])
            names += (list(om.STAT_FEATURES) if b == "stats" else list(om.SIGNAL_FEATURES) if b == "signals"
                      else [f"{b}_{i}" for i in range(m.shape[1])])
            parts.append(m)
    return om.FeatureTable(names, np.hstack(parts), columns)


def synthetic(n_tasks: int = 40, runs: int = 4, seed: int = 0, *, within_only: bool = False, noise: float = 0.5):
    """Tasks of different difficulty b_t, runs with a skill u: success is u + b_t + noise > 0.

    ``within_only``: the one informative count rises with u but *falls* with the task's ease,
    so across tasks it points the wrong way and only differences within a task carry signal."""
    rng = np.random.default_rng(seed)
    groups = np.repeat([f"t{i}" for i in range(n_tasks)], runs)
    b = np.repeat(rng.normal(0, 1.5, n_tasks), runs)
    u = rng.normal(0, 1, groups.size)
    y = (u + b + rng.normal(0, noise, groups.size) > 0).astype(int)
    signal = u - 3.0 * b if within_only else u + b
    stats = rng.normal(0, 1, (groups.size, len(om.STAT_FEATURES)))
    stats[:, 1] = signal
    signals = rng.normal(0, 1, (groups.size, len(om.SIGNAL_FEATURES)))
    blocks = {"stats": stats, "signals": signals,
              "task_norm": rng.normal(0, 1, (groups.size, len(om.COUNT_FEATURES))),
              "request_emb": rng.normal(0, 1, (groups.size, 4)), "answer_emb": rng.normal(0, 1, (groups.size, 4))}
    return table_of(blocks), y, groups


FAST = om.config_grid(("counts", "counts_task"), om.OBJECTIVES, (0.1, 1.0))


# --------------------------------------------------------------------------- nested CV and leaks
def test_a_planted_leak_in_the_folds_is_caught(monkeypatch):
    table, y, groups = synthetic()

    def overlapping(g, n_folds=5, seed=0):            # rows split in halves that share their tasks
        n = np.asarray(g).size
        return [np.arange(0, n // 2 + 8), np.arange(n // 2 - 8, n)]

    monkeypatch.setattr(om, "grouped_folds", overlapping)
    with pytest.raises(om.FoldLeak, match="outer fold"):
        om.nested_cv(table, y, groups, configs=FAST)

    def by_rows(g, n_folds=5, seed=0):                # disjoint rows, but runs of one task on both sides
        return list(np.array_split(np.arange(np.asarray(g).size), 6))   # parts of 26-27 rows: tasks cut

    monkeypatch.setattr(om, "grouped_folds", by_rows)
    with pytest.raises(om.FoldLeak, match="held-out task"):
        om.nested_cv(table, y, groups, configs=FAST)


def test_no_inner_fit_ever_sees_a_task_of_its_outer_fold(monkeypatch):
    table, y, groups = synthetic(n_tasks=30)
    current: dict[str, set] = {"forbidden": set()}
    fits = {"n": 0}
    real_choose, real_fit = om.choose_configs, om.fit_linear

    def choose(x, yy, g, rows, configs, columns, **kw):
        current["forbidden"] = set(g[kw["forbidden"]].tolist()) if kw.get("forbidden") is not None else set()
        return real_choose(x, yy, g, rows, configs, columns, **kw)

    def fit(x, yy, g, objective, c, seed=0):
        assert not (set(np.asarray(g).tolist()) & current["forbidden"]), "a held-out task reached a fit"
        fits["n"] += 1
        return real_fit(x, yy, g, objective, c, seed)

    monkeypatch.setattr(om, "choose_configs", choose)
    monkeypatch.setattr(om, "fit_linear", fit)
    cv = om.nested_cv(table, y, groups, configs=FAST, outer_folds=4, inner_folds=3)
    assert fits["n"] >= 4 * 3 * len(FAST)
    assert not np.isnan(cv.predictions).any()
    for train, held in cv.splits:                     # the outer folds themselves split by task
        assert not set(groups[train]) & set(groups[held])
    assert sorted(np.concatenate([h for _, h in cv.splits]).tolist()) == list(range(y.size))


def test_check_no_leak_names_the_task():
    groups = np.array(["a", "a", "b", "c"])
    om.check_no_leak(groups, np.array([0, 1]), np.array([2, 3]), "ok")
    with pytest.raises(om.FoldLeak, match="'a'"):
        om.check_no_leak(groups, np.array([0, 2]), np.array([1, 3]), "planted")


# --------------------------------------------------------------------------- the within-task objective
def test_the_within_task_objective_finds_a_signal_only_differences_within_a_task_carry():
    table, y, groups = synthetic(n_tasks=150, runs=4, seed=3, within_only=True, noise=0.2)
    cols = table.select(("stats", "signals"))
    x = table.matrix[:, cols]
    train = np.flatnonzero(np.isin(groups, [f"t{i}" for i in range(100)]))
    test = np.setdiff1d(np.arange(y.size), train)
    pairwise = om.fit_linear(x[train], y[train], groups[train], "within_task", 1.0)
    plain = om.fit_linear(x[train], y[train], groups[train], "all_pairs", 1.0)
    w_pair = within_task_auc(pairwise.predict(x[test]), y[test], groups[test])
    w_plain = within_task_auc(plain.predict(x[test]), y[test], groups[test])
    assert w_pair > 0.85 and w_plain < 0.4, (w_pair, w_plain)
    assert pairwise.coef[1] > 0 > plain.coef[1]      # the count's sign: right within tasks, wrong across
    # the inner folds, asked for within-task ranking, choose the within-task objective
    cv = om.nested_cv(table, y, groups, configs=FAST, select="within_task", top_configs=1)
    assert all(top[0].objective == "within_task" for top in cv.chosen)
    assert within_task_auc(cv.predictions, y, groups) > 0.8


def test_within_task_needs_a_task_with_both_outcomes():
    x = np.random.default_rng(0).normal(size=(6, 2))
    y = np.array([1, 1, 0, 0, 1, 0])
    groups = np.array(["a", "a", "b", "b", "c", "d"])   # no task holds a success and a failure
    assert om.fit_linear(x, y, groups, "within_task", 1.0) is None
    assert om.fit_linear(x, y, groups, "all_pairs", 1.0) is not None


# --------------------------------------------------------------------------- baselines
def test_baselines_are_fitted_on_the_same_outer_folds():
    from sklearn.linear_model import LogisticRegression

    table, y, groups = synthetic(n_tasks=30, seed=5)
    report, cv = om.heldout_report(table, y, groups, configs=FAST, outer_folds=4, inner_folds=3, n_boot=50,
                                   repeats=1)
    cols = [table.names.index(n) for n in om.COUNT_FEATURES]
    x = table.matrix[:, cols]
    expected = np.empty(y.size)
    for train, held in cv.splits:
        mean, scale = x[train].mean(0), np.where(x[train].std(0) > 1e-12, x[train].std(0), 1.0)
        model = LogisticRegression(C=1.0, max_iter=2000).fit((x[train] - mean) / scale, y[train])
        expected[held] = model.predict_proba((x[held] - mean) / scale)[:, 1]
    got = om.baseline_counts(table, y, groups, cv.splits)
    assert np.allclose(got, expected, atol=1e-6)
    embed = om.baseline_counts_embed(table, y, groups, cv.splits)
    for fig, pred in ((report.baseline_counts, got), (report.baseline_counts_embed, embed),
                      (report.learned, cv.predictions)):
        assert fig.all_pairs.value == auc(pred, y) and fig.within_task.value == within_task_auc(pred, y, groups)
    assert report.learned == om.for_new_tasks(report.learned_this_set)
    assert report.folds == 4 and report.tasks_with_both == int(sum(
        0 < y[groups == g].sum() < (groups == g).sum() for g in np.unique(groups)))
    assert report.learned.all_pairs.value > 0.75          # the synthetic signal is learnable


# --------------------------------------------------------------------------- learning curve
def test_the_learning_curve_rises_with_labels_and_skips_what_the_data_cannot_give():
    table, y, groups = synthetic(n_tasks=60, runs=4, seed=7, noise=0.3)
    curve = om.learning_curve_table(table, y, groups, sizes=(10, 20, 40, 80, 160, 1000), seeds=3, folds=4,
                                    config=om.Config("counts", "all_pairs", 1.0))
    assert curve.configs == [om.Config("counts", "all_pairs", 1.0)]
    assert [p.labelled for p in curve.points] == [10, 20, 40, 80, 160] and curve.skipped == [1000]
    assert all(p.seeds == 3 for p in curve.points)
    values = [p.all_pairs for p in curve.points]
    assert values[-1] > values[0] + 0.05 and values[-1] > 0.85
    assert sum(b >= a - 0.03 for a, b in zip(values, values[1:])) >= 3     # monotone up to noise
    for p in curve.points:
        assert p.all_pairs_range[0] <= p.all_pairs <= p.all_pairs_range[1]


def test_learning_curve_draws_whole_tasks():
    rng = np.random.default_rng(0)
    groups = np.repeat(["a", "b", "c", "d"], 5)
    rows = om._draw_by_task(np.arange(20), groups, 12, rng)
    assert rows.size == 12 and len(set(groups[rows])) == 3      # two whole tasks and part of a third
    spread = om._draw_by_task(np.arange(20), groups, 8, rng, per_task=2)
    assert spread.size == 8 and len(set(groups[spread])) == 4   # at most two runs of each task
    assert om._poolsize(np.arange(20), groups, 2) == 8


def test_learning_curve_on_a_frame(grok):
    frame, labels, groups = grok
    curve = om.learning_curve(frame, labels, groups, ScoringContext(), sizes=(10, 40, 10_000), seeds=2, folds=3,
                              per_task=None)
    assert isinstance(curve, om.LearningCurve) and curve.configs == list(om.CURVE_CONFIGS)
    assert [p.labelled for p in curve.points] == [10, 40] and curve.skipped == [10_000]
    # by default labels spread over tasks as a labelling queue gives them: fewer can be drawn
    spread = om.learning_curve(frame, labels, groups, ScoringContext(), sizes=(10, 10_000), seeds=1, folds=3)
    assert spread.per_task == om.CURVE_RUNS_PER_TASK and spread.skipped == [10_000]
    assert all(0 <= p.all_pairs <= 1 and p.seeds == 2 for p in curve.points)
    with pytest.raises(InputError, match="at least 2 tasks"):
        om.learning_curve(frame, np.full(frame.n_episodes, np.nan), groups)


# --------------------------------------------------------------------------- honest intervals
def test_repeats_widen_the_interval_with_the_choice_of_folds():
    table, y, groups = synthetic(n_tasks=40, seed=2, noise=1.0)
    one, _ = om.heldout_report(table, y, groups, configs=FAST[:2], outer_folds=4, inner_folds=3, repeats=1)
    three, cv = om.heldout_report(table, y, groups, configs=FAST[:2], outer_folds=4, inner_folds=3, repeats=3)
    assert len(three.chosen) == 3 * len(one.chosen)
    assert three.learned.all_pairs.value == auc(cv.predictions, y)
    single = om.repeated_fidelity([cv.predictions], y, groups)
    assert single.all_pairs.ci90 == fidelity(cv.predictions, y, groups, n_boot=500).all_pairs.ci90


def test_for_new_tasks_widens_about_the_value():
    fig = om.Fidelity(om.AucFigure(0.7, (0.6, 0.75), 10, 50), om.AucFigure(float("nan"), (float("nan"),) * 2, 0, 0))
    wide = om.for_new_tasks(fig)
    assert wide.all_pairs.ci90 == pytest.approx((0.7 - 0.1 * om.NEW_TASKS_WIDEN, 0.7 + 0.05 * om.NEW_TASKS_WIDEN))
    assert wide.all_pairs.value == 0.7 and np.isnan(wide.within_task.value)


def test_the_reported_interval_covers_what_new_tasks_give():
    """Fit on half the tasks, score the other half: the reported interval from the first half
    covers the second half's figure in most draws of the split, where the bootstrap over the
    first half's own tasks alone covers it less often."""
    table, y, groups = synthetic(n_tasks=120, runs=4, seed=11, noise=1.0)
    tasks = np.unique(groups)
    covered = {"reported": 0, "this_set": 0}
    trials = 8
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        half = set(rng.permutation(tasks)[: tasks.size // 2].tolist())
        a = np.flatnonzero([g in half for g in groups])
        b = np.setdiff1d(np.arange(y.size), a)
        sub = om.FeatureTable(table.names, table.matrix[a], table.columns)
        report, _ = om.heldout_report(sub, y[a], groups[a], configs=FAST[:2], outer_folds=4, inner_folds=3,
                                      n_boot=200, seed=seed)
        columns = om.set_columns(table)
        used, model = om.fit_ensemble(table.matrix[a], y[a], groups[a], report.chosen[0], columns)
        new = auc(model.predict(table.matrix[b][:, used]), y[b])
        for key, fig in (("reported", report.learned), ("this_set", report.learned_this_set)):
            lo, hi = fig.all_pairs.ci90
            covered[key] += lo <= new <= hi
    assert covered["reported"] >= trials - 1, covered
    assert covered["this_set"] <= covered["reported"]


# --------------------------------------------------------------------------- real runs: fit, save, score
@pytest.fixture(scope="module")
def grok():
    parsed = read_file(REAL / "tau2_grok" / "episodes.jsonl", reward_key="outcome", id_key="id")
    frame = frame_from_episodes(parsed.episodes, parsed.tools)
    labels, groups = outcome_columns(parsed.episodes)
    tasks = np.unique(groups.astype(str))[:24]                 # a subset keeps the suite quick
    keep = np.flatnonzero(np.isin(groups.astype(str), tasks))
    return frame.take_episodes(keep), labels[keep], groups[keep].astype(str)


@pytest.fixture(scope="module")
def grok_fit(grok):
    frame, labels, groups = grok
    ctx = ScoringContext()                                     # the sentence model (its store set by conftest)
    return fit_outcome_model(frame, labels, groups, ctx=ctx, cs=(0.1,), outer_folds=4, inner_folds=3, n_boot=50)


def test_the_fit_reports_held_out_figures_with_intervals(grok, grok_fit):
    frame, labels, groups = grok
    fit = grok_fit
    h = fit.heldout
    assert fit.n_labelled == frame.n_episodes and fit.n_tasks == 24 and fit.folds == 4
    for fig in (h.learned, h.baseline_counts, h.baseline_counts_embed):
        assert 0 <= fig.all_pairs.value <= 1 and fig.all_pairs.ci90[0] <= fig.all_pairs.ci90[1]
        assert fig.within_task.n_tasks == h.tasks_with_both > 0
    assert h.learned.all_pairs.value == auc(fit.predictions, labels)        # mean over the repeats
    assert h.learned.within_task.value == within_task_auc(fit.predictions, labels, groups)
    lo, hi = h.learned.all_pairs.ci90
    assert lo <= h.learned_this_set.all_pairs.ci90[0] <= h.learned.all_pairs.value <= h.learned_this_set.all_pairs.ci90[1] <= hi
    assert fit.params["heldout"]["all_pairs"]["value"] == round(h.learned.all_pairs.value, 4)
    assert fit.params["heldout"]["tasks_with_both"] == h.tasks_with_both
    json.dumps(fit.params)                                   # plain numbers: no pickle anywhere


def test_params_round_trip_through_the_template_and_score_as_fitted(grok, grok_fit):
    frame, labels, groups = grok
    fit = grok_fit
    ctx = ScoringContext()
    term = LearnedOutcome(**fit.params)
    table = om.feature_table(frame, ctx, groups, fit.params["blocks"])
    assert table.names == fit.params["features"]
    direct = om.LinearModel(np.array(fit.params["mean"]), np.array(fit.params["scale"]),
                            np.array(fit.params["coef"]), fit.params["intercept"]).predict(table.matrix)
    assert np.allclose(term.predict(frame, ctx, groups), direct)
    assert auc(direct, labels) > 0.5                          # fitted on these labels: ranks them

    template = with_learned_outcome(parse_template(TINY), fit.params)
    again = parse_template(template.to_yaml())               # saved and read back as YAML
    assert again.components_hash() == template.components_hash()
    result = score(None, again, frame=frame)
    col = [c.name for c in again.episode_terms].index("learned_outcome")
    values = result.matrix.episode_values[:, col]
    assert np.allclose(values, term.predict(frame, ctx))      # without task ids: grouped by the frame
    assert 0.0 <= values.min() and values.max() <= 1.0 and values.std() > 0


def test_a_task_with_one_run_has_no_task_relative_contrast(grok):
    frame, _, groups = grok
    one = frame.take_episodes([0])
    rel = om.task_relative(episode_stats(one)[:, :3], np.array(["x"]))
    assert np.all(rel == 0)
    many = om.task_relative(np.array([[1.0], [3.0], [7.0]]), np.array(["t", "t", "t"]))
    assert np.allclose(many[:, 0], np.log1p([1.0, 3.0, 7.0]) - np.log1p(3.0))


def test_criteria_features_join_when_the_episodes_have_criteria(grok, monkeypatch):
    from core.rewards import criteria

    frame, labels, groups = grok

    def criteria_features(f, ctx):                   # half the episodes with criteria that track the outcome
        has = (np.arange(f.n_episodes) % 2 == 0).astype(float)
        return ["has_criteria", "calls_matched"], np.column_stack([has, has * (labels > 0.5)])

    monkeypatch.setattr(criteria, "criteria_features", criteria_features)
    fit = fit_outcome_model(frame, labels, groups, embed="none", cs=(1.0,), objectives=("all_pairs",),
                            outer_folds=3, inner_folds=3, n_boot=20, top_configs=1, repeats=1)
    assert "criteria" in fit.params["blocks"] and "criteria_calls_matched" in fit.params["features"]
    assert fit.heldout.learned.all_pairs.value > fit.heldout.baseline_counts.all_pairs.value

    monkeypatch.setattr(criteria, "criteria_features",
                        lambda f, ctx: (["has_criteria", "calls_matched"], np.zeros((f.n_episodes, 2))))
    table = om.feature_table(frame, ScoringContext(), groups, ("stats", "criteria"))
    assert "criteria" not in table.columns                    # no episode has criteria: left out when fitting
    scored = LearnedOutcome(**fit.params).predict(frame, ScoringContext(), groups)
    assert scored.shape == (frame.n_episodes,)                # scoring keeps the block (has_criteria = 0)


def test_the_real_criteria_features_are_used_without_criteria_as_absent(grok):
    frame, _, groups = grok
    table = om.feature_table(frame, ScoringContext(), groups, ("stats", "criteria"))
    assert "criteria" not in table.columns                    # a frame of no workspace: no criteria
    kept = om.feature_table(frame, ScoringContext(), groups, ("stats", "criteria"), scoring=True)
    assert kept.matrix[:, kept.columns["criteria"]].shape[1] >= 2


def test_frame_groups_use_the_task_ids_a_workspace_load_stamps(grok):
    from core.rewards.criteria import TASK_IDS_KEY

    frame, _, groups = grok
    sub = frame.take_episodes(np.arange(frame.n_episodes))
    sub._cache = {}
    plain = om.frame_groups(sub)                             # tau2 runs of a task differ in their first words
    assert len(set(plain)) > len(set(groups))
    sub._cache[TASK_IDS_KEY] = ("d", {None: [g.split(":", 1)[1] for g in groups]})
    stamped = om.frame_groups(sub)
    assert len(set(stamped)) == len(set(groups))


def test_too_few_labels_are_refused_with_the_numbers(grok):
    frame, labels, groups = grok
    few = labels.copy()
    few[20:] = np.nan
    with pytest.raises(InputError, match="this data has 20"):
        fit_outcome_model(frame, few, groups, embed="none")


def test_an_unfitted_term_has_no_opinion_and_a_stale_one_is_refused(grok):
    frame, _, _ = grok
    template = with_learned_outcome(parse_template(TINY), {"embed": "none"})
    result = score(None, template, frame=frame)
    col = [c.name for c in template.episode_terms].index("learned_outcome")
    assert np.all(result.matrix.episode_values[:, col] == 0.5)
    stale = with_learned_outcome(parse_template(TINY), {
        "blocks": ["stats"], "features": ["x"], "mean": [0.0], "scale": [1.0], "coef": [1.0]})
    with pytest.raises(InputError, match="refit it"):
        score(None, stale, frame=frame)
    with pytest.raises(ValueError, match="unknown feature blocks"):
        LearnedOutcome(blocks=["nope"])


def test_a_term_saved_before_feature_blocks_still_scores(grok):
    frame, _, _ = grok
    coef = np.linspace(-1, 1, 12)
    term = LearnedOutcome(embed="none", features=[*STAT_FEATURES, "write_calls", "unrecovered_errors"],
                          mean=[0.0] * 12, scale=[1.0] * 12, coef=coef.tolist(), intercept=0.1)
    from core.rewards.learned import signal_features

    x = np.hstack([episode_stats(frame), signal_features(frame)])
    assert np.allclose(term(frame, ScoringContext()), 1 / (1 + np.exp(-(x @ coef + 0.1))))


def test_the_hand_built_pyramid_is_the_template_without_its_learned_term(grok_fit):
    plain = parse_template(TINY)
    learned = with_learned_outcome(plain, grok_fit.params)
    assert "learned_outcome" in [c.name for c in learned.episode_terms]
    stripped = without_learned_outcome(learned)
    assert [c.name for c in stripped.episode_terms] == [c.name for c in plain.episode_terms]
    assert without_learned_outcome(plain) is plain


def test_rwb_reward_learn_reports_held_out_figures_and_baselines(tmp_path, capsys):
    from core.cli import main

    ws = str(tmp_path / "ws")
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY)
    rwb_import_labelled(ws, "tau2_whissle", "whissle")
    assert main(["--workspace", ws, "reward", "save", "tiny", str(tiny), "--base", "0", "--json"]) == 0
    capsys.readouterr()
    assert main(["--workspace", ws, "reward", "learn", "-t", "tiny", "--dataset", "whissle",
                 "--embed", "none", "--C", "1", "--save", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["labelled"] == 50 and body["tasks"] == 50 and body["folds"] == 5
    assert body["tasks_with_both"] == 0                       # one run per task: no within-task pair
    for key in ("learned", "baseline_counts", "baseline_counts_embed"):
        fig = body[key]["all_pairs"]
        assert 0 <= fig["value"] <= 1 and fig["ci90"][0] <= fig["value"] <= fig["ci90"][1]
    assert body["learned_heldout_auc"] == body["learned"]["all_pairs"]["value"]
    assert body["saved"] == "tiny@2"
    assert main(["--workspace", ws, "reward", "validate", "tiny@2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "learned_outcome" in shown["episode_terms"]
    assert main(["--workspace", ws, "reward", "learn", "-t", "tiny", "--dataset", "whissle",
                 "--embed", "none", "--C", "1"]) == 0
    text = capsys.readouterr().out
    assert "baseline: counts + embeddings" in text and "within task" in text and "0 with both outcomes" in text


def test_a_near_constant_column_keeps_a_scale_the_template_accepts():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(size=40), 1.0 + 1e-9 * rng.normal(size=40)])
    y = (x[:, 0] > 0).astype(int)
    model = om.fit_linear(x, y, np.arange(40).astype(str), "all_pairs", 1.0)
    assert model.scale[1] == 1.0
    LearnedOutcome(blocks=["stats"], features=["a", "b"], mean=model.mean.round(8).tolist(),
                   scale=model.scale.round(8).tolist(), coef=model.coef.tolist())
