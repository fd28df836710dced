"""Promoted policies, shipped inside the ``core`` package (DESIGN.md §9).

``core.registry.promote`` writes an approved bundle into this folder as
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
decision engine (:class:`core.serving.DecisionEngine`) serving the promoted policy.
``load_bundle_for(name)`` is the verified :class:`core.bundle.LoadedBundle` alone (what
the engine is built on, and what a script that only needs the policy loads).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.bundle import LoadedBundle
    from core.serving import DecisionEngine
    from core.store import Workspace

INDEX = "index.json"
INDEX_FORMAT = 1
ENV_ROOT = "RWB_POLICIES_DIR"


def policies_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$RWB_POLICIES_DIR``, else this package folder (``core/policies``)."""
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else Path(__file__).resolve().parent


def empty_index() -> dict[str, Any]:
    return {"rwb_policies": INDEX_FORMAT, "policies": {}}


def read_index(root: str | Path | None = None) -> dict[str, Any]:
    """The index of promoted policies (an empty one when the folder has none yet)."""
    path = policies_root(root) / INDEX
    if not path.is_file():
        return empty_index()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"the policies index is unreadable: {exc}", file=str(path)) from None
    if not isinstance(data, dict) or data.get("rwb_policies") != INDEX_FORMAT or \
            not isinstance(data.get("policies"), dict):
        raise InputError("not a Reward Workbench policies index (rwb_policies: 1)", file=str(path))
    return data


def active_version(name: str, root: str | Path | None = None) -> str:
    """The version of ``name`` that production serves (InputError when none is promoted)."""
    entry = read_index(root)["policies"].get(name)
    if not entry or not entry.get("active"):
        known = ", ".join(sorted(read_index(root)["policies"])) or "none"
        raise InputError(f"no promoted policy named {name!r} in {policies_root(root)} (promoted: {known}); "
                         "promote one with `rwb registry promote NAME VERSION`", field="name")
    return str(entry["active"])


def load_bundle_for(name: str, *, root: str | Path | None = None, version: str | None = None,
                    trust: Mapping[str, bytes] | None = None) -> "LoadedBundle":
    """The verified bundle of ``name``'s active version (or ``version``, one the index
    lists).  Refused when verification fails (a missing or invalid signature, or — with
    ``trust``, a workspace's trust store — one by an untrusted key), when it is not
    ``name@version``, or when its manifest is not the one the index recorded at promotion.
    Serving (core.serving) passes its workspace's trust store and also checks the digest
    its registry recorded; the index alone is a file anyone who can write the folder can
    edit."""
    from core.bundle import BundleError, load_bundle

    base = policies_root(root)
    entry = read_index(root)["policies"].get(name) or {}
    version = version or active_version(name, root)
    recorded = (entry.get("versions") or {}).get(version)
    if recorded is None:
        raise InputError(f"version {version!r} of {name!r} was never promoted into {base}", field="version")
    bundle = load_bundle(base / name / version, trust=trust)
    if (bundle.name, bundle.version) != (name, version):
        raise BundleError(f"the folder {name}/{version} holds {bundle.policy_version}", file=str(base / name / version))
    if bundle.manifest.digest != recorded.get("manifest_digest"):
        raise BundleError(f"{name} {version} in {base} is not the bundle that was promoted (its manifest "
                          "digest differs from the index)", file=str(base / name / version))
    return bundle


def load(name: str, *, root: str | Path | None = None, ws: "Workspace | None" = None,
         **options: Any) -> "DecisionEngine":
    """The decision engine serving the promoted policy ``name`` (``engine.decide(request)``):
    :func:`core.serving.load` — ``ws`` keeps the audit trail and the review queue
    (default ``$RWB_WORKSPACE`` or ./workspace), ``options`` go to the engine."""
    from core.serving import load as engine_for

    return engine_for(name, ws=ws, root=root, **options)


__all__ = ["ENV_ROOT", "INDEX", "active_version", "empty_index", "load", "load_bundle_for", "policies_root",
           "read_index"]
