"""The labelled real runs copied into datasets/real, and importing them through ``rwb``."""

from __future__ import annotations

from pathlib import Path

from core.cli import main

REAL = Path(__file__).resolve().parents[1] / "datasets" / "real"


def rwb_import_labelled(ws: str, name: str, dataset: str) -> None:
    """``rwb episodes import`` a labelled tau2 run file (outcome and id keys as its README says)."""
    assert main(["--workspace", ws, "episodes", "import", str(REAL / name / "episodes.jsonl"),
                 "--reward-key", "outcome", "--id-key", "id", "--dataset", dataset, "--json"]) == 0
