"""The learned outcome component (core.rewards.learned) on the labelled Grok tau2 runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _state_fixtures import HashEmbedder
from _real_logs import REAL, rwb_import_labelled
from core.base.errors import InputError
from core.data.importers import read_file
from core.rewards.api import frame_from_episodes, score
from core.rewards.calibration import outcome_columns
from core.rewards.components import ScoringContext
from core.rewards.agent_signals import AnswerConsistency
from core.rewards.learned import (ANSWER_FEATURES, SIGNAL_FEATURES, STAT_FEATURES, LearnedOutcome, episode_stats,
                                  fit_outcome_model, last_words, signal_features, with_learned_outcome)
from core.rewards.template import parse_template


TINY = """\
version: 1
name: tiny
levels:
  L1:
    components:
      tool_validity: {weight: 1.0}
"""


@pytest.fixture(scope="module")
def grok():
    parsed = read_file(REAL / "tau2_grok" / "episodes.jsonl", reward_key="outcome", id_key="id")
    frame = frame_from_episodes(parsed.episodes, parsed.tools)
    labels, groups = outcome_columns(parsed.episodes)
    return parsed.episodes, frame, labels, groups


def test_episode_stats_count_what_the_logs_hold(grok):
    episodes, frame, _, _ = grok
    stats = episode_stats(frame)
    assert stats.shape == (len(episodes), len(STAT_FEATURES))
    calls = [sum(s.action.kind == "tool_call" for s in e.steps) for e in episodes]
    assert stats[:, STAT_FEATURES.index("tool_calls")].tolist() == calls
    errors = [sum(bool(s.tool_error) for s in e.steps if s.action.kind == "tool_call") for e in episodes]
    assert stats[:, STAT_FEATURES.index("tool_errors")].tolist() == errors


def test_fit_is_grouped_and_predicts_as_the_model_fitted_directly(grok):
    from sklearn.linear_model import LogisticRegression

    _, frame, labels, groups = grok
    ctx = ScoringContext(embedder=HashEmbedder())
    fit = fit_outcome_model(frame, labels, groups, ctx=ctx, embed="last_words")
    assert fit.n_labelled == 586 and fit.n_tasks == 81 and fit.folds == 5
    assert 0.0 <= fit.heldout_auc <= 1.0 and fit.params["heldout_auc"] == round(fit.heldout_auc, 4)
    json.dumps(fit.params)                                   # plain numbers: no pickle anywhere

    predicted = LearnedOutcome(**fit.params)(frame, ctx)
    cosine, has = AnswerConsistency().cosines(frame, ctx)
    x = np.hstack([episode_stats(frame), signal_features(frame), cosine[:, None], has[:, None],
                   np.asarray(HashEmbedder().encode(last_words(frame)))])
    assert fit.params["features"][10:14] == [*SIGNAL_FEATURES, *ANSWER_FEATURES]
    mean, scale = x.mean(axis=0), np.where(x.std(axis=0) > 1e-12, x.std(axis=0), 1.0)
    direct = LogisticRegression(C=1.0, max_iter=2000).fit((x - mean) / scale, (labels > 0.5).astype(int))
    assert np.allclose(predicted, direct.predict_proba((x - mean) / scale)[:, 1], atol=1e-5)


def test_the_fitted_term_is_saved_in_the_template_and_scores(grok):
    _, frame, labels, groups = grok
    fit = fit_outcome_model(frame, labels, groups, embed="none")
    template = with_learned_outcome(parse_template(TINY), fit.params)
    again = parse_template(template.to_yaml())               # saved and read back as YAML
    assert again.components_hash() == template.components_hash()
    result = score(None, again, frame=frame)
    term = [c.name for c in again.episode_terms].index("learned_outcome")
    values = result.matrix.episode_values[:, term]
    assert np.allclose(values, LearnedOutcome(**fit.params)(frame, ScoringContext()))
    assert values.std() > 0 and 0.0 <= values.min() and values.max() <= 1.0


def test_too_few_labels_are_refused_with_the_numbers(grok):
    _, frame, labels, groups = grok
    few = labels.copy()
    few[20:] = np.nan
    with pytest.raises(InputError, match="this data has 20"):
        fit_outcome_model(frame, few, groups, embed="none")


def test_an_unfitted_term_has_no_opinion_and_a_stale_one_is_refused(grok):
    _, frame, _, _ = grok
    template = with_learned_outcome(parse_template(TINY), {"embed": "none"})
    result = score(None, template, frame=frame)
    term = [c.name for c in template.episode_terms].index("learned_outcome")
    assert np.all(result.matrix.episode_values[:, term] == 0.5)
    stale = with_learned_outcome(parse_template(TINY), {
        "embed": "none", "features": ["x"], "mean": [0.0], "scale": [1.0], "coef": [1.0]})
    with pytest.raises(InputError, match="refit it"):
        score(None, stale, frame=frame)


def test_rwb_reward_learn_reports_both_aucs_and_saves_a_version(tmp_path, capsys):
    from core.cli import main

    ws = str(tmp_path / "ws")
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY)
    rwb_import_labelled(ws, "tau2_whissle", "whissle")
    assert main(["--workspace", ws, "reward", "save", "tiny", str(tiny), "--base", "0", "--json"]) == 0
    capsys.readouterr()
    assert main(["--workspace", ws, "reward", "learn", "-t", "tiny", "--dataset", "whissle",
                 "--embed", "none", "--save", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["labelled"] == 50 and body["tasks"] == 50 and body["folds"] == 5
    assert 0 <= body["learned_heldout_auc"] <= 1 and 0 <= body["pyramid_heldout_auc"] <= 1
    assert body["saved"] == "tiny@2"
    assert main(["--workspace", ws, "reward", "validate", "tiny@2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "learned_outcome" in shown["episode_terms"]


def test_the_hand_built_pyramid_is_the_template_without_its_learned_term(grok):
    from core.rewards.learned import without_learned_outcome

    _, frame, labels, groups = grok
    fit = fit_outcome_model(frame, labels, groups, embed="none")
    plain = parse_template(TINY)
    learned = with_learned_outcome(plain, fit.params)
    assert "learned_outcome" in [c.name for c in learned.episode_terms]
    stripped = without_learned_outcome(learned)
    assert [c.name for c in stripped.episode_terms] == [c.name for c in plain.episode_terms]
    assert stripped.components_hash() == plain.components_hash()
    assert without_learned_outcome(plain) is plain
