"""A bundle is bounded before it is read (issue 28, attacks 4 and 5).

Zip bombs: an extra member that unpacks to 1 GiB (6-7 MB on disk), two of them, a listed
member declaring 1 GiB, a member whose header declares its real size but that inflates to
1 GiB, 60,000 entries, and the same in a promoted folder — each refused before (or while,
never past its declared size) it is read, in well under a second, with the process's peak
memory less than 100 MB above a normal verify's.  Deep JSON: a 100,000-level
``manifest.json``, ``signature.json`` or safetensors header is refused with the member and
the JSON path named, or, past the member's size cap, unread (exit 2 from ``rwb bundle
verify``, no traceback, a security event).

The bombs are written by hand (one compressed MiB of zeros repeated, see
:func:`deflated_zeros`), so building a 1 GiB member costs a few milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import members, module_hash_embedder, reseal, write_zip  # noqa: F401
from core.access.audit import security_events
from core.govern import bundle as B
from core.govern.bundle import MANIFEST, SIGNATURE, list_bundles, safetensors_problem, verify_bundle
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
DEEP = 100_000


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture()
def ws(run, tmp_path):
    """A copy of the shared workspace (its trust store and security log stay in this test)."""
    root = tmp_path / "ws"
    shutil.copytree(run.root, root)
    w = Workspace.open(root)
    yield w
    w.close()


# --------------------------------------------------------------------------- building bombs cheaply
_ZEROS: dict[int, tuple[bytes, int]] = {}


def deflated_zeros(n_mib: int) -> tuple[bytes, int]:
    """A raw deflate stream that inflates to ``n_mib`` MiB of zeros, and their CRC-32: one
    compressed MiB after a full flush (which makes the blocks independent) repeated."""
    if n_mib not in _ZEROS:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        mib = bytes(MIB)
        first = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
        again = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
        assert again == c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
        crc = 0
        for _ in range(n_mib):
            crc = zlib.crc32(mib, crc)
        _ZEROS[n_mib] = (first + again * (n_mib - 1) + c.flush(), crc)
    return _ZEROS[n_mib]


def deflated(data: bytes) -> tuple[bytes, int, int]:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(), zlib.crc32(data), len(data)


def raw_zip(path: Path, entries: dict[str, tuple[bytes, int, int]], *, end_count: int | None = None) -> Path:
    """A zip of deflated ``entries`` (name -> compressed bytes, CRC-32, the unpacked size its
    headers declare), written field by field so a header may declare any size;
    ``end_count`` overrides the entry count of the end record."""
    out, central = bytearray(), bytearray()
    for name, (data, crc, size) in entries.items():
        raw = name.encode("utf-8")
        offset = len(out)
        out += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, 8, 0, 0x21, crc, len(data), size, len(raw),
                           0) + raw + data
        central += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 8, 0, 0x21, crc, len(data), size,
                               len(raw), 0, 0, 0, 0, 0o100644 << 16, offset) + raw
    count = len(entries) if end_count is None else end_count
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))
    return path


def bundle_entries(run) -> dict[str, tuple[bytes, int, int]]:
    return {name: deflated(data) for name, data in members(run.bundle).items()}


def gib_member(n_gib: int = 1) -> tuple[bytes, int, int]:
    data, crc = deflated_zeros(1024 * n_gib)
    return data, crc, n_gib * GIB


def assert_refused_quickly(path: Path, *words: str) -> B.VerifyReport:
    """``verify_bundle(path)`` refuses with ``words`` in its reason, in under a second, with
    Python's peak allocations during the refusal under 10 MB (a 1 GiB member is never read)."""
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        report = verify_bundle(path)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not report.ok
    for w in words:
        assert w in report.reason, f"{w!r} not in {report.reason!r}"
    assert seconds < 1.0, f"the refusal took {seconds:.2f} s"
    assert peak < 10 * MIB, f"the refusal allocated {peak / MIB:.0f} MiB"
    return report


# --------------------------------------------------------------------------- zip bombs (attack 4)
@pytest.mark.parametrize("n_bombs", [1, 2])
def test_extra_gigabyte_members_are_refused_by_name_unread(run, tmp_path, n_bombs):
    entries = bundle_entries(run)
    for i in range(n_bombs):
        entries[f"extra-{i}.json"] = gib_member()
    path = raw_zip(tmp_path / "bomb.zip", entries)
    assert path.stat().st_size < 8 * MIB * n_bombs
    report = assert_refused_quickly(path, *(f"extra file 'extra-{i}.json'" for i in range(n_bombs)), "not read")
    assert [c.check for c in report.checks] == ["paths"]


def test_a_listed_member_declaring_a_gigabyte_is_refused_unread(run, tmp_path):
    entries = {**bundle_entries(run), "policy.safetensors": gib_member()}
    path = raw_zip(tmp_path / "bomb.zip", entries)
    assert_refused_quickly(path, "'policy.safetensors' unpacks to 1,073,741,824 bytes, more than the "
                          f"{B.MAX_WEIGHTS_BYTES:,}")


@pytest.mark.parametrize("name", ["policy.safetensors", MANIFEST, SIGNATURE])
def test_a_member_inflating_past_its_declared_size_is_read_no_further(run, tmp_path, name):
    """The headers declare the member's real size (the manifest agrees); its data inflates
    to 1 GiB: reading stops at the declared size."""
    entries = bundle_entries(run)
    real_size = entries[name][2]
    data, crc, _ = gib_member()
    entries[name] = (data, crc, real_size)
    path = raw_zip(tmp_path / "liar.zip", entries)
    # zipfile inflates no further than the declared size; the CRC-32 then gives the lie away
    report = assert_refused_quickly(path, f"{name!r} cannot be read from the zip: Bad CRC-32")
    assert [c.check for c in report.checks] == ["paths", "archive"]


def test_a_member_at_another_size_than_the_manifest_lists_is_not_read(run, tmp_path):
    files = members(run.bundle)
    files["smoke.json"] = files["smoke.json"] + b" " * 100
    assert_refused_quickly(write_zip(tmp_path / "grown.zip", files),
                    f"smoke.json has {len(files['smoke.json']):,} bytes, the manifest says")


@pytest.mark.parametrize("end_count", [None, 14])
def test_a_zip_of_60000_entries_is_refused_before_its_directory_is_parsed(tmp_path, end_count):
    """60,000 entries (and the same with an end record that claims 14): refused from the
    end record, before zipfile builds an object per entry."""
    empty = deflated(b"")
    path = raw_zip(tmp_path / "many.zip", {f"f{i}.json": empty for i in range(60_000)}, end_count=end_count)
    words = ("60,000 entries",) if end_count is None else ("central directory takes",)
    assert_refused_quickly(path, *words)


def test_a_promoted_folder_with_gigabyte_files_is_refused_unread(run, tmp_path):
    folder = tmp_path / "bundle"
    folder.mkdir()
    for name, data in members(run.bundle).items():
        (folder / name).write_bytes(data)
    assert verify_bundle(folder).ok
    with open(folder / "extra.json", "wb") as f:  # sparse: 1 GiB that takes no disk
        f.truncate(GIB)
    assert_refused_quickly(folder, "extra file 'extra.json'", "not read")
    (folder / "extra.json").unlink()
    os.truncate(folder / "smoke.json", GIB)
    assert_refused_quickly(folder, "'smoke.json' unpacks to 1,073,741,824 bytes")
    (folder / "smoke.json").write_bytes(members(run.bundle)["smoke.json"])
    for i in range(B.MAX_MEMBERS):
        (folder / f"f{i}.json").write_bytes(b"{}")
    assert_refused_quickly(folder, f"holds more than {B.MAX_MEMBERS} entries")


_PEAK_SCRIPT = """
import json, resource, sys, time
from core.govern.bundle import verify_bundle

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
assert verify_bundle(sys.argv[1]).ok
normal = peak()
t0 = time.perf_counter()
report = verify_bundle(sys.argv[2])
print(json.dumps({"normal": normal, "bomb": peak(), "seconds": time.perf_counter() - t0, "ok": report.ok}))
"""


def test_the_process_peak_refusing_two_gigabyte_members_stays_within_100_mb_of_a_normal_verify(run, tmp_path):
    """The acceptance figure for the whole process (ru_maxrss): a normal verify of the
    bundle, then the bomb (the bundle plus two 1 GiB members) — the peak rises by less
    than 100 MB, and the refusal takes less than a second."""
    entries = {**bundle_entries(run), "extra-0.json": gib_member(), "extra-1.yaml": gib_member()}
    bomb = raw_zip(tmp_path / "bomb.zip", entries)
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(run.bundle), str(bomb)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["ok"] is False
    assert figures["bomb"] - figures["normal"] < 100e6, figures
    assert figures["seconds"] < 1.0, figures


def test_rwb_bundle_verify_refuses_a_bomb_with_exit_2_and_a_security_event(run, ws, tmp_path, capsys):
    from core.cli import main

    entries = {**bundle_entries(run), "extra-0.json": gib_member()}
    path = raw_zip(tmp_path / "bomb.zip", entries)
    assert main(["--workspace", str(ws.root), "bundle", "verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "extra file 'extra-0.json'" in err and "Traceback" not in err
    event = security_events(ws, "bundle_refused")[-1]
    assert event.detail["file"] == str(path) and event.detail["checks"] == ["paths"]
    assert event.detail["bytes"] == path.stat().st_size and len(event.detail["bundle_sha256"]) == 64
    assert "extra-0.json" in event.detail["reason"]


# --------------------------------------------------------------------------- deep JSON (attack 5)
def _deep_manifest(run) -> dict[str, bytes]:
    """The bundle with 100,000 levels of lists under ``evaluation.notes`` in its manifest."""
    files = members(run.bundle)
    manifest = json.loads(files[MANIFEST])
    manifest["evaluation"]["notes"] = "@DEEP@"
    text = json.dumps(manifest, sort_keys=True, indent=2)
    files[MANIFEST] = text.replace('"@DEEP@"', "[" * DEEP + "]" * DEEP).encode()
    return files


def test_rwb_bundle_verify_refuses_a_100k_level_manifest_naming_the_path(run, ws, tmp_path):
    """The real console script: exit 2, the member and the JSON path named, no traceback,
    a security event."""
    path = write_zip(tmp_path / "deep.zip", _deep_manifest(run))
    done = subprocess.run([str(Path(sys.executable).with_name("rwb")), "--workspace", str(ws.root), "bundle",
                           "verify", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout and "RecursionError" not in done.stderr
    assert "manifest.json, field 'evaluation.notes[0][0]" in done.stderr
    assert f"nested deeper than {B.MAX_JSON_DEPTH} levels" in done.stderr
    event = security_events(ws, "bundle_refused")[-1]
    assert event.detail["file"] == str(path) and event.detail["checks"] == ["manifest"]
    assert "nested deeper" in event.detail["reason"]


@pytest.mark.parametrize("levels", [DEEP, 30_000])
def test_a_deep_signature_is_refused_naming_the_member(run, ws, tmp_path, capsys, levels):
    """100,000 levels (200 kB) pass the signature's size cap and are refused unread; 30,000
    levels (60 kB) fit it and are refused by depth, with the JSON path named."""
    from core.cli import main

    files = members(run.bundle)
    files[SIGNATURE] = ('{"signature": ' + "[" * levels + "]" * levels + "}").encode()
    path = write_zip(tmp_path / "deep-signature.zip", files)
    assert main(["--workspace", str(ws.root), "bundle", "verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if levels == DEEP:
        assert f"'signature.json' unpacks to {len(files[SIGNATURE]):,} bytes, more than the" in err
        failed = ["paths"]
    else:
        assert "signature.json, field 'signature[0][0]" in err and "nested deeper than" in err
        failed = ["signature"]
    assert security_events(ws, "bundle_refused")[-1].detail["checks"] == failed


def test_a_deep_safetensors_header_is_refused_not_recursed():
    header = ('{"a": ' + "[" * DEEP + "]" * DEEP + "}").encode()
    why = safetensors_problem("policy.safetensors", len(header).to_bytes(8, "little") + header)
    assert why is not None and "header is not valid JSON" in why and "nested deeper" in why


def test_a_deep_yaml_member_is_refused_by_safe_yaml(run, tmp_path):
    path = reseal(run.bundle, tmp_path / "deep-yaml.zip",
                  files={"masks.yaml": ("rules: " + "[" * DEEP + "]" * DEEP + "\n").encode()})
    report = verify_bundle(path)
    assert not report.ok and [c.check for c in report.checks if not c.ok] == ["formats"]
    assert "masks.yaml" in report.reason and "not valid YAML" in report.reason


def test_listing_bundles_reads_each_manifest_within_the_same_bounds(run, ws, tmp_path):
    folder = B.bundles_dir(ws)
    write_zip(folder / "deep.zip", _deep_manifest(run))
    entries = bundle_entries(run)
    data, crc, _ = gib_member()
    entries[MANIFEST] = (data, crc, entries[MANIFEST][2])
    raw_zip(folder / "liar.zip", entries)
    shutil.copy(run.bundle, folder / "good.zip")
    listed = {b.file: b for b in list_bundles(ws)}
    assert listed["good.zip"].problem is None and listed["good.zip"].name == "finance_risk"
    assert "nested deeper" in listed["deep.zip"].problem
    assert "'manifest.json' cannot be read from the zip: Bad CRC-32" in listed["liar.zip"].problem
