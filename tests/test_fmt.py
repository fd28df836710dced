"""Figures on pages are rounded for reading (rwb_app.fmt): never more significant digits
than asked, separators on large numbers, a percentage for a share, a dash for no figure."""

from __future__ import annotations

import doctest
import math
import re

from hypothesis import given, strategies as st

from rwb_app import fmt


def test_the_examples_in_the_docstrings_hold():
    failures, tried = doctest.testmod(fmt)
    assert tried >= 2 and failures == 0


def test_raw_floats_are_rounded_and_units_written():
    assert fmt.number(0.32000000000000006) == "0.32"
    assert fmt.number(2.5589999) == "2.56"
    assert fmt.number(40960) == "40,960"
    assert fmt.number(0.7768, digits=4) == "0.7768"
    assert fmt.number(0.0649, "share") == "6.49%"
    assert fmt.number(float("nan")) == fmt.MISSING
    assert fmt.number(None, "share") == fmt.MISSING
    assert fmt.number(True) == "yes"
    assert fmt.number(1.2e-9) == "1.20e-09"
    assert fmt.number(float("inf")) == "∞"
    assert fmt.signed(-0.040312) == "−0.0403"
    assert fmt.signed(0.25, "share") == "+25%"


#: The significant digits of a figure as written (separators, sign and exponent aside).
_DIGITS = re.compile(r"[0-9][0-9,]*(?:\.[0-9]+)?")


def _significant(text: str) -> int:
    mantissa = text.split("e")[0]
    digits = "".join(_DIGITS.findall(mantissa)).replace(",", "").replace(".", "").lstrip("0")
    return len(digits.rstrip("0")) if "." not in mantissa else len(digits)


@given(st.floats(min_value=-1e11, max_value=1e11, allow_nan=False).filter(lambda x: abs(x) < 1000))
def test_a_fraction_never_shows_more_than_the_digits_asked(x):
    text = fmt.number(x)
    assert _significant(text) <= 3
    if x != 0 and abs(x) >= 1e-6:
        assert math.isclose(float(text.replace(",", "")), x, rel_tol=5e-3, abs_tol=1e-12)
