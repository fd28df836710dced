"""The promoted-policies folder: where it is, its ``index.json``, and the verified bundle of
a promoted version (see :mod:`core.policies` for the layout).  The registry and serving read
the folder through this module, which sits below both; :func:`core.policies.load`, above
serving, builds an engine on it."""


from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.base.errors import InputError
from core.govern.bundle import BundleError, load_bundle

if TYPE_CHECKING:  # pragma: no cover
    from core.govern.bundle import LoadedBundle

INDEX = "index.json"
INDEX_FORMAT = 1
ENV_ROOT = "RWB_POLICIES_DIR"


def policies_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$RWB_POLICIES_DIR``, else the ``core/policies`` package folder."""
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "policies"


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
    Serving (core.serve.serving) passes its workspace's trust store and also checks the digest
    its registry recorded; the index alone is a file anyone who can write the folder can
    edit."""
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


__all__ = ["ENV_ROOT", "INDEX", "INDEX_FORMAT", "active_version", "empty_index", "load_bundle_for", "policies_root",
           "read_index"]
