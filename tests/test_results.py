"""core.base.results: the one serialiser behind every ``--json`` output."""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

from core.base.results import dumps, to_jsonable


class Stage(enum.Enum):
    CANDIDATE = "candidate"
    PRODUCTION = "production"


@dataclass(frozen=True)
class Check:
    check: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Report:
    path: Path
    stage: Stage
    checks: list[Check] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)


class Ref(BaseModel):
    name: str
    dim: int


def test_nested_dataclasses_become_dicts_in_field_order() -> None:
    report = Report(Path("/tmp/b.zip"), Stage.PRODUCTION, [Check("zip", True), Check("sha", False, "differs")],
                    {"mean": 0.25})
    assert to_jsonable(report) == {
        "path": "/tmp/b.zip", "stage": "production",
        "checks": [{"check": "zip", "ok": True, "detail": ""}, {"check": "sha", "ok": False, "detail": "differs"}],
        "scores": {"mean": 0.25}}
    assert list(json.loads(dumps(report))) == ["path", "stage", "checks", "scores"]


def test_round_trip_of_a_dataclass_through_its_json() -> None:
    check = Check("manifest", False, "missing field ‘name’")
    assert Check(**json.loads(dumps(check))) == check
    assert "‘name’" in dumps(check)  # non-ASCII is written as is, not \\u-escaped


def test_numpy_scalars_and_arrays_become_python_numbers_and_lists() -> None:
    value = {"f32": np.float32(0.5), "i64": np.int64(7), "flag": np.bool_(True),
             "grid": np.arange(6, dtype=np.int32).reshape(2, 3), "f64": np.float64(1.25)}
    out = to_jsonable(value)
    assert out == {"f32": 0.5, "i64": 7, "flag": True, "grid": [[0, 1, 2], [3, 4, 5]], "f64": 1.25}
    assert type(out["i64"]) is int and type(out["flag"]) is bool and type(out["f64"]) is float  # type: ignore[index]
    assert json.loads(dumps(value))["grid"] == [[0, 1, 2], [3, 4, 5]]


def test_nan_and_infinity_are_written_as_json_module_writes_them() -> None:
    # The CLI has always written json.dumps's NaN / Infinity tokens; json.loads reads them back.
    text = dumps({"mean": float("nan"), "best": np.float32("inf"), "worst": -math.inf})
    assert text == '{"mean": NaN, "best": Infinity, "worst": -Infinity}'
    back = json.loads(text)
    assert math.isnan(back["mean"]) and back["best"] == math.inf and back["worst"] == -math.inf


def test_paths_dates_bytes_sets_enums_and_pydantic_models() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert to_jsonable({"p": Path("a") / "b.json", "t": when, "d": dt.date(2026, 1, 2), "raw": b"\x01\xff",
                        "tags": {"b", "a", "c"}, "s": Stage.CANDIDATE, "ref": Ref(name="m", dim=3),
                        "pair": (1, "x")}) == {
        "p": str(Path("a") / "b.json"), "t": "2026-01-02T03:04:05+00:00", "d": "2026-01-02", "raw": "01ff",
        "tags": ["a", "b", "c"], "s": "candidate", "ref": {"name": "m", "dim": 3}, "pair": [1, "x"]}


def test_mapping_keys_are_written_as_json_writes_them() -> None:
    assert to_jsonable({3: "a", True: "b", None: "c", 2.5: "d"}) == {"3": "a", "true": "b", "null": "c", "2.5": "d"}


def test_unknown_objects_become_their_str() -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque#1"

    assert dumps({"x": Opaque()}) == '{"x": "opaque#1"}'


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json_values)
def test_plain_json_values_are_written_exactly_as_the_cli_wrote_them(value: object) -> None:
    assert dumps(value) == json.dumps(value, ensure_ascii=False, default=str)


@pytest.mark.parametrize("argv, key", [(["keys", "show", "--json"], "fingerprint"),
                                      (["users", "list", "--json"], "users")])
def test_cli_json_goes_through_dumps(tmp_path: Path, argv: list[str], key: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from core.cli import main

    assert main(["--workspace", str(tmp_path / "ws"), *argv]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and key in json.loads(printed)


def test_typed_results_serialise_to_the_keys_the_cli_printed() -> None:
    from core.access.users import User
    from core.govern.bundle import EnvironmentCheck, VerifyCheck, VerifyReport

    user = User("ada", "admin", "ada@example.org", None, True, False, "2026-01-01T00:00:00Z", "local")
    assert to_jsonable(user) == user.to_dict()
    env = EnvironmentCheck("numpy", "2.1.0", "2.1.3", "same", "ok", "numpy 2.1.0 (here 2.1.3)")
    report = VerifyReport(path="b.zip", ok=True, checks=[VerifyCheck("zip", True, "")], environment=[env],
                          manifest={"name": "p", "version": "0.1.0"})
    printed = json.loads(dumps(report.to_dict()))
    assert printed["checks"] == [{"check": "zip", "ok": True, "detail": ""}]
    assert printed["environment"] == [env.to_dict()]
    assert (printed["name"], printed["version"]) == ("p", "0.1.0")
