"""The reference benchmarks/bench_decide.py sets beside decide()'s tail: the machine's own
floor for fixed work, and the hypervisor's steal read from /proc/stat."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace
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


def test_the_tail_ratio_is_decides_p99_over_its_floors_p99_over_the_pooled_rounds(bench):
    def part(ms):
        return {"all": bench.percentiles(ms), "rl_boost": bench.percentiles(ms[::2]), "all_ms": ms, "rl_boost_ms": ms[::2]}

    def floor(ms):
        return {**bench.percentiles(ms), "chunk_ms": 1.0, "steal": None, "wall_ms": ms}

    slow, fast = [1.0] * 99 + [3.0], [1.0] * 100
    rounds = [{"paced": part(slow), "paced_floor": floor(fast), "back_to_back": part(fast), "back_to_back_floor": floor(fast)},
              {"paced": part(fast), "paced_floor": floor(fast), "back_to_back": part(fast), "back_to_back_floor": floor(slow)}]
    tail = bench.pooled_tail(rounds)
    assert tail["rounds"] == 2 and tail["paced"]["all"]["n"] == 200
    # pooled: one slow request in 200 sits beyond the p99, so the pooled ratio is 1 while the first round's is not
    t = bench.tail_ratios({"tail": tail})
    assert t["paced"] == pytest.approx(bench.percentiles(slow + fast)["p99"] / 1.0)
    assert t["paced_per_round"] == [pytest.approx(bench.percentiles(slow)["p99"]), pytest.approx(1.0)]
    assert t["back_to_back_per_round"][1] == pytest.approx(1.0 / bench.percentiles(slow)["p99"])
    assert t["goal"] == bench.TAIL_RATIO_GOAL and t["rounds"] == 2
    assert all("all_ms" not in r["paced"] and "wall_ms" not in r["paced_floor"] for r in rounds)  # raw times dropped
    empty = bench.pooled_tail([{"paced": part([]), "paced_floor": floor([]), "back_to_back": part([]),
                                "back_to_back_floor": floor([])}])
    assert bench.tail_ratios({"tail": empty})["back_to_back"] is None   # nothing measured: no ratio, no crash


def test_the_paired_pass_runs_the_floors_computation_after_every_request(bench, monkeypatch):
    spins = []
    monkeypatch.setattr(bench, "spin_iterations", lambda chunk_ms: 7)
    monkeypatch.setattr(bench, "_spin", lambda n: spins.append(n))

    class Engine:
        def __init__(self):
            self.ids = []

        def decide(self, request):
            assert len(spins) == len(self.ids)          # the floor's run of the request before came first
            self.ids.append(request["episode_id"])
            return SimpleNamespace(rl_boost=True, intent_pending=False)

        def flush(self):
            pass

    steps = [[bench.Step({"episode_id": f"e{i}"}, float(k), 1.0) for k in range(2)] for i in range(3)]
    engine = Engine()
    decide, floor = bench.paired_back_to_back(engine, bench.ReplayClock(), steps, 10.0, "-pair", 0.9)
    assert engine.ids == ["e0-pair"] * 2 + ["e1-pair"] * 2 + ["e2-pair"] * 2
    assert spins == [7] * 6 and decide["all"]["n"] == floor["n"] == 6 and floor["chunk_ms"] == 0.9


def test_back_to_back_decides_every_request_under_new_episode_ids_and_sorts_out_rl_boosts(bench):
    class Engine:
        def __init__(self):
            self.ids, self.flushed = [], 0

        def decide(self, request):
            self.ids.append(request["episode_id"])
            return SimpleNamespace(rl_boost=len(self.ids) % 2 == 0, intent_pending=len(self.ids) == 4)

        def flush(self):
            self.flushed += 1

    steps = [[bench.Step({"episode_id": f"e{i}"}, float(k), 1.0) for k in range(3)] for i in range(2)]
    engine, clock = Engine(), bench.ReplayClock()
    out = bench.back_to_back(engine, clock, steps, 10.0, "-b2b")
    assert engine.ids == ["e0-b2b"] * 3 + ["e1-b2b"] * 3 and engine.flushed == 1
    assert out["all"]["n"] == 6 and out["rl_boost"]["n"] == 2        # requests 2 and 6 (4 was deferred)
    assert clock.t == pytest.approx(1 / 10 + 2.0)                     # the last request's recorded time


def test_the_production_size_is_the_network_the_demo_trains(bench):
    from core.sample.demo import FULL, demo_training_config
    from core.rl.ppo import PPOConfig

    production, demo = PPOConfig(**bench.SIZES["production"]), demo_training_config(FULL)
    assert (production.hidden, production.n_critics, production.encoder_config()) == \
        (demo.hidden, demo.n_critics, demo.encoder_config())
    assert demo.encoder_config().dim == 512 and PPOConfig(**bench.SIZES["small"]).encoder_config().dim == 64


def test_the_side_by_side_rounds_interleave_so_every_bundle_meets_the_same_machine(bench):
    calls = []
    out = bench.interleaved_rounds(["full", "distilled"], 3, lambda label, k: calls.append((label, k)) or {"k": k})
    assert calls == [("full", 0), ("distilled", 0), ("full", 1), ("distilled", 1), ("full", 2), ("distilled", 2)]
    assert out == {"full": [{"k": 0}, {"k": 1}, {"k": 2}], "distilled": [{"k": 0}, {"k": 1}, {"k": 2}]}


def test_the_side_by_side_report_prints_each_bundles_ratios_and_agreement_and_any_refusal(bench):
    def part(ms):
        return {"all": bench.percentiles(ms), "rl_boost": bench.percentiles(ms[:3]), "all_ms": ms, "rl_boost_ms": ms[:3]}

    def floor(ms):
        return {**bench.percentiles(ms), "chunk_ms": 1.0, "steal": None, "wall_ms": ms}

    def figures(decide_ms):
        tail = bench.pooled_tail([{"paced": part(decide_ms), "paced_floor": floor([1.0] * 100),
                                   "back_to_back": part(decide_ms), "back_to_back_floor": floor([1.0] * 100)}])
        return {"tail": tail, "tail_ratio": bench.tail_ratios({"tail": tail})}

    held = {"states": 656, "top1": 0.9954, "prob_gap_max": 0.05, "prob_gap_mean": 0.002, "value_gap_max": 0.1,
            "value_gap_mean": 0.01}
    out = {"rounds": 1, "episodes": 100, "load_before": 1.0, "load_after": 2.0,
           "bundles": {"full": {"precision": "full", "weights": 1_655_424, "heldout": None, **figures([2.0] * 100)},
                       "distilled": {"precision": "distilled", "weights": 237_696, "heldout": held,
                                     **figures([1.2] * 100)}},
           "refused": {"int8": "its most probable allowed action is the trained policy's on 98.00% …"}}
    text = "\n".join(bench.comparison_lines(out))
    assert "full" in text and "paced 2.00×, back to back 2.00×" in text and "the trained policy itself" in text
    assert "237,696 weights; tail ratio paced 1.20×" in text and "99.54% of 656 held-out states" in text
    assert "int8       not exported: its most probable" in text
