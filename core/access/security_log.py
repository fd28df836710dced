"""The security log's file: one JSON line per event, appended and flushed to disk at once.

:func:`core.access.audit.security_event` is the API the rest of ``core`` calls (an
:class:`~core.access.users.Actor` and the details).  It writes through :func:`append`
here, and so does :mod:`core.access.users` for refused sign-ins and passwords: ``audit``
imports ``users``, so ``users`` cannot import ``audit``; this module imports neither.

Details: docs/security.md (## Signed bundles, …: "Security log").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Where the log lives under the workspace's artifacts.
SECURITY_LOG = ("security", "events.jsonl")


def security_log_path(ws: "Workspace") -> Path:
    """The log file of ``ws`` (its folder is made on first need)."""
    return ws.artifact_dir(SECURITY_LOG[0]) / SECURITY_LOG[1]


def append(ws: "Workspace", event: str, *, actor: str | None, role: str | None,
           detail: Mapping[str, Any], at: str | None = None) -> dict[str, Any]:
    """Append one event and return it as written: ``at`` (UTC, the audit trail's
    timestamp format; now when not given), ``event``, ``actor`` and ``role`` (None when no
    signed-in user caused it) and ``detail`` (names, sizes, digests, reasons: never a
    secret).  One ``O_APPEND`` write, fsynced before returning, so concurrent writers never
    interleave within a line."""
    stamp = at or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    record = {"at": stamp, "event": event, "actor": actor, "role": role, "detail": dict(detail)}
    line = (json.dumps(record, ensure_ascii=False, sort_keys=True, default=str) + "\n").encode("utf-8")
    fd = os.open(security_log_path(ws), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return record
