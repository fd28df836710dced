"""``rwb``'s answers to mistakes: usage errors, ``--json`` errors, ``--version``, completion,
and a fast start (no torch, sentence model, Streamlit or pandas behind ``--help``).

The usage-error tests walk the whole command tree from the typer app, so a command added
later is covered without a line here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main

from core.cli import main, root, version

ROOT = Path(__file__).resolve().parents[1]
#: What `rwb --help`, `rwb --version` and a usage error must not load.
HEAVY = ("torch", "sentence_transformers", "streamlit", "sklearn", "pandas", "scipy", "numpy", "optuna")
ERROR_KEYS = {"type", "message", "file", "line", "record", "field"}


def _walk(command, path=("rwb",)):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(typer.main.get_command(root)))
LEAVES = [(p, c) for p, c in COMMANDS if not hasattr(c, "commands")]
WITH_REQUIRED = [(p, c) for p, c in LEAVES if any(param.required for param in c.params)]
WITH_JSON = [(p, c) for p, c in COMMANDS if any("--json" in getattr(x, "opts", ()) for x in c.params)]


def _ids(items):
    return [" ".join(p) for p, _ in items]


@pytest.fixture
def rwb(tmp_path, monkeypatch, capsys):
    """``rwb ARGS`` in this process on an empty workspace: (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_the_tree_is_walked():
    # rwb, its groups and their commands: a broken walk would make every test below vacuous
    assert len(LEAVES) >= 50
    assert {"rwb episodes import", "rwb tune show", "rwb reward save", "rwb runs stop"} <= set(_ids(LEAVES))
    assert len(WITH_REQUIRED) >= 20 and len(WITH_JSON) >= 40


@pytest.mark.parametrize("path,command", COMMANDS, ids=_ids(COMMANDS))
def test_unknown_flag_exits_2_naming_the_flag_and_the_help(rwb, path, command):
    code, out, err = rwb(*path[1:], "--no-such-flag")
    assert code == 2
    assert "Traceback" not in err + out
    line, = err.splitlines()  # one line
    assert "--no-such-flag" in line
    assert f"'{' '.join(path)} --help'" in line
    assert not (Path("ws").exists()), "a usage error must not open (create) the workspace"


@pytest.mark.parametrize("path,command", WITH_REQUIRED, ids=_ids(WITH_REQUIRED))
def test_missing_required_argument_or_option_exits_2(rwb, path, command):
    code, out, err = rwb(*path[1:])
    assert code == 2
    assert "Traceback" not in err + out
    line, = err.splitlines()
    assert line.startswith("Error: Missing ")
    first_missing = next(p for p in command.params if p.required)
    assert first_missing.name in line.lower() or any(o in line for o in getattr(first_missing, "opts", ()))
    assert line.endswith(f"See '{' '.join(path)} --help'.")


@pytest.mark.parametrize("args,help_of", [
    (["no-such-command"], "rwb"),
    (["episodes", "no-such-command"], "rwb episodes"),
    (["tune", "no-such-command"], "rwb tune"),
])
def test_unknown_command_exits_2(rwb, args, help_of):
    code, out, err = rwb(*args)
    assert code == 2
    assert err == f"Error: No such command 'no-such-command'. See '{help_of} --help'.\n"


def test_bad_value_exits_2_naming_the_option(rwb):
    code, _, err = rwb("episodes", "list", "--limit", "many")
    assert code == 2
    assert "'--limit'" in err and "Traceback" not in err


def test_group_without_its_command_shows_its_help(rwb):
    code, out, err = rwb("episodes")
    assert code == 2
    assert "Usage: rwb episodes" in out and "import" in out and "Traceback" not in out + err


def _error(err: str) -> dict:
    body = json.loads(err)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    return body["error"]


def test_json_usage_error_is_a_json_object_on_stderr(rwb):
    code, out, err = rwb("reward", "check", "--json")
    assert (code, out) == (2, "")
    error = _error(err)
    assert error["type"] == "UsageError" and error["field"] == "template"
    assert error["message"] == "Missing option '--template' / '-t'. See 'rwb reward check --help'."


@pytest.mark.parametrize("path,command", WITH_JSON, ids=_ids(WITH_JSON))
def test_every_json_command_reports_an_unknown_flag_as_json(rwb, path, command):
    code, out, err = rwb(*path[1:], "--json", "--no-such-flag")
    assert (code, out) == (2, "")
    error = _error(err)
    assert error["type"] == "UsageError" and error["field"] == "--no-such-flag"
    assert f"'{' '.join(path)} --help'" in error["message"]


def test_json_input_error_keeps_its_location_and_exit_code(rwb, tmp_path):
    code, out, err = rwb("episodes", "import", "missing.jsonl", "--json")
    assert (code, out) == (2, "")
    error = _error(err)
    assert error == {"type": "InputError", "message": "missing.jsonl: file not found", "file": "missing.jsonl",
                     "line": None, "record": None, "field": None}
    # the same error without --json: the message as before
    assert rwb("episodes", "import", "missing.jsonl") == (2, "", "Error: missing.jsonl: file not found\n")


def test_json_conflict_keeps_exit_code_4(rwb, tmp_path):
    code, template, _ = rwb("reward", "show", "finance_risk@0")
    assert code == 0
    (tmp_path / "t.yaml").write_text(template, encoding="utf-8")
    assert rwb("reward", "save", "finance_risk", "t.yaml", "--base", "0")[0] == 0
    code, out, err = rwb("reward", "save", "finance_risk", "t.yaml", "--base", "0", "--json")
    assert (code, out) == (4, "")
    error = _error(err)
    assert error["type"] == "TemplateConflict" and "version 1" in error["message"]
    code, _, err = rwb("reward", "save", "finance_risk", "t.yaml", "--base", "0")
    assert code == 4 and err.startswith("Error: template 'finance_risk' is at version 1")


def test_version_is_the_package_version(rwb):
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert rwb("--version") == (0, f"rwb {expected}\n", "")


def test_version_falls_back_to_pyproject(monkeypatch):
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert version() == expected


def test_shell_completion(rwb, monkeypatch):
    code, out, _ = rwb("--show-completion", "bash")
    assert code == 0 and "_RWB_COMPLETE=complete_bash" in out
    monkeypatch.setenv("_RWB_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "rwb episodes im")
    monkeypatch.setenv("COMP_CWORD", "2")
    assert rwb() == (0, "import\n", "")


def test_review_claim_lease_help_names_the_default():
    from core.guard.review import DEFAULT_LEASE_SECONDS

    claim = dict(COMMANDS)[("rwb", "review", "claim")]
    lease = next(p for p in claim.params if p.name == "lease")
    assert f"(default {DEFAULT_LEASE_SECONDS:g})" in lease.help


_LOADED_AFTER = """
import contextlib, io, json, sys
from core.cli import main
codes = []
for args in (["--help"], ["--version"], ["episodes", "import", "--bogus"], ["states", "map"],
             ["tune", "show", "--bogus"], ["no-such-command"], ["reward", "check", "--json"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(args))
print(json.dumps({"codes": codes, "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))}))
"""


def test_help_version_and_usage_errors_load_no_heavy_module(tmp_path):
    env = {**os.environ, "RWB_WORKSPACE": str(tmp_path / "ws"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOADED_AFTER.replace("set(HEAVY)", repr(set(HEAVY)))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["codes"] == [0, 0, 2, 2, 2, 2, 2]
    assert result["loaded"] == []
