"""The app speaks its own words: pages say what to do in the app first, with the CLI second,
and core errors that name CLI options reach the analyst with the page's labels instead."""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from rwb_app.messages import CLI_PREFIX, app_words, user_message
from core.base.errors import InputError
from core.data.importers import IMPORTERS
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
EPISODES_PAGE = str(ROOT / "pages" / "episodes.py")
#: A command line as an instruction: a `rwb <command>` or a `--flag`.
CLI_TEXT = re.compile(r"(?<![\w/.])rwb [a-z]|(?<![\w-])--[a-z][a-z0-9-]+")
SCANNED = sorted(ROOT.glob("pages/*.py")) + [ROOT / "app" / "main.py"]


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _cli_equivalent_args(tree: ast.AST) -> set[int]:
    """Strings passed to ``cli_equivalent(...)``: the one place a page may show a command."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "cli_equivalent":
                out.update(id(n) for arg in node.args for n in ast.walk(arg))
    return out


def cli_first_texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal, docstrings and CLI-equivalent captions aside,
    that tells the analyst to run a command or give a flag."""
    tree = ast.parse(source)
    allowed = _docstrings(tree) | _cli_equivalent_args(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in allowed and CLI_TEXT.search(node.value)
            and not node.value.startswith(CLI_PREFIX)]


def test_the_scan_finds_a_cli_first_text_and_passes_the_app_first_one():
    page = ('"""Run with `rwb app`."""\n'
            'st.info("No runs yet: launch one (or `rwb train --dataset NAME`).")\n'
            'st.text_input("Key", help="Key of the outcome (--reward-key).")\n'
            'st.info("No runs yet: launch one on the **Training** page.")\n'
            'cli_equivalent("rwb train --dataset NAME")\n'
            'st.checkbox("As served episodes (rwb JSONL)")\n')
    assert [line for line, _ in cli_first_texts(page)] == [2, 3]


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.name)
def test_page_texts_put_the_app_first(path):
    assert cli_first_texts(path.read_text()) == []


def test_user_message_names_the_input_and_its_choices():
    exc = InputError("cannot tell the format (first record has: foo)", file="log.jsonl", field="format",
                     hint="give --format, one of openai, rwb (openai also needs --messages-key)",
                     allowed=["openai", "rwb"])
    # The CLI's text is the message and the hint, as one sentence.
    assert str(exc) == ("log.jsonl, field 'format': cannot tell the format (first record has: foo); "
                        "give --format, one of openai, rwb (openai also needs --messages-key)")
    assert user_message(exc) == ("log.jsonl: cannot tell the format (first record has: foo). "
                                 "**Format**: choose one of openai, rwb.")
    assert "--" not in user_message(exc, {"format": "Log format"})
    assert "**Log format**: choose one of" in user_message(exc, {"format": "Log format"})


def test_user_message_replaces_flags_by_labels():
    exc = InputError("several datasets (a, b); say which with --dataset", field="dataset")
    assert user_message(exc, {"dataset": "Dataset name"}) == (
        "field 'dataset': several datasets (a, b); say which with **Dataset name**")
    assert app_words("give --template NAME or FILE, or --messages-key") == (
        "give **Template** or FILE, or **Messages key**")
    assert app_words("nothing to change — a dash, x--y") == "nothing to change — a dash, x--y"
    assert InputError("plain").to_dict() == {"file": None, "line": None, "record": None, "field": None,
                                             "reason": "plain", "message": "plain"}


def test_an_upload_keeps_the_errors_structure(tmp_path):
    from core.data.episode_views import import_upload

    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(InputError) as info:
        import_upload(ws, "mystery.jsonl", b'{"foo": 1}\n')
    exc = info.value
    assert exc.file == "mystery.jsonl" and exc.field == "format"
    assert exc.allowed == tuple(IMPORTERS)
    assert "give --format, one of" in str(exc)  # the CLI's words are unchanged


class _Upload(io.BytesIO):
    """What ``st.file_uploader`` hands back (Streamlit's UploadedFile: a BytesIO with a name),
    for a page run where AppTest cannot upload."""

    def __init__(self, name: str, data: bytes):
        super().__init__(data)
        self.name = name


def test_episodes_page_shows_an_unknown_format_in_the_apps_words(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    real_uploader = st.file_uploader

    def uploader(label, *args, **kwargs):
        real_uploader(label, *args, **kwargs)
        return _Upload("mystery.jsonl", b'{"foo": 1}\n')

    monkeypatch.setattr(st, "file_uploader", uploader)
    at = AppTest.from_file(EPISODES_PAGE, default_timeout=120).run()
    assert not at.exception
    next(b for b in at.button if b.label == "Import").click().run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "--" not in errors[0]
    assert errors[0].startswith("mystery.jsonl: cannot tell the format")
    assert errors[0].endswith(f"**Format**: choose one of {', '.join(IMPORTERS)}.")
    assert any(c.proto.help.startswith(CLI_PREFIX + "`rwb episodes import") for c in at.caption)
