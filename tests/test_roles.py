"""Roles on every write: each core function of ``core.access.users.ACTIONS`` is called as every
role in a multi-user workspace, and refuses exactly the roles the permission table
(``core.access.users.PERMISSIONS``) leaves out, before it changes anything.

Also: the table names every core function that takes an acting user; a workspace
without users keeps working as the local admin; the CLI and the Reward Pyramid page act
as the signed-in user.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import core
from core.base.errors import PermissionDenied, RwbError
from core.records.store import Workspace, WorkspaceError
from core.access.users import ACTIONS, LOCAL_ADMIN, PERMISSIONS, ROLES, SERVICE_ROLE, Actor, add_user

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
SAMPLE_EPISODES = 250  # datasets/finance/sample.jsonl: a header line and 250 episodes

#: One signed-in user per role (the admin first: it switches the workspace to multi-user mode).
TEAM = {"admin": ("ada", "ada-password"), "analyst": ("ana", "ana-password"),
        "reviewer": ("rae", "rae-password"), "approver": ("bob", "bob-password")}
ACTORS: dict[str, Actor] = {role: Actor(name, role) for role, (name, _) in TEAM.items()}
ACTORS[SERVICE_ROLE] = Actor.service("roles-test")
ALL_ROLES = (*ROLES, SERVICE_ROLE)


def _resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _finance_risk() -> Any:
    from core import rewards

    return rewards.load_template("finance_risk")


def _review_request() -> Any:
    from core.guard.review import ReviewRequest

    return ReviewRequest(origin="training", reason="roles test", state={"task_type": "trade"},
                         token_id=1)


def _send_step(f: Any, ws: Workspace, a: Actor, t: str) -> Any:
    """Send the first recorded step with a catalog token of the sample to review."""
    from core.records.catalog import catalog_for_dataset
    from core.guard.review import recorded_steps

    catalog = catalog_for_dataset(ws, "imp-seed")
    step = next(s for e in ws.load_episodes("imp-seed", limit=5)
                for s in recorded_steps(e, "imp-seed", catalog))
    return f(ws, a, "imp-seed", step.episode_id, step.step_t, f"roles test {t}", catalog=catalog)


def _ppo_config() -> Any:
    from core.rl.ppo import PPOConfig

    return PPOConfig()


#: How to call each write function: (function, workspace, actor, tag unique to the role, a
#: scratch folder).  Where cheap the call is a real one that succeeds for an allowed role
#: (SUCCEEDS); the others name something that does not exist, so an allowed role gets past
#: the permission check and is then refused for the missing thing (never PermissionDenied).
CALLS: dict[str, Callable[[Any, Workspace, Actor, str, Path], Any]] = {
    "core.rl.runs.resume_run": lambda f, ws, a, t, d: f(ws, a, "no-such-run"),
    "core.data.datasets.archive_dataset": lambda f, ws, a, t, d: f(ws, a, "imp-seed"),
    "core.data.datasets.restore_dataset": lambda f, ws, a, t, d: f(ws, a, "no-such-dataset"),
    "core.data.datasets.delete_dataset": lambda f, ws, a, t, d: f(ws, a, "imp-seed", confirm="imp-seed"),
    "core.data.importers.api.import_file": lambda f, ws, a, t, d: f(ws, SAMPLE, dataset=f"imp-{t}", actor=a),
    "core.data.episode_views.import_upload": lambda f, ws, a, t, d: f(
        ws, f"upload-{t}.jsonl", SAMPLE.read_bytes(), dataset=f"up-{t}", actor=a),
    "core.rewards.versions.save_template": lambda f, ws, a, t, d: f(
        ws, a, f"roles_{t}", _finance_risk(), None, "saved by the roles test"),
    "core.data.task_criteria.import_criteria": lambda f, ws, a, t, d: f(
        ws, a, f"criteria-{t}.jsonl", "imp-seed", data=b'{"task_id": "t1", "communicate": ["ok"]}\n'),
    "core.rewards.labels.add_label": lambda f, ws, a, t, d: f(
        ws, a, "imp-seed", ws.load_episodes("imp-seed", limit=1)[0].episode_id, 1, note=f"roles test {t}"),
    "core.tuning.apply.apply_study": lambda f, ws, a, t, d: f(ws, a, "no-such-study"),
    "core.tuning.preferences.add_preference": lambda f, ws, a, t, d: f(ws, a, "no-such-dataset", "e1", "e2"),
    "core.tuning.studies.tune": lambda f, ws, a, t, d: f(ws, a, "finance_risk", dataset="no-such-dataset",
                                                 trials=1),
    "core.tuning.workers.launch_tuning": lambda f, ws, a, t, d: f(ws, a, "finance_risk",
                                                          dataset="no-such-dataset", trials=0),
    "core.tuning.workers.stop_tuning": lambda f, ws, a, t, d: f(ws, a, "no-such-study"),
    "core.rl.runs.create_run": lambda f, ws, a, t, d: f(ws, a, template=_finance_risk(),
                                                     config=_ppo_config(), dataset="imp-seed"),
    "core.rl.runs.train": lambda f, ws, a, t, d: f(ws, a, template="no_such_template",
                                                dataset="no-such-dataset"),
    "core.rl.runs.launch_run": lambda f, ws, a, t, d: f(ws, a, template="no_such_template",
                                                     dataset="no-such-dataset"),
    "core.rl.runs.stop_run": lambda f, ws, a, t, d: f(ws, a, "no-such-run"),
    "core.guard.review.enqueue": lambda f, ws, a, t, d: f(ws, a, _review_request()),
    "core.guard.review.enqueue_many": lambda f, ws, a, t, d: f(ws, a, [_review_request()]),
    "core.guard.review.reserve_item_ids": lambda f, ws, a, t, d: f(ws, a, 2),
    "core.guard.review.send_step": lambda f, ws, a, t, d: _send_step(f, ws, a, t),
    "core.guard.review.claim": lambda f, ws, a, t, d: f(ws, a, dataset=f"no-items-{t}"),
    "core.guard.review.release": lambda f, ws, a, t, d: f(ws, a, 10**9),
    "core.guard.review.decide": lambda f, ws, a, t, d: f(ws, a, 10**9, "approve", "roles test"),
    "core.govern.bundle.export_bundle": lambda f, ws, a, t, d: f(ws, a, "no-such-run", d / "b.zip"),
    "core.govern.registry.register": lambda f, ws, a, t, d: f(ws, a, d / "no-such-bundle.zip"),
    "core.govern.registry.approve": lambda f, ws, a, t, d: f(ws, a, "no-such-policy", "1.0.0", "ok"),
    "core.govern.registry.promote": lambda f, ws, a, t, d: f(ws, a, "no-such-policy", "1.0.0", "go"),
    "core.govern.registry.rollback": lambda f, ws, a, t, d: f(ws, a, "no-such-policy", "back"),
    "core.govern.registry.publish_index": lambda f, ws, a, t, d: f(ws, a, "no-such-policy", root=d / "policies"),
    "core.access.audit.AuditWriter": lambda f, ws, a, t, d: f(ws, a, synchronous=True).close(),
    "core.access.audit.write_record": lambda f, ws, a, t, d: f(ws, a, {"not": "an audit record"}),
    "core.access.audit.recover_unflushed": lambda f, ws, a, t, d: f(ws, a),
    "core.access.audit.export": lambda f, ws, a, t, d: f(ws, a, d / f"audit-{t}.jsonl"),
    "core.access.users.list_users": lambda f, ws, a, t, d: f(ws, a),
    "core.access.users.add_user": lambda f, ws, a, t, d: f(ws, a, f"new-{t}", "analyst",
                                                    password="new-user-password"),
    "core.access.users.set_role": lambda f, ws, a, t, d: f(ws, a, "tgt", "reviewer"),
    "core.access.users.set_password": lambda f, ws, a, t, d: f(ws, a, "tgt", "tgt-password-2"),
    "core.access.users.disable_user": lambda f, ws, a, t, d: f(ws, a, "tgt"),
    "core.access.keys.rotate": lambda f, ws, a, t, d: f(ws, a),
    "core.access.keys.trust": lambda f, ws, a, t, d: f(ws, a, d / "no-such-key.pem"),
    "core.access.keys.untrust": lambda f, ws, a, t, d: f(ws, a, "0" * 16),
}

#: Calls above that are real and must succeed for a role that holds the permission.
SUCCEEDS = {"core.data.datasets.archive_dataset", "core.data.datasets.delete_dataset",
            "core.data.importers.api.import_file", "core.data.episode_views.import_upload",
            "core.data.task_criteria.import_criteria",
            "core.rewards.labels.add_label",
            "core.rewards.versions.save_template", "core.rl.runs.create_run", "core.guard.review.enqueue",
            "core.guard.review.enqueue_many", "core.guard.review.reserve_item_ids", "core.guard.review.send_step", "core.guard.review.claim", "core.access.audit.AuditWriter",
            "core.access.audit.recover_unflushed", "core.access.audit.export", "core.access.users.list_users",
            "core.access.users.add_user", "core.access.users.set_role", "core.access.users.set_password",
            "core.access.users.disable_user", "core.access.keys.rotate"}

#: Functions that take an ``actor`` but are not writes checked against the table.
NOT_WRITES = {
    "core.govern.overview.workspace_overview": "reads; the actor only picks the next step its role may do",
    "core.data.datasets.DatasetEvent": "a record read back: the actor is who did it",
    "core.govern.review_context.review_context": "reads; the actor's last template on the dataset's domain is the default",
    "core.govern.review_context.choose_template": "reads; the actor's last template on the dataset's domain is the default",
    "core.govern.policy_folder.resolve_active": "reads; raises its high-water mark; the actor is named in the security log",
    "core.access.users.require_role": "the check itself",
    "core.access.users.require": "the check itself",
    "core.access.users.authorize": "the check itself",
    "core.access.users.check_four_eyes": "a further check inside core.govern.registry.approve",
    "core.access.users.open_session": "signing in: the actor is who signs in",
    "core.access.users.Session": "a signed-in session: the actor is who signed in",
    "core.access.audit.security_event": "a line of the security log naming who did what",
    "core.access.security_log.append": "the writer behind security_event: a line naming who did what",
    "core.serve.serving.RefusalLog": "security-log lines of refused requests: the actor is the service",
    "core.govern.bundle.verify_in_workspace": "reads; the actor is named in the security log on a refusal",
    "core.serve.serving.load_promoted": "reads; the actor is named in the security log on a refusal",
    "core.serve.serving.DecisionEngine": "writes audit records through core.access.audit.AuditWriter (checked)",
    "core.access.audit.SecurityEvent": "a record read back: the actor is who did it",
    "core.govern.registry_records.RegistryEvent": "a record read back: the actor is who did it",
    "core.guard.review.ReviewEvent": "a record read back: the actor is who did it",
}


@pytest.fixture(scope="module")
def team_ws(tmp_path_factory) -> Path:
    """A multi-user workspace with one user per role, the sample imported, and users to
    administer ("tgt")."""
    from core.data.importers import import_file

    path = tmp_path_factory.mktemp("roles") / "ws"
    ws = Workspace.open(path)
    import_file(ws, SAMPLE, dataset="imp-seed")                     # still embedded: the local admin
    admin = add_user(ws, LOCAL_ADMIN, "ada", "admin", password=TEAM["admin"][1]).actor()
    for role, (name, password) in TEAM.items():
        if role != "admin":
            add_user(ws, admin, name, role, password=password)
    add_user(ws, admin, "tgt", "analyst", password="tgt-password")
    ws.close()
    return path


@pytest.fixture
def ws(team_ws, tmp_path) -> Workspace:
    """A fresh copy of the team workspace per test (a refusal is checked against a clean copy)."""
    copy = tmp_path / "ws"
    shutil.copytree(team_ws, copy)
    ws = Workspace.open(copy)
    yield ws
    ws.close()


def _snapshot(ws: Workspace) -> dict[str, Any]:
    """Every table's rows and every file under the workspace folder except the database."""
    tables = [r[0] for r in ws.conn.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
    rows = {t: sorted(map(repr, ws.conn.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables}
    # the security log records refusals (core.govern.registry's *_refused events): appending
    # to it is not a change of the workspace
    files = sorted(str(p.relative_to(ws.root)) for p in Path(ws.root).rglob("*")
                   if p.is_file() and not p.name.startswith("workspace.db")
                   and p.relative_to(ws.root).as_posix() != "artifacts/security/events.jsonl")
    return {"rows": rows, "files": files}


# --------------------------------------------------------------------------- the table
def _functions_taking_an_actor() -> set[str]:
    """Every public function and class of ``core`` (not the CLI parsers) with an ``actor`` parameter."""
    found: set[str] = set()
    for info in pkgutil.walk_packages(core.__path__, "core."):
        if info.name.startswith("core.cli"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                try:
                    params = inspect.signature(obj).parameters
                except (TypeError, ValueError):
                    continue
                if "actor" in params:
                    found.add(f"{info.name}.{name}")
    return found


def test_the_table_names_every_function_that_takes_an_actor():
    found = _functions_taking_an_actor()
    assert found - set(NOT_WRITES) == set(ACTIONS), (
        f"missing from core.access.users.ACTIONS: {sorted(found - set(NOT_WRITES) - set(ACTIONS))}; "
        f"in the table but not found: {sorted(set(ACTIONS) - found)}")


def test_every_permission_guards_a_write_and_every_write_has_a_known_permission():
    assert set(ACTIONS.values()) == set(PERMISSIONS)
    for roles in PERMISSIONS.values():
        assert roles <= set(ALL_ROLES)
    assert set(CALLS) == set(ACTIONS)          # the walk below covers every write
    assert SUCCEEDS <= set(CALLS)


def test_the_known_answers_of_the_table():
    """A few rows spelled out, so a slip in PERMISSIONS cannot pass by agreeing with itself."""
    allowed = {action: {r for r in ALL_ROLES if r in PERMISSIONS[p]} for action, p in ACTIONS.items()}
    assert allowed["core.data.importers.api.import_file"] == {"analyst", "admin"}
    assert allowed["core.rewards.versions.save_template"] == {"analyst", "admin"}
    assert allowed["core.tuning.apply.apply_study"] == {"analyst", "admin"}
    assert allowed["core.rl.runs.launch_run"] == {"analyst", "admin"}
    assert allowed["core.guard.review.decide"] == {"reviewer", "admin"}
    assert allowed["core.guard.review.enqueue"] == {"analyst", "admin", SERVICE_ROLE}
    assert allowed["core.guard.review.send_step"] == {"analyst", "admin", SERVICE_ROLE}
    assert allowed["core.govern.registry.register"] == {"analyst", "admin"}
    assert allowed["core.govern.registry.approve"] == {"approver", "admin"}
    assert allowed["core.govern.registry.promote"] == {"approver", "admin"}
    assert allowed["core.govern.registry.rollback"] == {"approver", "admin"}
    assert allowed["core.access.audit.write_record"] == {"admin", SERVICE_ROLE}
    assert allowed["core.access.users.set_role"] == {"admin"}


# --------------------------------------------------------------------------- every write x every role
@pytest.mark.parametrize("role", ALL_ROLES)
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_every_write_as_every_role(ws, tmp_path, action, role):
    fn, actor = _resolve(action), ACTORS[role]
    call = CALLS[action]
    if role not in PERMISSIONS[ACTIONS[action]]:
        before = _snapshot(ws)
        with pytest.raises(PermissionDenied, match=r"may not .* it needs the role"):
            call(fn, ws, actor, role, tmp_path)
        assert _snapshot(ws) == before, f"{action} refused {role} but changed the workspace"
        return
    try:
        call(fn, ws, actor, role, tmp_path)
    except PermissionDenied as exc:
        pytest.fail(f"{action} refused {role}, which the table allows: {exc}")
    except (RwbError, WorkspaceError) as exc:
        assert action not in SUCCEEDS, f"{action} as {role} failed: {exc}"
    else:
        assert action in SUCCEEDS, f"{action} was given made-up arguments but succeeded"


def test_the_successful_writes_record_who_acted(ws):
    from core.data.importers import import_file
    from core.rewards.versions import get_template, save_template

    ana = ACTORS["analyst"]
    result = import_file(ws, SAMPLE, dataset="by-ana", actor=ana)
    assert (result.dataset, result.episodes) == ("by-ana", SAMPLE_EPISODES)
    saved = save_template(ws, ana, "by_ana", _finance_risk(), None, "mine")
    assert (saved.version, get_template(ws, "by_ana").saved_by) == (1, "ana")


def test_a_demoted_or_disabled_user_is_refused_with_an_actor_from_before(ws):
    from core.data.importers import import_file
    from core.access.users import disable_user, set_role

    ana = ACTORS["analyst"]
    set_role(ws, ACTORS["admin"], "ana", "reviewer")
    with pytest.raises(PermissionDenied, match="import data"):
        import_file(ws, SAMPLE, dataset="late", actor=ana)
    set_role(ws, ACTORS["admin"], "ana", "analyst")
    disable_user(ws, ACTORS["admin"], "ana")
    with pytest.raises(PermissionDenied, match="disabled"):
        import_file(ws, SAMPLE, dataset="late", actor=ana)
    assert not ws.has_dataset("late")


def test_a_refusal_is_logged_with_who_and_what(ws, caplog):
    from core.data.importers import import_file

    with caplog.at_level("WARNING", logger="core.access.users"):
        with pytest.raises(PermissionDenied):
            import_file(ws, SAMPLE, dataset="nope", actor=ACTORS["approver"])
    assert [r.getMessage() for r in caplog.records if r.name == "core.access.users"] == [
        "permission refused: actor=bob (approver) permission=import: "
        "bob (approver) may not import data: it needs the role admin or analyst"]


# --------------------------------------------------------------------------- without an actor
def test_without_users_everyone_is_the_local_admin(tmp_path):
    from core.data.episode_views import import_upload
    from core.data.importers import import_file

    ws = Workspace.open(tmp_path / "solo")
    assert import_file(ws, SAMPLE, dataset="solo").episodes == SAMPLE_EPISODES
    assert import_upload(ws, "up.jsonl", SAMPLE.read_bytes(), dataset="solo-up").episodes == SAMPLE_EPISODES
    # a stated role still counts without users: a reviewer does not import
    with pytest.raises(PermissionDenied, match="import data"):
        import_file(ws, SAMPLE, dataset="solo-2", actor=ACTORS["reviewer"])
    ws.close()


def test_with_users_an_import_must_say_who_imports(ws):
    from core.data.episode_views import import_upload
    from core.data.importers import import_file

    before = _snapshot(ws)
    with pytest.raises(PermissionDenied, match="sign in"):
        import_file(ws, SAMPLE, dataset="anon")
    with pytest.raises(PermissionDenied, match="sign in"):
        import_upload(ws, "anon.jsonl", SAMPLE.read_bytes(), dataset="anon")
    with pytest.raises(PermissionDenied, match="local admin is retired"):
        import_file(ws, SAMPLE, dataset="anon", actor=LOCAL_ADMIN)
    assert _snapshot(ws) == before


def test_a_new_multi_user_workspace_is_still_seeded_with_the_samples(tmp_path):
    """Seeding an empty workspace is part of setting it up: no signed-in user is needed."""
    from core.sample.workspace_setup import init_workspace

    ws = Workspace.open(tmp_path / "fresh")
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    status = init_workspace(ws)
    assert status.imported and all(r["episodes"] > 0 for r in status.imported)
    ws.close()


# --------------------------------------------------------------------------- CLI and page
def test_cli_import_acts_as_the_signed_in_user(ws, monkeypatch, capsys):
    from core.cli import main

    root = str(ws.root)
    ws.close()
    monkeypatch.setenv("RWB_PASSWORD", TEAM["reviewer"][1])
    code = main(["--workspace", root, "episodes", "import", str(SAMPLE), "--dataset", "cli", "--as", "rae"])
    assert code != 0
    assert "rae (reviewer) may not import data" in capsys.readouterr().err
    monkeypatch.setenv("RWB_PASSWORD", TEAM["analyst"][1])
    assert main(["--workspace", root, "episodes", "import", str(SAMPLE), "--dataset", "cli",
                 "--as", "ana", "--json"]) == 0
    assert f'"episodes": {SAMPLE_EPISODES}' in capsys.readouterr().out


@pytest.fixture
def pyramid_page(team_ws, tmp_path, monkeypatch):
    from _state_fixtures import HashEmbedder

    path = tmp_path / "ws"
    shutil.copytree(team_ws, path)
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    return path


def _open_pyramid(path: Path, role: str | None):
    """The page in a session signed in as ``role``'s user the way the sign-in page does it
    (``core.access.users.sign_in``, then the session's actor and token in the session state)."""
    from streamlit.testing.v1 import AppTest

    from core.access.users import sign_in

    at = AppTest.from_file(str(ROOT / "pages" / "reward_pyramid.py"), default_timeout=120)
    at.session_state["rp_dataset"] = "imp-seed"
    at.session_state["rp_template"] = "finance_risk@0"
    at.session_state["rp_tab"] = "Save & versions"  # only the open tab runs
    if role is not None:
        ws = Workspace.open(path)
        session = sign_in(ws, *TEAM[role])
        ws.close()
        at.session_state["actor"] = session.actor
        at.session_state["session_token"] = session.token
    return at.run()


def test_reward_pyramid_saves_as_the_signed_in_analyst(pyramid_page):
    from core.rewards.versions import get_template

    at = _open_pyramid(pyramid_page, "analyst")
    assert not at.exception, at.exception
    next(s for s in at.slider if s.label == "latency").set_value(0.5).run()
    at.text_input(key="rp_save_message1").set_value("as ana")
    next(b for b in at.button if b.label == "Save as new version").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert "Saved finance_risk@1." in [s.value for s in at.success]
    ws = Workspace.open(pyramid_page)
    saved = get_template(ws, "finance_risk")
    assert (saved.version, saved.saved_by, saved.message) == (1, "ana", "as ana")
    ws.close()


@pytest.mark.parametrize("role", [None, "reviewer"], ids=["signed-out", "reviewer"])
def test_reward_pyramid_offers_no_save_to_who_may_not(pyramid_page, role):
    at = _open_pyramid(pyramid_page, role)
    assert not at.exception, at.exception
    assert "Save as new version" not in [b.label for b in at.button]
    assert any("needs the analyst or admin role" in i.value for i in at.info)
