"""Datasets: synthetic recorded episodes for the built-in domains, the committed samples,
and the life of a workspace's datasets (list, archive, restore, delete).

Two domains, ``finance`` and ``ecommerce``, each with tool schemas under
``datasets/<domain>/tools.json`` and behaviours that include a reward hack with an honest twin
per hacking episode.  :func:`generate` builds a dataset deterministically (the same domain,
size and seed give a byte-identical file) and :func:`write_jsonl` writes it; the worlds and
behaviours live in :mod:`core.data.datagen`.

:func:`archive_dataset` hides a dataset from every picker and keeps its data;
:func:`delete_dataset` removes it with its episodes, labels and cached files.  Both are refused,
with what depends on the dataset named, while a training run, a tuning study or a registered
policy needs it (:func:`dataset_dependents`); each one, refused or done, is a row of the
append-only ``dataset_events`` table (:func:`dataset_events`).

Details: docs/datasets.md (## The two domains, ## A generated step's observation,
## Reproducible random numbers, ## Archiving and deleting a dataset).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from core.access.audit import now_iso, security_event
from core.access.users import Actor, authorize
from core.base import package_data
from core.data.datagen import common, ecommerce, finance
from core.records.episodes import Episode, ToolSchema
from core.records.store import Workspace
from core.base.errors import ConflictError, InputError, RwbError

#: Bumped whenever a change to the generators changes their output for a given seed.
GENERATOR_VERSION = 2

_MODULES = {"finance": finance, "ecommerce": ecommerce}
DOMAINS: tuple[str, ...] = tuple(_MODULES)
_ID_PREFIX = {"finance": "fin", "ecommerce": "ecom"}
#: Uniforms drawn per task (the task builders read at most this many columns).
_TASK_UNIFORMS = 48


@dataclass(frozen=True)
class SampleSpec:
    """How a committed sample file was generated."""

    domain: str
    episodes: int
    seed: int

    @property
    def path(self) -> Path:
        return datasets_dir() / self.domain / "sample.jsonl"


#: The committed samples; the test suite regenerates them and compares bytes.
SAMPLES: tuple[SampleSpec, ...] = (SampleSpec("finance", 250, 20240917), SampleSpec("ecommerce", 180, 20240918))


def datasets_dir() -> Path:
    """The shipped sample datasets, one folder per domain (``datasets/<domain>/`` in the
    checkout): tool schemas, mask rules and the committed samples."""
    return package_data.datasets_dir()


def sample_files() -> list[Path]:
    """The committed sample episode files, one per domain."""
    return [spec.path for spec in SAMPLES]


def _check_domain(domain: str) -> Any:
    if domain not in _MODULES:
        raise InputError(f"unknown domain {domain!r}; choose one of: {', '.join(DOMAINS)}", field="domain")
    return _MODULES[domain]


def load_tools(domain: str) -> list[ToolSchema]:
    """The domain's committed tool schemas (``datasets/<domain>/tools.json``)."""
    _check_domain(domain)
    path = datasets_dir() / domain / "tools.json"
    if not path.exists():
        raise RwbError(f"tool schemas for {domain!r} not found at {path}; reinstall Reward Workbench "
                       f"(its sample datasets ship with it)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return [ToolSchema.model_validate(t) for t in raw]
    except (ValueError, TypeError) as exc:
        raise InputError(f"invalid tool schemas: {exc}", file=str(path)) from exc


# --------------------------------------------------------------------------- generated data

@dataclass
class GeneratedDataset:
    """Episodes of one generated file, kept as canonical JSON objects.

    ``records`` are exactly ``Episode.model_dump(mode="json")`` of each episode, so a
    file is written without a pydantic round trip; :attr:`episodes` validates them
    (once) into :class:`~core.records.episodes.Episode` objects."""

    domain: str
    tools: list[ToolSchema]
    records: list[dict[str, Any]]
    seed: int
    seconds: float = 0.0

    @cached_property
    def episodes(self) -> list[Episode]:
        """The episodes, validated by the Episode schema."""
        return [Episode.model_validate(r) for r in self.records]

    @property
    def n_steps(self) -> int:
        return sum(len(r["steps"]) for r in self.records)

    def header(self) -> dict[str, Any]:
        """The rwb JSONL header object (format version, domain, tool schemas)."""
        return _header(self.domain, self.tools)

    def lines(self) -> Iterator[str]:
        """The rwb JSONL lines: header first, then one canonical episode per line."""
        yield common.dumps(self.header())
        for r in self.records:
            yield common.dumps(r)


#: Episodes built per chunk: bounds memory when a large file is streamed to disk.
CHUNK_EPISODES = 4096


def _check_size(n_episodes: Any, seed: Any) -> None:
    if isinstance(n_episodes, bool) or not isinstance(n_episodes, int) or n_episodes < 1:
        raise InputError(f"--episodes must be a positive integer, got {n_episodes!r}", field="episodes")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"--seed must be an integer, got {seed!r}", field="seed")


def _tool_dicts(domain: str, module: Any) -> tuple[list[ToolSchema], dict[str, dict[str, Any]]]:
    tools = load_tools(domain)
    tool_dicts = {t.name: t.model_dump(mode="json") for t in tools}
    missing = module.TOOLS_USED - set(tool_dicts)
    if missing:
        raise RwbError(f"datasets/{domain}/tools.json lacks tools the {domain} generator uses: "
                       f"{', '.join(sorted(missing))}")
    return tools, tool_dicts


def _record_chunks(domain: str, n_episodes: int, seed: int, tool_dicts: dict[str, dict[str, Any]],
                   progress: Callable[[int, int], None] | None) -> Iterator[list[dict[str, Any]]]:
    """The episodes' canonical records in file order, ``chunk`` episodes at a time.

    Every random number is addressed by (seed, stream, index), so chunking does not
    change a single byte of the output."""
    module = _MODULES[domain]
    chunk = CHUNK_EPISODES
    plans = common.plan_episodes(n_episodes, module.SHARES, module.PAIRS, seed)
    n_tasks = 1 + max(p.task for p in plans)
    task_seeds = common.seeds53(common.stream_keys(seed, f"{domain}/task", n_tasks))
    episode_class = finance.FinanceEpisode if domain == "finance" else ecommerce.EcomEpisode
    prefix = f"{_ID_PREFIX[domain]}-s{seed}-"
    width = max(6, len(str(n_episodes - 1)))
    for a in range(0, n_episodes, chunk):
        part = plans[a:a + chunk]
        # A task depends on its task_seed alone, so twins (same seed) see the same task
        # even when they fall into different chunks.
        needed = sorted({p.task for p in part})
        seeds = [task_seeds[i] for i in needed]
        task_u = common.uniforms(np.array(seeds, dtype=np.uint64), _TASK_UNIFORMS)
        tasks = dict(zip(needed, module.build_tasks(seeds, task_u)))
        draws = common.episode_draws(seed, f"{domain}/episode", len(part), start=a)
        runs = []
        for plan, d in zip(part, draws):
            ep = episode_class(tasks[plan.task], plan.behaviour, d, tool_dicts)
            module.RUNNERS[plan.behaviour](ep)
            runs.append(ep)
        feats = np.array([module.features(ep) for ep in runs], dtype=np.float64)
        outcome_u = common.uniforms(common.stream_keys(seed, f"{domain}/outcome", len(part), start=a), 6)
        records = []
        for plan, ep, outcome in zip(part, runs, module.outcomes(feats, outcome_u)):
            # the domain's task class (FinanceTask, EcomTask) declares its fields as __slots__ only
            task: Any = ep.task
            meta: dict[str, Any] = {"task_seed": task.seed, "generator_seed": seed}
            if plan.twin is not None:
                meta["twin_of"] = f"{prefix}{plan.twin:0{width}d}"
            records.append(common.episode_record(
                episode_id=f"{prefix}{plan.position:0{width}d}", domain=domain, query=task.query,
                task_type=task.type, intents=task.intents, steps=ep.rec.steps, outcome=outcome,
                behaviour=plan.behaviour, meta=meta, record=plan.position))
        if progress is not None:
            progress(a + len(part), n_episodes)
        yield records


def generate(domain: str, n_episodes: int, seed: int,
             progress: Callable[[int, int], None] | None = None) -> GeneratedDataset:
    """Generate ``n_episodes`` recorded episodes of ``domain`` in memory (deterministic by
    ``seed``).  ``progress(done, total)`` is called after every chunk of episodes."""
    _check_domain(domain)
    _check_size(n_episodes, seed)
    started = time.perf_counter()
    tools, tool_dicts = _tool_dicts(domain, _MODULES[domain])
    records = [r for part in _record_chunks(domain, n_episodes, seed, tool_dicts, progress) for r in part]
    return GeneratedDataset(domain=domain, tools=tools, records=records, seed=seed,
                            seconds=time.perf_counter() - started)


def _header(domain: str, tools: list[ToolSchema]) -> dict[str, Any]:
    return {"rwb_header": {"version": 1, "domain": domain, "tools": [t.model_dump(mode="json") for t in tools]}}


def _write_lines(lines: Iterator[str], out: str | Path) -> Path:
    """Write lines to ``out`` all or nothing (temporary name, then rename)."""
    path = Path(out)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            for line in lines:
                fh.write(line)
                fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write the episode file: {exc.strerror or exc}", file=str(path),
                         field="out") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_jsonl(dataset: GeneratedDataset, out: str | Path) -> Path:
    """Write the dataset as rwb JSONL (header with the tool schemas, then one episode per
    line).  All or nothing: written to a temporary name next to ``out``, then renamed."""
    return _write_lines(dataset.lines(), out)


# --------------------------------------------------------------------------- summaries

@dataclass(frozen=True)
class BehaviourOutcome:
    """The outcomes of one behaviour's episodes in a generated dataset."""

    episodes: int
    #: Means over its episodes (rounded to 4 decimals); ``resolved_rate`` is the share resolved
    final_reward_mean: float
    business_metric_mean: float
    resolved_rate: float
    sentiment_mean: float


@dataclass(frozen=True)
class DatasetSummary:
    """Counts and per-behaviour outcome figures of a generated dataset (:func:`summarize`)."""

    domain: str
    seed: int
    episodes: int
    steps: int
    #: Steps that call a tool, and those whose call failed
    tool_calls: int
    tool_errors: int
    #: How many tool schemas the domain has
    tools: int
    #: Episodes per behaviour and per task type, by name
    behaviours: dict[str, int]
    task_types: dict[str, int]
    #: Honest twins of hacking episodes
    twins: int
    outcome_by_behaviour: dict[str, BehaviourOutcome]
    #: Seconds the generation took
    seconds: float


@dataclass(frozen=True)
class GeneratedFile(DatasetSummary):
    """What :func:`generate_file` wrote: the figures of :class:`DatasetSummary` and the file."""

    #: The file, its size in bytes and the SHA-256 of its bytes
    out: str
    bytes: int
    sha256: str


class _Tally:
    """Running counts and outcome sums over chunks of records (for streamed files)."""

    def __init__(self) -> None:
        self.episodes = self.steps = self.tool_calls = self.tool_errors = self.twins = 0
        self.behaviours: Counter[str] = Counter()
        self.task_types: Counter[str] = Counter()
        self.sums: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(4))

    def add(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.episodes += 1
            self.steps += len(r["steps"])
            for s in r["steps"]:
                if s["action"]["kind"] == "tool_call":
                    self.tool_calls += 1
                    self.tool_errors += s["tool_error"] is not None
            self.behaviours[r["behaviour"]] += 1
            self.task_types[r["task"]["task_type"]] += 1
            self.twins += "twin_of" in r["meta"]
            o = r["outcome"]
            self.sums[r["behaviour"]] += (o["final_reward"], o["business_metric"], float(o["resolved"]),
                                          o["sentiment"])

    def result(self, domain: str, seed: int, n_tools: int, seconds: float) -> DatasetSummary:
        outcome = {}
        for b in sorted(self.behaviours):
            mean = self.sums[b] / self.behaviours[b]
            outcome[b] = BehaviourOutcome(episodes=self.behaviours[b], final_reward_mean=round(float(mean[0]), 4),
                                          business_metric_mean=round(float(mean[1]), 4),
                                          resolved_rate=round(float(mean[2]), 4),
                                          sentiment_mean=round(float(mean[3]), 4))
        return DatasetSummary(domain=domain, seed=seed, episodes=self.episodes, steps=self.steps,
                              tool_calls=self.tool_calls, tool_errors=self.tool_errors, tools=n_tools,
                              behaviours=dict(sorted(self.behaviours.items())),
                              task_types=dict(sorted(self.task_types.items())), twins=self.twins,
                              outcome_by_behaviour=outcome, seconds=round(seconds, 3))


def summarize(dataset: GeneratedDataset) -> DatasetSummary:
    """Counts and per-behaviour outcome figures (means of final reward, business metric,
    resolved rate, sentiment) of a generated dataset."""
    tally = _Tally()
    tally.add(dataset.records)
    return tally.result(dataset.domain, dataset.seed, len(dataset.tools), dataset.seconds)


def generate_file(domain: str, n_episodes: int, seed: int, out: str | Path,
                  progress: Callable[[int, int], None] | None = None,
                  behaviours: Sequence[str] | None = None) -> GeneratedFile:
    """Generate episodes straight into an rwb JSONL file (what ``rwb datasets generate``
    does); memory stays bounded by one chunk.  The bytes equal ``write_jsonl(generate(...))``.

    ``behaviours`` (names, or one comma-separated string) keeps only the episodes of those
    behaviours among the ``n_episodes`` generated — e.g. ``("noisy", "hacker")``: the logs of an imperfect agent, with no expert
    demonstration to imitate.  Returns the :func:`summarize` figures (of what was written)
    with the output path, size and sha256."""
    _check_domain(domain)
    _check_size(n_episodes, seed)
    keep = _check_behaviours(domain, behaviours)
    started = time.perf_counter()
    tools, tool_dicts = _tool_dicts(domain, _MODULES[domain])
    tally = _Tally()
    digest = hashlib.sha256()

    def lines() -> Iterator[str]:
        for line in [common.dumps(_header(domain, tools))]:
            digest.update(line.encode() + b"\n")
            yield line
        for part in _record_chunks(domain, n_episodes, seed, tool_dicts, progress):
            if keep is not None:
                part = [r for r in part if r["behaviour"] in keep]
            tally.add(part)
            for record in part:
                line = common.dumps(record)
                digest.update(line.encode() + b"\n")
                yield line

    path = _write_lines(lines(), out)
    summary = tally.result(domain, seed, len(tools), time.perf_counter() - started)
    return GeneratedFile(**vars(summary), out=str(path), bytes=path.stat().st_size, sha256=digest.hexdigest())


def _check_behaviours(domain: str, behaviours: Sequence[str] | None) -> set[str] | None:
    """The behaviours to keep (None: all); unknown names are refused, naming the known ones."""
    if behaviours is None:
        return None
    if isinstance(behaviours, str):     # "noisy,hacker", as the command line writes it
        behaviours = behaviours.split(",")
    known = _MODULES[domain].BEHAVIOURS
    wanted = [b.strip() for b in behaviours if b.strip()]
    unknown = sorted(set(wanted) - set(known))
    if unknown or not wanted:
        raise InputError(f"unknown {domain} behaviours {', '.join(unknown) or '(none given)'}: "
                         f"choose among {', '.join(known)}", field="behaviours")
    return set(wanted)


@dataclass(frozen=True)
class ListedDataset:
    """One dataset of a workspace, as :func:`list_datasets` lists it."""

    name: str
    #: The domain of its episodes; None when it has none recorded
    domain: str | None
    episodes: int
    steps: int
    created_at: str
    #: When it was archived; None while in use
    archived_at: str | None = None


@dataclass(frozen=True)
class SampleFile:
    """One committed sample file (:data:`SAMPLES`) and whether it is on disk."""

    domain: str
    path: str
    #: How it was generated: episodes and seed
    episodes: int
    seed: int
    exists: bool


@dataclass(frozen=True)
class DatasetListing:
    """What :func:`list_datasets` returns (``rwb datasets list``)."""

    #: The workspace folder
    workspace: str
    #: Its datasets, by name
    datasets: list[ListedDataset]
    samples: list[SampleFile]


def list_datasets(ws: Any, *, include_archived: bool = False) -> DatasetListing:
    """The workspace's datasets (name, domain, episodes, steps, created; archived ones only
    with ``include_archived``) and the sample files."""
    rows = [ListedDataset(name=d.name, domain=d.domain, episodes=d.n_episodes, steps=d.n_steps,
                          created_at=d.created_at, archived_at=d.archived_at)
            for d in ws.datasets(include_archived=include_archived)]
    samples = [SampleFile(domain=s.domain, path=str(s.path), episodes=s.episodes, seed=s.seed,
                          exists=s.path.exists()) for s in SAMPLES]
    return DatasetListing(workspace=str(ws.root), datasets=rows, samples=samples)


def write_samples() -> list[Path]:
    """(Re)write the committed sample files from :data:`SAMPLES`."""
    return [write_jsonl(generate(s.domain, s.episodes, s.seed), s.path) for s in SAMPLES]


# --------------------------------------------------------------------------- archive, restore, delete
#: The permission archiving, restoring and deleting a dataset need (who may import data may
#: also put it away).
DATASET_PERMISSION = "import"
#: Statuses of a tuning run whose study is still reading its dataset.
_STUDY_ACTIVE = ("starting", "running")


@dataclass(frozen=True)
class DatasetDependent:
    """Something that needs a dataset: a run training on it, a tuning study running on it, or a
    registered policy trained on it."""

    #: "run", "study" or "policy"
    kind: str
    #: The run id, the study name, or ``name version`` of the policy
    name: str
    #: Why it needs the dataset, in words ("is training on it")
    why: str
    #: True when it blocks archiving too (something still running); a policy blocks deletion only
    running: bool

    @property
    def text(self) -> str:
        return f"{self.kind} {self.name} {self.why}"


class DatasetInUse(ConflictError):
    """A dataset cannot be archived or deleted while something depends on it; ``dependents``
    names each one."""

    def __init__(self, message: str, dependents: Sequence[DatasetDependent]):
        super().__init__(message)
        self.dependents = list(dependents)


@dataclass(frozen=True)
class DatasetEvent:
    """One row of the ``dataset_events`` log: who archived, restored or deleted a dataset
    (or was refused), when, and the details (counts removed, the reason of a refusal)."""

    id: int
    dataset: str
    #: archived, restored, deleted, archive_refused or delete_refused
    event: str
    actor: str
    role: str
    at: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class DeletionPreview:
    """What deleting a dataset removes, and what would stop it (:func:`deletion_preview`)."""

    dataset: str
    archived: bool
    #: Rows removed with it
    episodes: int
    steps: int
    labels: int
    preferences: int
    task_criteria: int
    imports: int
    #: Files removed with it: import reports, uploaded copies, cached state features
    files: list[str]
    #: Runs that used it, ended, and stay recorded (they can no longer be resumed)
    runs_kept: list[str]
    #: What refuses the deletion (empty: it may be deleted)
    blockers: list[DatasetDependent]

    @property
    def removes(self) -> str:
        """What goes, in one line: ``250 episodes, 4,310 steps, 12 labels and 3 files``."""
        parts = [f"{self.episodes:,} episodes", f"{self.steps:,} steps"]
        for count, what in ((self.labels, "labels"), (self.preferences, "preference pairs"),
                            (self.task_criteria, "task criteria"), (self.imports, "import records"),
                            (len(self.files), "cached files")):
            if count:
                parts.append(f"{count:,} {what}")
        return ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass(frozen=True)
class DatasetDeleted:
    """What :func:`delete_dataset` removed."""

    dataset: str
    episodes: int
    steps: int
    labels: int
    files: list[str]
    event_id: int


def _require_known(ws: Workspace, name: str) -> None:
    if not isinstance(name, str) or not ws.has_dataset(name):
        known = ", ".join(d.name for d in ws.datasets(include_archived=True)) or "none yet"
        raise InputError(f"no dataset named {name!r} in the workspace (known: {known})", field="dataset")


def _archived_at(ws: Workspace, name: str) -> str | None:
    row = ws.conn.execute("SELECT archived_at FROM datasets WHERE name=?", (name,)).fetchone()
    return None if row is None else row[0]


def dataset_dependents(ws: Workspace, name: str) -> list[DatasetDependent]:
    """What needs ``name``: runs training on it (status running, an interrupted one included:
    stop it first), tuning studies running on it, and registered policies trained on it.

    Read from the workspace's own tables (runs, tuning, registry), so the data layer needs
    none of the layers that write them."""
    conn = ws.conn
    out = [DatasetDependent("run", run_id, "is training on it (stop it first)", True)
           for (run_id,) in conn.execute("SELECT id FROM runs WHERE dataset=? AND status='running' "
                                         "ORDER BY created_at", (name,))]
    out += [DatasetDependent("study", study, "is tuning on it (stop it first)", True)
            for (study,) in conn.execute(
                f"SELECT DISTINCT s.name FROM tuning_studies s JOIN tuning_runs r ON r.study = s.name "
                f"WHERE s.dataset=? AND r.status IN ({','.join('?' * len(_STUDY_ACTIVE))}) ORDER BY s.name",
                (name, *_STUDY_ACTIVE))]
    out += [DatasetDependent("policy", f"{policy} {version}", f"was trained on it (run {run_id})", False)
            for policy, version, run_id in conn.execute(
                "SELECT p.name, p.version, p.run_id FROM policy_versions p JOIN runs r ON r.id = p.run_id "
                "WHERE r.dataset=? ORDER BY p.name, p.registered_at", (name,))]
    return out


def _refusal(name: str, verb: str, blockers: Sequence[DatasetDependent]) -> str:
    what = "; ".join(b.text for b in blockers)
    text = f"dataset '{name}' cannot be {verb}: {what}"
    if verb == "deleted" and not any(b.running for b in blockers):
        text += ". Archive it instead: it leaves the pickers and keeps the data those policies were trained on"
    return text


def _record(conn: Any, name: str, event: str, actor: Actor, detail: dict[str, Any]) -> int:
    cur = conn.execute("INSERT INTO dataset_events(dataset, event, actor, role, at, detail) VALUES (?,?,?,?,?,?)",
                       (name, event, actor.name, actor.role, now_iso(),
                        json.dumps(detail, ensure_ascii=False, sort_keys=True, default=str)))
    return int(cur.lastrowid or 0)


def _refuse(ws: Workspace, actor: Actor, name: str, event: str, verb: str,
            blockers: Sequence[DatasetDependent]) -> DatasetInUse:
    """Record the refusal (outside the refused write's transaction, so it stays) and return
    the error to raise."""
    message = _refusal(name, verb, blockers)
    with ws.transaction() as conn:
        _record(conn, name, event, actor, {"reason": message, "dependents": [b.text for b in blockers]})
    return DatasetInUse(message, blockers)


def archive_dataset(ws: Workspace, actor: Actor, name: str) -> DatasetEvent | None:
    """Hide ``name`` from every picker and keep its data (:func:`restore_dataset` brings it
    back); returns the event recorded, None when it was archived already.  Needs ``import``;
    refused (:class:`DatasetInUse`, recorded) while a run or a study is running on it."""
    authorize(ws, actor, DATASET_PERMISSION)
    _require_known(ws, name)
    with ws.transaction() as conn:
        if _archived_at(ws, name) is not None:
            return None
        blockers = [b for b in dataset_dependents(ws, name) if b.running]
        if not blockers:
            conn.execute("UPDATE datasets SET archived_at=? WHERE name=?", (now_iso(), name))
            _record(conn, name, "archived", actor, {})
    if blockers:
        raise _refuse(ws, actor, name, "archive_refused", "archived", blockers)
    return _last_event(ws, name, "archived")


def restore_dataset(ws: Workspace, actor: Actor, name: str) -> DatasetEvent | None:
    """Bring an archived dataset back into the pickers; returns the event recorded, None when
    it was not archived.  Needs ``import``."""
    authorize(ws, actor, DATASET_PERMISSION)
    _require_known(ws, name)
    with ws.transaction() as conn:
        if _archived_at(ws, name) is None:
            return None
        conn.execute("UPDATE datasets SET archived_at=NULL WHERE name=?", (name,))
        _record(conn, name, "restored", actor, {})
    return _last_event(ws, name, "restored")


def _slug(name: str) -> str:
    """The cache folder name core.state.features gives a key (``_slug`` there; the data layer
    cannot import the state layer, and tests/test_dataset_lifecycle.py checks both agree)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:48]
    return f"{clean}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _cached_paths(ws: Workspace, name: str, upload_files: Sequence[str]) -> list[Path]:
    """The files and folders of ``name`` under the workspace's artifacts: its import reports,
    its cached state features, and the kept copies of files uploaded into it alone."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "dataset"
    paths = [ws.artifacts / "imports" / safe, ws.artifacts / "states" / _slug(f"dataset-{name}")]
    uploads = (ws.artifacts / "uploads").resolve()
    for file in upload_files:
        path = Path(file)
        if path.resolve().parent.parent == uploads:
            paths.append(path)
    return [p for p in paths if p.exists()]


def _counts(conn: Any, name: str) -> dict[str, int]:
    def one(sql: str) -> int:
        return int(conn.execute(sql, (name,)).fetchone()[0])

    return {"episodes": one("SELECT COUNT(*) FROM episodes WHERE dataset=?"),
            "steps": one("SELECT COUNT(*) FROM steps WHERE episode_uid IN (SELECT uid FROM episodes WHERE dataset=?)"),
            "labels": one("SELECT COUNT(*) FROM label_events WHERE dataset=?"),
            "preferences": one("SELECT COUNT(*) FROM preferences WHERE dataset=?"),
            "task_criteria": one("SELECT COUNT(*) FROM task_criteria WHERE dataset=?"),
            "imports": one("SELECT COUNT(*) FROM imports WHERE dataset=?")}


def _own_uploads(conn: Any, name: str) -> list[str]:
    """Files imported into ``name`` that no other dataset's import names."""
    return [f for (f,) in conn.execute(
        "SELECT DISTINCT file FROM imports WHERE dataset=? AND file NOT IN "
        "(SELECT file FROM imports WHERE dataset<>?)", (name, name))]


def deletion_preview(ws: Workspace, name: str) -> DeletionPreview:
    """What :func:`delete_dataset` would remove from ``name``, and what refuses it (reads only)."""
    _require_known(ws, name)
    counts = _counts(ws.conn, name)
    files = _cached_paths(ws, name, _own_uploads(ws.conn, name))
    runs = [r for (r,) in ws.conn.execute("SELECT id FROM runs WHERE dataset=? AND status<>'running' "
                                          "ORDER BY created_at", (name,))]
    return DeletionPreview(dataset=name, archived=_archived_at(ws, name) is not None, **counts,
                           files=[str(p.relative_to(ws.root)) for p in files], runs_kept=runs,
                           blockers=dataset_dependents(ws, name))


def delete_dataset(ws: Workspace, actor: Actor, name: str, *, confirm: str | None = None) -> DatasetDeleted:
    """Delete ``name``: its episodes, steps, tools, labels, preference pairs, task criteria and
    import records in one transaction, then its cached files (import reports, uploaded
    copies no other dataset imported, state features).  Runs that used it keep their records;
    review items and the rules learned from them stay (they are history).

    Needs ``import`` and ``confirm`` equal to the name (what the person typed; the CLI's
    ``--yes``).  Refused (:class:`DatasetInUse`, recorded in ``dataset_events``) while a run
    or study is running on it or a registered policy was trained on it."""
    authorize(ws, actor, DATASET_PERMISSION)
    _require_known(ws, name)
    if confirm != name:
        preview = deletion_preview(ws, name)
        raise InputError(f"deleting dataset '{name}' would remove {preview.removes}; nothing was deleted, "
                         "as the deletion was not confirmed", hint="add --yes to delete it")
    with ws.transaction() as conn:
        blockers = dataset_dependents(ws, name)
        if not blockers:
            counts = _counts(conn, name)
            files = _cached_paths(ws, name, _own_uploads(conn, name))
            shown = [str(p.relative_to(ws.root)) for p in files]
            conn.execute("DELETE FROM steps WHERE episode_uid IN (SELECT uid FROM episodes WHERE dataset=?)", (name,))
            for table in ("episodes", "tools", "label_events", "preferences", "task_criteria", "imports"):
                conn.execute(f"DELETE FROM {table} WHERE dataset=?", (name,))  # fixed table names
            conn.execute("DELETE FROM datasets WHERE name=?", (name,))
            event_id = _record(conn, name, "deleted", actor, {**counts, "files": shown})
    if blockers:
        raise _refuse(ws, actor, name, "delete_refused", "deleted", blockers)
    for path in files:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: another file of the same bytes is kept there
                path.parent.rmdir()
    security_event(ws, actor, "dataset_deleted", dataset=name, episodes=counts["episodes"], event_id=event_id)
    return DatasetDeleted(dataset=name, episodes=counts["episodes"], steps=counts["steps"],
                          labels=counts["labels"], files=shown, event_id=event_id)


def _event(row: tuple[Any, ...]) -> DatasetEvent:
    return DatasetEvent(id=row[0], dataset=row[1], event=row[2], actor=row[3], role=row[4], at=row[5],
                        detail=json.loads(row[6]) if row[6] else {})


def _last_event(ws: Workspace, name: str, event: str) -> DatasetEvent | None:
    row = ws.conn.execute("SELECT id, dataset, event, actor, role, at, detail FROM dataset_events "
                          "WHERE dataset=? AND event=? ORDER BY id DESC LIMIT 1", (name, event)).fetchone()
    return None if row is None else _event(row)


def dataset_events(ws: Workspace, dataset: str | None = None) -> list[DatasetEvent]:
    """Every archive, restore and deletion (refused ones too), oldest first; of ``dataset``
    only when given (a deleted dataset's events stay)."""
    sql = "SELECT id, dataset, event, actor, role, at, detail FROM dataset_events"
    args: tuple[Any, ...] = ()
    if dataset is not None:
        sql, args = sql + " WHERE dataset=?", (dataset,)
    return [_event(r) for r in ws.conn.execute(sql + " ORDER BY id", args)]
