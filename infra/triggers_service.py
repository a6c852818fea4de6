"""The event-triggered evaluate/deploy process (flows/triggers.py) as a service of the local stack.

`triggers_spec(stack_cfg)` describes `python -m flows.triggers serve --webserver`: prefect's
`serve` of the deployments evaluate-checkpoint and deploy-model, whose runs talk to this stack's
Prefect and MLflow (infra.stack.client_env). Its health check is the runner's own webserver
(GET /health answers 200 while the runner polls the Prefect API; PREFECT_RUNNER_SERVER_*).

Registered in infra/stack.py like the other core services (see the lead's note in the issue-6
report): started after Prefect and MLflow, stopped before them.
"""
from __future__ import annotations

import os
import sys

from infra import stack

TRIGGERS = "triggers"
DEFAULT_PORT = 8610  # the runner webserver (health only)


def triggers_spec(stack_cfg, lineage_cfg=None, port: int | None = None) -> stack.ServiceSpec:
    host = stack_cfg.host
    port = port or getattr(stack_cfg, "triggers_port", DEFAULT_PORT)
    env = {
        **stack.client_env(stack_cfg, lineage_cfg),
        "PYTHONPATH": os.pathsep.join(p for p in (str(stack.REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
        "PREFECT_RUNNER_SERVER_ENABLE": "true",
        "PREFECT_RUNNER_SERVER_HOST": host,
        "PREFECT_RUNNER_SERVER_PORT": str(port),
        # a triggered run waits up to one poll for the runner to pick it up (Prefect's default: 10 s)
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        # /health turns 503 after this many missed polls; at 2 s a poll, the default (2) calls a
        # runner dead when the Prefect server is merely slow for 4 s (a loaded machine). The cost:
        # a runner that really hangs shows as unhealthy only after 60 s
        "PREFECT_RUNNER_SERVER_MISSED_POLLS_TOLERANCE": "30",
        "PREFECT_HOME": str(stack.state_dir(stack_cfg) / "prefect-client"),
    }
    return stack.ServiceSpec(
        name=TRIGGERS,
        cmd=[sys.executable, "-m", "flows.triggers", "serve", "--webserver"],
        host=host, port=port, health_path="/health", url=stack.prefect_ui_url(stack_cfg) + "/deployments",
        marker=["flows.triggers", "serve"], env=env,
        info={"deployments": ["evaluate-checkpoint/evaluate-checkpoint", "deploy-model/deploy-model"],
              "events": ["crucible.checkpoint.saved", "crucible.eval.completed"]},
    )
