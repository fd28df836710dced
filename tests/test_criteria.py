"""Task criteria: the three formats, bounds and errors, import and coverage, the criteria components
on hand-made episodes, the cache, ``rwb tasks`` / ``rwb episodes import --tasks``, roles, and the
criteria upload on the Episodes page."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from core import rewards
from core.access.users import LOCAL_ADMIN, add_user
from core.base.errors import InputError, PermissionDenied
from core.cli import main
from core.data import task_criteria as tc
from core.data.importers import import_file
from core.records.episodes import Action, Episode, Outcome, Step, Task
from core.records.store import Workspace
from core.rewards.components import COMPONENTS, ScoringContext
from core.rewards.criteria import (EpisodeCriteria, criteria_features, episodes_criteria, frame_criteria,
                                   match_calls, parse_date,
                                   said_exactly, value_similarity)
from core.rewards.reference import REFERENCES
from core.rewards.outcomes import DEFAULT_GROUP_KEYS, episode_groups, episode_labels, fidelity
from _rewards_fixtures import FakeEmbedder, make_frame

ROOT = Path(__file__).resolve().parents[1]
TAU2_AIRLINE = ROOT / "datasets" / "real" / "tau2" / "airline" / "tasks.json"
WHISSLE = ROOT / "datasets" / "real" / "tau2_whissle" / "episodes.jsonl"
EPISODES_PAGE = str(ROOT / "pages" / "episodes.py")


# --------------------------------------------------------------------------- hand-made episodes
def _call(t: int, tool: str, error: str | None = None, **params) -> Step:
    return Step(t=t, action=Action(kind="tool_call", tool=tool, params=params), tool_result={"ok": True},
                tool_error=error)


def _reply(t: int, text: str) -> Step:
    return Step(t=t, action=Action(kind="reply"), output_text=text)


def _episode(eid: str, task_id: str, steps: list[Step], resolved: bool | None = None) -> Episode:
    steps = [s.model_copy(update={"t": i}) for i, s in enumerate(steps)]
    return Episode(episode_id=eid, domain="airline", task=Task(query=f"task {task_id}"), steps=steps,
                   outcome=Outcome(resolved=resolved), meta={"task_id": task_id})


def _score(name: str, episodes: list[Episode], by_episode: dict, embedder=None, **params) -> np.ndarray:
    frame = rewards.frame_from_episodes(episodes)
    ctx = ScoringContext(embedder=embedder or FakeEmbedder(), criteria=EpisodeCriteria(by_episode, "test"))
    return COMPONENTS[name](**params)(frame, ctx)


BOOK = {"name": "book_reservation",
        "arguments": {"user_id": "u1", "amount": 1000, "date": "2024-05-01",
                      "passengers": [{"first": "Ann", "last": "Lee"}, {"first": "Bo", "last": "Wu"}]}}


def test_argument_order_number_formats_dates_and_nested_values_match():
    made = {"passengers": [{"last": "Wu", "first": "Bo"}, {"first": "Ann", "last": "Lee"}],
            "date": "May 1, 2024", "amount": "1,000", "user_id": "u1"}
    assert value_similarity(BOOK["arguments"], made) == 1.0
    assert value_similarity(1000, "1000") == value_similarity("1,000", 1000.0) == 1.0
    assert value_similarity("2024-05-01", "1st May 2024") == 1.0
    assert parse_date("05/01/2024") == "2024-05-01" and parse_date("not a date") is None
    assert value_similarity("2024-05-01", "2024-05-02") == 0.0
    # one passenger wrong in one field: 3 of 4 arguments agree, the list half-and-half
    wrong = dict(made, passengers=[{"first": "Ann", "last": "Lee"}, {"first": "Bo", "last": "Xu"}])
    assert value_similarity(BOOK["arguments"], wrong) == pytest.approx((3 + 0.75) / 4)


def test_expected_calls_partial_credit_missing_call_and_best_assignment():
    cancel = {"name": "cancel_reservation", "arguments": {"reservation_id": "R1"}}
    crit = {"expected_calls": [BOOK, cancel], "communicate": []}
    full = _episode("full", "t", [_call(0, "cancel_reservation", reservation_id="R1"),
                                  _call(1, "book_reservation", **BOOK["arguments"])])
    missing = _episode("missing", "t", [_call(0, "book_reservation", **BOOK["arguments"])])
    half_args = _episode("half", "t", [_call(0, "cancel_reservation", reservation_id="R1"),
                                       _call(1, "book_reservation", user_id="u1", amount=1000, date="2024-05-02",
                                             passengers=[])])
    failed = _episode("failed", "t", [_call(0, "cancel_reservation", error="not allowed", reservation_id="R1")])
    values = _score("expected_calls", [full, missing, half_args, failed], {e: crit for e in
                                                                         ("full", "missing", "half", "failed")})
    assert values.tolist() == pytest.approx([1.0, 0.5, (1 + 2 / 4) / 2, 0.0])   # 2 of 4 arguments right
    # two calls of one tool: the best one-to-one assignment, not the first match
    exp = [{"name": "cancel_reservation", "arguments": {"reservation_id": "A"}},
           {"name": "cancel_reservation", "arguments": {"reservation_id": "B"}}]
    match = match_calls(exp, [("cancel_reservation", {"reservation_id": "B"}),
                              ("cancel_reservation", {"reservation_id": "A"})])
    assert match.credit.tolist() == [1.0, 1.0] and match.assigned.tolist() == [1, 0]


def test_reads_are_not_expected_by_default_and_a_task_with_nothing_to_write_scores_full():
    crit = {"expected_calls": [{"name": "get_user_details", "arguments": {"user_id": "u1"}}], "communicate": []}
    quiet = _episode("q", "t", [_reply(0, "Sorry, I cannot do that.")])
    assert _score("expected_calls", [quiet], {"q": crit}).tolist() == [1.0]
    assert _score("expected_calls", [quiet], {"q": crit}, writes_only=False).tolist() == [0.0]


def test_unexpected_writes_and_forbidden_tools():
    crit = {"expected_calls": [{"name": "cancel_reservation", "arguments": {"reservation_id": "R1"}}],
            "communicate": [], "forbidden_tools": ["transfer_to_human_agents"]}
    clean = _episode("clean", "t", [_call(0, "get_reservation_details", reservation_id="R1"),
                                    _call(1, "cancel_reservation", reservation_id="R1")])
    extra = _episode("extra", "t", [_call(0, "cancel_reservation", reservation_id="R1"),
                                    _call(1, "cancel_reservation", reservation_id="R2"),
                                    _call(2, "update_reservation_flights", reservation_id="R1")])
    forbidden = _episode("forbidden", "t", [_call(0, "transfer_to_human_agents", summary="help")])
    by = {e: crit for e in ("clean", "extra", "forbidden")}
    assert _score("unexpected_writes", [clean, extra, forbidden], by, per=0.5).tolist() == [0.0, -1.0, -0.5]


def test_communicated_info_exact_then_embedding():
    class Keyed(FakeEmbedder):
        """Texts mentioning a refund share one vector; everything else is hashed apart."""

        def encode(self, texts):
            out = super().encode(texts)
            out[[("refund" in t.lower()) for t in texts]] = np.eye(self.dim, dtype=np.float32)[0]
            return out

    crit = {"expected_calls": [], "communicate": ["1628", "a refund to the original card"]}
    both = _episode("both", "t", [_reply(0, "Your total is $1,628.00."),
                                  _reply(1, "The refund goes back to your card in 5 days.")])
    number_only = _episode("num", "t", [_reply(0, "That costs 1628 dollars.")])
    wrong = _episode("wrong", "t", [_reply(0, "That costs 1629 dollars.")])
    by = {e: crit for e in ("both", "num", "wrong")}
    assert _score("communicated_info", [both, number_only, wrong], by, embedder=Keyed()).tolist() == [1.0, 0.5, 0.0]
    assert _score("communicated_info", [both], by, embedder=Keyed(), use_embeddings=False).tolist() == [0.5]
    assert said_exactly("Seat 12A", "ok, seat 12a, is yours") and not said_exactly("12A", "seat 112A")


def test_no_criteria_is_neutral_not_zero_and_the_features_say_which():
    eps = [_episode("with", "t", [_call(0, "cancel_reservation", reservation_id="R9")]),
           _episode("without", "u", [_call(0, "cancel_reservation", reservation_id="R9")])]
    crit = {"expected_calls": [{"name": "cancel_reservation", "arguments": {"reservation_id": "R1"}}],
            "communicate": [], "call_budget": 0}
    frame = rewards.frame_from_episodes(eps)
    ctx = ScoringContext(embedder=FakeEmbedder(), criteria=EpisodeCriteria({"with": crit}, "x"))
    names, x = criteria_features(frame, ctx)
    assert names == ["expected_calls", "unexpected_writes", "communicated_info", "call_budget", "has_criteria"]
    assert x[0].tolist() == pytest.approx([0.0, 0.0, 1.0, -0.05, 1.0])
    assert x[1].tolist() == pytest.approx([0.5, 0.0, 0.5, 0.0, 0.0])      # the documented neutral values
    names, none = criteria_features(frame, ScoringContext(embedder=FakeEmbedder()))
    assert none[:, -1].tolist() == [0.0, 0.0]


def _random_criteria(frame, seed: int) -> list[dict | None]:
    """Criteria built from each episode's own calls, some arguments changed, a call it never made,
    words it said and did not say, a budget and a forbidden tool; every fourth episode has none."""
    rng = np.random.default_rng(seed)
    names = frame.tool_name_of()
    out: list[dict | None] = []
    for e in range(frame.n_episodes):
        if e % 4 == 3:
            out.append(None)
            continue
        rows = [r for r in np.flatnonzero(frame.episode == e) if frame.kind[r] == 0]
        picked = rng.choice(rows, size=min(len(rows), 3), replace=False) if rows else []
        calls = []
        for r in picked:
            args = json.loads(frame.params_json[r]) if frame.params_json[r] else {}
            if args and rng.random() < 0.4:
                args[next(iter(args))] = "changed"
            calls.append({"name": str(names[r]), "arguments": args})
        calls.append({"name": "order", "arguments": {"side": "buy", "quantity": 1}})
        said = " ".join(frame.output_text[frame.episode == e].tolist()).split()
        say = ([said[0]] if said else []) + ["never said at all"]
        out.append({"expected_calls": calls, "communicate": say, "call_budget": int(rng.integers(0, 4)),
                    "forbidden_tools": ["news"]})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, params", [("expected_calls", {}), ("expected_calls", {"writes_only": False,
                                          "count_failed": True, "power": 2.0}),
                                          ("unexpected_writes", {}), ("unexpected_writes", {"count_failed": True}),
                                          ("communicated_info", {}), ("communicated_info", {"threshold": -1.0}),
                                          ("call_budget", {"per": 0.2, "cap": 2})])
def test_components_match_the_brute_force_reference(name, params, seed):
    frame = make_frame(seed=seed, n=10)
    per_episode = _random_criteria(frame, seed)
    by = {e: c for e, c in zip(frame.episode_ids.tolist(), per_episode) if c is not None}
    comp = COMPONENTS[name](**params)
    fast = comp(frame, ScoringContext(embedder=FakeEmbedder(), criteria=EpisodeCriteria(by, "t")))
    slow = (REFERENCES[name](frame, comp, FakeEmbedder(), per_episode) if comp.uses_embeddings
            else REFERENCES[name](frame, comp, per_episode))
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)
    assert len(set(np.round(fast, 9).tolist())) > 1 or name == "call_budget"


# --------------------------------------------------------------------------- formats
def test_tau2_task_file():
    fmt, parsed = tc.parse_criteria(TAU2_AIRLINE)
    assert fmt == "tau2" and len(parsed) == 50
    raw = {t["id"]: t["evaluation_criteria"] for t in json.loads(TAU2_AIRLINE.read_text())}
    for task_id, (crit, place) in parsed.items():
        # tau2's compare_args name the arguments its evaluator checks (an empty list: none)
        assert crit["expected_calls"] == [
            {"name": a["name"], "arguments": {k: v for k, v in a["arguments"].items()
                                              if a.get("compare_args") is None or k in a["compare_args"]}}
            for a in raw[task_id]["actions"]]
        assert crit["communicate"] == [str(x) for x in raw[task_id]["communicate_info"]]
    assert any(a.get("compare_args") == [] for t in raw.values() for a in t["actions"])
    crit, place = parsed["11"]
    assert place == 11
    assert [c["name"] for c in crit["expected_calls"]][-1] == "update_reservation_flights"
    assert sum(bool(c["communicate"]) for c, _ in parsed.values()) == 6


def test_tau_bench_v1_records_and_trajectories(tmp_path):
    tasks = tmp_path / "v1.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in [
        {"task_id": 0, "user_id": "mia_li_3668", "instruction": "book a flight",
         "actions": [{"name": "book_reservation", "kwargs": {"user_id": "mia_li_3668", "total_baggages": 3}}],
         "outputs": []},
        {"task_id": 1, "user_id": "sofia_kim", "instruction": "how much did I pay",
         "actions": [], "outputs": ["327", "1000"]}]) + "\n")
    fmt, parsed = tc.parse_criteria(tasks)
    assert fmt == "tau-bench" and set(parsed) == {"0", "1"}
    assert parsed["0"][0]["expected_calls"] == [{"name": "book_reservation",
                                                 "arguments": {"user_id": "mia_li_3668", "total_baggages": 3}}]
    assert parsed["1"][0]["communicate"] == ["327", "1000"]
    # a trajectory file: each task once per run, with its record under info.task
    runs = tmp_path / "runs.json"
    task = {"user_id": "u", "actions": [{"name": "cancel_reservation", "kwargs": {"reservation_id": "X"}}],
            "instruction": "cancel", "outputs": []}
    runs.write_text(json.dumps([{"task_id": 7, "reward": r, "info": {"task": task}, "traj": []} for r in (0, 1)]))
    fmt, parsed = tc.parse_criteria(runs)
    assert fmt == "tau-bench" and list(parsed) == ["7"]


def test_documented_format(tmp_path):
    f = tmp_path / "criteria.jsonl"
    f.write_text(json.dumps({"task_id": "a", "expected_calls": [{"name": "refund", "arguments": {"order": 1}}],
                             "communicate": ["refund issued"], "forbidden": ["delete_account"],
                             "call_budget": 6}) + "\n")
    fmt, parsed = tc.parse_criteria(f)
    assert fmt == "rwb"
    assert parsed["a"][0] == {"expected_calls": [{"name": "refund", "arguments": {"order": 1}}],
                              "communicate": ["refund issued"], "forbidden_tools": ["delete_account"],
                              "call_budget": 6}


@pytest.mark.parametrize("content, fmt, expect", [
    ('{"task_id": "a"}\n{not json\n', None, ("line 2", "invalid JSON")),
    ('{"task_id": "a", "expected_calls": [{"arguments": {}}]}\n', None, ("line 1", "expected_calls[0].name")),
    ('{"task_id": "a", "colour": 1}\n', None, ("line 1", "field 'colour'")),
    ('{"task_id": "a", "call_budget": -1}\n', None, ("line 1", "call_budget")),
    ('[{"id": "1", "evaluation_criteria": {"actions": "x"}}]', None, ("record 0", "evaluation_criteria.actions")),
    ('[{"id": "1"}, {"id": true}]', "tau2", ("record 1", "field 'id'")),
    ('{"task_id": "a"}\n{"task_id": "a", "communicate": ["x"]}\n', None, ("line 2", "given twice")),
    ('{"hello": 1}\n', None, ("line 1", "give --format")),
    ('{"task_id": "a"}\n', "bogus", ("format", "bogus")),
])
def test_bad_input_names_file_record_and_field(tmp_path, content, fmt, expect):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(InputError) as err:
        tc.parse_criteria(f, format=fmt)
    for part in expect:
        assert part in str(err.value)
    if fmt != "bogus":
        assert err.value.file == str(f)


def test_bounds(tmp_path, monkeypatch):
    deep: object = "x"
    for _ in range(tc.MAX_DEPTH + 2):
        deep = {"k": deep}
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps({"task_id": "a", "expected_calls": [{"name": "t", "arguments": deep}]}) + "\n")
    with pytest.raises(InputError, match="nested deeper"):
        tc.parse_criteria(f)
    f.write_text(json.dumps({"task_id": "a", "communicate": ["x" * (tc.MAX_STRING + 1)]}) + "\n")
    with pytest.raises(InputError, match="communicate\\[0\\]"):
        tc.parse_criteria(f)
    monkeypatch.setattr(tc, "MAX_RECORDS", 2)
    f.write_text("".join(json.dumps({"task_id": str(i)}) + "\n" for i in range(3)))
    with pytest.raises(InputError, match="more than 2 records"):
        tc.parse_criteria(f)
    monkeypatch.setattr(tc, "MAX_FILE_BYTES", 10)
    with pytest.raises(InputError, match="limited to 10"):
        tc.parse_criteria(f)
    with pytest.raises(InputError, match="limited to 10"):
        tc.parse_criteria("upload.jsonl", data=b"x" * 11)


def test_task_id_keys_follow_the_task_groups():
    assert tc.TASK_ID_KEYS == DEFAULT_GROUP_KEYS


# --------------------------------------------------------------------------- the workspace
def _write(tmp_path: Path, episodes: list[Episode]) -> Path:
    f = tmp_path / "eps.jsonl"
    f.write_text("\n".join(ep.to_json() for ep in episodes) + "\n")
    return f


def _ws_with(tmp_path: Path) -> Workspace:
    eps = [_episode(f"e{i}", str(i % 3), [_call(0, "cancel_reservation", reservation_id=f"R{i % 3}"),
                                          _reply(1, "done")], resolved=True) for i in range(6)]
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, _write(tmp_path, eps), dataset="d")
    return ws


def _rwb_file(tmp_path: Path, name: str, rows: dict[str, str]) -> Path:
    f = tmp_path / name
    f.write_text("".join(json.dumps({"task_id": t, "expected_calls": [
        {"name": "cancel_reservation", "arguments": {"reservation_id": r}}]}) + "\n" for t, r in rows.items()))
    return f


def test_import_coverage_and_reimport(tmp_path):
    ws = _ws_with(tmp_path)
    assert tc.criteria_coverage(ws, "d").line == "criteria for 0 of 6 episodes"
    first = tc.import_criteria(ws, LOCAL_ADMIN, _rwb_file(tmp_path, "a.jsonl", {"0": "R0", "1": "R1", "9": "R9"}), "d")
    assert (first.tasks_read, first.tasks_matched, first.replaced) == (3, 2, 0)
    assert first.coverage_line == "criteria for 4 of 6 episodes" and first.unmatched_task_ids == ["9"]
    cov = tc.criteria_coverage(ws, "d")
    assert (cov.episodes_with_criteria, cov.tasks_with_criteria, cov.tasks_matched) == (4, 3, 2)
    again = tc.import_criteria(ws, LOCAL_ADMIN, _rwb_file(tmp_path, "b.jsonl", {"1": "R7", "2": "R2"}), "d")
    assert again.replaced == 1 and again.coverage_line == "criteria for 6 of 6 episodes"
    stored = tc.criteria_for(ws, "d")
    assert stored["1"]["expected_calls"][0]["arguments"] == {"reservation_id": "R7"} and "0" in stored
    row = ws.conn.execute("SELECT source_file, source_line, source_format, imported_by FROM task_criteria "
                          "WHERE dataset='d' AND task_id='2'").fetchone()
    assert tuple(row) == (str(tmp_path / "b.jsonl"), 2, "rwb", LOCAL_ADMIN.name)
    # a bad file changes nothing
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "0"}\n{oops\n')
    with pytest.raises(InputError):
        tc.import_criteria(ws, LOCAL_ADMIN, bad, "d")
    assert tc.criteria_for(ws, "d") == stored


def test_scoring_joins_the_criteria_and_the_cache_follows_a_reimport(tmp_path):
    ws = _ws_with(tmp_path)
    template = rewards.parse_template("""
version: 1
name: only_criteria
levels:
  L1:
    components:
      tool_validity: {weight: 1.0}
episode_terms:
  expected_calls: {weight: 1.0}
""")
    def expected_calls() -> list[float]:
        result = rewards.score(ws, template, frame=rewards.load_frame(ws, "d"))
        matrix = result.matrix
        return matrix.episode_values[:, matrix.episode_names.index("expected_calls")].tolist()

    assert expected_calls() == [0.5] * 6                                        # no criteria: neutral
    tc.import_criteria(ws, LOCAL_ADMIN, _rwb_file(tmp_path, "a.jsonl", {"0": "R0", "1": "R1"}), "d")
    assert expected_calls() == [1.0, 1.0, 0.5, 1.0, 1.0, 0.5]
    tc.import_criteria(ws, LOCAL_ADMIN, _rwb_file(tmp_path, "b.jsonl", {"0": "R5"}), "d")
    assert expected_calls() == [0.0, 1.0, 0.5, 0.0, 1.0, 0.5]
    frame = rewards.load_frame(ws, "d")
    assert frame_criteria(ws, frame).by_episode["e0"]["expected_calls"][0]["arguments"] == {"reservation_id": "R5"}
    cache = rewards.ComponentCache.for_workspace(ws, frame_criteria(ws, frame).digest)
    assert cache.get(frame, COMPONENTS["expected_calls"]()) is not None          # scored: cached under the digest
    assert rewards.ComponentCache.for_workspace(ws, "other").get(frame, COMPONENTS["expected_calls"]()) is None


def test_group_key_joins_on_another_field(tmp_path):
    eps = [_episode(f"e{i}", "ignored", [_call(0, "cancel_reservation", reservation_id="R1")]) for i in range(2)]
    eps = [ep.model_copy(update={"meta": {"task": {"code": f"T{i}"}}}) for i, ep in enumerate(eps)]
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, _write(tmp_path, eps), dataset="g")
    f = _rwb_file(tmp_path, "g.jsonl", {"T0": "R1"})
    assert tc.import_criteria(ws, LOCAL_ADMIN, f, "g").episodes_with_criteria == 0
    assert tc.import_criteria(ws, LOCAL_ADMIN, f, "g", group_key="task.code").coverage_line == \
        "criteria for 1 of 2 episodes"
    frame = rewards.load_frame(ws, "g")
    assert set(frame_criteria(ws, frame).by_episode) == {"e0"}
    assert episodes_criteria(ws, "g", ws.load_episodes("g")) == frame_criteria(ws, frame)
    assert frame_criteria(ws, frame.take_episodes([1])) is None          # a frame of another origin


def test_a_reviewer_cannot_import_criteria(tmp_path):
    ws = _ws_with(tmp_path)
    admin = add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password-1").actor()
    reviewer = add_user(ws, admin, "rae", "reviewer", password="rae-password-1").actor()
    analyst = add_user(ws, admin, "ana", "analyst", password="ana-password-1").actor()
    f = _rwb_file(tmp_path, "a.jsonl", {"0": "R0"})
    with pytest.raises(PermissionDenied):
        tc.import_criteria(ws, reviewer, f, "d")
    assert tc.criteria_for(ws, "d") == {}
    assert tc.import_criteria(ws, analyst, f, "d").tasks_read == 1


# --------------------------------------------------------------------------- real runs
def test_expected_calls_and_unexpected_writes_rank_real_tau2_runs(tmp_path):
    """On the 50 whissle airline runs with tau2's own task file: expected writes made, nothing else
    written, ranks successes first (measured 0.99 all pairs; docs/criteria.md)."""
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, WHISSLE, dataset="wh", reward_key="outcome", id_key="id")
    assert tc.import_criteria(ws, LOCAL_ADMIN, TAU2_AIRLINE, "wh").coverage_line == "criteria for 50 of 50 episodes"
    frame = rewards.load_frame(ws, "wh")
    ctx = ScoringContext(embedder=FakeEmbedder(), criteria=frame_criteria(ws, frame))
    score = COMPONENTS["expected_calls"]()(frame, ctx) + COMPONENTS["unexpected_writes"]()(frame, ctx)
    eps = ws.load_episodes("wh")
    fig = fidelity(score, episode_labels(eps), episode_groups(eps))
    assert fig.all_pairs.value >= 0.9


# --------------------------------------------------------------------------- CLI
def _rwb(ws: Path, *args: str) -> list[str]:
    return ["--workspace", str(ws), *args]


def test_cli_tasks_import_list_and_episodes_import_tasks(tmp_path, capsys):
    ws = tmp_path / "ws"
    eps = [_episode(f"e{i}", str(i % 2), [_call(0, "cancel_reservation", reservation_id="R0")]) for i in range(4)]
    episodes = _write(tmp_path, eps)
    crit = _rwb_file(tmp_path, "c.jsonl", {"0": "R0"})
    assert main(_rwb(ws, "episodes", "import", str(episodes), "--dataset", "d", "--tasks", str(crit))) == 0
    out = capsys.readouterr().out
    assert "Imported 4 episodes" in out and "criteria for 2 of 4 episodes" in out
    assert main(_rwb(ws, "tasks", "import", str(crit), "--dataset", "d", "--json")) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["criteria"]["replaced"] == 1 and got["coverage"] == "criteria for 2 of 4 episodes"
    assert main(_rwb(ws, "tasks", "list", "--dataset", "d", "--json")) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["line"] == "criteria for 2 of 4 episodes" and list(listed["tasks"]) == ["0"]
    assert main(_rwb(ws, "tasks", "list", "--dataset", "d")) == 0
    assert "criteria for 2 of 4 episodes" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    ws = tmp_path / "ws"
    eps = _write(tmp_path, [_episode("e0", "0", [_call(0, "cancel_reservation", reservation_id="R0")])])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "0", "expected_calls": [{"arguments": {}}]}\n')
    # a bad criteria file stops `episodes import --tasks` before any episode is imported
    assert main(_rwb(ws, "episodes", "import", str(eps), "--dataset", "d", "--tasks", str(bad))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1" in err and "expected_calls[0].name" in err and "Traceback" not in err
    assert Workspace.open(ws).datasets() == []
    assert main(_rwb(ws, "episodes", "import", str(eps), "--dataset", "d")) == 0
    for args, words in ((("tasks", "import", str(bad), "--dataset", "d"), "expected_calls[0].name"),
                        (("tasks", "import", str(tmp_path / "none.json"), "--dataset", "d"), "cannot read"),
                        (("tasks", "import", str(bad), "--dataset", "nope"), "no dataset named 'nope'"),
                        (("tasks", "list", "--dataset", "nope"), "no dataset named 'nope'"),
                        (("tasks", "import", str(bad), "--dataset", "d", "--format", "xml"),
                         "unknown criteria format")):
        capsys.readouterr()
        assert main(_rwb(ws, *args)) == 2
        err = capsys.readouterr().err
        assert err.startswith("Error: ") and err.count("\n") == 1 and words in err, err


# --------------------------------------------------------------------------- the Episodes page
def test_upload_bytes_and_the_episodes_page_shows_coverage(tmp_path, monkeypatch):
    ws = _ws_with(tmp_path)
    # the page hands the uploaded bytes to import_criteria (AppTest cannot drive a file uploader)
    data = _rwb_file(tmp_path, "up.jsonl", {"0": "R0"}).read_bytes()
    result = tc.import_criteria(ws, LOCAL_ADMIN, "my tasks.jsonl", "d", data=data)
    assert result.file == "my tasks.jsonl" and result.coverage_line == "criteria for 2 of 6 episodes"
    with pytest.raises(InputError) as err:
        tc.import_criteria(ws, LOCAL_ADMIN, "broken.jsonl", "d", data=b'{"task_id": 1}\n{x\n')
    assert str(err.value).startswith("broken.jsonl, line 2")
    ws.close()

    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    at = AppTest.from_file(EPISODES_PAGE, default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    assert any("Task criteria: criteria for 2 of 6 episodes" in c.value for c in at.caption)
    at.button(key="FormSubmitter:episodes_criteria-Import criteria").click().run()
    assert any("Choose a criteria file first" in w.value for w in at.warning)
    assert at.selectbox(key="episodes_criteria_format").options[0].startswith("auto")
    at.session_state["episodes_criteria_outcome"] = ("error", "broken.jsonl, line 2: invalid JSON")
    at.run()
    assert [e.value for e in at.error] == ["broken.jsonl, line 2: invalid JSON"]
