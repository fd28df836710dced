"""Errors that speak to the analyst: what was wrong, where, and what to do.

Every error a user can cause derives from :class:`RwbError`; the CLI prints its
message (no traceback) and exits with ``exit_code``; the app shows it with
``st.error``.
"""

from __future__ import annotations


class RwbError(Exception):
    """Base class of user-facing errors."""

    exit_code = 2


class InputError(RwbError):
    """Bad input data, located precisely: file, line or record index, field."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 record: int | None = None, field: str | None = None):
        self.file, self.line, self.record, self.field = file, line, record, field
        self.reason = message
        where = []
        if file:
            where.append(str(file))
        if line is not None:
            where.append(f"line {line}")
        if record is not None:
            where.append(f"record {record}")
        if field:
            where.append(f"field '{field}'")
        super().__init__(f"{': '.join([', '.join(where), message]) if where else message}")

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "record": self.record, "field": self.field,
                "reason": self.reason, "message": str(self)}


class PermissionDenied(RwbError):
    """The acting user's role does not allow this."""

    exit_code = 3


class ConflictError(RwbError):
    """A save on top of a stale version, a claim already held, …"""

    exit_code = 4
