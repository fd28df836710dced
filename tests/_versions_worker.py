"""A process of the template-version race test (spawned: keep its imports small)."""

from __future__ import annotations


def save_on_base_zero(root: str, i: int, barrier, results) -> None:
    """Open the workspace, wait for the others, then save finance_risk on base 0."""
    from core.rewards.template import load_template
    from core.base.errors import ConflictError
    from core.rewards.versions import save_template
    from core.records.store import Workspace
    from core.access.users import Actor

    ws = Workspace.open(root)
    text = load_template("finance_risk").with_weights({"latency": 0.1 * (i + 1)}).to_yaml()
    barrier.wait()
    try:
        saved = save_template(ws, Actor(f"proc{i}", "analyst"), "finance_risk", text, 0)
        results.put((i, "won", saved.version))
    except ConflictError as exc:
        results.put((i, "conflict", str(exc)))
    finally:
        ws.close()
