"""Where tuning studies live: Optuna storages, and the batched writer of the default path.

Two ways to run a study, chosen by whether a storage URL is given:

* **Default (one machine)**: the study lives in the workspace's own Optuna database,
  ``artifacts/tuning/optuna.db`` (plain SQLite in Optuna's RDB schema, so
  ``optuna-dashboard sqlite:///…/optuna.db`` opens it).  While it runs, the trials are
  kept in Optuna's in-memory storage and written to that file in batches (every
  ``flush_seconds`` and at the end) by :class:`BatchedTrialWriter`.  Why: Optuna's RDB
  storage issues ~45 ORM statements per trial (create, one per parameter, one per
  constraint, state, value …); measured on this project's 2-core machine that is
  60-120 ms per trial, which alone caps a study near 500-900 trials/min — below the
  1,000 trials/min a weight-only study must reach.  The batched writer inserts the
  same rows with one bulk insert per table and batch (< 1 ms per trial), and the page
  reads a study that is at most ``flush_seconds`` behind.  One process writes a
  default-path study at a time.
* **Distributed (``--storage URL``)**: any SQLAlchemy URL (``postgresql://…``,
  ``mysql://…``, ``sqlite:///…``) used as Optuna's own RDB storage, directly: every
  trial is written as it happens, so several ``rwb tune --storage URL --study NAME``
  workers share one study and their samplers see each other's trials.  No coordination
  of our own — it is Optuna's RDB mode.

Why a separate SQLite file rather than tables in ``workbench.db``: Optuna owns its
schema (and migrates it with alembic); keeping it out of the workspace database keeps
that database's schema ours, and lets the dashboard open the study file on its own.

The batched writer fills Optuna's RDB tables (those of Optuna's ORM models,
``optuna.storages._rdb.models``) with the rows ``RDBStorage.create_new_trial`` with a
template trial would write, one bulk insert per table and batch;
``tests/test_tuning_storage.py`` reads every written trial back through
:func:`optuna.load_study` and compares it field by field, so a change of Optuna's
schema fails a test instead of corrupting studies.
"""

from __future__ import annotations

import datetime
import json
import random
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import distribution_to_json
from optuna.trial import FrozenTrial, TrialState

from core.errors import ConflictError, InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.store import Workspace

#: The workspace's Optuna database, relative to its artifacts folder.
DEFAULT_DB = Path("tuning") / "optuna.db"
#: Seconds between heartbeats of a running trial in a shared study.
HEARTBEAT_S = 60
#: Attempts to open a storage whose schema another worker is creating at the same moment.
RACE_RETRIES = 5
_RACE_MARKERS = ("already exists", "duplicate key", "UniqueViolation", "DuplicateTable")
#: Trial states that are final (only those are written by the batched writer).
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def default_storage_url(ws: "Workspace") -> str:
    """``sqlite:///<workspace>/artifacts/tuning/optuna.db`` (the folder is created)."""
    path = ws.artifact_dir("tuning") / DEFAULT_DB.name
    return f"sqlite:///{path}"


def describe_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for tables, logs and messages)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
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


def open_rdb(url: str, *, heartbeat: bool = False) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on ``url`` (schema created or upgraded as Optuna does).

    SQLite files get WAL journaling, so the page can read a study while a worker
    writes it.  ``heartbeat`` (shared studies): each running trial records a heartbeat,
    and a trial whose worker died is marked failed by the other workers instead of
    staying "running" for ever.  An unreachable server or a bad URL is an
    :class:`InputError`."""
    if not isinstance(url, str) or "://" not in url:
        raise InputError(f"storage must be an SQLAlchemy URL such as postgresql://user@host/db or "
                         f"sqlite:///path/optuna.db, got {url!r}", field="storage")
    url = driver_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if str(path) not in ("", ":memory:"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with sqlite3.connect(path, timeout=30) as conn:  # WAL is a property of the file
                conn.execute("PRAGMA journal_mode=WAL")
    for attempt in range(RACE_RETRIES):
        try:
            kwargs = {"heartbeat_interval": HEARTBEAT_S, "grace_period": 3 * HEARTBEAT_S} if heartbeat else {}
            return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url), **kwargs)
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


def study_id(storage: optuna.storages.BaseStorage, name: str) -> int | None:
    """The id of study ``name`` in ``storage``, or None when there is none."""
    try:
        return storage.get_study_id_from_name(name)
    except KeyError:
        return None


def count_trials(storage: optuna.storages.RDBStorage, sid: int) -> int:
    """Number of trials (any state) of a study, with one query."""
    from sqlalchemy import func, select
    from optuna.storages._rdb import models

    with storage.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(models.TrialModel.__table__)
                                .where(models.TrialModel.__table__.c.study_id == sid)).scalar_one())


class BatchedTrialWriter:
    """Writes finished trials of an in-memory study into an RDB study, many per transaction.

    Contract: ``write(trials)`` takes finished trials whose numbers continue the RDB
    study's numbering (the next number is :attr:`written`); it inserts each trial with
    its parameters, values, intermediate values, user and system attributes (so
    constraints too) in one transaction, and refuses with :class:`ConflictError` when
    another process added trials to the study in the meantime."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_name: str):
        sid = study_id(storage, study_name)
        if sid is None:
            raise InputError(f"no study {study_name!r} in {describe_url(storage.url)}", field="study")
        self.storage, self.study_name, self.study_id = storage, study_name, sid
        self.written = count_trials(storage, sid)

    def write(self, trials: Sequence[FrozenTrial]) -> int:
        """Insert ``trials`` (finished, numbered from :attr:`written` on); returns how many."""
        from sqlalchemy import func, insert, select
        from optuna.storages._rdb import models

        trials = list(trials)
        if not trials:
            return 0
        for i, fr in enumerate(trials):
            if fr.number != self.written + i:
                raise ValueError(f"trial {fr.number} does not continue the study "
                                 f"(next number {self.written + i})")
            if fr.state not in FINISHED:
                raise ValueError(f"trial {fr.number} is {fr.state.name}; only finished trials are written")
        trial_t = models.TrialModel.__table__
        # SQLAlchemy Core, one executemany per table: the ORM's unit of work costs several
        # times more per row and the rows need none of its bookkeeping.
        with self.storage.engine.begin() as conn:
            # Check, inside the write transaction, that nobody numbered trials since our last write.
            now = conn.execute(select(func.count()).select_from(trial_t)
                               .where(trial_t.c.study_id == self.study_id)).scalar_one()
            if now != self.written:
                raise ConflictError(
                    f"another process added trials to study {self.study_name!r} while this one ran "
                    f"({now - self.written} unexpected); several workers on one study need a shared "
                    "storage given with --storage (Optuna's RDB mode)")
            ids = conn.execute(
                insert(trial_t).returning(trial_t.c.trial_id, sort_by_parameter_order=True),
                [{"number": fr.number, "study_id": self.study_id, "state": fr.state,
                  "datetime_start": _naive_utc(fr.datetime_start),
                  "datetime_complete": _naive_utc(fr.datetime_complete)} for fr in trials]).scalars().all()
            params, values, inter, user, system = [], [], [], [], []
            for tid, fr in zip(ids, trials):
                for name, value in fr.params.items():
                    dist = fr.distributions[name]
                    params.append({"trial_id": tid, "param_name": name, "param_value": dist.to_internal_repr(value),
                                   "distribution_json": distribution_to_json(dist)})
                for objective, value in enumerate(fr.values or ()):
                    stored, kind = models.TrialValueModel.value_to_stored_repr(value)
                    values.append({"trial_id": tid, "objective": objective, "value": stored, "value_type": kind})
                for step, value in fr.intermediate_values.items():
                    stored, kind = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(value)
                    inter.append({"trial_id": tid, "step": step, "intermediate_value": stored,
                                  "intermediate_value_type": kind})
                user += [{"trial_id": tid, "key": k, "value_json": json.dumps(v)} for k, v in fr.user_attrs.items()]
                system += [{"trial_id": tid, "key": k, "value_json": json.dumps(v)}
                           for k, v in fr.system_attrs.items()]
            for model, rows in ((models.TrialParamModel, params), (models.TrialValueModel, values),
                                (models.TrialIntermediateValueModel, inter),
                                (models.TrialUserAttributeModel, user), (models.TrialSystemAttributeModel, system)):
                if rows:
                    conn.execute(insert(model.__table__), rows)
        self.written += len(trials)
        return len(trials)


def _naive_utc(value: datetime.datetime | None) -> datetime.datetime | None:
    """A local datetime as the naive UTC that Optuna's RDB schema stores (its model's setter)."""
    if value is None:
        return None
    return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)


__all__ = ["BatchedTrialWriter", "DEFAULT_DB", "count_trials", "default_storage_url", "describe_url", "driver_url",
           "open_rdb", "study_id"]
