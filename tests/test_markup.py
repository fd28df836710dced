"""Tool-call markups in decoded text (core/rewards/markup.py): each markup, several calls, JSON-string
arguments, broken calls as INVALID calls with their reason (never a crash), the bounds, transcripts in
each chat template, a property round trip per markup, and a fuzz run that must never raise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.base.errors import InputError
from core.rewards.markup import (INVALID_TOOL_CALL, MARKUPS, MAX_CALL_DEPTH, MAX_CALLS, MAX_TEXT_CHARS,
                                 completion_messages, detect_markup, detect_template, parse_tool_calls,
                                 transcript_messages)


def calls_of(text: str, markup: str = "auto") -> list[tuple[str, object]]:
    return [(c.name, c.arguments) for c in parse_tool_calls(text, markup).calls]


def errors_of(text: str, markup: str = "auto") -> list[str | None]:
    return [c.error for c in parse_tool_calls(text, markup).calls]


# --------------------------------------------------------------------------- Hermes / Qwen
def test_hermes_several_calls_content_and_string_arguments():
    text = ('Let me check.\n<tool_call>\n{"name": "get_order", "arguments": {"id": 7}}\n</tool_call>\n'
            '<tool_call>\n{"name": "refund", "arguments": "{\\"id\\": 7, \\"amount\\": 2.5}"}\n</tool_call><|im_end|>')
    parsed = parse_tool_calls(text)
    assert parsed.markup == "hermes"
    assert parsed.content == "Let me check."
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("get_order", {"id": 7}, None), ("refund", {"id": 7, "amount": 2.5}, None)]
    assert parsed.calls[0].raw.startswith("<tool_call>") and parsed.calls[0].raw.endswith("</tool_call>")


def test_hermes_final_tag_cut_by_a_stop_string_still_counts():
    assert calls_of('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n') == [("f", {"a": 1})]


def test_hermes_call_without_arguments_and_a_list_in_one_tag():
    assert calls_of('<tool_call>{"name": "now"}</tool_call>') == [("now", {})]
    assert calls_of('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
                    '</tool_call>') == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize("body, reason", [
    ('{"name": "f", "arguments": {"a": 1,}}', "invalid JSON: Expecting property name"),
    ('{"arguments": {"a": 1}}', 'has no "name"'),
    ('{"name": 3, "arguments": {}}', '"name" that is not a tool name (a number)'),
    ('{"name": "f", "arguments": [1, 2]}', "arguments of f must be a JSON object, got a list"),
    ('{"name": "f", "arguments": "{not json"}', "arguments of f: invalid JSON"),
    ('{"name": "f", "arguments": "[1]"}', "arguments of f must be a JSON object, got a list"),
    ('"just a string"', "a tool call must be a JSON object, got a string"),
    ("", "invalid JSON: Expecting value"),
    ("{'name': 'f'}", "invalid JSON"),
    ('{"name": "f", "arguments": {"x": NaN}}', "non-finite number NaN"),
])
def test_hermes_broken_calls_are_errors_with_the_reason(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>").calls
    assert call.error is not None and reason in call.error, call.error
    assert call.raw == f"<tool_call>{body}</tool_call>"


def test_hermes_unclosed_tag_with_broken_json_says_both():
    (error,) = errors_of('<tool_call>{"name": "f", "arguments": {"a": 1}')
    assert error.startswith("unclosed <tool_call> tag; ") and "invalid JSON" in error


def test_hermes_unclosed_tag_before_the_next_call():
    text = '<tool_call>{"name": "a", "arguments": {<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["", "b"]
    assert parsed.calls[0].error.startswith("unclosed <tool_call> tag")


def test_a_broken_call_does_not_spoil_its_neighbours():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "c", "arguments": {"k": "v"}}</tool_call>')
    assert [(c.name, c.error is None) for c in parse_tool_calls(text).calls] == [("a", True), ("", False),
                                                                                   ("c", True)]


# --------------------------------------------------------------------------- Llama 3.x
def test_llama3_python_tag_and_semicolon_separated_calls():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"type": "function", "name": "get_time", "parameters": {"tz": "CET"}}<|eom_id|>')
    parsed = parse_tool_calls(text)
    assert parsed.markup == "llama3" and parsed.content == ""
    assert calls_of(text) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_llama3_bare_json_call_a_list_and_string_parameters():
    assert calls_of('{"name": "f", "parameters": {"a": "x;y"}}<|eot_id|>') == [("f", {"a": "x;y"})]
    assert calls_of('[{"name": "f", "parameters": {}}, {"name": "g", "parameters": "{\\"b\\": 2}"}]') == [
        ("f", {}), ("g", {"b": 2})]
    assert calls_of('{"function": {"name": "f", "arguments": {"a": 1}}}') == [("f", {"a": 1})]


def test_llama3_builtin_tools_and_code_interpreter():
    assert calls_of('<|python_tag|>brave_search.call(query="weather today", n=3)<|eom_id|>') == [
        ("brave_search", {"query": "weather today", "n": 3})]
    assert calls_of("<|python_tag|>import math\nprint(math.pi)") == [
        ("code_interpreter", {"code": "import math\nprint(math.pi)"})]
    (error,) = errors_of("<|python_tag|>brave_search.call(query=os.environ)")
    assert error.startswith("arguments of brave_search: not literal keyword arguments")
    (error,) = errors_of("<|python_tag|>brave_search.call(1e999)")
    assert "not literal keyword arguments" in error


def test_llama3_text_after_the_calls_is_content_and_json_answers_are_not_calls():
    parsed = parse_tool_calls('{"name": "f", "parameters": {}} and some words')
    assert calls_of('{"name": "f", "parameters": {}} and some words') == [("f", {})]
    assert parsed.content == "and some words"
    for answer in ('{"answer": 42}', '{"type": "object", "properties": {}}', "The answer is 42."):
        assert parse_tool_calls(answer).calls == [] and parse_tool_calls(answer).markup is None


def test_llama3_unclosed_and_nameless_calls():
    (error,) = errors_of('<|python_tag|>{"name": "f", "parameters": {"a": 1}')
    assert error == "unclosed JSON tool call: the text ends inside it"
    (error,) = errors_of('{"parameters": {}}', "llama3")
    assert 'has no "name"' in error


# --------------------------------------------------------------------------- Mistral
def test_mistral_json_list_form():
    text = ('Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}, '
            '{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}]</s>')
    parsed = parse_tool_calls(text)
    assert parsed.markup == "mistral" and parsed.content == "Sure."
    assert calls_of(text) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]


def test_mistral_named_forms():
    text = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]lookup[CALL_ID]abc123XYZ[ARGS]{"q": 1}'
            '[TOOL_CALLS]ping{}')
    assert calls_of(text) == [("get_weather", {"city": "Paris"}), ("lookup", {"q": 1}), ("ping", {})]


@pytest.mark.parametrize("text, reason", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', "arguments of get_weather: unclosed JSON object"),
    ("[TOOL_CALLS]get_weather[ARGS]city=Paris", "arguments of get_weather: no JSON object after the name"),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}', "unclosed JSON list after [TOOL_CALLS]"),
    ("[TOOL_CALLS]", "[TOOL_CALLS] is not followed by a tool name or a JSON list"),
    ('[TOOL_CALLS][]', "an empty list of tool calls"),
    ('[TOOL_CALLS]f[ARGS]{"a": tru}', "arguments of f: invalid JSON"),
])
def test_mistral_broken_calls(text, reason):
    (error,) = errors_of(text)
    assert reason in error, error


# --------------------------------------------------------------------------- auto, markup choice, bounds
def test_auto_detection():
    assert detect_markup('x <tool_call>{"name": "f"}</tool_call>') == "hermes"
    assert detect_markup('[TOOL_CALLS][{"name": "f"}]') == "mistral"
    assert detect_markup('<|python_tag|>{"name": "f"}') == "llama3"
    assert detect_markup('  {"name": "f", "parameters": {}}') == "llama3"
    assert detect_markup("Just an answer.") is None
    plain = parse_tool_calls("  Just an answer.<|im_end|>")
    assert (plain.content, plain.calls, plain.markup) == ("Just an answer.", [], None)


def test_an_explicit_markup_reads_only_its_own_markup():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert calls_of(text, "hermes") == [("f", {})]
    for other in ("llama3", "mistral"):
        parsed = parse_tool_calls(text, other)
        assert parsed.calls == [] and parsed.content == text and parsed.markup == other


def test_bad_arguments_to_the_parser_name_the_field():
    with pytest.raises(InputError) as err:
        parse_tool_calls("x", "chatgpt")
    assert err.value.field == "markup" and set(MARKUPS) < set(err.value.allowed)
    with pytest.raises(InputError) as err:
        completion_messages(b"bytes")
    assert err.value.field == "text"


def test_huge_text_is_refused_before_any_parsing():
    limit_text = "<tool_call>" + "x" * (MAX_TEXT_CHARS - len("<tool_call>"))
    (call,) = parse_tool_calls(limit_text).calls  # at the limit: read (one broken call)
    assert call.error is not None
    for parse in (parse_tool_calls, completion_messages, transcript_messages):
        with pytest.raises(InputError) as err:
            parse(limit_text + "x")
        assert err.value.field == "text" and "more than the 1,000,000 allowed" in str(err.value)


@pytest.mark.parametrize("text", [
    "<tool_call>{\"name\": \"f\", \"arguments\": " + "[" * 100_000 + "]" * 100_000 + "}</tool_call>",
    "{\"name\": \"f\", \"parameters\": " + "{\"a\": " * 50_000 + "1" + "}" * 50_000 + "}",
    "[TOOL_CALLS]f[ARGS]" + "{\"a\": " * 50_000 + "1" + "}" * 50_000,
    "[TOOL_CALLS][" + "[" * 200_000 + "]" * 200_000 + "]",
    "<tool_call>{\"name\": \"f\", \"arguments\": \"" + "[" * 100_000 + "]" * 100_000 + "\"}</tool_call>",
    "<|python_tag|>f.call(a=" + "[" * 100_000 + "]" * 100_000 + ")",
    "[TOOL_CALLS]" + "[" * 500_000,
])
def test_deep_nesting_is_an_error_of_that_call_not_a_crash(text):
    (call,) = parse_tool_calls(text).calls
    assert call.error is not None
    assert "nested deeper than" in call.error or "unclosed" in call.error or "nested parentheses" in call.error


def test_nesting_within_the_limit_parses():
    inner = "{\"a\": " * (MAX_CALL_DEPTH - 1) + "1" + "}" * (MAX_CALL_DEPTH - 1)  # the call object is level 1
    (call,) = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {inner}}}</tool_call>').calls
    assert call.error is None
    (call,) = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {{"b": {inner}}}}}</tool_call>').calls
    assert call.error.startswith("<tool_call>: nested deeper than 32 levels at call.arguments.b.a")


@pytest.mark.parametrize("markup, one", [
    ("hermes", '<tool_call>{{"name": "t{i}", "arguments": {{}}}}</tool_call>'),
    ("llama3", '{{"name": "t{i}", "parameters": {{}}}};'),
    ("mistral", '[TOOL_CALLS]t{i}[ARGS]{{}}'),
])
def test_calls_past_the_limit_become_one_invalid_call(markup, one):
    text = "".join(one.format(i=i) for i in range(MAX_CALLS + 6))
    calls = parse_tool_calls(text).calls
    assert len(calls) == MAX_CALLS + 1
    assert [c.name for c in calls[:MAX_CALLS]] == [f"t{i}" for i in range(MAX_CALLS)]
    assert all(c.error is None for c in calls[:MAX_CALLS])
    assert calls[-1].error == (f"more than {MAX_CALLS} tool calls in one message: the calls after the "
                               f"{MAX_CALLS}th were not read")
    assert "t64" in calls[-1].raw and "t69" in calls[-1].raw


def test_a_mistral_list_past_the_limit():
    text = "[TOOL_CALLS]" + json.dumps([{"name": f"t{i}", "arguments": {}} for i in range(100)])
    calls = parse_tool_calls(text).calls
    assert len(calls) == MAX_CALLS + 1 and calls[-1].error.startswith("more than 64 tool calls")


# --------------------------------------------------------------------------- completion messages
def test_completion_messages_shape():
    (message,) = completion_messages('Hi<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                                     '<tool_call>{"name": "g", "arguments": {"a": 1,]}</tool_call>')
    assert message["role"] == "assistant" and message["content"] == "Hi"
    good, bad = message["tool_calls"]
    assert good == {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    assert bad["id"] == "call_1" and bad["function"]["name"] == INVALID_TOOL_CALL
    assert bad["function"]["arguments"]["raw"] == '<tool_call>{"name": "g", "arguments": {"a": 1,]}</tool_call>'
    assert bad["function"]["arguments"]["error"].startswith("<tool_call>: invalid JSON")
    assert completion_messages("Plain answer.") == [{"role": "assistant", "content": "Plain answer."}]
    json.dumps(message, allow_nan=False)  # the messages are JSON


def test_the_raw_text_of_an_invalid_call_is_bounded():
    (message,) = completion_messages("<tool_call>{" + "x" * 50_000 + "</tool_call>")
    raw = message["tool_calls"][0]["function"]["arguments"]["raw"]
    assert len(raw) == 2_001 and raw.endswith("…")


# --------------------------------------------------------------------------- transcripts
QWEN = """<|im_start|>system
You are a support agent. Call tools like this:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Where is order 7?<|im_end|>
<|im_start|>assistant
Let me look.
<tool_call>
{"name": "get_order", "arguments": {"id": 7}}
</tool_call>
<tool_call>
{"name": "get_user", "arguments": "{\\"id\\": 1}"}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"status": "shipped"}
</tool_response>
<tool_response>
{"name": "Ann"}
</tool_response><|im_end|>
<|im_start|>assistant
It shipped, Ann.<|im_end|>
"""


def test_chatml_transcript():
    messages = transcript_messages(QWEN)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert "tool_calls" not in messages[0]  # the system prompt's example is not a call
    assert messages[2]["content"] == "Let me look."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in messages[2]["tool_calls"]] == [
        ("call_0", "get_order", {"id": 7}), ("call_1", "get_user", {"id": 1})]
    assert messages[3] == {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_0",
                           "name": "get_order"}
    assert (messages[4]["tool_call_id"], messages[4]["name"]) == ("call_1", "get_user")
    assert messages[5] == {"role": "assistant", "content": "It shipped, Ann."}


def test_verl_response_without_its_prompt_and_a_tool_role():
    response = ('<tool_call>\n{"name": "get_order", "arguments": {"id": 7}}\n</tool_call><|im_end|>\n'
                "<|im_start|>tool\n<tool_response>\nshipped\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n<tool_call>\n{broken}\n</tool_call><|im_end|>\n"
                "<|im_start|>user\n<tool_response>\nError: bad call\n</tool_response>\nAnd my refund?<|im_end|>\n"
                "<|im_start|>assistant\nIt shipped")
    messages = transcript_messages(response)
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "user", "assistant"]
    assert messages[1] == {"role": "tool", "content": "shipped", "tool_call_id": "call_0", "name": "get_order"}
    bad = messages[2]["tool_calls"][0]
    assert bad["id"] == "call_1" and bad["function"]["name"] == INVALID_TOOL_CALL
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("call_1", "Error: bad call")
    assert messages[4] == {"role": "user", "content": "And my refund?"}
    assert messages[5] == {"role": "assistant", "content": "It shipped"}


LLAMA = """<|begin_of_text|><|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|><|start_header_id|>user<|end_header_id|>

Weather in Paris and Rome?<|eot_id|><|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}<|eom_id|><|start_header_id|>ipython<|end_header_id|>

{"temp": 21}<|eot_id|><|start_header_id|>ipython<|end_header_id|>

{"temp": 25}<|eot_id|><|start_header_id|>assistant<|end_header_id|>

21 and 25 degrees.<|eot_id|>"""


def test_llama3_transcript():
    messages = transcript_messages(LLAMA)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"]["city"] for c in messages[2]["tool_calls"]] == ["Paris", "Rome"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:5]] == [("call_0", '{"temp": 21}'),
                                                                          ("call_1", '{"temp": 25}')]
    assert messages[5]["content"] == "21 and 25 degrees."


def test_mistral_transcripts_both_generations():
    v3 = ('<s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"}}][/AVAILABLE_TOOLS]'
          '[INST]Weather in Paris?[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
          '"id": "abcdefghi"}]</s>[TOOL_RESULTS]{"content": {"temp": 21}, "call_id": "abcdefghi"}[/TOOL_RESULTS]'
          "21 degrees.</s>[INST]Thanks[/INST]")
    messages = transcript_messages(v3)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_0",
                           "name": "get_weather"}
    v11 = ("<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Weather?[/INST]"
           '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]Sunny.</s>')
    messages = transcript_messages(v11)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3]["content"] == "sunny" and messages[3]["tool_call_id"] == "call_0"
    response_only = '[TOOL_CALLS]f[ARGS]{}</s>[TOOL_RESULTS]ok[/TOOL_RESULTS]Done.'
    assert [m["role"] for m in transcript_messages(response_only)] == ["assistant", "tool", "assistant"]


def test_templates_are_detected_and_plain_text_is_one_message():
    assert detect_template(QWEN) == "chatml" and detect_template(LLAMA) == "llama3"
    assert detect_template("[INST]hi[/INST]hello</s>") == "mistral"
    assert detect_template("hello</s>") is None
    assert transcript_messages('Sure.<tool_call>{"name": "f"}</tool_call>') == completion_messages(
        'Sure.<tool_call>{"name": "f"}</tool_call>')


def test_a_tool_result_without_a_call_has_no_call_id():
    messages = transcript_messages("<|im_start|>user\n<tool_response>\nstray\n</tool_response><|im_end|>")
    assert messages == [{"role": "tool", "content": "stray"}]


def test_call_ids_run_across_the_transcript():
    turn = '<|im_start|>assistant\n<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>\n'
    result = "<|im_start|>user\n<tool_response>ok</tool_response><|im_end|>\n"
    messages = transcript_messages((turn + result) * 3)
    assert [m["tool_calls"][0]["id"] for m in messages if m["role"] == "assistant"] == ["call_0", "call_1", "call_2"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_0", "call_1", "call_2"]


# --------------------------------------------------------------------------- properties
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
CALLS = st.lists(st.tuples(NAMES, st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)),
                 min_size=1, max_size=5)


def render(markup: str, calls: list[tuple[str, dict]], as_string: bool) -> str:
    def args(a: dict) -> object:
        return json.dumps(a) if as_string else a
    if markup == "hermes":
        return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': args(a)})}\n</tool_call>\n"
                       for n, a in calls)
    if markup == "llama3":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": args(a)}) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": args(a)} for n, a in calls])


@pytest.mark.parametrize("markup", MARKUPS)
@settings(max_examples=60, deadline=None)
@given(calls=CALLS, as_string=st.booleans())
def test_rendered_calls_parse_back(markup, calls, as_string):
    parsed = parse_tool_calls(render(markup, calls, as_string))
    assert parsed.markup == markup
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [(n, a, None) for n, a in calls]


@settings(max_examples=60, deadline=None)
@given(calls=CALLS)
def test_mistral_named_form_parses_back(calls):
    text = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    assert calls_of(text) == calls


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
                          "{", "}", "[", "]", '"', "\\", ":", ",", ";", '"name"', '"arguments"', '"parameters"',
                          "<|im_start|>", "<|im_end|>", "assistant\n", "user\n", "<tool_response>",
                          "</tool_response>", "<|start_header_id|>", "<|end_header_id|>", "ipython", "[INST]",
                          "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>", ".call(", ")", "=", "1", "x"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES | st.text(max_size=5), max_size=40), markup=st.sampled_from(("auto", *MARKUPS)))
def test_no_text_makes_the_parsers_raise(pieces, markup):
    text = "".join(pieces)
    parsed = parse_tool_calls(text, markup)
    assert all(c.error is None or c.error for c in parsed.calls)
    for messages in (completion_messages(text, markup), transcript_messages(text, markup)):
        json.dumps(messages, allow_nan=False)
        for m in messages:
            assert m["role"] in ("system", "user", "assistant", "tool")
            for call in m.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], dict) and call["function"]["name"]


# --------------------------------------------------------------------------- into the scorer
ORDER_TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look an order up.",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}]
ONE_EPISODE = [
    {"role": "user", "content": "Where is order 7?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_order", "arguments": {"id": 7}}}]},
    {"role": "tool", "content": "shipped", "tool_call_id": "call_0", "name": "get_order"},
    {"role": "assistant", "content": "It shipped."},
]
ONE_EPISODE_AS_TEXT = {
    "chatml": ('<|im_start|>user\nWhere is order 7?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
               '{"name": "get_order", "arguments": {"id": 7}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
               "<tool_response>\nshipped\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt shipped.<|im_end|>\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhere is order 7?<|eot_id|>"
               '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_order", "parameters": {"id": 7}}'
               "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nshipped<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nIt shipped.<|eot_id|>"),
    "mistral": ('<s>[INST]Where is order 7?[/INST][TOOL_CALLS][{"name": "get_order", "arguments": {"id": 7}}]</s>'
                '[TOOL_RESULTS]{"content": "shipped", "call_id": "abcdefghi"}[/TOOL_RESULTS]It shipped.</s>'),
}


@pytest.mark.parametrize("template", sorted(ONE_EPISODE_AS_TEXT))
def test_one_episode_in_each_template_reads_as_the_same_messages(template):
    assert transcript_messages(ONE_EPISODE_AS_TEXT[template]) == ONE_EPISODE


def test_transcripts_score_as_their_messages():
    from core.rewards.trajectory import score_trajectories, score_trajectory

    expected = score_trajectory(ONE_EPISODE, tools=ORDER_TOOLS)
    scores = score_trajectories([{"messages": transcript_messages(text), "tools": ORDER_TOOLS}
                                 for text in ONE_EPISODE_AS_TEXT.values()])
    assert [s.to_dict() for s in scores] == [expected.to_dict()] * len(ONE_EPISODE_AS_TEXT)
    assert expected.steps[0].valid and expected.steps[0].tool == "get_order"


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "get_order", "arguments": {"id": 7,}}</tool_call>', "<tool_call>: invalid JSON"),
    ('<tool_call>{"arguments": {"id": 7}}</tool_call>', 'the tool call has no "name"'),
    ('[TOOL_CALLS]get_order[ARGS]{"id": 7', "arguments of get_order: unclosed JSON object"),
    ('{"name": "get_order", "parameters": ' + "[" * 40 + "]" * 40 + "}", "nested deeper than 32 levels"),
])
def test_an_unreadable_call_is_scored_invalid_with_the_parse_error(text, error):
    from core.rewards.trajectory import score_trajectory

    messages = [{"role": "user", "content": "Where is order 7?"}, *completion_messages(text)]
    score = score_trajectory(messages, tools=ORDER_TOOLS)
    (step,) = score.steps
    assert (step.kind, step.tool, step.valid) == ("tool_call", INVALID_TOOL_CALL, False)
    assert step.invalid_reason.startswith("unreadable tool call: ") and error in step.invalid_reason
    assert score.components["tool_validity"] == 0.0
    valid = score_trajectory([messages[0], *completion_messages('<tool_call>{"name": "get_order", '
                                                                '"arguments": {"id": 7}}</tool_call>')],
                             tools=ORDER_TOOLS)
    assert valid.components["tool_validity"] > 0 and valid.score > score.score
