"""Promoted policies, shipped inside the ``core`` package (docs/design.md §9).

``core.govern.registry.promote`` writes an approved bundle into this folder as
``<name>/<version>/`` and records it in ``index.json`` (the active version and those a
rollback returns to); ``RWB_POLICIES_DIR`` or ``root=`` moves the folder.  ``load(name)`` is
the production entry point: the decision engine serving the promoted policy.
``load_bundle_for(name)`` is the verified bundle alone, checked against the index.

Details: docs/workspace.md (## The policies folder, ## The policies index, ## Loading a
promoted policy).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.govern.policy_folder import (ENV_ROOT, INDEX, INDEX_FORMAT, active_version, empty_index, load_bundle_for,
                                       policies_root, read_index)
from core.serve.serving import load as engine_for

if TYPE_CHECKING:  # pragma: no cover
    from core.serve.serving import DecisionEngine
    from core.records.store import Workspace


def load(name: str, *, root: str | Path | None = None, ws: "Workspace | None" = None,
         **options: Any) -> "DecisionEngine":
    """The decision engine serving the promoted policy ``name`` (``engine.decide(request)``):
    :func:`core.serve.serving.load` — ``ws`` keeps the audit trail and the review queue
    (default ``$RWB_WORKSPACE`` or ./workspace), ``options`` go to the engine."""
    return engine_for(name, ws=ws, root=root, **options)


__all__ = ["ENV_ROOT", "INDEX", "INDEX_FORMAT", "active_version", "empty_index", "load", "load_bundle_for",
           "policies_root", "read_index"]
