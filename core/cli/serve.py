"""``rwb serve``: ask the decision engine (``core.serve.serving``) from the command line.

``decide`` serves requests with the promoted policy NAME (or a bundle zip/folder) and
writes their audit records to the workspace; ``metrics`` does the same and prints the
engine's Prometheus metrics (or, with ``--alert-rules``, the example alert rules);
``http`` runs the HTTP decision service (``core.serve.serve_http``, docs/http_service.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from core.cli import open_workspace, print_json
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

app = typer.Typer(help="The decision engine: serve requests with a promoted policy or a bundle.",
                  no_args_is_help=True)

POLICY_HELP = "Promoted policy name (core/policies or $RWB_POLICIES_DIR), or a bundle .zip / promoted folder."
REQUEST_HELP = ("The request: JSON text, @FILE (a JSON object, a list, or JSON lines, served in order), "
                "or - for stdin.")


def _requests(request: str) -> list[dict]:
    from core.serve.serving import MAX_REQUESTS_TEXT_BYTES, read_requests  # deferred: keeps rwb --help fast

    if request == "-":  # one character past the cap is enough for read_requests to refuse
        return read_requests(sys.stdin.read(MAX_REQUESTS_TEXT_BYTES + 1), file="<stdin>")
    if request.startswith("@"):
        path = Path(request[1:])
        try:
            size = path.stat().st_size
            if size > MAX_REQUESTS_TEXT_BYTES:  # refused before it is read
                raise InputError(f"{size:,} bytes is more than the {MAX_REQUESTS_TEXT_BYTES:,} a request file may "
                                 "hold; split it", file=str(path))
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot read the requests: {exc}", file=str(path)) from exc
        return read_requests(text, file=str(path))
    return read_requests(request, file="--request")


def _config(confidence: Optional[float], force_rde: bool, budget_ms: Optional[float], defer: bool = False):
    """The engine's settings.  A one-shot command has no later request that a background
    embedding would serve, so its RL-Boosts wait for their query's embedding unless
    ``defer`` (the long-running service's default, ServingConfig.wait_for_intent), and the
    sentence model runs in this process (a child would only add its start-up)."""
    from core.serve.serving import ServingConfig  # deferred: keeps rwb --help fast

    options: dict = {"force_rde_override": force_rde, "wait_for_intent": not defer, "model_process": False}
    if confidence is not None:
        options["confidence_threshold"] = confidence
    if budget_ms is not None:
        options["time_budget_ms"] = budget_ms
    return ServingConfig(**options)


@app.command("decide")
def decide(
    policy: str = typer.Option(..., "--policy", help=POLICY_HELP),
    request: str = typer.Option(..., "--request", "-r", help=REQUEST_HELP),
    confidence: Optional[float] = typer.Option(
        None, "--confidence", help="RDE confidence below which RL-Boost runs (default 0.7)."),
    force_rde: bool = typer.Option(False, "--force-rde", help="force_rde_override: always serve the baseline."),
    budget_ms: Optional[float] = typer.Option(
        None, "--budget-ms", help="Time budget of candidate generation (default 300 ms)."),
    defer: bool = typer.Option(
        False, "--defer-unembedded",
        help="Defer an RL-Boost whose query is not embedded yet, as a running service does (the baseline "
             "answers at once), instead of waiting for the sentence model."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Serve the request(s) and print each decision (its audit record is written)."""
    from core.serve.serving import serve_requests  # deferred: keeps rwb --help fast

    decisions, _ = serve_requests(open_workspace(), policy, _requests(request),
                                  config=_config(confidence, force_rde, budget_ms, defer))
    if as_json:
        print_json({"decisions": [d.to_dict() for d in decisions]})
        return
    for d in decisions:
        cands = ", ".join(f"{c.name} p={c.prob:.2f} est={c.reward_est:.3f}" for c in d.rl_candidates)
        typer.echo(f"{d.episode_id} t={d.step_t}: {d.final_name} {d.final_label} [{d.source}, "
                   f"confidence {d.confidence:.2f}, {d.policy_version}]")
        typer.echo(f"  {d.explanation}")
        if cands:
            typer.echo(f"  candidates: {cands}")
        if d.review_item is not None:
            typer.echo(f"  queued for review as item #{d.review_item}")


@app.command("metrics")
def metrics(
    policy: Optional[str] = typer.Option(None, "--policy", help=POLICY_HELP),
    request: Optional[str] = typer.Option(None, "--request", "-r", help=REQUEST_HELP + " Served first."),
    alert_rules: bool = typer.Option(False, "--alert-rules",
                                     help="Print the example Prometheus alert rules instead."),
) -> None:
    """Print the engine's Prometheus metrics after serving the given requests."""
    from core.serve.serving import alert_rules as rules_text  # deferred: keeps rwb --help fast
    from core.serve.serving import serve_requests  # deferred: keeps rwb --help fast

    if alert_rules:
        typer.echo(rules_text(), nl=False)
        return
    if policy is None:
        raise InputError("give --policy (and --request to serve some requests first), or --alert-rules",
                         field="policy")
    _, text = serve_requests(open_workspace(), policy, _requests(request) if request else [],
                             config=_config(None, False, None))
    typer.echo(text, nl=False)


@app.command("http")
def http(
    policy: str = typer.Option(..., "--policy", help=POLICY_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
    workers: int = typer.Option(
        1, "--workers", min=1,
        help="Worker processes. Each keeps its own episodes and metrics: an episode's requests must reach "
             "the same worker (one keep-alive connection per episode), else keep 1 and scale with processes "
             "behind a balancer that routes by episode."),
    confidence: Optional[float] = typer.Option(
        None, "--confidence", help="RDE confidence below which RL-Boost runs (default 0.7)."),
    force_rde: bool = typer.Option(False, "--force-rde", help="force_rde_override: always serve the baseline."),
    budget_ms: Optional[float] = typer.Option(
        None, "--budget-ms", help="Time budget of candidate generation (default 300 ms)."),
    wait_for_intent: bool = typer.Option(
        False, "--wait-for-intent",
        help="An RL-Boost whose query is not embedded yet waits for the sentence model (within the budget) "
             "instead of letting the baseline answer at once."),
    max_batch: int = typer.Option(256, "--max-batch", min=1, help="Requests one batch call may carry."),
    access_log: bool = typer.Option(False, "--access-log", help="Log every HTTP request (uvicorn's access log)."),
    as_json: bool = typer.Option(False, "--json", help="Print the start-up line as one JSON object."),
) -> None:
    """Serve decisions over HTTP until stopped (Ctrl-C / SIGTERM commit the audit records).
    The decide endpoints need `Authorization: Bearer ...` when RWB_SERVE_TOKEN is set."""
    import json
    import os

    # fastapi and uvicorn are the [http] extra: imported only when the service runs
    try:
        import uvicorn

        from core.serve.serve_http import (  # deferred: loads fastapi
            ENV_TOKEN, ServiceSettings, build_app, check_policy, service_config)
    except ImportError as exc:
        raise InputError(f"the HTTP service needs the [http] extra ({exc.name} is not installed): "
                         "pip install 'reward-workbench[http]'") from None

    # a serving process: the loaded engine frozen out of the collector's reach, and the
    # collector run between requests (ServingConfig.freeze_gc, idle_gc)
    options: dict = {"force_rde_override": force_rde, "wait_for_intent": wait_for_intent,
                     "freeze_gc": True, "idle_gc": True}
    if confidence is not None:
        options["confidence_threshold"] = confidence
    if budget_ms is not None:
        options["time_budget_ms"] = budget_ms
    ws = open_workspace()
    root = str(ws.root)
    ws.close()
    settings = ServiceSettings(policy=policy, workspace=root, token=os.environ.get(ENV_TOKEN),
                               policies_root=os.environ.get("RWB_POLICIES_DIR") or None,
                               max_batch=max_batch, config=service_config(**options))
    app_or_factory: FastAPI | str  # the app itself, or the import path each worker builds it from
    if workers == 1:
        app_or_factory = build_app(settings)
        version = app_or_factory.state.service.engine.policy_version
    else:
        version = check_policy(settings)  # a usage error stops here, before any worker starts
        os.environ.update(settings.to_env())  # what each worker's create_app() reads
        app_or_factory = "core.serve.serve_http:create_app"
    info = {"url": f"http://{host}:{port}", "policy_version": version, "workers": workers,
            "token_required": settings.token is not None, "workspace": root}
    if as_json:
        print_json(info)
    else:
        typer.echo(f"serving {version} at {info['url']} ({workers} worker{'s' if workers > 1 else ''}, "
                   f"token {'required' if info['token_required'] else 'not required'}; audit in {root})")
    sys.stdout.flush()
    try:
        uvicorn.run(app_or_factory, host=host, port=port, workers=workers if workers > 1 else None,
                    factory=workers > 1, access_log=access_log, log_level="info")
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
