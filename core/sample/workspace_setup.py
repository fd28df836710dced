"""Setting a workspace up: create it and, when it is empty, import the sample datasets.

A first-time user should find episodes to look at straight away: :func:`init_workspace`
(``rwb workspace init``) and :func:`ensure_samples` import the committed finance and
e-commerce samples (generated with the same fixed seed when the checkout's ``datasets/`` is
absent) and put a few high-risk steps on the review queue (:func:`queue_sample_reviews`).

Details: docs/workspace.md (## Sample datasets).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.access.keys import signing_key
from core.access.users import Actor
from core.data import datasets
from core.data.importers.api import seed_file
from core.guard import review
from core.records.store import DatasetInfo, Workspace

#: Dataset name of each domain's sample inside a workspace.
SAMPLE_DATASETS: dict[str, str] = {"ecommerce": "ecommerce-sample", "finance": "finance-sample"}


@dataclass
class SampleFile:
    """Where one domain's sample episodes come from."""

    domain: str
    dataset: str
    path: Path
    #: True when the file was generated because the checkout's copy was missing.
    generated: bool


@dataclass
class WorkspaceStatus:
    """What ``init_workspace`` found and did."""

    root: str
    schema_version: int
    datasets: list[DatasetInfo]
    #: ``ImportResult.to_dict()`` of every sample imported by this call (empty when none was needed).
    imported: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "schema_version": self.schema_version,
                "datasets": [asdict(d) for d in self.datasets], "imported": self.imported}


def sample_sources(ws: Workspace) -> list[SampleFile]:
    """The sample file of every domain: the checkout's committed copy, or one generated
    into ``artifacts/samples/`` with the generator's fixed sample seed when it is missing."""
    committed = {path.parent.name: path for path in datasets.sample_files()}
    specs = {spec.domain: spec for spec in datasets.SAMPLES}
    sources = []
    for domain, dataset in sorted(SAMPLE_DATASETS.items()):
        path = committed.get(domain)
        if path is not None and path.is_file():
            sources.append(SampleFile(domain, dataset, path, generated=False))
            continue
        out = ws.artifact_dir("samples", domain) / "sample.jsonl"
        if not out.is_file():
            spec = specs[domain]
            generated = datasets.generate(domain, spec.episodes, spec.seed)
            # Write beside the target and rename: a crash never leaves half a sample behind.
            tmp = out.with_name(f".sample.jsonl.{os.getpid()}.tmp")
            datasets.write_jsonl(generated, tmp)
            os.replace(tmp, out)
        sources.append(SampleFile(domain, dataset, out, generated=True))
    return sources


def ensure_samples(ws: Workspace) -> list[Any]:
    """Import the sample datasets when the workspace has no dataset yet.

    Returns the ``ImportResult`` of each file imported, or ``[]`` when the workspace
    already had data (it is never touched then).  Both files go in one transaction,
    so a failure leaves the workspace empty and the next call tries again.  Seeding is
    part of setting the workspace up, so no acting user is checked (see
    :func:`core.data.importers.api.seed_file`)."""
    if ws.datasets(include_archived=True) or _had_datasets(ws):
        return []
    sources = sample_sources(ws)
    with ws.transaction() as conn:
        # Checked again under the write lock: two app sessions starting together
        # must not both import.
        if conn.execute("SELECT 1 FROM datasets LIMIT 1").fetchone() is not None or _had_datasets(ws):
            return []
        results = [seed_file(ws, src.path, format="rwb", dataset=src.dataset) for src in sources]
    queue_sample_reviews(ws, [src.dataset for src in sources])
    return results


def _had_datasets(ws: Workspace) -> bool:
    """Whether someone deleted a dataset here: a workspace emptied on purpose is not new."""
    return ws.conn.execute("SELECT 1 FROM dataset_events WHERE event = 'deleted' LIMIT 1").fetchone() is not None


#: The principal that queues the sample workspace's review items (no person acts).
SAMPLE_SETUP = Actor.service("workspace-setup")


def queue_sample_reviews(ws: Workspace, datasets: list[str]) -> list[int]:
    """Put the steps :func:`core.guard.review.sample_review_steps` picks from each sample dataset
    (high-risk actions in episodes that failed) on the review queue, so a new analyst
    finds the queue working.  Steps already on the queue are left as they are, so a second
    call adds nothing; returns the ids of the items this call added.  Part of setting the
    workspace up: the service principal :data:`SAMPLE_SETUP` queues them."""
    requests = [review.recorded_step_request(step, review.sample_review_reason(step),
                                             {"picked_by": "sample workspace set-up"})
                for dataset in datasets for step in review.sample_review_steps(ws, dataset)]
    if not requests:
        return []
    before = {row[0] for row in ws.conn.execute("SELECT id FROM review_items")}
    return [i for i in review.enqueue_many(ws, SAMPLE_SETUP, requests) if i not in before]


def init_workspace(ws: Workspace, *, samples: bool = True) -> WorkspaceStatus:
    """Create/migrate the workspace (opening it does), make its bundle-signing key (once:
    :func:`core.access.keys.signing_key`) and import the samples into an empty one; what the app
    does on first start and ``rwb workspace init`` does."""
    signing_key(ws)
    imported = [r.to_dict() for r in ensure_samples(ws)] if samples else []
    return workspace_status(ws, imported)


def workspace_status(ws: Workspace, imported: list[dict[str, Any]] | None = None) -> WorkspaceStatus:
    """Folder, schema version and datasets of a workspace (``rwb workspace info``)."""
    return WorkspaceStatus(root=str(ws.root), schema_version=ws.schema_version(),
                           datasets=ws.datasets(), imported=list(imported or []))


__all__ = ["SAMPLE_DATASETS", "SAMPLE_SETUP", "SampleFile", "WorkspaceStatus", "ensure_samples",
           "init_workspace", "queue_sample_reviews", "sample_sources", "workspace_status"]
