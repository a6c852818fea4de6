"""The stack's Prefect deployments, registered to a work pool whose worker runs them.

    python -m flows.deployments [--config CONFIG [--set KEY=VALUE ...]] [--no-triggers] [--pool NAME]

`crucible up` runs this (infra/stack.py) against its Prefect server, for its `process` work pool
`crucible` (created here if missing), whose worker, the stack's service `worker`, runs them:

    deployment                                   entrypoint                                runs
    pretrain/pretrain                            flows.pretrain.pretrain                   on demand: the UI's Run, the API
    evaluate-checkpoint/evaluate-checkpoint      flows.triggers.evaluate_checkpoint_flow   on crucible.checkpoint.saved
    deploy-model/deploy-model                    flows.triggers.deploy_model_flow          on crucible.eval.completed (passed)
    continue-pretraining/continue-pretraining    flows.continued.continue_pretraining      on continue.schedule (cron)

pretrain and continue-pretraining take CONFIG (resolved, as JSON) as their `config` parameter, so
a Run with the defaults runs the pipeline on it; continue-pretraining is registered when CONFIG
sets continue.schedule. The event-triggered two are registered unless --no-triggers
(stack.triggers: false), which removes them, so the worker never evaluates a checkpoint the
pretrain flow evaluates itself.

Entrypoints are module paths: a flow run imports its flow from the package (the process worker has
the repository on its PYTHONPATH; a Kubernetes worker's image has it installed), so nothing is
pulled or copied and the same deployments run on infra/k8s's `crucible-kubernetes` pool
(`--pool crucible-kubernetes`; that pool is created by its worker's init container). On a
`process` pool each deployment also gets a working directory (job variable `working_dir`; the
worker's default is a temporary directory, removed after the run): the state directory for the
event-triggered flows, this process's for the two taking CONFIG, so its relative paths (run_root)
mean what they mean to `crucible run`, and the command `python -m prefect.engine` (this
interpreter), so each run stays in the worker's process group. While the stack's Ray cluster runs,
CONFIG gets its address and those runs its token's environment (job variable `env`), as `crucible
run` does.

Prints {"pool", "registered": {deployment: id}, "removed": [deployment, ...]} as JSON.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from infra.settings import StackConfig, load_config
from tasks.config import ConfigError, PipelineConfig
from tasks.core.constants import EVENT_DEPLOYMENTS, PRETRAIN_FLOW, WORK_POOL


def ensure_work_pool(name: str = WORK_POOL) -> str:
    """The type of work pool `name`. The stack's own pool is created as a `process` pool with
    Prefect's default template if it does not exist; any other must exist already."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(name).type
        except ObjectNotFound:
            if name != WORK_POOL:
                raise SystemExit(f"work pool {name!r} does not exist: create it first (infra/k8s: the "
                                 "prefect-worker's init container creates crucible-kubernetes)") from None
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=ProcessWorker.type,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:  # another `crucible up` created it meanwhile
            pass
        return client.read_work_pool(name).type


def pretrain_deployment(cfg: PipelineConfig, job_variables: dict | None = None):
    """The pretrain flow on demand, `cfg` its default `config`."""
    from prefect.types.entrypoint import EntrypointType

    from flows.pretrain import pretrain

    return pretrain.to_deployment(
        name=PRETRAIN_FLOW, entrypoint_type=EntrypointType.MODULE_PATH, tags=["crucible"],
        parameters={"config": cfg.model_dump(mode="json")}, job_variables=job_variables,
        description=f"The whole pipeline on config {cfg.name!r} (run_root {cfg.run_root}): curate, tokenizer, "
                    "token shards, training, evaluation, gated deployment. Run it with the default parameters, "
                    "the config `crucible up` registered, or edit `config` in the run form.")


def _delete(client, name: str) -> bool:
    """Remove a deployment and the automations of its triggers; False if there was none."""
    from prefect.exceptions import ObjectNotFound

    try:
        deployment = client.read_deployment_by_name(name)
    except ObjectNotFound:
        return False
    client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
    client.delete_deployment(deployment.id)
    return True


def register(cfg: PipelineConfig | None, triggers: bool = True, pool: str = WORK_POOL) -> dict:
    """Register the deployments (module docstring) to `pool` against PREFECT_API_URL."""
    from prefect.client.orchestration import get_client

    from flows.continued import build_deployment
    from flows.triggers import build_deployments
    from infra import stack

    process = ensure_work_pool(pool) == "process"

    def job_variables(working_dir: Path, env: dict[str, str] | None = None) -> dict:
        if not process:
            return {}
        # an explicit command keeps each flow run (and what it starts: Ray, torchrun) in the worker's
        # process group, which `crucible down` stops as a whole; without one the worker puts each run
        # in a session of its own, and Ray's agents outlive a stopped stack
        return {"working_dir": str(working_dir), "command": shlex.join([sys.executable, "-m", "prefect.engine"]),
                **({"env": env} if env else {})}

    deployments, removed = [], []
    if triggers:  # the state dir: $CRUCIBLE_STATE_DIR when the stack runs this, else the config's
        deployments += build_deployments(job_variables(stack.state_dir(cfg.stack if cfg else StackConfig())))
    else:
        with get_client(sync_client=True) as client:
            removed = [name for name in EVENT_DEPLOYMENTS if _delete(client, name)]
    if cfg is not None:
        cfg = cfg.model_copy(deep=True)
        env = stack.attach_cluster(cfg)  # while the stack's Ray cluster runs, as `crucible run` does
        deployments.append(pretrain_deployment(cfg, job_variables(Path.cwd(), env)))
        if cfg.continue_.schedule:
            deployments.append(build_deployment(cfg, job_variables(Path.cwd(), env)))
    registered = {f"{d.flow_name}/{d.name}": str(d.apply(work_pool_name=pool)) for d in deployments}
    return {"pool": pool, "registered": registered, "removed": removed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.deployments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="CONFIG", help="pipeline config of the pretrain (and continue) deployment")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a value of CONFIG (repeatable)")
    ap.add_argument("--no-triggers", dest="triggers", action="store_false",
                    help="remove the event-triggered deployments instead of registering them")
    ap.add_argument("--pool", default=WORK_POOL,
                    help=f"work pool (default {WORK_POOL}, the stack's: created as a process pool if missing)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides) if args.config else None
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(register(cfg, triggers=args.triggers, pool=args.pool)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
