"""Synthetic recorded episodes for the built-in domains, and the committed samples.

Two domains, ``finance`` and ``ecommerce``, each with tool schemas under
``datasets/<domain>/tools.json`` and behaviours that include a reward hack with an honest twin
per hacking episode.  :func:`generate` builds a dataset deterministically (the same domain,
size and seed give a byte-identical file) and :func:`write_jsonl` writes it; the worlds and
behaviours live in :mod:`core.data.datagen`.

Details: docs/datasets.md (## The two domains, ## A generated step's observation,
## Reproducible random numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from core.base import package_data
from core.data.datagen import common, ecommerce, finance
from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError, RwbError

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


def list_datasets(ws: Any) -> DatasetListing:
    """The workspace's datasets (name, domain, episodes, steps, created) and the sample files."""
    rows = [ListedDataset(name=d.name, domain=d.domain, episodes=d.n_episodes, steps=d.n_steps,
                          created_at=d.created_at) for d in ws.datasets()]
    samples = [SampleFile(domain=s.domain, path=str(s.path), episodes=s.episodes, seed=s.seed,
                          exists=s.path.exists()) for s in SAMPLES]
    return DatasetListing(workspace=str(ws.root), datasets=rows, samples=samples)


def write_samples() -> list[Path]:
    """(Re)write the committed sample files from :data:`SAMPLES`."""
    return [write_jsonl(generate(s.domain, s.episodes, s.seed), s.path) for s in SAMPLES]
