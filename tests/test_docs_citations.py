"""Every citation of the design, the source documents and the docs resolves.

Code and docs cite ``docs/X.md``, ``docs/design.md §N``, the source documents as
``S000 §2.2`` or a bare ``S001`` (their reference is docs/seeds.md), and docs/seeds.md,
docs/glossary.md and docs/design.md name where things live as a backticked path, optionally
followed by a backticked name in that file.  A citation of a section, file or name that
does not exist fails here, with the file and line that cite it.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Folders whose files may cite, and the files at the root that may.
SCANNED_DIRS = ("core", "app", "pages", "benchmarks", "docs", "reward_templates")
SCANNED_FILES = ("README.md",)
SCANNED_SUFFIXES = (".py", ".yaml", ".yml", ".md", ".sh", ".toml")
#: Docs that say where a thing lives in the repository; their locations are checked too.
LOCATING_DOCS = ("seeds.md", "glossary.md", "design.md")

SECTION = r"\d+(?:\.\d+)*"
#: One or more sections: "§5", "§5, §10", "§2.2-2.3", "§2.2, §2.3, §5.2".
SECTIONS = rf"§{SECTION}(?:(?:, ?§|[-–]§?){SECTION})*"
DOC_FILE = re.compile(r"\bdocs/([a-z_]+)\.md\b")
DESIGN_CITE = re.compile(rf"\bdesign\.md ({SECTIONS})")
SEED_CITE = re.compile(rf"\b(S00\d)\b(?: ({SECTIONS}))?")
LOCATION = re.compile(
    r"`((?:core|app|pages|benchmarks|reward_templates|datasets|tests|notebooks)/[\w./*-]*)`"
    r"(?:\s+`([A-Za-z_][\w.]*)`)?")
DESIGN_HEADING = re.compile(r"^(?:## (\d+)\.|### (\d+\.\d+)) ", re.M)
SEED_HEADING = re.compile(rf"^#{{2,3}} (S00\d)\b(?: §({SECTION}))?", re.M)


@dataclass(frozen=True)
class Citation:
    """One cited thing, where it is cited."""

    where: str
    line: int
    text: str


def sections_of(cited: str) -> list[str]:
    """The section numbers in "§5, §10" or "§2.2-2.3"."""
    return re.findall(SECTION, cited)


def design_sections(text: str) -> set[str]:
    """Section numbers of docs/design.md's "## N." and "### N.M" headings."""
    return {a or b for a, b in DESIGN_HEADING.findall(text)}


def seed_sections(text: str) -> dict[str, set[str]]:
    """For each source document with a heading in docs/seeds.md, its section numbers."""
    out: dict[str, set[str]] = {}
    for doc, section in SEED_HEADING.findall(text):
        out.setdefault(doc, set())
        if section:
            out[doc].add(section)
    return out


def has_section(known: set[str], section: str) -> bool:
    """A section resolves to its own heading; a chapter ("3") also to one of its sections ("3.1")."""
    return section in known or ("." not in section and any(k.startswith(section + ".") for k in known))


@dataclass(frozen=True)
class Targets:
    """What a citation may point to: design.md's sections, seeds.md's sections per source
    document, and the names of the files in docs/."""

    design: set[str]
    seeds: dict[str, set[str]]
    doc_names: set[str]

    @classmethod
    def of(cls, docs: Path) -> "Targets":
        return cls(design=design_sections((docs / "design.md").read_text(encoding="utf-8")),
                   seeds=seed_sections((docs / "seeds.md").read_text(encoding="utf-8")),
                   doc_names={p.stem for p in docs.glob("*.md")})


def unresolved(where: str, text: str, targets: Targets) -> list[Citation]:
    """The citations in ``text`` (of file ``where``) that do not resolve."""
    design, seeds, doc_names = targets.design, targets.seeds, targets.doc_names
    bad: list[Citation] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for m in DOC_FILE.finditer(line):
            if m.group(1) not in doc_names:
                bad.append(Citation(where, number, m.group(0)))
        for m in DESIGN_CITE.finditer(line):
            if not all(has_section(design, s) for s in sections_of(m.group(1))):
                bad.append(Citation(where, number, m.group(0)))
        for m in SEED_CITE.finditer(line):
            doc, cited = m.group(1), m.group(2)
            if doc not in seeds or (cited and not all(has_section(seeds[doc], s) for s in sections_of(cited))):
                bad.append(Citation(where, number, m.group(0)))
    return bad


def missing_locations(where: str, text: str, root: Path) -> list[Citation]:
    """Backticked paths in ``text`` that do not exist under ``root``, and names said to be in a
    file that the file does not contain (every dotted part is looked for as a word)."""
    bad: list[Citation] = []
    for m in LOCATION.finditer(text):
        path, name = m.group(1), m.group(2)
        number = text.count("\n", 0, m.start()) + 1
        matches = glob.glob(str(root / path))
        if not matches:
            bad.append(Citation(where, number, path))
            continue
        target = Path(matches[0])
        if name and "*" not in path and target.is_file():
            body = target.read_text(encoding="utf-8")
            if not all(re.search(rf"\b{re.escape(part)}\b", body) for part in name.split(".")):
                bad.append(Citation(where, number, f"{path} {name}"))
    return bad


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES]
    for folder in SCANNED_DIRS:
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.suffix in SCANNED_SUFFIXES and p.is_file() and "__pycache__" not in p.parts]
    return files


@pytest.fixture(scope="module")
def targets() -> Targets:
    return Targets.of(DOCS)


def test_every_citation_resolves(targets: Targets) -> None:
    bad: list[Citation] = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        bad += unresolved(str(path.relative_to(ROOT)), text, targets)
    assert not bad, "citations that resolve to nothing:\n" + "\n".join(
        f"  {c.where}:{c.line}: {c.text}" for c in bad)


def test_code_cites_the_source_documents_and_the_design() -> None:
    """The scan finds the citations the code is known to make (a scan that finds nothing passes vacuously)."""
    text = (ROOT / "core/serve/serving.py").read_text(encoding="utf-8")
    assert any(m.group(2) == "§2.2" for m in SEED_CITE.finditer(text))
    assert any(m.group(1) == "§9" for m in DESIGN_CITE.finditer(text))
    found = {m.group(1) for p in scanned_files() if p.parts[len(ROOT.parts)] == "core"
             for m in SEED_CITE.finditer(p.read_text(encoding="utf-8", errors="replace"))}
    assert found >= {"S000", "S001", "S004"}


def test_every_documented_location_exists() -> None:
    bad: list[Citation] = []
    for name in LOCATING_DOCS:
        bad += missing_locations(f"docs/{name}", (DOCS / name).read_text(encoding="utf-8"), ROOT)
    assert not bad, "paths or names the docs point to that do not exist:\n" + "\n".join(
        f"  {c.where}:{c.line}: {c.text}" for c in bad)


def test_seeds_has_a_section_per_source_document(targets: Targets) -> None:
    assert set(targets.seeds) == {"S000", "S001", "S004"}
    assert {"2.2", "3.1", "3.2", "3.3", "4.3", "5.1", "5.2", "5.3", "7.1"} <= targets.seeds["S000"]


def test_the_resolver_refuses_what_does_not_exist(targets: Targets) -> None:
    text = ("see docs/design.md §42 and docs/design.md §9, §77\n"
            "per S000 §9.9, S000 §2.2-2.9 and S003\n"
            "as docs/no_such_doc.md says\n"
            "fine: docs/design.md §2.1, S000 §2.2, §3.3, S001, docs/seeds.md, S000 §3\n")
    bad = unresolved("made-up.py", text, targets)
    assert [(c.line, c.text) for c in bad] == [
        (1, "design.md §42"), (1, "design.md §9, §77"),
        (2, "S000 §9.9"), (2, "S000 §2.2-2.9"), (2, "S003"),
        (3, "docs/no_such_doc.md")]


def test_the_location_check_refuses_what_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "thing.py").write_text("class Thing:\n    limit: int = 3\n", encoding="utf-8")
    text = ("`core/thing.py` `Thing.limit` is fine, `core/thing.py` `Thing.ceiling` is not,\n"
            "nor is `core/gone.py`; `core/thing.py` alone is fine.\n")
    bad = missing_locations("made-up.md", text, tmp_path)
    assert [(c.line, c.text) for c in bad] == [(1, "core/thing.py Thing.ceiling"), (2, "core/gone.py")]
