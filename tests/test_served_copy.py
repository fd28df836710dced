"""The served copy of a policy (core.govern.served_copy, ``rwb bundle export --serve-precision``).

On the suite's tiny trained run: a copy of each precision is exported with its agreement on
the run's held-out states in the signed manifest, loads and serves in the policy's place, and
is what the registry evaluates; a copy below the bar is refused at export, and a bundle that
lies about its copy (its figures or its weights) is refused on load or by the registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import PASSWORDS, members, module_hash_embedder, trained_copy, workspace_key  # noqa: F401
from core.access.audit import security_events
from core.base.errors import InputError
from core.govern import registry, served_copy
from core.govern.bundle import (BUNDLE_FILES, SERVED_FILES, BundleError, export_bundle, load_bundle, verify_bundle,
                                write_bundle)

#: A distilled copy trained this little cannot make the policy's choices (the bar is 99%).
UNDERTRAINED = {"DISTILL_STATES": 300, "DISTILL_EPOCHS": 1}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_copy(tmp_path_factory)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """One bundle per precision the tiny run's policy passes the bar with, exported once."""
    out, ws = {}, run.workspace()
    folder = tmp_path_factory.mktemp("served-copies")
    for k, precision in enumerate(("float16", "bfloat16", "int8")):
        out[precision] = export_bundle(ws, run.actor("ana"), run.run_id, folder / f"{precision}.zip",
                                       name="served", version=f"0.{k + 1}.0", serve_precision=precision)
    ws.close()
    return out


def _stored_dtypes(path: Path) -> set[torch.dtype]:
    from safetensors.torch import load

    return {t.dtype for t in load(members(path)[SERVED_FILES[0]]).values()}


@pytest.mark.parametrize("precision, stored", [("float16", {torch.float16}), ("bfloat16", {torch.bfloat16}),
                                               ("int8", {torch.int8, torch.float32})])
def test_each_precision_is_exported_with_its_held_out_agreement_signed_in_the_manifest(exported, precision, stored):
    path = exported[precision]
    report = verify_bundle(path)
    assert report.ok and report.signer, report.reason
    m = report.manifest
    assert set(m["files"]) == set(BUNDLE_FILES) | set(SERVED_FILES)   # the copy is covered by the digest
    served = m["served"]
    assert served["precision"] == precision and served["min_top1"] == served_copy.MIN_TOP1
    held, smoke = served["heldout"], served["smoke"]
    # measured on the held-out episodes' states, not on the 64 smoke states
    assert held["states"] > smoke["states"] and "held-out episodes" in served["heldout_states"]
    assert held["top1"] >= 0.99 and 0 <= held["prob_gap_mean"] <= held["prob_gap_max"] <= 1
    assert held["value_gap_mean"] <= held["value_gap_max"]
    assert served["parameters"] == served["trained_parameters"]      # the same network, rounded weights
    assert _stored_dtypes(path) == stored


def test_a_loaded_bundle_serves_its_copy_not_the_trained_module(exported):
    from core.serve.serving import PolicyRuntime

    bundle = load_bundle(exported["int8"])
    copy, full = bundle.served, bundle.policy
    assert copy is not None and copy is not full and bundle.serve_precision == "int8"
    w_copy, w_full = copy.actor[0].weight, full.actor[0].weight
    assert not torch.equal(w_copy, w_full) and torch.allclose(w_copy, w_full, atol=0.05)   # rounded, close
    runtime = PolicyRuntime(bundle)
    assert runtime.serve_precision == "int8" and runtime.fast is not None
    # the numpy forward serving runs was built from the copy's weights
    np.testing.assert_array_equal(runtime.fast.actor[0][0], w_copy.numpy().T)
    assert not np.array_equal(runtime.fast.actor[0][0], w_full.numpy().T)


def test_a_bundle_without_a_copy_serves_the_trained_module(run):
    from core.serve.serving import PolicyRuntime

    bundle = load_bundle(run.bundle)
    runtime = PolicyRuntime(bundle)
    assert bundle.served is None and bundle.served_policy is bundle.policy and runtime.serve_precision == "full"
    np.testing.assert_array_equal(runtime.fast.actor[0][0], bundle.policy.actor[0].weight.numpy().T)


def test_the_engine_decides_with_the_copy(exported, tmp_path):
    from _state_fixtures import HashEmbedder
    from core.records.store import Workspace
    from core.serve.serving import DecisionEngine, ServingConfig

    bundle = load_bundle(exported["float16"])
    ws = Workspace.open(tmp_path / "serve-ws")
    engine = DecisionEngine(ws, bundle, config=ServingConfig(wait_for_intent=True), embedder=HashEmbedder())
    # a task type training never had: out of distribution, so RL-Boost runs the policy
    d = engine.decide({"episode_id": "e1", "query": "Analyse the Q3 report of Kweichow Moutai 600519",
                       "task_type": "never_trained_on", "state": {"hour": 10, "volatility": 0.1}})
    assert d.rl_boost and d.rl_candidates
    assert engine.runtime.fast.actor[0][0].dtype == np.float32
    np.testing.assert_array_equal(engine.runtime.fast.actor[0][0], bundle.served.actor[0].weight.numpy().T)
    engine.close()
    ws.close()


def test_a_copy_below_the_bar_is_refused_at_export_naming_the_precisions_to_try(run, tmp_path, monkeypatch):
    for name, value in UNDERTRAINED.items():
        monkeypatch.setattr(served_copy, name, value)
    ws = run.workspace()
    out = tmp_path / "distilled.zip"
    with pytest.raises(InputError) as err:
        export_bundle(ws, run.actor("ana"), run.run_id, out, name="served", version="0.9.0",
                      serve_precision="distilled")
    ws.close()
    assert err.value.field == "serve_precision"
    assert "held-out states" in err.value.reason and "--serve-precision float16 or bfloat16" in err.value.reason
    assert not out.exists()


def test_a_distilled_copy_is_a_smaller_network_that_loads_and_serves(run, tmp_path, monkeypatch):
    """The plumbing of a distilled copy (its own network in served.json, built on load, served
    by the numpy forward); the bar is lowered so that a copy trained in seconds passes it."""
    from core.serve.serving import PolicyRuntime

    for name, value in {**UNDERTRAINED, "MIN_TOP1": 0.0, "MAX_PROB_GAP_MEAN": 1.0}.items():
        monkeypatch.setattr(served_copy, name, value)
    ws = run.workspace()
    path = export_bundle(ws, run.actor("ana"), run.run_id, tmp_path / "distilled.zip", name="served",
                         version="0.8.0", serve_precision="distilled")
    ws.close()
    bundle = load_bundle(path)
    copy, full = bundle.served, bundle.policy
    dim, hidden = served_copy.student_size(full)
    assert (copy.encoder.config.dim, copy.hidden) == (dim, hidden)
    assert dim < full.encoder.config.dim and hidden < full.hidden
    assert bundle.manifest.served.parameters == sum(p.numel() for p in copy.parameters()) \
        < bundle.manifest.served.trained_parameters
    assert json.loads(members(path)[SERVED_FILES[1]])["encoder"]["config"]["dim"] == dim
    runtime = PolicyRuntime(bundle)
    assert runtime.fast is not None and runtime.fast.dim == dim


def test_an_unknown_precision_is_refused_before_any_work(run, tmp_path):
    ws = run.workspace()
    with pytest.raises(InputError) as err:
        export_bundle(ws, run.actor("ana"), run.run_id, tmp_path / "x.zip", serve_precision="float8")
    ws.close()
    assert err.value.field == "serve_precision" and "distilled" in err.value.reason
    # the bundle format's list, the manifest's schema and the copies made here are one list
    from typing import get_args

    from core.govern.bundle import SERVE_PRECISIONS, ServedCopy

    assert SERVE_PRECISIONS == ("full", *served_copy.PRECISIONS)
    assert get_args(ServedCopy.model_fields["precision"].annotation) == served_copy.PRECISIONS


def test_the_export_command_takes_the_precision_and_prints_the_agreement(run, tmp_path, monkeypatch, capsys):
    from core.cli import main

    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ana"])
    out = tmp_path / "cli.zip"
    code = main(["--workspace", str(run.root), "bundle", "export", run.run_id, "--out", str(out), "--name", "served",
                 "--version", "0.5.0", "--serve-precision", "bfloat16", "--as", "ana"])
    text = capsys.readouterr().out
    assert code == 0 and "Serving runs a bfloat16 copy" in text and "held-out states" in text
    assert main(["--workspace", str(run.root), "bundle", "export", run.run_id, "--out", str(tmp_path / "y.zip"),
                 "--serve-precision", "half", "--as", "ana"]) == 2


# --------------------------------------------------------------------------- lies about the copy
def _resealed(src: Path, dst: Path, root: Path, change) -> Path:
    """A copy of bundle ``src`` with ``change(manifest_body, files)`` applied, sealed and signed
    with the workspace's own key (a trusted signer that lies)."""
    files = members(src)
    body = json.loads(files.pop("manifest.json"))
    files.pop("signature.json")
    for key in ("digest", "files"):
        body.pop(key)
    change(body, files)
    return write_bundle(dst, body, files, key=workspace_key(root))


def test_a_copy_whose_smoke_figures_are_not_its_own_fails_verification(run, exported, tmp_path):
    def flatter(body, files):
        body["served"]["smoke"]["prob_gap_max"] = 0.0

    bad = _resealed(exported["int8"], tmp_path / "flatter.zip", run.root, flatter)
    report = verify_bundle(bad)
    assert not report.ok and "does not agree with the policy on the smoke states" in report.reason
    with pytest.raises(BundleError):
        load_bundle(bad)


def test_a_copy_whose_weights_are_not_its_precision_fails_verification(run, exported, tmp_path):
    def swapped(body, files):  # the float16 copy's bytes under the int8 copy's manifest
        files[SERVED_FILES[0]] = members(exported["float16"])[SERVED_FILES[0]]

    report = verify_bundle(_resealed(exported["int8"], tmp_path / "swapped.zip", run.root, swapped))
    assert not report.ok and "served.safetensors" in report.reason and "int8" in report.reason


def test_files_of_a_copy_without_its_manifest_record_are_refused(run, exported, tmp_path):
    def unrecorded(body, files):
        del body["served"]

    with pytest.raises(ValueError):  # the writer refuses it …
        _resealed(exported["int8"], tmp_path / "unrecorded.zip", run.root, unrecorded)


# --------------------------------------------------------------------------- the registry
def test_the_registry_evaluates_the_copy_that_will_be_served(run, exported, monkeypatch):
    import core.rl.evaluation as evaluation

    seen = []
    real = evaluation.evaluate

    def spy(ws, run_id, **kw):
        seen.append(kw.get("policy"))
        return real(ws, run_id, **kw)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    ws = run.workspace()
    reg = registry.register(ws, run.actor("ana"), exported["float16"])
    ws.close()
    bundle = load_bundle(exported["float16"])
    (copy,) = seen
    assert copy is not None and copy is not bundle.policy
    for k, v in bundle.served.state_dict().items():           # the very weights serving loads
        assert torch.equal(copy.state_dict()[k], v), k
    ws = run.workspace()
    detail = json.loads(ws.conn.execute("SELECT detail FROM registry_events WHERE name='served' AND version=? "
                                        "AND event='registered'", (reg.version,)).fetchone()[0])
    ws.close()
    assert "served float16 copy" in detail["evaluated_from"]
    recorded = load_bundle(exported["float16"]).manifest.served.heldout.model_dump()
    assert detail["served"]["heldout"] == pytest.approx(recorded, abs=1e-6)


def test_the_registry_refuses_a_copy_whose_held_out_figures_are_not_its_own(run, exported, tmp_path):
    def flatter(body, files):
        body["version"] = "0.7.0"
        body["served"]["heldout"]["prob_gap_max"] = body["served"]["heldout"]["prob_gap_max"] / 2 + 1e-3

    bad = _resealed(exported["int8"], tmp_path / "lying.zip", run.root, flatter)
    assert verify_bundle(bad).ok                       # signed by a trusted key; only the registry can tell
    ws = run.workspace()
    with pytest.raises(BundleError) as err:
        registry.register(ws, run.actor("ana"), bad)
    events = security_events(ws, "bundle_weights_refused")
    ws.close()
    assert err.value.field == "served" and "prob_gap_max" in err.value.reason
    assert events and events[-1].detail["policy"] == "served@0.7.0"


def test_agreement_counts_first_choices_and_probability_gaps_under_the_mask():
    class Fixed(torch.nn.Module):
        def __init__(self, logits, values):
            super().__init__()
            self.l, self.v = logits, values

        def state(self, obs):
            return obs["x"]

        def heads(self, state):
            return self.l[state.long()], self.v[state.long()]

    full = Fixed(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]), torch.tensor([[1.0], [2.0]]))
    copy = Fixed(torch.tensor([[2.0, 1.0, 5.0], [3.0, 0.0, 0.0]]), torch.tensor([[1.5], [2.0]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])   # row 0: the copy's 5.0 is masked
    got = served_copy.agreement(full, copy, {"x": torch.tensor([0, 1])}, mask)
    p1 = torch.softmax(torch.tensor([0.0, 3.0, 0.0]), 0)
    assert got.states == 2 and got.top1 == 0.5
    assert got.prob_gap_max == pytest.approx(float(p1[1] - p1[0]), abs=1e-6)
    assert got.prob_gap_mean == pytest.approx(got.prob_gap_max / 2, abs=1e-6)
    assert (got.value_gap_max, got.value_gap_mean) == (pytest.approx(0.5), pytest.approx(0.25))
    assert "50.00%" in got.problem()
    assert got.differs_from(got.to_dict()) is None
    assert "prob_gap_mean" in got.differs_from({**got.to_dict(), "prob_gap_mean": 0.9})
    assert "states" in got.differs_from({**got.to_dict(), "states": 3})


def test_int8_rows_keep_their_scale_and_round_trip_within_half_a_step():
    from core.rl.agent import Agent
    from core.state.features import StateEncoderConfig

    agent = Agent(12, StateEncoderConfig(dim=16), hidden=16, n_critics=2)
    stored = served_copy.stored_tensors(agent, "int8")
    back = served_copy.float_weights(stored, "int8")
    for k, v in agent.state_dict().items():
        if v.dim() == 2:
            assert stored[k].dtype == torch.int8
            step = stored[k + served_copy.SCALE_SUFFIX][:, None]
            assert bool(((back[k] - v).abs() <= step / 2 + 1e-7).all()), k
        else:
            assert torch.equal(back[k], v)
    with pytest.raises(ValueError):
        served_copy.float_weights({k: v for k, v in stored.items() if not k.endswith(served_copy.SCALE_SUFFIX)},
                                  "int8")
    with pytest.raises(ValueError):
        served_copy.float_weights(served_copy.stored_tensors(agent, "float16"), "bfloat16")


def test_the_policies_page_exports_the_chosen_copy_and_shows_its_agreement(run, tmp_path, monkeypatch):
    import shutil

    from streamlit.testing.v1 import AppTest

    root = tmp_path / "ws"
    shutil.copytree(run.root, root)
    monkeypatch.setenv("RWB_WORKSPACE", str(root))
    monkeypatch.setenv("RWB_POLICIES_DIR", str(tmp_path / "policies"))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "pages" / "policies.py"), default_timeout=300)
    at.session_state["actor"] = run.actor("ana")
    at.session_state["policies_tab"] = "Runs & bundles"
    at.run()
    assert at.selectbox(key="policies_export_precision").value == "full"          # the trained policy by default
    at.selectbox(key="policies_export_run").set_value(run.run_id)
    at.text_input(key="policies_export_name").input("paged")
    at.selectbox(key="policies_export_precision").set_value("bfloat16")
    next(b for b in at.button if b.label == "Export bundle").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    shown = [c.value for c in at.caption if c.value.startswith("Serving runs")]
    assert len(shown) == 1 and "a bfloat16 copy" in shown[0] and "held-out states" in shown[0]
    exported = sorted((root / "artifacts" / "bundles").glob("paged-*.zip"))
    assert len(exported) == 1 and load_bundle(exported[0]).serve_precision == "bfloat16"
