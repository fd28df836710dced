"""The reference benchmarks/bench_decide.py sets beside decide()'s tail: the machine's own
floor for fixed work, and the hypervisor's steal read from /proc/stat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decide", ROOT / "benchmarks" / "bench_decide.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_decide"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_decide", None)


def test_steal_share_is_stolen_ticks_over_all_ticks_between_two_readings(bench):
    assert bench.steal_share((10, 1_000), (15, 1_100)) == pytest.approx(0.05)
    assert bench.steal_share((10, 1_000), (10, 1_000)) is None  # no tick passed
    assert bench.steal_share(None, (15, 1_100)) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat here")
def test_cpu_ticks_read_steal_and_the_total_of_all_cpus(bench):
    steal, total = bench.cpu_ticks()
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    assert 0 <= steal <= total
    assert total >= sum(fields[:4])  # user, nice, system and idle at least
    assert bench.cpu_ticks()[1] >= total  # the counters only grow


def test_the_machine_floor_runs_its_chunk_as_often_as_asked_and_at_the_due_times(bench):
    import time

    t0 = time.perf_counter()
    paced = bench.machine_floor([0.05 * k for k in range(5)], 5, 0.2)
    assert paced["n"] == 5 and paced["chunk_ms"] == 0.2
    assert time.perf_counter() - t0 >= 0.2  # the last run was due 0.2 s after the first
    back_to_back = bench.machine_floor(None, 40, 0.2)
    assert back_to_back["n"] == 40
    # the loop is scaled to the chunk: its median run lands near it even on a busy machine
    assert 0.02 < back_to_back["p50"] < 5.0



def test_the_cold_penalty_times_the_same_work_back_to_back_and_at_the_due_times(bench):
    import time

    calls = []
    t0 = time.perf_counter()
    out = bench.cold_penalty(lambda: calls.append(time.perf_counter()), [0.02 * k for k in range(6)])
    assert len(calls) == 50 + 6 + 6  # warm-up, back to back, paced
    paced = calls[-6:]
    assert paced[-1] - paced[0] >= 0.1  # the last paced call was due 0.1 s after the first
    assert time.perf_counter() - t0 >= 0.1
    assert out["paced_us"] > 0 and out["back_to_back_us"] > 0
    assert out["ratio"] == pytest.approx(out["paced_us"] / out["back_to_back_us"])


def test_the_machine_floor_of_nothing_is_empty_rather_than_a_crash(bench):
    for count, chunk in ((0, 0.5), (10, None)):
        empty = bench.machine_floor(None, count, chunk)
        assert (empty["n"], empty["p50"], empty["p99"], empty["steal"]) == (0, None, None, None)
