"""Errors that speak to the analyst: what was wrong, where, and what to do.

Every error a user can cause derives from :class:`RwbError`; the CLI prints its
message (no traceback) and exits with ``exit_code``; the app shows it with
``st.error``.
"""

from __future__ import annotations

from collections.abc import Sequence


class RwbError(Exception):
    """Base class of user-facing errors."""

    exit_code = 2


class InputError(RwbError):
    """Bad input data, located precisely: file, line or record index, field.

    ``message`` says what was wrong.  Optional structure lets each front end word the fix
    its own way: ``allowed`` lists the values ``field`` accepts, and ``hint`` says what to
    do in the command line's words (it follows the message after "; " in ``str(exc)``, so
    CLI output reads as one sentence; the app rewords it, see ``app/messages.py``).
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 record: int | None = None, field: str | None = None,
                 allowed: Sequence[str] | None = None, hint: str | None = None):
        self.file, self.line, self.record, self.field = file, line, record, field
        self.reason = message
        self.allowed = tuple(allowed) if allowed is not None else None
        self.hint = hint
        where = []
        if file:
            where.append(str(file))
        if line is not None:
            where.append(f"line {line}")
        if record is not None and line is None:  # a line says where a record is; its index would only confuse
            where.append(f"record {record}")
        if field:
            where.append(f"field '{field}'")
        text = f"{message}; {hint}" if hint else message
        super().__init__(f"{': '.join([', '.join(where), text]) if where else text}")

    def relocated(self, file: str) -> InputError:
        """The same error naming another file (e.g. an upload by its original name)."""
        return InputError(self.reason, file=file, line=self.line, record=self.record,
                          field=self.field, allowed=self.allowed, hint=self.hint)

    def to_dict(self) -> dict:
        out: dict[str, object] = {"file": self.file, "line": self.line, "record": self.record, "field": self.field,
               "reason": self.reason, "message": str(self)}
        if self.allowed is not None:
            out["allowed"] = list(self.allowed)
        if self.hint:
            out["hint"] = self.hint
        return out


class PermissionDenied(RwbError):
    """The acting user's role does not allow this."""

    exit_code = 3


class ConflictError(RwbError):
    """A save on top of a stale version, a claim already held, …"""

    exit_code = 4
