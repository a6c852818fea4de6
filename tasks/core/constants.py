"""Names shared across layers: the repository root, Prefect event names and deployment names.

Stage logic, flows, the stack and the services all read them from here, so an event emitted by
training and the trigger that waits for it can never disagree."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# set by `crucible run` for the flow process: the stack's lineage service, where events also go
LINEAGE_URL_ENV = "CRUCIBLE_LINEAGE_URL"
# the lineage service's write token: the token itself, or (what the stack hands its processes, so
# the secret never sits in an environment listing or spec file) the path of a 0600 file holding it
LINEAGE_TOKEN_ENV = "CRUCIBLE_LINEAGE_TOKEN"
LINEAGE_TOKEN_FILE_ENV = "CRUCIBLE_LINEAGE_TOKEN_FILE"
# the stack's MLflow login (user MLFLOW_USERNAME): the path of a 0600 file holding its password, read
# by the request-auth plugin MLFLOW_TRACKING_AUTH=crucible names (tasks/tracking/auth.py), so no
# password sits in an environment
MLFLOW_PASSWORD_FILE_ENV = "CRUCIBLE_MLFLOW_PASSWORD_FILE"
MLFLOW_USERNAME = "crucible"
MLFLOW_AUTH_PROVIDER = "crucible"

# Prefect events (resource ids: crucible.checkpoint.<run>.<step>, crucible.eval.<run>.<step>, ...)
CHECKPOINT_EVENT = "crucible.checkpoint.saved"
EVAL_EVENT = "crucible.eval.completed"
DEPLOYED_EVENT = "crucible.model.deployed"
SPIKE_EVENT = "crucible.train.spike"

# Event-triggered flows; each is deployed under its own name, so the deployment's full
# reference is "<flow>/<deployment>".
EVAL_FLOW = "evaluate-checkpoint"
DEPLOY_FLOW = "deploy-model"
EVAL_DEPLOYMENT = f"{EVAL_FLOW}/{EVAL_FLOW}"
DEPLOY_DEPLOYMENT = f"{DEPLOY_FLOW}/{DEPLOY_FLOW}"
EVENT_DEPLOYMENTS = (EVAL_DEPLOYMENT, DEPLOY_DEPLOYMENT)  # registered unless stack.triggers is off
# scheduled continued pretraining (flows/continued.py): the flow and its deployment
CONTINUE_FLOW = "continue-pretraining"
CONTINUE_DEPLOYMENT = f"{CONTINUE_FLOW}/{CONTINUE_FLOW}"
# the pretrain flow (flows/pretrain.py), also deployed under its own name: run on demand (the
# Prefect UI's Run, the API)
PRETRAIN_FLOW = "pretrain"
# the curation alone (flows/curation.py, `crucible curate`): the pretrain flow's curate subflow
CURATION_FLOW = "curation"
# the local stack's `process` work pool: its worker (infra/stack.py) runs every deployment above
WORK_POOL = "crucible"
# the OpenLineage namespace of Crucible's jobs unless lineage.namespace says otherwise (infra/settings.py)
LINEAGE_NAMESPACE = "crucible"
