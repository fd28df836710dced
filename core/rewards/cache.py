"""On-disk cache of component columns, so a weight edit never recomputes a component.

One ``.npy`` file per (frame content, component class, class version, parameters)
under ``artifacts/reward_matrix/<frame hash>/``, with a JSON sidecar saying what
it holds.  The frame hash covers the episodes' content hashes and the catalog
version; parameters are hashed with their defaults filled in, so ``{}`` and the
explicit defaults share an entry.  Files are written to a temporary name and
renamed (never half-written) and read with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from core.rewards.components import EMBEDDING_MODEL, Component
from core.rewards.frame import StepsFrame


def component_key(frame: StepsFrame, comp: Component, criteria_digest: str = "") -> str:
    """Cache key of one component column for one frame (and, for a component that reads task
    criteria, the digest of the criteria it was given)."""
    body = {"frame": frame.content_hash, "catalog": frame.catalog_version,
            "n": [frame.n_steps, frame.n_episodes], "component": comp.name,
            "version": comp.version, "params": comp.params()}
    if comp.uses_embeddings:
        body["model"] = EMBEDDING_MODEL
    if getattr(comp, "uses_criteria", False):
        body["criteria"] = criteria_digest
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class ComponentCache:
    """Component columns on disk (see the module docstring)."""

    def __init__(self, root: str | Path, criteria_digest: str = ""):
        self.root = Path(root)
        self.stats = {"hits": 0, "misses": 0}
        #: Digest of the task criteria the scoring context holds ("" for none)
        self.criteria_digest = criteria_digest

    @classmethod
    def for_workspace(cls, ws, criteria_digest: str = "") -> "ComponentCache":
        """The cache inside a workspace's artifacts folder."""
        return cls(ws.artifact_dir("reward_matrix"), criteria_digest)

    def _path(self, frame: StepsFrame, key: str) -> Path:
        return self.root / frame.content_hash[:24] / f"{key}.npy"

    def get(self, frame: StepsFrame, comp: Component) -> np.ndarray | None:
        """The cached column, or None when absent (or unreadable: it is then rewritten)."""
        path = self._path(frame, component_key(frame, comp, self.criteria_digest))
        expected = frame.n_episodes if comp.scope == "episode" else frame.n_steps
        try:
            values = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            self.stats["misses"] += 1
            return None
        if values.shape != (expected,) or values.dtype != np.float64:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        return values

    def put(self, frame: StepsFrame, comp: Component, values: np.ndarray) -> Path:
        """Store a column (atomically)."""
        key = component_key(frame, comp, self.criteria_digest)
        path = self._path(frame, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}.{threading.get_ident()}"  # concurrent writers never share a temp file
        tmp = path.with_name(f".{path.name}.{tag}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(values, dtype=np.float64), allow_pickle=False)
        os.replace(tmp, path)
        meta = {"component": comp.name, "version": comp.version, "params": comp.params(),
                "frame": frame.content_hash, "catalog": frame.catalog_version,
                "n_steps": frame.n_steps, "n_episodes": frame.n_episodes,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tmp_meta = path.with_name(f".{key}.json.{tag}.tmp")
        tmp_meta.write_text(json.dumps(meta, sort_keys=True, default=str))
        os.replace(tmp_meta, path.with_suffix(".json"))
        return path
