"""``rwb episodes import|list|show|export`` through the real entry point (core.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.cli import main

ROOT = Path(__file__).resolve().parents[1]
TAU2_RETAIL = ROOT / "datasets" / "real" / "tau2" / "retail" / "tasks.json"


def rwb(ws: Path, *args: str) -> list[str]:
    return ["--workspace", str(ws), "episodes", *args]


def run_json(capsys: pytest.CaptureFixture, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # --json prints exactly one object
    return json.loads(out[0])


def test_import_list_show_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ws = tmp_path / "ws"
    result = run_json(capsys, rwb(ws, "import", str(TAU2_RETAIL), "--json"))
    assert {"episodes", "steps", "tool_calls", "invalid_tokens"} <= set(result)
    assert (result["episodes"], result["dataset"], result["invalid_tokens"]) == (114, "tau2_retail", 0)

    listed = run_json(capsys, rwb(ws, "list", "--dataset", "tau2_retail", "--json"))
    assert listed["count"] == 114
    first = listed["episodes"][0]
    assert first["episode_id"] == "retail-0" and first["n_steps"] == 6
    assert first["outcome"]["resolved"] is True

    shown = run_json(capsys, rwb(ws, "show", "retail-0", "--json"))
    assert shown["dataset"] == "tau2_retail" and len(shown["episode"]["steps"]) == 6
    assert shown["tokens"][-1] == "F0" and "INVALID" not in shown["tokens"]

    assert main(rwb(ws, "show", "retail-0")) == 0
    text = capsys.readouterr().out
    assert "find_user_id_by_name_zip(first_name=Yusuf" in text and "not replayed" in text

    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    exported = run_json(capsys, rwb(ws, "export", "--out", str(out1), "--json"))
    assert exported["episodes"] == 114
    assert main(rwb(ws, "import", str(out1), "--dataset", "copy")) == 0
    assert "Imported 114 episodes" in capsys.readouterr().out
    assert main(rwb(ws, "export", "--dataset", "copy", "--out", str(out2))) == 0
    assert out1.read_bytes() == out2.read_bytes()


def test_reimport_says_nothing_changed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ws = tmp_path / "ws"
    assert main(rwb(ws, "import", str(TAU2_RETAIL))) == 0
    assert main(rwb(ws, "import", str(TAU2_RETAIL))) == 0
    assert "already imported" in capsys.readouterr().out
    again = run_json(capsys, rwb(ws, "import", str(TAU2_RETAIL), "--json"))
    assert again["already_imported"] is True and again["episodes"] == 114


def test_openai_keys_by_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = [
        {"run": {"uid": "r1", "chat": [
            {"role": "user", "content": "price of AAPL?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function", "function": {
                "name": "quote", "arguments": "{\"symbol\": \"AAPL\"}"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "{\"price\": 190.1}"},
            {"role": "assistant", "content": "190.1"}]}, "eval": {"passed": True}},
        {"run": {"uid": "r2", "chat": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello"}]}, "eval": {"passed": False}},
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    ws = tmp_path / "ws"
    result = run_json(capsys, rwb(ws, "import", str(path), "--messages-key", "run.chat", "--reward-key",
                                  "eval.passed", "--id-key", "run.uid", "--json"))
    assert (result["format"], result["episodes"], result["steps"], result["tool_calls"]) == ("openai", 2, 3, 1)
    listed = run_json(capsys, rwb(ws, "list", "--json"))
    assert [(e["episode_id"], e["n_steps"], e["outcome"]["resolved"]) for e in listed["episodes"]] == \
           [("r1", 2, True), ("r2", 1, False)]
    assert list(listed["episodes"][0]) == ["dataset", "episode_id", "domain", "task_type", "behaviour", "n_steps",
                                           "resolved", "final_reward", "business_metric", "query", "outcome"]
    assert list(listed["episodes"][0]["outcome"]) == ["resolved", "final_reward", "business_metric"]


def test_bad_input_exits_2_with_location(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "broken.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"content": "no role"}]}) + "\n",
                    encoding="utf-8")
    ws = tmp_path / "ws"
    capsys.readouterr()
    assert main(rwb(ws, "import", str(path), "--json")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # the line, as an editor numbers it; a record's index beside it would only confuse ("record 1")
    assert "broken.jsonl, line 2, field 'messages[0].role'" in captured.err and "record 1" not in captured.err
    assert main(rwb(ws, "list", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 0  # nothing was imported

    result = run_json(capsys, rwb(ws, "import", str(path), "--skip-invalid", "--json"))
    assert result["episodes"] == 1 and len(result["rejected"]) == 1
    assert Path(result["report_path"]).exists()

    assert main(rwb(ws, "show", "nope")) == 2
    assert "no episode 'nope'" in capsys.readouterr().err
    assert main(rwb(ws, "list", "--dataset", "nope")) == 2
    assert main(rwb(ws, "import", str(tmp_path / "missing.json"))) == 2
    assert "file not found" in capsys.readouterr().err
