"""MLflow request-auth plugin `crucible`: the stack's MLflow login for every MLflow client.

The stack's tracking server runs MLflow's `basic-auth` app (infra/stack.py `mlflow_spec`). Its clients
(`crucible run`, the worker's flow runs, torchrun workers, the model server's reload) get
MLFLOW_TRACKING_AUTH=crucible and $CRUCIBLE_MLFLOW_PASSWORD_FILE, the path of the stack's 0600
password file, in their environment (infra/stack.py `client_env`); MLflow then asks this plugin
(registered under the entry point group `mlflow.request_auth_provider`, pyproject.toml) for each
request's auth, and it answers with HTTP Basic for user MLFLOW_USERNAME read from that file. MLflow's
own MLFLOW_TRACKING_PASSWORD would put the password itself in every environment and spec, and its
~/.mlflow/credentials has a fixed path: one per user, not per stack.

Stdlib only at import (MLflow's registry calls get_name/get_auth and nothing else; requests is
imported when a request needs auth), so infra/stack.py stays fast to import.
"""
from __future__ import annotations

import os
from pathlib import Path

from tasks.core.constants import MLFLOW_AUTH_PROVIDER, MLFLOW_PASSWORD_FILE_ENV, MLFLOW_USERNAME


class MlflowLoginError(RuntimeError):
    """The stack's MLflow login cannot be read: says which file and setting."""


def read_password(path: str | Path) -> str:
    try:
        password = Path(path).read_text().strip()
    except OSError as e:
        raise MlflowLoginError(f"the stack's MLflow password file {path} (${MLFLOW_PASSWORD_FILE_ENV}) cannot be "
                               f"read: {e.strerror or e}") from None
    if not password:
        raise MlflowLoginError(f"the stack's MLflow password file {path} (${MLFLOW_PASSWORD_FILE_ENV}) is empty")
    return password


class CrucibleAuthProvider:
    """mlflow.tracking.request_auth.RequestAuthProvider for MLFLOW_TRACKING_AUTH=crucible."""

    def get_name(self) -> str:
        return MLFLOW_AUTH_PROVIDER

    def get_auth(self):
        from requests.auth import HTTPBasicAuth

        path = os.environ.get(MLFLOW_PASSWORD_FILE_ENV)
        if not path:  # a request without the login would only get MLflow's 401: say what is missing
            raise MlflowLoginError(f"MLFLOW_TRACKING_AUTH={MLFLOW_AUTH_PROVIDER} needs ${MLFLOW_PASSWORD_FILE_ENV}, the "
                                   "stack's MLflow password file (infra/stack.py client_env sets both)")
        # read for each request: a stack restarted with a new login is followed without a restart here
        return HTTPBasicAuth(MLFLOW_USERNAME, read_password(path))
