"""Fixtures shared by several test files: a local Ray session, and the language-model artifacts
(tokenizer, tokens, training run) that tests/lm_helpers.py builds once per session under one folder."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# One signing key for the whole test session (tasks/core/signing.py), outside the repository: the
# records a test signs in process and those the stacks it starts sign agree (infra/stack.py
# signing_key_file keeps a key the starting process already has). A test of a forged record signs
# it with another key, or none.
os.environ.setdefault("CRUCIBLE_SIGNING_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="crucible-key-"), "signing.key"))
# Likewise one MLflow login (infra/stack.py mlflow_password_file keeps the starting process's): the
# stacks the tests start ask for it, and this process's own MLflow clients (reading a stack's runs and
# registry after a `crucible run`) send it through the request-auth plugin (tasks/tracking/auth.py).
os.environ.setdefault("CRUCIBLE_MLFLOW_PASSWORD_FILE", os.path.join(os.path.dirname(os.environ["CRUCIBLE_SIGNING_KEY_FILE"]),
                                                                    "mlflow-password"))
os.environ.setdefault("MLFLOW_TRACKING_AUTH", "crucible")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The folder where lm_helpers caches the session's corpus, tokenizer, tokens and training run."""
    return tmp_path_factory.getbasetemp() / "lm"


@pytest.fixture(scope="module")
def run(base) -> dict:
    """The session's real 2-process training run of lm_helpers.tiny_cfg() (built on first use)."""
    from lm_helpers import training_run

    return training_run(base)


@pytest.fixture(scope="module")
def ray_session():
    """A local 2-CPU Ray cluster for one test module."""
    import ray

    from tasks.config import RayConfig
    from tasks.core.ray_utils import init_ray

    init_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()
