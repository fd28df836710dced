"""Preparing a workspace before the app serves it, so that every page opens at once.

Scoring a dataset from scratch is slow, because the text components embed every tool
output with the sentence model.  :func:`prepare_workspace` does that work ahead, where a
progress display can show it (``rwb app`` at start, ``rwb workspace prepare``): it sets the
workspace up and scores every sample dataset with the latest version of every template,
leaving the component columns and text embeddings in the workspace, keyed by content, so
a second call computes nothing and an edited template is prepared again.

Details: docs/workspace.md (## Warm-up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core import rewards
from core.base.embed import DIM, Embedder
from core.base.embed_store import SAMPLE_STORE_FOLDER, SharedEmbeddings, packaged_model_digest
from core.base.errors import InputError, RwbError
from core.base.package_data import datasets_dir
from core.records.store import Workspace
from core.rewards.versions import get_template, resolve_template, template_names
from core.sample.workspace_setup import SAMPLE_DATASETS, init_workspace



@dataclass(frozen=True)
class PrepareProgress:
    """One step of the preparation, for a progress display."""

    #: "workspace" (set-up and sample import), "score" (one dataset and template) or
    #: "embedding" (texts sent through the sentence model within a score).
    stage: str
    #: Scorings finished so far and planned in all (0 and 0 in the "workspace" stage).
    done: int
    total: int
    dataset: str = ""
    template: str = ""
    #: Within the "embedding" stage: texts embedded so far and in all.
    texts_done: int = 0
    texts_total: int = 0

    @property
    def text(self) -> str:
        """One line saying where the preparation is."""
        if self.stage == "workspace":
            return "setting up the workspace (an empty one gets the sample datasets)"
        where = f"[{self.done + 1}/{self.total}] scoring {self.dataset} with {self.template}"
        if self.stage == "embedding":
            return f"{where}: embedding texts {self.texts_done}/{self.texts_total}"
        return where


@dataclass
class PreparedScoring:
    """What preparing one (dataset, template) pair did."""

    dataset: str
    template: str
    #: Components computed now (empty when every column was already in the workspace).
    computed: list[str]
    #: Components read from the workspace's cache.
    cached: list[str]
    #: Texts the sentence model embedded now (0 when every text was in the embeddings cache).
    embedded: int
    seconds: float
    #: Why the pair could not be scored (the page shows the same message when it is picked).
    error: str | None = None


@dataclass
class PrepareReport:
    """What :func:`prepare_workspace` found and did."""

    root: str
    #: ``ImportResult.to_dict()`` of each sample dataset imported by this call.
    imported: list[dict[str, Any]]
    scorings: list[PreparedScoring] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def did_work(self) -> bool:
        """True when this call imported a dataset or computed a component."""
        return bool(self.imported) or any(s.computed for s in self.scorings)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "imported": self.imported, "did_work": self.did_work,
                "scorings": [asdict(s) for s in self.scorings], "seconds": round(self.seconds, 3)}


def sample_datasets(ws: Workspace) -> list[str]:
    """The sample datasets the workspace holds, with steps, in the order pages list them."""
    samples = set(SAMPLE_DATASETS.values())
    return [d.name for d in ws.datasets() if d.name in samples and d.n_steps > 0]


def latest_templates(ws: Workspace) -> list[str]:
    """``name@N`` of the latest version of every reward template (shipped or saved)."""
    return [get_template(ws, name).label for name in template_names(ws)]


def prepare_workspace(ws: Workspace, *, datasets: Sequence[str] | None = None,
                      templates: Sequence[str] | None = None,
                      progress: Callable[[PrepareProgress], None] | None = None) -> PrepareReport:
    """Set the workspace up and score ``datasets`` (default: its sample datasets) with
    ``templates`` (default: the latest version of every template), keeping the component
    columns and text embeddings in the workspace (docs/workspace.md, "Warm-up").

    A dataset or template given by name that the workspace does not hold is refused with
    :class:`~core.base.errors.InputError` before any work.  A pair that cannot be scored (a
    template whose components need fields the data lacks) is reported with its error, not
    raised: the other pairs are still prepared.  ``progress`` receives a
    :class:`PrepareProgress` before each step and as texts are embedded."""
    t0 = time.perf_counter()
    tell = progress or (lambda _event: None)
    tell(PrepareProgress("workspace", 0, 0))
    status = init_workspace(ws)
    known = [d.name for d in ws.datasets()]
    names = list(datasets) if datasets is not None else sample_datasets(ws)
    for name in names:
        if name not in known:
            raise InputError(f"no dataset named {name!r} in the workspace", field="dataset",
                             allowed=known)
    specs = list(templates) if templates is not None else latest_templates(ws)
    chosen = {spec: resolve_template(ws, spec) for spec in specs}
    report = PrepareReport(root=str(ws.root), imported=list(status.imported))
    total = len(names) * len(specs)
    for d, dataset in enumerate(names):
        frame = rewards.load_frame(ws, dataset)   # once per dataset: every template scores it
        for k, spec in enumerate(specs):
            i = d * len(specs) + k
            tell(PrepareProgress("score", i, total, dataset, spec))

            def on_score(event: dict[str, Any], i: int = i, dataset: str = dataset, spec: str = spec) -> None:
                if event.get("stage") == "embedding":
                    tell(PrepareProgress("embedding", i, total, dataset, spec,
                                         texts_done=event["done"], texts_total=event["total"]))

            start = time.perf_counter()
            try:
                result = rewards.score(ws, chosen[spec], frame=frame, progress=on_score)
            except RwbError as exc:
                report.scorings.append(PreparedScoring(dataset, spec, [], [], 0,
                                                       time.perf_counter() - start, error=str(exc)))
                continue
            report.scorings.append(PreparedScoring(
                dataset, spec, computed=list(result.matrix.computed), cached=list(result.matrix.cached),
                embedded=int(result.matrix.embed_stats.get("encoded", 0)),
                seconds=time.perf_counter() - start))
    report.seconds = time.perf_counter() - t0
    return report


@dataclass(frozen=True)
class SampleEmbeddings:
    """What :func:`write_sample_embeddings` wrote for one sample dataset."""

    domain: str
    #: The store's folder (``<out>/<domain>/embeddings/<model digest>``)
    folder: str
    texts: int


def write_sample_embeddings(out: Path | None = None, *, work_dir: Path,
                            progress: Callable[[PrepareProgress], None] | None = None) -> list[SampleEmbeddings]:
    """Write the embeddings store each sample dataset ships (docs/workspace.md, "The shared
    embedding store"): for each domain, a new workspace under ``work_dir`` is prepared with
    that sample alone, and every text it embedded becomes the pack ``sample`` of
    ``<out>/<domain>/embeddings/`` (``out`` default: the shipped datasets folder), replacing
    what the store held for the packaged model."""
    root = Path(out) if out is not None else datasets_dir()
    digest = packaged_model_digest()
    written = []
    for domain, dataset in sorted(SAMPLE_DATASETS.items()):
        ws = Workspace.open(Path(work_dir) / f"{domain}-workspace")
        try:
            prepare_workspace(ws, datasets=[dataset], progress=progress)
            hashes, vectors = Embedder(ws.artifact_dir("embeddings"), shared=None).cached()
        finally:
            ws.close()
        store = SharedEmbeddings(root / domain / SAMPLE_STORE_FOLDER, digest, DIM)
        if not store.add(hashes, vectors, name="sample"):   # replaces sample.npy/.keys whole
            raise RwbError(f"could not write the embeddings store of the {domain} sample into {store.folder}")
        for other in store.folder.iterdir():                 # packs of earlier writers, if any
            if other.name not in ("sample.npy", "sample.keys"):
                other.unlink()
        written.append(SampleEmbeddings(domain, str(store.folder), len(hashes)))
    return written


__all__ = ["PrepareProgress", "PrepareReport", "PreparedScoring", "SampleEmbeddings", "latest_templates",
           "prepare_workspace", "sample_datasets", "write_sample_embeddings"]
