"""The exported reward as a verifiers 0.4 ``vf.Task``, scored through verifiers' own entry point
(``await task.score(trace)``): ``trace.rewards`` hold each component with its template weight and
``trace.reward`` is the scorer's score (docs/export.md)."""

from __future__ import annotations

import asyncio
import json

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the rl extra (verifiers) is not installed")

from core.rewards.export import CONSTANT_REWARD, trace_messages, verifiers_task, verifiers_taskset  # noqa: E402
from core.rewards.trajectory import TrajectoryScorer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order by its id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]
TASK = {"expected_calls": [{"name": "get_order", "arguments": {"order_id": 7}}], "communicate": ["shipped"]}


def _trace(task, messages, tools=()):
    """A finished verifiers trace of ``messages`` (assistant turns sampled, the rest prompt)."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    nodes = [MessageNode(parent=None if i == 0 else i - 1, message=m, sampled=m.role == "assistant",
                         tools=list(tools) if i == 0 else [])
             for i, m in enumerate(messages)]
    return Trace(task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                 nodes=nodes)


def _conversation(reply: str = "Your order 7 shipped yesterday.", tool: str = "get_order"):
    return [vf.UserMessage(content="Where is my order 7?"),
            vf.AssistantMessage(content="Let me look.",
                                tool_calls=[vf.ToolCall(id="c1", name=tool, arguments=json.dumps({"order_id": 7}))]),
            vf.ToolMessage(tool_call_id="c1", name=tool, content='{"status": "shipped", "when": "yesterday"}'),
            vf.AssistantMessage(content=reply)]


def _openai(reply: str = "Your order 7 shipped yesterday.", tool: str = "get_order"):
    return [{"role": "user", "content": "Where is my order 7?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": tool, "arguments": '{"order_id": 7}'}}]},
            {"role": "tool", "tool_call_id": "c1", "name": tool,
             "content": '{"status": "shipped", "when": "yesterday"}'},
            {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("template", ["tool_agent", "tool_agent_criteria"])
@pytest.mark.parametrize("with_task", [True, False])
def test_task_score_fills_trace_rewards_as_the_scorer_scores(template, with_task):
    row = {"prompt": "Where is my order 7?", "tools": TOOLS, **({"task": TASK} if with_task else {})}
    task = verifiers_task(template, row=row)
    assert isinstance(task, vf.Task)
    trace = _trace(task, _conversation())
    asyncio.run(task.score(trace))

    expected = TrajectoryScorer(template).score(_openai(), tools=TOOLS, task=TASK if with_task else None)
    for name, value in expected.components.items():
        if value is None:   # does not apply: left out, its neutral part is in the constant reward
            assert name not in trace.rewards
        else:
            assert trace.rewards[name].score == pytest.approx(value, abs=1e-12)
            assert trace.rewards[name].weight == expected.weights[name]
    assert trace.rewards[CONSTANT_REWARD].score == pytest.approx(expected.constant)
    assert trace.reward == pytest.approx(expected.score, abs=1e-9)


def test_criteria_components_do_not_apply_without_criteria():
    task = verifiers_task("tool_agent_criteria", row={"tools": TOOLS})
    trace = _trace(task, _conversation())
    asyncio.run(task.score(trace))
    expected = TrajectoryScorer("tool_agent_criteria").score(_openai(), tools=TOOLS)
    missing = {n for n, v in expected.components.items() if v is None}
    assert missing and not (missing & set(trace.rewards))


def test_the_traces_tools_are_used_when_the_row_has_none():
    task = verifiers_task("tool_agent")
    tool = vf.Tool(name="get_order", description="Look up an order by its id.",
                   parameters=TOOLS[0]["function"]["parameters"])
    trace = _trace(task, _conversation(), tools=[tool])
    asyncio.run(task.score(trace))
    expected = TrajectoryScorer("tool_agent").score(_openai(), tools=TOOLS)
    assert trace.reward == pytest.approx(expected.score, abs=1e-9)
    # an unknown tool is judged against that catalog too
    bad = _trace(task, _conversation(tool="cancel_order"), tools=[tool])
    asyncio.run(task.score(bad))
    worse = TrajectoryScorer("tool_agent").score(_openai(tool="cancel_order"), tools=TOOLS)
    assert bad.reward == pytest.approx(worse.score, abs=1e-9)
    assert bad.rewards["tool_validity"].score < trace.rewards["tool_validity"].score


def test_trace_messages_are_openai_messages():
    task = verifiers_task("tool_agent")
    msgs = trace_messages(_trace(task, _conversation()))
    assert msgs == _openai()


def test_taskset_yields_one_task_per_row():
    taskset = verifiers_taskset("tool_agent", [{"prompt": "a", "tools": TOOLS}, {"prompt": "b", "task": TASK}])
    tasks = list(taskset)
    assert [t.data.prompt for t in tasks] == ["a", "b"]
    assert tasks[0].data.tools == TOOLS and tasks[1].data.criteria == TASK


def test_a_bad_row_names_its_field():
    from core.base.errors import InputError

    with pytest.raises(InputError) as err:
        verifiers_task("tool_agent", row={"task": "{not json"})
    assert err.value.field == "row.task"
    with pytest.raises(InputError) as err:
        verifiers_task("tool_agent", row={"answer": 3})
    assert err.value.field == "row.answer"


def test_no_legacy_rubric_in_this_verifiers():
    """verifiers 0.4 installs only ``verifiers.v1``: there is no ``verifiers.legacy`` Rubric to
    export to (docs/export.md says so)."""
    import importlib.util

    assert importlib.util.find_spec("verifiers.legacy") is None
