"""Streaming import (issue 28, attack 12): ``rwb episodes import`` holds a record at a time,
not the file.  Before, a file was read whole, split, validated and stored from memory, and
the import peaked at 7–12× the file's size; now the peak over a one-episode import stays a
small fraction of the file.  Also here: the JSON list reader that makes this possible
(records cut by a vectorised nesting scan) against Python's parser, and the all-or-nothing
rule when the rows travel in many batches."""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from core.base.errors import InputError
from core.data.episode_views import import_upload
from core.data.importers import import_file, parallel
from core.data.importers import base as importer_base
from core.data.importers.base import MAX_JSON_DEPTH, _NestingScan, load_document, open_document
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_import_memory import peak_of_import, write_episodes_file  # noqa: E402

#: Peak memory over a one-episode import allowed, as a share of the file's size.  The code
#: that read files whole needed 7× (JSON Lines) to 12× (a JSON list); streaming needs a
#: constant (a batch of rows, the catalog's distinct calls), about 15–25 MB.
MAX_GROWTH_PER_FILE_BYTE = 0.5


def counts(ws: Workspace) -> dict[str, int]:
    return {t: ws.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("datasets", "episodes", "steps", "tools", "imports")}


@pytest.mark.parametrize("fmt, megabytes, workers", [("rwb", 64, 2), ("openai-list", 40, 1)])
def test_import_memory_is_bounded_by_a_record_not_by_the_file(tmp_path: Path, fmt: str, megabytes: int,
                                                              workers: int) -> None:
    """A 64 MB rwb file (read by two processes: chunks in flight) and a 40 MB OpenAI JSON list: the importing
    process's peak memory over that of importing a one-episode file the same way is under
    half the file's size (it was 7× and 12×)."""
    extra = [] if fmt == "rwb" else ["--id-key", "id"]
    tiny, big = tmp_path / "tiny.json", tmp_path / "big.json"
    write_episodes_file(tiny, 0.001, fmt)
    episodes = write_episodes_file(big, megabytes, fmt)
    size = big.stat().st_size
    base = peak_of_import(tiny, tmp_path / "ws-tiny", *extra, workers=workers)
    peak = peak_of_import(big, tmp_path / "ws-big", *extra, workers=workers)
    assert peak.result["episodes"] == episodes and base.result["episodes"] == 1
    growth = peak.main - base.main
    assert growth <= MAX_GROWTH_PER_FILE_BYTE * size, (
        f"importing {size / 1e6:.0f} MB raised the peak by {growth / 1e6:.0f} MB "
        f"({growth / size:.2f}x the file; baseline {base.main / 1e6:.0f} MB)")


# --------------------------------------------------------------------------- the JSON list reader
def _reference_structure(text: bytes) -> list[tuple[int, int, int]]:
    """(offset, byte, depth after) of each bracket and comma outside strings, char by char."""
    out, depth, inside, escaped = [], 0, False, False
    for i, b in enumerate(text):
        if inside:
            if escaped:
                escaped = False
            elif b == ord("\\"):
                escaped = True
            elif b == ord('"'):
                inside = False
            continue
        if b == ord('"'):
            inside = True
        elif b in b"[{":
            depth += 1
            out.append((i, b, depth))
        elif b in b"]}":
            depth -= 1
            out.append((i, b, depth))
        elif b == ord(","):
            out.append((i, b, depth))
    return out


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    text = "".join(rng.choice(['\\', '"', '[', ']', '{', '}', ',', 'a', ' ', '\n', 'é', '\\\\', '\\"'])
                   for _ in range(rng.randint(0, 10)))
    r = rng.random()
    if depth > 5 or r < 0.3:
        return rng.choice([1, 2.5, None, True, text])
    if r < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {text + str(k): _random_value(rng, depth + 1) for k in range(rng.randint(0, 4))}


def test_the_nesting_scan_matches_a_char_by_char_walk_however_the_text_is_cut() -> None:
    """Strings full of brackets, commas, quotes and backslash runs, cut anywhere (a quote
    escaped across two pieces included)."""
    rng = random.Random(7)
    for _ in range(600):
        value = [_random_value(rng) for _ in range(rng.randint(0, 5))]
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode()
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        scan, seen, at = _NestingScan(), [], 0
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            offsets, chars, depth = scan.feed(text[a:b])
            seen += [(at + int(o), int(c), int(d)) for o, c, d in zip(offsets, chars, depth)]
            at += b - a
        assert seen == _reference_structure(text), text


def test_a_json_list_is_read_record_by_record_as_python_parses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importer_base, "READ_BYTES", 48)  # records cut across pieces
    rng = random.Random(11)
    for _ in range(200):
        value = [_random_value(rng) for _ in range(rng.randint(0, 6))]
        data = json.dumps(value, indent=rng.choice([None, 2]), ensure_ascii=False).encode()
        doc = load_document("list.json", data)
        assert doc.layout == "json-list" and [r.value for r in doc.records] == value, data


@pytest.mark.parametrize("data, line, record, reason", [
    (b'[{"a": 1},\n {"b": 2} x,\n {"c": 3}]', 2, 1, r"invalid JSON: Extra data \(column 11\)"),
    (b'[{"a": 1},\n {"b": 2},]', 2, 2, "invalid JSON: Expecting value"),
    (b'[{"a": 1},\n {"b": 2}\n', 3, None, "the file ends inside the list"),
    (b'[{"a": 1},\n {"b": 2}]\n\n{"c": 3}', 4, None, "Extra data after the list"),
    (b'[{"a": 1e400}]', 1, 0, "number 1e400 is too large"),
])
def test_a_syntax_error_in_a_json_list_refuses_the_file_naming_line_and_record(
        data: bytes, line: int, record: int | None, reason: str) -> None:
    with pytest.raises(InputError, match=reason) as info:
        list(open_document("list.json", data).records)
    assert (info.value.line, info.value.record) == (line, record)


def test_a_record_nested_too_deep_in_a_json_list_is_named_before_it_is_parsed() -> None:
    deep: Any = {"x": 1}
    for _ in range(150):  # 300 levels
        deep = {"k": [deep]}
    data = json.dumps([{"ok": 1}, {"meta": deep}]).encode()
    with pytest.raises(InputError, match=f"nested deeper than {MAX_JSON_DEPTH} levels") as info:
        list(open_document("deep.json", data).records)
    assert info.value.record == 1 and info.value.field.startswith("meta.k[0].k[0]")


# --------------------------------------------------------------------------- all or nothing, in batches
def test_rows_stored_in_many_batches_are_still_all_or_nothing(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One episode per batch: the same rows as one batch; a bad last line refuses the whole
    file, names it, and leaves the workspace as it was."""
    good = tmp_path / "good.jsonl"
    write_episodes_file(good, 0.4, "rwb")
    ws = Workspace.open(tmp_path / "ws")
    try:
        whole = import_file(ws, good, dataset="whole")
        monkeypatch.setattr(parallel, "BATCH_BYTES", 1)
        monkeypatch.setattr(parallel, "CHUNK_BYTES", 1)
        batched = import_file(ws, good, dataset="batched")
        assert (whole.episodes, whole.steps, whole.invalid_tokens) == \
               (batched.episodes, batched.steps, batched.invalid_tokens) and whole.episodes > 50
        rows = "SELECT episode_id, body FROM episodes WHERE dataset=? ORDER BY uid"
        assert ws.conn.execute(rows, ("whole",)).fetchall() == ws.conn.execute(rows, ("batched",)).fetchall()

        lines = good.read_text(encoding="utf-8").splitlines()
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join(lines + [lines[-1].replace('"t":0', '"t":"zero"', 1)]) + "\n", encoding="utf-8")
        before = counts(ws)
        with pytest.raises(InputError) as info:
            import_file(ws, bad, dataset="bad")
        assert info.value.line == len(lines) + 1 and info.value.field is not None
        assert counts(ws) == before
    finally:
        ws.close()


def test_an_upload_given_as_a_file_object_is_copied_a_piece_at_a_time(tmp_path: Path) -> None:
    """The Episodes page hands over Streamlit's UploadedFile (a file object), not its bytes."""
    path = tmp_path / "orders.jsonl"
    write_episodes_file(path, 0.2, "rwb")
    ws = Workspace.open(tmp_path / "ws")
    try:
        upload = io.BytesIO(path.read_bytes())
        upload.read(100)  # wherever the page left it, the whole file is read
        result = import_upload(ws, "orders.jsonl", upload)
        assert result.dataset == "orders" and result.episodes > 10
        kept = list((ws.artifacts / "uploads").glob("*/orders.jsonl"))
        assert len(kept) == 1 and kept[0].read_bytes() == path.read_bytes()
        assert not list((ws.artifacts / "uploads").glob(".upload.*"))
        again = import_upload(ws, "orders.jsonl", io.BytesIO(path.read_bytes()))
        assert again.already_imported
        with pytest.raises(InputError, match="empty"):
            import_upload(ws, "none.jsonl", io.BytesIO(b""))
    finally:
        ws.close()
