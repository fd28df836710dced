"""Signed bundles, the registry's own records and serving's digest check (issue 17, part 1).

Attacks with the code's own functions: a bundle changed in any byte and re-sealed with
``seal_manifest`` (new hashes, new digest, old signature); a bundle signed by a key the
workspace does not trust; a manifest that brags (gate figures 9.99) or names another
exporter, signed with the workspace's own key (an insider); a promoted copy swapped in
the policies folder, index edited to match.  Plus the key file's mode, rotation and
untrusting.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import (  # noqa: F401
    PASSWORDS,
    members,
    module_hash_embedder,
    registry_figures,
    reseal,
    workspace_key,
    write_zip,
)
from core.access import keys
from core.govern import registry
from core.access.audit import security_events
from core.govern.bundle import BUNDLE_FILES, MANIFEST, SIGNATURE, BundleError, load_bundle, seal_manifest, verify_bundle
from core.govern.policy_folder import PolicyIndexRefused
from core.base.errors import ConflictError, PermissionDenied
from core.serve.serving import DecisionEngine
from core.records.store import Workspace
from _state_fixtures import HashEmbedder


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture()
def ws(run, tmp_path):
    """A copy of the shared workspace (same run, users and signing key), so key and trust
    changes stay in this test."""
    root = tmp_path / "ws"
    shutil.copytree(run.root, root)
    w = Workspace.open(root)
    yield w
    w.close()


@pytest.fixture()
def policies(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "policies"
    monkeypatch.setenv("RWB_POLICIES_DIR", str(root))
    return root


def _resealed_with_old_signature(src: Path, dst: Path, change: str) -> Path:
    """``src`` with one byte of ``change`` flipped (or, for the manifest, its claims edited),
    the manifest re-sealed over the new hashes (:func:`seal_manifest`), and the original
    ``signature.json`` kept."""
    import hashlib

    files = members(src)
    body = json.loads(files[MANIFEST])
    body.pop("digest")
    if change == MANIFEST:
        body["evaluation"]["policy"]["return_mean"] = 9.99
    else:
        data = bytearray(files[change])
        data[len(data) // 2] ^= 0x01
        files[change] = bytes(data)
        body["files"][change] = {"sha256": hashlib.sha256(files[change]).hexdigest(), "bytes": len(files[change])}
    sealed = seal_manifest(body)
    assert sealed.digest != json.loads(members(src)[MANIFEST])["digest"]
    files[MANIFEST] = sealed.to_bytes()
    return write_zip(dst, files)                      # signature.json: the old one, untouched


# --------------------------------------------------------------------------- re-sealed bundles
@pytest.mark.parametrize("change", [MANIFEST, *BUNDLE_FILES])
def test_a_resealed_bundle_is_refused_by_verify_register_and_serving(run, ws, tmp_path, change):
    path = _resealed_with_old_signature(run.bundle, tmp_path / "resealed.zip", change)
    trust = keys.trust_store(ws)
    # the hashes and the digest agree with the files: only the signature gives it away
    report = verify_bundle(path, trust=trust)
    assert not report.ok and report.signer is None
    assert "signature" in [c.check for c in report.checks if not c.ok]
    assert "changed after signing" in report.reason
    with pytest.raises(BundleError, match="changed after signing"):
        registry.register(ws, run.actor("ana"), path)
    assert registry.list_versions(ws, "finance_risk") == []
    assert security_events(ws, "bundle_refused")[-1].detail["file"] == str(path)
    with pytest.raises(BundleError, match="changed after signing"):
        DecisionEngine.from_bundle(ws, path, embedder=HashEmbedder())


def test_an_unsigned_bundle_is_refused_and_allow_unsigned_is_for_inspection_only(run, ws, tmp_path, monkeypatch,
                                                                                   capsys):
    from core.cli import main

    path = reseal(run.bundle, tmp_path / "unsigned.zip", signer=None)
    assert SIGNATURE not in members(path)
    assert "not signed" in verify_bundle(path).reason
    w = ["--workspace", str(ws.root)]
    assert main([*w, "bundle", "verify", str(path)]) == 2
    assert "not signed" in capsys.readouterr().err
    assert main([*w, "bundle", "verify", str(path), "--allow-unsigned"]) == 0
    out = capsys.readouterr()
    assert "warning: the bundle is not signed" in out.err and "NOT signed by a trusted key" in out.out
    # registering has no such option: the bundle is refused
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ana"])
    assert main([*w, "registry", "register", str(path), "--as", "ana"]) == 2
    assert "not signed" in capsys.readouterr().err


def test_an_untrusted_signer_is_refused_until_trusted(run, ws, tmp_path, monkeypatch, capsys):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from core.cli import main

    stranger = Ed25519PrivateKey.generate()
    path = reseal(run.bundle, tmp_path / "stranger.zip", name="stranger", signer=stranger)
    fp = keys.fingerprint(stranger.public_key())
    assert verify_bundle(path).ok and verify_bundle(path).signer == fp      # a valid signature ...
    report = verify_bundle(path, trust=keys.trust_store(ws))
    assert not report.ok and f"signed by key {fp}, which this workspace does not trust" in report.reason
    with pytest.raises(BundleError, match="does not trust"):
        registry.register(ws, run.actor("ana"), path)
    with pytest.raises(BundleError, match="does not trust"):
        DecisionEngine.from_bundle(ws, path, embedder=HashEmbedder())

    pem = tmp_path / "stranger.pem"
    pem.write_bytes(stranger.public_key().public_bytes(
        keys.serialization.Encoding.PEM, keys.serialization.PublicFormat.SubjectPublicKeyInfo))
    w = ["--workspace", str(ws.root)]
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ana"])
    assert main([*w, "keys", "trust", str(pem), "--as", "ana"]) == 3          # an analyst may not
    capsys.readouterr()
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ada"])
    assert main([*w, "keys", "trust", str(pem), "--as", "ada", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"trusted": fp}
    assert verify_bundle(path, trust=keys.trust_store(ws)).ok
    assert main([*w, "bundle", "verify", str(path)]) == 0
    assert f"signed by key {fp}" in capsys.readouterr().out
    # the registry records the signer it verified (and computes its own evaluation)
    v = registry.register(ws, run.actor("ana"), path)
    assert v.signer == fp and registry.history(ws, "stranger")[0].detail["signer"] == fp
    assert main([*w, "keys", "untrust", fp, "--as", "ada"]) == 0
    capsys.readouterr()
    assert not verify_bundle(path, trust=keys.trust_store(ws)).ok
    assert [e.event for e in security_events(ws) if e.event.startswith("key_")] == ["key_trusted",
                                                                                    "key_untrusted"]


# --------------------------------------------------------------------------- the registry's own records
def test_a_forged_manifest_cannot_pass_the_gate_or_four_eyes(run, ws, tmp_path):
    """An insider with the workspace's key signs a manifest that brags (9.99 everywhere the gate
    once looked) and names cy as the exporter: the registry evaluates the run itself and
    four-eyes reads who registered the bundle and who trained the run."""
    from core.access.users import set_role

    forged = reseal(run.bundle, tmp_path / "forged.zip", name="forged", policy_return=9.99, created_by="cy")
    manifest = load_bundle(forged).manifest
    assert manifest.evaluation["policy"]["return_mean"] == 9.99 and manifest.created_by == "cy"
    assert verify_bundle(forged, trust=keys.trust_store(ws)).ok       # signed by a trusted key
    ada = run.actor("ada")
    v = registry.register(ws, ada, forged)
    record = registry.history(ws, "forged")[0].detail
    assert record["registered_by"] == "ada" and record["trained_by"] == "ana"
    assert record["manifest_digest"] == manifest.digest and record["signer"] == keys.show(ws).fingerprint
    real = record["evaluation"]
    assert real["policy"]["return_mean"] != 9.99 and v.return_mean == real["policy"]["return_mean"]
    # the registry's figures are the export's own evaluation of the run, reproduced
    exported = load_bundle(run.bundle).manifest.evaluation
    assert real["policy"]["return_mean"] == exported["policy"]["return_mean"]
    assert real["heldout_fingerprint"] == exported["heldout_fingerprint"]

    gate = registry.promotion_gate(ws, "forged", "0.1.0")
    best = real["best_logged"]["behaviour"]
    assert gate.candidate_return == real["paired"][best]["policy"] != 9.99
    assert gate.passed == (gate.candidate_return > gate.baseline_return)
    # four-eyes: ada registered it (whatever the manifest says), ana trained the run
    with pytest.raises(PermissionDenied, match="four-eyes rule: ada"):
        registry.approve(ws, ada, "forged", "0.1.0", "cy exported it, I may approve")
    set_role(ws, ada, "ana", "approver")
    from core.access.users import Actor

    with pytest.raises(PermissionDenied, match="four-eyes rule: ana"):
        registry.approve(ws, Actor("ana", "approver"), "forged", "0.1.0", "cy exported it")
    if not gate.passed:  # the tiny run does not beat the expert: the brag does not help
        with pytest.raises(registry.GateFailed, match="does not beat"):
            registry.approve(ws, run.actor("bob"), "forged", "0.1.0", "9.99 is great")


def test_the_registry_refuses_weights_that_are_not_the_runs(run, ws, tmp_path):
    from safetensors.torch import load, save

    weights = load(members(run.bundle)["policy.safetensors"])
    weights["actor.4.bias"] = weights["actor.4.bias"] + 0.5                # nudged, signed by the insider
    path = reseal(run.bundle, tmp_path / "nudged.zip", name="nudged",
                  files={"policy.safetensors": save(weights)}, signer=workspace_key(ws.root))
    assert verify_bundle(path, trust=keys.trust_store(ws)).ok
    with pytest.raises(BundleError, match="not the checkpoint of run"):
        registry.register(ws, run.actor("ana"), path)
    assert registry.list_versions(ws, "nudged") == []


# --------------------------------------------------------------------------- serving a swapped copy
def _promote(run, ws, tmp_path, policies, name: str) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        expert = load_bundle(run.bundle).manifest.evaluation["expert_return"]
        registry_figures(mp, {(name, "0.1.0"): expert + 1.0})
        registry.register(ws, run.actor("ana"), reseal(run.bundle, tmp_path / f"{name}.zip", name=name))
    registry.approve(ws, run.actor("bob"), name, "0.1.0", "beats the expert")
    registry.promote(ws, run.actor("bob"), name, "0.1.0")
    return policies / name / "0.1.0"


def _swap(folder: Path, policies: Path, signer) -> str:
    """Change the promoted copy's weights, re-seal its manifest, sign it with ``signer``
    (None: keep the old signature) and edit index.json to the new digest."""
    import hashlib

    from core.access.keys import sign_digest

    data = bytearray((folder / "policy.safetensors").read_bytes())
    data[-1] ^= 0x01
    (folder / "policy.safetensors").write_bytes(bytes(data))
    body = json.loads((folder / MANIFEST).read_text())
    body.pop("digest")
    body["files"]["policy.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    sealed = seal_manifest(body)
    (folder / MANIFEST).write_bytes(sealed.to_bytes())
    if signer is not None:
        (folder / SIGNATURE).write_text(json.dumps(sign_digest(signer, sealed.digest).to_dict()))
    index = json.loads((policies / "index.json").read_text())
    index["policies"][folder.parent.name]["versions"]["0.1.0"]["manifest_digest"] = sealed.digest
    (policies / "index.json").write_text(json.dumps(index))
    return sealed.digest


@pytest.mark.parametrize("who", ["old signature", "stranger's key", "the workspace's own key"])
def test_a_swapped_promoted_copy_is_refused_by_serving_with_an_audit_event(run, ws, tmp_path, policies, who):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from core.policies import load_bundle_for

    folder = _promote(run, ws, tmp_path, policies, "swap")
    engine = DecisionEngine.from_policy(ws, "swap", embedder=HashEmbedder())
    assert engine.policy_version == "swap@0.1.0"
    engine.close()
    signer = {"old signature": None, "stranger's key": Ed25519PrivateKey.generate(),
              "the workspace's own key": keys.signing_key(ws)}[who]
    digest = _swap(folder, policies, signer)
    expected = {"old signature": "changed after signing", "stranger's key": "does not trust",
                "the workspace's own key": "not the copy the registry promoted"}[who]
    with pytest.raises(BundleError, match=expected):
        DecisionEngine.from_policy(ws, "swap", embedder=HashEmbedder())
    event = security_events(ws, "promoted_copy_refused")[-1]
    assert event.detail["policy"] == "swap@0.1.0" and expected in event.detail["reason"]
    assert registry.promoted_digest(ws, "swap", "0.1.0") != digest
    # the folder alone no longer passes either: the index entry edited to match is no
    # longer the one the registry signed
    with pytest.raises(PolicyIndexRefused, match="changed after"):
        load_bundle_for("swap", trust=keys.trust_store(ws))


# --------------------------------------------------------------------------- keys
def test_the_signing_key_is_private_and_never_in_a_bundle_or_the_database(run, ws):
    from cryptography.hazmat.primitives import serialization

    path = keys.keys_dir(ws) / keys.PRIVATE_KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.keys_dir(ws).stat().st_mode) == 0o700
    private = keys.signing_key(ws).private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                 serialization.NoEncryption())
    pem = path.read_bytes()
    from core.records.store import DB_NAME

    ws.conn.execute("PRAGMA wal_checkpoint(FULL)")
    for blob in [*members(run.bundle).values(), run.bundle.read_bytes(), (Path(ws.root) / DB_NAME).read_bytes()]:
        assert private not in blob and pem not in blob
    sig = json.loads(members(run.bundle)[SIGNATURE])
    assert set(sig) == {"algorithm", "fingerprint", "public_key", "manifest_digest", "signature"}
    assert sig["fingerprint"] == keys.show(ws).fingerprint and len(sig["fingerprint"]) == 16
    # a key file others can read is refused (rotate it)
    path.chmod(0o644)
    with pytest.raises(ConflictError, match="readable by others"):
        keys.signing_key(ws)
    path.chmod(0o600)


def test_a_new_workspace_makes_its_key_on_first_need(tmp_path):
    fresh = Workspace.open(tmp_path / "fresh")
    assert keys.trust_store(fresh) == {}                                  # reading makes nothing
    info = keys.show(fresh)
    assert stat.S_IMODE((keys.keys_dir(fresh) / keys.PRIVATE_KEY).stat().st_mode) == 0o600
    assert info.trusted == [{"fingerprint": info.fingerprint, "own": True}]
    assert keys.show(fresh).fingerprint == info.fingerprint              # the same key next time
    fresh.close()


def test_rotate_keeps_old_bundles_verifying_until_untrusted(run, ws, tmp_path, monkeypatch, capsys):
    from core.cli import main

    old_fp = keys.show(ws).fingerprint
    old = reseal(run.bundle, tmp_path / "old.zip", signer=keys.signing_key(ws))
    w = ["--workspace", str(ws.root)]
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["bob"])
    assert main([*w, "keys", "rotate", "--as", "bob"]) == 3                # approvers may not
    capsys.readouterr()
    monkeypatch.setenv("RWB_PASSWORD", PASSWORDS["ada"])
    assert main([*w, "keys", "rotate", "--as", "ada", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    new_fp = info["fingerprint"]
    assert new_fp != old_fp and {t["fingerprint"] for t in info["trusted"]} >= {old_fp, new_fp}
    assert stat.S_IMODE((keys.keys_dir(ws) / keys.PRIVATE_KEY).stat().st_mode) == 0o600
    new = reseal(run.bundle, tmp_path / "new.zip", signer=keys.signing_key(ws))
    assert verify_bundle(new, trust=keys.trust_store(ws)).signer == new_fp
    assert verify_bundle(old, trust=keys.trust_store(ws)).ok               # still trusted
    with pytest.raises(ConflictError, match="rotate"):
        keys.untrust(ws, run.actor("ada"), new_fp)                         # the current key
    assert main([*w, "keys", "untrust", old_fp, "--as", "ada"]) == 0
    capsys.readouterr()
    assert "does not trust" in verify_bundle(old, trust=keys.trust_store(ws)).reason
    assert verify_bundle(new, trust=keys.trust_store(ws)).ok
    assert main([*w, "keys", "untrust", "not-a-fingerprint", "--as", "ada"]) == 2
    assert main([*w, "keys", "show"]) == 0
    assert new_fp in capsys.readouterr().out
    rotated = security_events(ws, "key_rotated")[-1]
    assert rotated.detail == {"old": old_fp, "new": new_fp} and rotated.actor == "ada"
