"""One real tiny training run shared by the bundle, registry and Policies-page tests.

A workspace with users (admin ``ada``, analyst ``ana`` who trains and exports, approvers
``bob`` and ``cy``, reviewer ``rae``), the finance sample imported, a short PPO run by
``ana`` and its exported bundle.  It is built once per test process (a few seconds of
training) and then only read; tests that change the registry use their own policy names
(:func:`reseal` re-labels a bundle) and their own policies folder.

The sentence model is replaced by the deterministic hash embedder while these tests run
(the text model is not what they test; tests/test_rewards_templates.py covers it).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _state_fixtures import HashEmbedder

PASSWORDS = {"ada": "ada-password", "ana": "ana-password", "bob": "bob-password", "cy": "cy-password-1",
             "rae": "rae-password"}
ROLES = {"ada": "admin", "ana": "analyst", "bob": "approver", "cy": "approver", "rae": "reviewer"}
#: Episodes of the finance sample the run trains on (every task type and behaviour is present).
N_EPISODES = 150


@dataclass
class Trained:
    root: Path
    run_id: str
    bundle: Path

    def workspace(self):
        from core.records.store import Workspace

        return Workspace.open(self.root)

    def actor(self, name: str):
        from core.access.users import Actor

        return Actor(name=name, role=ROLES[name])


_CACHE: dict[str, Trained] = {}


def tiny_config() -> Any:
    from core.rl.ppo import PPOConfig

    return PPOConfig(total_steps=2048, n_envs=64, rollout_len=16, update_epochs=2, n_minibatches=2,
                     bc_epochs=2, hidden=64, n_critics=2, encoder={"dim": 64}, device="cpu",
                     checkpoint_every=100, seed=0)


def hash_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap the sentence model for the hash embedder (everywhere core looks it up)."""
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())


@pytest.fixture(scope="module", autouse=True)
def module_hash_embedder():
    """Import this into a test module and every test of it embeds with the hash embedder."""
    with pytest.MonkeyPatch.context() as mp:
        hash_embedder(mp)
        yield


def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The shared workspace, run and bundle (built on first use in this process, with the
    hash embedder whoever asks first: tests/conftest.py's session fixture ``tiny_run`` is
    set up before any module's own patches)."""
    if "run" in _CACHE:
        return _CACHE["run"]
    with pytest.MonkeyPatch.context() as mp:
        hash_embedder(mp)
        _CACHE["run"] = _build(tmp_path_factory)
    return _CACHE["run"]


def _build(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    from core.data.importers import import_file
    from core.rl.runs import train
    from core.records.store import Workspace
    from core.access.users import LOCAL_ADMIN, Actor, add_user

    root = tmp_path_factory.mktemp("bundle-ws")
    sample = Path(__file__).resolve().parents[1] / "datasets" / "finance" / "sample.jsonl"
    lines = sample.read_text(encoding="utf-8").splitlines()
    subset = root.parent / "finance-subset.jsonl"
    subset.write_text("\n".join(lines[:N_EPISODES + 1]) + "\n", encoding="utf-8")  # header + episodes
    ws = Workspace.open(root)
    import_file(ws, subset, dataset="finance")
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password=PASSWORDS["ada"])
    ada = Actor("ada", "admin")
    for name in ("ana", "bob", "cy", "rae"):
        add_user(ws, ada, name, ROLES[name], password=PASSWORDS[name])
    ana = Actor("ana", "analyst")
    result = train(ws, ana, template="finance_risk", dataset="finance", config=tiny_config())
    from core.govern.bundle import export_bundle

    bundle = export_bundle(ws, ana, result.run_id, root.parent / "finance_risk-0.1.0.zip")
    ws.close()
    import shutil

    # What trained_copy hands out: the workspace as built, before any module registers in it.
    shutil.copytree(root, root.parent / "bundle-ws-as-built")
    return Trained(root=root, run_id=result.run_id, bundle=bundle)


def trained_copy(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The shared run in a workspace of the caller's own (a copy of the workspace as built,
    not as other modules have left it): what a module registers, approves and promotes there
    never meets another module's registrations of the same names in the shared workspace."""
    import dataclasses
    import shutil

    shared = trained(tmp_path_factory)
    root = tmp_path_factory.mktemp("bundle-ws-copy") / "ws"
    shutil.copytree(shared.root.parent / "bundle-ws-as-built", root)
    return dataclasses.replace(shared, root=root)


def promote_svc(run: Trained, root: Path) -> Path:
    """A policies folder at ``root`` with ``svc`` 0.1.0 promoted and 0.2.0 approved, through
    ``run``'s registry (its own evaluation re-labelled: 0.2.0 beats 0.1.0, both beat the expert)."""
    from core.govern import registry
    from core.govern.bundle import load_bundle

    w = run.workspace()
    expert = load_bundle(run.bundle).manifest.evaluation["expert_return"]
    with pytest.MonkeyPatch.context() as mp:
        registry_figures(mp, {("svc", "0.1.0"): expert + 1.0, ("svc", "0.2.0"): expert + 2.0})
        for version in ("0.1.0", "0.2.0"):
            path = reseal(run.bundle, root.parent / f"{root.name}-svc-{version}.zip", name="svc", version=version)
            registry.register(w, run.actor("ana"), path)
            registry.approve(w, run.actor("bob"), "svc", version, "beats the baseline on held-out episodes")
    registry.promote(w, run.actor("bob"), "svc", "0.1.0", root=root)
    w.close()
    return root


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def write_zip(path: Path, files: dict[str, bytes], *, symlinks: tuple[str, ...] = ()) -> Path:
    """A zip of exactly ``files`` (in order), entries named in ``symlinks`` marked as links."""
    import stat

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
            mode = stat.S_IFLNK | 0o777 if name in symlinks else stat.S_IFREG | 0o644
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


def workspace_key(root: Path) -> Any:
    """The signing key of the workspace at ``root`` (made on first need)."""
    from core.access.keys import signing_key
    from core.records.store import Workspace

    ws = Workspace.open(root)
    try:
        return signing_key(ws)
    finally:
        ws.close()


def relabel(ev: dict[str, Any], *, policy_return: float | None = None, expert_return: float | None = None) -> None:
    """Set the held-out figures of an evaluation report (the headline and the paired ones
    the gate reads) in place."""
    # the gate reads the paired figures (the policy from the best logged behaviour's start
    # states vs that behaviour's logs): relabel them with the headline ones
    best = (ev.get("best_logged") or {}).get("behaviour") or "expert"
    if policy_return is not None:
        ev["policy"]["return_mean"] = policy_return
        ev["paired"][best]["policy"] = policy_return
    if expert_return is not None:
        ev["expert_return"] = expert_return
        ev["logged"]["expert"] = expert_return
        ev["paired"]["expert"]["logged"] = expert_return


def reseal(src: Path, dst: Path, *, name: str | None = None, version: str | None = None,
           policy_return: float | None = None, expert_return: float | None = None,
           created_by: str | None = None, files: dict[str, bytes] | None = None, signer: Any = "run") -> Path:
    """A re-labelled copy of a bundle: a new manifest (name, version, evaluation numbers,
    exporter) sealed over the same — or the given — files and signed with the private key
    ``signer`` (default ``"run"``: the shared workspace's key, as its exporter would; None:
    unsigned)."""
    from core.govern.bundle import BUNDLE_FILES, write_bundle

    m = members(src)
    manifest = json.loads(m["manifest.json"])
    for key in ("digest", "files"):
        manifest.pop(key)
    if name is not None:
        manifest["name"] = name
    if version is not None:
        manifest["version"] = version
    if created_by is not None:
        manifest["created_by"] = created_by
    relabel(manifest["evaluation"], policy_return=policy_return, expert_return=expert_return)
    body_files = {n: (files or {}).get(n, m[n]) for n in BUNDLE_FILES}
    if isinstance(signer, str) and signer == "run":
        signer = workspace_key(_CACHE["run"].root)
    return write_bundle(dst, manifest, body_files, key=signer)


#: The registry's real own record per run (computed once per process: an evaluation takes seconds).
_OWN_RECORDS: dict[str, dict[str, Any]] = {}


def registry_figures(mp: pytest.MonkeyPatch, returns: dict[tuple[str, str], float],
                     changes: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
    """Let tests choose the registry's own held-out figures per ``(name, version)``: the
    registry's real record of the run (its own evaluation, who trained it), with the
    policy's return set to ``returns[(name, version)]`` and ``changes`` merged into the
    evaluation.  Tests of the gate's logic use it; tests of what the registry computes
    (tests/test_signing.py) do not."""
    import copy

    from core.govern import registry

    real = registry._own_record

    def own_record(ws, m, members):
        if m.run_id not in _OWN_RECORDS:
            _OWN_RECORDS[m.run_id] = real(ws, m, members)
        rec = copy.deepcopy(_OWN_RECORDS[m.run_id])
        if (m.name, m.version) in returns:
            relabel(rec["evaluation"], policy_return=returns[(m.name, m.version)])
        rec["evaluation"].update((changes or {}).get((m.name, m.version), {}))
        return rec

    mp.setattr(registry, "_own_record", own_record)
