"""Policy bundles (core.govern.bundle) and the RDE tree (core.rl.rde): export from a real tiny run,
verify, load, and refuse every kind of tampering.

Tampering kinds (issue 6): a flipped byte in any file, an added file, a path escaping the
bundle (``..``, absolute, backslash, symbolic link, sub-folder), a pickle payload —
``verify_bundle`` says why and ``load_bundle`` refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import PASSWORDS, members, module_hash_embedder, reseal, write_zip  # noqa: F401
from core.govern.bundle import (
    BUNDLE_FILES,
    MANIFEST,
    SIGNATURE,
    BundleError,
    LoadedBundle,
    load_bundle,
    pickle_signature,
    safetensors_problem,
    verify_bundle,
)


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def loaded(run) -> LoadedBundle:
    return load_bundle(run.bundle)


def assert_refused(path: Path, *words: str) -> str:
    """Assert verify and load both refuse ``path``; returns the reason."""
    report = verify_bundle(path)
    assert not report.ok, "the tampered bundle was accepted"
    for w in words:
        assert w in report.reason, f"{w!r} not in {report.reason!r}"
    with pytest.raises(BundleError) as exc:
        load_bundle(path)
    assert report.reason in str(exc.value)
    return report.reason


# --------------------------------------------------------------------------- the exported bundle
def test_export_writes_a_bundle_a_person_can_open(run):
    from core.rl.runs import get_run, run_template, template_hash

    files = members(run.bundle)
    assert list(files) == [MANIFEST, *BUNDLE_FILES, SIGNATURE]
    manifest = json.loads(files[MANIFEST])
    ws = run.workspace()
    record = get_run(ws, run.run_id)
    assert manifest["name"] == "finance_risk" and manifest["version"] == "0.1.0"
    assert manifest["created_by"] == "ana" and manifest["trained_by"] == record.created_by == "ana"
    assert manifest["run_id"] == run.run_id and manifest["approvals"] == []
    assert manifest["template"]["sha256"] == template_hash(run_template(ws, run.run_id))
    assert manifest["template"]["name"] == "finance_risk"
    # the sha256 and size of every other file, and nothing else
    assert set(manifest["files"]) == set(BUNDLE_FILES)
    for name in BUNDLE_FILES:
        assert manifest["files"][name] == {"sha256": hashlib.sha256(files[name]).hexdigest(),
                                           "bytes": len(files[name])}
    # human-readable metadata, weights as safetensors, never a pickle
    assert json.loads(files["catalog.json"])["version"] == manifest["catalog_version"]
    assert "rules:" in files["masks.yaml"].decode() and "levels:" in files["template.yaml"].decode()
    assert manifest["encoder"] == json.loads(files["encoder.json"])
    assert all(pickle_signature(n, d) is None for n, d in files.items())
    assert all(safetensors_problem(n, files[n]) is None for n in BUNDLE_FILES if n.endswith(".safetensors"))
    # the evaluation report on held-out episodes, with the logged behaviours as baselines
    ev = manifest["evaluation"]
    assert ev["split"] == "heldout" and ev["episodes"] > 0 and len(ev["heldout_fingerprint"]) == 64
    assert ev["policy"]["mask_violations"] == 0 and ev["policy"]["episodes"] == ev["episodes"] * ev["repeats"]
    assert ev["expert_return"] == ev["logged"]["expert"]
    assert {"expert", "noisy", "hacker"} <= set(ev["logged"])
    assert ev["random_in_mask"]["return_mean"] < ev["expert_return"]
    # the RDE tree is summarised and scored on held-out expert steps
    assert manifest["rde"]["trained_on"]["behaviour"] == "expert"
    assert 0.0 <= ev["rde_heldout_expert"]["accuracy"] <= 1.0
    assert ev["rde_heldout_expert"] == manifest["rde"]["heldout_expert"]  # the manifest's keys are sorted
    assert set(ev["rde_heldout_expert"]) == {"decisions", "accuracy", "mean_confidence"}


def test_logs_without_an_expert_fit_the_baseline_on_their_best_behaviour(tmp_path):
    """An imperfect agent's logs (no expert label): the RDE tree imitates the behaviour whose
    training episodes earned the most, and the bundle verifies."""
    from _bundle_fixtures import tiny_config
    from core.data import datasets
    from core.govern.bundle import export_bundle
    from core.data.importers import import_file
    from core.rl.runs import train
    from core.records.store import Workspace
    from core.access.users import LOCAL_ADMIN

    data = datasets.generate_file("finance", 90, 5, tmp_path / "agent.jsonl", behaviours="noisy,hacker")
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, data.out, dataset="agent")
    run_id = train(ws, LOCAL_ADMIN, template="finance_risk", dataset="agent", config=tiny_config()).run_id
    from core.rl.runs import open_run
    from core.rl.sim import logged_returns

    d = open_run(ws, run_id, need_policy=False).data
    earned = logged_returns(d.tables, d.train_episodes)
    assert set(earned) == {"noisy", "hacker"}
    best = max(earned, key=lambda b: earned[b])
    path = export_bundle(ws, LOCAL_ADMIN, run_id, tmp_path / "agent.zip")
    ws.close()
    manifest = json.loads(members(path)[MANIFEST])
    n_best = sum(d.tables.behaviours[i] == best for i in d.train_episodes.tolist())
    fit = manifest["rde"]["trained_on"]
    assert (fit["behaviour"], fit["episodes"], fit["split"]) == (best, n_best, "train")
    assert manifest["evaluation"]["expert_return"] is None
    assert manifest["evaluation"]["rde_heldout_expert"]["decisions"] > 0
    assert verify_bundle(path).ok


def test_verify_accepts_the_exported_bundle(run):
    report = verify_bundle(run.bundle)
    assert report.ok, report.reason
    assert [c.check for c in report.checks] == ["paths", "archive", "pickle", "manifest", "signature", "files",
                                                   "hashes", "formats", "contents", "smoke"]
    assert all(c.ok for c in report.checks)


def test_loaded_bundle_serves_only_unmasked_actions(loaded, run):
    import torch

    assert loaded.policy_version == "finance_risk@0.1.0"
    assert not loaded.policy.training and not any(p.requires_grad for p in loaded.policy.parameters())
    assert loaded.n_actions == len(loaded.catalog.tokens) == loaded.manifest.n_actions
    obs, mask = loaded.smoke_obs(), loaded.smoke_mask()
    assert mask.shape == (len(loaded.smoke["states"]), loaded.n_actions) and not mask.all()
    top, probs = loaded.top_k(obs, mask, k=3)
    assert ((top < 0) | mask[np.arange(len(top))[:, None], np.maximum(top, 0)]).all()
    assert (np.diff(probs, axis=1) <= 1e-7).all()
    greedy = loaded.act(obs, mask)
    masked_logits = loaded.logits(obs).masked_fill(~torch.as_tensor(mask), float("-inf"))
    assert (greedy == masked_logits.argmax(1).numpy()).all()
    assert torch.isfinite(loaded.values(obs)).all()
    # the RDE baseline answers the same states with a confidence, inside the mask
    X = loaded.rde.featurize(loaded.smoke["states"], loaded.smoke["task_types"], loaded.smoke["step_t"],
                             np.full(len(greedy), -2))
    tokens, conf = loaded.rde.predict(X, mask)
    assert ((tokens < 0) | mask[np.arange(len(tokens)), np.maximum(tokens, 0)]).all()
    assert ((conf >= 0) & (conf <= 1)).all()


# --------------------------------------------------------------------------- tampering: changed bytes
POSITIONS = ("first", "middle", "last")


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name", [MANIFEST, *BUNDLE_FILES, SIGNATURE])
def test_flipping_a_byte_of_any_file_is_refused(run, tmp_path, name, position):
    files = members(run.bundle)
    data = bytearray(files[name])
    i = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[position]
    data[i] ^= 0xFF
    files[name] = bytes(data)
    reason = assert_refused(write_zip(tmp_path / "flipped.zip", files))
    assert name in reason or (name == MANIFEST and "manifest" in reason)


def test_a_flipped_byte_in_the_compressed_archive_is_refused(run, tmp_path):
    raw = bytearray(run.bundle.read_bytes())
    with zipfile.ZipFile(run.bundle) as zf:
        info = zf.getinfo("policy.safetensors")
    # inside the member's compressed data (after its local header)
    raw[info.header_offset + 30 + len(info.filename) + 64] ^= 0x01
    path = tmp_path / "corrupt.zip"
    path.write_bytes(bytes(raw))
    assert_refused(path, "policy.safetensors")


def test_an_edited_manifest_is_refused_even_when_it_stays_valid_json(run, tmp_path):
    files = members(run.bundle)
    manifest = json.loads(files[MANIFEST])
    manifest["evaluation"]["policy"]["return_mean"] = 99.0  # brag, keeping the old digest
    files[MANIFEST] = (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode()
    assert_refused(write_zip(tmp_path / "brag.zip", files), "manifest.json was changed")


# --------------------------------------------------------------------------- tampering: files and paths
def test_an_added_file_is_refused(run, tmp_path):
    files = {**members(run.bundle), "notes.txt": b"harmless?"}
    assert_refused(write_zip(tmp_path / "extra.zip", files), "extra file 'notes.txt'")


def test_a_missing_file_is_refused(run, tmp_path):
    files = members(run.bundle)
    del files["rde.json"]
    assert_refused(write_zip(tmp_path / "missing.zip", files), "missing file 'rde.json'")


@pytest.mark.parametrize("entry, words", [
    ("../escape.json", ("escapes the bundle", "..")),
    ("deep/../../escape.json", ("escapes the bundle",)),
    ("/etc/escape.json", ("absolute path",)),
    ("C:/escape.json", ("absolute path",)),
    ("..\\escape.json", ("escapes the bundle",)),
    ("sub/escape.json", ("inside a folder",)),
])
def test_paths_escaping_the_bundle_are_refused(run, tmp_path, entry, words):
    files = {**members(run.bundle), entry: b"{}"}
    assert_refused(write_zip(tmp_path / "slip.zip", files), *words)


def test_a_symbolic_link_is_refused(run, tmp_path):
    files = members(run.bundle)
    files["template.yaml"] = b"/etc/passwd"  # a link's target is stored as its content
    assert_refused(write_zip(tmp_path / "link.zip", files, symlinks=("template.yaml",)), "symbolic link")


def test_a_promoted_folder_with_a_link_or_subfolder_is_refused(run, tmp_path):
    folder = tmp_path / "bundle"
    folder.mkdir()
    for name, data in members(run.bundle).items():
        (folder / name).write_bytes(data)
    assert verify_bundle(folder).ok
    (folder / "sub").mkdir()
    assert_refused(folder, "'sub' is not a plain file")
    (folder / "sub").rmdir()
    os.replace(folder / "rde.json", tmp_path / "rde.json")
    os.symlink(tmp_path / "rde.json", folder / "rde.json")
    assert_refused(folder, "symbolic link")


# --------------------------------------------------------------------------- tampering: pickle payloads
class _Payload:
    """Unpickling this runs a shell command that leaves a sentinel file behind."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_pickle_file_added_to_the_bundle_is_refused(run, tmp_path):
    sentinel = tmp_path / "pwned"
    files = {**members(run.bundle), "policy.pkl": pickle.dumps(_Payload(sentinel), protocol=4)}
    assert_refused(write_zip(tmp_path / "pkl.zip", files), "pickle")
    assert not sentinel.exists()


@pytest.mark.parametrize("target", ["catalog.json", "rde.safetensors", "smoke.json"])
def test_a_pickle_in_place_of_a_file_is_refused_even_with_matching_hashes(run, tmp_path, target):
    sentinel = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(sentinel), protocol=2)
    path = reseal(run.bundle, tmp_path / "resealed.zip", files={target: payload})
    report = verify_bundle(path)
    assert [c.check for c in report.checks if not c.ok] == ["pickle"]
    assert_refused(path, f"{target!r} is a pickle")
    assert not sentinel.exists()


def test_torch_save_weights_are_refused_even_with_matching_hashes(run, tmp_path, loaded):
    import io

    import torch

    buf = io.BytesIO()
    torch.save(loaded.policy.state_dict(), buf)  # a zip of pickles
    path = reseal(run.bundle, tmp_path / "torchsave.zip", files={"policy.safetensors": buf.getvalue()})
    assert_refused(path, "zip inside the bundle")


# --------------------------------------------------------------------------- contents and smoke run
def test_weights_that_do_not_fit_the_module_are_refused(run, tmp_path):
    import torch
    from safetensors.torch import load, save

    weights = load(members(run.bundle)["policy.safetensors"])
    weights["actor.4.weight"] = torch.zeros(3, 3)
    path = reseal(run.bundle, tmp_path / "shape.zip", files={"policy.safetensors": save(weights)})
    assert_refused(path, "policy.safetensors", "actor.4.weight")


def test_a_policy_with_non_finite_logits_fails_the_smoke_run(run, tmp_path):
    import torch
    from safetensors.torch import load, save

    weights = load(members(run.bundle)["policy.safetensors"])
    # finite weights (float32's largest) whose sums overflow: the logits are ±inf or NaN
    weights["actor.4.weight"] = torch.sign(weights["actor.4.weight"]) * 3e38
    path = reseal(run.bundle, tmp_path / "overflow.zip", files={"policy.safetensors": save(weights)})
    report = verify_bundle(path)
    assert [c.check for c in report.checks if not c.ok] == ["smoke"]
    assert_refused(path, "non-finite logits")


def test_masks_that_do_not_fit_the_catalog_are_refused(run, tmp_path):
    rules = b"version: 1\nrules:\n  - name: ghost\n    kind: risk\n    targets: {tools: [no_such_tool]}\n"
    path = reseal(run.bundle, tmp_path / "masks.zip", files={"masks.yaml": rules})
    assert_refused(path, "masks.yaml")


def test_safetensors_header_checker():
    from safetensors.numpy import save

    good = save({"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.int64)})
    assert safetensors_problem("x", good) is None
    assert "too short" in safetensors_problem("x", good[:4])
    assert "does not fit" in safetensors_problem("x", (10**9).to_bytes(8, "little") + good[8:])
    assert "data region" in safetensors_problem("x", good + b"\0")
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    header["a"]["dtype"] = "PICKLE"
    text = json.dumps(header).encode()
    assert "unknown dtype" in safetensors_problem("x", len(text).to_bytes(8, "little") + text + good[8 + n:])
    header["a"]["dtype"], header["a"]["shape"] = "F32", [3, 3]
    text = json.dumps(header).encode()
    assert "do not match" in safetensors_problem("x", len(text).to_bytes(8, "little") + text + good[8 + n:])


def test_pickle_signatures():
    assert "pickle-style" in pickle_signature("weights.pt", b"")
    for protocol in (2, 3, 4, 5):
        assert "pickle" in pickle_signature("x.json", pickle.dumps({"a": 1}, protocol=protocol))
    for protocol in (0, 1):
        assert "protocol 0/1" in pickle_signature("x.json", pickle.dumps({"a": [1, "b"]}, protocol=protocol))
    assert "protocol 0/1" in pickle_signature("x.yaml", b"cos\nsystem\n(S'touch /tmp/x'\ntR.\n")
    assert "zip inside" in pickle_signature("x.safetensors", b"PK\x03\x04rest")
    assert "npy" in pickle_signature("x.safetensors", b"\x93NUMPY\x01\x00")
    assert pickle_signature("catalog.json", b'{"a": 1}') is None
    assert pickle_signature("masks.yaml", b"version: 1\nrules: []\n") is None
    assert pickle_signature("notes.yaml", b"(a sentence that ends with a full stop.") is None


# --------------------------------------------------------------------------- export with review rules, via the CLI
def test_cli_export_includes_review_rules_and_verify_reports(run, loaded, tmp_path, monkeypatch, capsys):
    from core.cli import main
    from core.guard.review import ReviewRequest, claim, decide, enqueue

    # a copy of the workspace, so the rejected review stays out of the other tests
    ws_copy = tmp_path / "ws"
    shutil.copytree(run.root, ws_copy)
    from core.records.store import Workspace

    ws = Workspace.open(ws_copy)
    rae = run.actor("rae")
    token = next(t for t in loaded.catalog.tokens if t.risk == "high")
    item = enqueue(ws, run.actor("ada"), ReviewRequest(
        origin="serving", reason="high risk", state={"volatility": 0.5, "hour": 10}, task_type="rebalance",
        token_id=token.id, token_name=token.name, action_label=token.label, tool=token.tool, risk="high",
        reward_components={}, dataset="finance"))
    claim(ws, rae, item)
    decide(ws, rae, item, "reject", "never in a spike")
    ws.close()

    out = tmp_path / "with-review.zip"
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ana"])
    code = main(["--workspace", str(ws_copy), "bundle", "export", run.run_id, "--out", str(out),
                 "--version", "0.1.1", "--as", "ana", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and printed["verified"] and printed["version"] == "0.1.1"
    masks = members(out)["masks.yaml"].decode()
    assert f"review_{item}" in masks and "never in a spike" in masks

    assert main(["--workspace", str(ws_copy), "bundle", "verify", str(out), "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["ok"] is True and verified["signer"] == printed["signer"]
    files = members(out)
    files["masks.yaml"] = files["masks.yaml"] + b"\n"
    bad = write_zip(tmp_path / "bad.zip", files)
    assert main(["--workspace", str(ws_copy), "bundle", "verify", str(bad)]) == 2
    assert "masks.yaml has" in capsys.readouterr().err


def test_export_refuses_wrong_role_and_unfinished_runs(run, tmp_path):
    from core.govern.bundle import export_bundle
    from core.base.errors import InputError, PermissionDenied

    ws = run.workspace()
    with pytest.raises(PermissionDenied):
        export_bundle(ws, run.actor("bob"), run.run_id, tmp_path / "x.zip")  # approvers do not export
    with pytest.raises(InputError, match="no run"):
        export_bundle(ws, run.actor("ana"), "run-missing", tmp_path / "x.zip")
    assert not (tmp_path / "x.zip").exists()


# --------------------------------------------------------------------------- the RDE tree
def test_rde_predictor_matches_scikit_learn_and_a_slow_walk(run):
    from sklearn.tree import DecisionTreeClassifier

    from core.rl.rde import RdeModel, decisions_of, fit_rde

    bundle = load_bundle(run.bundle)
    ws = run.workspace()
    episodes = [e for e in ws.load_episodes("finance") if e.behaviour == "expert"]
    model = fit_rde(episodes, bundle.catalog)
    states, types, t, prev, tokens = decisions_of(episodes, bundle.catalog)
    X = model.featurize(states, types, t, prev)
    keep = tokens >= 0
    tree = DecisionTreeClassifier(max_depth=model.config.max_depth, min_samples_leaf=model.config.min_samples_leaf,
                                  random_state=model.config.seed).fit(X[keep], tokens[keep])
    rng = np.random.default_rng(0)
    probe = np.concatenate([X, X[rng.integers(0, len(X), 200)] + rng.normal(0, 0.5, (200, X.shape[1]))])
    np.testing.assert_allclose(model.predict_proba(probe), tree.predict_proba(probe), atol=1e-12)

    def slow_leaf(x):
        node = 0
        while model.children_left[node] >= 0:
            go_left = x[model.feature[node]] <= model.threshold[node]
            node = model.children_left[node] if go_left else model.children_right[node]
        return node

    assert (model.leaves(probe) == np.array([slow_leaf(x) for x in probe])).all()
    # round trip through the bundle's plain arrays
    again = RdeModel.from_parts(json.loads(json.dumps(model.meta())), model.arrays())
    np.testing.assert_array_equal(again.predict_proba(probe), model.predict_proba(probe))
    tokens_pred, conf = model.predict(X)
    assert ((conf > 0) & (conf <= 1)).all()
    assert (tokens_pred[keep] == tokens[keep]).mean() > 0.5  # it learnt the expert's habits


def test_rde_refuses_malformed_arrays(loaded):
    from core.base.errors import InputError
    from core.rl.rde import RdeModel

    arrays = loaded.rde.arrays()
    arrays["children_left"] = arrays["children_left"].copy()
    arrays["children_left"][0] = 0  # the root as its own child: a cycle
    with pytest.raises(InputError, match="malformed"):
        RdeModel.from_parts(loaded.rde.meta(), arrays)
