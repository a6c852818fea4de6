"""MLflow's artifact store on an object store (`stack.artifacts_root: s3://bucket/prefix`).

The stack's tracking server proxies every artifact (`mlflow server --artifacts-destination <root>`,
default artifact root `mlflow-artifacts:/`): the pipeline, torchrun workers and the model server log
and download through the server over HTTP, and only the server holds the store's endpoint and
credentials:

* `server_env`: what the server gets in its environment when it is launched: stack.artifacts_options
  (storage.options' form, credentials as "${ENV_VAR}" references) resolved into MLFLOW_S3_ENDPOINT_URL,
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and AWS_DEFAULT_REGION; never written to
  its spec or log. Without options the server uses botocore's chain from its own environment.
* `client_env`: MLflow 3.17's client asks the server's /server-info whether its store presigns URLs
  (S3 does) and then downloads every artifact file (and uploads large ones) straight from the store
  with presigned URLs. That needs the store's endpoint reachable from every client (the server's may
  be a private one: 127.0.0.1 here), and a store that refuses them stalls each file for minutes in
  MLflow's chunk retries. The stack's clients keep the transfers on the server (the proxy switches
  off, unless the operator's environment sets them).
* `check`: before the server starts, the bucket check of an object-store run_root (`tasks.core.fs.check_store`)
  on artifacts_root, so a missing bucket or a refused key stops `up` within
  stack.artifacts_check_timeout naming the setting, not the first artifact upload minutes into a run.

Only the standard library is imported at module level (tasks.core.fs when the bucket is checked).
"""
from __future__ import annotations

import os

# MLflow's client switches for presigned transfers (mlflow/store/artifact/mlflow_artifacts_repo.py)
PROXY_SWITCHES = ("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD")


class ArtifactStoreError(RuntimeError):
    """stack.artifacts_root cannot be used: names the setting and what to check (never a secret)."""


def client_env() -> dict[str, str]:
    """What every client of the stack's MLflow server gets: artifact transfers through the server."""
    return {name: os.environ.get(name, "false") for name in PROXY_SWITCHES}


def server_env(stack_cfg) -> dict[str, str]:
    """The MLflow server's store settings, resolved in this process's environment (secrets included:
    for the server's process only)."""
    if not stack_cfg.artifacts_on_s3:
        return {}
    from tasks.core.fs import resolve_storage_options

    names, resolved = stack_cfg.ARTIFACT_OPTION_ENV, resolve_storage_options(stack_cfg.artifacts_options)
    return {names[k]: str(v) for k, v in stack_cfg.flat_options(resolved).items() if v is not None}


def check(stack_cfg) -> None:
    """Write and delete a probe object under stack.artifacts_root (an object store) within
    stack.artifacts_check_timeout; ArtifactStoreError naming the setting otherwise."""
    if not stack_cfg.artifacts_on_s3:
        return
    from tasks.core.fs import StorageError, check_store

    options = dict(stack_cfg.artifacts_options)
    if "endpoint_url" not in options and os.environ.get("MLFLOW_S3_ENDPOINT_URL"):
        options["endpoint_url"] = os.environ["MLFLOW_S3_ENDPOINT_URL"]  # what the server will use
    try:
        check_store(stack_cfg.artifacts_root, options, stack_cfg.artifacts_check_timeout, "stack.artifacts_root",
                    "stack.artifacts_options")
    except StorageError as e:
        raise ArtifactStoreError(str(e)) from None
