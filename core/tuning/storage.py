"""Where tuning studies live: Optuna storages opened through Optuna's public API only.

By default a study lives in the workspace's Optuna journal (``artifacts/tuning/optuna.log``),
its trials kept in memory while it runs and appended in batches by :class:`BatchedTrialWriter`;
with ``--storage`` it lives in a shared RDB URL or journal file that several workers write as
trials happen.  Opening the workspace journal copies the studies of an older
``artifacts/tuning/optuna.db`` into it.  Nothing here touches Optuna's private modules.

Details: docs/tuning.md (## Study storage).
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from core.base.errors import ConflictError, InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: The workspace's Optuna journal, relative to its artifacts folder.
DEFAULT_JOURNAL = Path("tuning") / "optuna.log"
#: An SQLite study database in the workspace (Optuna's RDB schema), copied into the journal on first open.
LEGACY_DB = Path("tuning") / "optuna.db"
#: The suffix that database is renamed with once copied (kept, never read again).
MIGRATED_SUFFIX = ".migrated"
#: How a journal file's name ends (what tells a journal from a mistyped database path).
JOURNAL_SUFFIX = ".log"
#: Seconds between heartbeats of a running trial in a shared RDB study.
HEARTBEAT_S = 60
#: Attempts to open a storage whose schema another worker is creating at the same moment.
RACE_RETRIES = 5
_RACE_MARKERS = ("already exists", "duplicate key", "UniqueViolation", "DuplicateTable")
#: Trial states that are final (only those are written by the batched writer).
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def default_storage_url(ws: "Workspace") -> str:
    """The path of the workspace's journal, ``<workspace>/artifacts/tuning/optuna.log``
    (the folder is created).  It is what ``optuna-dashboard`` takes as its storage."""
    return str(ws.artifact_dir("tuning") / DEFAULT_JOURNAL.name)


def describe_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for tables, logs and messages)."""
    from sqlalchemy.engine import make_url

    if "://" not in url:  # a journal file: a path, nothing secret
        return url
    try:
        return str(make_url(url).render_as_string(hide_password=True))
    except Exception:  # not parseable: nothing secret to hide in what SQLAlchemy rejects
        return url


def driver_url(url: str) -> str:
    """``url`` with an explicit PostgreSQL driver when it names none.

    SQLAlchemy 2.1 reads a bare ``postgresql://`` as the psycopg 3 driver; the workbench
    installs psycopg2 (``psycopg2-binary``), so a bare URL is given that driver when
    psycopg 3 is not installed.  A URL naming its driver (``postgresql+psycopg://``) is
    used as written."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if sep and scheme in ("postgresql", "postgres") and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql+psycopg2://{rest}"
    return url


def open_storage(url: str, *, heartbeat: bool = False) -> BaseStorage:
    """The Optuna storage ``url`` names: an SQLAlchemy URL opens :func:`open_rdb`, a path
    ending in ``.log`` opens :func:`open_journal`; anything else is an :class:`InputError`."""
    if isinstance(url, str) and "://" not in url and url.endswith(JOURNAL_SUFFIX):
        return open_journal(url)
    return open_rdb(url, heartbeat=heartbeat)


def open_rdb(url: str, *, heartbeat: bool = False) -> RDBStorage:
    """Optuna's RDB storage on ``url`` (schema created or upgraded as Optuna does).

    SQLite files get WAL journaling, so the page can read a study while a worker
    writes it.  ``heartbeat`` (shared studies): each running trial records a heartbeat,
    and a trial whose worker died is marked failed by the other workers instead of
    staying "running" for ever.  An unreachable server or a bad URL is an
    :class:`InputError`."""
    if not isinstance(url, str) or "://" not in url:
        raise InputError(f"storage must be an SQLAlchemy URL such as postgresql://user@host/db or "
                         f"sqlite:///path/optuna.db, or an Optuna journal file ending in {JOURNAL_SUFFIX}, "
                         f"got {url!r}", field="storage")
    url = driver_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if str(path) not in ("", ":memory:"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with sqlite3.connect(path, timeout=30) as conn:  # WAL is a property of the file
                conn.execute("PRAGMA journal_mode=WAL")
    for attempt in range(RACE_RETRIES):
        try:
            kwargs: dict[str, Any] = ({"heartbeat_interval": HEARTBEAT_S, "grace_period": 3 * HEARTBEAT_S}
                                      if heartbeat else {})
            return RDBStorage(url, engine_kwargs=_engine_kwargs(url), **kwargs)
        except ImportError as exc:
            raise InputError(f"no database driver for {describe_url(url)}: {exc}", field="storage") from None
        except Exception as exc:  # sqlalchemy OperationalError, ArgumentError, IntegrityError, …
            text = str(exc)
            # Workers started together on an empty database race to create Optuna's tables;
            # the loser sees a duplicate type/table.  Once the winner is done the tables exist,
            # so open again (Optuna creates only what is missing).
            if attempt + 1 < RACE_RETRIES and any(m in text for m in _RACE_MARKERS):
                time.sleep(0.5 + random.random())
                continue
            raise InputError(f"cannot open the tuning storage {describe_url(url)}: "
                             f"{type(exc).__name__}: {text.splitlines()[0]}", field="storage") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        # a reader (the page) and the writer share the file: wait instead of failing at once
        return {"connect_args": {"timeout": 30}}
    # detect connections dropped by a server restart before using them
    return {"pool_pre_ping": True}


#: One JournalStorage per journal file and process, keyed by (path, inode): a journal
#: storage replays the log once and then reads only the lines appended since, so the
#: page's repeated reads of a growing study cost what was added, not the whole log.
#: A file replaced under the same name (new inode) gets a fresh storage.
_JOURNALS: dict[tuple[str, int], JournalStorage] = {}
_JOURNALS_LOCK = threading.Lock()


def open_journal(path: str | os.PathLike[str]) -> JournalStorage:
    """Optuna's journal storage on the file ``path`` (created when missing).

    Next to the workspace's journal, a legacy ``optuna.db`` is migrated first
    (:func:`migrate_legacy_db`)."""
    journal = Path(path).resolve()
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
        if not journal.exists():
            journal.touch()
        key = (str(journal), journal.stat().st_ino)
    except OSError as exc:
        raise InputError(f"cannot open the tuning journal {journal}: {exc.strerror or exc}",
                         field="storage") from None
    with _JOURNALS_LOCK:
        storage = _JOURNALS.get(key)
        if storage is None:
            storage = JournalStorage(JournalFileBackend(str(journal)))
            legacy = journal.with_name(LEGACY_DB.name)
            if journal.name == DEFAULT_JOURNAL.name and legacy.is_file():
                migrate_legacy_db(legacy, storage)
            _JOURNALS[key] = storage
    return storage


def migrate_legacy_db(db: Path, journal: BaseStorage) -> list[str]:
    """Copy every study of the RDB SQLite file ``db`` that ``journal`` lacks into
    ``journal`` (:func:`optuna.copy_study`: directions, trials, user and system
    attributes), then rename ``db`` to ``<db>.migrated``.  Returns the copied names.

    Two processes migrating at once: the second one's copy of a study the first has
    created already is skipped (Optuna refuses a duplicate study name)."""
    legacy = open_rdb(f"sqlite:///{db}")
    copied = []
    for summary in optuna.get_all_study_summaries(storage=legacy, include_best_trial=False):
        if study_id(journal, summary.study_name) is not None:
            continue
        try:
            optuna.copy_study(from_study_name=summary.study_name, from_storage=legacy, to_storage=journal)
        except optuna.exceptions.DuplicatedStudyError:
            continue
        copied.append(summary.study_name)
    legacy.remove_session()
    try:
        db.rename(db.with_name(db.name + MIGRATED_SUFFIX))
    except FileNotFoundError:  # another process renamed it first
        pass
    return copied


def study_id(storage: BaseStorage, name: str) -> int | None:
    """The id of study ``name`` in ``storage``, or None when there is none."""
    try:
        return storage.get_study_id_from_name(name)
    except KeyError:
        return None


def count_trials(storage: BaseStorage, sid: int) -> int:
    """Number of trials (any state) of a study, in O(log n) single-trial look-ups.

    Trials are numbered 0, 1, 2 … within a study, so the count is the first number with
    no trial: found by doubling, then bisection, through the public
    ``get_trial_id_from_study_id_trial_number`` (one indexed query on an RDB storage),
    where ``BaseStorage.get_n_trials`` would read every trial."""
    def exists(number: int) -> bool:
        try:
            storage.get_trial_id_from_study_id_trial_number(sid, number)
            return True
        except KeyError:
            return False

    if not exists(0):
        return 0
    low, high = 0, 1          # invariant: trial ``low`` exists
    while exists(high):
        low, high = high, high * 2
    while high - low > 1:     # trial ``low`` exists, trial ``high`` does not
        mid = (low + high) // 2
        low, high = (mid, high) if exists(mid) else (low, mid)
    return high


class BatchedTrialWriter:
    """Writes finished trials of an in-memory study into a persistent study at each flush.

    Contract: ``write(trials)`` takes finished trials whose numbers continue the
    persistent study's numbering (the next number is :attr:`written`); each is stored
    with its parameters, values, intermediate values, user and system attributes (so
    constraints too) and times by ``storage.create_new_trial(study_id, template_trial=…)``,
    the storage's public call for that.  It refuses with :class:`ConflictError` when
    another process added trials to the study in the meantime."""

    def __init__(self, storage: BaseStorage, study_name: str):
        sid = study_id(storage, study_name)
        if sid is None:
            raise InputError(f"no study {study_name!r} in the tuning storage", field="study")
        self.storage, self.study_name, self.study_id = storage, study_name, sid
        self.written = count_trials(storage, sid)

    def write(self, trials: Sequence[FrozenTrial]) -> int:
        """Store ``trials`` (finished, numbered from :attr:`written` on); returns how many."""
        trials = list(trials)
        if not trials:
            return 0
        for i, fr in enumerate(trials):
            if fr.number != self.written + i:
                raise ValueError(f"trial {fr.number} does not continue the study "
                                 f"(next number {self.written + i})")
            if fr.state not in FINISHED:
                raise ValueError(f"trial {fr.number} is {fr.state.name}; only finished trials are written")
        now = count_trials(self.storage, self.study_id)
        if now != self.written:
            raise self._conflict(now - self.written)
        for fr in trials:
            tid = self.storage.create_new_trial(self.study_id, template_trial=fr)
            # The storage numbers trials itself; a number other than ours means another
            # writer slipped in between the check above and this trial.
            if self.storage.get_trial_number_from_id(tid) != fr.number:
                raise self._conflict(1)
            self.written += 1
        return len(trials)

    def _conflict(self, unexpected: int) -> ConflictError:
        return ConflictError(
            f"another process added trials to study {self.study_name!r} while this one ran "
            f"({unexpected} unexpected); several workers on one study need a shared "
            "storage given with --storage")


__all__ = ["BatchedTrialWriter", "DEFAULT_JOURNAL", "LEGACY_DB", "count_trials", "default_storage_url",
           "describe_url", "driver_url", "migrate_legacy_db", "open_journal", "open_rdb", "open_storage",
           "study_id"]
