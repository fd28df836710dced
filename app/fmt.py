"""Numbers as an analyst reads them: rounded to a few significant digits, with thousands
separators, a percentage for a share, and a dash where there is no figure.

Pages never print a raw float (``0.32000000000000006``): every figure on a page goes
through :func:`number` (or :func:`signed` for a change), so that a figure never shows
more digits than it means.
"""

from __future__ import annotations

import math
from numbers import Real

#: What a page shows where there is no figure (None, NaN).
MISSING = "—"
#: Units :func:`number` writes itself: a share is a percentage of 1.
SHARE_UNITS = ("share", "%")
#: Counting units said in the singular for exactly one ("1 time", "1 episode").
SINGULAR = {"times": "time", "episodes": "episode", "steps": "step", "items": "item", "trials": "trial"}


def _is_missing(x: object) -> bool:
    return x is None or (isinstance(x, Real) and not isinstance(x, bool) and math.isnan(float(x)))


def _rounded(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, with thousands separators and no exponent
    below a trillion; trailing zeros of a fraction dropped."""
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    if magnitude >= 12 or magnitude < -6:
        return f"{x:.{max(digits - 1, 0)}e}"
    decimals = max(digits - 1 - magnitude, 0)
    text = f"{round(x, decimals):,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def number(x: object, unit: str | None = None, digits: int = 3) -> str:
    """``x`` for reading: at most ``digits`` significant digits (whole numbers keep all
    theirs, with separators), ``unit`` after it; a ``share`` unit shows a percentage.

    >>> number(0.32000000000000006), number(40960), number(0.1234, "share"), number(None)
    ('0.32', '40,960', '12.3%', '—')
    >>> number(2.4471, "return"), number(-0.0403)
    ('2.45 return', '-0.0403')
    """
    if _is_missing(x):
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not isinstance(x, Real):
        return str(x)
    if unit in SHARE_UNITS:
        return _rounded(float(x) * 100, digits) + "%"
    if isinstance(x, int) or float(x).is_integer() and abs(float(x)) >= 10 ** digits:
        text = f"{int(x):,}"
    else:
        text = _rounded(float(x), digits)
    if unit and float(x) == 1:
        unit = SINGULAR.get(unit, unit)
    return f"{text} {unit}" if unit else text


def signed(x: object, unit: str | None = None, digits: int = 3) -> str:
    """A change, always with its sign: ``+0.12``, ``−0.04`` (a true minus sign), ``±0``.

    For text and tables; a ``st.metric`` delta takes :func:`delta` (Streamlit reads its
    arrow and colour from an ASCII minus).

    >>> signed(0.1234), signed(-0.0403), signed(0), signed(0.05, "share")
    ('+0.123', '−0.0403', '±0', '+5%')
    """
    if _is_missing(x) or not isinstance(x, Real) or isinstance(x, bool):
        return number(x, unit, digits)
    if x == 0:
        return "±0" + (f" {unit}" if unit and unit not in SHARE_UNITS else "")
    text = number(abs(x), unit, digits)
    return ("+" if x > 0 else "−") + text


def delta(x: object, unit: str | None = None, digits: int = 3) -> str | None:
    """A change as ``st.metric``'s ``delta`` takes it: rounded, signed with an ASCII ``-``
    (which turns the arrow down and red), ``None`` where there is no figure.

    >>> delta(-0.0403), delta(0.12), delta(None)
    ('-0.0403', '+0.12', None)
    """
    if _is_missing(x) or not isinstance(x, Real) or isinstance(x, bool):
        return None
    return signed(x, unit, digits).replace("−", "-").replace("±", "")
