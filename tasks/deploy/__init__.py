"""Deployment: gate a checkpoint on its evaluation, register it in MLflow (alias `champion`) and
serve it behind an OpenAI-compatible API.

    gate.py          gate(deploy_cfg, eval_result, champion_val_loss) -> {passed, reason}
    registry.py      get_champion / register (MLflow model registry)
    server.py        the FastAPI server (python -m tasks.deploy.server ...): completions with SSE
                     streaming and logprobs, bearer auth, POST /v1/admin/reload (hot swap)
    scheduler.py     continuous batching: one thread steps all active sequences together
    service.py       start_or_refresh_server: the server as a background service of the stack
                     (a new champion is swapped into the running server in place)
    generation.py    KV-cached sampling shared by the server and the registered pyfunc
    export.py        Hugging Face-compatible export (Llama layout) + model card

Event-triggered evaluation/deployment lives in flows/triggers.py (served by infra/triggers_service.py).

Importing this package is cheap (no MLflow, no torch); the heavy modules load on first use.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tasks.deploy.gate import gate
from tasks.deploy.service import endpoint_url, server_status, start_or_refresh_server, stop_server

log = logging.getLogger(__name__)

__all__ = ["gate", "deploy_if_better", "start_or_refresh_server", "stop_server", "server_status", "endpoint_url"]


def deploy_if_better(cfg, tracking_uri: str, evaluation: dict, tokenizer_path: Path,
                     train_run_id: str | None = None) -> dict:
    """Gate `evaluation` (an evaluate-stage report: checkpoint, val_loss, ...) against the current
    champion; if it passes, register it as the new champion and (deploy.serve) serve it.

    Returns {"passed", "reason", "model_name", "val_loss", "checkpoint", "champion_version",
    "champion_val_loss", "version", "alias", "content_hash", "source", "endpoint", "pid"}.
    When the gate fails, version/alias/content_hash are None and `endpoint` is the running
    server's (still the previous champion) if there is one.
    """
    from tasks.deploy.registry import get_champion, model_content_hash, register

    dcfg = cfg.deploy
    champion = get_champion(tracking_uri, dcfg.model_name)
    content_hash = model_content_hash(evaluation["checkpoint"], tokenizer_path)
    if champion and champion["tags"].get("content_hash") == content_hash:
        # The same checkpoint was already promoted (e.g. by the event-triggered deploy-model flow
        # while this run was still going): report it as deployed rather than failing the gate.
        current = server_status(cfg.stack)
        return {
            "passed": True, "reason": f"already the champion (version {champion['version']})",
            "model_name": dcfg.model_name, "val_loss": evaluation.get("val_loss"),
            "checkpoint": evaluation.get("checkpoint"), "champion_version": champion["version"],
            "champion_val_loss": champion["val_loss"], "version": int(champion["version"]), "alias": "champion",
            "content_hash": content_hash, "source": champion.get("source"),
            "endpoint": current["url"] if current and current["healthy"] else None,
            "pid": current["pid"] if current else None,
        }
    decision = gate(dcfg, evaluation, champion["val_loss"] if champion else None)
    result = {
        "passed": decision["passed"], "reason": decision["reason"], "model_name": dcfg.model_name,
        "val_loss": evaluation.get("val_loss"), "checkpoint": evaluation.get("checkpoint"),
        "champion_version": champion["version"] if champion else None,
        "champion_val_loss": champion["val_loss"] if champion else None,
        "version": None, "alias": None, "content_hash": None, "source": None, "endpoint": None, "pid": None,
    }
    log.info("deploy gate for %s: %s", evaluation.get("checkpoint"), decision["reason"])
    if decision["passed"]:
        reg = register(tracking_uri, dcfg.model_name, evaluation["checkpoint"], tokenizer_path, evaluation,
                       train_run_id)
        result.update({k: reg[k] for k in ("version", "alias", "content_hash", "source")})
        if dcfg.serve:
            served = start_or_refresh_server(cfg.stack, dcfg, evaluation["checkpoint"], tokenizer_path,
                                             dcfg.model_name)
            result.update(endpoint=served["endpoint"], pid=served["pid"])
    else:
        current = server_status(cfg.stack)
        if current and current["healthy"]:
            result.update(endpoint=current["url"], pid=current["pid"])
    return result
