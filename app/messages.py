"""The app's own words for errors and command-line equivalents.

Core errors are written once, for every front end; many name a CLI option
("give --format, one of …").  A page shows them through :func:`user_message`,
which names the page's input instead of the option.  Where a page mentions the
CLI at all, it does so second, under the in-app instruction, through
:func:`cli_equivalent`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import streamlit as st

from core.base.errors import InputError

#: ``--some-flag`` and its metavar, if any (``--dataset NAME``, ``--out F.zip``).
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?: [A-Z][A-Z0-9_.]*\b)?")

CLI_PREFIX = "From the command line: "


def field_label(field: str, labels: Mapping[str, str] | None = None) -> str:
    """The input's label on the page: ``labels[field]``, else the field in words
    (``messages_key`` → "Messages key")."""
    if labels and field in labels:
        return labels[field]
    words = field.replace("-", " ").replace("_", " ").strip()
    return words[:1].upper() + words[1:]


def app_words(text: str, labels: Mapping[str, str] | None = None) -> str:
    """``text`` with every ``--flag [METAVAR]`` replaced by the bold label of its field."""
    return _FLAG.sub(lambda m: f"**{field_label(m.group(1).replace('-', '_'), labels)}**", text)


def user_message(exc: BaseException, labels: Mapping[str, str] | None = None) -> str:
    """An error as a page shows it: where, what was wrong, and what to do in the app.

    For an :class:`~core.base.errors.InputError` with ``allowed`` values the fix reads
    "Format: choose one of auto, rwb, …"; otherwise CLI options in the text become the
    labels of the page's inputs (``labels`` maps field → label).  The CLI keeps
    ``str(exc)`` unchanged.

    >>> user_message(InputError("cannot tell the format", hint="give --format, one of a, b",
    ...                         allowed=["a", "b"], field="format"))
    'cannot tell the format. **Format**: choose one of a, b.'
    """
    if not isinstance(exc, InputError):
        return app_words(str(exc), labels)
    where = [str(exc.file)] if exc.file else []
    if exc.line is not None:
        where.append(f"line {exc.line}")
    if exc.record is not None and exc.line is None:  # "line 2", never "line 2, record 1"
        where.append(f"record {exc.record}")
    if exc.allowed and exc.field:
        text = (f"{app_words(exc.reason, labels)}. **{field_label(exc.field, labels)}**: "
                f"choose one of {', '.join(exc.allowed)}.")
    else:
        if exc.field:
            where.append(f"field '{exc.field}'")
        text = app_words(f"{exc.reason}; {exc.hint}" if exc.hint else exc.reason, labels)
    return f"{', '.join(where)}: {text}" if where else text


def cli_equivalent(command: str, note: str = "") -> None:
    """A small caption under the in-app instruction saying the same works from a terminal;
    the command itself is in the caption's tooltip, so the page's text stays in the app's
    words (``note``, if given, says what the command does beyond the page's action)."""
    st.caption("Also from the command line" + (f" ({note})" if note else "") + ": hover the sign.",
               help=f"{CLI_PREFIX}`{command}`")
