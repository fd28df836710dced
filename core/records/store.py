"""The workspace: one folder with an SQLite database (WAL) and an artifacts folder.

The database is plain SQLite that ``sqlite-utils`` and Datasette open as is.
Its schema carries a version number and moves forward by the migrations in
``MIGRATIONS`` (never backwards; a database newer than this code is refused).

Example::

    >>> ws = Workspace.open("/tmp/ws-doc")          # doctest: +SKIP
    >>> ws.db["episodes"].count                      # doctest: +SKIP
    0
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from core.records.episodes import Episode, ToolSchema, episode_from_body
from core.base.errors import RwbError

DEFAULT_WORKSPACE = "workspace"
DB_NAME = "workbench.db"


class WorkspaceError(RwbError):
    """The workspace cannot be used as asked (newer schema, missing dataset…)."""


def default_workspace_path() -> Path:
    """``$RWB_WORKSPACE`` or ``./workspace``."""
    return Path(os.environ.get("RWB_WORKSPACE") or DEFAULT_WORKSPACE).resolve()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------- migrations
# Each migration takes the raw connection inside an open transaction.  Append only:
# never edit a migration that has shipped; add the next one at the end of MIGRATIONS
# (all of them live here, so the version number never depends on import order).

def _run_script(conn: sqlite3.Connection, script: str) -> None:
    """Run ``;``-separated DDL inside the current transaction (executescript would commit)."""
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def _m1_initial(conn: sqlite3.Connection) -> None:
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS datasets (
            name TEXT PRIMARY KEY,
            domain TEXT,
            description TEXT,
            created_at TEXT NOT NULL
        );
        CREATE TABLE IF NOT EXISTS episodes (
            uid INTEGER PRIMARY KEY AUTOINCREMENT,
            dataset TEXT NOT NULL REFERENCES datasets(name),
            episode_id TEXT NOT NULL,
            domain TEXT,
            task_type TEXT,
            query TEXT,
            behaviour TEXT,
            n_steps INTEGER NOT NULL,
            resolved INTEGER,
            final_reward REAL,
            business_metric REAL,
            content_hash TEXT NOT NULL,
            source_file TEXT,
            source_format TEXT,
            source_line INTEGER,
            import_id INTEGER REFERENCES imports(id),
            body TEXT NOT NULL,
            UNIQUE (dataset, episode_id)
        );
        CREATE INDEX IF NOT EXISTS idx_episodes_dataset ON episodes(dataset);
        CREATE TABLE IF NOT EXISTS steps (
            episode_uid INTEGER NOT NULL REFERENCES episodes(uid),
            t INTEGER NOT NULL,
            kind TEXT NOT NULL,
            tool TEXT,
            params TEXT,
            tool_error TEXT,
            output_text TEXT,
            latency_ms REAL,
            PRIMARY KEY (episode_uid, t)
        );
        CREATE TABLE IF NOT EXISTS tools (
            dataset TEXT NOT NULL REFERENCES datasets(name),
            name TEXT NOT NULL,
            schema TEXT NOT NULL,
            PRIMARY KEY (dataset, name)
        );
        CREATE TABLE IF NOT EXISTS imports (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            dataset TEXT NOT NULL,
            file TEXT NOT NULL,
            file_sha256 TEXT NOT NULL,
            format TEXT NOT NULL,
            options TEXT,
            n_episodes INTEGER NOT NULL,
            n_steps INTEGER NOT NULL,
            report TEXT,
            at TEXT NOT NULL
        );
        CREATE INDEX IF NOT EXISTS idx_imports_sha ON imports(file_sha256, dataset);
        """
    )


def _m2_users_review_audit(conn: sqlite3.Connection) -> None:
    """Users (core.access.users), the review queue (core.guard.review) and the audit trail (core.access.audit)."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS users (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL CHECK (role IN ('analyst', 'reviewer', 'approver', 'admin')),
            email TEXT UNIQUE,
            oidc_sub TEXT UNIQUE,
            password_hash TEXT,
            disabled INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            created_by TEXT NOT NULL
        );
        CREATE TABLE IF NOT EXISTS review_items (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            origin TEXT NOT NULL CHECK (origin IN ('training', 'serving')),
            reason TEXT NOT NULL,
            dataset TEXT,
            task_type TEXT,
            state TEXT NOT NULL,
            key_features TEXT,
            token_id INTEGER NOT NULL,
            token_name TEXT,
            action_label TEXT,
            tool TEXT,
            risk TEXT,
            reward_components TEXT NOT NULL,
            confidence REAL,
            run_id TEXT,
            episode_id TEXT,
            step_t INTEGER,
            decision_id TEXT,
            source_key TEXT UNIQUE,
            status TEXT NOT NULL DEFAULT 'pending'
                CHECK (status IN ('pending', 'claimed', 'decided')),
            created_at REAL NOT NULL,
            created_by TEXT NOT NULL,
            claimed_by TEXT,
            claimed_at REAL,
            claim_expires REAL,
            decision TEXT CHECK (decision IN ('approve', 'reject')),
            decided_by TEXT,
            decided_at REAL,
            comment TEXT,
            CHECK ((status = 'decided') = (decision IS NOT NULL))
        );
        CREATE INDEX IF NOT EXISTS idx_review_items_status ON review_items(status, id);
        CREATE INDEX IF NOT EXISTS idx_review_items_dataset ON review_items(dataset, decision);
        CREATE TABLE IF NOT EXISTS review_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            item_id INTEGER NOT NULL REFERENCES review_items(id),
            event TEXT NOT NULL CHECK (event IN ('enqueued', 'claimed', 'released', 'decided')),
            actor TEXT NOT NULL,
            at REAL NOT NULL,
            detail TEXT
        );
        CREATE INDEX IF NOT EXISTS idx_review_events_item ON review_events(item_id, id);
        CREATE TABLE IF NOT EXISTS mask_rules_from_reviews (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            item_id INTEGER NOT NULL UNIQUE REFERENCES review_items(id),
            dataset TEXT,
            task_type TEXT,
            pattern TEXT NOT NULL,
            token_id INTEGER NOT NULL,
            token_name TEXT,
            tool TEXT,
            rule TEXT NOT NULL,
            comment TEXT,
            created_at REAL NOT NULL,
            created_by TEXT NOT NULL
        );
        CREATE TABLE IF NOT EXISTS audit (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            decision_id TEXT NOT NULL UNIQUE,
            timestamp TEXT NOT NULL,
            episode_id TEXT,
            policy_version TEXT,
            input_hash TEXT NOT NULL,
            final_action TEXT NOT NULL,
            record TEXT NOT NULL,
            request TEXT,
            action TEXT,
            written_by TEXT NOT NULL
        );
        CREATE INDEX IF NOT EXISTS idx_audit_episode ON audit(episode_id, timestamp, seq);
        CREATE INDEX IF NOT EXISTS idx_audit_time ON audit(timestamp);
        CREATE INDEX IF NOT EXISTS idx_audit_policy ON audit(policy_version, seq);
        """
    )
    # Triggers run one statement each (_run_script splits on ';', which trigger bodies
    # contain).  They make the logs append-only in the database itself, whoever writes.
    for name, when, message in (
        ("review_items_decided_is_final", "UPDATE ON review_items WHEN OLD.status = 'decided'",
         "review item already decided; a decision is final"),
        ("review_items_no_delete", "DELETE ON review_items", "review items are never deleted"),
        ("review_events_no_update", "UPDATE ON review_events", "review events are append-only"),
        ("review_events_no_delete", "DELETE ON review_events", "review events are append-only"),
        ("audit_no_update", "UPDATE ON audit", "audit records are append-only"),
        ("audit_no_delete", "DELETE ON audit", "audit records are append-only"),
        # INSERT OR REPLACE deletes the old row without firing DELETE triggers: refuse it.
        ("audit_no_replace", "INSERT ON audit WHEN EXISTS (SELECT 1 FROM audit WHERE "
         "decision_id = NEW.decision_id)",
         "audit records are append-only; this decision is already recorded"),
    ):
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {when} "
                     f"BEGIN SELECT RAISE(ABORT, '{message}'); END")


def _m3_runs(conn: sqlite3.Connection) -> None:
    """Training runs (core.rl.runs): one row per run, its metrics per update, its checkpoints."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS runs (
            id TEXT PRIMARY KEY,
            status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed', 'stopped')),
            dataset TEXT,
            episodes_file TEXT,
            template_name TEXT NOT NULL,
            template_version TEXT,
            template_hash TEXT NOT NULL,
            template_yaml TEXT NOT NULL,
            masks_source TEXT,
            masks_yaml TEXT,
            device TEXT NOT NULL,
            config TEXT NOT NULL,
            total_steps INTEGER NOT NULL,
            env_steps INTEGER NOT NULL DEFAULT 0,
            updates INTEGER NOT NULL DEFAULT 0,
            curriculum_level INTEGER,
            pid INTEGER,
            host TEXT,
            stop_requested INTEGER NOT NULL DEFAULT 0,
            launch_token_hash TEXT,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL,
            started_at TEXT,
            ended_at TEXT,
            heartbeat_at REAL,
            error TEXT,
            final_metrics TEXT,
            log_path TEXT
        );
        CREATE INDEX IF NOT EXISTS idx_runs_status ON runs(status, created_at);
        CREATE TABLE IF NOT EXISTS run_metrics (
            run_id TEXT NOT NULL REFERENCES runs(id),
            update_idx INTEGER NOT NULL,
            env_steps INTEGER NOT NULL,
            at REAL NOT NULL,
            metrics TEXT NOT NULL,
            PRIMARY KEY (run_id, update_idx)
        );
        CREATE TABLE IF NOT EXISTS run_checkpoints (
            run_id TEXT NOT NULL REFERENCES runs(id),
            update_idx INTEGER NOT NULL,
            env_steps INTEGER NOT NULL,
            path TEXT NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (run_id, update_idx)
        )
        """
    )


def _m4_template_versions(conn: sqlite3.Connection) -> None:
    """Reward template versions (core.rewards.versions): every save is a new row; rows are
    never updated or deleted, so the history of a template is complete."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS template_versions (
            name TEXT NOT NULL,
            version INTEGER NOT NULL CHECK (version >= 1),
            yaml TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            base_version INTEGER CHECK (base_version IS NULL OR base_version < version),
            saved_by TEXT NOT NULL,
            saved_at TEXT NOT NULL,
            message TEXT NOT NULL DEFAULT '',
            meta TEXT,
            PRIMARY KEY (name, version)
        )
        """
    )
    for name, when, message in (
        ("template_versions_no_update", "UPDATE ON template_versions",
         "template versions are never changed; save a new version"),
        ("template_versions_no_delete", "DELETE ON template_versions",
         "template versions are never deleted"),
        # INSERT OR REPLACE deletes the old row without firing DELETE triggers: refuse it.
        ("template_versions_no_replace", "INSERT ON template_versions WHEN EXISTS (SELECT 1 FROM "
         "template_versions WHERE name = NEW.name AND version = NEW.version)",
         "this template version already exists; save a new version"),
    ):
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {when} "
                     f"BEGIN SELECT RAISE(ABORT, '{message}'); END")


def _m5_policy_registry(conn: sqlite3.Connection) -> None:
    """The policy registry (core.govern.registry): one row per registered bundle version and an
    event log of every transition (registered, approved, promoted, rolled back).  Both are
    append-only: the stage of a version is read from its events, never stored in place."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS policy_versions (
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            bundle_path TEXT NOT NULL,
            bundle_sha256 TEXT NOT NULL,
            manifest_digest TEXT NOT NULL,
            manifest TEXT NOT NULL,
            run_id TEXT,
            created_by TEXT NOT NULL,
            trained_by TEXT,
            registered_by TEXT NOT NULL,
            registered_at TEXT NOT NULL,
            PRIMARY KEY (name, version)
        );
        CREATE TABLE IF NOT EXISTS registry_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            event TEXT NOT NULL CHECK (event IN ('registered', 'approved', 'promoted', 'rolled_back')),
            actor TEXT NOT NULL,
            role TEXT NOT NULL,
            at TEXT NOT NULL,
            comment TEXT NOT NULL DEFAULT '',
            detail TEXT,
            FOREIGN KEY (name, version) REFERENCES policy_versions(name, version)
        );
        CREATE INDEX IF NOT EXISTS idx_registry_events_name ON registry_events(name, id)
        """
    )
    for name, when, message in (
        ("policy_versions_no_update", "UPDATE ON policy_versions",
         "registered policy versions are never changed; register a new version"),
        ("policy_versions_no_delete", "DELETE ON policy_versions", "registered policy versions are never deleted"),
        ("policy_versions_no_replace", "INSERT ON policy_versions WHEN EXISTS (SELECT 1 FROM policy_versions "
         "WHERE name = NEW.name AND version = NEW.version)", "this policy version is already registered"),
        ("registry_events_no_update", "UPDATE ON registry_events", "registry events are append-only"),
        ("registry_events_no_delete", "DELETE ON registry_events", "registry events are append-only"),
        ("registry_events_no_replace", "INSERT ON registry_events WHEN EXISTS (SELECT 1 FROM registry_events "
         "WHERE id = NEW.id)", "registry events are append-only"),
    ):
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {when} "
                     f"BEGIN SELECT RAISE(ABORT, '{message}'); END")


def _m6_tuning(conn: sqlite3.Connection) -> None:
    """Weight tuning (core.tuning): analysts' preference labels on episode pairs, the Optuna
    studies started from this workspace with the worker processes that ran them, and every
    application of a study's result as a new template version.  (The trials themselves live
    in Optuna's own storage: the journal artifacts/tuning/optuna.log (optuna.db before it) or a shared database.)"""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS preferences (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            dataset TEXT NOT NULL REFERENCES datasets(name),
            better_id TEXT NOT NULL,
            worse_id TEXT NOT NULL,
            comment TEXT,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL,
            CHECK (better_id <> worse_id),
            UNIQUE (dataset, better_id, worse_id, created_by)
        );
        CREATE INDEX IF NOT EXISTS idx_preferences_dataset ON preferences(dataset, id);
        CREATE TABLE IF NOT EXISTS tuning_studies (
            name TEXT PRIMARY KEY,
            storage TEXT,
            objective TEXT NOT NULL,
            template_name TEXT NOT NULL,
            template_version INTEGER,
            template_sha256 TEXT NOT NULL,
            dataset TEXT,
            episodes_file TEXT,
            config TEXT NOT NULL,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL
        );
        CREATE TABLE IF NOT EXISTS tuning_runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            study TEXT NOT NULL REFERENCES tuning_studies(name),
            status TEXT NOT NULL CHECK (status IN ('starting', 'running', 'finished', 'stopped', 'failed')),
            trials_requested INTEGER NOT NULL,
            trials_done INTEGER NOT NULL DEFAULT 0,
            best_value REAL,
            pid INTEGER,
            host TEXT,
            log_path TEXT,
            stop_requested INTEGER NOT NULL DEFAULT 0,
            started_by TEXT NOT NULL,
            started_at TEXT NOT NULL,
            heartbeat_at TEXT,
            ended_at TEXT,
            trials_per_min REAL,
            error TEXT
        );
        CREATE INDEX IF NOT EXISTS idx_tuning_runs_study ON tuning_runs(study, id);
        CREATE TABLE IF NOT EXISTS tuning_applications (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            study TEXT NOT NULL,
            trial_number INTEGER NOT NULL,
            template_name TEXT NOT NULL,
            base_version INTEGER,
            version INTEGER NOT NULL,
            figures TEXT NOT NULL,
            diff TEXT NOT NULL,
            applied_by TEXT NOT NULL,
            applied_at TEXT NOT NULL
        )
        """
    )


def _m7_sign_in(conn: sqlite3.Connection) -> None:
    """Failed sign-ins (the back-off of core.access.users reads them) and app sessions (idle and
    absolute expiry, revocation).  Times are POSIX seconds; a session is kept by the SHA-256
    of its token, never the token itself."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS sign_in_failures (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            user TEXT NOT NULL,
            address TEXT NOT NULL,
            at REAL NOT NULL,
            -- 1 once the user signed in successfully: no longer counts for the user,
            -- still counts for the address
            user_cleared INTEGER NOT NULL DEFAULT 0
        );
        CREATE INDEX IF NOT EXISTS idx_sign_in_failures_user ON sign_in_failures(user, at);
        CREATE INDEX IF NOT EXISTS idx_sign_in_failures_address ON sign_in_failures(address, at);
        CREATE TABLE IF NOT EXISTS sessions (
            token_sha256 TEXT PRIMARY KEY,
            user TEXT NOT NULL,
            address TEXT NOT NULL,
            method TEXT NOT NULL,
            created_at REAL NOT NULL,
            last_seen REAL NOT NULL,
            ended_at REAL,
            ended_why TEXT
        );
        CREATE INDEX IF NOT EXISTS idx_sessions_user ON sessions(user)
        """
    )


def _m8_criteria_and_labels(conn: sqlite3.Connection) -> None:
    """Task criteria (what a task's success requires: expected calls, what to communicate),
    one record per (dataset, task id), joined to the dataset's episodes by task id; and
    outcome labels given by people, append-only: an episode's label is its latest event, and
    the label set's version is the highest event id."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS task_criteria (
            dataset TEXT NOT NULL REFERENCES datasets(name),
            task_id TEXT NOT NULL,
            criteria TEXT NOT NULL,
            source_file TEXT,
            source_line INTEGER,
            source_format TEXT NOT NULL,
            imported_by TEXT NOT NULL,
            imported_at TEXT NOT NULL,
            PRIMARY KEY (dataset, task_id)
        );
        CREATE TABLE IF NOT EXISTS label_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            dataset TEXT NOT NULL REFERENCES datasets(name),
            episode_id TEXT NOT NULL,
            outcome INTEGER CHECK (outcome IS NULL OR outcome IN (0, 1)),
            note TEXT,
            created_by TEXT NOT NULL,
            created_at TEXT NOT NULL
        );
        CREATE INDEX IF NOT EXISTS idx_label_events_episode ON label_events(dataset, episode_id, id)
        """
    )


def _m9_policy_index_seen(conn: sqlite3.Connection) -> None:
    """Per promoted policy, the newest signed index entry this workspace has served from
    (core.govern.policy_folder.resolve_active): an entry reflecting an earlier registry event
    than this high-water mark is an old index put back, and refused."""
    _run_script(
        conn, """
        CREATE TABLE IF NOT EXISTS policy_index_seen (
            name TEXT PRIMARY KEY,
            sequence INTEGER NOT NULL,
            fingerprint TEXT NOT NULL,
            active TEXT NOT NULL,
            manifest_digest TEXT NOT NULL,
            seen_at TEXT NOT NULL
        )
        """
    )


def _m10_dataset_lifecycle(conn: sqlite3.Connection) -> None:
    """Archiving and deleting datasets (core.data.datasets): ``datasets.archived_at`` (NULL
    while the dataset is in use; an archived one keeps its data and leaves the pickers), and an
    append-only log of every archive, restore and deletion (refused ones too) that outlives
    the dataset it names."""
    _run_script(
        conn, """
        ALTER TABLE datasets ADD COLUMN archived_at TEXT;
        CREATE TABLE IF NOT EXISTS dataset_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            dataset TEXT NOT NULL,
            event TEXT NOT NULL CHECK (event IN ('archived', 'restored', 'deleted', 'archive_refused',
                                                 'delete_refused')),
            actor TEXT NOT NULL,
            role TEXT NOT NULL,
            at TEXT NOT NULL,
            detail TEXT
        );
        CREATE INDEX IF NOT EXISTS idx_dataset_events_dataset ON dataset_events(dataset, id)
        """
    )
    for name, when, message in (
        ("dataset_events_no_update", "UPDATE ON dataset_events", "dataset events are append-only"),
        ("dataset_events_no_delete", "DELETE ON dataset_events", "dataset events are append-only"),
        ("dataset_events_no_replace", "INSERT ON dataset_events WHEN EXISTS (SELECT 1 FROM dataset_events "
         "WHERE id = NEW.id)", "dataset events are append-only"),
    ):
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {when} "
                     f"BEGIN SELECT RAISE(ABORT, '{message}'); END")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_m1_initial, _m2_users_review_audit, _m3_runs,
                                                          _m4_template_versions, _m5_policy_registry,
                                                          _m6_tuning, _m7_sign_in, _m8_criteria_and_labels,
                                                          _m9_policy_index_seen, _m10_dataset_lifecycle]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class DatasetInfo:
    name: str
    domain: str | None
    n_episodes: int
    n_steps: int
    created_at: str
    #: When it was archived (hidden from pickers, data kept); None while in use
    archived_at: str | None = None

    @property
    def archived(self) -> bool:
        return self.archived_at is not None


@dataclass(frozen=True)
class OutcomeFigures:
    """An episode's recorded outcome as the episodes table holds it."""

    #: Whether the task was resolved (None: not recorded)
    resolved: bool | None
    final_reward: float | None
    business_metric: float | None


@dataclass(frozen=True)
class EpisodeSummary:
    """One stored episode without its steps (:meth:`Workspace.episode_summaries`)."""

    dataset: str
    episode_id: str
    domain: str | None
    task_type: str | None
    #: Who acted: "expert", "noisy" … (None: not recorded)
    behaviour: str | None
    n_steps: int
    resolved: bool | None
    final_reward: float | None
    business_metric: float | None
    #: The task's request text
    query: str | None
    #: ``resolved``, ``final_reward`` and ``business_metric`` together
    outcome: OutcomeFigures


def episode_row(ep: Episode, body: str, content_hash: str) -> tuple[Any, ...]:
    """The ``episodes`` columns of one episode, from ``episode_id`` to ``source_line``, then
    ``body`` (dataset and import_id are added by :meth:`Workspace.insert_rows`)."""
    o = ep.outcome
    return (ep.episode_id, ep.domain, ep.task.task_type, ep.task.query, ep.behaviour, ep.n_steps,
            None if o.resolved is None else int(o.resolved), o.final_reward, o.business_metric,
            content_hash, ep.source.file, ep.source.format, ep.source.line, body)


def step_rows(ep: Episode) -> list[tuple[Any, ...]]:
    """The ``steps`` columns (without episode_uid) of each step of ``ep``."""
    return [(s.t, s.action.kind, s.action.tool,
             json.dumps(s.action.params, ensure_ascii=False, sort_keys=True) if s.action.params else None,
             s.tool_error, s.output_text, s.latency_ms) for s in ep.steps]


class Workspace:
    """A workspace folder: ``workbench.db`` plus ``artifacts/``.

    One ``Workspace`` may be shared by threads (Streamlit sessions, the audit
    writer's flusher): each thread gets its own SQLite connection, so one
    thread's open transaction never swallows another's writes."""

    _lock = threading.Lock()

    def __init__(self, root: Path):
        self.root = root
        self.artifacts = root / "artifacts"
        self.db_path = root / DB_NAME
        self._local = threading.local()
        self._all_conns: list[tuple[threading.Thread, sqlite3.Connection]] = []
        self._conns_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, timeout=30, check_same_thread=False,
                               isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=30000")
        with self._conns_lock:
            # Streamlit runs each rerun on a fresh thread: close the connections of
            # threads that have ended so they do not pile up.
            alive = []
            for thread, old in self._all_conns:
                if thread.is_alive():
                    alive.append((thread, old))
                else:
                    old.close()
            alive.append((threading.current_thread(), conn))
            self._all_conns = alive
        return conn

    @property
    def db(self) -> sqlite_utils.Database:
        """This thread's sqlite-utils view of the database."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite_utils.Database(self._connect())
            self._local.db = db
        return db

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's raw connection (autocommit; use :meth:`transaction` to write)."""
        return self.db.conn

    # ----------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | Path | None = None, *, create: bool = True) -> "Workspace":
        """Open (and create or migrate) the workspace at ``path`` (default: see
        :func:`default_workspace_path`)."""
        root = Path(path).resolve() if path else default_workspace_path()
        if not root.exists():
            if not create:
                raise WorkspaceError(f"no workspace at {root}")
            root.mkdir(parents=True)
        (root / "artifacts").mkdir(exist_ok=True)
        ws = cls(root)
        ws.migrate()
        return ws

    @classmethod
    def memory(cls, root: str | Path) -> "Workspace":
        """A workspace whose folder is ``root`` (for tests); same as :meth:`open`."""
        return cls.open(root)

    def close(self) -> None:
        """Close every connection this workspace opened (in any thread)."""
        with self._conns_lock:
            conns, self._all_conns = self._all_conns, []
        for _, conn in conns:
            conn.close()
        self._local = threading.local()

    def schema_version(self) -> int:
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self) -> int:
        """Apply forward migrations; refuse a database from newer code."""
        with self._lock:
            current = self.schema_version()
            if current > len(MIGRATIONS):
                raise WorkspaceError(
                    f"workspace {self.root} has schema version {current}, newer than this "
                    f"Reward Workbench ({len(MIGRATIONS)}); upgrade the package")
            for version in range(current, len(MIGRATIONS)):
                with self.transaction() as conn:
                    MIGRATIONS[version](conn)
                    conn.execute(f"PRAGMA user_version={version + 1}")
            return self.schema_version()

    # ----------------------------------------------------------------- transactions
    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One all-or-nothing write: BEGIN IMMEDIATE … COMMIT, ROLLBACK on any error.

        Nested use joins the outer transaction (a SAVEPOINT), so a helper that writes
        inside an import is rolled back with it."""
        conn = self.conn
        if conn.in_transaction:
            name = f"sp{id(conn)}_{time.monotonic_ns()}"
            conn.execute(f"SAVEPOINT {name}")
            try:
                yield conn
            except BaseException:
                conn.execute(f"ROLLBACK TO {name}")
                conn.execute(f"RELEASE {name}")
                raise
            conn.execute(f"RELEASE {name}")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # ----------------------------------------------------------------- artifacts
    def artifact_dir(self, *parts: str) -> Path:
        p = self.artifacts.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    # ----------------------------------------------------------------- datasets & episodes
    def ensure_dataset(self, conn: sqlite3.Connection, name: str, domain: str | None) -> None:
        conn.execute(
            "INSERT OR IGNORE INTO datasets(name, domain, description, created_at) VALUES (?,?,?,?)",
            (name, domain, None, _now()))

    def datasets(self, *, include_archived: bool = False) -> list[DatasetInfo]:
        """The datasets by name; archived ones (core.data.datasets.archive_dataset) only when
        ``include_archived``: pickers never offer them, their data stays loadable."""
        where = "" if include_archived else "WHERE d.archived_at IS NULL"
        rows = self.conn.execute(
            f"""SELECT d.name, d.domain, d.created_at, COUNT(e.uid), COALESCE(SUM(e.n_steps), 0), d.archived_at
                FROM datasets d LEFT JOIN episodes e ON e.dataset = d.name {where}
                GROUP BY d.name ORDER BY d.name""").fetchall()
        return [DatasetInfo(name=r[0], domain=r[1], created_at=r[2], n_episodes=r[3], n_steps=r[4],
                            archived_at=r[5]) for r in rows]

    def has_dataset(self, name: str) -> bool:
        return self.conn.execute("SELECT 1 FROM datasets WHERE name=?", (name,)).fetchone() is not None

    def require_dataset(self, name: str) -> None:
        if not self.has_dataset(name):
            known = ", ".join(d.name for d in self.datasets()) or "none yet"
            raise WorkspaceError(f"no dataset named {name!r} in {self.root}; known: {known}")

    def insert_episodes(self, conn: sqlite3.Connection, dataset: str, episodes: Iterable[Episode],
                        import_id: int | None = None,
                        prepared: Sequence[tuple[str, str]] | None = None) -> tuple[int, int]:
        """Insert episodes (and their steps) inside the caller's transaction.

        ``prepared``: optional ``(ep.to_json(), ep.content_hash())`` per episode, when the
        caller already computed them (the importers do, to locate errors and save a dump).
        Returns (episodes, steps) inserted.  A repeated ``(dataset, episode_id)`` raises
        ``sqlite3.IntegrityError`` — callers decide ids before they get here."""
        eps = list(episodes)
        if prepared is not None and len(prepared) != len(eps):
            raise ValueError("prepared must hold one (body, content_hash) pair per episode")
        rows = [episode_row(ep, *(prepared[i] if prepared is not None else (ep.to_json(), ep.content_hash())))
                for i, ep in enumerate(eps)]
        return self.insert_rows(conn, dataset, rows, [step_rows(ep) for ep in eps], import_id)

    def insert_rows(self, conn: sqlite3.Connection, dataset: str, episodes: Sequence[tuple[Any, ...]],
                    steps: Sequence[Sequence[tuple[Any, ...]]], import_id: int | None = None
                    ) -> tuple[int, int]:
        """Insert rows made by :func:`episode_row` and :func:`step_rows` (one list of step
        rows per episode), inside the caller's transaction.  Returns (episodes, steps)."""
        if len(episodes) != len(steps):
            raise ValueError("steps must hold one list of step rows per episode")
        first = conn.execute("SELECT COALESCE(MAX(uid), 0) FROM episodes").fetchone()[0]
        conn.executemany(
            """INSERT INTO episodes(dataset, episode_id, domain, task_type, query, behaviour, n_steps,
                   resolved, final_reward, business_metric, content_hash, source_file,
                   source_format, source_line, import_id, body)
               VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
            [(dataset, *row[:-1], import_id, row[-1]) for row in episodes])
        uids = [r[0] for r in conn.execute(
            "SELECT uid FROM episodes WHERE uid > ? AND dataset = ? ORDER BY uid", (first, dataset))]
        if len(uids) != len(episodes):  # pragma: no cover - guarded by the transaction's write lock
            raise WorkspaceError("concurrent insert changed episode ids; retry the import")
        flat = [(uid, *row) for uid, rows in zip(uids, steps) for row in rows]
        conn.executemany(
            """INSERT INTO steps(episode_uid, t, kind, tool, params, tool_error, output_text, latency_ms)
               VALUES (?,?,?,?,?,?,?,?)""", flat)
        return len(episodes), len(flat)

    def upsert_tools(self, conn: sqlite3.Connection, dataset: str, tools: Iterable[ToolSchema]) -> int:
        n = 0
        for tool in tools:
            conn.execute("INSERT OR REPLACE INTO tools(dataset, name, schema) VALUES (?,?,?)",
                         (dataset, tool.name, tool.model_dump_json()))
            n += 1
        return n

    def tools(self, dataset: str) -> list[ToolSchema]:
        return [ToolSchema.model_validate_json(r[0]) for r in self.conn.execute(
            "SELECT schema FROM tools WHERE dataset=? ORDER BY name", (dataset,))]

    def episode_ids(self, dataset: str) -> list[str]:
        return [r[0] for r in self.conn.execute(
            "SELECT episode_id FROM episodes WHERE dataset=? ORDER BY uid", (dataset,))]

    def load_episodes(self, dataset: str, *, limit: int | None = None,
                      episode_ids: list[str] | None = None) -> list[Episode]:
        """Episodes of a dataset in import order."""
        self.require_dataset(dataset)
        sql = "SELECT body FROM episodes WHERE dataset=?"
        args: list[Any] = [dataset]
        if episode_ids is not None:
            sql += f" AND episode_id IN ({','.join('?' * len(episode_ids))})"
            args.extend(episode_ids)
        sql += " ORDER BY uid"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return [episode_from_body(r[0]) for r in self.conn.execute(sql, args)]

    def get_episode(self, dataset: str, episode_id: str) -> Episode:
        row = self.conn.execute("SELECT body FROM episodes WHERE dataset=? AND episode_id=?",
                                (dataset, episode_id)).fetchone()
        if row is None:
            raise WorkspaceError(f"no episode {episode_id!r} in dataset {dataset!r}")
        return episode_from_body(row[0])

    def episode_summaries(self, dataset: str | None = None) -> list[EpisodeSummary]:
        """Every stored episode (of ``dataset``, or of all) without its steps, in import order."""
        sql = ("SELECT dataset, episode_id, domain, task_type, behaviour, n_steps, resolved, "
               "final_reward, business_metric, query FROM episodes")
        args: tuple[Any, ...] = ()
        if dataset:
            sql += " WHERE dataset=?"
            args = (dataset,)
        sql += " ORDER BY uid"
        out = []
        for ds, episode_id, domain, task_type, behaviour, n_steps, resolved, final_reward, business_metric, query \
                in self.conn.execute(sql, args):
            resolved = None if resolved is None else bool(resolved)
            out.append(EpisodeSummary(
                dataset=ds, episode_id=episode_id, domain=domain, task_type=task_type, behaviour=behaviour,
                n_steps=n_steps, resolved=resolved, final_reward=final_reward, business_metric=business_metric,
                query=query, outcome=OutcomeFigures(resolved=resolved, final_reward=final_reward,
                                                    business_metric=business_metric)))
        return out
