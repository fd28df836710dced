"""The Export reward page (AppTest) on a real workspace: the pinned label, the sha256 and the framework's
snippet show and follow the picks; the download is the module ``rwb reward export`` writes; a saved
version exports as itself; the page is in the app's navigation next to the Reward Pyramid."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest

from core.access.users import LOCAL_ADMIN
from core.records.store import Workspace
from core.rewards.export import FRAMEWORKS, write_export
from core.rewards.versions import get_template, save_template

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "reward_export.py")


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A workspace with one saved version of tool_agent (its weights changed), so @1 differs from @0."""
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    shipped = get_template(ws, "tool_agent", 0).yaml
    edited = shipped.replace("tool_validity: {weight: 0.3}", "tool_validity: {weight: 0.5}")
    assert edited != shipped
    save_template(ws, LOCAL_ADMIN, "tool_agent", edited, base_version=0, message="more L1")
    ws.close()
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    return path


def open_page(template: str = "tool_agent@0", framework: str = "trl") -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["rx_template"] = template
    at.session_state["rx_framework"] = framework
    return at.run()


def expected(path: Path, template: str, framework: str, out: Path):
    ws = Workspace.open(path)
    try:
        return write_export(template, framework, out, ws=ws)
    finally:
        ws.close()


def shown_code(at: AppTest) -> list[str]:
    return [c.value for c in at.code]


def test_label_sha256_and_snippet_follow_the_framework(workspace, tmp_path):
    at = open_page()
    assert not at.exception, at.exception
    assert not at.error
    assert at.title[0].value == "Export reward"
    snippets = set()
    for framework in FRAMEWORKS:
        at.selectbox(key="rx_framework").set_value(framework).run()
        assert not at.exception and not at.error
        want = expected(workspace, "tool_agent@0", framework, tmp_path / framework)
        assert {m.label: m.value for m in at.metric}["Pinned template"] == "tool_agent@0"
        assert any(want.sha256 in m.value for m in at.markdown)
        assert any(want.entry_point in c.value for c in at.caption)
        code = shown_code(at)
        # the snippet as written, with the module's path inside the download instead of the temporary one
        assert code[0] == want.snippet.replace(str((tmp_path / framework).resolve()),
                                                f"./rwb_reward_tool_agent_0_{framework}")
        commands = " ".join(c.proto.help for c in at.caption)
        assert f"rwb reward export --template tool_agent@0 --to {framework} " in commands
        assert "rwb reward serve --template tool_agent@0" in commands
        snippets.add(code[0])
    assert len(snippets) == len(FRAMEWORKS)
    assert "reward_funcs=reward.funcs" in next(s for s in snippets if "GRPOTrainer" in s)
    assert any("reward.custom_reward_function.path=./rwb_reward_tool_agent_0_verl/rwb_reward_tool_agent_0.py" in s
               for s in snippets)


def test_a_saved_version_is_pinned_as_itself(workspace, tmp_path):
    at = open_page("tool_agent@1", "verl")
    assert not at.exception and not at.error
    saved = expected(workspace, "tool_agent@1", "verl", tmp_path / "one")
    shipped = expected(workspace, "tool_agent@0", "verl", tmp_path / "zero")
    assert saved.sha256 != shipped.sha256
    assert {m.label: m.value for m in at.metric}["Pinned template"] == "tool_agent@1"
    assert any(saved.sha256 in m.value for m in at.markdown)
    assert not any(shipped.sha256 in m.value for m in at.markdown)
    at.selectbox(key="rx_template").set_value("tool_agent@0").run()
    assert any(shipped.sha256 in m.value for m in at.markdown)
    assert {m.label: m.value for m in at.metric}["Pinned template"] == "tool_agent@0"


def test_the_download_is_the_exported_module(workspace, tmp_path, monkeypatch):
    """The zip behind the button (caught where Streamlit stores it) holds what ``rwb reward export``
    writes, in one folder, with the module named by its path in that folder."""
    served: list[tuple[bytes, str | None]] = []
    store = MemoryMediaFileStorage.load_and_get_id

    def catching(self, path_or_data, mimetype, kind, filename=None):
        served.append((path_or_data, filename))
        return store(self, path_or_data, mimetype, kind, filename)

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", catching)
    at = open_page("tool_agent@1", "verl")
    assert not at.exception and not at.error
    (button,) = at.get("download_button")
    assert button.proto.label == "Download rwb_reward_tool_agent_1_verl.zip"
    ((data, filename),) = served
    assert filename == "rwb_reward_tool_agent_1_verl.zip"
    want = expected(workspace, "tool_agent@1", "verl", tmp_path / "direct")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        files = {name: archive.read(name).decode("utf-8") for name in archive.namelist()}
    folder = "rwb_reward_tool_agent_1_verl/"
    assert sorted(files) == sorted(folder + p.name for p in want.files)
    for path in want.files:  # as written, but for the folder the module sits in
        assert files[folder + path.name] == path.read_text(encoding="utf-8").replace(
            str((tmp_path / "direct").resolve()), "./rwb_reward_tool_agent_1_verl")
    assert f"SHA256 = {want.sha256!r}" in files[folder + "rwb_reward_tool_agent_1.py"]
    assert "path=./rwb_reward_tool_agent_1_verl/rwb_reward_tool_agent_1.py" in files[folder + "README.md"]
    assert str(tmp_path) not in "".join(files.values())
    # the same export twice is the same download
    open_page("tool_agent@1", "verl")
    assert served[1][0] == data


def test_the_page_is_in_the_navigation_next_to_the_reward_pyramid(workspace):
    source = (ROOT / "app" / "main.py").read_text(encoding="utf-8")
    pyramid = source.index('("reward_pyramid.py", "Reward Pyramid"')
    export = source.index('("reward_export.py", "Export reward"')
    assert pyramid < export and "\n" not in source[source.index("\n", pyramid) + 1:export]
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    at.switch_page("page_scripts/reward_export.py").run()
    assert not at.exception and not at.error
    assert [t.value for t in at.title] == ["Export reward"]


def test_an_export_that_fails_says_why_and_offers_no_download(workspace, monkeypatch):
    from core.base.errors import InputError

    def refusing(template, framework, out_dir, **kwargs):
        raise InputError(f"template {template} changed while it was exported", field="template")

    monkeypatch.setattr("core.rewards.export.write_export", refusing)
    at = open_page("tool_agent@1", "trl")
    assert not at.exception
    assert "tool_agent@1 changed while it was exported" in at.error[0].value
    assert not at.get("download_button") and not at.code
