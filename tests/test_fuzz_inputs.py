"""Attacks on what users hand in: reward templates (YAML) and episode files (JSON).

Hypothesis generates templates (deep nesting, aliases and anchors, huge numbers, huge
strings, odd keys) and episode files (deep nesting, huge strings, odd file and dataset
names).  Every case either parses or raises :class:`InputError` (``TemplateError`` is one)
— never another exception, never a hang, never a half-written import.  The number of
cases run is printed in the terminal summary (tests/conftest.py).

Beside the generated cases, the known attacks of issue 17 by name: the 459-byte alias
bomb (work and memory), 300-level JSON, a 400-digit weight, a 10 MB text in fields that
used to take it, and 300-byte and NUL upload names."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.base import safe_yaml
from core.cli import main
from core.data.episode_views import import_upload
from core.records.episodes import MAX_TEXT_CHARS
from core.base.errors import InputError
from core.data.importers import import_file
from core.data.importers.base import MAX_JSON_DEPTH, MAX_RECORD_BYTES
from core.rewards.template import Template, TemplateError, parse_template
from core.rewards.views import apply_yaml
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])

#: The smallest valid template; the generated ones are variations of it.
SMALL_TEMPLATE = """\
version: 1
name: fuzz
levels:
  L1:
    components:
      tool_validity: {weight: 0.3}
"""

#: The 459-byte alias bomb of issue 17: nine levels of nine aliases (9^9 strings).
ALIAS_BOMB = "version: 1\nname: bomb\n" + 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{b}: &{b} [{','.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def _depth(value: Any) -> int:
    """Nesting of lists and mappings (the slow, obvious reference)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _nested(depth: int, leaf: Any, as_list: bool) -> Any:
    for _ in range(depth):
        leaf = [leaf] if as_list else {"k": leaf}
    return leaf


# --------------------------------------------------------------------------- templates
_ODD_KEYS = st.sampled_from(["", "<<", "~", "null", "1e5", "? x", "a: b", "- x", "#", "é", "\u2028",
                             "x" * 300, "weight", "levels", "L1", "version", "*a", "&a", "!!python/object"])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                     st.text(max_size=30), st.sampled_from([10 ** 70, -(10 ** 400), 2 ** 64]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(_ODD_KEYS, st.text(max_size=10)), inner, max_size=4)),
    max_leaves=25)
_NUMBER_TEXT = st.one_of(
    st.integers(1, 500).map(lambda n: "9" * n),
    st.integers(1, 500).map(lambda n: "1." + "0" * n + "1"),
    st.integers(1, 500).map(lambda n: "1e" + "9" * min(n, 40)),
    st.integers(1, 200).map(lambda n: "0x" + "f" * n),
    st.integers(1, 40).map(lambda n: ":".join(["59"] * n)),   # YAML 1.1 base 60
    st.sampled_from([".nan", "-.inf", ".inf", "1_000", "0b101", "0o17", "-0", "1e400", "!!float 1e400",
                     "!!int 99999999999999999999999999", "!!float abc", "!!binary zz", "2001-13-45"]))
_PLACES = [("levels", "L1", "components", "tool_validity", "weight"),
           ("levels", "L1", "components", "tool_validity", "params"),
           ("levels", "L1", "gate"), ("levels", "L1"), ("return", "gamma"), ("description",),
           ("name",), ("version",), ("gating",), ("extra_key",), ("levels", "L1", "components")]


def _template_text(place: tuple, value_text: str) -> str:
    """SMALL_TEMPLATE with the YAML ``value_text`` (flow style) at ``place``."""
    data = yaml.safe_load(SMALL_TEMPLATE)
    marker = "__FUZZ__"
    cur = data
    for k in place[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    cur[place[-1]] = marker
    return yaml.safe_dump(data, sort_keys=False, width=10 ** 9).replace(repr(marker).replace("'", ""), value_text)


def _alias_text(levels: int, width: int) -> str:
    lines = ["a0: &a0 [lol]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return SMALL_TEMPLATE + "\n".join(lines) + "\n"


@st.composite
def template_texts(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["value", "number", "nesting", "alias", "string", "key", "raw"]))
    place = draw(st.sampled_from(_PLACES))
    if kind == "value":
        return _template_text(place, yaml.safe_dump(draw(_VALUES), default_flow_style=True, width=10 ** 9).strip()
                              .removesuffix("...").strip())
    if kind == "number":
        return _template_text(place, draw(_NUMBER_TEXT))
    if kind == "nesting":
        n = draw(st.integers(1, 3000))
        flow = draw(st.booleans())
        if flow:
            return _template_text(place, "[" * n + "1" + "]" * n)
        block = "".join(f"{' ' * i}k{i}:\n" for i in range(min(n, 400))) + " " * min(n, 400) + "v: 1\n"
        return SMALL_TEMPLATE + block
    if kind == "alias":
        return _alias_text(draw(st.integers(1, 12)), draw(st.integers(1, 12)))
    if kind == "string":
        size = draw(st.sampled_from([0, 10, safe_yaml.MAX_SCALAR_CHARS, safe_yaml.MAX_SCALAR_CHARS + 1,
                                     safe_yaml.MAX_BYTES + 1]))
        return _template_text(place, json.dumps("x" * size))
    if kind == "key":
        key = draw(_ODD_KEYS)
        return SMALL_TEMPLATE.replace("tool_validity", json.dumps(key), 1) if draw(st.booleans()) else \
            SMALL_TEMPLATE + f"{json.dumps(key)}: 1\n"
    return draw(st.text(alphabet=st.sampled_from(list("[]{}:,-&*!|>?'\"#%@` \n\tab01.e~<") + ["\x00", "\u2028"]),
                        max_size=200))


@pytest.mark.timeout(300)  # a case that hangs fails the test here
@settings(FUZZ, max_examples=300)
@given(text=template_texts())
def test_fuzzed_templates_parse_or_say_why(text: str, fuzz_counts: Counter[str]) -> None:
    fuzz_counts["template"] += 1
    try:
        template = parse_template(text, file="fuzz.yaml")
    except InputError as exc:  # TemplateError is one
        assert str(exc)
        fuzz_counts["template refused"] += 1
    else:
        assert isinstance(template, Template)
        assert all(isinstance(w, float) and w == w and abs(w) != float("inf")
                   for w in template.weights().values())


# --------------------------------------------------------------------------- episode files
_BASE_EPISODE = {"episode_id": "e1", "domain": "finance", "task": {"query": "analyse"},
                 "steps": [{"t": 0, "action": {"kind": "tool_call", "tool": "get_quote", "params": {"s": "A"}},
                            "tool_result": {"price": 1.5}},
                           {"t": 1, "action": {"kind": "final_answer"}, "output_text": "done"}],
                 "outcome": {"resolved": True, "final_reward": 1.0}}
_EPISODE_PLACES = [("steps", 0, "observation"), ("steps", 0, "tool_result"), ("steps", 0, "action", "params", "p"),
                   ("meta", "m"), ("outcome", "extra", "x"), ("task", "query"), ("task", "intents"),
                   ("domain",), ("behaviour",), ("episode_id",), ("steps", 1, "output_text"),
                   ("steps", 0, "tool_error"), ("steps", 0, "timestamp"), ("steps", 0, "action", "tool"),
                   ("steps", 0, "action", "raw_arguments"), ("task", "task_type")]
_FILE_NAMES = st.one_of(
    st.sampled_from(["ok.jsonl", "a b.jsonl", "é.jsonl", "../../escape.jsonl", "C:\\\\x\\\\y.jsonl", ".", "..",
                     "", "a\x00b.jsonl", "\x01.jsonl", "x" * 300 + ".jsonl", "é" * 128 + ".jsonl",
                     "x" * 249 + ".jsonl", "dir/sub/name.jsonl"]),
    st.text(min_size=1, max_size=40).map(lambda s: s + ".jsonl"))
_DATASETS = st.one_of(st.none(), st.sampled_from(["ds", "a/b", "..", ".", "x\\y", "n\x00l", "é" * 100, "x" * 201, " "]))


def _counts(ws: Workspace) -> tuple[int, int, int]:
    return tuple(ws.conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]  # type: ignore[return-value]
                 for t in ("episodes", "steps", "imports"))


@st.composite
def episode_files(draw: st.DrawFn) -> tuple[str, bytes, str | None, bool]:
    """(file name, bytes, dataset, must_refuse): must_refuse when the file breaks a bound."""
    record = json.loads(json.dumps(_BASE_EPISODE))
    place = draw(st.sampled_from(_EPISODE_PLACES))
    kind = draw(st.sampled_from(["nested", "huge", "value"]))
    if kind == "nested":
        value: Any = _nested(draw(st.one_of(st.integers(1, 60), st.integers(61, 400))), draw(st.sampled_from(["x", 1, None])), draw(st.booleans()))
    elif kind == "huge":
        value = "y" * draw(st.sampled_from([10, MAX_TEXT_CHARS, MAX_TEXT_CHARS + 1]))
    else:
        value = draw(_VALUES)
    cur = record
    for k in place[:-1]:
        cur = cur.setdefault(k, {}) if isinstance(cur, dict) else cur[k]
    cur[place[-1]] = value
    must_refuse = _depth(record) > MAX_JSON_DEPTH or (isinstance(value, str) and len(value) > MAX_TEXT_CHARS)
    lines = [json.dumps(record)]
    if draw(st.booleans()):
        lines.append(json.dumps(dict(_BASE_EPISODE, episode_id="e2")))
    # half the cases with plain names, so that the contents get through to the importer
    name = draw(st.one_of(st.just("ok.jsonl"), _FILE_NAMES))
    dataset = draw(st.one_of(st.none(), _DATASETS))
    return name, ("\n".join(lines) + "\n").encode(), dataset, must_refuse


@pytest.fixture(scope="module")
def fuzz_ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = Workspace.open(tmp_path_factory.mktemp("fuzz") / "ws")
    yield ws
    ws.close()


@pytest.mark.timeout(300)  # a case that hangs fails the test here
@settings(FUZZ, max_examples=150)
@given(case=episode_files())
def test_fuzzed_episode_files_import_whole_or_not_at_all(case: tuple[str, bytes, str | None, bool],
                                                         fuzz_ws: Workspace, fuzz_counts: Counter[str]) -> None:
    fuzz_counts["episode file"] += 1
    name, data, dataset, must_refuse = case
    ws = fuzz_ws
    before = _counts(ws)
    try:
        result = import_upload(ws, name, data, dataset=dataset)
    except InputError as exc:
        assert str(exc) and exc.file
        assert _counts(ws) == before, f"partial import after {exc}"
        fuzz_counts["episode file refused"] += 1
    else:
        assert not must_refuse, "a file over the bounds was imported"
        fuzz_counts["episode file imported"] += 1
        stored = ws.load_episodes(result.dataset)
        assert stored, result
        for ep in stored:  # what was imported reads back (rwb episodes show never fails)
            assert ws.get_episode(result.dataset, ep.episode_id) == ep
            assert _depth(json.loads(ep.to_json())) <= MAX_JSON_DEPTH + 8


# --------------------------------------------------------------------------- the known attacks, by name
def _composed_nodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the YAML nodes the bounded loader starts composing (one entry per node)."""
    composed: list[int] = []
    real = safe_yaml._BoundedLoader.compose_node

    def counted(self, parent, index):
        composed.append(1)
        return real(self, parent, index)

    monkeypatch.setattr(safe_yaml._BoundedLoader, "compose_node", counted)
    return composed


#: Nodes of the alias bomb before its first anchor: the root mapping, two key-value pairs
#: and the key ``a`` (the anchored list after it is refused before it is composed).
BOMB_NODES_BEFORE_THE_ANCHOR = 7


def test_alias_bomb_is_refused_at_its_first_anchor_and_small(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at the first anchor, nothing after it composed or expanded (the work is a
    handful of nodes, whatever the nine levels would grow to) and in little memory."""
    assert len(ALIAS_BOMB.encode()) < 460  # issue 17: a 459-byte bomb
    composed = _composed_nodes(monkeypatch)
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match=r"anchors \(&a\) are not allowed") as info:
            parse_template(ALIAS_BOMB, file="bomb.yaml")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.line == 3 and info.value.field == "a" and info.value.file == "bomb.yaml"
    assert len(composed) == BOMB_NODES_BEFORE_THE_ANCHOR
    assert peak < 200 * 2 ** 20, peak  # measured: well under 1 MB
    # the page's YAML box reaches the same loader, and stops at the same place
    composed.clear()
    with pytest.raises(TemplateError, match="anchors"):
        apply_yaml(ALIAS_BOMB, name="typed")
    assert len(composed) == BOMB_NODES_BEFORE_THE_ANCHOR


def test_alias_bomb_in_the_cli_exits_2_without_traceback(tmp_path: Path) -> None:
    """``rwb reward validate bomb.yaml`` in a fresh process: exit 2, one line, no traceback,
    nothing composed after the first anchor, and under 200 MB for the refusal itself
    (measured after a warm-up run on a good template, so that importing the reward modules
    is not counted)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB, encoding="utf-8")
    good = ROOT / "reward_templates" / "tool_agent.yaml"
    script = f"""
from core.base import safe_yaml
from core.cli import main

def kb(key):  # this process's memory (VmHWM: its peak since exec), in kB
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
    return 0

assert main(["reward", "validate", {str(good)!r}]) == 0
composed = []
real = safe_yaml._BoundedLoader.compose_node
safe_yaml._BoundedLoader.compose_node = lambda self, parent, index: composed.append(1) or real(self, parent, index)
before = kb("VmRSS:")
rc = main(["reward", "validate", {str(bomb)!r}])
print("RESULT", rc, len(composed), kb("VmHWM:") - before)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "anchors (&a) are not allowed" in proc.stderr
    rc, composed, grown_kb = proc.stdout.split("RESULT")[1].split()
    assert int(rc) == 2
    assert int(composed) == BOMB_NODES_BEFORE_THE_ANCHOR
    if Path("/proc/self/status").exists():
        assert int(grown_kb) < 200 * 1024, grown_kb


def test_recursive_and_deep_yaml_are_refused_with_line_and_key() -> None:
    with pytest.raises(TemplateError, match="anchors"):
        parse_template(SMALL_TEMPLATE + "loop: &x [*x]\n")
    deep = SMALL_TEMPLATE.replace("{weight: 0.3}", "{weight: 0.3, params: {p: " + "[" * 5000 + "]" * 5000 + "}}")
    with pytest.raises(TemplateError, match=f"nested deeper than {safe_yaml.MAX_DEPTH} levels") as info:
        parse_template(deep, file="deep.yaml")
    assert info.value.line == 6 and info.value.field.startswith("levels.L1.components.tool_validity.params.p[0]")


def test_a_400_digit_weight_is_refused_with_line_and_key() -> None:
    text = SMALL_TEMPLATE.replace("0.3", "1" + "0" * 399)
    with pytest.raises(TemplateError, match="a number of 400 characters is longer than 64") as info:
        parse_template(text, file="w.yaml")
    assert (info.value.file, info.value.line) == ("w.yaml", 6)
    assert info.value.field == "levels.L1.components.tool_validity.weight"
    # a 64-digit weight is short enough to read, and then refused by the template number rule
    with pytest.raises(TemplateError, match="an integer of 64 digits; every number in a template"):
        parse_template(SMALL_TEMPLATE.replace("0.3", "1" * 64))


def test_safe_yaml_reads_what_safe_load_reads_within_bounds() -> None:
    """Known answers: the bounded loader and ``yaml.safe_load`` agree on plain documents."""
    for path in sorted((ROOT / "reward_templates").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        assert safe_yaml.safe_load(text) == yaml.safe_load(text), path
    assert safe_yaml.safe_load("a: [1, {b: c}]\n'x': 2") == {"a": [1, {"b": "c"}], "x": 2}
    assert safe_yaml.safe_load("") is None
    with pytest.raises(InputError, match="longer than"):
        safe_yaml.load("a: " + "1" * (safe_yaml.MAX_BYTES + 1))
    with pytest.raises(InputError, match="a key must be plain text"):
        safe_yaml.load("? [1]\n: 2")


def _rwb_file(path: Path, record: dict[str, Any]) -> Path:
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


def test_json_nested_300_levels_is_refused_naming_file_line_and_path(tmp_path: Path) -> None:
    ws = Workspace.open(tmp_path / "ws")
    try:
        good = _rwb_file(tmp_path / "good.jsonl", dict(_BASE_EPISODE, episode_id="g"))
        import_file(ws, good, dataset="d")
        before = _counts(ws)
        deep = dict(_BASE_EPISODE, meta={"m": _nested(300, "x", as_list=True)})
        path = tmp_path / "deep.jsonl"
        path.write_text(json.dumps(dict(_BASE_EPISODE, episode_id="ok")) + "\n" + json.dumps(deep) + "\n",
                        encoding="utf-8")
        with pytest.raises(InputError, match=f"nested deeper than {MAX_JSON_DEPTH} levels") as info:
            import_file(ws, path, dataset="d")
        assert (info.value.file, info.value.line, info.value.record) == (str(path), 2, 1)
        assert info.value.field.startswith("meta.m[0][0]")
        assert _counts(ws) == before  # nothing half-written: the good first line is not kept either
        # the same as one JSON list: the record index and the path
        path = tmp_path / "deep.json"
        path.write_text(json.dumps([dict(_BASE_EPISODE, episode_id="ok"), deep]), encoding="utf-8")
        with pytest.raises(InputError, match="nested deeper") as info:
            import_file(ws, path, format="rwb", dataset="d")
        assert info.value.record == 1 and info.value.field.startswith("meta.m[0]")
        assert _counts(ws) == before
        # as deep as allowed: imported, and shown by the CLI
        edge = dict(_BASE_EPISODE, episode_id="edge", meta={"m": _nested(MAX_JSON_DEPTH - 2, "x", as_list=True)})
        assert _depth(edge) == MAX_JSON_DEPTH
        import_file(ws, _rwb_file(tmp_path / "edge.jsonl", edge), dataset="d")
    finally:
        ws.close()
    assert main(["--workspace", str(tmp_path / "ws"), "episodes", "show", "edge"]) == 0


def test_max_depth_matches_the_slow_reference() -> None:
    from core.data.importers.base import _deep_path, _max_depth

    texts = ['"[\\\\"', '["\\"["]', '{"a":[["]]]]"]]}', "[]", "1", '"x"', '[{"a\\\\":[1,{"b":[]}]}]',
             json.dumps(_nested(70, "]", True))]
    for line in (ROOT / "datasets" / "real" / "tau2_grok" / "episodes.jsonl").read_text(encoding="utf-8").splitlines()[:40]:
        texts.append(line)
    for text in texts:
        depth = _depth(json.loads(text))
        assert _max_depth(text.encode()) == depth, text[:80]
        assert (_deep_path(text, depth) is None) and (_deep_path(text, depth - 1) is not None or depth == 0)


def test_a_10mb_text_is_refused_in_fields_that_used_to_take_it(tmp_path: Path) -> None:
    huge = "z" * (10 * 2 ** 20)
    ws = Workspace.open(tmp_path / "ws")
    try:
        for field, record in [("domain", dict(_BASE_EPISODE, domain=huge)),
                              ("task.query", dict(_BASE_EPISODE, task={"query": huge})),
                              ("outcome.extra.x", dict(_BASE_EPISODE, outcome={"extra": {"x": huge}})),
                              ("behaviour", dict(_BASE_EPISODE, behaviour=huge)),
                              ("task.intents[0]", dict(_BASE_EPISODE, task={"intents": [huge]}))]:
            with pytest.raises(InputError) as info:
                import_file(ws, _rwb_file(tmp_path / "big.jsonl", record), dataset="d")
            assert info.value.field is not None and field.split(".")[0] in info.value.field, (field, info.value)
            assert "1000000" in str(info.value) or "at most" in str(info.value), info.value
        # an OpenAI log with a 10 MB message: the raw record kept in source.raw is bounded too
        chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                "reward": 1, "note": huge}
        with pytest.raises(InputError, match="longer than 1000000") as info:
            import_file(ws, _rwb_file(tmp_path / "chat.jsonl", chat), dataset="c")
        assert info.value.field == "source.raw.note"
        assert _counts(ws) == (0, 0, 0)
    finally:
        ws.close()


def test_a_record_over_the_byte_cap_is_refused(tmp_path: Path) -> None:
    many = {f"k{i}": "v" * 900_000 for i in range(MAX_RECORD_BYTES // 900_000 + 1)}
    ws = Workspace.open(tmp_path / "ws")
    try:
        with pytest.raises(InputError, match=f"longer than {MAX_RECORD_BYTES} bytes") as info:
            import_file(ws, _rwb_file(tmp_path / "big.jsonl", dict(_BASE_EPISODE, meta=many)), dataset="d")
        assert info.value.line == 1 and info.value.record == 0
        assert _counts(ws) == (0, 0, 0)
    finally:
        ws.close()


@pytest.mark.parametrize("name, message", [
    ("x" * 300 + ".jsonl", "306 bytes long, more than 255"),
    ("a\x00b.jsonl", "control character"),
    ("é" * 128 + ".jsonl", "262 bytes long"),
])
def test_bad_upload_names_are_refused_clearly(tmp_path: Path, name: str, message: str) -> None:
    ws = Workspace.open(tmp_path / "ws")
    try:
        with pytest.raises(InputError, match=message):
            import_upload(ws, name, json.dumps(_BASE_EPISODE).encode())
        assert _counts(ws) == (0, 0, 0)
        assert not list((tmp_path / "ws").rglob("*.jsonl*"))  # nothing kept
        # 255 bytes exactly is a file name like any other
        result = import_upload(ws, "x" * 249 + ".jsonl", json.dumps(_BASE_EPISODE).encode(), dataset="ok")
        assert result.episodes == 1
    finally:
        ws.close()


@pytest.mark.parametrize("dataset", ["a/b", "..", "x\\y", "é" * 128 + "x" * 10])
def test_dataset_names_that_are_no_folder_name_are_refused(tmp_path: Path, dataset: str) -> None:
    ws = Workspace.open(tmp_path / "ws")
    try:
        with pytest.raises(InputError) as info:
            import_file(ws, _rwb_file(tmp_path / "e.jsonl", _BASE_EPISODE), dataset=dataset)
        assert info.value.field == "dataset"
        assert _counts(ws) == (0, 0, 0)
    finally:
        ws.close()


def test_stored_bodies_deeper_than_the_json_parser_takes_still_read(tmp_path: Path) -> None:
    """A workspace filled before the depth cap may hold deeper bodies: they still read."""
    ws = Workspace.open(tmp_path / "ws")
    try:
        import_file(ws, _rwb_file(tmp_path / "e.jsonl", _BASE_EPISODE), dataset="d")
        deep = dict(_BASE_EPISODE, meta={"m": _nested(300, "x", as_list=True)})
        body = json.dumps(deep, sort_keys=True, separators=(",", ":"))
        with ws.conn:
            ws.conn.execute("UPDATE episodes SET body=? WHERE episode_id='e1'", (body,))
        assert _depth(ws.get_episode("d", "e1").meta) == 301
        assert len(ws.load_episodes("d")) == 1
    except sqlite3.OperationalError as exc:  # pragma: no cover - the schema names the column body
        pytest.fail(str(exc))
    finally:
        ws.close()
