"""The framework adapters (docs/export.md): verl's and OpenRLHF's documented call shapes, TRL's
functions (weights, schedules, None, pickling, one scoring per batch) and ``rwb reward export``
(the written module imports in a fresh process, gives the scorer's values and refuses a changed
template copy)."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from core.base.errors import InputError
from core.cli import main
from core.rewards import export
from core.rewards.export import (FRAMEWORKS, openrlhf_reward_func, trl_reward_funcs, verl_compute_score,
                                 write_export)
from core.rewards.markup import transcript_messages
from core.rewards.template import templates_dir
from core.rewards.trajectory import TrajectoryScorer

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order by its id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]
TASK = {"expected_calls": [{"name": "get_order", "arguments": {"order_id": 7}}], "communicate": ["shipped"]}
PROMPT = [{"role": "user", "content": "Where is my order 7?"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": 7}}}
COMPLETIONS = [
    [{"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "c1", "name": "get_order", "content": '{"status": "shipped"}'},
     {"role": "assistant", "content": "Your order 7 shipped."}],
    [{"role": "assistant", "content": "Your order 7 shipped yesterday."}],
    [{"role": "assistant", "content": '<tool_call>{"name": "get_order", "arguments": {"order_id": 7}}</tool_call>'}],
    [{"role": "assistant", "content": '<tool_call>{"name": "get_order", "arguments": </tool_call>'}],
]
#: The same trajectories as decoded ChatML text (what verl and OpenRLHF hand a reward).
SOLUTION = ('<tool_call>\n{"name": "get_order", "arguments": {"order_id": 7}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n{"status": "shipped"}\n</tool_response><|im_end|>\n'
            "<|im_start|>assistant\nYour order 7 shipped.<|im_end|>")
QUERY = "<|im_start|>user\nWhere is my order 7?<|im_end|>\n<|im_start|>assistant\n" + SOLUTION


@pytest.fixture(scope="module")
def scorer():
    return TrajectoryScorer("tool_agent")


@pytest.fixture(scope="module")
def criteria_scorer():
    return TrajectoryScorer("tool_agent_criteria")


def _trajectories(completions=COMPLETIONS, task=None):
    from core.rewards.markup import completion_messages

    out = []
    for c in completions:
        msgs = []
        for m in c:   # a message that carries no calls but holds markup is read as calls
            if m["role"] == "assistant" and not m.get("tool_calls") and "<tool_call>" in m["content"]:
                msgs += completion_messages(m["content"])
            else:
                msgs.append(m)
        out.append({"messages": PROMPT + msgs, "tools": TOOLS, "task": task})
    return out


# --------------------------------------------------------------------------- TRL
def test_trl_funcs_give_each_component_and_sum_to_the_score(scorer):
    reward = trl_reward_funcs("tool_agent")
    assert reward.names == scorer.component_names == [f.__name__ for f in reward.funcs]
    assert reward.weights == [scorer.weights_at()[n] for n in reward.names]
    columns = {"tools": [json.dumps(TOOLS)] * 4, "task": [None] * 4}
    values = [f(prompts=[PROMPT] * 4, completions=COMPLETIONS, completion_ids=None, **columns) for f in reward.funcs]
    expected = scorer.score_batch(_trajectories())
    for i, s in enumerate(expected):
        assert [v[i] for v in values] == [s.components[n] for n in reward.names]
        total = math.fsum(w * v[i] for w, v in zip(reward.weights, values) if v[i] is not None)
        assert total + s.constant == pytest.approx(s.score, abs=1e-9)
    broken = expected[3].steps[0]   # the call that does not parse is an invalid action, with the reason
    assert not broken.valid and "unreadable tool call" in broken.invalid_reason


def test_trl_text_completions_are_parsed(scorer):
    reward = trl_reward_funcs("tool_agent")
    text = '<tool_call>{"name": "get_order", "arguments": {"order_id": 7}}</tool_call>'
    got = [f(["Where is my order 7?"], [text], tools=[TOOLS]) for f in reward.funcs]
    want = scorer.score(PROMPT + transcript_messages(text), tools=TOOLS)
    assert [g[0] for g in got] == [want.components[n] for n in reward.names]


def test_trl_none_where_a_component_does_not_apply(criteria_scorer):
    reward = trl_reward_funcs("tool_agent_criteria")
    task = [json.dumps(TASK), None, TASK, ""]
    values = {f.__name__: f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4, task=task) for f in reward.funcs}
    uses = [n for n, v in values.items() if v[1] is None]
    assert uses, "tool_agent_criteria has criteria components"
    for n in uses:
        assert values[n][1] is None and values[n][3] is None
        assert values[n][0] is not None and values[n][2] is not None
    expected = criteria_scorer.score_batch(
        [dict(t, task=TASK if i in (0, 2) else None) for i, t in enumerate(_trajectories())])
    for i, s in enumerate(expected):
        assert {n: v[i] for n, v in values.items()} == s.components


def test_trl_level_granularity(scorer):
    reward = trl_reward_funcs("tool_agent", granularity="level")
    assert reward.names == ["L1", "L2", "L3", "penalty", "episode"] and reward.weights == [1.0] * 5
    values = [f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4) for f in reward.funcs]
    for i, s in enumerate(scorer.score_batch(_trajectories())):
        assert [v[i] for v in values] == pytest.approx([s.levels[n] for n in reward.names], abs=1e-12)
        assert math.fsum(v[i] for v in values) + s.constant == pytest.approx(s.score, abs=1e-9)
    with pytest.raises(InputError) as err:
        trl_reward_funcs("tool_agent", granularity="step")
    assert err.value.field == "granularity"


def test_trl_funcs_share_one_scoring_per_batch(monkeypatch):
    reward = trl_reward_funcs("tool_agent")
    shared = reward.funcs[0]._shared
    assert all(f._shared is shared for f in reward.funcs + reward.async_funcs)
    calls = []
    real = shared.scorer.score_batch
    monkeypatch.setattr(shared.scorer, "score_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for f in reward.funcs:
        f([PROMPT] * 2, COMPLETIONS[:2], tools=[TOOLS] * 2)
    assert len(calls) == 1
    reward.funcs[0]([PROMPT] * 2, COMPLETIONS[1:3], tools=[TOOLS] * 2)   # another batch: scored anew
    assert len(calls) == 2


def test_trl_async_funcs_give_the_same_values():
    import asyncio

    from trl.trainer.utils import get_callable_name, is_async_callable

    reward = trl_reward_funcs("tool_agent")
    assert all(is_async_callable(f) for f in reward.async_funcs)
    assert not any(is_async_callable(f) for f in reward.funcs)
    assert [get_callable_name(f) for f in reward.async_funcs] == reward.names

    async def run_all():
        return await asyncio.gather(*(f(prompts=[PROMPT] * 4, completions=COMPLETIONS, tools=[TOOLS] * 4)
                                      for f in reward.async_funcs))

    got = asyncio.run(run_all())
    assert got == [f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4) for f in reward.funcs]


def test_trl_funcs_pickle_and_score_in_a_new_scorer():
    reward = trl_reward_funcs("tool_agent")
    want = [f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4) for f in reward.funcs]
    funcs = pickle.loads(pickle.dumps(reward.funcs))
    assert funcs[0]._shared is funcs[-1]._shared and funcs[0]._shared._scorer is None   # rebuilt lazily
    assert [f.__name__ for f in funcs] == reward.names
    assert [f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4) for f in funcs] == want
    assert funcs[0]._shared.scorer.label == "tool_agent@0"
    assert pickle.loads(pickle.dumps(reward.async_funcs[0])).__name__ == reward.names[0]


@pytest.fixture
def scheduled(tmp_path):
    """tool_agent with two schedules: one from its template weight, one from a zero weight."""
    text = (templates_dir() / "tool_agent.yaml").read_text(encoding="utf-8")
    text = text.replace("  answered:\n    component: ends_with_answer\n    weight: 1.0",
                        "  answered:\n    component: ends_with_answer\n    weight: 0.0")
    text += "schedules:\n  answer_consistency: [[0, 1.5], [10, 0.5]]\n  answered: [[0, 0.0], [10, 2.0]]\n"
    path = tmp_path / "scheduled.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("step", [0, 4, 10, 25])
def test_trl_schedules_follow_the_training_step(scheduled, step):
    from types import SimpleNamespace

    reward = trl_reward_funcs(scheduled)
    weight = dict(zip(reward.names, reward.weights))
    assert weight["answered"] == 1.0    # a zero template weight is exported as 1 (docs/export.md)
    assert weight["answer_consistency"] == 1.5
    state = SimpleNamespace(global_step=step)
    values = [f([PROMPT] * 4, COMPLETIONS, tools=[TOOLS] * 4, trainer_state=state) for f in reward.funcs]
    scores = TrajectoryScorer(scheduled).score_batch(_trajectories(), step=step)
    for i, s in enumerate(scores):
        total = math.fsum(w * v[i] for w, v in zip(reward.weights, values) if v[i] is not None)
        assert total == pytest.approx(s.score - s.constant, abs=1e-9)
    assert scores[0].weights["answered"] == pytest.approx(min(step, 10) * 0.2)


# --------------------------------------------------------------------------- verl
def test_verl_compute_score_positional_and_keyword(scorer):
    compute_score = verl_compute_score("tool_agent")
    want = scorer.score(transcript_messages(SOLUTION), tools=TOOLS)
    by_position = compute_score("tool_agent_data", SOLUTION, None, {"tools": TOOLS, "num_turns": 3})
    by_keyword = compute_score(data_source="tool_agent_data", solution_str=SOLUTION, ground_truth=None,
                               extra_info={"tools": json.dumps(TOOLS), "tool_rewards": [0.0]})
    assert by_position == by_keyword
    assert by_position == {"score": want.score, **want.components}
    assert isinstance(compute_score("d", SOLUTION)["score"], float)    # extra_info defaults to None


def test_verl_ground_truth_carries_criteria_or_an_envelope(criteria_scorer):
    compute_score = verl_compute_score("tool_agent_criteria")
    msgs = transcript_messages(SOLUTION)
    want = criteria_scorer.score(msgs, tools=TOOLS, task=TASK)
    plain = compute_score("d", SOLUTION, json.dumps(TASK), {"tools": TOOLS})
    envelope = compute_score("d", SOLUTION, {"task": TASK, "tools": TOOLS})
    assert plain == envelope == {"score": want.score, **want.components}
    without = compute_score("d", SOLUTION, None, {"tools": TOOLS})
    nan = [k for k, v in without.items() if isinstance(v, float) and math.isnan(v)]
    assert nan and all(want.components[k] is not None for k in nan)   # NaN: does not apply here
    with pytest.raises(InputError) as err:
        compute_score("d", SOLUTION, "{broken")
    assert err.value.field == "ground_truth"
    with pytest.raises(InputError) as err:
        compute_score("d", ["not", "text"])
    assert err.value.field == "solution_str"


# --------------------------------------------------------------------------- OpenRLHF
def test_openrlhf_reward_func_documented_shape(scorer):
    import torch

    reward_func = openrlhf_reward_func("tool_agent")
    queries = [QUERY, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"]
    prompts = [q.split("<|im_start|>assistant\n")[0] for q in queries]
    labels = [json.dumps({"tools": TOOLS}), ""]
    by_position = reward_func(queries, prompts, labels)
    by_keyword = reward_func(queries=queries, prompts=prompts, labels=labels, extra="ignored")
    want = [scorer.score(transcript_messages(QUERY), tools=TOOLS),
            scorer.score(transcript_messages(queries[1]))]
    for out in (by_position, by_keyword):
        assert set(out) == {"rewards", "scores", "extra_logs"}
        assert isinstance(out["rewards"], torch.Tensor) and out["rewards"].dtype == torch.float32
        assert out["rewards"].tolist() == pytest.approx([w.score for w in want], abs=1e-6)
        assert torch.equal(out["scores"], out["rewards"])
        assert set(out["extra_logs"]) == set(scorer.component_names)
        for name, col in out["extra_logs"].items():
            assert col.tolist() == pytest.approx([w.components[name] for w in want], abs=1e-6)
    with pytest.raises(InputError) as err:
        reward_func(queries, prompts, labels[:1])
    assert err.value.field == "labels"


# --------------------------------------------------------------------------- rwb reward export
_CHECKS = {
    "trl": ("reward = mod.reward\n"
            "vals = [f([[{'role': 'user', 'content': 'Where is my order 7?'}]], [[{'role': 'assistant', "
            "'content': 'It shipped.'}]], tools=[TOOLS]) for f in mod.reward_funcs]\n"
            "out = {'names': reward.names, 'weights': mod.reward_weights, 'values': [v[0] for v in vals]}\n"),
    "verl": "out = mod.compute_score('d', SOLUTION, None, {'tools': TOOLS})\n",
    "openrlhf": ("r = mod.reward_func([QUERY], [''], [json.dumps({'tools': TOOLS})])\n"
                 "out = {'rewards': r['rewards'].tolist(), 'logs': {k: v.tolist() for k, v in r['extra_logs'].items()}}\n"),
    "verifiers": ("import verifiers.v1 as vf\ntask = mod.load_task({'tools': TOOLS})\n"
                  "tasks = list(mod.load_taskset([{'prompt': 'a'}, {'prompt': 'b', 'tools': TOOLS}]))\n"
                  "out = {'task': isinstance(task, mod.RewardTask) and isinstance(task, vf.Task),\n"
                  "       'rewards': [f.__name__ for f in task.hooks('reward')],\n"
                  "       'rows': [t.data.prompt for t in tasks if isinstance(t, mod.RewardTask)]}\n"),
}


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory) -> tuple[dict, dict]:
    """Every framework's export written to its own folder, then imported and called in ONE fresh
    Python process (each module loaded from its file): (write_export results, what each gave)."""
    root = tmp_path_factory.mktemp("exports")
    results = {fw: write_export("tool_agent", fw, root / fw) for fw in FRAMEWORKS}
    code = ("import importlib.util, json, sys\n"
            f"TOOLS = json.loads({json.dumps(json.dumps(TOOLS))})\nSOLUTION = {SOLUTION!r}\nQUERY = {QUERY!r}\n"
            "outs = {}\n")
    for fw in FRAMEWORKS:
        path = root / fw / f"{MODULE}.py"
        code += (f"spec = importlib.util.spec_from_file_location('rwb_export_{fw}', {str(path)!r})\n"
                 "mod = importlib.util.module_from_spec(spec)\nsys.modules[spec.name] = mod\n"
                 "spec.loader.exec_module(mod)\n" + _CHECKS[fw] + f"outs[{fw!r}] = out\n")
    code += "print(json.dumps(outs))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return results, json.loads(done.stdout.strip().splitlines()[-1])


MODULE = "rwb_reward_tool_agent_0"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_written_module_imports_in_a_fresh_process(fresh_process, framework, scorer):
    results, outs = fresh_process
    result, out = results[framework], outs[framework]
    folder = result.files[0].parent
    assert [f.name for f in result.files] == [f"{MODULE}.py", "tool_agent@0.yaml", "README.md"]
    assert result.entry_point.startswith(MODULE + ":") and result.template == "tool_agent@0"
    assert result.sha256 == scorer.sha256
    assert result.snippet in (folder / "README.md").read_text(encoding="utf-8")
    if framework == "trl":
        want = scorer.score(PROMPT + [{"role": "assistant", "content": "It shipped."}], tools=TOOLS)
        assert out == {"names": scorer.component_names, "weights": [scorer.weights_at()[n] for n in out["names"]],
                       "values": [want.components[n] for n in out["names"]]}
    elif framework == "verl":
        want = scorer.score(transcript_messages(SOLUTION), tools=TOOLS)
        assert out == {"score": want.score, **want.components}
    elif framework == "openrlhf":
        want = scorer.score(transcript_messages(QUERY), tools=TOOLS)
        assert out["rewards"] == pytest.approx([want.score], abs=1e-6)
        assert out["logs"] == {k: pytest.approx([v], abs=1e-6) for k, v in want.components.items()}
    else:
        assert out == {"task": True, "rewards": sorted([*scorer.component_names, "constant"]), "rows": ["a", "b"]}


def test_a_changed_template_copy_is_refused(tmp_path):
    result = write_export("tool_agent", "verl", tmp_path)
    copy = tmp_path / "tool_agent@0.yaml"
    copy.write_text(copy.read_text(encoding="utf-8").replace("weight: 0.3", "weight: 3.0"), encoding="utf-8")
    code = (f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
            "from core.base.errors import InputError\n"
            "try:\n    import rwb_reward_tool_agent_0\nexcept InputError as exc:\n    print('refused:', exc)\n"
            "else:\n    print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("refused:") and result.sha256 in done.stdout


def test_write_export_refuses_bad_input(tmp_path):
    with pytest.raises(InputError) as err:
        write_export("tool_agent", "deepspeed", tmp_path)
    assert err.value.field == "to"
    with pytest.raises(InputError) as err:
        write_export("no_such_template", "trl", tmp_path)
    assert err.value.field == "template"
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError) as err:
        write_export("tool_agent", "trl", tmp_path / "file")
    assert err.value.field == "out"


def test_export_imports_no_framework():
    code = ("import sys\nimport core.rewards.export\n"
            "print(sorted(m for m in ('trl', 'verifiers', 'transformers', 'datasets') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
    assert export.FRAMEWORKS == ("trl", "verifiers", "verl", "openrlhf")


@pytest.fixture
def rwb(tmp_path, monkeypatch, capsys):
    """``rwb ARGS`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_cli_export(rwb, tmp_path):
    code, out, err = rwb("reward", "export", "--template", "tool_agent@0", "--to", "verl", "--out", "dist", "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["template"] == "tool_agent@0" and body["entry_point"] == "rwb_reward_tool_agent_0:compute_score"
    assert all(Path(f).is_file() for f in body["files"])
    code, out, err = rwb("reward", "export", "-t", "tool_agent", "--to", "trl", "--out", "dist2")
    assert code == 0 and "entry point rwb_reward_tool_agent_0:reward" in out and "GRPOTrainer" in out


@pytest.mark.parametrize("args, field", [
    (("--to", "deepspeed"), "to"),
    (("--to", "trl", "-t", "tool_agent@4"), "template"),
])
def test_cli_export_usage_errors_exit_2_without_a_traceback(rwb, args, field):
    full = ["reward", "export", "--out", "dist", *args]
    if "-t" not in args:
        full += ["--template", "tool_agent"]
    code, out, err = rwb(*full)
    assert code == 2
    assert "Traceback" not in out + err and field in err
    code, out, err = rwb(*full, "--json")
    assert code == 2 and json.loads(err)["error"]["field"] == field
