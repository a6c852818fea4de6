"""The model server as a background service of the local stack (see infra/stack.py).

`start_or_refresh_server` (re)starts `python -m infra.services.model_server` on
deploy.host:deploy.port with its pid file, spec and log under the stack's state directory, in its
own session so it outlives `crucible run`. The spec is kept after `crucible down`, so `crucible up` serves the last
deployed model again.

A refresh of a running server (deploy.reload_in_place, the default) posts the new checkpoint to its
/v1/admin/reload: requests in flight finish on the old model, nothing is dropped, and the recorded
spec is updated to the new checkpoint. Only when the server is not running, runs with different
settings, or the reload fails, is it (re)started (a few seconds without an answer on the port).

`serve_model` is what flows hand to the deploy stage (tasks.deploy.deploy_if_better's serve_model).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from infra import stack
from tasks.deploy import api_headers

SERVER_MODULE = "infra.services.model_server"
log = logging.getLogger(__name__)


def endpoint_url(deploy_cfg) -> str:
    return f"http://{stack.connect_host(deploy_cfg.host)}:{deploy_cfg.port}/v1"


def server_spec(deploy_cfg, ckpt_dir: str | Path, tokenizer_path: str | Path, model_name: str) -> stack.ServiceSpec:
    ckpt_dir, tokenizer_path = str(Path(ckpt_dir).resolve()), str(Path(tokenizer_path).resolve())
    return stack.ServiceSpec(
        name=stack.MODEL_SERVER,
        cmd=[sys.executable, "-m", SERVER_MODULE, "--checkpoint", ckpt_dir, "--tokenizer", tokenizer_path,
             "--model-name", model_name, "--host", deploy_cfg.host, "--port", str(deploy_cfg.port),
             "--threads", str(deploy_cfg.threads), "--max-tokens-limit", str(deploy_cfg.max_tokens_limit),
             "--max-n", str(deploy_cfg.max_n), "--max-batch", str(deploy_cfg.max_batch)]
            + (["--api-key-env", deploy_cfg.api_key_env] if deploy_cfg.api_key_env else []),
        host=deploy_cfg.host, port=deploy_cfg.port, health_path="/health", url=endpoint_url(deploy_cfg),
        marker=[SERVER_MODULE],
        # importable even if the repo is not pip-installed; the server runs from the state dir
        env={"PYTHONPATH": stack.repo_pythonpath(), "PYTHONUNBUFFERED": "1"},
        info={"model_name": model_name, "checkpoint": ckpt_dir, "tokenizer": tokenizer_path,
              "requires": [ckpt_dir, tokenizer_path]},
    )


def serve_model(cfg, checkpoint_dir: str | Path, tokenizer_path: str | Path, model_name: str) -> dict:
    """Serve `checkpoint_dir` as the stack's model server, per the config's `stack` and `deploy`
    sections: start_or_refresh_server's {"endpoint", "pid", "log", "seconds", "reloaded"}."""
    return start_or_refresh_server(cfg.stack, cfg.deploy, checkpoint_dir, tokenizer_path, model_name)


def start_or_refresh_server(stack_cfg, deploy_cfg, ckpt_dir: str | Path, tokenizer_path: str | Path,
                            model_name: str, timeout: float | None = None) -> dict:
    """(Re)start the model server for this checkpoint and wait until GET /health answers.

    Returns {"endpoint": "http://127.0.0.1:8600/v1", "pid": int, "log": path, "seconds": float}.
    Raises infra.stack.StackError (with the server's log tail) if it does not become healthy.
    """
    spec = server_spec(deploy_cfg, ckpt_dir, tokenizer_path, model_name)
    for p in spec.info["requires"]:
        if not Path(p).exists():
            raise FileNotFoundError(f"cannot serve {model_name}: {p} does not exist")
    with stack.stack_lock(stack_cfg):
        if getattr(deploy_cfg, "reload_in_place", False):
            reloaded = _reload_in_place(stack_cfg, deploy_cfg, spec)
            if reloaded is not None:
                return reloaded
        res = stack.start_services(stack_cfg, [spec], timeout=timeout, restart=True)[stack.MODEL_SERVER]
    return {"endpoint": spec.url, "pid": res["pid"], "log": str(stack.log_path(stack_cfg, stack.MODEL_SERVER)),
            "seconds": res["seconds"], "reloaded": False}


def _settings(cmd: list[str]) -> list[str]:
    """The command line without the checkpoint and tokenizer values: what a reload cannot change."""
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a in ("--checkpoint", "--tokenizer"):
            skip = True
            continue
        out.append(a)
    return out


def _reload_in_place(stack_cfg, deploy_cfg, spec: stack.ServiceSpec) -> dict | None:
    """POST the new checkpoint to the running server; None if it cannot be reloaded in place."""
    import httpx

    pid = stack.running_pid(stack_cfg, stack.MODEL_SERVER)
    old = stack.read_spec(stack_cfg, stack.MODEL_SERVER)
    if pid is None or old is None or _settings(old.cmd) != _settings(spec.cmd):
        return None
    headers = api_headers(deploy_cfg)
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{spec.url}/admin/reload", headers=headers, timeout=300, trust_env=False,
                       json={"checkpoint": spec.info["checkpoint"], "tokenizer": spec.info["tokenizer"]})
    except httpx.HTTPError as e:
        log.warning("reload in place failed (%s); restarting the model server", e)
        return None
    if r.status_code != 200:
        log.warning("reload in place refused (%s %s); restarting the model server", r.status_code, r.text[:300])
        return None
    stack.write_spec(stack_cfg, spec)  # record the new checkpoint, so `crucible up` after a restart serves it
    return {"endpoint": spec.url, "pid": pid, "log": str(stack.log_path(stack_cfg, stack.MODEL_SERVER)),
            "seconds": round(time.perf_counter() - t0, 3), "reloaded": True}


def server_status(stack_cfg) -> dict | None:
    """{url, healthy, pid} of the model server, or None if no model has been deployed."""
    return stack.status(stack_cfg).get(stack.MODEL_SERVER)
