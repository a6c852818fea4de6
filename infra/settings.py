"""The stack's settings: its ports and state, the databases behind Prefect and MLflow, the Ray
cluster it supervises and the lineage service (with where lineage events go). They sit in the same
YAML file as the stage layer's sections: `CrucibleConfig` is the whole file, `tasks.config.PipelineConfig`
plus the `stack` and `lineage` sections (tasks.config.INFRA_SECTIONS), validated here; the stage
layer never sees them (tasks/ does not import infra/). `load_config` reads that one file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tasks.config import PipelineConfig, Section, literal_secret_options
from tasks.config import load_config as load_file
from tasks.core.constants import LINEAGE_NAMESPACE


class StackConfig(Section):
    state_dir: str = ".crucible"  # relative to the working directory unless absolute
    host: str = "127.0.0.1"
    prefect_port: int = Field(default=4200, gt=0, lt=65536)
    mlflow_port: int = Field(default=5000, gt=0, lt=65536)
    mlflow_workers: int = Field(default=1, gt=0)  # uvicorn workers of the MLflow server
    # the event-triggered evaluate/deploy deployments, run by the stack's worker; false: they are not
    # registered, and checkpoints are evaluated only by the pretrain flow itself
    triggers: bool = True
    # the Prefect worker of the stack's `process` work pool: its health webserver's port, and how many
    # flow runs it runs at once (a pretrain or continue-pretraining run holds one for its whole run while
    # the evaluations it waits for take others)
    worker_port: int = Field(default=8610, gt=0, lt=65536)
    worker_limit: int = Field(default=6, ge=2)
    # a failed event-triggered evaluation is retried this often, with exponential backoff (seconds)
    eval_retries: int = Field(default=2, ge=0)
    eval_retry_backoff: float = Field(default=10.0, gt=0)
    # how long the pretrain flow's evaluate (or deploy) subflow waits on its triggered flow runs, all of them
    # together, before cancelling those not final and doing their work itself (flows/triggered_runs.py)
    triggered_timeout: float = Field(default=1800.0, gt=0)
    # Ray: "local" (each run starts its own in-process Ray) or "cluster" (`crucible up --ray`): a
    # head (`ray start --head`, ray_head_cpus CPUs, GCS on ray_port) plus ray_workers worker nodes
    # (named worker-1, ...; ray_worker_cpus CPUs each, default the machine's CPUs shared out),
    # supervised as services; a run attaches to it while it is up (infra/stack.py)
    ray: Literal["local", "cluster"] = "local"
    ray_port: int = Field(default=6380, gt=0, lt=65536)
    # Ray Client (ray://host:port); not in 10002-19999, the ports of Ray's workers
    ray_client_port: int = Field(default=10001, gt=0, lt=65536)
    ray_agent_port: int = Field(default=52465, gt=0, lt=65000)  # head's health endpoint; worker i: + i (not Ray's own 52365, which every local ray.init takes)
    ray_workers: int = Field(default=2, ge=1, le=64)
    ray_head_cpus: int = Field(default=0, ge=0)  # 0: the head only coordinates; the workers run tasks
    ray_worker_cpus: int | None = Field(default=None, gt=0)
    ray_object_store_mb: int = Field(default=512, ge=80)  # per node (Ray's minimum is ~75 MB)
    start_timeout: float = Field(default=180.0, gt=0)  # seconds for a service to become healthy
    stop_timeout: float = Field(default=15.0, gt=0)  # seconds between SIGTERM and SIGKILL
    # where Prefect's server and MLflow's tracking store keep their state (infra/database.py):
    # SQLite files in the state directory, or PostgreSQL (databases `prefect` and `mlflow`)
    database: Literal["sqlite", "postgres"] = "sqlite"
    # postgres: a cluster `crucible up` creates under <state_dir>/postgres and runs on 127.0.0.1:postgres_port,
    # as postgres_os_user when crucible runs as root (PostgreSQL refuses to run as root) ...
    postgres_port: int = Field(default=5433, gt=0, lt=65536)  # beside a system PostgreSQL on 5432 (Debian's main cluster)
    postgres_os_user: str = "postgres"
    # ... or an existing server, postgresql://user@host:port (its password from PGPASSWORD or PGPASSFILE)
    postgres_url: str | None = Field(default=None, pattern=r"^postgres(ql)?://")
    database_timeout: float = Field(default=10.0, gt=0)  # seconds to reach PostgreSQL before `up` fails
    # MLflow's artifact store (a local path or a URI such as s3://bucket/mlflow); None: <state_dir>/mlflow/artifacts.
    # The tracking server alone reads and writes it; clients go through the server (infra/artifact_store.py)
    artifacts_root: str | None = None
    # an s3:// artifacts_root's options, in storage.options' form: endpoint_url, credentials only as
    # "${ENV_VAR}" references (resolved into the server's environment when it starts, never stored);
    # {}: the server's own environment (AWS_ACCESS_KEY_ID, MLFLOW_S3_ENDPOINT_URL, AWS_PROFILE, ...)
    artifacts_options: dict[str, Any] = {}
    artifacts_check_timeout: float = Field(default=20.0, gt=0)  # the bucket check before MLflow starts
    # each option an s3:// artifacts_root takes and the server's environment variable it becomes
    ARTIFACT_OPTION_ENV: ClassVar[dict[str, str]] = {
        "endpoint_url": "MLFLOW_S3_ENDPOINT_URL", "key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY",
        "token": "AWS_SESSION_TOKEN", "client_kwargs.region_name": "AWS_DEFAULT_REGION"}

    @field_validator("postgres_url")
    @classmethod
    def _no_password_in_url(cls, url: str | None) -> str | None:
        from urllib.parse import urlsplit

        if url and urlsplit(url).password is not None:  # the URL goes into service specs, logs and MLflow params
            raise ValueError("holds a password: give it in PGPASSWORD or a PGPASSFILE instead")
        return url

    @staticmethod
    def flat_options(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """{"client_kwargs": {"region_name": r}} -> {"client_kwargs.region_name": r} (ARTIFACT_OPTION_ENV's keys)."""
        out: dict[str, Any] = {}
        for name, value in options.items():
            is_dict = isinstance(value, dict)
            out.update(StackConfig.flat_options(value, f"{prefix}{name}.") if is_dict else {prefix + name: value})
        return out

    @field_validator("artifacts_options")
    @classmethod
    def _artifact_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(cls.flat_options(v)) - set(cls.ARTIFACT_OPTION_ENV))
        if unknown:  # each option becomes an environment variable of the server: no others have one
            raise ValueError(f"unsupported {unknown}; the options are {sorted(cls.ARTIFACT_OPTION_ENV)}")
        bad = literal_secret_options(v)
        if bad:
            raise ValueError(f"credentials must be \"${{ENV_VAR}}\" references, not literals: {bad}")
        return v

    @property
    def artifacts_on_s3(self) -> bool:
        """MLflow's artifacts on an object store (infra/artifact_store.py)."""
        return (self.artifacts_root or "").startswith("s3://")

    @model_validator(mode="after")
    def _options_need_s3(self) -> "StackConfig":
        if self.artifacts_options and not self.artifacts_on_s3:
            raise ValueError("stack.artifacts_options apply to an s3:// stack.artifacts_root only")
        return self


class LineageConfig(Section):
    namespace: str = LINEAGE_NAMESPACE  # of the jobs; the deploy stage tags model versions with it
    producer: str = "https://github.com/crucible-ml/crucible"
    service_host: str = "127.0.0.1"  # the lineage service (python -m infra.services.lineage)
    service_port: int = Field(default=5055, gt=0, lt=65536)
    service_db: str = "lineage.db"  # SQLite store; relative to stack.state_dir unless absolute
    replay_batch_size: int = Field(default=500, gt=0)  # events per POST when replaying a lineage.jsonl
    # Events always go to runs/<run>/lineage.jsonl (the record); also over HTTP, best effort, to
    # http_url (e.g. Marquez, http://127.0.0.1:9000) or, when unset, to the stack's lineage service.
    http_enabled: bool = True
    http_url: str | None = Field(default=None, pattern=r"^https?://")
    http_timeout: float = Field(default=5.0, gt=0)  # seconds per HTTP request
    owner: str | None = "team:crucible"  # `ownership` facet of jobs and produced datasets; null: none
    # reads of the lineage service: public (the auditors' page works) or only with the read token
    # (a 0600 file in the state directory; API clients only). Writes always need the write token.
    public_reads: bool = True


class CrucibleConfig(PipelineConfig):
    """The user's whole YAML file: the stage layer's sections and the stack's."""

    stack: StackConfig = StackConfig()
    lineage: LineageConfig = LineageConfig()


def load_config(path: str | Path, overrides: list[str] | None = None) -> CrucibleConfig:
    """The YAML file at `path` with `overrides` (`a.b=value`), every section validated; raises
    tasks.config.ConfigError naming each bad field by its path (e.g. `stack.prefect_port`)."""
    return load_file(path, overrides, model=CrucibleConfig)
