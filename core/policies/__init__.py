"""Promoted policies, shipped inside the ``core`` package (docs/design.md §9).

``core.govern.registry.promote`` writes an approved bundle into this folder as
``<name>/<version>/`` (the bundle's files, flat, with its approvals mirrored into the
manifest) and records it in ``index.json``::

    {"rwb_policies": 1,
     "policies": {"finance_risk": {"active": "0.2.0", "previous": ["0.1.0"],
                                   "versions": {"0.2.0": {"manifest_digest": "…", "promoted_at": "…",
                                                          "promoted_by": "…", "run_id": "…"}, …},
                                   "updated_at": "…"}}}

``active`` is the version production serves; ``previous`` the versions a rollback returns
to, most recent first.  Because the folder is part of the package, the ``core`` that
production installs carries the promoted policy: ``load_bundle_for("finance_risk")``
verifies the active version (every hash, no pickle, smoke run) and checks that its
manifest is the one the index recorded at promotion.

The folder can be moved with the ``RWB_POLICIES_DIR`` environment variable (tests do, so
they never write into the source tree), or per call with ``root=``.

``load(name)`` is the production entry point (``from core.policies import load``): the
decision engine (:class:`core.serve.serving.DecisionEngine`) serving the promoted policy.
``load_bundle_for(name)`` is the verified :class:`core.govern.bundle.LoadedBundle` alone (what
the engine is built on, and what a script that only needs the policy loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.govern.policy_folder import (ENV_ROOT, INDEX, INDEX_FORMAT, active_version, empty_index, load_bundle_for,
                                       policies_root, read_index)

if TYPE_CHECKING:  # pragma: no cover
    from core.serve.serving import DecisionEngine
    from core.records.store import Workspace


def load(name: str, *, root: str | Path | None = None, ws: "Workspace | None" = None,
         **options: Any) -> "DecisionEngine":
    """The decision engine serving the promoted policy ``name`` (``engine.decide(request)``):
    :func:`core.serve.serving.load` — ``ws`` keeps the audit trail and the review queue
    (default ``$RWB_WORKSPACE`` or ./workspace), ``options`` go to the engine."""
    from core.serve.serving import load as engine_for  # deferred: reading the index needs no torch

    return engine_for(name, ws=ws, root=root, **options)


__all__ = ["ENV_ROOT", "INDEX", "INDEX_FORMAT", "active_version", "empty_index", "load", "load_bundle_for",
           "policies_root", "read_index"]
