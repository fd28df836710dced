"""``rwb reward serve``: the HTTP reward service (:mod:`core.serve.reward_service`) for a pinned
template, on uvicorn: OpenRLHF's ``/get_reward``, NeMo Gym's ``/verify`` and the batch ``/v1/score``.

The template is resolved and pinned (``name@version`` and sha256) once, before any worker starts;
each worker scores with its own copy.  The bearer token never goes on the command line: it is read
from ``--token-file`` or ``$RWB_REWARD_TOKEN``.  Details: docs/export.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from core.base.errors import InputError
from core.cli import open_workspace, print_json

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

TEMPLATE_HELP = ("Template to serve: a shipped name (tool_agent), NAME@VERSION (tool_agent@3: saved in the "
                 "workspace; @0 = shipped), or a YAML file. Pinned by its sha256 at start-up.")


def _token(token_file: Optional[Path]) -> str | None:
    """The bearer token: the first line of ``token_file``, else ``$RWB_REWARD_TOKEN``, else none."""
    from core.serve.reward_service import ENV_TOKEN  # deferred: loads fastapi

    if token_file is None:
        return os.environ.get(ENV_TOKEN) or None
    try:
        text = token_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the token: {exc}", file=str(token_file)) from None
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise InputError("the token file is empty", file=str(token_file))
    return token


def _workspace_root(template: str) -> str | None:
    """The workspace that resolves saved versions (``tool_agent@3``), when there is one; none is
    created, and none is needed for a shipped template or a file."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    if Path(template).is_file():
        return None
    try:
        ws = open_workspace(create=False)
    except WorkspaceError:
        return None
    root = str(ws.root)
    ws.close()
    return root


def serve(
    template: str = typer.Option(..., "--template", "-t", help=TEMPLATE_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8600, "--port", help="TCP port to listen on."),
    workers: int = typer.Option(
        1, "--workers", min=1, help="Worker processes, each with its own scorer, sentence model, embedding cache "
                                    "and metrics."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="A file whose first line is the bearer token the reward endpoints require "
                                   "(default: $RWB_REWARD_TOKEN; neither: no token)."),
    max_batch: int = typer.Option(256, "--max-batch", min=1, help="Trajectories (or queries) one request may carry."),
    max_body_mb: float = typer.Option(32.0, "--max-body-mb", min=0.01, help="Largest request body read, in MiB."),
    access_log: bool = typer.Option(False, "--access-log", help="Log every HTTP request (uvicorn's access log)."),
    as_json: bool = typer.Option(False, "--json", help="Print the start-up line as one JSON object."),
) -> None:
    """Serve rewards of a pinned template over HTTP until stopped: POST /get_reward (OpenRLHF),
    /verify (NeMo Gym), /v1/score (batch); /healthz, /readyz, /metrics, /openapi.json."""
    # fastapi and uvicorn are the [http] extra: imported only when the service runs
    try:
        import uvicorn

        from core.serve.reward_service import (  # deferred: loads fastapi and the scorer
            RewardSettings, open_scorer, reward_app)
    except ImportError as exc:
        raise InputError(f"the HTTP service needs the [http] extra ({exc.name} is not installed): "
                         "pip install 'reward-workbench[http]'") from None

    spec = RewardSettings(template=template, workspace=_workspace_root(template), token=_token(token_file),
                          max_batch=max_batch, max_body_bytes=int(max_body_mb * 1024 * 1024))
    scorer = open_scorer(spec)  # a usage error (unknown template, bad YAML) stops here, before any worker starts
    is_file = template.endswith((".yaml", ".yml")) or Path(template).is_file()
    # every worker serves exactly this text: the resolved version (or the file), pinned by its digest
    settings = RewardSettings(template=template if is_file else scorer.label, sha256=scorer.sha256,
                              workspace=spec.workspace, token=spec.token, max_batch=spec.max_batch,
                              max_body_bytes=spec.max_body_bytes)
    app_or_factory: FastAPI | str  # the app itself, or the import path each worker builds it from
    if workers == 1:
        app_or_factory = reward_app(scorer, token=settings.token, max_batch=settings.max_batch,
                                    max_body_bytes=settings.max_body_bytes, freeze_gc=True)
    else:
        os.environ.update(settings.to_env())  # what each worker's app_from_env() reads
        app_or_factory = "core.serve.reward_service:app_from_env"
    info = {"url": f"http://{host}:{port}", "template": scorer.label, "sha256": scorer.sha256, "workers": workers,
            "token_required": settings.token is not None, "max_batch": settings.max_batch}
    if as_json:
        print_json(info)
    else:
        typer.echo(f"serving rewards of {scorer.label} (sha256 {scorer.sha256[:12]}…) at {info['url']} "
                   f"({workers} worker{'s' if workers > 1 else ''}, token "
                   f"{'required' if info['token_required'] else 'not required'}); OpenRLHF: {info['url']}/get_reward, "
                   f"NeMo Gym: {info['url']}/verify")
    sys.stdout.flush()
    try:
        uvicorn.run(app_or_factory, host=host, port=port, workers=workers if workers > 1 else None,
                    factory=workers > 1, access_log=access_log, log_level="info")
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
